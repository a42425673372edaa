"""The webhook's pod mutation as a pure function: what it adds, that it is idempotent,
and that hostIPC/hostPID come only with cuda-ipc."""

import copy

import pytest

from weightcache.operator.manifests import Defaults, node_label_key
from weightcache.operator.mutation import MutationRefused, is_daemon_pod, mutate_pod


def cache(backend="cpu", **spec):
    base = {"model": {"path": "/models/mini", "revision": "r1"}, "backend": backend,
            "parallelism": {"tensor": 2, "pipeline": 1, "data": 1}, "clientPolicy": {"fallback": "error"}}
    base.update(spec)
    return {"metadata": {"name": "mini", "namespace": "ml", "uid": "u"}, "spec": base}


def pod(**spec):
    base = {"containers": [{"name": "engine", "image": "vllm", "env": [{"name": "KEEP", "value": "1"},
                                                                      {"name": "WEIGHTCACHE_MODE", "value": "off"}]},
                           {"name": "proxy", "image": "envoy"}]}
    base.update(spec)
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "e", "namespace": "ml", "labels": {"weightcache.io/cache": "mini"}}, "spec": base}


D = Defaults(agent_image="reg/weightcache-engine:9")


def env_of(c):
    return {e["name"]: e.get("value") for e in c.get("env") or []}


def test_every_app_container_gets_the_client_env_and_mounts():
    out = mutate_pod(pod(), cache(), D)
    for c in out["spec"]["containers"]:
        env = env_of(c)
        assert env["WEIGHTCACHE_MODE"] == "client" and env["WEIGHTCACHE_FALLBACK"] == "error"
        assert env["WEIGHTCACHE_SOCKET_DIR"] == "/run/weightcache/ml/mini"
        assert env["WEIGHTCACHE_CACHE_NAME"] == "mini" and env["WEIGHTCACHE_MODEL_DIR"] == "/models/mini"
        assert env["WEIGHTCACHE_REVISION"] == "r1" and env["WEIGHTCACHE_DEVICE"] == "cpu"
        assert env["WEIGHTCACHE_TP_SIZE"] == "2"
        assert env["WEIGHTCACHE_REPORT_FILE"] == "/run/weightcache-report/engine.json"
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/run/weightcache/ml/mini"]["readOnly"] is True
        assert mounts["/models/mini"]["readOnly"] is True
        assert "/run/weightcache-report" in mounts
    engine = out["spec"]["containers"][0]
    assert env_of(engine)["KEEP"] == "1"
    assert [e["name"] for e in engine["env"]].count("WEIGHTCACHE_MODE") == 1
    vols = {v["name"]: v for v in out["spec"]["volumes"]}
    assert vols["weightcache-sockets"]["hostPath"] == {"path": "/run/weightcache/ml/mini", "type": "DirectoryOrCreate"}
    assert vols["weightcache-model"]["hostPath"] == {"path": "/models/mini"}
    assert vols["weightcache-report"] == {"name": "weightcache-report", "emptyDir": {}}
    assert out["metadata"]["annotations"]["weightcache.io/mutated"] == "mini"


def test_the_agent_is_a_native_sidecar_with_probes_and_readonly_mounts():
    out = mutate_pod(pod(initContainers=[{"name": "fetch", "image": "busybox"}]), cache(), D)
    fetch, agent = out["spec"]["initContainers"]
    assert fetch["name"] == "fetch"  # the user's init containers run first
    assert agent["name"] == "weightcache-agent" and agent["image"] == "reg/weightcache-engine:9"
    assert agent["restartPolicy"] == "Always"
    assert agent["args"] == ["agent", "--socket-dir", "/run/weightcache/ml/mini", "--cache", "mini",
                             "--model", "/models/mini", "--revision", "r1", "--tp-size", "2",
                             "--http-bind", "$(POD_IP):9401", "--report-file", "/run/weightcache-report/engine.json"]
    assert agent["startupProbe"]["httpGet"] == {"path": "/ready", "port": 9401}
    assert agent["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 9401}
    assert agent["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert all(m["readOnly"] for m in agent["volumeMounts"])
    assert {m["mountPath"] for m in agent["volumeMounts"]} == {"/run/weightcache/ml/mini", "/models/mini",
                                                                "/run/weightcache-report"}
    assert env_of(agent) == {"POD_IP": None}


def test_mutation_is_idempotent_and_leaves_the_input_alone():
    original = pod(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}})
    before = copy.deepcopy(original)
    once = mutate_pod(original, cache(), D)
    assert original == before
    assert mutate_pod(once, cache(), D) == once
    assert mutate_pod(mutate_pod(once, cache(), D), cache(), D) == once


