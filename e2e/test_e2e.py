"""The user's path, in order, against any cluster: install the chart, create the example
cpu WeightCache, run the example engine Deployment on it, upgrade the daemon image
without a reload while the engines serve, and fail a primary over to its hot standby.
The tests share one release and one namespace and run in file order; each names the
promise it checks."""

from __future__ import annotations

import ipaddress
import json
import os
import threading
import time

import pytest
import yaml

from kit import CACHE_YAML, ENGINE_YAML, TIMEOUT, condition, pod_ready, ready_now, wait_for

CACHE = yaml.safe_load(CACHE_YAML.read_text())["metadata"]["name"]
ENGINE = yaml.safe_load(ENGINE_YAML.read_text())
ENGINE_NAME = ENGINE["metadata"]["name"]
ENGINE_SELECTOR = ",".join(f"{k}={v}" for k, v in ENGINE["spec"]["selector"]["matchLabels"].items())
REPLICAS = ENGINE["spec"]["replicas"]
DAEMONS = f"app.kubernetes.io/name=weightcache-daemon,weightcache.io/cache={CACHE}"
DAEMON_PORT, ENGINE_PORT = 9400, 8000
SENTENCES = ["The daemon was replaced; the weights stayed where they were.", "Hello, world."]

pytestmark = pytest.mark.timeout(3 * TIMEOUT)


def wc(kube, ns) -> dict | None:
    return kube.get("wc", CACHE, "-n", ns)


def daemon_pods(kube, ns) -> list[dict]:
    """The daemons of NS's cache: in the chart's namespace for daemons, labelled with NS."""
    return kube.json("get", "pods", "-A", "-l", f"{DAEMONS},weightcache.io/cache-namespace={ns}")["items"]


def engine_pods(kube, ns) -> list[dict]:
    return kube.json("get", "pods", "-n", ns, "-l", ENGINE_SELECTOR)["items"]


def infer(pod_http, pod) -> list:
    code, body = pod_http.post(pod, ENGINE_PORT, "/infer", {"sentences": SENTENCES})
    assert code == 200 and body["source"] == "cache", body
    return body["embeddings"]


