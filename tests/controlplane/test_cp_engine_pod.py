"""An engine pod built by hand the way the webhook will build it (agent as a native
sidecar, the WEIGHTCACHE_* env, the socket directory and model mounted read-only)
beside a daemon pod serving the packaged all-MiniLM-L6-v2 on the cpu backend.

The sidecar holds the engine back until the node's cache answers; the engine then
attaches (its report says `cache`), becomes Ready and answers /infer exactly as an
engine that loaded from disk; an agent whose fingerprint disagrees fails with its
reason in the pod status."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import pytest

from cluster import wait_for
from cluster.procs import free_port
from cluster.testkit import apply, container, container_status, get, is_ready, pod, pod_ip_env, wait_pod
from weightcache.demo import packaged_model_dir

CACHE = "mini"
REVISION = "r1"
REPORT_DIR = "/run/weightcache-report"
SENTENCES = ["A restarting engine maps its weights instead of reading them.", "Hello."]


def call(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def reachable(url: str):
    try:
        return call(url)
    except OSError:
        return None


# -- the manifests (as the operator and its webhook will build them) ----------------------
def socket_dir(ns: str) -> str:
    return f"/run/weightcache/{ns}/{CACHE}"


def model_path(ns: str) -> str:
    return f"/models/{ns}/minilm"  # per test namespace: nodes are shared across tests


def volumes(ns: str) -> list[dict]:
    return [{"name": "wc-sockets", "hostPath": {"path": socket_dir(ns), "type": "DirectoryOrCreate"}},
            {"name": "wc-model", "hostPath": {"path": model_path(ns), "type": "Directory"}}]


def daemon_pod(ns: str, node: str) -> dict:
    c = container("daemon", "weightcache-daemon:test",
                  args=["daemon", "--backend", "cpu", "--model", model_path(ns), "--socket-dir", socket_dir(ns),
                        "--name", CACHE, "--revision", REVISION],
                  securityContext={"privileged": True}, env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
                  volumeMounts=[{"name": "wc-sockets", "mountPath": socket_dir(ns)},
                                {"name": "wc-model", "mountPath": model_path(ns), "readOnly": True}])
    return pod("wc-daemon", [c], nodeSelector={"kubernetes.io/hostname": node}, volumes=volumes(ns))


def engine_mounts(ns: str) -> list[dict]:
    return [{"name": "wc-sockets", "mountPath": socket_dir(ns), "readOnly": True},
            {"name": "wc-model", "mountPath": model_path(ns), "readOnly": True},
            {"name": "wc-report", "mountPath": REPORT_DIR}]


def agent_sidecar(ns: str, port: int, revision: str) -> dict:
    probe = {"httpGet": {"path": "/ready", "port": port}, "periodSeconds": 1}
    return container("weightcache-agent", "weightcache-engine:test",
                     args=["agent", "--socket-dir", socket_dir(ns), "--cache", CACHE, "--model", model_path(ns),
                           "--revision", revision, "--http-bind", f"$(POD_IP):{port}",
                           "--report-file", f"{REPORT_DIR}/engine.json"],
                     env=pod_ip_env(), restartPolicy="Always", terminationMessagePolicy="FallbackToLogsOnError",
                     startupProbe={**probe, "failureThreshold": 600}, readinessProbe=probe,
                     volumeMounts=engine_mounts(ns))


def client_env(ns: str) -> list[dict]:
    values = {"WEIGHTCACHE_MODE": "client", "WEIGHTCACHE_FALLBACK": "error", "WEIGHTCACHE_SOCKET_DIR": socket_dir(ns),
              "WEIGHTCACHE_CACHE_NAME": CACHE, "WEIGHTCACHE_MODEL_DIR": model_path(ns),
              "WEIGHTCACHE_REVISION": REVISION, "WEIGHTCACHE_DEVICE": "cpu", "WEIGHTCACHE_TP_SIZE": "1",
              "WEIGHTCACHE_REPORT_FILE": f"{REPORT_DIR}/engine.json"}
    return [{"name": k, "value": v} for k, v in values.items()]


def engine_container(ns: str, port: int, env: list[dict]) -> dict:
    return container("engine", "weightcache-engine:test",
                     args=["example-engine", "--model", model_path(ns), "--http-bind", f"$(POD_IP):{port}"],
                     env=pod_ip_env() + env, volumeMounts=engine_mounts(ns),
                     readinessProbe={"httpGet": {"path": "/ready", "port": port}, "periodSeconds": 1})


def engine_pod(name: str, ns: str, node: str, agent_port: int, engine_port: int, revision: str = REVISION) -> dict:
    return pod(name, [engine_container(ns, engine_port, client_env(ns))],
               initContainers=[agent_sidecar(ns, agent_port, revision)],
               nodeSelector={"kubernetes.io/hostname": node},
               volumes=volumes(ns) + [{"name": "wc-report", "emptyDir": {}}])


def disk_engine_pod(ns: str, node: str, port: int) -> dict:
    env = [{"name": "WEIGHTCACHE_MODE", "value": "off"}]
    return pod("disk-engine", [engine_container(ns, port, env)], nodeSelector={"kubernetes.io/hostname": node},
               volumes=volumes(ns) + [{"name": "wc-report", "emptyDir": {}}])


# -- the tests ----------------------------------------------------------------------------
def agent_status(p: dict) -> dict:
    for s in (p.get("status") or {}).get("initContainerStatuses") or []:
        if s["name"] == "weightcache-agent":
            return s
    return {}


@pytest.fixture(scope="module")
def node_ns(cluster):
    """A short namespace (socket paths under the node root must fit 107 bytes) and a node
    whose hostPath holds the model."""
    ns, node = f"wce-{uuid.uuid4().hex[:6]}", cluster.nodes[0]
    cluster.create_namespace(ns)
    link = cluster.node_root(node) / model_path(ns).lstrip("/")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(packaged_model_dir(), target_is_directory=True)
    yield ns, node
    cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_sidecar_gates_the_engine_until_the_cache_is_ready_then_it_attaches(cluster, node_ns):
    ns, node = node_ns
    agent_port, engine_port, disk_port = free_port(), free_port(), free_port()
    apply(cluster, ns, engine_pod("engine", ns, node, agent_port, engine_port))
    apply(cluster, ns, disk_engine_pod(ns, node, disk_port))

    # No daemon yet: the agent runs and says why it is not ready; the engine has not started.
    p = wait_pod(cluster, ns, "engine", lambda p: p["status"].get("podIP") and
                 agent_status(p).get("state", {}).get("running"), "agent running", timeout=60)
    agent_url = f"http://{p['status']['podIP']}:{agent_port}"
    status, doc = wait_for(lambda: reachable(agent_url + "/ready"), 60, "the agent answering")
    assert status == 503 and doc["reason"] == "NoSocket" and doc["engine"] is None
    p = get(cluster, ns, "pod", "engine")
    assert not is_ready(p) and set(container_status(p, "engine")["state"]) == {"waiting"}

    apply(cluster, ns, daemon_pod(ns, node))
    p = wait_pod(cluster, ns, "engine", is_ready, "ready after the cache", timeout=240)
    engine = container_status(p, "engine")
    assert engine["restartCount"] == 0  # fallback=error: it started only once the cache answered
    assert agent_status(p)["started"] and agent_status(p)["ready"]

    engine_url = f"http://{p['status']['podIP']}:{engine_port}"
    status, doc = call(engine_url + "/status")
    assert doc["source"] == "cache" and doc["reason"].startswith("attached to ")

    def attached():
        doc = call(agent_url + "/status")[1]
        return doc if doc["attached_clients"] == 1 and doc["engine"] else None
    doc = wait_for(attached, 30, "the agent seeing the engine attached")
    assert doc["ready"] and doc["engine"]["source"] == "cache"
    assert doc["engine"]["fingerprint"] == doc["daemon"]["fingerprint"]

    d = wait_pod(cluster, ns, "disk-engine", is_ready, "ready", timeout=240)
    disk_url = f"http://{d['status']['podIP']}:{disk_port}"
    assert call(disk_url + "/status")[1]["source"] == "disk"
    for output, key in [("mean", "embeddings"), ("last_hidden_state", "last_hidden_state")]:
        a = call(engine_url + "/infer", {"sentences": SENTENCES, "output": output})
        b = call(disk_url + "/infer", {"sentences": SENTENCES, "output": output})
        assert a[0] == b[0] == 200
        assert a[1]["source"] == "cache" and b[1]["source"] == "disk" and a[1][key] == b[1][key]


def test_fingerprint_disagreement_fails_the_agent_with_its_reason_in_the_pod_status(cluster, node_ns):
    ns, node = node_ns
    apply(cluster, ns, daemon_pod(ns, node))  # the same daemon as above, or this test's own
    apply(cluster, ns, engine_pod("wrong", ns, node, free_port(), free_port(), revision="r2"))

    def failed_with_message(p):
        s = agent_status(p)
        term = s.get("lastState", {}).get("terminated") or s.get("state", {}).get("terminated") or {}
        return term.get("message") and term
    term = wait_pod(cluster, ns, "wrong", failed_with_message, "the agent failing with a message", timeout=120)
    term = failed_with_message(term)
    assert term["exitCode"] == 3
    assert "FingerprintMismatch" in term["message"]
    assert "revision: --model gives 'r2', daemon has 'r1'" in term["message"]
    p = get(cluster, ns, "pod", "wrong")
    assert not is_ready(p) and set(container_status(p, "engine")["state"]) == {"waiting"}
