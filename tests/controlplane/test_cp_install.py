"""Issue 5's must-show flow, end to end, as a user runs it: `helm install` the chart,
`kubectl apply -f examples/weightcache.yaml`, `kubectl apply -f
examples/engine-deployment.yaml`, then delete them again - against the real control
plane, with the node simulator running the chart's operator pods, the operator's daemon
DaemonSet and the engine pods (agent sidecar included) as local processes.

The chart and the example files are used unchanged; the only setup a user would do by
hand too is putting the model on every node (examples/weightcache.yaml, step 2): the
packaged all-MiniLM-L6-v2 is copied to each fake node's root at the examples' path.

One module-scoped release and application namespace serve the tests in order (an
install is the expensive part); each test checks one promise of the issue, and its
assertions say which.

Short names on purpose: a daemon's socket is <node_root>/run/weightcache/<namespace>/
<cache>/<cache>__cpu__<digest12>.sock, and a Unix socket path must fit in 107 bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from cluster import wait_for
from procs import http
from cluster.procs import free_port
from cluster.testkit import condition, container_status, is_ready, ready_now, wait_object
from weightcache.demo import packaged_model_dir
from weightcache.operator.manifests import daemonset_name, node_label_key

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "weightcache"
CACHE_YAML = ROOT / "examples" / "weightcache.yaml"
ENGINE_YAML = ROOT / "examples" / "engine-deployment.yaml"
EXAMPLE_CACHE = yaml.safe_load(CACHE_YAML.read_text())
EXAMPLE_ENGINE = yaml.safe_load(ENGINE_YAML.read_text())
CACHE = EXAMPLE_CACHE["metadata"]["name"]  # minilm
MODEL = EXAMPLE_CACHE["spec"]["model"]["path"]  # /var/lib/weightcache/models/all-MiniLM-L6-v2
ENGINE = EXAMPLE_ENGINE["metadata"]["name"]  # minilm-engine
ENGINE_SELECTOR = ",".join(f"{k}={v}" for k, v in EXAMPLE_ENGINE["spec"]["selector"]["matchLabels"].items())
ENGINE_PORT = EXAMPLE_ENGINE["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
REPLICAS = EXAMPLE_ENGINE["spec"]["replicas"]
WEIGHTCACHE = str(Path(sys.executable).with_name("weightcache"))
AGENT_PORT, DAEMON_PORT = 9401, 9400
REPORT_FILE = "/run/weightcache-report/engine.json"
SENTENCES = ["The operator keeps the weights resident; engines map them.", "Hello, world."]

# Every wait is generous: the machine has two cores shared with other test sessions.
pytestmark = pytest.mark.timeout(900)


def wait(check, timeout: float, what: str):
    """wait_for at a pace that leaves the cores to the cluster (each poll is a kubectl)."""
    return wait_for(check, timeout, what, interval=0.5)


def example_cache(name: str = CACHE, path: str = MODEL, **spec) -> dict:
    """examples/weightcache.yaml, renamed or changed where a test needs another cache."""
    manifest = json.loads(json.dumps(EXAMPLE_CACHE))
    manifest["metadata"]["name"] = name
    manifest["spec"]["model"]["path"] = path
    manifest["spec"].update(spec)
    return manifest


# -- the release and the application namespace ---------------------------------------------
class Flow:
    """The installed chart (release RELEASE in RELEASE_NS) and the user's namespace NS."""

    def __init__(self, cluster, release: str, release_ns: str, ns: str, work: Path) -> None:
        self.cluster, self.release, self.release_ns, self.ns, self.work = cluster, release, release_ns, ns, work

    # kubectl as the user types it
    def kubectl(self, *args, **kw):
        return self.cluster.kubectl(*args, "-n", self.ns, **kw)

    def apply_file(self, path: Path, check: bool = True):
        return self.kubectl("apply", "-f", str(path), check=check)

    def apply_manifest(self, manifest: dict, check: bool = True):
        path = self.work / f"{manifest['metadata']['name']}-{uuid.uuid4().hex[:4]}.yaml"
        path.write_text(yaml.safe_dump(manifest))
        return self.apply_file(path, check=check)

    def get(self, kind: str, name: str) -> dict | None:
        r = self.kubectl("get", kind, name, "-o", "json", check=False)
        if r.returncode == 0:
            return json.loads(r.stdout)
        assert "NotFound" in r.stderr, r.stderr
        return None

    # the operator's side
    def operator_pods(self) -> list[dict]:
        return self.cluster.kubectl_json("get", "pods", "-n", self.release_ns, "-l",
                                         f"app.kubernetes.io/instance={self.release},"
                                         "app.kubernetes.io/component=operator")["items"]

    def operator_logs(self) -> str:
        out = []
        for p in self.operator_pods():
            path = self.cluster.pod_log(self.release_ns, p["metadata"]["name"], "operator")
            out.append(f"--- {p['metadata']['name']}:\n" + (path.read_text()[-3000:] if path.exists() else "(none)"))
        return "\n".join(out)

    def operator_deployment(self) -> dict:
        return self.cluster.kubectl_json("get", "deployment", f"{self.release}-operator", "-n", self.release_ns)

    # the cache's side
    def wc(self, name: str = CACHE) -> dict | None:
        return self.get("wc", name)

    def wait_wc(self, name: str, check, what: str, timeout: float = 300) -> dict:
        return wait_object(lambda: self.wc(name), check, f"WeightCache {self.ns}/{name} {what}", timeout,
                           detail=self.operator_logs)

    @property
    def daemons_ns(self) -> str:
        """The chart's namespace for every cache's daemons (daemons.namespace's default)."""
        return f"{self.release}-daemons"

    def daemonset(self, name: str = CACHE) -> dict | None:
        r = self.cluster.kubectl("get", "ds", daemonset_name(self.ns, name), "-n", self.daemons_ns, "-o", "json",
                                 check=False)
        if r.returncode == 0:
            return json.loads(r.stdout)
        assert "NotFound" in r.stderr, r.stderr
        return None

    def daemon_pods(self, name: str = CACHE) -> list[dict]:
        return self.cluster.kubectl_json("get", "pods", "-n", self.daemons_ns, "-l",
                                         f"app.kubernetes.io/name=weightcache-daemon,weightcache.io/cache={name},"
                                         f"weightcache.io/cache-namespace={self.ns}")["items"]

    def engine_pods(self) -> list[dict]:
        return self.kubectl_json("get", "pods", "-l", ENGINE_SELECTOR)["items"]

    def kubectl_json(self, *args) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def labelled_nodes(self, name: str = CACHE) -> set[str]:
        key = node_label_key(self.ns, name)
        return {n["metadata"]["name"] for n in self.cluster.kubectl_json("get", "nodes")["items"]
                if (n["metadata"].get("labels") or {}).get(key) == "ready"}

    def sockets(self, node: str, name: str = CACHE) -> list[Path]:
        return sorted((self.cluster.node_root(node) / "run/weightcache" / self.ns / name).glob("*.sock"))

    def events(self, name: str, reason: str) -> list[dict]:
        return self.kubectl_json("get", "events", "--field-selector",
                                 f"involvedObject.name={name},involvedObject.kind=WeightCache,reason={reason}")["items"]