def verify_pod(name: str, image: str) -> dict:
    """A pod that opts into the cache, attaches as an engine would and compares every
    byte with the model files (`weightcache attach --verify`); it succeeds only if they match."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"weightcache.io/cache": CACHE, "app": "weightcache-e2e-verify"}},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "verify", "image": image, "terminationMessagePolicy":
                                     "FallbackToLogsOnError",
                                     "args": ["attach", "--socket-dir", "$(WEIGHTCACHE_SOCKET_DIR)", "--model",
                                              "$(WEIGHTCACHE_MODEL_DIR)", "--cache", CACHE, "--verify", "--json"]}]}}


def finished(kube, ns, name) -> dict | None:
    p = kube.get("pod", name, "-n", ns)
    return p if p and p["status"].get("phase") in ("Succeeded", "Failed") else None


def assert_verified(kube, ns, name, timeout: float = 300) -> None:
    p = wait_for(lambda: finished(kube, ns, name), timeout, f"pod {name} to finish attaching and verifying")
    statuses = p["status"].get("containerStatuses") or []
    detail = [s.get("state") for s in statuses]
    assert p["status"]["phase"] == "Succeeded", f"{name}: {p['status']['phase']}: {json.dumps(detail)}"
    kube.kubectl("delete", "pod", name, "-n", ns, "--wait=false")


# -- 1. install ---------------------------------------------------------------------------------
def test_1_helm_install_runs_the_operator(kube, release):
    r = kube.kubectl("rollout", "status", f"deployment/{release.name}-operator", "-n", release.namespace,
                     f"--timeout={TIMEOUT:.0f}s", check=False, timeout=TIMEOUT + 30)
    assert r.returncode == 0, f"operator not rolled out: {r.stdout}{r.stderr}"
    kube.kubectl("wait", "--for=condition=Established", "crd/weightcaches.weightcache.io", "--timeout=60s")


# -- 2. a cache ---------------------------------------------------------------------------------
def test_2_the_example_cache_becomes_ready_on_every_node(kube, release, app):
    kube.kubectl("apply", "-n", app, "-f", CACHE_YAML)
    obj = wait_for(lambda: (lambda o: o if ready_now(o) else None)(wc(kube, app)), TIMEOUT,
                   f"WeightCache {CACHE} Ready")
    st = obj["status"]
    assert st["nodes"]["ready"] == st["nodes"]["desired"] > 0 and st["nodes"]["failed"] == 0, st["nodes"]
    assert len(st["fingerprint"]) == 64 and st["bytesPerGPU"] > 0, st
    assert condition(obj, "Degraded")["status"] == "False"


# -- 3. engines ---------------------------------------------------------------------------------
def test_3_the_example_engines_attach_and_serve_from_the_cache(kube, app, pod_http):
    kube.kubectl("apply", "-n", app, "-f", ENGINE_YAML)
    r = kube.kubectl("rollout", "status", f"deployment/{ENGINE_NAME}", "-n", app, f"--timeout={TIMEOUT:.0f}s",
                     check=False, timeout=TIMEOUT + 30)
    assert r.returncode == 0, f"engines not rolled out: {r.stdout}{r.stderr}"
    pods = engine_pods(kube, app)
    assert len(pods) == REPLICAS and all(pod_ready(p) for p in pods)
    for p in pods:
        code, status = pod_http.get(p, ENGINE_PORT, "/status")
        assert code == 200 and status["source"] == "cache", f"{p['metadata']['name']} did not attach: {status}"
        assert len(infer(pod_http, p)) == len(SENTENCES)
    wait_for(lambda: (wc(kube, app)["status"].get("attachedClients") or 0) >= REPLICAS, 120,
             f"the cache counting {REPLICAS} attached engines")


# -- 4. a daemon upgrade without a reload -------------------------------------------------------
class Watch(threading.Thread):
    """What must hold all through the roll, polled until stopped: the engines answer with
    their recorded output, the cache stays Ready, no daemon container restarts."""

    def __init__(self, kube, ns, pod_http, engines: list[dict], expected: dict) -> None:
        super().__init__(daemon=True)
        self.kube, self.ns, self.http, self.engines, self.expected = kube, ns, pod_http, engines, expected
        self.stop = threading.Event()
        self.problems: list[str] = []
        self.rounds = 0

    def run(self) -> None:
        while not self.stop.is_set():
            for p in self.engines:
                name = p["metadata"]["name"]
                try:
                    code, body = self.http.post(p, ENGINE_PORT, "/infer", {"sentences": SENTENCES})
                    if code != 200 or body.get("embeddings") != self.expected[name]:
                        self.problems.append(f"{time.time():.1f} {name}: HTTP {code}, output changed")
                except OSError as e:
                    self.problems.append(f"{time.time():.1f} {name}: {e}")
            ready = condition(wc(self.kube, self.ns), "Ready")
            if ready.get("status") != "True":
                self.problems.append(f"{time.time():.1f} cache not Ready: {ready}")
            for p in daemon_pods(self.kube, self.ns):
                if any(c.get("restartCount") for c in p["status"].get("containerStatuses") or []):
                    self.problems.append(f"{time.time():.1f} daemon {p['metadata']['name']} restarted")
            self.rounds += 1
            self.stop.wait(0.5)


def test_4_a_daemon_image_upgrade_hands_the_slabs_over_while_engines_serve(kube, release, app, pod_http, engine_image):
    engines = engine_pods(kube, app)
    expected = {p["metadata"]["name"]: infer(pod_http, p) for p in engines}
    old = {p["metadata"]["name"] for p in daemon_pods(kube, app)}
    ds = kube.json("get", "ds", "-A", "-l", f"{DAEMONS},weightcache.io/cache-namespace={app}")["items"][0]
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    current = ds["spec"]["template"]["spec"]["containers"][0]["image"]
    target = os.environ.get("WEIGHTCACHE_E2E_NEXT_DAEMON_IMAGE", f"{current}-next")
    desired = wc(kube, app)["status"]["nodes"]["desired"]

    watch = Watch(kube, app, pod_http, engines, expected)
    watch.start()
    try:
        # The admin's move: the chart's default class names the new image; its caches roll.
        kube.kubectl("patch", "wcc", release.name, "--type=merge", "-p",
                     json.dumps({"spec": {"daemon": {"image": target}}}))
        kube.apply(verify_pod("verify-during", engine_image), app)  # a new attach while the daemons roll

        def rolled():
            pods = daemon_pods(kube, app)
            return pods if (len(pods) == desired and not old & {p["metadata"]["name"] for p in pods} and all(
                p["spec"]["containers"][0]["image"] == target and pod_ready(p) for p in pods)) else None
        new = wait_for(rolled, TIMEOUT, f"every daemon replaced by {target}, the old pods gone")
        wait_for(lambda: (lambda o: ready_now(o) and condition(o, "Progressing")["status"] == "False")(
            wc(kube, app)), 180, "the cache Ready and Stable after the roll")
        after = watch.rounds
        wait_for(lambda: watch.rounds >= after + 2, 60, "more rounds of the watch after the roll")
    finally:
        watch.stop.set()
        watch.join(60)
    assert watch.problems == [], watch.problems

    fingerprint = wc(kube, app)["status"]["fingerprint"]
    for p in new:
        code, doc = pod_http.get(p, DAEMON_PORT, "/status")
        # Nothing read from disk: no load progress, and each device's slabs were taken over.
        assert code == 200 and doc["state"] == "ready" and doc["progress"]["total_bytes"] == 0, doc
        assert all(d["load_s"] == 0 and d["fingerprint"] == fingerprint for d in doc["devices"]), doc
        log = kube.logs(app, p["metadata"]["name"], "daemon")
        if log is not None:  # clusters with a kubelet API
            assert '"taken over"' in log and '"loading"' not in log, log[-3000:]
    assert_verified(kube, app, "verify-during")
    kube.apply(verify_pod("verify-after", engine_image), app)
    assert_verified(kube, app, "verify-after")
    for p in engines:
        assert infer(pod_http, p) == expected[p["metadata"]["name"]]


# -- 5. a failover onto a hot standby -----------------------------------------------------------
ROLE, STANDBY_FOR = "weightcache.io/role", "weightcache.io/standby-for"


def ready_endpoint_ips(kube, ns, service: str) -> set[str]:
    slices = kube.json("get", "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={service}")["items"]
    return {address for s in slices for e in s.get("endpoints") or []
            if (e.get("conditions") or {}).get("ready") for address in e["addresses"]}


def test_5_a_deleted_primary_fails_over_to_its_hot_standby(kube, app, pod_http):
    selector = ENGINE["spec"]["selector"]["matchLabels"]
    kube.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": ENGINE_NAME},
                "spec": {"selector": selector, "ports": [{"port": 80, "targetPort": ENGINE_PORT}]}}, app)
    primaries = engine_pods(kube, app)  # the selector's labels: standbys do not carry them
    kube.kubectl("annotate", "deployment", ENGINE_NAME, "-n", app, "weightcache.io/hot-standby=1", "--overwrite")

    def paired(primaries):
        standbys = kube.json("get", "pods", "-n", app, "-l", f"{ROLE}=standby")["items"]
        ready = {s["metadata"]["labels"][STANDBY_FOR]: s for s in standbys if pod_ready(s)}
        return ready if all(p["metadata"]["name"] in ready for p in primaries) else None
    standby_of = wait_for(lambda: paired(primaries), TIMEOUT, "a Ready standby beside every primary")
    victim = primaries[0]
    standby = standby_of[victim["metadata"]["name"]]
    assert standby["spec"]["nodeName"] == victim["spec"]["nodeName"]
    expected = infer(pod_http, victim)
    # The apiserver refuses loopback addresses in EndpointSlices, so on the test control
    # plane (loopback pod IPs) the EndpointSlice controller cannot list any pod; there the
    # Service's membership is the pod's labels and readiness, checked below either way.
    slices_work = not ipaddress.ip_address(victim["status"]["podIP"]).is_loopback
    if slices_work:
        assert standby["status"]["podIP"] not in ready_endpoint_ips(kube, app, ENGINE_NAME)

    kube.kubectl("delete", "pod", victim["metadata"]["name"], "-n", app, "--wait=false")

    def promoted():
        p = kube.get("pod", standby["metadata"]["name"], "-n", app)
        return p if p and p["metadata"]["labels"].get(ROLE) == "primary" and pod_ready(p) else None
    now = wait_for(promoted, 60, f"standby {standby['metadata']['name']} promoted")
    assert all(now["metadata"]["labels"].get(k) == v for k, v in selector.items()), now["metadata"]["labels"]
    assert infer(pod_http, now) == expected
    if slices_work:
        wait_for(lambda: now["status"]["podIP"] in ready_endpoint_ips(kube, app, ENGINE_NAME), 60,
                 "the promoted pod among the Service's ready endpoints")
    events = kube.json("get", "events", "-n", app, "--field-selector", "reason=StandbyPromoted")["items"]
    assert any(standby["metadata"]["name"] in e.get("message", "") for e in events), events

    def settled():
        pods = [p for p in engine_pods(kube, app) if not p["metadata"].get("deletionTimestamp")]
        return len(pods) == REPLICAS and all(pod_ready(p) for p in pods) and paired(pods) is not None
    wait_for(settled, TIMEOUT, f"{REPLICAS} Ready primaries again (one promoted), a new standby beside it")
