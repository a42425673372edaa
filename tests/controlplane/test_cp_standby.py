"""Hot standby against the real control plane: the operator (a local process) keeps one
standby per primary of an example-engine Deployment annotated
`weightcache.io/hot-standby: "1"`, on the primary's node, attached to the same resident
weights, Ready and out of the Service. Killing the primary's engine process (SIGKILL,
found by the pid its /status reports) or deleting the primary pod promotes the standby:
the Service's EndpointSlice lists it, it answers /infer as the primary did, the
ReplicaSet removes the dead primary, and a new standby appears. A scale-down promotes
nothing. The GPU-sharing standby specs (device plugin, DRA) are accepted by the apiserver.

Short names on purpose: socket paths under the node root must fit 107 bytes."""

from __future__ import annotations

import json
import uuid

import pytest

from cluster import wait_for
from standbykit import (ENGINE_PORT, ROLE, STANDBY_FOR, Env, EndpointsWatch, engine_deployment, http, is_ready,
                        kill_engine, service)
from weightcache.demo import packaged_model_dir
from weightcache.operator import standby as sb

CACHE, APP = "mini", "eng"
MODEL = "/m/sb/mini"
SENTENCES = ["A standby takes over without reading a byte from disk.", "Hello."]
pytestmark = pytest.mark.timeout(900)


def wait(check, timeout: float, what: str):
    return wait_for(check, timeout, what, interval=0.3)


@pytest.fixture(scope="module")
def env(cluster, tmp_path_factory):
    e = Env(cluster, tmp_path_factory.mktemp("standby"), f"wsb-{uuid.uuid4().hex[:4]}")
    node = cluster.nodes[0]
    e.node = node
    try:
        e.start()
        e.put_model(node, packaged_model_dir(), MODEL)
        e.create_cache(CACHE, MODEL, node)
        e.wait_cache_ready(CACHE)
        e.apply(service(APP))
        e.slices = EndpointsWatch(cluster, e.ns, {"app": APP})
        yield e
    finally:
        if getattr(e, "slices", None):
            e.slices.stop()
        e.stop()


def primaries(env) -> list[dict]:
    return [p for p in env.pods(f"app={APP}") if not p["metadata"].get("deletionTimestamp")]


def standbys(env) -> list[dict]:
    return [p for p in env.pods(f"{ROLE}=standby") if not p["metadata"].get("deletionTimestamp")]


def ready_pair(env, replicas: int = 1) -> tuple[list[dict], list[dict]]:
    """Wait for REPLICAS Ready primaries, each with one Ready standby; return both lists."""
    def check():
        ps, ss = primaries(env), standbys(env)
        if len(ps) != replicas or not all(is_ready(p) for p in ps):
            return None
        if len(ss) != replicas or not all(is_ready(s) for s in ss):
            return None
        if {s["metadata"]["labels"][STANDBY_FOR] for s in ss} != {p["metadata"]["name"] for p in ps}:
            return None
        return ps, ss
    try:
        return wait(check, 300, f"{replicas} Ready primaries with one Ready standby each")
    except TimeoutError as e:
        raise AssertionError(f"{e}\nprimaries: {[(p['metadata']['name'], is_ready(p)) for p in primaries(env)]}\n"
                             f"standbys: {[(s['metadata']['name'], is_ready(s)) for s in standbys(env)]}\n"
                             f"{env.operator_log()}") from None


def infer(pod: dict) -> dict:
    status, doc = http(f"http://{pod['status']['podIP']}:{ENGINE_PORT}/infer", {"sentences": SENTENCES})
    assert status == 200, doc
    return doc


