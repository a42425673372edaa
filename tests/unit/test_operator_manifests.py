"""The operator's pure builders: the daemon DaemonSet, socket directory, node label key."""

import hashlib
import re

import pytest

from weightcache.operator.manifests import (Defaults, daemonset_for, daemonset_name, device_args, node_label_key, node_selector,
                                            socket_dir_for)


def cache(name="llama", ns="ml", **spec):
    base = {"model": {"path": "/models/llama", "revision": "abc"}, "backend": "cuda-vmm", "dtype": "auto",
            "quantization": "none", "parallelism": {"tensor": 1, "pipeline": 1, "data": 1},
            "clientPolicy": {"fallback": "disk"}}
    base.update(spec)
    return {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache",
            "metadata": {"name": name, "namespace": ns, "uid": "u-1", "generation": 1}, "spec": base}


def daemon(ds):
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    return c


def test_daemonset_names_are_unique_per_namespace_and_name_and_fit():
    names = {daemonset_name(ns, n) for ns, n in [("a-b", "c"), ("a", "b-c"), ("ml", "llama"), ("other", "llama")]}
    assert len(names) == 4  # "<ns>-<name>" would make the first two collide
    long = daemonset_name("n" * 63, "x" * 63)
    assert len(long) <= 52 and long.startswith("wc-" + "x" * 40 + "-")


def test_socket_dir_and_node_label_key():
    assert socket_dir_for("ml", "llama") == "/run/weightcache/ml/llama"
    key = node_label_key("ml", "llama")
    assert key == "cache.weightcache.io/" + hashlib.sha256(b"ml/llama").hexdigest()[:10]
    assert re.fullmatch(r"cache\.weightcache\.io/[0-9a-f]{10}", key)
    # namespace and name are both part of it: same name elsewhere is another cache
    assert node_label_key("other", "llama") != key and node_label_key("ml", "llama2") != key


