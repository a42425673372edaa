"""Pure builders for what the operator sends: the daemon DaemonSet of a WeightCache, the
node-local socket directory, and the node label that marks where a cache is ready.

A WeightCache is the API's JSON form (a dict, camelCase keys, defaults applied by the
CRD). Nothing here talks to a cluster; tests call these directly.

The daemons run in the operator's own namespace (Defaults.daemon_namespace), never in
the cache's: a tenant's namespace holds nothing privileged. An owner reference cannot
cross namespaces, so a DaemonSet names its cache by labels (namespace, name, uid) and
the cache's finalizer deletes it.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass

from weightcache import __version__

GROUP = "weightcache.io"
VERSION = "v1alpha1"
PLURAL = "weightcaches"
KIND = "WeightCache"

CACHE_LABEL = "weightcache.io/cache"  # on daemon pods and on engine pods (the opt-in)
CACHE_NAMESPACE_LABEL = "weightcache.io/cache-namespace"  # on daemon DaemonSets and pods: whose cache
CACHE_UID_LABEL = "weightcache.io/cache-uid"  # on daemon DaemonSets: which incarnation of the cache owns it
NAME_LABEL = "app.kubernetes.io/name"
DAEMON_APP = "weightcache-daemon"
NODE_LABEL_PREFIX = "cache.weightcache.io/"
NODE_READY = "ready"
FORCE_DELETE_ANNOTATION = "weightcache.io/force-delete"

SOCKET_ROOT = "/run/weightcache"
DAEMON_HTTP_PORT = 9400
GPU_NODE_LABEL = "nvidia.com/gpu.present"  # the default placement of GPU backends
CHECKPOINT, PUBLISHED = "Checkpoint", "Published"  # spec.source


@dataclass(frozen=True)
class Defaults:
    """What the operator's command line decides for every cache."""

    daemon_image: str = f"weightcache-daemon:{__version__}"
    daemon_namespace: str = "weightcache-daemons"  # where every cache's daemons run (the admin's namespace)
    agent_image: str = f"weightcache-engine:{__version__}"
    # The group engine pods get (supplementalGroups) and daemons admit (--socket-group,
    # --allow-gid): engines run as any uid, and the daemon checks the kernel's word for
    # the peer's groups (SO_PEERGROUPS) as well as the socket's file mode.
    client_gid: int = 60100


def socket_dir_for(namespace: str, name: str) -> str:
    """The node's socket directory of one cache; the same path in daemon and engines."""
    return f"{SOCKET_ROOT}/{namespace}/{name}"


def node_label_key(namespace: str, name: str) -> str:
    """`cache.weightcache.io/<hash10>`: "<namespace>.<name>" does not fit a label key's
    63-character name part, so the key carries a digest of it."""
    return NODE_LABEL_PREFIX + hashlib.sha256(f"{namespace}/{name}".encode()).hexdigest()[:10]


def daemonset_name(namespace: str, name: str) -> str:
    """`wc-<name>-<hash8>`: unique in the daemons' namespace for every namespace/name (a
    name alone is not, and "<namespace>-<name>" is ambiguous and may not fit), and short
    enough for the pods and revisions the DaemonSet controller names after it."""
    digest = hashlib.sha256(f"{namespace}/{name}".encode()).hexdigest()[:8]
    return f"wc-{name[:40].rstrip('-.')}-{digest}"


def daemon_labels(namespace: str, name: str) -> dict[str, str]:
    """The DaemonSet's selector and its pods' labels."""
    return {NAME_LABEL: DAEMON_APP, CACHE_LABEL: name, CACHE_NAMESPACE_LABEL: namespace}


def owner_labels(cache: dict) -> dict[str, str]:
    """What ties a DaemonSet to its cache across namespaces: its namespace, name and uid
    (a cache deleted and made again under the same name is another owner)."""
    meta = cache["metadata"]
    return {**daemon_labels(meta["namespace"], meta["name"]), CACHE_UID_LABEL: meta["uid"],
            "app.kubernetes.io/managed-by": "weightcache-operator"}


def owned_by(obj: dict, uid: str) -> bool:
    return (obj["metadata"].get("labels") or {}).get(CACHE_UID_LABEL) == uid