def promoted(env, standby: dict, dead: str) -> dict:
    """Wait until STANDBY is a primary of the Deployment's ReplicaSet and in the Service."""
    name, ip = standby["metadata"]["name"], standby["status"]["podIP"]
    env.slices.wait(lambda ready: ip in ready, 0, 120, f"{name} ({ip}) listed ready")

    def adopted():
        p = env.get("pod", name)
        owner = sb.controller_of(p or {"metadata": {}})
        return p if owner and owner["kind"] == "ReplicaSet" else None
    p = wait(adopted, 60, f"{name} adopted by the ReplicaSet")
    labels = p["metadata"]["labels"]
    assert labels["app"] == APP and labels[ROLE] == "primary" and STANDBY_FOR not in labels, labels
    assert p["metadata"]["annotations"][sb.PROMOTED_FROM_ANNOTATION] == dead
    return p


def test_1_a_standby_runs_beside_each_primary_ready_attached_and_out_of_the_service(env):
    before = env.daemon_status(CACHE)["devices"][0]
    env.apply(engine_deployment(APP, MODEL, CACHE, standbys=1))
    (primary,), (standby,) = ready_pair(env)
    assert standby["spec"]["nodeName"] == primary["spec"]["nodeName"] == env.node
    labels = standby["metadata"]["labels"]
    # Not the template's labels (so neither the ReplicaSet nor the Service selects it);
    # the apiserver adds the node's topology labels on binding (PodTopologyLabels).
    assert "app" not in labels and "pod-template-hash" not in labels, labels
    assert {k: v for k, v in labels.items() if k.startswith("weightcache.io/")} == {
        "weightcache.io/cache": CACHE, ROLE: "standby", STANDBY_FOR: primary["metadata"]["name"]}
    owner = sb.controller_of(standby)
    assert owner["kind"] == "Deployment" and owner["name"] == APP
    # Went through the webhook like any engine pod: the agent sidecar, the client env.
    assert [c["name"] for c in standby["spec"]["initContainers"]] == ["weightcache-agent"]
    assert standby["metadata"]["annotations"]["weightcache.io/mutated"] == CACHE
    # Attached to the resident weights: the same fingerprint, no new weight memory.
    _, doc = http(f"http://{standby['status']['podIP']}:{ENGINE_PORT}/status")
    assert doc["source"] == "cache", doc
    after = wait(lambda: (lambda d: d if d["attached_clients"] == 2 else None)(env.daemon_status(CACHE)["devices"][0]),
                 60, "the daemon counting primary and standby attached")
    assert after["resident_bytes"] == before["resident_bytes"] and after["fingerprint"] == before["fingerprint"]
    # Ready, yet not in the Service: only the primary is an endpoint.
    env.slices.wait(lambda ready: ready == {primary["status"]["podIP"]}, 0, 60, "only the primary listed")
    assert standby["status"]["podIP"] not in env.slices.ready()


def test_2_killing_the_primary_engine_promotes_its_standby(env):
    (primary,), (standby,) = ready_pair(env)
    expected = infer(primary)
    kill_engine(primary)
    p = promoted(env, standby, primary["metadata"]["name"])
    assert infer(p) == expected  # the same weights, the same answers
    # The ReplicaSet, one pod over, removes the dead primary itself (not the operator).
    wait(lambda: env.get("pod", primary["metadata"]["name"]) is None, 120, "the dead primary removed")
    (now,), (new_standby,) = ready_pair(env)
    assert now["metadata"]["name"] == p["metadata"]["name"]
    assert new_standby["metadata"]["labels"][STANDBY_FOR] == p["metadata"]["name"]
    assert new_standby["spec"]["nodeName"] == p["spec"]["nodeName"]
    (event, *_) = wait(lambda: env.events("Deployment", APP, "StandbyPromoted"), 60, "a StandbyPromoted Event")
    assert standby["metadata"]["name"] in event["message"] and primary["metadata"]["name"] in event["message"]
    assert env.slices.ready() == {p["status"]["podIP"]}
    # Through the Service (the simulator's kube-proxy): the promoted pod answers.
    ip = env.get("service", APP)["spec"]["clusterIP"]
    assert http(f"http://{ip}:80/infer", {"sentences": SENTENCES}) == (200, expected)


