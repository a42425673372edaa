"""What the operator sends to the cluster for representative caches, from its own pure
builders: the daemon DaemonSets (a generation beside another too), the engine pods as its
webhook mutates them, and a hot standby. `scan/run.py` scans these; run alone, this
prints them as YAML (`python scan/generated.py`).

Only the public builders are called, each with a WeightCache as the API serves it (a
dict, camelCase keys, the CRD's defaults applied): they are changing, and this must keep
working while they do. A builder that raises stops the scan (nothing is left out
silently).

The engine pods start from an engine written to pass every check on its own (a pinned
image, limits, probes, a restricted securityContext) in a namespace with a NetworkPolicy,
so that a finding on a mutated pod is what the mutation added. The unmutated engine is
scanned too, as `baseline-engine`: it must stay clean.
"""

from __future__ import annotations

import copy
import sys

from weightcache.operator import classes, generations, manifests, mutation, standby

NAMESPACE = "ml"  # the tenant's namespace: caches and engines
ENGINE_IMAGE = "registry.example/acme/engine@sha256:" + "0" * 64
GPU_UUID = "GPU-00000000-0000-0000-0000-000000000000"


def cache(name: str, uid: str, **spec) -> dict:
    base = {"model": {"path": f"/models/{name}", "revision": "r1"}, "source": "Checkpoint", "backend": "cuda-vmm",
            "dtype": "auto", "quantization": "none", "parallelism": {"tensor": 1, "pipeline": 1, "data": 1},
            "clientPolicy": {"fallback": "disk"}}
    base.update(spec)
    return {"apiVersion": f"{manifests.GROUP}/{manifests.VERSION}", "kind": manifests.KIND,
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid, "generation": 1}, "spec": base}


def klass(name: str, **spec) -> dict:
    """A WeightCacheClass, the admin's: the default one of the chart, or one with more."""
    return {"apiVersion": f"{manifests.GROUP}/{manifests.VERSION}", "kind": "WeightCacheClass",
            "metadata": {"name": name}, "spec": {"modelRoots": ["/models"], "backends": ["cuda-vmm", "cpu"], **spec}}


DEFAULT_CLASS = klass("weightcache")
SIZED_CLASS = klass("sized", daemon={"resources": {"requests": {"cpu": "2", "memory": "8Gi"},
                                                   "limits": {"cpu": "8", "memory": "32Gi"}}})
IPC_CLASS = klass("legacy-ipc", backends=["cuda-ipc"], allowHostIPC=True)

# One cache (and its class) per way the daemon and the engines are built differently.
# Names matter to skips.yaml: its patterns say "wc-*" (every daemon DaemonSet,
# wc-<cache>-<hash8>), "wc-gpu-ipc-*", "engine-*" (every mutated engine pod); the
# unmutated engine is "baseline-engine", outside every pattern, so no skip can hide a
# finding on it.
CACHES = [
    (cache("cpu", "uid-cpu", backend="cpu"), DEFAULT_CLASS),
    (cache("gpu-vmm", "uid-vmm", backend="cuda-vmm", className="sized"), SIZED_CLASS),
    (cache("gpu-ipc", "uid-ipc", backend="cuda-ipc", allowHostIPC=True, className="legacy-ipc"), IPC_CLASS),
    (cache("gpu-store", "uid-store", backend="cuda-vmm", source="Published"), DEFAULT_CLASS),
]


def engine_deployment(c: dict) -> dict:
    """An engine Deployment labelled for cache C, compliant before the webhook touches it."""
    gpu = c["spec"]["backend"] != "cpu"
    limits = {"cpu": "4", "memory": "16Gi", **({"nvidia.com/gpu": "1"} if gpu else {})}
    container = {
        "name": "engine", "image": ENGINE_IMAGE, "imagePullPolicy": "Always",
        "args": ["serve", "--model", c["spec"]["model"]["path"]],
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}},
        "resources": {"requests": {"cpu": "1", "memory": "8Gi"}, "limits": limits},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "runAsUser": 10001, "capabilities": {"drop": ["ALL"]}},
    }
    labels = {"app": f"engine-{c['metadata']['name']}", manifests.CACHE_LABEL: c["metadata"]["name"]}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": f"engine-{c['metadata']['name']}", "namespace": NAMESPACE, "uid": f"dep-{c['metadata']['uid']}",
                     "annotations": {standby.HOT_STANDBY_ANNOTATION: "1"}},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": labels["app"]}}, "template": {
            "metadata": {"labels": labels},
            "spec": {"automountServiceAccountToken": False, "serviceAccountName": "engine",
                     "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                     "containers": [container]}}},
    }


def as_pod(deployment: dict, name: str) -> dict:
    """The pod the ReplicaSet controller creates from DEPLOYMENT, as the webhook receives it."""
    template = copy.deepcopy(deployment["spec"]["template"])
    meta = {**template.get("metadata", {}), "name": name, "namespace": deployment["metadata"]["namespace"]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


def tenant_network_policy() -> dict:
    """The tenant's own default-deny ingress: what a hardened engine namespace has."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "default-deny-ingress", "namespace": NAMESPACE},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}


def documents() -> list[dict]:
    """Every object the scan checks from the operator's side, each named uniquely."""
    defaults = manifests.Defaults()
    docs = [tenant_network_policy()]
    baseline = as_pod(engine_deployment(CACHES[0][0]), "baseline-engine")
    docs.append(baseline)
    for c, cls in CACHES:
        assert classes.refusals(c, cls, {}) == [], (c["metadata"]["name"], classes.refusals(c, cls, {}))
        name = c["metadata"]["name"]
        generation = generations.desired_generation(c)
        # What the reconciler sends: the generation's DaemonSet in slot a.
        docs.append(generations.generation_daemonset(c, generation, "a", defaults, cls=cls))
        deployment = engine_deployment(c)
        pod = mutation.mutate_pod(as_pod(deployment, f"engine-{name}"), c, defaults)
        docs.append(pod)
        if name == "gpu-vmm":
            # BlueGreen: the next revision loads in slot b beside the old, under an allowance.
            nxt = generations.Generation(revision="r2", path=c["spec"]["model"]["path"])
            docs.append(generations.generation_daemonset(c, nxt, "b", defaults, max_device_bytes=40 << 30, cls=cls))
            # A hot standby of the engine, as created and then mutated by the webhook.
            rs = {"metadata": {"name": f"engine-{name}-5d8f", "uid": "rs-1"},
                  "spec": {"replicas": 1, "template": copy.deepcopy(deployment["spec"]["template"])}}
            primary = dict(pod, spec={**pod["spec"], "nodeName": "gpu-node-0"})
            sb = standby.standby_pod(deployment, rs, primary, [GPU_UUID])
            sb["metadata"]["name"] = f"engine-{name}-standby"
            sb["metadata"].pop("generateName", None)
            docs.append(mutation.mutate_pod(sb, c, defaults))
    return docs


if __name__ == "__main__":
    import yaml

    yaml.safe_dump_all(documents(), sys.stdout, sort_keys=False)
