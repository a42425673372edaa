"""Status aggregation: per-node states from pods and daemon reports, counts, reasons,
the fingerprint and bytes, and conditions that keep their transition times."""

import pytest

from weightcache.operator.status import (FAILED, LOADING, READY, NodeState, aggregate, condition, human_bytes,
                                         for_node, merge_conditions, node_state, weight_args)

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def cache(generation=3, status=None):
    return {"metadata": {"name": "c", "namespace": "ns", "generation": generation}, "spec": {}, "status": status or {}}


def ds(desired=2, generation=1, observed=1, updated=None):
    return {"metadata": {"generation": generation},
            "status": {"desiredNumberScheduled": desired, "observedGeneration": observed,
                       "updatedNumberScheduled": desired if updated is None else updated}}


def pod(node, ready=False, phase="Running", waiting=None, last=None, created="2026-01-01T00:00:00Z",
        deleting=False, revision="h1"):
    cs = {"name": "daemon", "state": {"waiting": waiting} if waiting else {"running": {}}}
    if last:
        cs["lastState"] = {"terminated": last}
    meta = {"name": f"d-{node}", "creationTimestamp": created, "labels": {"controller-revision-hash": revision}}
    if deleting:
        meta["deletionTimestamp"] = created
    return {"metadata": meta, "spec": {"nodeName": node},
            "status": {"phase": phase, "containerStatuses": [cs],
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def report(state, fp="f" * 64, nbytes=1000, clients=0, reason="", message="", progress=None):
    devices = [{"device": "cpu", "fingerprint": fp, "resident_bytes": nbytes, "attached_clients": clients}] \
        if state == READY else []
    return {"state": state, "reason": reason, "message": message, "devices": devices,
            "progress": progress or {}}


def test_human_bytes():
    assert human_bytes(0) == "0 B" and human_bytes(1536) == "1.5 KiB"
    assert human_bytes(16 << 30) == "16 GiB" and human_bytes(90856960) == "86.6 MiB"


def test_the_report_wins_over_the_pod():
    s = node_state(pod("n0", ready=False), report(READY, clients=2))
    assert (s.node, s.state) == ("n0", READY) and s.devices[0]["attached_clients"] == 2
    f = node_state(pod("n0", ready=True), report(FAILED, reason="ModelNotFound", message="no /m"))
    assert (f.state, f.reason, f.message) == (FAILED, "ModelNotFound", "no /m")


@pytest.mark.parametrize("waiting, expected", [
    ({"reason": "CrashLoopBackOff", "message": "back-off"}, (FAILED, "CrashLoopBackOff")),
    ({"reason": "ImagePullBackOff"}, (FAILED, "ImagePullBackOff")),
    ({"reason": "ContainerCreating"}, (LOADING, "Starting")),
])
def test_without_a_report_the_container_state_speaks(waiting, expected):
    s = node_state(pod("n1", waiting=waiting, last={"exitCode": 2, "message": "boom"}), None, "refused")
    assert (s.state, s.reason) == expected
    if expected[0] == FAILED:
        assert "last exit code 2: boom" in s.message


def test_a_ready_pod_without_a_reachable_status_counts_ready():
    s = node_state(pod("n0", ready=True), None, "timed out")
    assert s.state == READY and "timed out" in s.message


def test_a_daemon_of_an_older_template_is_not_ready_for_this_spec():
    s = node_state(pod("n0", ready=True, revision="old"), report(READY), current="new")
    assert (s.state, s.reason) == (LOADING, "Outdated")
    assert node_state(pod("n0", revision="new"), report(READY), current="new").state == READY
    failed = node_state(pod("n0", revision="old"), report(FAILED, reason="LoadFailed"), current="new")
    assert failed.state == FAILED


def daemon_pod(node, args, **kw):
    p = pod(node, **kw)
    p["spec"]["containers"] = [{"name": "daemon", "args": args}]
    return p


ARGS = ["daemon", "--model", "/m", "--backend", "cpu", "--revision", "", "--tp-size", "1", "--http-bind", "x:1"]


def test_an_older_template_serving_the_same_weights_stays_ready_until_replaced():
    """Only the image (or env, resources...) changed: the old daemon still serves what the
    spec asks for; another revision does not."""
    same = daemon_pod("n0", ARGS + ["--take-over"], ready=True, revision="old")
    assert node_state(same, report(READY), current="new", current_args=ARGS + ["--take-over"]).state == READY
    other = ["daemon", "--model", "/m", "--backend", "cpu", "--revision", "r2", "--tp-size", "1", "--http-bind", "y:2"]
    s = node_state(same, report(READY), current="new", current_args=other)
    assert (s.state, s.reason) == (LOADING, "Outdated")
    assert weight_args(ARGS) == [("--model", "/m"), ("--backend", "cpu"), ("--revision", ""), ("--tp-size", "1")]


def test_a_node_is_ready_while_either_daemon_of_a_surge_serves():
    old = pod("n0", ready=True, created="2026-01-01T00:00:00Z")
    new = pod("n0", created="2026-01-01T00:05:00Z")
    serving = node_state(old, report(READY))
    # The new pod starting, then taking over, then serving while the old waits for SIGTERM.
    starting = for_node([(old, serving), (new, node_state(new, None, "connection refused"))])
    assert starting.state == READY and "starting beside" in starting.rollout
    taking = for_node([(old, serving), (new, node_state(new, report(LOADING, reason="TakingOver")))])
    assert taking.state == READY and "hand-off in progress" in taking.rollout
    done = for_node([(old, node_state(old, report("handed-over", message="waits"))),
                     (new, node_state(new, report(READY)))])
    assert done.state == READY and "hand-off done" in done.rollout
    assert for_node([(new, node_state(new, report(READY)))]).rollout == ""
    out = aggregate(cache(), ds(desired=1), [taking], T0)
    assert condition(out, "Ready")["status"] == "True"
    progressing = condition(out, "Progressing")
    assert progressing["reason"] == "RollingOut" and "n0: hand-off in progress" in progressing["message"]


def test_without_a_ready_daemon_the_live_newest_speaks():
    old = pod("n0", created="2026-01-01T00:00:00Z")
    new = pod("n0", created="2026-01-01T00:05:00Z")
    dying = pod("n0", created="2026-01-01T00:09:00Z", deleting=True)
    states = [(p, node_state(p, report(LOADING, message=p["metadata"]["creationTimestamp"])))
              for p in (old, dying, new)]
    assert for_node(states).message == "2026-01-01T00:05:00Z"
    assert for_node(states[1:2]).message == "2026-01-01T00:09:00Z"
    handed = node_state(new, report("handed-over"))
    assert (handed.state, handed.reason) == (LOADING, "HandedOver")
    assert for_node([(new, handed), (old, node_state(old, report(FAILED, reason="LoadFailed")))]).state == FAILED


def test_all_ready():
    states = [NodeState("n0", READY, devices=[{"fingerprint": "a" * 64, "resident_bytes": 10 << 20,
                                                "attached_clients": 1}]),
              NodeState("n1", READY, devices=[{"fingerprint": "a" * 64, "resident_bytes": 10 << 20,
                                                "attached_clients": 2}])]
    out = aggregate(cache(), ds(), states, T0)
    assert out["nodes"] == {"desired": 2, "loading": 0, "ready": 2, "failed": 0, "failures": []}
    assert out["readyNodes"] == "2/2" and out["fingerprint"] == "a" * 64
    assert out["bytesPerGPU"] == 10 << 20 and out["size"] == "10 MiB" and out["attachedClients"] == 3
    assert out["observedGeneration"] == 3
    assert condition(out, "Ready")["status"] == "True" and condition(out, "Ready")["reason"] == "AllNodesReady"
    assert condition(out, "Progressing")["status"] == "False"
    assert condition(out, "Degraded")["status"] == "False"
    assert all(c["observedGeneration"] == 3 and c["lastTransitionTime"] == T0 for c in out["conditions"])


def test_a_failed_node_is_degraded_with_its_reason_and_named():
    states = [NodeState("n0", READY, devices=[{"fingerprint": "a" * 64, "resident_bytes": 5}]),
              NodeState("n1", FAILED, "ModelNotFound", "model path /m does not exist")]
    out = aggregate(cache(), ds(), states, T0)
    assert out["nodes"]["failed"] == 1 and out["readyNodes"] == "1/2"
    assert out["nodes"]["failures"] == [{"node": "n1", "reason": "ModelNotFound",
                                         "message": "model path /m does not exist"}]
    d = condition(out, "Degraded")
    assert d["status"] == "True" and d["reason"] == "ModelNotFound" and "n1" in d["message"]
    assert condition(out, "Ready")["reason"] == "NodesFailed"


def test_different_failures_give_a_summary_reason():
    states = [NodeState("n0", FAILED, "ModelNotFound", "x"), NodeState("n1", FAILED, "CrashLoopBackOff", "y")]
    out = aggregate(cache(), ds(), states, T0)
    assert condition(out, "Degraded")["reason"] == "NodesFailed"
    assert out["fingerprint"] == "" and out["bytesPerGPU"] == 0 and out["size"] == ""


def test_loading_shows_progress_and_nodes_without_pods_count_as_loading():
    p = {"loaded_bytes": 512, "total_bytes": 1024, "bytes_per_s": 100.0, "eta_s": 5.1}
    out = aggregate(cache(), ds(desired=3), [NodeState("n0", LOADING, progress=p)], T0)
    assert out["nodes"]["loading"] == 3 and out["readyNodes"] == "0/3"
    prog = condition(out, "Progressing")
    assert prog["status"] == "True" and prog["reason"] == "Loading" and "n0: 50% of 1 KiB, eta 5 s" in prog["message"]
    assert condition(out, "Ready")["reason"] == "NodesLoading"


def test_rollouts_and_outdated_daemons_are_progressing():
    ready = NodeState("n0", READY, devices=[{"fingerprint": "a", "resident_bytes": 1}])
    out = aggregate(cache(), ds(desired=1, generation=2, observed=1), [ready], T0)
    assert condition(out, "Progressing")["reason"] == "RollingOut"
    out = aggregate(cache(), ds(desired=1), [NodeState("n0", LOADING, "Outdated", "older spec")], T0)
    assert condition(out, "Progressing")["reason"] == "RollingOut"


def test_no_matching_nodes_and_operator_problems():
    out = aggregate(cache(), ds(desired=0), [], T0)
    assert condition(out, "Ready")["reason"] == "NoMatchingNodes" and out["readyNodes"] == "0/0"
    out = aggregate(cache(), None, [], T0, problem=("DaemonSetRefused", "forbidden"))
    assert condition(out, "Degraded")["reason"] == "DaemonSetRefused"
    assert condition(out, "Ready")["reason"] == "DaemonSetRefused"


def test_deleting_says_why_in_ready_and_progressing():
    states = [NodeState("n0", READY, devices=[{"fingerprint": "a", "resident_bytes": 1, "attached_clients": 1}])]
    out = aggregate(cache(), ds(desired=1), states, T0, deleting=("DeletionBlocked", "waits for 1 client"))
    assert condition(out, "Progressing")["reason"] == "DeletionBlocked"
    ready = condition(out, "Ready")
    assert (ready["status"], ready["reason"], ready["message"]) == ("False", "Deleting", "waits for 1 client")
    assert out["attachedClients"] == 1


def test_transition_times_survive_unchanged_statuses():
    first = aggregate(cache(), ds(), [NodeState("n0", READY), NodeState("n1", READY)], T0)
    again = aggregate(cache(status=first), ds(), [NodeState("n0", READY), NodeState("n1", READY)], T1)
    assert again == first  # nothing changed: same status, so nothing to write
    worse = aggregate(cache(status=first), ds(), [NodeState("n0", READY), NodeState("n1", FAILED, "X", "y")], T1)
    assert condition(worse, "Ready")["lastTransitionTime"] == T1
    assert condition(worse, "Degraded")["lastTransitionTime"] == T1
    assert condition(worse, "Progressing")["lastTransitionTime"] == T0


def test_merge_conditions_takes_new_fields():
    old = [{"type": "Ready", "status": "True", "reason": "A", "message": "m", "lastTransitionTime": T0}]
    new = [{"type": "Ready", "status": "True", "reason": "B", "message": "n"}]
    assert merge_conditions(old, new, T1) == [{"type": "Ready", "status": "True", "reason": "B", "message": "n",
                                               "lastTransitionTime": T0}]


def test_the_most_common_fingerprint_is_reported_and_bytes_are_per_gpu():
    def dev(fp, n):
        return {"fingerprint": fp, "resident_bytes": n}
    states = [NodeState("n0", READY, devices=[dev("b", 4), dev("b", 6)]), NodeState("n1", READY, devices=[dev("a", 5)])]
    out = aggregate(cache(), ds(), states, T0)
    assert out["fingerprint"] == "b" and out["bytesPerGPU"] == 6


def store_cache(status=None):
    return {**cache(status=status), "spec": {"source": "Published"}}


def store_report(*caches):
    """A ready store's /status: one device, each cache (engine, digest, bytes, clients)."""
    entries = [{"fingerprint": digest, "engine": engine, "resident_bytes": nbytes, "attached_clients": clients,
                "fingerprint_fields": {"engine": engine, "engine_version": "0.32.0", "dtype": "float32"}}
               for engine, digest, nbytes, clients in caches]
    return {"state": READY, "store": True, "reason": "", "message": "", "progress": {},
            "devices": [{"device": "cpu", "fingerprint": "", "resident_bytes": sum(e["resident_bytes"] for e in entries),
                         "attached_clients": sum(e["attached_clients"] for e in entries), "caches": entries}]}


def test_an_empty_store_is_ready_and_says_it_is_empty():
    states = [node_state(pod(n, ready=True), store_report()) for n in ("n1", "n2")]
    st = aggregate(store_cache(), ds(), states, T0)
    ready = condition(st, "Ready")
    assert ready["status"] == "True" and ready["reason"] == "AllNodesReady"
    assert ready["message"] == "store ready on 2/2 nodes; empty: the first engine on each node publishes"
    assert st["caches"] == [] and st["fingerprint"] == "" and st["size"] == "" and st["readyNodes"] == "2/2"
    assert condition(st, "Degraded")["status"] == "False"


def test_published_caches_are_listed_once_per_fingerprint_across_nodes():
    a, b = "a" * 64, "b" * 64
    states = [node_state(pod("n1", ready=True), store_report(("vllm", a, 3 << 20, 2), ("vllm", b, 1 << 20, 0))),
              node_state(pod("n2", ready=True), store_report(("vllm", a, 3 << 20, 1)))]
    st = aggregate(store_cache(), ds(), states, T0)
    assert st["caches"] == [
        {"engine": "vllm", "engineVersion": "0.32.0", "dtype": "float32", "fingerprint": a, "nodes": 2,
         "attachedClients": 3, "bytesPerGPU": 3 << 20, "size": "3 MiB"},
        {"engine": "vllm", "engineVersion": "0.32.0", "dtype": "float32", "fingerprint": b, "nodes": 1,
         "attachedClients": 0, "bytesPerGPU": 1 << 20, "size": "1 MiB"}]
    assert st["attachedClients"] == 3 and st["bytesPerGPU"] == 4 << 20  # the device holds both
    assert condition(st, "Ready")["message"] == (
        "store ready on 2/2 nodes; 2 published: vllm 0.32.0 float32 (3 MiB) on 2/2 nodes, 3 attached; "
        "vllm 0.32.0 float32 (1 MiB) on 1/2 nodes, 0 attached")


def test_a_store_not_serving_yet_is_loading_and_what_it_held_is_not_listed():
    states = [node_state(pod("n1", ready=True), store_report(("vllm", "a" * 64, 10, 1))),
              node_state(pod("n2"), None, "connection refused")]
    st = aggregate(store_cache(), ds(), states, T0)
    assert condition(st, "Ready")["status"] == "False" and condition(st, "Ready")["reason"] == "NodesLoading"
    assert [c["nodes"] for c in st["caches"]] == [1]


def test_a_checkpoint_cache_has_no_caches_list_unless_a_store_left_one():
    states = [node_state(pod("n1", ready=True), report(READY))]
    assert "caches" not in aggregate(cache(), ds(desired=1), states, T0)
    # Switched from Published: the old list is cleared, not left behind by the merge patch.
    assert aggregate(cache(status={"caches": [{"engine": "vllm"}]}), ds(desired=1), states, T0)["caches"] == []