def test_3_deleting_the_primary_pod_promotes_its_standby(env):
    (primary,), (standby,) = ready_pair(env)
    env.cluster.kubectl("delete", "pod", primary["metadata"]["name"], "-n", env.ns, "--wait=false")
    p = promoted(env, standby, primary["metadata"]["name"])
    assert infer(p)["embeddings"]
    (now,), (new_standby,) = ready_pair(env)
    assert now["metadata"]["name"] == p["metadata"]["name"]
    # No replacement that the ReplicaSet started meanwhile is left over.
    wait(lambda: len(env.pods(f"app={APP}")) == 1, 120, "one primary pod left")


def test_4_scale_down_promotes_nothing(env):
    promotions = len(env.events("Deployment", APP, "StandbyPromoted"))
    env.cluster.kubectl("scale", "deployment", APP, "-n", env.ns, "--replicas=2")
    ready_pair(env, 2)
    env.cluster.kubectl("scale", "deployment", APP, "-n", env.ns, "--replicas=1")
    (primary,), (standby,) = ready_pair(env, 1)
    assert standby["metadata"]["labels"][STANDBY_FOR] == primary["metadata"]["name"]
    assert len(env.events("Deployment", APP, "StandbyPromoted")) == promotions
    assert not env.pods(f"{ROLE}=primary,app={APP}") or all(
        p["metadata"]["name"] == primary["metadata"]["name"] for p in env.pods(f"{ROLE}=primary"))


# -- GPU sharing, at the API level ---------------------------------------------------------
def test_5_the_apiserver_accepts_gpu_sharing_standbys(env):
    """Device plugin: no nvidia.com/gpu request, the primary's UUIDs in
    NVIDIA_VISIBLE_DEVICES, bound by nodeName. DRA: the primary's claim by name, pinned
    to the node by affinity. Created with dryRun (no webhook, no pods run)."""
    c = env.cluster
    container = {"name": "engine", "image": "registry.k8s.io/pause:3.10",
                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    rs = {"metadata": {"name": "gpu-abc", "uid": "rs-uid", "labels": {"pod-template-hash": "abc"}},
          "spec": {"replicas": 1, "template": {"metadata": {"labels": {"app": "gpu", "pod-template-hash": "abc",
                                                                       "weightcache.io/cache": CACHE}},
                                               "spec": {"containers": [container]}}}}
    dep = {"metadata": {"name": "gpu", "namespace": env.ns, "uid": "3f1c5a9e-0000-4000-8000-000000000001"}}
    primary = {"metadata": {"name": "gpu-abc-x"}, "spec": {"nodeName": env.node}, "status": {}}
    pod = sb.standby_pod(dep, rs, primary, ["GPU-0000-aaaa"])
    pod["metadata"]["labels"].pop("weightcache.io/cache")  # stay clear of the webhook in a dry run
    out = json.loads(c.kubectl("create", "-n", env.ns, "--dry-run=server", "-o", "json", "-f", "-",
                               input=json.dumps(pod)).stdout)
    (engine,) = out["spec"]["containers"]
    assert "nvidia.com/gpu" not in json.dumps(engine.get("resources") or {})
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "GPU-0000-aaaa"} in engine["env"]
    assert out["spec"]["nodeName"] == env.node

    dra = json.loads(json.dumps(rs))
    dra["spec"]["template"]["spec"] = {
        "containers": [{"name": "engine", "image": "registry.k8s.io/pause:3.10", "resources": {"claims": [{"name": "gpu"}]}}],
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]}
    primary["status"] = {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "gpu-abc-x-gpu-7k2qz"}]}
    pod = sb.standby_pod(dep, dra, primary)
    pod["metadata"]["labels"].pop("weightcache.io/cache")
    out = json.loads(c.kubectl("create", "-n", env.ns, "--dry-run=server", "-o", "json", "-f", "-",
                               input=json.dumps(pod)).stdout)
    assert out["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimName": "gpu-abc-x-gpu-7k2qz"}]
    assert "nodeName" not in out["spec"]
    terms = out["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][-1]["values"] == [env.node]