def test_node_affinity_is_anded_into_every_term():
    key = node_label_key("ml", "mini")
    terms = [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
             {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]
    out = mutate_pod(pod(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": terms}}, "podAntiAffinity": {"x": 1}}), cache(), D)
    got = out["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(got) == 2
    for term in got:
        assert {"key": key, "operator": "In", "values": ["ready"]} in term["matchExpressions"]
    assert got[1]["matchFields"] == terms[1]["matchFields"]
    assert out["spec"]["affinity"]["podAntiAffinity"] == {"x": 1}
    plain = mutate_pod(pod(), cache(), D)["spec"]["affinity"]["nodeAffinity"]
    assert plain["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": key, "operator": "In", "values": ["ready"]}]}]


@pytest.mark.parametrize("backend, shared", [("cpu", False), ("cuda-vmm", False), ("cuda-ipc", True)])
def test_host_ipc_and_pid_only_for_cuda_ipc(backend, shared):
    out = mutate_pod(pod(), cache(backend=backend), D)
    assert ("hostIPC" in out["spec"], "hostPID" in out["spec"]) == (shared, shared)
    if shared:
        assert out["spec"]["hostIPC"] is True and out["spec"]["hostPID"] is True
    assert env_of(out["spec"]["containers"][0])["WEIGHTCACHE_DEVICE"] == ("cpu" if backend == "cpu" else "cuda")


def test_a_user_mount_at_the_model_path_is_replaced_not_duplicated():
    p = pod()
    p["spec"]["containers"][0]["volumeMounts"] = [{"name": "mine", "mountPath": "/models/mini"}]
    out = mutate_pod(p, cache(), D)
    mounts = [m for m in out["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == "/models/mini"]
    assert mounts == [{"name": "weightcache-model", "mountPath": "/models/mini", "readOnly": True}]


def test_pvc_model_is_mounted_readonly_at_the_model_path():
    out = mutate_pod(pod(), cache(model={"path": "/w", "volume": {"persistentVolumeClaim": {"claimName": "c"}}}), D)
    vols = {v["name"]: v for v in out["spec"]["volumes"]}
    assert vols["weightcache-model"]["persistentVolumeClaim"] == {"claimName": "c", "readOnly": True}


def test_daemon_pods_are_never_mutated():
    d = pod()
    d["metadata"]["labels"]["app.kubernetes.io/name"] = "weightcache-daemon"
    assert is_daemon_pod(d) and mutate_pod(d, cache(), D) == d


def test_a_pod_of_another_namespace_is_refused():
    p = pod()
    p["metadata"]["namespace"] = "other"
    with pytest.raises(MutationRefused, match="own namespace"):
        mutate_pod(p, cache(), D)


def test_the_pod_joins_the_group_the_daemon_admits_keeping_its_own_groups():
    mutated = mutate_pod(pod(securityContext={"runAsUser": 1000, "supplementalGroups": [7]}), cache(), D)
    assert mutated["spec"]["securityContext"] == {"runAsUser": 1000, "supplementalGroups": [7, D.client_gid]}
    assert mutate_pod(mutated, cache(), D)["spec"]["securityContext"]["supplementalGroups"] == [7, D.client_gid]
    assert mutate_pod(pod(), cache(), D)["spec"]["securityContext"] == {"supplementalGroups": [D.client_gid]}


def test_a_published_cache_gets_an_agent_that_waits_for_its_store():
    """The same pod shape (the model is still mounted: the first engine reads it), and the
    agent gates on the store's handshake (--store) instead of a checkpoint fingerprint."""
    out = mutate_pod(pod(), cache(source="Published"), D)
    (agent,) = out["spec"]["initContainers"]
    assert agent["args"][-1] == "--store" and "--model" in agent["args"]
    engine = out["spec"]["containers"][0]
    assert {m["mountPath"] for m in engine["volumeMounts"]} >= {"/models/mini", "/run/weightcache/ml/mini"}
    assert 60100 in out["spec"]["securityContext"]["supplementalGroups"]  # reader and writer alike
    assert mutate_pod(out, cache(source="Published"), D) == out
    assert "--store" not in mutate_pod(pod(), cache(), D)["spec"]["initContainers"][0]["args"]


def test_the_agent_meets_the_restricted_pod_security_level_and_a_quota():
    """What Pod Security "restricted" asks of a container, and requests and a memory
    limit for a namespace with a ResourceQuota."""
    (agent,) = mutate_pod(pod(), cache())["spec"]["initContainers"]
    sc = agent["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0 and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert agent["resources"]["requests"]["cpu"] and agent["resources"]["limits"]["memory"]