def model_volume(spec: dict) -> dict:
    """The pod volume behind spec.model.path: the node's own directory, or the given source.

    A hostPath of the model has no `type` on purpose: a missing directory must reach the
    daemon, which then reports ModelNotFound in its status, instead of the pod hanging in
    ContainerCreating with a mount error nobody reads."""
    model = spec["model"]
    source = model.get("volume")
    if not source:
        return {"name": "model", "hostPath": {"path": model["path"]}}
    if "persistentVolumeClaim" in source:
        return {"name": "model", "persistentVolumeClaim": {
            "claimName": source["persistentVolumeClaim"]["claimName"], "readOnly": True}}
    return {"name": "model", "hostPath": {"path": source["hostPath"]["path"]}}


def socket_volume(namespace: str, name: str, volume_name: str = "sockets") -> dict:
    return {"name": volume_name, "hostPath": {"path": socket_dir_for(namespace, name), "type": "DirectoryOrCreate"}}


def device_args(spec: dict) -> list[str]:
    """--device flags for the daemon: none on cpu; else the GPUs by UUID, the first N by
    ordinal, or all of the node's."""
    if spec.get("backend", "cuda-vmm") == "cpu":
        return []
    placement = spec.get("placement") or {}
    if placement.get("gpuUUIDs"):
        devices = list(placement["gpuUUIDs"])
    elif placement.get("gpusPerNode"):
        devices = [str(i) for i in range(placement["gpusPerNode"])]
    else:
        devices = ["all"]
    return [a for d in devices for a in ("--device", d)]


def is_store(spec: dict) -> bool:
    """spec.source Published: the daemons start empty and engines publish into them."""
    return spec.get("source", CHECKPOINT) == PUBLISHED


def store_args(cache: dict, defaults: Defaults = Defaults()) -> list[str]:
    """A store's daemon: no model, no parallelism (what an engine publishes carries its
    own), the client group allowed to attach AND to publish (engine pods get that group:
    the first engine on a node is the writer), and no --take-over (a store's
    publications cannot be handed over yet: the daemon refuses the flag)."""
    meta, spec = cache["metadata"], cache["spec"]
    gid = str(defaults.client_gid)
    return ["daemon", "--backend", spec.get("backend", "cuda-vmm"),
            "--socket-dir", socket_dir_for(meta["namespace"], meta["name"]), "--name", meta["name"],
            *device_args(spec), "--http-bind", f"$(POD_IP):{DAEMON_HTTP_PORT}",
            "--socket-group", gid, "--allow-gid", gid, "--allow-publish-gid", gid]


def daemon_args(cache: dict, defaults: Defaults = Defaults()) -> list[str]:
    meta, spec = cache["metadata"], cache["spec"]
    if is_store(spec):
        return store_args(cache, defaults)
    parallelism = spec.get("parallelism") or {}
    return ["daemon", "--model", spec["model"]["path"], "--backend", spec.get("backend", "cuda-vmm"),
            "--socket-dir", socket_dir_for(meta["namespace"], meta["name"]), "--name", meta["name"],
            "--revision", spec["model"].get("revision", ""), "--tp-size", str(parallelism.get("tensor", 1)),
            *device_args(spec), "--http-bind", f"$(POD_IP):{DAEMON_HTTP_PORT}",
            "--socket-group", str(defaults.client_gid), "--allow-gid", str(defaults.client_gid),
            # A replaced pod's daemon takes the resident slabs over from the one it replaces
            # (a surge pod beside it on the node); with none alive, it loads.
            "--take-over"]


def _env(daemon: dict) -> list[dict]:
    ours = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            # All GPUs visible, none requested: the daemon serves the node's GPUs by UUID.
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    extra = [dict(e) for e in (daemon.get("env") or []) if e["name"] != "POD_IP"]
    names = {e["name"] for e in extra}
    return [e for e in ours if e["name"] not in names] + extra


def node_selector(spec: dict, cls_placement: dict | None = None) -> dict[str, str]:
    """The class's nodeSelector (the admin's), narrowed by the cache's placement.nodeSelector
    (a key both set keeps the class's value: a cache only narrows). Neither given: GPU
    nodes for the GPU backends, any node for cpu."""
    placement, admin = spec.get("placement") or {}, cls_placement or {}
    if "nodeSelector" in placement or "nodeSelector" in admin:
        return {**(placement.get("nodeSelector") or {}), **(admin.get("nodeSelector") or {})}
    return {} if spec.get("backend", "cuda-vmm") == "cpu" else {GPU_NODE_LABEL: "true"}