def put_model_on_every_node(cluster) -> None:
    """The user's step 2 of examples/weightcache.yaml: the model at spec.model.path on each node."""
    for node in cluster.nodes:
        dest = cluster.node_root(node) / MODEL.lstrip("/")
        shutil.copytree(packaged_model_dir(), dest, dirs_exist_ok=True)


def force_cleanup(flow: Flow) -> list[str]:
    """Teardown, also after a failure: caches (forced), engines, and what they left.
    Returns what could not be cleaned the proper way."""
    problems = []
    c, ns = flow.cluster, flow.ns
    c.kubectl("delete", "deployment", ENGINE, "-n", ns, "--wait=false", "--ignore-not-found", check=False)
    items = json.loads(c.kubectl("get", "wc", "-n", ns, "-o", "json", check=False).stdout or '{"items": []}')["items"]
    if not items:
        return problems
    for item in items:
        name = item["metadata"]["name"]
        c.kubectl("annotate", "wc", name, "-n", ns, "weightcache.io/force-delete=true", "--overwrite", check=False)
        c.kubectl("delete", "wc", name, "-n", ns, "--wait=false", check=False)
    try:
        wait(lambda: not c.kubectl_json("get", "wc", "-n", ns)["items"], 180, "the caches to be finalized")
    except TimeoutError as e:
        # The operator could not finalize them: drop the finalizers so the namespace can go.
        problems.append(str(e))
        for item in c.kubectl_json("get", "wc", "-n", ns)["items"]:
            c.kubectl("patch", "wc", item["metadata"]["name"], "-n", ns, "--type=merge",
                      "-p", '{"metadata": {"finalizers": null}}', check=False)
    return problems


