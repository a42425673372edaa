"""The kopf handlers: thin shells that hand every WeightCache event, timer tick,
DaemonSet or daemon-pod event to the Reconciler, the deletion to its finalize(), and the
pod admission to the pure mutation.

Handlers are registered on a registry passed in (no module-level state), and return
nothing: kopf would store a handler's result in status, which the CRD does not allow.
"""

from __future__ import annotations

import logging

import kopf

from . import classes
from .hotstandby import StandbyController
from .kube import ApiError, Kube
from .manifests import CACHE_LABEL, CACHE_NAMESPACE_LABEL, DAEMON_APP, GROUP, NAME_LABEL, PLURAL, VERSION, Defaults
from .managed import MANAGED_ANNOTATION as MANAGED_ROLLOUT
from .mutation import MutationRefused, is_daemon_pod, mutate_pod
from .reconcile import Reconciler, Waiting

CACHES = (GROUP, VERSION, PLURAL)
WEBHOOK_ID = "mutate-pods"  # the webhook's URL path: https://<host>:<port>/mutate-pods
VALIDATE_ID = "validate-caches"  # https://<host>:<port>/validate-caches

log = logging.getLogger("weightcache.operator")


def emit_event(cache: dict, type: str, reason: str, message: str) -> None:
    """A Kubernetes Event on the cache through kopf's poster (queued, retried)."""
    try:
        kopf.event(cache, type=type, reason=reason, message=message[:1000])
    except LookupError:  # outside an operator context (no poster to queue to)
        log.debug("event not posted", extra={"fields": {"reason": reason, "message": message}})