def update_strategy(store: bool) -> dict:
    """Checkpoint daemons roll by surge: the new daemon pod starts beside the old one on
    each node and takes its slabs over (no reload, no gap); the old pod goes once the new
    one is Ready. A store cannot be handed over and a second store of the cache on a node
    refuses to start (its lock is held), so a store's pod is replaced: the old one stops
    (engines attached to it keep their mappings), the new one starts empty, and the
    engines that start after it publish again."""
    if store:
        return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def daemon_security_context() -> dict:
    """Not privileged, on every backend, and no capability. The daemon needs its socket
    directory (a hostPath volume), the model (read-only) and, on GPU backends, the GPUs,
    which the NVIDIA container runtime exposes from NVIDIA_VISIBLE_DEVICES=all without
    privileges. It runs as root, the owner of the node's socket directory (the kubelet
    makes it root-owned), with the client group as its primary group (daemon_pod_security)
    so that its sockets get that group without CAP_CHOWN. It writes nothing but sockets."""
    return {"privileged": False, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def daemon_pod_security(defaults: Defaults) -> dict:
    return {"runAsUser": 0, "runAsGroup": defaults.client_gid, "seccompProfile": {"type": "RuntimeDefault"}}


def daemonset_for(cache: dict, defaults: Defaults = Defaults(), cls: dict | None = None) -> dict:
    """The one DaemonSet that runs CACHE's daemon on every selected node, as its
    WeightCacheClass CLS says (image, env, resources, priority, runtime, tolerations and
    nodes are the class's: the admin's; None: the operator's defaults)."""
    meta, spec = cache["metadata"], cache["spec"]
    ns, name = meta["namespace"], meta["name"]
    labels = daemon_labels(ns, name)
    admin = (cls or {}).get("spec") or {}
    daemon, placement = admin.get("daemon") or {}, admin.get("placement") or {}
    sockets = socket_dir_for(ns, name)
    container = {
        "name": "daemon",
        "image": daemon.get("image") or defaults.daemon_image,
        "args": daemon_args(cache, defaults),
        "env": _env(daemon),
        "ports": [{"name": "http", "containerPort": DAEMON_HTTP_PORT, "protocol": "TCP"}],
        # /readyz answers 200 once every device's socket is published; /healthz while the
        # process serves, loading or failed, so a bad model is reported, not restarted.
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 2,
                           "failureThreshold": 1},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10,
                          "timeoutSeconds": 5, "failureThreshold": 3},
        # Liveness counts only once the process answers at all: importing torch on a busy
        # node can take longer than liveness allows, and a surge pod restarted for that
        # would only delay its take-over.
        "startupProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 2,
                         "timeoutSeconds": 5, "failureThreshold": 150},
        "securityContext": daemon_security_context(),
        "volumeMounts": [{"name": "sockets", "mountPath": sockets},
                         {"name": "model", "mountPath": spec["model"]["path"], "readOnly": True}],
    }
    store = is_store(spec)
    if store:  # a store reads no checkpoint: only the engines mount the model
        container["volumeMounts"] = container["volumeMounts"][:1]
    if daemon.get("resources"):
        container["resources"] = copy.deepcopy(daemon["resources"])
    pod_spec = {
        "containers": [container],
        "volumes": [socket_volume(ns, name)] + ([] if store else [model_volume(spec)]),
        "securityContext": daemon_pod_security(defaults),
        "automountServiceAccountToken": False,  # the daemon never calls the API
        "terminationGracePeriodSeconds": 30,
    }
    selector = node_selector(spec, placement)
    if selector:
        pod_spec["nodeSelector"] = selector
    if placement.get("tolerations"):
        pod_spec["tolerations"] = copy.deepcopy(placement["tolerations"])
    for key in ("priorityClassName", "runtimeClassName"):
        if daemon.get(key):
            pod_spec[key] = daemon[key]
    if spec.get("backend") == "cuda-ipc":
        # Legacy CUDA IPC handles open only across a shared IPC and PID namespace.
        pod_spec["hostIPC"] = True
        pod_spec["hostPID"] = True
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": daemonset_name(ns, name), "namespace": defaults.daemon_namespace,
                     "labels": owner_labels(cache)},
        "spec": {
            "selector": {"matchLabels": labels},
            "updateStrategy": update_strategy(store),
            "revisionHistoryLimit": 5,
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
