"""Issue 6, "daemon image upgrade without a reload", as a user meets it: the chart
installed, examples/weightcache.yaml Ready, examples/engine-deployment.yaml attached;
then the cache's daemon image changes. The DaemonSet rolls by surge: on each node the
new daemon pod starts beside the old one and takes the resident slabs over its socket
(`--take-over`), the old daemon hands over and waits for its pod to be deleted. Shown:
no cold load (logs, /status, the socket's own status), the old daemons gone, the
engines answering identically all along, new attaches working throughout and matching
the disk byte for byte, the cache Ready all along. A daemon pod deleted by hand (no
predecessor alive) comes back by loading.

The node simulator runs the chart's operator, the daemons and the engines as local
processes; hostPath volumes are real directories under each node's root, so the test
reads the daemons' sockets and logs there.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from cluster import wait_for
from cluster.testkit import condition, is_ready, ready_now
from weightcache.client import attach, compare_with_disk, list_sockets, query_status
from weightcache.demo import packaged_model_dir
from weightcache.operator.manifests import daemonset_name

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "weightcache"
CACHE_YAML = ROOT / "examples" / "weightcache.yaml"
ENGINE_YAML = ROOT / "examples" / "engine-deployment.yaml"
CACHE = yaml.safe_load(CACHE_YAML.read_text())["metadata"]["name"]
MODEL = yaml.safe_load(CACHE_YAML.read_text())["spec"]["model"]["path"]
ENGINE = yaml.safe_load(ENGINE_YAML.read_text())
ENGINE_SELECTOR = ",".join(f"{k}={v}" for k, v in ENGINE["spec"]["selector"]["matchLabels"].items())
REPLICAS = ENGINE["spec"]["replicas"]
DAEMON_PORT, ENGINE_PORT = 9400, 8000
DAEMONS = f"app.kubernetes.io/name=weightcache-daemon,weightcache.io/cache={CACHE}"
NEW_IMAGE = "weightcache-daemon:0.1.0-upgraded"  # the simulator runs any tag of a runnable image
SENTENCES = ["The daemon was replaced; the weights stayed where they were.", "Hello, world."]

pytestmark = pytest.mark.timeout(900)


def wait(check, timeout: float, what: str):
    return wait_for(check, timeout, what, interval=0.5)


def post(url: str, body: dict, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def log_events(path: Path) -> list[str]:
    if not path.exists():
        return []
    return [json.loads(line).get("msg", "") for line in path.read_text().splitlines() if line.startswith("{")]


class Setup:
    def __init__(self, cluster, ns: str, release: str) -> None:
        self.cluster, self.ns = cluster, ns
        # The chart's namespace for daemons and its default WeightCacheClass.
        self.daemons_ns, self.class_name = f"{release}-daemons", release

    def kubectl(self, *args, **kw):
        return self.cluster.kubectl(*args, "-n", self.ns, **kw)

    def kubectl_json(self, *args) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def wc(self) -> dict:
        return self.kubectl_json("get", "wc", CACHE)

    def daemon_pods(self) -> list[dict]:
        return self.cluster.kubectl_json("get", "pods", "-n", self.daemons_ns, "-l",
                                         f"{DAEMONS},weightcache.io/cache-namespace={self.ns}")["items"]

    def daemonset(self) -> dict:
        return self.cluster.kubectl_json("get", "ds", daemonset_name(self.ns, CACHE), "-n", self.daemons_ns)

    def engine_pods(self) -> list[dict]:
        return self.kubectl_json("get", "pods", "-l", ENGINE_SELECTOR)["items"]

    def socket_dir(self, node: str) -> Path:
        return self.cluster.node_root(node) / "run/weightcache" / self.ns / CACHE

    def model_dir(self, node: str) -> Path:
        return self.cluster.node_root(node) / MODEL.lstrip("/")

    def daemon_log(self, pod: dict) -> Path:
        return self.cluster.pod_log(self.daemons_ns, pod["metadata"]["name"], "daemon")

    def infer_all(self) -> dict[str, list]:
        out = {}
        for p in self.engine_pods():
            code, body = post(f"http://{p['status']['podIP']}:{ENGINE_PORT}/infer", {"sentences": SENTENCES})
            assert code == 200 and body["source"] == "cache", body
            out[p["metadata"]["name"]] = body["embeddings"]
        return out


@pytest.fixture(scope="module")
def setup(cluster):
    """The chart (one operator replica: the machine is small), a privileged namespace, the
    example cache Ready and the example engines attached."""
    tag = uuid.uuid4().hex[:4]
    release, release_ns, ns = f"up{tag}", f"ups-{tag}", f"upa-{tag}"
    for node in cluster.nodes:
        shutil.copytree(packaged_model_dir(), cluster.node_root(node) / MODEL.lstrip("/"), dirs_exist_ok=True)
    cluster.create_namespace(ns)
    s = Setup(cluster, ns, release)
    try:
        cluster.helm("install", release, CHART, "--namespace", release_ns, "--create-namespace",
                     "--set", "operator.replicas=1", timeout=240)
        s.kubectl("apply", "-f", str(CACHE_YAML))
        wait(lambda: ready_now(s.wc()), 300, f"WeightCache {CACHE} Ready")
        s.kubectl("apply", "-f", str(ENGINE_YAML))
        wait(lambda: (s.kubectl_json("get", "deployment", ENGINE["metadata"]["name"])["status"]
                      .get("readyReplicas") == REPLICAS), 420, "the engines Ready")
        yield s
    finally:
        s.kubectl("delete", "-f", str(ENGINE_YAML), "--wait=false", "--ignore-not-found", check=False)
        s.kubectl("annotate", "wc", CACHE, "weightcache.io/force-delete=true", "--overwrite", check=False)
        s.kubectl("delete", "wc", CACHE, "--timeout=120s", check=False, timeout=150)
        cluster.helm("uninstall", release, "--namespace", release_ns, "--wait", "--timeout", "120s",
                     check=False, timeout=180)
        for name in (ns, release_ns, s.daemons_ns):
            cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


class Watch(threading.Thread):
    """Polls, until stopped, what must hold throughout: every engine answers /infer with
    the recorded output, a new attach works on every node, the cache stays Ready, and no
    daemon container restarts. Records every violation with the time it was seen."""

    def __init__(self, setup: Setup, expected: dict[str, list]) -> None:
        super().__init__(daemon=True)
        self.s, self.expected = setup, expected
        self.ips = {p["metadata"]["name"]: p["status"]["podIP"] for p in setup.engine_pods()}
        self.stop = threading.Event()
        self.problems: list[str] = []
        self.rounds = self.attaches = 0

    def run(self) -> None:
        while not self.stop.is_set():
            for name, ip in self.ips.items():
                try:
                    code, body = post(f"http://{ip}:{ENGINE_PORT}/infer", {"sentences": SENTENCES})
                    if code != 200 or body.get("embeddings") != self.expected[name]:
                        self.problems.append(f"{time.time():.1f} {name}: HTTP {code}, output changed")
                except OSError as e:
                    self.problems.append(f"{time.time():.1f} {name}: {e}")
            for node in self.s.cluster.nodes:
                try:
                    with attach(self.s.model_dir(node), socket_dir=self.s.socket_dir(node), cache_name=CACHE,
                                timeout=10):
                        self.attaches += 1
                except Exception as e:  # noqa: BLE001  (every failure is a finding)
                    self.problems.append(f"{time.time():.1f} attach on {node}: {type(e).__name__}: {e}")
            if self.rounds % 3 == 0:
                ready = condition(self.s.wc(), "Ready")
                if ready.get("status") != "True":
                    self.problems.append(f"{time.time():.1f} cache not Ready: {ready}")
                for p in self.s.daemon_pods():
                    restarts = [c.get("restartCount", 0) for c in p["status"].get("containerStatuses") or []]
                    if any(restarts):
                        self.problems.append(f"{time.time():.1f} {p['metadata']['name']} restarted: {restarts}")
            self.rounds += 1
            self.stop.wait(0.3)


def test_a_daemon_image_upgrade_takes_the_slabs_over_without_a_reload(setup):
    s, nodes = setup, setup.cluster.nodes
    expected = s.infer_all()
    old = {p["metadata"]["name"]: p for p in s.daemon_pods()}
    assert len(old) == len(nodes)
    ds = s.daemonset()
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}

    watch = Watch(s, expected)
    watch.start()
    try:
        # The daemons' image is the admin's: the class's, and every cache of the class rolls.
        s.cluster.kubectl("patch", "wcc", s.class_name, "--type=merge", "-p",
                          json.dumps({"spec": {"daemon": {"image": NEW_IMAGE}}}))

        def rolled():
            pods = s.daemon_pods()
            return pods if (len(pods) == len(nodes) and not set(old) & {p["metadata"]["name"] for p in pods}
                            and all(p["spec"]["containers"][0]["image"] == NEW_IMAGE and is_ready(p)
                                    for p in pods)) else None
        new = wait(rolled, 300, "every node's daemon replaced by the new image, the old pods gone")
        wc = wait(lambda: (lambda o: o if ready_now(o) and condition(o, "Progressing")["status"] == "False"
                           else None)(s.wc()), 120, "the cache Ready and Stable after the roll")
        after = watch.rounds
        wait(lambda: watch.rounds >= after + 3, 60, "a few more rounds of the watch after the roll")
    finally:
        watch.stop.set()
        watch.join(30)
    assert watch.problems == [], watch.problems
    assert watch.rounds > 3 and watch.attaches > 0, (watch.rounds, watch.attaches)

    assert {p["spec"]["nodeName"] for p in new} == set(nodes)
    for p in new:
        node, events = p["spec"]["nodeName"], log_events(s.daemon_log(p))
        assert "taken over" in events and "loading" not in events, (p["metadata"]["name"], events)
        doc = get(f"http://{p['status']['podIP']}:{DAEMON_PORT}/status")
        assert doc["state"] == "ready" and doc["progress"]["total_bytes"] == 0, doc  # nothing read from disk
        (device,) = doc["devices"]
        assert device["load_s"] == 0 and device["fingerprint"] == wc["status"]["fingerprint"], device
        (sock,) = list_sockets(s.socket_dir(node), CACHE)
        status = query_status(sock)
        assert (status.pid, status.load_s) == (doc["pid"], 0.0)
        assert all(c["restartCount"] == 0 for c in p["status"]["containerStatuses"])
    for name, p in old.items():
        events = log_events(s.daemon_log(p))
        assert "handed over" in events and events[-1] == "stopped", (name, events[-5:])

    # A new attach after the roll matches the files on disk byte for byte, on every node.
    for node in nodes:
        with attach(s.model_dir(node), socket_dir=s.socket_dir(node), cache_name=CACHE) as att:
            assert compare_with_disk(att.tensors, s.model_dir(node)) == []
    assert s.infer_all() == expected


def test_a_daemon_pod_deleted_by_hand_comes_back_by_loading(setup):
    s = setup
    expected = s.infer_all()
    victim = s.daemon_pods()[0]
    node = victim["spec"]["nodeName"]
    s.cluster.kubectl("delete", "pod", victim["metadata"]["name"], "-n", s.daemons_ns, "--wait=false")

    def replaced():
        pods = [p for p in s.daemon_pods() if p["spec"]["nodeName"] == node]
        return pods[0] if len(pods) == 1 and pods[0]["metadata"]["uid"] != victim["metadata"]["uid"] \
            and is_ready(pods[0]) else None
    fresh = wait(replaced, 300, f"a new daemon pod Ready on {node}")
    events = log_events(s.daemon_log(fresh))
    assert "loading" in events and "taken over" not in events, events
    doc = get(f"http://{fresh['status']['podIP']}:{DAEMON_PORT}/status")
    assert doc["devices"][0]["load_s"] > 0 and doc["progress"]["loaded_bytes"] > 0, doc
    wait(lambda: ready_now(s.wc()), 120, "the cache Ready again")
    assert s.infer_all() == expected  # the engines kept their mappings through it
    with attach(s.model_dir(node), socket_dir=s.socket_dir(node), cache_name=CACHE) as att:
        assert compare_with_disk(att.tensors, s.model_dir(node)) == []
