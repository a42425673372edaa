"""A model revision change on a WeightCache, against the real control plane: BlueGreen
loads the new generation beside the old, lists both in status, moves an engine
Deployment onto it and releases the old one when no engine holds it; InPlace waits
while an engine is attached, then replaces; a budget too small falls back and says so.

The operator runs as a real process with its webhook (scoped to this module's
namespace); the simulator runs the daemons, the agents and `weightcache example-engine`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import wait_for
from cluster.testkit import condition, is_ready, ready_now
from test_cp_operator import start_operator, stop_operator
from weightcache.demo import packaged_model_dir
from weightcache.operator.generations import Generation, generation_node_label_key
from weightcache.operator.manifests import daemonset_name, node_label_key

NS = "wcg"
MODEL = "/m/mini"
ENGINE_PORT = 8000
# A real engine-side client: attaches for REVISION, checks every byte against the files,
# says so, and holds the mapping (and so its attachment) until stdin closes.
HOLD = ("import sys; from weightcache.client import attach, compare_with_disk; "
        "a = attach(sys.argv[1], socket_dir=sys.argv[2], cache_name=sys.argv[3], revision=sys.argv[4], timeout=30); "
        "print('attached', a.fingerprint.revision, len(compare_with_disk(a.tensors, sys.argv[1])), flush=True); "
        "sys.stdin.read()")


def wait(check, timeout: float, what: str):
    return wait_for(check, timeout, what, interval=0.5)


@pytest.fixture(scope="module")
def op(cluster, tmp_path_factory):
    for node in cluster.nodes:
        shutil.copytree(packaged_model_dir(), cluster.node_root(node) / MODEL.lstrip("/"), dirs_exist_ok=True)
    operator, hook = start_operator(cluster, tmp_path_factory.mktemp("generations"), NS, "weightcache-gen",
                                    only_ns=True)
    try:
        yield operator
    finally:
        stop_operator(cluster, operator, hook, NS, workloads="deployments", timeout=90)


# -- helpers ----------------------------------------------------------------------------
def get(cluster, kind: str, name: str) -> dict | None:
    r = cluster.kubectl("get", kind, name, "-n", NS, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def create_cache(cluster, name: str, revision: str, **spec) -> None:
    manifest = {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache", "metadata": {"name": name},
                "spec": {"model": {"path": MODEL, "revision": revision}, "backend": "cpu",
                         "clientPolicy": {"fallback": "error"}, **spec}}
    cluster.kubectl("create", "-n", NS, "-f", "-", input=json.dumps(manifest))


def set_revision(cluster, name: str, revision: str) -> None:
    cluster.kubectl("patch", "wc", name, "-n", NS, "--type=merge", "-p",
                    json.dumps({"spec": {"model": {"revision": revision}}}))


def wait_cache(cluster, name: str, check, what: str, timeout: float = 120) -> dict:
    def probe():
        obj = get(cluster, "wc", name)
        return obj if obj is not None and check(obj) else None
    try:
        return wait(probe, timeout, f"WeightCache {name} {what}")
    except TimeoutError as e:
        raise AssertionError(f"{e}; last seen: {json.dumps((get(cluster, 'wc', name) or {}).get('status'))}") from None


def phases(wc: dict) -> list[tuple[str, str]]:
    return [(g["revision"], g["phase"]) for g in (wc.get("status") or {}).get("generations") or []]


def daemonsets(cluster, name: str) -> dict[str, list[str]]:
    """DaemonSet name -> its daemon's args, for the cache's DaemonSets."""
    items = cluster.kubectl_json("get", "ds", "-n", NS, "-l", f"weightcache.io/cache={name}")["items"]
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]["args"] for d in items}


def revision_of(args: list[str]) -> str:
    return args[args.index("--revision") + 1]


def nodes_labelled(cluster, key: str) -> set[str]:
    return {n["metadata"]["name"] for n in cluster.kubectl_json("get", "nodes")["items"]
            if n["metadata"].get("labels", {}).get(key) == "ready"}


def sockets(cluster, node: str, name: str) -> list[Path]:
    return sorted((cluster.node_root(node) / "run/weightcache" / NS / name).glob("*.sock"))


def events(cluster, name: str, reason: str) -> list[dict]:
    return cluster.kubectl_json("get", "events", "-n", NS, "--field-selector",
                                f"involvedObject.name={name},involvedObject.kind=WeightCache,reason={reason}")["items"]


class Holder:
    """A real engine-side client attached to REVISION on NODE; it checked every byte."""

    def __init__(self, cluster, node: str, name: str, revision: str, log: Path) -> None:
        socket_dir = cluster.node_root(node) / "run/weightcache" / NS / name
        self.err = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD, str(packaged_model_dir()), str(socket_dir), name,
                                      revision], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err)
        self.line = self.proc.stdout.readline().decode().split()
        assert self.line[:1] == ["attached"], f"client did not attach: {Path(log).read_text()[-2000:]}"

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.err.close()


def engine_deployment(name: str, cache: str, revision: str, replicas: int, managed: bool = False) -> dict:
    """`weightcache example-engine` through CACHE, needing REVISION (the template's
    weightcache.io/revision; the webhook gives each pod that generation, and its model
    directory in WEIGHTCACHE_MODEL_DIR)."""
    labels = {"app": name}
    engine = {"name": "engine", "image": "weightcache-engine:test",
              "args": ["example-engine", "--model", "$(WEIGHTCACHE_MODEL_DIR)", "--http-bind", f"$(POD_IP):{ENGINE_PORT}"],
              "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
              "ports": [{"name": "http", "containerPort": ENGINE_PORT}],
              "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1}}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "labels": {**labels, "weightcache.io/cache": cache},
                         "annotations": {"weightcache.io/managed-rollout": "true"} if managed else {}},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                     "template": {"metadata": {"labels": {**labels, "weightcache.io/cache": cache},
                                               "annotations": {"weightcache.io/revision": revision}},
                                  "spec": {"terminationGracePeriodSeconds": 5, "containers": [engine]}}}}


def engine_pods(cluster, app: str) -> list[dict]:
    return cluster.kubectl_json("get", "pods", "-n", NS, "-l", f"app={app}")["items"]


def rolled_out(cluster, name: str, revision: str, replicas: int) -> bool:
    d = get(cluster, "deployment", name)
    st = d.get("status") or {}
    pods = [p for p in engine_pods(cluster, name) if not p["metadata"].get("deletionTimestamp")]
    return (st.get("observedGeneration") == d["metadata"]["generation"] and st.get("updatedReplicas") == replicas
            and st.get("readyReplicas") == replicas and st.get("replicas") == replicas and len(pods) == replicas
            and all(is_ready(p) and p["metadata"]["annotations"]["weightcache.io/revision"] == revision
                    for p in pods))


def engine_env(p: dict) -> dict[str, str]:
    (main,) = [c for c in p["spec"]["containers"] if c["name"] == "engine"]
    return {e["name"]: e.get("value", "") for e in main["env"]}


def engine_status(p: dict) -> dict:
    import urllib.request
    with urllib.request.urlopen(f"http://{p['status']['podIP']}:{ENGINE_PORT}/status", timeout=10) as r:
        return json.loads(r.read())


# -- tests ------------------------------------------------------------------------------
def test_blue_green_loads_beside_the_old_moves_the_engines_and_releases_the_old(cluster, op, tmp_path):
    name, n = "bg", len(cluster.nodes)
    create_cache(cluster, name, "r1", rollout={"strategy": "BlueGreen", "memoryBudgetPerGPU": "1Gi"})
    first = wait_cache(cluster, name, ready_now, "ready with r1")
    assert phases(first) == [("r1", "Active")] and first["status"]["rollout"] == f"r1 Active {n}/{n}"
    cluster.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(engine_deployment("eng", name, "r1", 2)))
    wait(lambda: rolled_out(cluster, "eng", "r1", 2), 180, "the engines on r1")
    wait_cache(cluster, name, lambda o: o["status"]["attachedClients"] == 2, "counting the two engines")

    set_revision(cluster, name, "r2")
    both = wait_cache(cluster, name, lambda o: phases(o) == [("r2", "Active"), ("r1", "Draining")],
                      "with r2 Active beside r1 Draining")
    r1, r2 = Generation("r1", MODEL), Generation("r2", MODEL)
    assert both["status"]["generations"][1]["attachedClients"] == 2
    assert both["status"]["generations"][1]["enginePods"] == 2
    assert both["status"]["rollout"] == f"r1 Draining {n}/{n} -> r2 Active {n}/{n}"
    assert condition(both, "Progressing")["reason"] == "Draining"
    assert {revision_of(a) for a in daemonsets(cluster, name).values()} == {"r1", "r2"}
    assert sorted(daemonsets(cluster, name)) == [daemonset_name(NS, name), daemonset_name(NS, name) + "-b"]
    for node in cluster.nodes:  # two generations of the cache on each node, each with its socket
        assert len(sockets(cluster, node, name)) == 2
    wait(lambda: nodes_labelled(cluster, generation_node_label_key(NS, name, r2)) == set(cluster.nodes), 30,
         "nodes labelled for r2")
    assert nodes_labelled(cluster, generation_node_label_key(NS, name, r1)) == set(cluster.nodes)
    assert nodes_labelled(cluster, node_label_key(NS, name)) == set(cluster.nodes)
    row = cluster.kubectl("get", "wc", name, "-n", NS, "--no-headers").stdout
    assert f"r1 Draining {n}/{n} -> r2 Active {n}/{n}" in row

    # The engines roll to r2: each new pod gets the r2 generation and attaches to it.
    cluster.kubectl("patch", "deployment", "eng", "-n", NS, "--type=merge", "-p", json.dumps(
        {"spec": {"template": {"metadata": {"annotations": {"weightcache.io/revision": "r2"}}}}}))
    wait(lambda: rolled_out(cluster, "eng", "r2", 2), 240, "the engines on r2")
    for p in engine_pods(cluster, "eng"):
        if p["metadata"].get("deletionTimestamp"):
            continue
        assert engine_env(p)["WEIGHTCACHE_REVISION"] == "r2"
        assert p["metadata"]["annotations"]["weightcache.io/generation"] == r2.key
        status = engine_status(p)
        assert status["source"] == "cache", status

    # Nobody holds r1 now: its DaemonSet, sockets and labels go.
    done = wait_cache(cluster, name, lambda o: phases(o) == [("r2", "Active")], "with r2 alone", 120)
    wait(lambda: list(daemonsets(cluster, name)) == [daemonset_name(NS, name) + "-b"], 60, "r1's DaemonSet deleted")
    wait(lambda: all(len(sockets(cluster, node, name)) == 1 for node in cluster.nodes), 60, "r1's sockets gone")
    wait(lambda: nodes_labelled(cluster, generation_node_label_key(NS, name, r1)) == set(), 30, "r1's labels gone")
    assert done["status"]["attachedClients"] == 2 and condition(done, "Progressing")["status"] == "False"
    assert events(cluster, name, "GenerationReleased")

    # The bytes the new generation serves are the files' bytes.
    holder = Holder(cluster, cluster.nodes[0], name, "r2", tmp_path / "holder.log")
    try:
        assert holder.line[1:] == ["r2", "0"]
    finally:
        holder.release()
    cluster.kubectl("delete", "deployment", "eng", "-n", NS, "--wait=true", "--timeout=60s")


def deployment_events(cluster, name: str, reason: str) -> list[dict]:
    return cluster.kubectl_json("get", "events", "-n", NS, "--field-selector",
                                f"involvedObject.name={name},involvedObject.kind=Deployment,reason={reason}")["items"]


def test_a_managed_rollout_waits_paused_until_its_generation_is_ready_everywhere(cluster, op):
    name, (first, second) = "mr", cluster.nodes[:2]
    create_cache(cluster, name, "r1", rollout={"strategy": "BlueGreen", "memoryBudgetPerGPU": "1Gi"})
    wait_cache(cluster, name, ready_now, "ready with r1")
    cluster.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(engine_deployment("web", name, "r1", 2, True)))
    wait(lambda: rolled_out(cluster, "web", "r1", 2), 180, "the engines on r1")
    old_pods = {p["metadata"]["name"] for p in engine_pods(cluster, "web")}

    # r2 lives in another directory, on the first node only for now: its daemon on the
    # second node reports ModelNotFound, so r2 is ready on one node of two.
    shutil.copytree(packaged_model_dir(), cluster.node_root(first) / "m/mini2", dirs_exist_ok=True)
    cluster.kubectl("patch", "wc", name, "-n", NS, "--type=merge", "-p",
                    json.dumps({"spec": {"model": {"path": "/m/mini2", "revision": "r2"}}}))
    wait_cache(cluster, name, lambda o: phases(o)[:1] == [("r2", "Loading")] and
               o["status"]["generations"][0]["readyNodes"] == "1/2", "with r2 ready on one node")

    cluster.kubectl("patch", "deployment", "web", "-n", NS, "--type=merge", "-p", json.dumps(
        {"spec": {"template": {"metadata": {"annotations": {"weightcache.io/revision": "r2"}}}}}))
    paused = wait(lambda: (lambda d: d if d["spec"].get("paused") else None)(get(cluster, "deployment", "web")), 30,
                  "the operator to pause the rollout")
    assert paused["metadata"]["annotations"]["weightcache.io/paused-by"] == "weightcache-operator"
    wait(lambda: deployment_events(cluster, "web", "RolloutPaused"), 30, "a RolloutPaused event")
    assert "ready on 1/2 nodes" in deployment_events(cluster, "web", "RolloutPaused")[0]["message"]
    # Paused, nothing more rolls: at most the one surge pod, on the node where r2 is ready.
    d = get(cluster, "deployment", "web")
    assert (d["status"].get("updatedReplicas") or 0) <= 1
    live = [p for p in engine_pods(cluster, "web") if not p["metadata"].get("deletionTimestamp")]
    assert sum(p["metadata"]["name"] in old_pods for p in live) >= 1
    assert all(p["spec"].get("nodeName") in (None, first) for p in live if p["metadata"]["name"] not in old_pods)

    # r2 becomes ready on the second node too: the operator resumes, the rollout finishes
    # and every new engine attached to r2.
    shutil.copytree(packaged_model_dir(), cluster.node_root(second) / "m/mini2", dirs_exist_ok=True)
    for p in cluster.kubectl_json("get", "pods", "-n", NS, "-l",
                                  f"app.kubernetes.io/name=weightcache-daemon,weightcache.io/cache={name}")["items"]:
        if p["spec"]["nodeName"] == second and "/m/mini2" in p["spec"]["containers"][0]["args"]:
            cluster.kubectl("delete", "pod", p["metadata"]["name"], "-n", NS, "--wait=false")
    wait(lambda: rolled_out(cluster, "web", "r2", 2), 240, "the engines on r2")
    resumed = get(cluster, "deployment", "web")
    assert not resumed["spec"].get("paused") and "weightcache.io/paused-by" not in resumed["metadata"]["annotations"]
    assert deployment_events(cluster, "web", "RolloutResumed")
    for p in engine_pods(cluster, "web"):
        if not p["metadata"].get("deletionTimestamp"):
            assert engine_status(p)["source"] == "cache" and engine_env(p)["WEIGHTCACHE_MODEL_DIR"] == "/m/mini2"
    wait_cache(cluster, name, lambda o: phases(o) == [("r2", "Active")], "with r2 alone once r1 is released")
    cluster.kubectl("delete", "deployment", "web", "-n", NS, "--wait=true", "--timeout=60s")


def test_in_place_waits_while_an_engine_is_attached_then_replaces(cluster, op, tmp_path):
    name = "ip"
    create_cache(cluster, name, "r1")
    wait_cache(cluster, name, ready_now, "ready with r1")
    holder = Holder(cluster, cluster.nodes[0], name, "r1", tmp_path / "holder.log")
    try:
        wait_cache(cluster, name, lambda o: o["status"]["attachedClients"] == 1, "counting the client")
        set_revision(cluster, name, "r2")
        waiting = wait_cache(cluster, name, lambda o: condition(o, "Progressing").get("reason") == "WaitingForEngines",
                             "waiting for the engine")
        message = condition(waiting, "Progressing")["message"]
        assert "InPlace" in message and "1 attached client(s)" in message and "loads from disk" in message
        assert condition(waiting, "Ready")["status"] == "False"
        assert phases(waiting) == [("r2", "Pending"), ("r1", "Active")]
        # Decided in the same pass that wrote the condition: the DaemonSet still serves r1.
        assert [revision_of(a) for a in daemonsets(cluster, name).values()] == ["r1"]
        wait(lambda: events(cluster, name, "WaitingForEngines"), 30, "a WaitingForEngines event")
    finally:
        holder.release()
    replaced = wait_cache(cluster, name, lambda o: ready_now(o) and phases(o) == [("r2", "Active")],
                          "ready with r2 once the engine is gone", 180)
    assert list(daemonsets(cluster, name)) == [daemonset_name(NS, name)]  # replaced in place
    assert [revision_of(a) for a in daemonsets(cluster, name).values()] == ["r2"]
    assert replaced["status"]["generations"][0]["fingerprint"] == replaced["status"]["fingerprint"]


def test_a_budget_too_small_for_both_falls_back_to_waiting_and_says_so(cluster, op, tmp_path):
    name = "bud"
    # The mini model is about 87 MiB per device: 150Mi leaves about 63 MiB beside it.
    create_cache(cluster, name, "r1", rollout={"strategy": "BlueGreen", "memoryBudgetPerGPU": "150Mi"})
    wait_cache(cluster, name, ready_now, "ready with r1")
    holder = Holder(cluster, cluster.nodes[0], name, "r1", tmp_path / "holder.log")
    try:
        wait_cache(cluster, name, lambda o: o["status"]["attachedClients"] == 1, "counting the client")
        set_revision(cluster, name, "r2")
        refused = wait_cache(cluster, name, lambda o: condition(o, "Progressing").get("reason") == "OverBudget",
                             "saying r2 does not fit beside r1")
        message = condition(refused, "Progressing")["message"]
        assert "does not fit the per-GPU budget" in message and "InPlace" in message and "may allocate" in message
        assert phases(refused) == [("r2", "OverBudget"), ("r1", "Active")] or \
            phases(refused) == [("r2", "OverBudget"), ("r1", "Draining")]
        assert condition(refused, "Degraded")["status"] == "False"  # a fallback, not a failure
        wait(lambda: events(cluster, name, "OverBudget"), 30, "an OverBudget event")
        assert nodes_labelled(cluster, generation_node_label_key(NS, name, Generation("r2", MODEL))) == set()
    finally:
        holder.release()
    # The old generation released, the new one loads without the allowance.
    done = wait_cache(cluster, name, lambda o: ready_now(o) and phases(o) == [("r2", "Active")],
                      "ready with r2 once r1 is released", 180)
    (args,) = daemonsets(cluster, name).values()
    assert revision_of(args) == "r2" and "--max-device-bytes" not in args
    assert condition(done, "Progressing")["status"] == "False"


def test_a_budget_smaller_than_the_old_generation_says_so_before_loading(cluster, op, tmp_path):
    name = "tiny"
    create_cache(cluster, name, "r1", rollout={"strategy": "BlueGreen", "memoryBudgetPerGPU": "10Mi"})
    wait_cache(cluster, name, ready_now, "ready with r1")
    holder = Holder(cluster, cluster.nodes[0], name, "r1", tmp_path / "holder.log")
    try:
        set_revision(cluster, name, "r2")
        wc = wait_cache(cluster, name, lambda o: condition(o, "Progressing").get("reason") == "BudgetExceeded",
                        "saying the budget leaves no room")
        assert "budget is 10 MiB" in condition(wc, "Progressing")["message"]
        assert len(daemonsets(cluster, name)) == 1
        wait(lambda: events(cluster, name, "BudgetExceeded"), 30, "a BudgetExceeded event")
    finally:
        holder.release()
    wait_cache(cluster, name, lambda o: ready_now(o) and phases(o) == [("r2", "Active")], "ready with r2", 180)


def test_blue_green_without_a_budget_is_refused_by_the_schema(cluster, op):
    manifest = {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache", "metadata": {"name": "nob"},
                "spec": {"model": {"path": MODEL}, "backend": "cpu", "rollout": {"strategy": "BlueGreen"}}}
    r = cluster.kubectl("create", "-n", NS, "-f", "-", input=json.dumps(manifest), check=False)
    assert r.returncode != 0 and "BlueGreen needs memoryBudgetPerGPU" in r.stderr, r.stderr
    manifest["spec"]["rollout"] = {"strategy": "BlueGreen", "memoryBudgetPerGPU": "80GB"}
    r = cluster.kubectl("create", "-n", NS, "-f", "-", input=json.dumps(manifest), check=False)
    assert r.returncode != 0 and "memoryBudgetPerGPU" in r.stderr, r.stderr
