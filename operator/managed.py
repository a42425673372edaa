"""Managed rollouts of engine Deployments, as pure decisions: an engine Deployment
labelled `weightcache.io/cache: <name>` and annotated `weightcache.io/managed-rollout:
"true"` is paused while the generation its pod template needs is not Ready on every node
of that generation, and resumed once it is.

Why a pause and nothing more: the webhook already sends each new pod to nodes where its
generation is ready, and the agent holds the pod un-Ready until it attached; the
Deployment controller already honours maxSurge and maxUnavailable. What it would do
wrong is keep rolling while the generation is still loading: scale the old ReplicaSet
down by maxUnavailable for pods that cannot start yet, and count the load against
progressDeadlineSeconds. A paused Deployment does neither; resumed, it rolls at the pace
its strategy allows, each new pod attaching instead of loading. The operator resumes only
a Deployment it paused itself (marked by an annotation): a user's pause is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import generations as gens

MANAGED_ANNOTATION = "weightcache.io/managed-rollout"
PAUSED_BY_ANNOTATION = "weightcache.io/paused-by"  # set while the operator holds the Deployment paused
PAUSED_BY = "weightcache-operator"


@dataclass(frozen=True)
class Gate:
    pause: bool
    reason: str
    message: str


def is_managed(deployment: dict) -> bool:
    return (deployment["metadata"].get("annotations") or {}).get(MANAGED_ANNOTATION) == "true"


def rollout_in_progress(deployment: dict) -> bool:
    """The controller has not yet seen the latest spec, or not every replica runs the
    latest template."""
    spec, status = deployment["spec"], deployment.get("status") or {}
    replicas = spec.get("replicas", 1)
    return (status.get("observedGeneration", 0) < deployment["metadata"].get("generation", 0)
            or status.get("updatedReplicas", 0) < replicas or status.get("replicas", 0) > replicas)


def needed_generation(deployment: dict, cache: dict) -> gens.Generation | None:
    """The generation the template's pods need: the revision they name, or the spec's."""
    template_meta = deployment["spec"]["template"].get("metadata") or {}
    revision = (template_meta.get("annotations") or {}).get(gens.REVISION_ANNOTATION)
    if revision is None:
        return gens.desired_generation(cache)
    return gens.generation_for_revision(cache, revision)


def gate(deployment: dict, cache: dict) -> Gate:
    """Whether DEPLOYMENT's rollout should wait for the cache, and why."""
    if not rollout_in_progress(deployment):
        return Gate(False, "RolloutComplete", "every replica runs the current template")
    needed = needed_generation(deployment, cache)
    name = cache["metadata"]["name"]
    if needed is None:
        revision = deployment["spec"]["template"]["metadata"]["annotations"][gens.REVISION_ANNOTATION]
        return Gate(True, "RevisionNotServed", f"the template needs revision {revision!r}, which WeightCache {name} "
                    f"does not serve; set its spec.model.revision")
    entry = next((e for e in (cache.get("status") or {}).get("generations") or [] if e.get("key") == needed.key), None)
    if entry is None or entry.get("phase") != gens.ACTIVE:
        where = f"ready on {entry['readyNodes']} nodes, {entry['phase']}" if entry else "not started yet"
        return Gate(True, "WaitingForCache", f"{needed.describe()} of WeightCache {name} is {where}; the rollout "
                    "resumes once it is ready on every node, and new pods then attach instead of loading")
    return Gate(False, "CacheReady", f"{needed.describe()} of WeightCache {name} is ready on {entry['readyNodes']} nodes")


def patch_for(deployment: dict, decided: Gate) -> dict | None:
    """The merge patch that makes the Deployment's pause what DECIDED says, or None.
    Only a pause the operator made is undone."""
    paused = bool(deployment["spec"].get("paused"))
    ours = (deployment["metadata"].get("annotations") or {}).get(PAUSED_BY_ANNOTATION) == PAUSED_BY
    if decided.pause and not paused:
        return {"metadata": {"annotations": {PAUSED_BY_ANNOTATION: PAUSED_BY}}, "spec": {"paused": True}}
    if not decided.pause and paused and ours:
        return {"metadata": {"annotations": {PAUSED_BY_ANNOTATION: None}}, "spec": {"paused": False}}
    return None
