"""`weightcache operator` as a real local process against the real control plane: the
node simulator runs the DaemonSet's daemons (`weightcache daemon`, cpu backend, the
packaged all-MiniLM-L6-v2) and the engine pods' agent sidecars; the apiserver calls the
operator's webhook over TLS.

Short names on purpose: a daemon's socket is
<node_root>/run/weightcache/<namespace>/<cache>/<cache>__cpu__<digest12>.sock and a Unix
socket path must fit in 107 bytes.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest

from cluster import wait_for
from cluster.pki import _key, _openssl, _signed, server_ext
from cluster.procs import free_port
from cluster.testkit import SIMULATED_IMAGE, condition, container, is_ready, pod, ready_now, wait_object
from weightcache.demo import packaged_model_dir
from weightcache.operator.manifests import daemonset_name, node_label_key

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "weightcache.io_weightcaches.yaml"
CLASS_CRD = ROOT / "crds" / "weightcache.io_weightcacheclasses.yaml"
MODEL_ROOT = "/m"  # the test class's model root: every model of this tier lives under it
WEIGHTCACHE = str(Path(sys.executable).with_name("weightcache"))
NS = "wco"
MODEL = "/m/mini"
HOLD = ("import sys; from weightcache.client import attach; "
        "a = attach(sys.argv[1], socket_dir=sys.argv[2], cache_name=sys.argv[3], revision=sys.argv[4], timeout=30); "
        "print('attached', flush=True); sys.stdin.read()")



def wait(check, timeout: float, what: str):
    """wait_for at a pace that leaves the two cores to the cluster (each poll is a kubectl)."""
    return wait_for(check, timeout, what, interval=0.5)


# -- the operator process ---------------------------------------------------------------
class Operator:
    """Replicas of `weightcache operator` sharing one webhook port and peering object."""

    def __init__(self, cluster, work: Path, daemon_ns: str) -> None:
        self.cluster, self.work, self.daemon_ns = cluster, work, daemon_ns
        self.webhook_port = free_port()
        self.peering = f"wc-test-{uuid.uuid4().hex[:6]}"
        self.procs: list[subprocess.Popen] = []

    def start(self, priority: int) -> subprocess.Popen:
        health = free_port()
        argv = [WEIGHTCACHE, "operator", "--webhook-bind", f"127.0.0.1:{self.webhook_port}",
                "--tls-cert", str(self.work / "tls.crt"), "--tls-key", str(self.work / "tls.key"),
                "--health-bind", f"127.0.0.1:{health}", "--peering", self.peering, "--priority", str(priority),
                "--peering-lifetime", "6", "--poll-interval", "1", "--log-level", "info",
                # The caches' own namespace: it is privileged here, and the tests of this tier
                # look for a cache's daemons beside it (the chart's own namespace for them is
                # tested by test_cp_install).
                "--daemon-namespace", self.daemon_ns]
        log = open(self.work / f"operator-{len(self.procs)}.log", "wb")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig)}, start_new_session=True)
        proc.log_path = log.name
        self.procs.append(proc)

        def healthy():
            assert proc.poll() is None, f"operator exited {proc.returncode}: {self.log(proc)}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False
        wait(healthy, 60, "the operator's /healthz")
        return proc

    def log(self, proc) -> str:
        return Path(proc.log_path).read_text()[-3000:]

    def kill(self, proc) -> None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill(proc)


def make_webhook_cert(work: Path) -> None:
    """A CA and a serving certificate for 127.0.0.1, where the apiserver calls the webhook."""
    _key(work, "ca.key")
    _openssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=weightcache-webhook-test-ca", "-days", "2",
             "-out", "ca.crt", cwd=work)
    _signed(work, "tls", "localhost", "", server_ext(["localhost"], ["127.0.0.1"]))


def webhook_configuration(name: str, port: int, ca: bytes) -> dict:
    """What the chart ships, pointed at the local operator: narrow selection (engine pods
    labelled for a cache, never the daemons), failing closed."""
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [{"name": "pods.weightcache.io",
                          "clientConfig": {"url": f"https://127.0.0.1:{port}/mutate-pods",
                                           "caBundle": base64.b64encode(ca).decode()},
                          "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                                     "resources": ["pods"]}],
                          "objectSelector": {"matchExpressions": [
                              {"key": "weightcache.io/cache", "operator": "Exists"},
                              {"key": "app.kubernetes.io/name", "operator": "NotIn", "values": ["weightcache-daemon"]}]},
                          "failurePolicy": "Fail", "sideEffects": "None", "admissionReviewVersions": ["v1"],
                          "timeoutSeconds": 10, "reinvocationPolicy": "IfNeeded"}]}


def default_class(name: str, **spec) -> dict:
    return {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCacheClass",
            "metadata": {"name": name, "annotations": {"weightcache.io/is-default-class": "true"}},
            "spec": {"modelRoots": [MODEL_ROOT], "backends": ["cuda-vmm", "cpu"], **spec}}


def start_operator(cluster, work: Path, ns: str, hook_prefix: str, only_ns: bool) -> tuple["Operator", str]:
    """The CRDs, namespace NS, one operator replica and its webhook (ONLY_NS: for NS alone,
    as other modules may run an operator of their own): (operator, webhook name)."""
    cluster.kubectl("apply", "-f", str(CRD), "-f", str(CLASS_CRD))
    crds = subprocess.run([WEIGHTCACHE, "operator", "--print-peering-crds"], capture_output=True, text=True,
                          check=True).stdout
    cluster.kubectl("apply", "-f", "-", input=crds)
    for crd in ("weightcaches.weightcache.io", "weightcacheclasses.weightcache.io", "clusterkopfpeerings.kopf.dev"):
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=30s")
    cluster.create_namespace(ns)
    # The admin's part: a default class whose model root holds this tier's models, named
    # after the namespace (classes are cluster-wide; each module makes and removes its own).
    cluster.kubectl("apply", "-f", "-", input=json.dumps(default_class(ns)))
    work.mkdir(parents=True, exist_ok=True)
    make_webhook_cert(work)
    operator = Operator(cluster, work, daemon_ns=ns)
    operator.active = operator.start(priority=100)
    wait(lambda: _connects(operator.webhook_port), 30, "the webhook port")
    hook = f"{hook_prefix}-{operator.peering}"
    config = webhook_configuration(hook, operator.webhook_port, (work / "ca.crt").read_bytes())
    if only_ns:
        config["webhooks"][0]["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": ns}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(config))
    return operator, hook


def stop_operator(cluster, operator: "Operator | None", hook: str, ns: str, workloads: str = "",
                  timeout: float = 60) -> None:
    """Undo start_operator: WORKLOADS (kinds, e.g. "deployments") and the caches of NS go,
    force-deleted; then the webhook, the operator and the namespace."""
    if workloads:
        cluster.kubectl("delete", workloads, "--all", "-n", ns, "--wait=false", check=False)
    listed = cluster.kubectl("get", "wc", "-n", ns, "-o", "json", check=False)
    for item in json.loads(listed.stdout)["items"] if listed.returncode == 0 else []:
        name = item["metadata"]["name"]
        cluster.kubectl("annotate", "wc", name, "-n", ns, "weightcache.io/force-delete=true", "--overwrite",
                        check=False)
        cluster.kubectl("delete", "wc", name, "-n", ns, "--wait=false", check=False)
    try:
        if listed.returncode == 0:
            wait(lambda: not cluster.kubectl_json("get", "wc", "-n", ns)["items"], timeout, "caches deleted")
    finally:
        if hook:
            cluster.kubectl("delete", "mutatingwebhookconfiguration", hook, check=False)
        if operator:
            operator.stop_all()
        cluster.kubectl("delete", "weightcacheclass", ns, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(scope="module")
def op(cluster, tmp_path_factory):
    for node in cluster.nodes:
        shutil.copytree(packaged_model_dir(), cluster.node_root(node) / MODEL.lstrip("/"), dirs_exist_ok=True)
    operator, hook = start_operator(cluster, tmp_path_factory.mktemp("operator"), NS, "weightcache-test",
                                    only_ns=False)
    try:
        yield operator
    finally:
        stop_operator(cluster, operator, hook, NS)


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


# -- helpers ----------------------------------------------------------------------------
def get_wc(cluster, name: str) -> dict | None:
    r = cluster.kubectl("get", "wc", name, "-n", NS, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def create_cache(cluster, name: str, path: str = MODEL, **spec) -> None:
    manifest = {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache", "metadata": {"name": name},
                "spec": {"model": {"path": path}, "backend": "cpu", **spec}}
    cluster.kubectl("create", "-n", NS, "-f", "-", input=json.dumps(manifest))


def wait_cache(cluster, name: str, check, what: str, timeout: float = 120) -> dict:
    return wait_object(lambda: get_wc(cluster, name), check, f"WeightCache {name} {what}", timeout)


def daemon_pods(cluster, name: str) -> list[dict]:
    return cluster.kubectl_json("get", "pods", "-n", NS, "-l",
                                f"app.kubernetes.io/name=weightcache-daemon,weightcache.io/cache={name}")["items"]


def get_ds(cluster, name: str) -> dict | None:
    r = cluster.kubectl("get", "ds", daemonset_name(NS, name), "-n", NS, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def labelled_nodes(cluster, name: str) -> set[str]:
    key = node_label_key(NS, name)
    return {n["metadata"]["name"] for n in cluster.kubectl_json("get", "nodes")["items"]
            if n["metadata"].get("labels", {}).get(key) == "ready"}


def sockets(cluster, node: str, name: str) -> list[Path]:
    return sorted((cluster.node_root(node) / "run/weightcache" / NS / name).glob("*.sock"))


def events(cluster, name: str, reason: str) -> list[dict]:
    return cluster.kubectl_json("get", "events", "-n", NS, "--field-selector",
                                f"involvedObject.name={name},involvedObject.kind=WeightCache,reason={reason}")["items"]


class Holder:
    """A real engine-side client that attached and keeps its connection (and mapping)."""

    def __init__(self, cluster, node: str, name: str, log: Path) -> None:
        socket_dir = cluster.node_root(node) / "run/weightcache" / NS / name
        revision = get_wc(cluster, name)["spec"]["model"].get("revision", "")
        self.err = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD, str(packaged_model_dir()), str(socket_dir), name,
                                      revision],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err)
        line = self.proc.stdout.readline()
        assert line.strip() == b"attached", f"client did not attach: {Path(log).read_text()[-2000:]}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.err.close()


def engine_pod(name: str, cache: str) -> dict:
    p = pod(name, [container("main", SIMULATED_IMAGE)])
    p["metadata"]["labels"]["weightcache.io/cache"] = cache
    return p


def create_pod(cluster, manifest: dict, check: bool = True):
    return cluster.kubectl("create", "-n", NS, "-f", "-", "-o", "json", input=json.dumps(manifest), check=check)


@pytest.fixture(scope="module")
def mini(op, cluster):
    """One cache shared by the tests that leave it as they found it: Ready on every node."""
    create_cache(cluster, "mini")
    wait_cache(cluster, "mini", ready_now, "ready")
    return "mini"


# -- tests ------------------------------------------------------------------------------
def test_a_cpu_cache_becomes_ready_on_every_node_with_fingerprint_and_labels(cluster, mini):
    wc = wait_cache(cluster, mini, ready_now, "ready")
    st = wc["status"]
    n = len(cluster.nodes)
    assert st["readyNodes"] == f"{n}/{n}" and st["nodes"]["ready"] == n and st["nodes"]["failed"] == 0
    assert len(st["fingerprint"]) == 64 and st["bytesPerGPU"] > 80 << 20 and st["size"].endswith("MiB")
    assert st["attachedClients"] == 0
    assert condition(wc, "Degraded")["status"] == "False" and condition(wc, "Progressing")["status"] == "False"
    for node in cluster.nodes:  # each node's daemon published the socket named for that fingerprint
        (sock,) = sockets(cluster, node, mini)
        assert sock.name == f"mini__cpu__{st['fingerprint'][:12]}.sock"
    wait(lambda: labelled_nodes(cluster, mini) == set(cluster.nodes), 30, "nodes labelled")
    ds = get_ds(cluster, mini)
    # No owner reference (daemons may live in another namespace): labels name the cache.
    assert ds["metadata"]["labels"]["weightcache.io/cache-uid"] == wc["metadata"]["uid"]
    assert "ownerReferences" not in ds["metadata"]
    for p in daemon_pods(cluster, mini):
        assert "weightcache.io/mutated" not in (p["metadata"].get("annotations") or {})  # daemons are not engines
        assert p["spec"]["containers"][0]["args"][:2] == ["daemon", "--model"]
    row = cluster.kubectl("get", "wc", mini, "-n", NS, "--no-headers").stdout.split()
    assert row[1:4] == [f"{n}/{n}", "cpu", st["size"].split()[0]]


def test_a_hand_edited_daemonset_is_put_back(cluster, mini):
    before = get_ds(cluster, mini)["spec"]["template"]
    cluster.kubectl("set", "image", f"ds/{daemonset_name(NS, mini)}", "daemon=weightcache-daemon:hacked", "-n", NS)
    cluster.kubectl("set", "env", f"ds/{daemonset_name(NS, mini)}", "EXTRA=1", "-n", NS)
    wait(lambda: get_ds(cluster, mini)["spec"]["template"] == before, 30, "the DaemonSet put back")
    wait(lambda: events(cluster, mini, "DaemonSetRestored"), 30, "a DaemonSetRestored event")
    wait_cache(cluster, mini, ready_now, "ready again")
    assert all(p["spec"]["containers"][0]["image"] != "weightcache-daemon:hacked" for p in daemon_pods(cluster, mini))


def test_engine_pods_are_mutated_through_the_apiserver_and_readmission_changes_nothing(cluster, mini):
    created = []
    try:
        got = json.loads(create_pod(cluster, engine_pod("eng", mini)).stdout)
        created.append("eng")
        spec = got["spec"]
        assert got["metadata"]["annotations"]["weightcache.io/mutated"] == mini
        (agent,) = [c for c in spec["initContainers"] if c["name"] == "weightcache-agent"]
        assert agent["restartPolicy"] == "Always" and agent["args"][0] == "agent"
        env = {e["name"]: e.get("value", "") for e in spec["containers"][0]["env"]}
        assert env["WEIGHTCACHE_SOCKET_DIR"] == f"/run/weightcache/{NS}/{mini}" and env["WEIGHTCACHE_DEVICE"] == "cpu"
        assert env["WEIGHTCACHE_MODEL_DIR"] == MODEL and env["WEIGHTCACHE_MODE"] == "client"
        mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
        assert mounts[f"/run/weightcache/{NS}/{mini}"]["readOnly"] and mounts[MODEL]["readOnly"]
        assert "hostIPC" not in spec and "hostPID" not in spec
        term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert term == [{"matchExpressions": [{"key": node_label_key(NS, mini), "operator": "In", "values": ["ready"]}]}]

        # The pod lands where the cache is ready, and its agent finds the daemon there.
        running = wait(lambda: (lambda p: p if is_ready(p) else None)(
            cluster.kubectl_json("get", "pod", "eng", "-n", NS)), 90, "the engine pod to be ready")
        assert running["spec"]["nodeName"] in labelled_nodes(cluster, mini)

        # Re-admission: the mutated pod, submitted again, comes back unchanged.
        again = {"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": "eng2", "labels": got["metadata"]["labels"],
                              "annotations": got["metadata"]["annotations"]},
                 "spec": {k: v for k, v in spec.items() if k != "nodeName"}}
        second = json.loads(create_pod(cluster, again).stdout)
        created.append("eng2")
        strip = lambda s: {k: v for k, v in s.items() if k != "nodeName"}  # noqa: E731
        assert strip(second["spec"]) == strip(spec)
        assert second["metadata"]["annotations"] == got["metadata"]["annotations"]

        # A pod labelled for a cache that does not exist is refused, naming it.
        refused = create_pod(cluster, engine_pod("lost", "nosuch"), check=False)
        assert refused.returncode != 0
        assert "WeightCache 'nosuch' not found in namespace 'wco'" in refused.stderr, refused.stderr
        # Unlabelled pods never reach the webhook.
        plain = pod("plain", [container("main", SIMULATED_IMAGE)])
        assert "annotations" not in json.loads(create_pod(cluster, plain).stdout)["metadata"]
        created.append("plain")
    finally:
        for name in created:
            cluster.kubectl("delete", "pod", name, "-n", NS, "--wait=true", "--timeout=60s", check=False)


def test_a_spec_change_rolls_the_daemonset(cluster, mini):
    old = get_wc(cluster, mini)["status"]["fingerprint"]
    cluster.kubectl("patch", "wc", mini, "-n", NS, "--type=merge", "-p", json.dumps({"spec": {"model": {"revision": "r2"}}}))

    def rolled():
        pods = daemon_pods(cluster, mini)
        return len(pods) == len(cluster.nodes) and all(
            "r2" in p["spec"]["containers"][0]["args"] and is_ready(p) for p in pods)
    wait(rolled, 120, "every daemon to run revision r2")
    wc = wait_cache(cluster, mini, lambda o: ready_now(o) and o["status"]["fingerprint"] != old, "ready with r2")
    wait(lambda: events(cluster, mini, "DaemonSetUpdated"), 30, "a DaemonSetUpdated event")
    assert wc["status"]["readyNodes"] == f"{len(cluster.nodes)}/{len(cluster.nodes)}"


def test_a_missing_model_path_degrades_the_cache_with_the_daemons_reason(cluster, op):
    create_cache(cluster, "gone", path="/m/none")
    wc = wait_cache(cluster, "gone", lambda o: condition(o, "Degraded").get("status") == "True"
                    and o["status"]["nodes"]["failed"] == len(cluster.nodes), "degraded on every node")
    degraded = condition(wc, "Degraded")
    assert degraded["reason"] in ("ModelNotFound", "InvalidCheckpoint"), degraded
    assert "m/none" in degraded["message"]
    assert {f["node"] for f in wc["status"]["nodes"]["failures"]} == set(cluster.nodes)
    assert condition(wc, "Ready")["status"] == "False" and labelled_nodes(cluster, "gone") == set()
    wait(lambda: events(cluster, "gone", degraded["reason"]), 30, "an event with the reason")
    # Reported, not a crash loop: the daemons stay up saying why.
    for p in daemon_pods(cluster, "gone"):
        assert p["status"]["phase"] == "Running"
        assert all(s["restartCount"] == 0 for s in p["status"]["containerStatuses"])
    cluster.kubectl("delete", "wc", "gone", "-n", NS, "--timeout=60s")
    assert get_ds(cluster, "gone") is None


def test_delete_waits_for_attached_clients_and_engine_pods_then_cleans_up(cluster, op, tmp_path):
    create_cache(cluster, "del")
    wait_cache(cluster, "del", ready_now, "ready")
    wait(lambda: labelled_nodes(cluster, "del") == set(cluster.nodes), 30, "nodes labelled")
    holder = Holder(cluster, cluster.nodes[0], "del", tmp_path / "holder.log")
    try:
        wait_cache(cluster, "del", lambda o: o["status"].get("attachedClients") == 1, "showing the client", 30)
        create_pod(cluster, engine_pod("user", "del"))
        cluster.kubectl("delete", "wc", "del", "-n", NS, "--wait=false")
        blocked = wait_cache(cluster, "del", lambda o: condition(o, "Progressing").get("reason") == "DeletionBlocked",
                             "saying its deletion is blocked", 30)
        message = condition(blocked, "Progressing")["message"]
        assert "1 attached client(s)" in message and "user" in message and "force-delete" in message
        assert condition(blocked, "Ready")["reason"] == "Deleting"
        wait(lambda: events(cluster, "del", "DeletionBlocked"), 30, "a DeletionBlocked event")
        assert get_ds(cluster, "del") is not None and sockets(cluster, cluster.nodes[0], "del")

        cluster.kubectl("delete", "pod", "user", "-n", NS, "--wait=true", "--timeout=60s")
        still = wait_cache(cluster, "del", lambda o: "0 engine pod(s)" in condition(o, "Progressing").get("message", ""),
                           "waiting for the client alone", 30)
        assert condition(still, "Progressing")["reason"] == "DeletionBlocked"
    finally:
        holder.kill()
    wait(lambda: get_wc(cluster, "del") is None, 60, "the cache to be deleted")
    assert get_ds(cluster, "del") is None and daemon_pods(cluster, "del") == []
    assert labelled_nodes(cluster, "del") == set()
    for node in cluster.nodes:
        assert sockets(cluster, node, "del") == []


def test_the_operator_killed_mid_reconcile_restarts_and_converges(cluster, op, mini):
    create_cache(cluster, "kil")
    wait(lambda: get_ds(cluster, "kil"), 30, "the operator to create the DaemonSet")
    op.kill(op.active)  # SIGKILL: no cleanup, no goodbye to the peering object
    # While it is down: its DaemonSet vanishes and the spec changes.
    cluster.kubectl("delete", "ds", daemonset_name(NS, "kil"), "-n", NS, "--wait=true", "--timeout=60s")
    cluster.kubectl("patch", "wc", "kil", "-n", NS, "--type=merge", "-p", json.dumps({"spec": {"model": {"revision": "r9"}}}))
    op.active = op.start(priority=200)
    wait_cache(cluster, "kil", ready_now, "ready after the restart")
    assert "r9" in get_ds(cluster, "kil")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert ready_now(get_wc(cluster, mini)) and labelled_nodes(cluster, "kil") == set(cluster.nodes)


def test_a_standby_replica_takes_over_when_the_active_one_is_killed(cluster, op):
    standby = op.start(priority=50)  # pauses: a higher-priority replica is alive
    op.kill(op.active)
    op.active = standby
    create_cache(cluster, "ha")
    wait_cache(cluster, "ha", ready_now, "ready, reconciled by the former standby")
    wait(lambda: labelled_nodes(cluster, "ha") == set(cluster.nodes), 30, "nodes labelled")


def test_force_delete_does_not_wait_for_engines(cluster, mini, tmp_path):
    # Last: it deletes the shared cache.
    wait_cache(cluster, mini, ready_now, "ready")
    holder = Holder(cluster, cluster.nodes[0], mini, tmp_path / "holder.log")
    try:
        wait_cache(cluster, mini, lambda o: o["status"].get("attachedClients") == 1, "showing the client", 30)
        cluster.kubectl("annotate", "wc", mini, "-n", NS, "weightcache.io/force-delete=true")
        cluster.kubectl("delete", "wc", mini, "-n", NS, "--timeout=60s")
        assert get_ds(cluster, mini) is None and labelled_nodes(cluster, mini) == set()
        assert holder.proc.poll() is None  # the engine outlives the daemon; its mapping stays valid
    finally:
        holder.kill()
