"""Model generations: naming, the per-generation DaemonSet, the budget decision, when an
old generation goes, status with two generations, and which generation a pod gets."""

import pytest

from weightcache.operator import generations as g
from weightcache.operator.manifests import daemonset_name, node_label_key
from weightcache.operator.mutation import MutationRefused, mutate_pod
from weightcache.operator.status import FAILED, LOADING, READY, NodeState

GiB = 1 << 30
T0 = "2026-01-01T00:00:00Z"


def cache(revision="r2", path="/m/x", rollout=None, generations=None):
    spec = {"model": {"path": path, "revision": revision}, "backend": "cpu"}
    if rollout:
        spec["rollout"] = rollout
    return {"metadata": {"name": "c", "namespace": "ns", "uid": "u1", "generation": 4}, "spec": spec,
            "status": {"generations": generations or []}}


def observed(revision, slot="a", clients=0, pods=(), nbytes=GiB, state=READY, reason="", message="",
             allowance=None, nodes=2):
    gen = g.Generation(revision, "/m/x")
    ds = g.generation_daemonset(cache(revision), gen, slot, max_device_bytes=allowance)
    ds["status"] = {"desiredNumberScheduled": nodes}
    devices = [{"device": "cpu", "fingerprint": revision * 32, "resident_bytes": nbytes, "attached_clients": clients}]
    states = [NodeState(f"n{i}", state, reason, message, devices if state == READY and i == 0 else
                        ([{**devices[0], "attached_clients": 0}] if state == READY else []),
                        {"total_bytes": nbytes})
              for i in range(nodes)]
    return g.Observed(gen, slot, ds, states, list(pods))


# -- naming ------------------------------------------------------------------------------------
def test_a_generation_is_the_model_path_and_revision():
    a, b = g.Generation("r1", "/m/x"), g.Generation("r2", "/m/x")
    assert a.key != b.key and len(a.key) == 10 and a.key == g.Generation("r1", "/m/x").key
    assert g.Generation("r1", "/m/y").key != a.key
    assert g.desired_generation(cache("r7", "/m/z")) == g.Generation("r7", "/m/z")