def test_one_daemonset_in_the_daemons_namespace_labelled_for_its_cache():
    ds = daemonset_for(cache(), Defaults(daemon_image="reg/weightcache-daemon:1", daemon_namespace="wc-daemons"))
    meta = ds["metadata"]
    # In the admin's namespace, never the tenant's; an owner reference cannot cross
    # namespaces, so labels say whose it is (the uid: which incarnation of the cache).
    assert meta["namespace"] == "wc-daemons" and "ownerReferences" not in meta
    assert re.fullmatch(r"wc-llama-[0-9a-f]{8}", meta["name"])
    labels = {"app.kubernetes.io/name": "weightcache-daemon", "weightcache.io/cache": "llama",
              "weightcache.io/cache-namespace": "ml"}
    assert meta["labels"] == {**labels, "weightcache.io/cache-uid": "u-1",
                              "app.kubernetes.io/managed-by": "weightcache-operator"}
    assert ds["spec"]["selector"]["matchLabels"] == labels
    assert ds["spec"]["template"]["metadata"]["labels"] == labels
    c = daemon(ds)
    assert c["name"] == "daemon" and c["image"] == "reg/weightcache-daemon:1"
    assert c["args"] == ["daemon", "--model", "/models/llama", "--backend", "cuda-vmm", "--socket-dir",
                         "/run/weightcache/ml/llama", "--name", "llama", "--revision", "abc", "--tp-size", "1",
                         "--device", "all", "--http-bind", "$(POD_IP):9400", "--socket-group", "60100",
                         "--allow-gid", "60100", "--take-over"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert c["ports"] == [{"name": "http", "containerPort": 9400, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["startupProbe"]["httpGet"]["path"] == "/healthz"  # liveness waits until the process answers
    # Not privileged on any backend, no capability: the NVIDIA runtime exposes the GPUs
    # from NVIDIA_VISIBLE_DEVICES; the client group is the daemon's primary group, so its
    # sockets get that group without CAP_CHOWN.
    assert c["securityContext"] == {"privileged": False, "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
                                    "seccompProfile": {"type": "RuntimeDefault"}}
    assert ds["spec"]["template"]["spec"]["securityContext"] == {
        "runAsUser": 0, "runAsGroup": 60100, "seccompProfile": {"type": "RuntimeDefault"}}
    assert "nvidia.com/gpu" not in repr(c.get("resources"))
    pod = ds["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["sockets"]["hostPath"] == {"path": "/run/weightcache/ml/llama", "type": "DirectoryOrCreate"}
    # no type: a missing model directory must reach the daemon, which reports it
    assert vols["model"]["hostPath"] == {"path": "/models/llama"}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["sockets"]["mountPath"] == "/run/weightcache/ml/llama" and not mounts["sockets"].get("readOnly")
    assert mounts["model"] == {"name": "model", "mountPath": "/models/llama", "readOnly": True}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "hostIPC" not in pod and "hostPID" not in pod


def test_daemons_roll_by_surge_and_take_the_slabs_over():
    """A changed template starts the new daemon pod beside the old one on the node (never
    fewer daemons than nodes), and the new daemon takes the resident slabs over."""
    spec = daemonset_for(cache())["spec"]
    assert spec["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert "--take-over" in daemon({"spec": spec})["args"]
    # Two daemon pods of a cache can share a node: no host network, no host port.
    pod = spec["template"]["spec"]
    assert not pod.get("hostNetwork") and all("hostPort" not in p for p in daemon({"spec": spec})["ports"])


def klass(**spec) -> dict:
    return {"metadata": {"name": "pool-a"}, "spec": {"modelRoots": ["/models"], **spec}}


def test_the_class_daemon_image_wins_over_the_operator_default():
    ds = daemonset_for(cache(), Defaults(daemon_image="default:1"), klass(daemon={"image": "mine:2"}))
    assert daemon(ds)["image"] == "mine:2"
    assert daemon(daemonset_for(cache(), Defaults(daemon_image="default:1"), klass()))["image"] == "default:1"


def test_the_class_decides_placement_resources_priority_runtime_and_env():
    tol = [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    cls = klass(placement={"nodeSelector": {"pool": "a100"}, "tolerations": tol},
                daemon={"resources": {"limits": {"memory": "4Gi"}}, "priorityClassName": "high",
                        "runtimeClassName": "nvidia",
                        "env": [{"name": "X", "value": "1"}, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "0"},
                                {"name": "POD_IP", "value": "bogus"}]})
    ds = daemonset_for(cache(placement={"nodeSelector": {"zone": "z1", "pool": "mine"}}), Defaults(), cls)
    pod = ds["spec"]["template"]["spec"]
    # The cache narrows the class's nodes; a key both set keeps the admin's value.
    assert pod["nodeSelector"] == {"pool": "a100", "zone": "z1"} and pod["tolerations"] == tol
    assert pod["priorityClassName"] == "high" and pod["runtimeClassName"] == "nvidia"
    c = daemon(ds)
    assert c["resources"] == {"limits": {"memory": "4Gi"}}
    env = {e["name"]: e for e in c["env"]}
    assert env["X"]["value"] == "1" and env["NVIDIA_VISIBLE_DEVICES"]["value"] == "0"
    assert "valueFrom" in env["POD_IP"]  # the --http-bind address is not the admin's to change either
    assert len(c["env"]) == len(env)


def test_what_a_cache_still_says_reaches_nothing_the_class_decides():
    """spec.daemon and spec.placement.tolerations are refused by the CRD; were one to reach
    the builder anyway (an old object), it would change nothing."""
    sneaky = cache(daemon={"image": "evil:1", "priorityClassName": "system-node-critical",
                           "env": [{"name": "LD_PRELOAD", "value": "/x.so"}]},
                   placement={"tolerations": [{"operator": "Exists"}]})
    ds = daemonset_for(sneaky, Defaults(daemon_image="default:1"), klass())
    pod = ds["spec"]["template"]["spec"]
    assert daemon(ds)["image"] == "default:1" and "tolerations" not in pod and "priorityClassName" not in pod
    assert "LD_PRELOAD" not in {e["name"] for e in daemon(ds)["env"]}


@pytest.mark.parametrize("spec, expected", [
    ({"backend": "cpu"}, []),
    ({"placement": {"gpusPerNode": 3}}, ["--device", "0", "--device", "1", "--device", "2"]),
    ({"placement": {"gpuUUIDs": ["GPU-a", "GPU-b"]}}, ["--device", "GPU-a", "--device", "GPU-b"]),
    ({}, ["--device", "all"]),
])
def test_device_flags(spec, expected):
    assert device_args({"backend": "cuda-vmm", **spec}) == expected


def test_cpu_has_no_default_node_selector_but_an_explicit_empty_one_is_kept():
    assert node_selector({"backend": "cpu"}) == {}
    assert node_selector({"backend": "cuda-vmm", "placement": {"nodeSelector": {}}}) == {}
    assert "nodeSelector" not in daemonset_for(cache(backend="cpu"))["spec"]["template"]["spec"]


def test_cuda_ipc_daemon_shares_host_ipc_and_pid():
    pod = daemonset_for(cache(backend="cuda-ipc", allowHostIPC=True))["spec"]["template"]["spec"]
    assert pod["hostIPC"] is True and pod["hostPID"] is True


def test_model_volume_sources():
    pvc = daemonset_for(cache(model={"path": "/m", "volume": {"persistentVolumeClaim": {"claimName": "w"}}}))
    vols = {v["name"]: v for v in pvc["spec"]["template"]["spec"]["volumes"]}
    assert vols["model"] == {"name": "model", "persistentVolumeClaim": {"claimName": "w", "readOnly": True}}
    hp = daemonset_for(cache(model={"path": "/m", "volume": {"hostPath": {"path": "/data/w"}}}))
    vols = {v["name"]: v for v in hp["spec"]["template"]["spec"]["volumes"]}
    assert vols["model"] == {"name": "model", "hostPath": {"path": "/data/w"}}
    assert daemon(hp)["args"][2] == "/m"  # the daemon reads the model where the volume is mounted


def test_a_changed_spec_changes_the_template_and_an_unchanged_one_does_not():
    a, b = daemonset_for(cache()), daemonset_for(cache())
    assert a == b
    c = daemonset_for(cache(model={"path": "/models/llama", "revision": "def"}))
    assert c["spec"]["template"] != a["spec"]["template"]


def test_a_published_cache_runs_a_store_that_the_client_group_may_publish_into():
    """source Published: the daemon args name no model, revision or parallelism (what an
    engine publishes carries its own), the client group attaches AND publishes (engine
    pods get it through supplementalGroups: the first engine on a node is the writer),
    there is no --take-over (the daemon refuses it for a store), and no model volume (a
    store reads no checkpoint; the engines mount it)."""
    ds = daemonset_for(cache(source="Published", backend="cpu"))
    c = daemon(ds)
    assert c["args"] == ["daemon", "--backend", "cpu", "--socket-dir", "/run/weightcache/ml/llama", "--name", "llama",
                         "--http-bind", "$(POD_IP):9400", "--socket-group", "60100", "--allow-gid", "60100",
                         "--allow-publish-gid", "60100"]
    pod = ds["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["sockets"]
    assert [m["name"] for m in c["volumeMounts"]] == ["sockets"]
    # The same probes as any daemon: a store is ready (/readyz) as soon as it serves, empty.
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_a_store_is_replaced_not_surged():
    """A second store of one cache on a node cannot start (the first holds its lock) and
    a store cannot be handed over: its pods are replaced one node at a time."""
    spec = daemonset_for(cache(source="Published"))["spec"]
    assert spec["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    gpu = daemon({"spec": spec})["args"]
    assert gpu[:3] == ["daemon", "--backend", "cuda-vmm"] and ["--device", "all"] == gpu[7:9]
    assert daemonset_for(cache(source="Checkpoint"))["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 1


def test_switching_the_source_changes_the_template():
    assert daemonset_for(cache(source="Published"))["spec"]["template"] != daemonset_for(cache())["spec"]["template"]
    # Checkpoint is the default: naming it changes nothing.
    assert daemonset_for(cache(source="Checkpoint")) == daemonset_for(cache())
