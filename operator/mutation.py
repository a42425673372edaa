"""The pod mutation of the webhook, as a pure function: an engine pod labelled
`weightcache.io/cache: <name>` gets the agent sidecar, the socket directory and the
model (read-only), the client's WEIGHTCACHE_* env and node affinity to the nodes where
the cache is ready.

Idempotent by construction: every element is keyed (containers, volumes and env by
name, mounts by path, the affinity requirement by key), put in place when missing and
replaced when present, so a mutated pod mutated again comes out unchanged.
"""

from __future__ import annotations

import copy

from . import generations as gens
from .manifests import (CACHE_LABEL, DAEMON_APP, NAME_LABEL, NODE_READY, Defaults, is_store, model_volume,
                        node_label_key, socket_dir_for, socket_volume)

AGENT = "weightcache-agent"
AGENT_PORT = 9401
MUTATED_ANNOTATION = "weightcache.io/mutated"
REPORT_DIR = "/run/weightcache-report"
REPORT_FILE = f"{REPORT_DIR}/engine.json"
VOL_SOCKETS, VOL_MODEL, VOL_REPORT = "weightcache-sockets", "weightcache-model", "weightcache-report"
AGENT_UID = 65532  # any non-root uid: the daemon admits the client group, not a uid
AGENT_SECURITY_CONTEXT = {"runAsNonRoot": True, "runAsUser": AGENT_UID, "allowPrivilegeEscalation": False,
                          "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
                          "seccompProfile": {"type": "RuntimeDefault"}}


class MutationRefused(ValueError):
    """The pod cannot be mutated for this cache; the message says why."""


def is_daemon_pod(pod: dict) -> bool:
    """The cache's own daemon pods carry the cache label too; they are never engines."""
    return ((pod.get("metadata") or {}).get("labels") or {}).get(NAME_LABEL) == DAEMON_APP


def client_env(cache: dict) -> list[dict]:
    meta, spec = cache["metadata"], cache["spec"]
    backend = spec.get("backend", "cuda-vmm")
    values = {
        "WEIGHTCACHE_MODE": "client",
        "WEIGHTCACHE_FALLBACK": (spec.get("clientPolicy") or {}).get("fallback", "disk"),
        "WEIGHTCACHE_SOCKET_DIR": socket_dir_for(meta["namespace"], meta["name"]),
        "WEIGHTCACHE_CACHE_NAME": meta["name"],
        "WEIGHTCACHE_MODEL_DIR": spec["model"]["path"],
        "WEIGHTCACHE_REVISION": spec["model"].get("revision", ""),
        # GPU backends: the client resolves the UUID of torch's current device itself.
        "WEIGHTCACHE_DEVICE": "cpu" if backend == "cpu" else "cuda",
        "WEIGHTCACHE_TP_SIZE": str((spec.get("parallelism") or {}).get("tensor", 1)),
        "WEIGHTCACHE_REPORT_FILE": REPORT_FILE,
    }
    return [{"name": k, "value": v} for k, v in values.items()]


def _mounts(cache: dict) -> list[dict]:
    meta, spec = cache["metadata"], cache["spec"]
    return [{"name": VOL_SOCKETS, "mountPath": socket_dir_for(meta["namespace"], meta["name"]), "readOnly": True},
            {"name": VOL_MODEL, "mountPath": spec["model"]["path"], "readOnly": True},
            {"name": VOL_REPORT, "mountPath": REPORT_DIR}]