@pytest.fixture(scope="module")
def flow(cluster, tmp_path_factory):
    """The chart installed as its README says (`helm install ... --create-namespace`), and a
    privileged namespace for the user's cache and engines. Everything is removed at the
    end, also after a failure: the caches (force-deleted if the flow left engines), the
    release (its webhook configuration must not outlive the session's other tests), and
    both namespaces."""
    tag = uuid.uuid4().hex[:4]
    release, release_ns, ns = f"wc{tag}", f"wcs-{tag}", f"wca-{tag}"
    put_model_on_every_node(cluster)
    cluster.create_namespace(ns)
    flow = Flow(cluster, release, release_ns, ns, tmp_path_factory.mktemp("install"))
    try:
        cluster.helm("install", release, CHART, "--namespace", release_ns, "--create-namespace", timeout=240)
        yield flow
    finally:
        problems = []
        try:
            problems = force_cleanup(flow)
        finally:
            cluster.helm("uninstall", release, "--namespace", release_ns, "--wait", "--timeout", "120s",
                         check=False, timeout=180)
            # The daemons' namespace is kept by helm uninstall (it may hold daemons engines use).
            for name in (ns, release_ns, flow.daemons_ns):
                cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)
        assert not problems, problems


# -- 1. the chart ----------------------------------------------------------------------------
def test_1_helm_install_runs_the_operator_deployment(flow):
    c = flow.cluster
    r = c.kubectl("rollout", "status", f"deployment/{flow.release}-operator", "-n", flow.release_ns,
                  "--timeout=300s", check=False, timeout=330)
    assert r.returncode == 0, f"operator Deployment not rolled out: {r.stdout}{r.stderr}\n{flow.operator_logs()}"
    dep = flow.operator_deployment()
    assert dep["status"].get("readyReplicas") == dep["spec"]["replicas"] == 2, dep["status"]
    pods = flow.operator_pods()
    assert {p["spec"]["containers"][0]["image"].split(":")[0] for p in pods} == {"weightcache-operator"}
    # Started cleanly, also when a replica came up before Helm created the peering object.
    assert [s["restartCount"] for p in pods for s in p["status"]["containerStatuses"]] == [0, 0]
    peering = c.kubectl_json("get", "clusterkopfpeering", flow.release)
    assert peering["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"  # the chart's, not a replica's
    for crd in ("weightcaches.weightcache.io", "clusterkopfpeerings.kopf.dev"):
        c.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")


# -- 2. the cache ----------------------------------------------------------------------------
def test_2_example_cache_loads_on_every_node_and_get_wc_shows_it(flow):
    c, n = flow.cluster, len(flow.cluster.nodes)
    flow.apply_file(CACHE_YAML)
    wc = flow.wait_wc(CACHE, ready_now, "Ready on every node")
    st = wc["status"]

    # The status: Ready, every desired node ready, fingerprint and size.
    assert condition(wc, "Ready")["reason"] == "AllNodesReady"
    assert st["nodes"]["desired"] == st["nodes"]["ready"] == n and st["nodes"]["failed"] == 0, st["nodes"]
    assert st["readyNodes"] == f"{n}/{n}"
    assert len(st["fingerprint"]) == 64 and int(st["fingerprint"], 16) >= 0, st["fingerprint"]
    assert st["bytesPerGPU"] > 80 << 20 and st["size"].endswith("MiB"), (st["bytesPerGPU"], st["size"])
    assert condition(wc, "Degraded")["status"] == "False" and condition(wc, "Progressing")["status"] == "False"

    # `kubectl get wc`, as the user reads it: the printer columns.
    header, row = flow.kubectl("get", "wc", CACHE).stdout.splitlines()
    assert header.split() == ["NAME", "READY", "NODES", "BACKEND", "SIZE", "CLIENTS", "ROLLOUT", "AGE"], header
    cells = row.split()
    assert cells[:4] == [CACHE, f"{n}/{n}", "cpu", st["size"].split()[0]] and cells[4] == "MiB", row
    shown = flow.kubectl("get", "wc", CACHE, "-o", "custom-columns=FINGERPRINT:.status.fingerprint,BYTES:.status.bytesPerGPU",
                         "--no-headers").stdout.split()
    assert shown == [st["fingerprint"], str(st["bytesPerGPU"])]

    # The real model is loaded on every fake GPU node: each daemon says so itself.
    # (The cache is Ready once every daemon reports ready over HTTP; the pods' own Ready
    # condition follows at their readiness probe's next period.)
    pods = wait(lambda: (lambda ps: len(ps) == len(c.nodes) and all(is_ready(p) for p in ps) and ps)(flow.daemon_pods()),
                60, "every daemon pod Ready")
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(c.nodes), "one daemon per node"
    # In the chart's namespace for daemons (privileged), none in the user's namespace.
    assert flow.kubectl_json("get", "pods,ds", "-l", "app.kubernetes.io/name=weightcache-daemon")["items"] == []
    labels = c.kubectl_json("get", "namespace", flow.daemons_ns)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged", labels
    assert all(not p["spec"]["containers"][0]["securityContext"].get("privileged") for p in pods)
    for p in pods:
        assert p["spec"]["containers"][0]["image"].startswith("weightcache-daemon:")
        _, doc = http(f"http://{p['status']['podIP']}:{DAEMON_PORT}/status")
        assert doc["state"] == "ready" and doc["backend"] == "cpu", doc
        (dev,) = doc["devices"]
        assert dev["fingerprint"] == st["fingerprint"] and dev["resident_bytes"] == st["bytesPerGPU"], dev
        assert dev["tensors"] > 100, dev  # the whole MiniLM, not a stub
        node = p["spec"]["nodeName"]
        assert [s.name for s in flow.sockets(node)] == [f"{CACHE}__cpu__{st['fingerprint'][:12]}.sock"]

    # Every node carries the ready label that engine pods are placed by.
    wait(lambda: flow.labelled_nodes() == set(c.nodes), 60, "every node labelled ready")


# -- 3. the engines --------------------------------------------------------------------------
def test_3a_engine_pods_are_mutated_by_the_webhook(flow):
    flow.apply_file(ENGINE_YAML)
    pods = wait(lambda: (lambda ps: ps if len(ps) == REPLICAS else None)(flow.engine_pods()), 120,
                f"{REPLICAS} engine pods created")
    sock = f"/run/weightcache/{flow.ns}/{CACHE}"
    for p in pods:
        name, spec = p["metadata"]["name"], p["spec"]
        assert p["metadata"]["annotations"]["weightcache.io/mutated"] == CACHE, name
        # The agent: a native sidecar (init container that keeps running).
        (agent,) = [i for i in spec.get("initContainers") or [] if i["name"] == "weightcache-agent"]
        assert agent["restartPolicy"] == "Always" and agent["image"].startswith("weightcache-engine:"), agent
        flags = dict(zip(agent["args"][1::2], agent["args"][2::2]))
        assert agent["args"][0] == "agent" and flags["--socket-dir"] == sock and flags["--cache"] == CACHE
        assert flags["--model"] == MODEL and flags["--http-bind"] == f"$(POD_IP):{AGENT_PORT}"
        assert flags["--report-file"] == REPORT_FILE
        assert agent["startupProbe"]["httpGet"]["path"] == "/ready" == agent["readinessProbe"]["httpGet"]["path"]
        assert agent["terminationMessagePolicy"] == "FallbackToLogsOnError"
        # The engine: socket directory and model read-only, the client's env.
        (engine,) = spec["containers"]
        mounts = {m["mountPath"]: m for m in engine["volumeMounts"]}
        assert mounts[sock].get("readOnly") is True and mounts[MODEL].get("readOnly") is True, mounts
        assert "/run/weightcache-report" in mounts
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes[mounts[sock]["name"]]["hostPath"]["path"] == sock
        env = {e["name"]: e.get("value", "") for e in engine["env"]}  # "" is omitted by the API
        assert {k: v for k, v in env.items() if k.startswith("WEIGHTCACHE_")} == {
            "WEIGHTCACHE_MODE": "client", "WEIGHTCACHE_FALLBACK": "disk", "WEIGHTCACHE_SOCKET_DIR": sock,
            "WEIGHTCACHE_CACHE_NAME": CACHE, "WEIGHTCACHE_MODEL_DIR": MODEL, "WEIGHTCACHE_REVISION": "",
            "WEIGHTCACHE_DEVICE": "cpu", "WEIGHTCACHE_TP_SIZE": "1", "WEIGHTCACHE_REPORT_FILE": REPORT_FILE}, env
        assert "POD_IP" in env  # the user's own env is kept
        # cpu backend: no host IPC or PID namespace.
        assert not spec.get("hostIPC") and not spec.get("hostPID"), name
        # Placed only where the cache is ready.
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms == [{"matchExpressions": [
            {"key": node_label_key(flow.ns, CACHE), "operator": "In", "values": ["ready"]}]}], terms


class DiskEngine:
    """`weightcache example-engine` as a local process with WEIGHTCACHE_MODE=off: the
    reference answers of an engine that read its weights from disk."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTCACHE_")}
        self.proc = subprocess.Popen([WEIGHTCACHE, "example-engine", "--model", str(packaged_model_dir()),
                                      "--http-bind", f"127.0.0.1:{self.port}"],
                                     env={**env, "WEIGHTCACHE_MODE": "off"}, stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self) -> None:
        def ready():
            assert self.proc.poll() is None, f"disk engine exited {self.proc.returncode}: " \
                                             f"{Path(self.log.name).read_text()[-2000:]}"
            try:
                return http(self.url + "/ready", timeout=5)[0] == 200
            except OSError:
                return False
        wait(ready, 300, "the disk-loaded engine to be ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def test_3b_engines_attach_from_the_cache_become_ready_and_answer_like_a_disk_engine(flow, tmp_path):
    disk = DiskEngine(tmp_path / "disk-engine.log")  # loads while the pods start
    try:
        def rolled_out():
            dep = flow.get("deployment", ENGINE)
            return dep if (dep or {}).get("status", {}).get("readyReplicas") == REPLICAS else None
        try:
            wait(rolled_out, 420, f"Deployment {ENGINE} {REPLICAS}/{REPLICAS} Ready")
        except TimeoutError as e:
            logs = "\n".join(f"--- {p['metadata']['name']}/{cname}:\n"
                             + flow.cluster.pod_log(flow.ns, p["metadata"]["name"], cname).read_text()[-2000:]
                             for p in flow.engine_pods() for cname in ("weightcache-agent", "engine")
                             if flow.cluster.pod_log(flow.ns, p["metadata"]["name"], cname).exists())
            raise AssertionError(f"{e}\n{logs}") from None
        fingerprint = flow.wc()["status"]["fingerprint"]
        pods = flow.engine_pods()
        assert len(pods) == REPLICAS and all(is_ready(p) for p in pods)
        disk.wait_ready()
        assert http(disk.url + "/status")[1]["source"] == "disk"
        for p in pods:
            name, ip = p["metadata"]["name"], p["status"]["podIP"]
            assert p["spec"]["nodeName"] in flow.labelled_nodes(), f"{name} placed where the cache is not ready"
            assert container_status(p, "engine")["restartCount"] == 0, name
            # Attached, not loaded from disk: the engine says which, and so does its agent.
            _, engine = http(f"http://{ip}:{ENGINE_PORT}/status")
            assert engine["source"] == "cache", f"{name} did not attach: {engine}"
            _, agent = http(f"http://{ip}:{AGENT_PORT}/status")
            assert agent["ready"] and agent["daemon"]["fingerprint"] == fingerprint, agent
            assert agent["engine"]["source"] == "cache" and agent["engine"]["fingerprint"] == fingerprint, agent
            # Inference, reached at the pod IP: identical to the disk-loaded engine's.
            for output, key in (("mean", "embeddings"), ("last_hidden_state", "last_hidden_state")):
                got = http(f"http://{ip}:{ENGINE_PORT}/infer", {"sentences": SENTENCES, "output": output})
                ref = http(disk.url + "/infer", {"sentences": SENTENCES, "output": output})
                assert got[0] == ref[0] == 200, (got, ref)
                assert got[1]["source"] == "cache" and ref[1]["source"] == "disk"
                assert got[1][key] == ref[1][key], f"{name}: {output} differs from the disk-loaded engine's"
    finally:
        disk.stop()


def test_3c_status_counts_the_attached_engines(flow):
    wc = flow.wait_wc(CACHE, lambda o: o["status"].get("attachedClients") == REPLICAS,
                      f"counting {REPLICAS} attached clients", timeout=120)
    assert ready_now(wc)
    row = flow.kubectl("get", "wc", CACHE, "--no-headers").stdout.split()
    assert row[5] == str(REPLICAS), row  # the CLIENTS column


# -- 4. invalid caches -----------------------------------------------------------------------
@pytest.mark.parametrize("change, needles", [
    # A typo in the example's clientPolicy: an enum, named with its allowed values.
    ({"clientPolicy": {"fallback": "memory"}}, ['spec.clientPolicy.fallback: Unsupported value: "memory"',
                                                 '"disk"', '"error"']),
    # A cross-field (CEL) rule: more tensor shards than the GPUs asked for on one node.
    ({"parallelism": {"tensor": 4}, "placement": {"gpusPerNode": 2}},
     ["spec: Invalid value", "parallelism: tensor * pipeline must fit the GPUs of one node", "placement.gpusPerNode"]),
], ids=["enum", "cel"])
def test_4_invalid_caches_are_rejected_by_the_api_server_naming_the_field(flow, change, needles):
    manifest = example_cache("bad", **change)
    r = flow.apply_manifest(manifest, check=False)
    assert r.returncode != 0, f"accepted: {r.stdout}"
    assert '"bad" is invalid' in r.stderr, r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr
    assert flow.wc("bad") is None  # nothing was stored


# -- 5. a missing model ----------------------------------------------------------------------
def test_5_a_model_path_missing_on_the_nodes_degrades_the_cache_with_a_reason(flow):
    c, n, missing = flow.cluster, len(flow.cluster.nodes), "/var/lib/weightcache/models/absent"
    flow.apply_manifest(example_cache("gone", path=missing))
    wc = flow.wait_wc("gone", lambda o: condition(o, "Degraded").get("status") == "True"
                      and o["status"]["nodes"]["failed"] == n, "Degraded on every node")
    degraded = condition(wc, "Degraded")
    assert degraded["reason"] == "ModelNotFound", degraded
    assert missing.lstrip("/") in degraded["message"], degraded
    assert {f["node"] for f in wc["status"]["nodes"]["failures"]} == set(c.nodes)
    assert all(f["reason"] == "ModelNotFound" for f in wc["status"]["nodes"]["failures"])
    assert condition(wc, "Ready")["status"] == "False" and flow.labelled_nodes("gone") == set()
    # Not a crash loop: each daemon stays up, saying why, and was never restarted.
    pods = flow.daemon_pods("gone")
    assert len(pods) == n
    for p in pods:
        assert p["status"]["phase"] == "Running", p["status"]
        assert [s["restartCount"] for s in p["status"]["containerStatuses"]] == [0], p["status"]
        _, doc = http(f"http://{p['status']['podIP']}:{DAEMON_PORT}/status")
        assert doc["state"] == "failed" and doc["reason"] == "ModelNotFound", doc
    wait(lambda: flow.events("gone", "ModelNotFound"), 60, "an Event with the reason")
    # ... and still none now that the operator has reported it and posted the Event.
    for p in flow.daemon_pods("gone"):
        assert [s["restartCount"] for s in p["status"]["containerStatuses"]] == [0], p["status"]

    flow.kubectl("delete", "wc", "gone", "--timeout=120s", timeout=150)
    assert flow.daemonset("gone") is None


# -- 6. deletion ----------------------------------------------------------------------------
def test_6_deleting_the_cache_waits_for_attached_engines_then_cleans_up_everything(flow):
    c = flow.cluster
    assert flow.wc()["status"].get("attachedClients") == REPLICAS, "precondition: the engines of test 3 attached"
    engines = sorted(p["metadata"]["name"] for p in flow.engine_pods())
    flow.kubectl("delete", "wc", CACHE, "--wait=false")

    # It waits, and says why: in the status and in an Event.
    wc = flow.wait_wc(CACHE, lambda o: condition(o, "Progressing").get("reason") == "DeletionBlocked",
                      "saying its deletion is blocked", timeout=120)
    assert wc["metadata"].get("deletionTimestamp"), "the object stays, marked for deletion"
    message = condition(wc, "Progressing")["message"]
    assert f"{REPLICAS} attached client(s)" in message and f"{REPLICAS} engine pod(s)" in message, message
    assert all(e in message for e in engines) and "force-delete" in message, message
    assert condition(wc, "Ready")["reason"] == "Deleting"
    (event, *_) = wait(lambda: flow.events(CACHE, "DeletionBlocked"), 60, "a DeletionBlocked Event")
    assert event["type"] == "Warning" and "engine pod(s)" in event["message"], event
    # Nothing was taken from under the engines.
    assert flow.daemonset() is not None and flow.labelled_nodes() == set(c.nodes)
    assert all(flow.sockets(node) for node in c.nodes)
    ip = flow.engine_pods()[0]["status"]["podIP"]
    assert http(f"http://{ip}:{ENGINE_PORT}/infer", {"sentences": SENTENCES})[0] == 200

    # The engines go; then everything goes.
    flow.kubectl("delete", "-f", str(ENGINE_YAML), "--wait=false")
    try:
        wait(lambda: flow.wc() is None, 240, "the cache to be deleted after its engines")
    except TimeoutError as e:
        raise AssertionError(f"{e}; last status: {json.dumps((flow.wc() or {}).get('status'))}\n"
                             f"{flow.operator_logs()}") from None
    assert flow.engine_pods() == []
    assert flow.daemonset() is None, "the DaemonSet"
    assert flow.daemon_pods() == [], "the daemon pods"
    assert flow.labelled_nodes() == set(), "the node labels"
    for node in c.nodes:
        assert flow.sockets(node) == [], f"the sockets on {node}"


# -- 7. the operator killed mid-reconcile ----------------------------------------------------
def operator_process(pod: dict) -> int | None:
    """The pid of the simulated operator container of POD (a local process; found by the
    POD_NAME and POD_NAMESPACE the chart puts in its env), or None."""
    want = {f"POD_NAME={pod['metadata']['name']}".encode(), f"POD_NAMESPACE={pod['metadata']['namespace']}".encode()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            env = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if b"operator" in cmdline and want <= env:
            return int(entry.name)
    return None


def test_7_the_operator_killed_mid_reconcile_resumes_and_converges(flow):
    c = flow.cluster
    before = {p["metadata"]["uid"] for p in flow.operator_pods()}
    assert len(before) == 2
    flow.apply_manifest(example_cache("kil"))
    wait(lambda: flow.daemonset("kil"), 120, "the operator to start reconciling (DaemonSet created)")
    at_kill = flow.wc("kil")
    # SIGKILL every replica (the active one included: no goodbye to the peering), then
    # remove their pods as a lost node would, so the Deployment must start new ones.
    killed = []
    for p in flow.operator_pods():
        pid = operator_process(p)
        assert pid is not None, f"no operator process found for pod {p['metadata']['name']}"
        assert os.getpgid(pid) == pid  # the simulator made it a group leader
        os.killpg(pid, signal.SIGKILL)
        killed.append(pid)
    c.kubectl("delete", "pods", "-n", flow.release_ns, "-l",
              f"app.kubernetes.io/instance={flow.release},app.kubernetes.io/component=operator",
              "--grace-period=0", "--force", "--wait=false")
    assert not ready_now(at_kill), "the kill landed mid-reconcile (the cache was not Ready yet)"
    # While no operator runs, the spec changes: the new replicas must converge to it.
    flow.kubectl("patch", "wc", "kil", "--type=merge", "-p", json.dumps({"spec": {"model": {"revision": "r2"}}}))

    def replaced():
        pods = flow.operator_pods()
        return (len(pods) == 2 and not before & {p["metadata"]["uid"] for p in pods}
                and all(is_ready(p) for p in pods))
    wait(replaced, 300, "the Deployment's two new operator pods Ready")
    wc = flow.wait_wc("kil", ready_now, "Ready for revision r2 after the operator restarted", timeout=420)
    n = len(c.nodes)
    assert wc["status"]["nodes"]["ready"] == n and wc["status"]["readyNodes"] == f"{n}/{n}"
    args = flow.daemonset("kil")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--revision") + 1] == "r2", args

    # The daemons roll by surge: the cache is Ready once the new daemon serves on every
    # node, while the old pods may still be going. Ask the daemons that stay.
    def rolled():
        pods = flow.daemon_pods("kil")
        return pods if len(pods) == n and not any(p["metadata"].get("deletionTimestamp") for p in pods) and all(
            "r2" in p["spec"]["containers"][0]["args"] for p in pods) else None
    for p in wait(rolled, 120, "only daemons of revision r2 left"):
        _, doc = http(f"http://{p['status']['podIP']}:{DAEMON_PORT}/status")
        assert doc["state"] == "ready" and doc["devices"][0]["fingerprint"] == wc["status"]["fingerprint"], doc
    wait(lambda: flow.labelled_nodes("kil") == set(c.nodes), 60, "every node labelled for the converged cache")