def test_slot_a_keeps_the_daemonset_name_and_selector_slot_b_adds_the_slot():
    c = cache()
    a = g.generation_daemonset(c, g.Generation("r1", "/m/x"), "a")
    b = g.generation_daemonset(c, g.Generation("r2", "/m/y"), "b", max_device_bytes=5 * GiB)
    assert a["metadata"]["name"] == daemonset_name("ns", "c") and b["metadata"]["name"] == daemonset_name("ns", "c") + "-b"
    assert a["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "weightcache-daemon",
                                                    "weightcache.io/cache": "c", "weightcache.io/cache-namespace": "ns"}
    assert b["spec"]["selector"]["matchLabels"]["weightcache.io/slot"] == "b"
    assert b["spec"]["template"]["metadata"]["labels"]["weightcache.io/slot"] == "b"
    args = b["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/m/y" and args[args.index("--revision") + 1] == "r2"
    assert args[-2:] == ["--max-device-bytes", str(5 * GiB)] and g.allowance_of(b) == 5 * GiB
    assert g.allowance_of(a) is None
    assert (g.slot_of(a), g.slot_of(b)) == ("a", "b")
    assert g.generation_of_daemonset(b) == g.Generation("r2", "/m/y")
    assert b["metadata"]["labels"][g.GENERATION_LABEL] == g.Generation("r2", "/m/y").key


def test_a_daemonset_from_before_generations_is_read_from_its_arguments():
    from weightcache.operator.manifests import daemonset_for
    legacy = daemonset_for(cache("r1"))
    assert g.generation_of_daemonset(legacy) == g.Generation("r1", "/m/x") and g.slot_of(legacy) == "a"


def test_generation_node_label_keys_differ_per_generation_and_share_the_cache_prefix():
    k1 = g.generation_node_label_key("ns", "c", g.Generation("r1", "/m/x"))
    k2 = g.generation_node_label_key("ns", "c", g.Generation("r2", "/m/x"))
    assert k1 != k2 and k1.startswith(node_label_key("ns", "c") + "-") and len(k1.split("/")[1]) <= 63


@pytest.mark.parametrize("text, value", [("80Gi", 80 * GiB), ("1.5Gi", 3 * GiB // 2), ("2G", 2 * 10**9),
                                         ("512", 512), (4096, 4096)])
def test_byte_quantities(text, value):
    assert g.parse_quantity(text) == value


@pytest.mark.parametrize("bad", ["80GB", "-1Gi", "lots", ""])
def test_a_bad_quantity_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="not a byte quantity"):
        g.parse_quantity(bad)


def test_rollout_defaults_to_in_place():
    assert g.rollout_of({}) == ("InPlace", None)
    assert g.rollout_of({"rollout": {"strategy": "BlueGreen", "memoryBudgetPerGPU": "4Gi"}}) == ("BlueGreen", 4 * GiB)


# -- the decision -------------------------------------------------------------------------------
R1, R2 = g.Generation("r1", "/m/x"), g.Generation("r2", "/m/x")


def test_a_new_cache_gets_slot_a():
    p = g.plan(R2, "InPlace", None, [])
    assert (p.keep, p.delete, p.target_slot, p.waiting) == ([("a", R2, None)], [], "a", None)


def test_a_model_change_nobody_holds_replaces_in_place_under_either_strategy():
    for strategy in ("InPlace", "BlueGreen"):
        p = g.plan(R2, strategy, 10 * GiB, [observed("r1", "b")])
        assert p.keep == [("b", R2, None)] and p.delete == [] and p.waiting is None


def test_in_place_waits_while_engines_hold_the_old_generation_and_says_why():
    p = g.plan(R2, "InPlace", None, [observed("r1", clients=2, pods=["e1"])])
    assert p.keep == [("a", R1, None)] and p.target_slot is None
    reason, message = p.waiting
    assert reason == "WaitingForEngines"
    assert "2 attached client(s)" in message and "e1" in message and "loads from disk" in message


def test_blue_green_loads_beside_the_old_with_what_the_budget_leaves():
    p = g.plan(R2, "BlueGreen", 3 * GiB, [observed("r1", clients=1)])
    assert p.target_slot == "b" and p.waiting is None
    assert p.keep == [("b", R2, 2 * GiB), ("a", R1, None)]


def test_blue_green_without_room_falls_back_to_waiting_and_says_so():
    p = g.plan(R2, "BlueGreen", GiB, [observed("r1", clients=1, nbytes=GiB)])
    assert p.target_slot is None and p.keep == [("a", R1, None)]
    reason, message = p.waiting
    assert reason == "BudgetExceeded" and "1 GiB per GPU" in message and "InPlace" in message


def test_a_daemon_refusing_over_budget_falls_back_then_loads_without_the_limit_once_the_old_is_gone():
    refused = observed("r2", "b", state=FAILED, reason="OverBudget", message="needs 3 GiB", allowance=GiB)
    p = g.plan(R2, "BlueGreen", 2 * GiB, [observed("r1", clients=1), refused])
    assert p.waiting[0] == "OverBudget" and "needs 3 GiB" in p.waiting[1]
    assert p.keep[0] == ("b", R2, GiB)  # kept as it is while the old one is held
    refused = observed("r2", "b", state=FAILED, reason="OverBudget", allowance=GiB)
    p = g.plan(R2, "BlueGreen", 2 * GiB, [observed("r1"), refused])
    assert p.delete == ["a"] and p.keep == [("b", R2, None)] and p.waiting is None


def test_a_generation_loaded_within_its_allowance_keeps_it_after_the_old_goes():
    # Dropping the flag would change the pod template, and the daemons would reload.
    p = g.plan(R2, "BlueGreen", 4 * GiB, [observed("r1"), observed("r2", "b", allowance=3 * GiB)])
    assert p.keep == [("b", R2, 3 * GiB)] and p.delete == ["a"]


def test_the_old_generation_stays_while_an_engine_pod_or_client_holds_it_then_goes():
    new = observed("r2", "b", allowance=GiB)
    assert g.plan(R2, "BlueGreen", 2 * GiB, [observed("r1", pods=["old-0"]), new]).delete == []
    assert g.plan(R2, "BlueGreen", 2 * GiB, [observed("r1", clients=1), new]).delete == []
    assert g.plan(R2, "BlueGreen", 2 * GiB, [observed("r1"), new]).delete == ["a"]


def test_a_ready_daemon_whose_clients_cannot_be_read_holds_its_generation():
    old = observed("r1")
    old.states = [NodeState("n0", READY, "", "ready (status not reachable: timeout)")]
    assert old.held and g.plan(R2, "BlueGreen", 4 * GiB, [old, observed("r2", "b")]).delete == []


def test_a_third_model_while_two_are_held_waits_for_one():
    p = g.plan(g.Generation("r3", "/m/x"), "BlueGreen", 10 * GiB,
               [observed("r1", clients=1), observed("r2", "b", clients=1)])
    assert p.target_slot is None and p.waiting[0] == "WaitingForEngines" and "two generations" in p.waiting[1]


# -- status ----------------------------------------------------------------------------------------
def test_status_lists_both_generations_during_a_move():
    live = [observed("r2", "b", allowance=GiB), observed("r1", clients=3)]
    decided = g.plan(R2, "BlueGreen", 2 * GiB, live)
    entries = g.generations_status(R2, live, decided)
    assert [(e["revision"], e["phase"], e["readyNodes"], e["attachedClients"]) for e in entries] == [
        ("r2", "Active", "2/2", 0), ("r1", "Draining", "2/2", 3)]
    assert entries[0]["daemonSet"] == daemonset_name("ns", "c") + "-b" and entries[1]["fingerprint"] == "r1" * 32
    assert "3 attached client(s)" in entries[1]["message"]
    assert g.rollout_summary(entries) == "r1 Draining 2/2 -> r2 Active 2/2"
    base = {"conditions": [{"type": "Ready", "status": "True", "reason": "AllNodesReady", "message": "2/2"},
                           {"type": "Progressing", "status": "False", "reason": "Stable", "message": ""},
                           {"type": "Degraded", "status": "False", "reason": "NoFailures", "message": ""}]}
    out = g.with_generations(base, entries, decided, 3, [], T0)
    progressing = next(c for c in out["conditions"] if c["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "Draining") and "r1 Draining" in progressing["message"]
    assert out["attachedClients"] == 3 and out["rollout"] == "r1 Draining 2/2 -> r2 Active 2/2"


def test_a_waiting_generation_is_listed_pending_and_the_cache_not_ready():
    live = [observed("r1", clients=1)]
    decided = g.plan(R2, "InPlace", None, live)
    entries = g.generations_status(R2, live, decided)
    assert [(e["revision"], e["phase"]) for e in entries] == [("r2", "Pending"), ("r1", "Active")]
    base = {"conditions": [{"type": "Ready", "status": "True", "reason": "AllNodesReady", "message": "2/2"},
                           {"type": "Progressing", "status": "False", "reason": "Stable", "message": ""}]}
    out = g.with_generations(base, entries, decided, 1, [], T0)
    ready = next(c for c in out["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "WaitingForEngines")
    assert all(c["lastTransitionTime"] == T0 for c in out["conditions"])


def test_over_budget_daemons_count_as_loading_not_failed():
    s = [NodeState("n0", FAILED, "OverBudget", "needs more"), NodeState("n1", FAILED, "ModelNotFound", "gone")]
    assert [x.state for x in g.states_for_status(s)] == [LOADING, FAILED]


# -- which generation a pod gets --------------------------------------------------------------------
def engine(revision=None):
    meta = {"name": "e", "namespace": "ns", "labels": {"weightcache.io/cache": "c"}}
    if revision is not None:
        meta["annotations"] = {g.REVISION_ANNOTATION: revision}
    return {"metadata": meta, "spec": {"containers": [{"name": "main", "image": "x"}]}}


def env_of(pod):
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}


def affinity_key(pod):
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return terms["nodeSelectorTerms"][0]["matchExpressions"][-1]["key"]


def test_a_pod_naming_an_old_revision_gets_that_generation_during_a_move():
    c = cache("r2", generations=[{"revision": "r2", "modelPath": "/m/x", "phase": "Loading"},
                                 {"revision": "r1", "modelPath": "/m/old", "phase": "Draining"}])
    old = mutate_pod(engine("r1"), c)
    assert env_of(old)["WEIGHTCACHE_REVISION"] == "r1" and env_of(old)["WEIGHTCACHE_MODEL_DIR"] == "/m/old"
    assert affinity_key(old) == g.generation_node_label_key("ns", "c", g.Generation("r1", "/m/old"))
    assert old["metadata"]["annotations"][g.GENERATION_LABEL] == g.Generation("r1", "/m/old").key
    new = mutate_pod(engine("r2"), c)
    assert env_of(new)["WEIGHTCACHE_REVISION"] == "r2"
    assert affinity_key(new) == g.generation_node_label_key("ns", "c", R2)
    assert mutate_pod(new, c) == new  # idempotent


def test_a_pod_without_a_revision_gets_the_specs_generation_and_the_cache_wide_label():
    plain = mutate_pod(engine(), cache("r2"))
    assert env_of(plain)["WEIGHTCACHE_REVISION"] == "r2" and affinity_key(plain) == node_label_key("ns", "c")
    assert plain["metadata"]["annotations"][g.GENERATION_LABEL] == R2.key


def test_a_pod_naming_a_revision_nobody_serves_is_refused_naming_what_is_served():
    c = cache("r2", generations=[{"revision": "r1", "modelPath": "/m/x", "phase": "Releasing"}])
    with pytest.raises(MutationRefused, match=r"asks for revision 'r9'.*serves 'r2'"):
        mutate_pod(engine("r9"), c)
    with pytest.raises(MutationRefused, match="asks for revision 'r1'"):  # released: no longer served
        mutate_pod(engine("r1"), c)


# -- managed rollouts: pause while the generation the template needs is not ready ------------------
from weightcache.operator import managed  # noqa: E402


def deployment(revision="r2", paused=False, ours=False, generation=2, observed=2, updated=0, replicas=2):
    ann = {managed.MANAGED_ANNOTATION: "true", **({managed.PAUSED_BY_ANNOTATION: managed.PAUSED_BY} if ours else {})}
    template = {"metadata": {"annotations": {g.REVISION_ANNOTATION: revision}} if revision else {}}
    return {"metadata": {"name": "web", "generation": generation, "annotations": ann},
            "spec": {"replicas": replicas, "paused": paused, "template": template},
            "status": {"observedGeneration": observed, "updatedReplicas": updated, "replicas": replicas}}


def cache_with(*entries, revision="r2"):
    return cache(revision, generations=[{"revision": r, "modelPath": "/m/x", "key": g.Generation(r, "/m/x").key,
                                         "phase": phase, "readyNodes": ready} for r, phase, ready in entries])


def test_a_rollout_waiting_for_a_loading_generation_is_paused_and_resumed_once_it_is_active():
    loading = cache_with(("r2", "Loading", "1/2"), ("r1", "Draining", "2/2"))
    decided = managed.gate(deployment(), loading)
    assert decided.pause and decided.reason == "WaitingForCache" and "1/2" in decided.message
    assert managed.patch_for(deployment(), decided) == {
        "metadata": {"annotations": {managed.PAUSED_BY_ANNOTATION: managed.PAUSED_BY}}, "spec": {"paused": True}}
    assert managed.patch_for(deployment(paused=True, ours=True), decided) is None  # already paused

    active = cache_with(("r2", "Active", "2/2"), ("r1", "Draining", "2/2"))
    decided = managed.gate(deployment(paused=True, ours=True), active)
    assert not decided.pause and decided.reason == "CacheReady"
    assert managed.patch_for(deployment(paused=True, ours=True), decided) == {
        "metadata": {"annotations": {managed.PAUSED_BY_ANNOTATION: None}}, "spec": {"paused": False}}


def test_a_users_own_pause_is_never_undone():
    active = cache_with(("r2", "Active", "2/2"))
    assert managed.patch_for(deployment(paused=True), managed.gate(deployment(paused=True), active)) is None


def test_a_complete_rollout_is_never_paused():
    loading = cache_with(("r2", "Loading", "0/2"))
    assert not managed.gate(deployment(updated=2), loading).pause
    assert managed.gate(deployment(updated=2, generation=3), loading).pause  # a spec it has not seen yet


def test_a_template_naming_an_unserved_revision_pauses_saying_so():
    decided = managed.gate(deployment(revision="r9"), cache_with(("r2", "Active", "2/2")))
    assert decided.pause and decided.reason == "RevisionNotServed" and "'r9'" in decided.message


def test_a_template_without_a_revision_follows_the_specs_generation():
    assert managed.gate(deployment(revision=None), cache_with(("r2", "Pending", "0/0"))).pause
    assert not managed.gate(deployment(revision=None), cache_with(("r2", "Active", "2/2"))).pause


def test_only_annotated_deployments_are_managed():
    d = deployment()
    assert managed.is_managed(d)
    d["metadata"]["annotations"][managed.MANAGED_ANNOTATION] = "false"
    assert not managed.is_managed(d)


# -- stores (source Published) ------------------------------------------------------------------
def test_a_store_moves_to_a_new_model_in_place_without_waiting_for_engines():
    """One store serves every generation (engines of the new revision publish beside the
    old one's tensors), so a model change never waits and never starts a second store
    (which could not start on a node whose store holds the cache's lock)."""
    old = observed("r1", clients=3, pods=["e1"])
    for strategy in (g.IN_PLACE, g.BLUE_GREEN):
        decided = g.plan(g.Generation("r2", "/m/x"), strategy, 10 * GiB, [old], store=True)
        assert decided.keep == [("a", g.Generation("r2", "/m/x"), None)]
        assert decided.delete == [] and decided.target_slot == "a" and decided.waiting is None


def test_a_store_keeps_one_daemonset_and_its_pods_do_not_change_with_the_model():
    left = observed("r1", slot="b")
    decided = g.plan(g.Generation("r2", "/m/x"), g.IN_PLACE, None, [observed("r0", slot="a"), left], store=True)
    assert decided.keep == [("a", g.Generation("r2", "/m/x"), None)] and decided.delete == ["b"]
    c = {**cache(), "spec": {**cache()["spec"], "source": "Published"}}
    r1 = g.generation_daemonset(c, g.Generation("r1", "/m/x"), "a")
    r2 = g.generation_daemonset(c, g.Generation("r2", "/m/y"), "a")
    assert r1["spec"]["template"] == r2["spec"]["template"]  # no roll: only the annotations move
    assert g.generation_of_daemonset(r2) == g.Generation("r2", "/m/y")