def agent_container(cache: dict, defaults: Defaults) -> dict:
    meta, spec = cache["metadata"], cache["spec"]
    probe = {"httpGet": {"path": "/ready", "port": AGENT_PORT}, "periodSeconds": 1}
    return {
        "name": AGENT,
        "image": defaults.agent_image,
        "args": ["agent", "--socket-dir", socket_dir_for(meta["namespace"], meta["name"]), "--cache", meta["name"],
                 "--model", spec["model"]["path"], "--revision", spec["model"].get("revision", ""),
                 "--tp-size", str((spec.get("parallelism") or {}).get("tensor", 1)),
                 "--http-bind", f"$(POD_IP):{AGENT_PORT}", "--report-file", REPORT_FILE,
                 # A store: ready once it answers (what the engine will publish or attach
                 # to is the engine's own fingerprint, which only the engine can compute).
                 *(["--store"] if is_store(spec) else [])],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "wc-agent", "containerPort": AGENT_PORT, "protocol": "TCP"}],
        # A native sidecar: started before the app containers, which wait for its
        # startup probe, i.e. for a ready daemon whose fingerprint matches the model.
        "restartPolicy": "Always",
        "startupProbe": {**probe, "failureThreshold": 900},
        "readinessProbe": probe,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [dict(m, readOnly=True) for m in _mounts(cache)],  # it only reads, the report too
        # Pod Security "restricted": it reads files and a socket (the client group, from the
        # pod's supplementalGroups, opens it) and writes nothing but its log.
        "securityContext": AGENT_SECURITY_CONTEXT,
        # Requests and a memory limit, so a namespace with a ResourceQuota admits the pod;
        # the limit leaves room for torch's import (the fingerprint names its version).
        "resources": {"requests": {"cpu": "10m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
    }


def _upsert(items: list[dict], item: dict, key: str) -> list[dict]:
    """ITEMS with ITEM replacing the one of the same KEY in place, or appended."""
    out, found = [], False
    for it in items:
        if it.get(key) == item[key]:
            if not found:
                out.append(item)
            found = True
        else:
            out.append(it)
    return out if found else out + [item]


def _with_client(container: dict, cache: dict) -> dict:
    c = dict(container)
    env = list(c.get("env") or [])
    for var in client_env(cache):
        env = _upsert(env, var, "name")
    c["env"] = env
    mounts = list(c.get("volumeMounts") or [])
    for m in _mounts(cache):
        mounts = _upsert(mounts, m, "mountPath")
    c["volumeMounts"] = mounts
    return c


def _with_affinity(pod_spec: dict, key: str) -> dict:
    """Required node affinity on KEY=ready, ANDed into every existing term (terms are
    ORed, so a new separate term would let the pod land where the cache is not)."""
    requirement = {"key": key, "operator": "In", "values": [NODE_READY]}
    affinity = copy.deepcopy(pod_spec.get("affinity") or {})
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    new_terms = []
    for term in terms:
        exprs = [e for e in term.get("matchExpressions") or [] if e.get("key") != key]
        new_terms.append({**term, "matchExpressions": exprs + [requirement]})
    required["nodeSelectorTerms"] = new_terms
    return affinity


def pod_generation(pod: dict, cache: dict) -> tuple[gens.Generation, bool]:
    """(the generation POD needs, whether the pod named it). A pod annotated
    `weightcache.io/revision: <rev>` (set in a Deployment's template) needs that revision:
    the spec's, or an earlier one still served during a BlueGreen move; a pod without it
    needs the spec's generation."""
    wanted = ((pod.get("metadata") or {}).get("annotations") or {}).get(gens.REVISION_ANNOTATION)
    if wanted is None:
        return gens.desired_generation(cache), False
    found = gens.generation_for_revision(cache, wanted)
    if found is None:
        served = sorted({cache["spec"]["model"].get("revision", "")} | {
            e.get("revision", "") for e in (cache.get("status") or {}).get("generations") or []
            if e.get("phase") in (gens.ACTIVE, gens.LOADING, gens.DRAINING)})
        raise MutationRefused(f"the pod asks for revision {wanted!r} ({gens.REVISION_ANNOTATION}), but WeightCache "
                              f"{cache['metadata']['name']!r} serves {', '.join(repr(r) for r in served)}; set "
                              f"spec.model.revision of the cache to {wanted!r} first, or change the annotation")
    return found, True


def mutate_pod(pod: dict, cache: dict, defaults: Defaults = Defaults()) -> dict:
    """POD (not changed) as the webhook admits it for CACHE (for the generation it needs)."""
    meta = cache["metadata"]
    name = meta["name"]
    if is_daemon_pod(pod):
        return copy.deepcopy(pod)
    if pod.get("metadata", {}).get("namespace") not in (None, meta["namespace"]):
        raise MutationRefused(f"pod is in namespace {pod['metadata']['namespace']!r}, "
                              f"WeightCache {name!r} in {meta['namespace']!r}: a pod can only use a cache of its own namespace")
    generation, pinned = pod_generation(pod, cache)
    cache = copy.deepcopy(cache)  # the cache as of that generation: its model path and revision
    cache["spec"]["model"].update(path=generation.path, revision=generation.revision)
    cache_spec = cache["spec"]
    out = copy.deepcopy(pod)
    spec = out.setdefault("spec", {})
    volumes = list(spec.get("volumes") or [])
    for vol in (socket_volume(meta["namespace"], name, VOL_SOCKETS), dict(model_volume(cache_spec), name=VOL_MODEL),
                {"name": VOL_REPORT, "emptyDir": {}}):
        volumes = _upsert(volumes, vol, "name")
    spec["volumes"] = volumes
    spec["initContainers"] = _upsert(list(spec.get("initContainers") or []), agent_container(cache, defaults), "name")
    spec["containers"] = [_with_client(c, cache) for c in spec.get("containers") or []]
    if cache_spec.get("backend") == "cuda-ipc":
        # Only legacy CUDA IPC needs the host's IPC and PID namespaces; VMM fds and the
        # cpu backend pass over the Unix socket without them.
        spec["hostIPC"] = True
        spec["hostPID"] = True
    security = spec.setdefault("securityContext", {})
    groups = list(security.get("supplementalGroups") or [])
    if defaults.client_gid not in groups:
        security["supplementalGroups"] = groups + [defaults.client_gid]  # the daemon admits this group
    # A pod that names its revision goes where that generation is ready; one that does
    # not, where the spec's generation is (the cache-wide label).
    key = gens.generation_node_label_key(meta["namespace"], name, generation) if pinned else \
        node_label_key(meta["namespace"], name)
    spec["affinity"] = _with_affinity(spec, key)
    annotations = out.setdefault("metadata", {}).setdefault("annotations", {})
    annotations[MUTATED_ANNOTATION] = name
    annotations[gens.GENERATION_LABEL] = generation.key  # the operator counts it as holding that generation
    return out


def cache_name_of(pod: dict) -> str | None:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(CACHE_LABEL)