def register(registry: kopf.OperatorRegistry, reconciler: Reconciler, kube: Kube, defaults: Defaults,
             poll_interval: float = 2.0, delete_retry: float = 2.0,
             standbys: StandbyController | None = None) -> None:

    @kopf.on.login(registry=registry)
    def login(**kwargs):
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    def peer_cluster_wide(settings: kopf.OperatorSettings, **_):
        # One ClusterKopfPeering for all replicas, also when they serve a few namespaces.
        settings.peering.clusterwide = True

    @kopf.on.resume(*CACHES, id="resume", registry=registry)
    @kopf.on.create(*CACHES, id="create", registry=registry)
    @kopf.on.update(*CACHES, id="update", field="spec", registry=registry)
    def reconcile_cache(namespace, name, **_):
        reconciler.reconcile(namespace, name)

    # Level-triggered: daemons' loading progress, attached clients and hand edits show
    # up in no event of the WeightCache, so every cache is also looked at on a timer.
    @kopf.timer(*CACHES, id="poll", interval=poll_interval, registry=registry)
    def poll(namespace, name, **_):
        reconciler.reconcile(namespace, name)

    # Daemons live in the operator's namespace; their labels name the cache's. A DaemonSet
    # whose cache is gone is deleted by the pass its event runs (orphans, after a restart).
    daemon_labels = {NAME_LABEL: DAEMON_APP, CACHE_LABEL: kopf.PRESENT, CACHE_NAMESPACE_LABEL: kopf.PRESENT}

    @kopf.on.event("apps", "v1", "daemonsets", id="daemonset-event", registry=registry, labels=daemon_labels)
    @kopf.on.event("v1", "pods", id="daemon-pod-event", registry=registry, labels=daemon_labels)
    def daemon_changed(labels, **_):
        reconciler.reconcile(labels[CACHE_NAMESPACE_LABEL], labels[CACHE_LABEL])

    # Managed rollouts: a labelled engine Deployment's template change runs its cache's
    # pass at once, which pauses the rollout until the generation it needs is ready.
    @kopf.on.event("apps", "v1", "deployments", id="managed-rollout-event", registry=registry,
                   labels={CACHE_LABEL: kopf.PRESENT}, annotations={MANAGED_ROLLOUT: "true"})
    def managed_deployment_changed(namespace, labels, **_):
        reconciler.reconcile(namespace, labels[CACHE_LABEL])

    @kopf.on.delete(*CACHES, id="finalize", registry=registry)
    def finalize(namespace, name, **_):
        cache = kube.get_cache(namespace, name)
        if cache is None:
            return
        try:
            reconciler.finalize(cache)
        except Waiting as w:
            raise kopf.TemporaryError(str(w), delay=delete_retry)

    if standbys is not None:
        # Hot standby: watch-driven, no timer. Every event of a Deployment (the
        # controller keeps those that ask for standbys, or did) and of every engine pod
        # (a primary dying or deleted, a standby turning Ready) runs a pass.
        @kopf.on.event("apps", "v1", "deployments", id="standby-deployment-event", registry=registry)
        def standby_deployment_changed(body, **_):
            standbys.deployment_event(_plain(body))

        @kopf.on.event("v1", "pods", id="standby-pod-event", registry=registry, labels={CACHE_LABEL: kopf.PRESENT})
        def standby_pod_changed(body, **_):
            pod = _plain(body)
            if not is_daemon_pod(pod):
                standbys.pod_event(pod)

    # A cache its class refuses is refused at the door, with every broken rule named. The
    # reconciler checks again (a class can change later); this is where a tenant hears it.
    @kopf.on.validate(*CACHES, id=VALIDATE_ID, operations=["CREATE", "UPDATE"], side_effects=False,
                      registry=registry)
    def validate_cache(body, old, operation, **_):
        cache = _plain(body)
        if cache["metadata"].get("deletionTimestamp"):
            return  # its finalizer must always be removable
        if operation == "UPDATE" and old is not None and _plain(old).get("spec") == cache.get("spec"):
            return  # metadata only (the operator's own annotations and finalizer)
        cache["metadata"]["namespace"] = cache["metadata"].get("namespace") or "default"
        try:
            reconciler.class_of(cache)
        except classes.ClassRefused as e:
            raise kopf.AdmissionError(str(e), code=403)
        except ApiError as e:
            raise kopf.AdmissionError(f"cannot read the WeightCacheClasses: {e}", code=500)

    @kopf.on.mutate("v1", "pods", id=WEBHOOK_ID, operations=["CREATE"], side_effects=False, registry=registry,
                    labels={CACHE_LABEL: kopf.PRESENT})
    def mutate_pods(body, patch, **_):
        pod = _plain(body)
        if is_daemon_pod(pod):
            return
        ns, name = pod["metadata"].get("namespace") or "default", pod["metadata"]["labels"][CACHE_LABEL]
        try:
            cache = kube.get_cache(ns, name)
        except ApiError as e:
            raise kopf.AdmissionError(f"cannot read WeightCache {ns}/{name}: {e}", code=500)
        if cache is None:
            raise kopf.AdmissionError(
                f"WeightCache {name!r} not found in namespace {ns!r}: the pod's label {CACHE_LABEL}={name} names "
                f"a cache that does not exist; create it first, or remove the label", code=403)
        if cache["metadata"].get("deletionTimestamp"):
            raise kopf.AdmissionError(f"WeightCache {ns}/{name} is being deleted; no new engines may use it", code=403)
        try:
            mutated = mutate_pod(pod, cache, defaults)
        except MutationRefused as e:
            raise kopf.AdmissionError(str(e), code=403)

        def replace(raw):
            raw.clear()
            raw.update(mutated)
        patch.fns.append(replace)


def _plain(body) -> dict:
    """A kopf Body (a mapping view) as plain nested dicts and lists."""
    def walk(v):
        if hasattr(v, "items"):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v
    return walk(body)


class QuietWaits(logging.Filter):
    """kopf logs every retry of a waiting deletion, and every refused pod, as an error.
    Both are expected outcomes (said in the cache's status and Events, or to the pod's
    creator), so they are logged at debug and info here."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        message = record.getMessage()
        if "failed temporarily: waiting: " in message:
            level = logging.DEBUG
        elif message.startswith((f"Webhook '{WEBHOOK_ID}' failed permanently: ",
                                 f"Webhook '{VALIDATE_ID}' failed permanently: ")):
            level = logging.INFO
        else:
            return True
        record.levelno, record.levelname = level, logging.getLevelName(level)
        return logging.getLogger(record.name).isEnabledFor(level)
