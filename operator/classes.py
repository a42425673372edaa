"""What a WeightCacheClass allows a cache, as pure functions: which class applies to a
cache, and every rule of it the cache breaks, each said with the field and the rule.

The class is the cluster admin's (cluster-scoped, like a StorageClass); the cache is the
tenant's. The admission webhook refuses a cache that breaks its class, and the reconciler
checks again before it creates anything (a class may change after a cache was admitted,
and a webhook can be bypassed by whoever may edit its configuration): a refused cache
gets no daemon, and says why in its status.
"""

from __future__ import annotations

import posixpath

CLASS_PLURAL = "weightcacheclasses"
DEFAULT_CLASS_ANNOTATION = "weightcache.io/is-default-class"


class ClassRefused(ValueError):
    """The cache may not be served under its class; the message names every broken rule."""


def is_default(cls: dict) -> bool:
    return ((cls.get("metadata") or {}).get("annotations") or {}).get(DEFAULT_CLASS_ANNOTATION) == "true"


def class_for(cache: dict, classes: list[dict]) -> dict:
    """The class of CACHE among CLASSES: the one spec.className names, else the default
    (the newest, if an admin marked several, as Kubernetes does for StorageClasses)."""
    wanted = (cache.get("spec") or {}).get("className")
    if wanted:
        for cls in classes:
            if cls["metadata"]["name"] == wanted:
                return cls
        raise ClassRefused(f"spec.className: WeightCacheClass {wanted!r} does not exist; "
                           f"`kubectl get {CLASS_PLURAL}` lists those the cluster admin made")
    defaults = [c for c in classes if is_default(c)]
    if not defaults:
        raise ClassRefused(f"spec.className is empty and no WeightCacheClass is the default "
                           f"({DEFAULT_CLASS_ANNOTATION}: \"true\"); name one of `kubectl get {CLASS_PLURAL}`")
    return max(defaults, key=lambda c: (c["metadata"].get("creationTimestamp") or "", c["metadata"]["name"]))


def selector_matches(selector: dict | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) against LABELS; None or {}: all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        present = key in labels
        if ((op == "In" and not (present and labels[key] in values))
                or (op == "NotIn" and present and labels[key] in values)
                or (op == "Exists" and not present) or (op == "DoesNotExist" and present)):
            return False
    return True


def host_model_dir(spec: dict) -> str | None:
    """The host directory a cache's daemons would mount for the model (None: not a host
    path). With spec.model.volume.hostPath the volume's path is the host's; without a
    volume spec.model.path itself is."""
    model = spec.get("model") or {}
    volume = model.get("volume")
    if not volume:
        return model.get("path")
    if "hostPath" in volume:
        return volume["hostPath"].get("path")
    return None


def within(path: str, root: str) -> bool:
    """PATH is ROOT or inside it, compared as normalised absolute paths (so "/models2"
    is not inside "/models", and "/models/../etc" is not either)."""
    if not path.startswith("/"):
        return False
    path, root = posixpath.normpath(path), posixpath.normpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def refusals(cache: dict, cls: dict, namespace_labels: dict[str, str]) -> list[str]:
    """Every rule of CLS that CACHE breaks (empty: it may be served). NAMESPACE_LABELS:
    the labels of the cache's namespace, for the class's namespaceSelector."""
    meta, spec, rules = cache["metadata"], cache.get("spec") or {}, cls.get("spec") or {}
    name, ns = cls["metadata"]["name"], meta["namespace"]
    out = []
    if not selector_matches(rules.get("namespaceSelector"), namespace_labels):
        out.append(f"namespace {ns!r} may not use WeightCacheClass {name!r} (its spec.namespaceSelector does not "
                   f"select the namespace's labels)")
    backend = spec.get("backend", "cuda-vmm")
    allowed = rules.get("backends") or ["cuda-vmm", "cpu"]
    if backend not in allowed:
        out.append(f"spec.backend: {backend!r} is not allowed by WeightCacheClass {name!r} "
                   f"(spec.backends: {', '.join(allowed)})")
    if backend == "cuda-ipc" and not rules.get("allowHostIPC"):
        out.append(f"spec.backend: 'cuda-ipc' runs daemons and engines with the host's IPC and PID namespaces, "
                   f"which WeightCacheClass {name!r} does not allow (spec.allowHostIPC); use cuda-vmm")
    volume = (spec.get("model") or {}).get("volume") or {}
    if "persistentVolumeClaim" in volume:
        out.append(f"spec.model.volume.persistentVolumeClaim: the daemons run in the operator's namespace and cannot "
                   f"mount a claim of namespace {ns!r}; put the model under a model root of WeightCacheClass "
                   f"{name!r} ({', '.join(rules.get('modelRoots') or [])})")
    host = host_model_dir(spec)
    if host is not None and not any(within(host, root) for root in rules.get("modelRoots") or []):
        field = "spec.model.volume.hostPath.path" if volume else "spec.model.path"
        out.append(f"{field}: {host!r} is outside the model roots of WeightCacheClass {name!r} "
                   f"({', '.join(rules.get('modelRoots') or []) or 'none'}); the daemons read models only from there")
    return out


def check(cache: dict, classes: list[dict], namespace_labels: dict[str, str]) -> dict:
    """The class CACHE is served under, or ClassRefused naming every broken rule."""
    cls = class_for(cache, classes)
    broken = refusals(cache, cls, namespace_labels)
    if broken:
        raise ClassRefused("; ".join(broken))
    return cls
