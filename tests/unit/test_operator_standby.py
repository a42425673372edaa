"""Hot standby's pure part: the standby pod built from a ReplicaSet's template, the
promotion patch, when a primary counts as dead, and the plan of one pass (which standby
is promoted, which are created, re-pointed or deleted, and the cases that must promote
nothing: start-up, a readiness flap, a scale-down, a rollout)."""

import json

import pytest

from weightcache.operator import standby as sb

T0 = "2026-11-29T10:00:00Z"
T1 = "2026-11-29T10:00:05Z"
T2 = "2026-11-29T10:00:10Z"
T3 = "2026-11-29T10:00:20Z"


def deployment(n="1", replicas=1, **template_labels):
    labels = {"app": "eng", "weightcache.io/cache": "mini", **template_labels}
    annotations = {"deployment.kubernetes.io/revision": "2"}
    if n is not None:
        annotations[sb.HOT_STANDBY_ANNOTATION] = n
    return {"metadata": {"name": "eng", "namespace": "ns", "uid": "dep-uid", "annotations": annotations},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "eng"}},
                     "template": {"metadata": {"labels": labels}, "spec": {}}}}


def replicaset(replicas=1, hash_="h2", revision="2", spec=None):
    labels = {"app": "eng", "weightcache.io/cache": "mini", "pod-template-hash": hash_}
    return {"metadata": {"name": f"eng-{hash_}", "uid": f"rs-{hash_}", "labels": {"pod-template-hash": hash_},
                         "annotations": {"deployment.kubernetes.io/revision": revision},
                         "ownerReferences": [{"kind": "Deployment", "name": "eng", "uid": "dep-uid", "controller": True}]},
            "spec": {"replicas": replicas, "template": {
                "metadata": {"labels": labels, "annotations": {"prometheus.io/scrape": "true"}},
                "spec": spec or {"containers": [{"name": "engine", "image": "weightcache-engine:1",
                                                 "resources": {"requests": {"cpu": "1"}}}]}}}}


def ready_cond(ok, since=T0):
    return {"type": "Ready", "status": "True" if ok else "False", "lastTransitionTime": since}


def primary(name="eng-h2-a", ready=True, node="n0", hash_="h2", created=T0, state=None, last=None,
            since=T0, deleting=None, restarts=0):
    status = {"phase": "Running", "podIP": "127.0.0.9", "conditions": [ready_cond(ready, since)],
              "containerStatuses": [{"name": "engine", "ready": ready, "restartCount": restarts,
                                     "state": state or {"running": {"startedAt": T0}},
                                     "lastState": {"terminated": last} if last else {}}]}
    meta = {"name": name, "uid": f"uid-{name}", "creationTimestamp": created, "resourceVersion": "7",
            "labels": {"app": "eng", "weightcache.io/cache": "mini", "pod-template-hash": hash_},
            "ownerReferences": [{"kind": "ReplicaSet", "name": f"eng-{hash_}", "uid": f"rs-{hash_}", "controller": True}]}
    if deleting:
        meta["deletionTimestamp"] = deleting
    return {"metadata": meta, "spec": {"nodeName": node}, "status": status}


def standby_of(p, name="eng-h2-standby-x", ready=True, node="n0", since=T1):
    pod = sb.standby_pod(deployment(), replicaset(), p)
    pod["metadata"].update(name=name, uid=f"uid-{name}", resourceVersion="11", creationTimestamp=T1)
    pod["spec"]["nodeName"] = node
    pod["status"] = {"phase": "Running", "conditions": [ready_cond(ready, since)]}
    return pod


# -- the annotation ----------------------------------------------------------------------
@pytest.mark.parametrize("value, n", [(None, 0), ("0", 0), ("1", 1), (" 2 ", 2), ("8", 8)])
def test_wanted_standbys_reads_the_annotation(value, n):
    assert sb.wanted_standbys(deployment(value)) == n


@pytest.mark.parametrize("value", ["-1", "one", "1.5", "9", ""])
def test_a_bad_annotation_is_refused_naming_it(value):
    with pytest.raises(sb.StandbyRefused, match=r"weightcache.io/hot-standby=.*whole number .* 0 to 8"):
        sb.wanted_standbys(deployment(value))


def test_a_template_without_the_cache_label_is_refused():
    d = deployment()
    del d["spec"]["template"]["metadata"]["labels"]["weightcache.io/cache"]
    with pytest.raises(sb.StandbyRefused, match="no weightcache.io/cache label"):
        sb.wanted_standbys(d)


def test_a_selector_on_the_cache_label_alone_is_refused():
    d = deployment()
    d["spec"]["selector"] = {"matchLabels": {"weightcache.io/cache": "mini"}}
    with pytest.raises(sb.StandbyRefused, match="select the pods by a label of their own"):
        sb.wanted_standbys(d)
    d["spec"]["selector"] = {"matchExpressions": [{"key": "app", "operator": "In", "values": ["eng"]}]}
    assert sb.wanted_standbys(d) == 1


# -- the standby pod ---------------------------------------------------------------------
def test_standby_is_the_template_bound_to_the_primarys_node_without_its_labels():
    pod = sb.standby_pod(deployment(), replicaset(), primary())
    meta = pod["metadata"]
    assert meta["generateName"] == "eng-h2-standby-" and meta["namespace"] == "ns"
    assert meta["labels"] == {"weightcache.io/cache": "mini", sb.ROLE_LABEL: "standby", sb.STANDBY_FOR_LABEL: "eng-h2-a"}
    assert json.loads(meta["annotations"][sb.TEMPLATE_LABELS_ANNOTATION]) == {
        "app": "eng", "weightcache.io/cache": "mini", "pod-template-hash": "h2"}
    assert meta["annotations"]["prometheus.io/scrape"] == "true"  # the template's own annotations stay
    assert meta["annotations"][sb.DEPLOYMENT_ANNOTATION] == "eng"
    assert meta["ownerReferences"] == [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "eng",
                                        "uid": "dep-uid", "controller": True}]
    assert pod["spec"]["nodeName"] == "n0"
    assert pod["spec"]["containers"] == replicaset()["spec"]["template"]["spec"]["containers"]


def test_device_plugin_gpus_are_shared_by_uuid_not_requested():
    spec = {"containers": [{"name": "engine", "image": "e", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "x"}],
                            "resources": {"limits": {"nvidia.com/gpu": "2", "memory": "8Gi"},
                                          "requests": {"nvidia.com/gpu": "2"}}},
                           {"name": "sidecar", "image": "s"}]}
    pod = sb.standby_pod(deployment(), replicaset(spec=spec), primary(), ["GPU-a", "GPU-b"])
    engine, sidecar = pod["spec"]["containers"]
    assert engine["resources"] == {"limits": {"memory": "8Gi"}}
    assert engine["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "GPU-a,GPU-b"}]
    assert sidecar == {"name": "sidecar", "image": "s"}
    assert pod["spec"]["nodeName"] == "n0"


def test_device_plugin_gpus_wait_for_the_primary_to_report_them():
    spec = {"containers": [{"name": "engine", "image": "e", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    with pytest.raises(sb.NotYet, match="GPU UUIDs"):
        sb.standby_pod(deployment(), replicaset(spec=spec), primary(), [])


def test_dra_claims_point_at_the_primarys_claim_and_the_pod_is_pinned_by_affinity():
    spec = {"containers": [{"name": "engine", "image": "e", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"},
                               {"name": "shared", "resourceClaimName": "team-gpus"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "cache.weightcache.io/abc", "operator": "In", "values": ["ready"]}]}]}}}}
    p = primary()
    p["status"]["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": "eng-h2-a-gpu-xyz"}]
    pod = sb.standby_pod(deployment(), replicaset(spec=spec), p)
    assert pod["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimName": "eng-h2-a-gpu-xyz"},
                                             {"name": "shared", "resourceClaimName": "team-gpus"}]
    assert "nodeName" not in pod["spec"]  # the scheduler reserves the shared claim for the standby
    (term,) = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [
        {"key": "cache.weightcache.io/abc", "operator": "In", "values": ["ready"]},
        {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n0"]}]


def test_dra_waits_for_the_primarys_generated_claim():
    spec = {"containers": [{"name": "engine", "image": "e"}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]}
    with pytest.raises(sb.NotYet, match="no ResourceClaim generated"):
        sb.standby_pod(deployment(), replicaset(spec=spec), primary())


def test_a_host_port_is_refused():
    spec = {"containers": [{"name": "engine", "image": "e", "ports": [{"containerPort": 80, "hostPort": 80}]}]}
    with pytest.raises(sb.StandbyRefused, match="hostPort"):
        sb.standby_pod(deployment(), replicaset(spec=spec), primary())


def test_a_primary_without_a_node_has_no_standby_yet():
    p = primary()
    del p["spec"]["nodeName"]
    with pytest.raises(sb.NotYet):
        sb.standby_pod(deployment(), replicaset(), p)


# -- promotion ---------------------------------------------------------------------------
def test_promotion_gives_the_template_labels_and_drops_the_owner():
    s = standby_of(primary())
    patch = sb.promotion_patch(s, "eng-h2-a")
    assert patch["metadata"]["labels"] == {"app": "eng", "weightcache.io/cache": "mini", "pod-template-hash": "h2",
                                           sb.ROLE_LABEL: "primary", sb.STANDBY_FOR_LABEL: None}
    assert patch["metadata"]["ownerReferences"] == []
    assert patch["metadata"]["resourceVersion"] == "11"  # a standby changed meanwhile is not promoted blindly
    assert patch["metadata"]["annotations"] == {sb.PROMOTED_FROM_ANNOTATION: "eng-h2-a"}


def test_deployment_of_each_kind_of_pod():
    p = primary()
    s = standby_of(p)
    assert sb.deployment_of(p) == "eng" and sb.deployment_of(s) == "eng"
    promoted = json.loads(json.dumps(s))
    promoted["metadata"]["ownerReferences"] = []
    assert sb.deployment_of(promoted) == "eng"
    bare = {"metadata": {"name": "x", "labels": {}}}
    assert sb.deployment_of(bare) is None


# -- when a primary is dead --------------------------------------------------------------
def test_a_killed_engine_is_dead_in_every_state_the_kubelet_reports():
    killed = {"exitCode": 137, "finishedAt": T1}
    assert sb.container_death(primary(ready=False, since=T1, state={"terminated": killed})) == \
        "container engine exited 137"
    assert sb.container_death(primary(ready=False, since=T1, state={"waiting": {"reason": "CrashLoopBackOff"}},
                                      last=killed, restarts=1))
    # Already restarted by the time we look: it died during this not-Ready spell.
    assert sb.container_death(primary(ready=False, since=T1, state={"running": {"startedAt": T1}},
                                      last=killed, restarts=1))


def test_not_dead_while_starting_ready_or_flapping():
    assert sb.container_death(primary(ready=False, state={"waiting": {"reason": "PodInitializing"}})) is None
    assert sb.container_death(primary(ready=False, state={"running": {"startedAt": T0}})) is None
    assert sb.container_death(primary(ready=True, last={"exitCode": 1, "finishedAt": T0}, restarts=1)) is None
    # A readiness probe failing long after an old restart: not a death.
    assert sb.container_death(primary(ready=False, since=T3, last={"exitCode": 1, "finishedAt": T1}, restarts=1)) is None


def test_a_dead_sidecar_counts_a_finished_init_container_does_not():
    p = primary(ready=False, since=T1)
    p["spec"]["initContainers"] = [{"name": "setup"}, {"name": "weightcache-agent", "restartPolicy": "Always"}]
    p["status"]["initContainerStatuses"] = [
        {"name": "setup", "state": {"terminated": {"exitCode": 0, "finishedAt": T0}}},
        {"name": "weightcache-agent", "state": {"running": {}}}]
    assert sb.container_death(p) is None
    p["status"]["initContainerStatuses"][1]["state"] = {"terminated": {"exitCode": 1, "finishedAt": T1}}
    assert sb.container_death(p) == "container weightcache-agent exited 1"


# -- one pass ----------------------------------------------------------------------------
def test_a_ready_primary_gets_its_standbys():
    p = primary()
    out = sb.plan(deployment("2"), replicaset(), [p], [], 2)
    assert out.create == [p, p] and not (out.promote or out.delete or out.repoint)


def test_a_primary_starting_up_gets_no_standby_yet_and_nothing_is_promoted():
    p = primary(ready=False)
    assert sb.plan(deployment(), replicaset(), [p], [], 1).empty()


def test_a_killed_primary_promotes_its_ready_standby_and_repoints_the_others():
    p = primary(ready=False, since=T2, state={"terminated": {"exitCode": 137, "finishedAt": T2}})
    old, newer, starting = (standby_of(p, "sb-old", since=T1), standby_of(p, "sb-new", since=T2),
                            standby_of(p, "sb-starting", ready=False))
    out = sb.plan(deployment("3"), replicaset(), [p], [newer, starting, old], 3)
    assert [(s["metadata"]["name"], dead, why) for s, dead, why in out.promote] == [
        ("sb-old", "eng-h2-a", "container engine exited 137")]  # Ready the longest
    assert sorted((s["metadata"]["name"], t) for s, t in out.repoint) == [("sb-new", "sb-old"), ("sb-starting", "sb-old")]
    assert not out.delete and not out.create  # the next pass tops up the promoted pod's standbys


def test_no_ready_standby_no_promotion_yet():
    p = primary(ready=False, since=T2, state={"terminated": {"exitCode": 137, "finishedAt": T2}})
    assert sb.plan(deployment(), replicaset(), [p], [standby_of(p, ready=False)], 1).empty()


def test_after_promotion_the_promoted_pod_is_a_primary_and_gets_its_standby():
    dead = primary(ready=False, since=T2, state={"terminated": {"exitCode": 137, "finishedAt": T2}})
    s = standby_of(dead)
    promoted = json.loads(json.dumps(s))
    promoted["metadata"]["labels"] = {"app": "eng", "weightcache.io/cache": "mini", "pod-template-hash": "h2",
                                      sb.ROLE_LABEL: "primary"}
    promoted["metadata"]["ownerReferences"] = []  # not adopted yet
    out = sb.plan(deployment(), replicaset(replicas=1), [dead, promoted], [], 1)
    assert [p["metadata"]["name"] for p in out.create] == [s["metadata"]["name"]] and not out.promote


def test_deleting_a_primary_promotes_when_the_replicaset_will_replace_it():
    p = primary(deleting=T2)
    s = standby_of(p)
    replacement = primary("eng-h2-new", ready=False, created=T3)  # the ReplicaSet was quicker than us
    out = sb.plan(deployment(), replicaset(replicas=1), [p, replacement], [s], 1)
    assert [(x["metadata"]["name"], why) for x, _, why in out.promote] == [(s["metadata"]["name"], "primary deleted")]


def test_a_replacement_created_within_the_grace_period_does_not_hide_the_deletion():
    # Deleted at T1 with a 30 s grace period: deletionTimestamp is T1 + 30 s. The
    # replacement the ReplicaSet created at T2, before that deadline, is still newer
    # than the deletion itself and must not count as a pod the ReplicaSet keeps.
    p = primary(deleting="2026-11-29T10:00:35Z")
    p["metadata"]["deletionGracePeriodSeconds"] = 30
    s = standby_of(p)
    replacement = primary("eng-h2-new", ready=False, created=T2)
    out = sb.plan(deployment(), replicaset(replicas=1), [p, replacement], [s], 1)
    assert [(x["metadata"]["name"], why) for x, _, why in out.promote] == [(s["metadata"]["name"], "primary deleted")]


def test_a_gone_primary_promotes_when_the_replicaset_will_replace_it():
    s = standby_of(primary())
    out = sb.plan(deployment(), replicaset(replicas=1), [], [s], 1)
    assert [why for _, _, why in out.promote] == ["primary gone"]


def test_scale_down_deletes_the_removed_primarys_standbys_and_promotes_nothing():
    keep, removed = primary("eng-h2-a"), primary("eng-h2-b", deleting=T2)
    s_keep, s_removed = standby_of(keep, "sb-a"), standby_of(removed, "sb-b")
    out = sb.plan(deployment(replicas=1), replicaset(replicas=1), [keep, removed], [s_keep, s_removed], 1)
    assert not out.promote and [(s["metadata"]["name"], why) for s, why in out.delete] == [
        ("sb-b", "primary eng-h2-b removed by its ReplicaSet")]
    # ... also when the removed primary is gone before we look.
    out = sb.plan(deployment(replicas=1), replicaset(replicas=1), [keep], [s_keep, s_removed], 1)
    assert not out.promote and [s["metadata"]["name"] for s, _ in out.delete] == ["sb-b"]


def test_a_rollout_deletes_standbys_of_the_old_template_and_promotes_nothing():
    old = primary("eng-h1-a", hash_="h1", deleting=T2)
    s_old = sb.standby_pod(deployment(), replicaset(hash_="h1"), old)
    s_old["metadata"].update(name="sb-h1", uid="uid-sb-h1", resourceVersion="3", creationTimestamp=T1)
    s_old["status"] = {"conditions": [ready_cond(True)]}
    new = primary("eng-h2-a")
    out = sb.plan(deployment(), replicaset(), [old, new], [s_old], 1)
    assert not out.promote and [(s["metadata"]["name"], why) for s, why in out.delete] == [
        ("sb-h1", "built from an earlier pod template")]
    assert out.create == [new]


def test_hot_standby_off_deletes_every_standby():
    p = primary()
    out = sb.plan(deployment(None), replicaset(), [p], [standby_of(p)], 0)
    assert [why for _, why in out.delete] == ["hot standby off"] and not out.create


def test_fewer_standbys_wanted_deletes_the_extra_ones_not_ready_first():
    p = primary()
    ready, starting = standby_of(p, "sb-ready"), standby_of(p, "sb-starting", ready=False)
    out = sb.plan(deployment("1"), replicaset(), [p], [ready, starting], 1)
    assert [s["metadata"]["name"] for s, _ in out.delete] == ["sb-starting"] and not out.create


def test_current_replicaset_is_the_one_of_the_deployments_revision():
    rss = [replicaset(hash_="h1", revision="1"), replicaset(hash_="h2", revision="2")]
    assert sb.current_replicaset(deployment(), rss)["metadata"]["name"] == "eng-h2"
    assert sb.current_replicaset(deployment(), rss[:1]) is None


def test_selector_string():
    assert sb.selector_string({"matchLabels": {"app": "eng", "a": "b"}, "matchExpressions": [
        {"key": "tier", "operator": "In", "values": ["x", "y"]}, {"key": "gpu", "operator": "Exists"},
        {"key": "old", "operator": "DoesNotExist"}, {"key": "z", "operator": "NotIn", "values": ["q"]}]}) == \
        "a=b,app=eng,tier in (x,y),gpu,!old,z notin (q)"
