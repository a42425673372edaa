"""Hot standby, the pure part: which pods are primaries and which are standbys, when a
primary counts as dead, the standby pod built from the ReplicaSet's template, the patch
that promotes one, and the plan of one reconcile pass. Nothing here talks to a cluster.

A Deployment annotated `weightcache.io/hot-standby: "N"` (its pod template carrying the
cache label) gets N standbys per primary. A primary is a pod of the Deployment's current
ReplicaSet. A standby is a copy of that ReplicaSet's pod template, bound to its primary's
node, owned by the Deployment (so no ReplicaSet adopts it and it goes with the
Deployment), labelled only with the cache label and its role (so neither the user's
Service nor the ReplicaSet selects it); the template's labels wait in an annotation.
Promoting a standby gives it those labels and drops its owner: the ReplicaSet adopts it,
the Service's EndpointSlice lists it (it is Ready already), and the ReplicaSet, now one
pod over, removes one (the not-ready dead primary ranks first).

Pods are the API's JSON form (dicts, camelCase keys)."""

from __future__ import annotations

import copy
import datetime
import json
from dataclasses import dataclass, field

from .manifests import CACHE_LABEL

HOT_STANDBY_ANNOTATION = "weightcache.io/hot-standby"
ROLE_LABEL = "weightcache.io/role"
STANDBY_FOR_LABEL = "weightcache.io/standby-for"
STANDBY, PRIMARY = "standby", "primary"
# On standbys (and promoted pods): the template's labels, restored on promotion, and the
# Deployment they belong to (a promoted pod has no owner until its ReplicaSet adopts it).
TEMPLATE_LABELS_ANNOTATION = "weightcache.io/template-labels"
DEPLOYMENT_ANNOTATION = "weightcache.io/deployment"
PROMOTED_FROM_ANNOTATION = "weightcache.io/promoted-for"
TEMPLATE_HASH_LABEL = "pod-template-hash"
REVISION_ANNOTATION = "deployment.kubernetes.io/revision"
GPU_RESOURCE = "nvidia.com/gpu"
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
HOSTNAME_LABEL = "kubernetes.io/hostname"
MAX_STANDBYS = 8  # per primary: more is a typo, not a plan


class StandbyRefused(ValueError):
    """The Deployment cannot have standbys as it is; the message says why and what to do."""


class NotYet(Exception):
    """A standby cannot be built yet (the primary has not said what it needs); a later
    event of the primary brings it."""


# -- reading the annotation and the objects ----------------------------------------------
def wanted_standbys(deployment: dict) -> int:
    """N of `weightcache.io/hot-standby: "N"` (0 when absent); StandbyRefused when it is
    not a whole number from 0 to MAX_STANDBYS, or the template does not use a cache."""
    meta = deployment["metadata"]
    raw = (meta.get("annotations") or {}).get(HOT_STANDBY_ANNOTATION)
    if raw is None:
        return 0
    text = str(raw).strip()
    if not text.isdigit() or int(text) > MAX_STANDBYS:
        raise StandbyRefused(f"annotation {HOT_STANDBY_ANNOTATION}={raw!r} on Deployment {meta['name']}: expected a "
                             f"whole number of standbys per primary from 0 to {MAX_STANDBYS}, like \"1\"")
    n = int(text)
    labels = ((deployment["spec"].get("template") or {}).get("metadata") or {}).get("labels") or {}
    if n and CACHE_LABEL not in labels:
        raise StandbyRefused(f"Deployment {meta['name']} asks for hot standby but its pod template has no "
                             f"{CACHE_LABEL} label: a standby must attach to a cache's resident weights "
                             f"(label the template with {CACHE_LABEL}=<WeightCache name>)")
    selector = deployment["spec"].get("selector") or {}
    keys = set(selector.get("matchLabels") or {}) | {e.get("key") for e in selector.get("matchExpressions") or []}
    if n and keys <= {CACHE_LABEL}:
        raise StandbyRefused(f"Deployment {meta['name']}: its selector uses only {CACHE_LABEL}, which standbys carry "
                             f"too; select the pods by a label of their own (e.g. app=...) so that standbys stay "
                             f"out of the ReplicaSet and the Service")
    return n


def labels_of(obj: dict) -> dict:
    return (obj.get("metadata") or {}).get("labels") or {}


def controller_of(obj: dict) -> dict | None:
    return next((o for o in (obj.get("metadata") or {}).get("ownerReferences") or [] if o.get("controller")), None)


def is_standby(pod: dict) -> bool:
    return labels_of(pod).get(ROLE_LABEL) == STANDBY


def is_terminating(pod: dict) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def pod_condition(pod: dict, kind: str) -> dict:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == kind), {})


def is_ready(pod: dict) -> bool:
    return pod_condition(pod, "Ready").get("status") == "True"


def deployment_of(pod: dict) -> str | None:
    """The name of the Deployment a cache-labelled pod belongs to, from the pod alone:
    a standby's owner, a promoted pod's annotation, or a ReplicaSet pod's owner named
    `<deployment>-<pod-template-hash>`, as the Deployment controller names them."""
    owner = controller_of(pod)
    if owner and owner.get("kind") == "Deployment":
        return owner["name"]
    if owner and owner.get("kind") == "ReplicaSet":
        suffix = "-" + labels_of(pod).get(TEMPLATE_HASH_LABEL, "")
        return owner["name"][:-len(suffix)] if suffix != "-" and owner["name"].endswith(suffix) else None
    return ((pod["metadata"].get("annotations") or {}).get(DEPLOYMENT_ANNOTATION)) if owner is None else None


def current_replicaset(deployment: dict, replicasets: list[dict]) -> dict | None:
    """The ReplicaSet the Deployment rolls to: owned by it, with its revision number."""
    uid, revision = deployment["metadata"]["uid"], (deployment["metadata"].get("annotations") or {}).get(REVISION_ANNOTATION)
    owned = [rs for rs in replicasets if (controller_of(rs) or {}).get("uid") == uid]
    if revision is None:
        return None
    return next((rs for rs in owned if (rs["metadata"].get("annotations") or {}).get(REVISION_ANNOTATION) == revision),
                None)


def template_hash(rs: dict) -> str:
    return labels_of(rs).get(TEMPLATE_HASH_LABEL) or ((rs["spec"]["template"].get("metadata") or {}).get("labels")
                                                       or {}).get(TEMPLATE_HASH_LABEL, "")


def standby_template_hash(standby: dict) -> str:
    return _template_labels(standby).get(TEMPLATE_HASH_LABEL, "")


def _template_labels(standby: dict) -> dict:
    raw = (standby["metadata"].get("annotations") or {}).get(TEMPLATE_LABELS_ANNOTATION) or "{}"
    try:
        labels = json.loads(raw)
    except ValueError:
        return {}
    return labels if isinstance(labels, dict) else {}


# -- when a primary is dead --------------------------------------------------------------
def _time(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)


def _long_running(pod: dict) -> list[dict]:
    """Statuses of the containers meant to keep running: app containers and native sidecars."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    sidecars = {c["name"] for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always"}
    return list(status.get("containerStatuses") or []) + [
        s for s in status.get("initContainerStatuses") or [] if s.get("name") in sidecars]


def container_death(pod: dict) -> str | None:
    """Why a running primary counts as dead ("container engine exited 137"), or None.

    Dead: the pod failed, or it is not Ready because a container died during this
    not-Ready spell: one is terminated (or waiting to restart) now, or one restarted no
    earlier than the pod turned not-Ready. Not dead: a pod starting up (nothing has
    terminated), a readiness probe failing while every container runs (an old restart
    predates the not-Ready spell), a pod that is Ready."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Failed", "Succeeded"):
        return f"pod phase {status['phase']}"
    if is_ready(pod):
        return None
    not_ready_since = _time(pod_condition(pod, "Ready").get("lastTransitionTime"))
    for s in _long_running(pod):
        state, last = s.get("state") or {}, (s.get("lastState") or {}).get("terminated")
        term = state.get("terminated")
        if term:
            return f"container {s['name']} exited {term.get('exitCode')}"
        if last and ("waiting" in state or (not_ready_since and (_time(last.get("finishedAt")) or not_ready_since)
                                            >= not_ready_since)):
            return f"container {s['name']} exited {last.get('exitCode')} and restarted"
    return None


def deletion_requested(pod: dict) -> datetime.datetime | None:
    """When the pod's deletion was asked for. Its deletionTimestamp is not that moment but
    the end of its grace period, by which a replacement has often been created already."""
    meta = pod["metadata"]
    deadline = _time(meta.get("deletionTimestamp"))
    if deadline is None:
        return None
    return deadline - datetime.timedelta(seconds=int(meta.get("deletionGracePeriodSeconds") or 0))


def replacement_wanted(rs: dict, rs_pods: list[dict], gone: str, since: datetime.datetime | None) -> bool:
    """Whether the ReplicaSet will replace the pod named GONE (being deleted, or gone):
    it has fewer pods that count than it wants. Counted: its other pods that are not
    being deleted and are Ready or older than SINCE (the deletion's time). Not counted:
    a replacement the ReplicaSet already started. So a scale-down (the ReplicaSet keeps
    exactly what it wants) or a rollout's removal of old pods promotes nothing; a deleted
    or lost pod that the ReplicaSet will replace does."""
    count = 0
    for p in rs_pods:
        if p["metadata"]["name"] == gone or is_terminating(p):
            continue
        created = _time(p["metadata"].get("creationTimestamp"))
        if is_ready(p) or (since is not None and created is not None and created <= since):
            count += 1
    return count < int((rs.get("spec") or {}).get("replicas") or 0)


# -- the standby pod ---------------------------------------------------------------------
def gpu_limited(container: dict) -> bool:
    resources = container.get("resources") or {}
    return any(GPU_RESOURCE in (resources.get(k) or {}) for k in ("limits", "requests"))


def uses_device_plugin_gpus(template_spec: dict) -> bool:
    return any(gpu_limited(c) for c in (template_spec.get("containers") or []) + (template_spec.get("initContainers") or []))


def _share_gpus(container: dict, gpu_uuids: list[str]) -> dict:
    """A container that asked the device plugin for GPUs: no request (the primary holds
    them), the primary's GPUs by UUID instead, for the NVIDIA container runtime."""
    c = copy.deepcopy(container)
    if not gpu_limited(c):
        return c
    for key in ("limits", "requests"):
        values = (c.get("resources") or {}).get(key)
        if values is not None:
            values.pop(GPU_RESOURCE, None)
            if not values:
                del c["resources"][key]
    env = [e for e in c.get("env") or [] if e.get("name") != VISIBLE_DEVICES_ENV]
    c["env"] = env + [{"name": VISIBLE_DEVICES_ENV, "value": ",".join(gpu_uuids)}]
    return c


def shared_claims(template_spec: dict, primary: dict) -> list[dict]:
    """The template's pod resourceClaims, each pointing at the primary's own claim:
    a named claim stays as it is; one generated from a ResourceClaimTemplate becomes the
    claim generated for the primary (its status.resourceClaimStatuses)."""
    generated = {s["name"]: s.get("resourceClaimName")
                 for s in (primary.get("status") or {}).get("resourceClaimStatuses") or []}
    out = []
    for claim in template_spec.get("resourceClaims") or []:
        if claim.get("resourceClaimName"):
            out.append({"name": claim["name"], "resourceClaimName": claim["resourceClaimName"]})
        elif claim.get("resourceClaimTemplateName"):
            name = generated.get(claim["name"])
            if not name:
                raise NotYet(f"primary {primary['metadata']['name']} has no ResourceClaim generated for "
                             f"{claim['name']!r} yet (status.resourceClaimStatuses)")
            out.append({"name": claim["name"], "resourceClaimName": name})
        else:
            out.append(copy.deepcopy(claim))
    return out


def _pin_to_node(spec: dict, node: str) -> None:
    """Required node affinity on the node's hostname label, ANDed into every term: the
    scheduler's DRA plugin then reserves the shared claim for the standby too."""
    requirement = {"key": HOSTNAME_LABEL, "operator": "In", "values": [node]}
    affinity = spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
    required = affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [
        {**t, "matchExpressions": [e for e in t.get("matchExpressions") or [] if e.get("key") != HOSTNAME_LABEL]
         + [requirement]} for t in terms]


def standby_pod(deployment: dict, rs: dict, primary: dict, gpu_uuids: list[str] | None = None) -> dict:
    """The standby of PRIMARY (a pod of RS, the Deployment's current ReplicaSet).

    Bound to the primary's node by spec.nodeName (no scheduling cycle), except with DRA
    claims: those must be reserved for the pod, which the scheduler does, so the pod is
    pinned to the node by affinity instead. Device-plugin GPUs are shared by UUID
    (GPU_UUIDS, what the primary's engine attached); NotYet while they are unknown."""
    dmeta, template = deployment["metadata"], rs["spec"]["template"]
    node = (primary.get("spec") or {}).get("nodeName")
    if not node:
        raise NotYet(f"primary {primary['metadata']['name']} is not on a node yet")
    tmeta = template.get("metadata") or {}
    spec = copy.deepcopy(template["spec"])
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        if any(p.get("hostPort") for p in c.get("ports") or []):
            raise StandbyRefused(f"Deployment {dmeta['name']}: container {c['name']} uses a hostPort, which a "
                                 f"standby on the same node cannot bind too; drop the hostPort or the hot standby")
    if uses_device_plugin_gpus(spec):
        if not gpu_uuids:
            raise NotYet(f"primary {primary['metadata']['name']} has not reported its GPU UUIDs yet")
        spec["containers"] = [_share_gpus(c, gpu_uuids) for c in spec.get("containers") or []]
        if spec.get("initContainers"):
            spec["initContainers"] = [_share_gpus(c, gpu_uuids) for c in spec["initContainers"]]
    spec.pop("schedulingGates", None)  # not allowed beside nodeName; nothing to wait for
    if spec.get("resourceClaims"):
        spec["resourceClaims"] = shared_claims(spec, primary)
        _pin_to_node(spec, node)
    else:
        spec["nodeName"] = node
    template_labels = dict(tmeta.get("labels") or {})
    annotations = {**(tmeta.get("annotations") or {}),
                   TEMPLATE_LABELS_ANNOTATION: json.dumps(template_labels, sort_keys=True),
                   DEPLOYMENT_ANNOTATION: dmeta["name"]}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"{rs['metadata']['name']}-standby-",
            "namespace": dmeta["namespace"],
            "labels": {CACHE_LABEL: template_labels[CACHE_LABEL], ROLE_LABEL: STANDBY,
                       STANDBY_FOR_LABEL: primary["metadata"]["name"]},
            "annotations": annotations,
            # The Deployment as controller: no ReplicaSet adopts a pod another controller
            # owns, and the garbage collector removes it with the Deployment.
            # blockOwnerDeletion is left out: setting it needs update rights on the
            # Deployment's finalizers where OwnerReferencesPermissionEnforcement is on.
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": dmeta["name"],
                                 "uid": dmeta["uid"], "controller": True}],
        },
        "spec": spec,
    }


def promotion_patch(standby: dict, dead_primary: str) -> dict:
    """The merge patch that makes STANDBY a primary: the template's labels (with
    pod-template-hash, so the ReplicaSet's selector matches and the Service's too), role
    primary, no standby-for, no owner (so the ReplicaSet adopts it). Carries the
    standby's resourceVersion: a standby changed meanwhile is not promoted blindly."""
    labels = _template_labels(standby)
    if TEMPLATE_HASH_LABEL not in labels:
        raise StandbyRefused(f"standby {standby['metadata']['name']} has no template labels with "
                             f"{TEMPLATE_HASH_LABEL} in {TEMPLATE_LABELS_ANNOTATION}")
    new = {k: None for k in labels_of(standby) if k not in labels}
    new.update(labels)
    new[ROLE_LABEL] = PRIMARY
    return {"metadata": {"resourceVersion": standby["metadata"]["resourceVersion"], "labels": new,
                         "annotations": {PROMOTED_FROM_ANNOTATION: dead_primary},
                         "ownerReferences": []}}


def repoint_patch(standby: dict, primary: str) -> dict:
    return {"metadata": {"resourceVersion": standby["metadata"]["resourceVersion"],
                         "labels": {STANDBY_FOR_LABEL: primary}}}


# -- one pass ----------------------------------------------------------------------------
@dataclass
class Plan:
    """What one pass does, in this order: promote, re-point, delete, create."""

    promote: list[tuple[dict, str, str]] = field(default_factory=list)  # (standby, dead primary, why)
    repoint: list[tuple[dict, str]] = field(default_factory=list)  # (standby, new primary name)
    delete: list[tuple[dict, str]] = field(default_factory=list)  # (standby, why)
    create: list[dict] = field(default_factory=list)  # primaries that need one more standby each

    def empty(self) -> bool:
        return not (self.promote or self.repoint or self.delete or self.create)


def _pick(standbys: list[dict]) -> dict:
    """The standby to promote: Ready the longest (then by name, for one answer)."""
    return min(standbys, key=lambda s: (pod_condition(s, "Ready").get("lastTransitionTime") or "",
                                        s["metadata"]["name"]))


def plan(deployment: dict, rs: dict | None, pods: list[dict], standbys: list[dict], n: int) -> Plan:
    """One pass for one Deployment: PODS match its selector (any ReplicaSet, or none),
    STANDBYS are the pods it owns as standbys, N the standbys wanted per primary."""
    out = Plan()
    if rs is None or n == 0:
        out.delete = [(s, "hot standby off" if n == 0 else "no current ReplicaSet")
                      for s in standbys if not is_terminating(s)]
        return out
    rs_hash, rs_uid = template_hash(rs), rs["metadata"]["uid"]
    live_standbys = [s for s in standbys if not is_terminating(s)]
    for s in live_standbys:
        if standby_template_hash(s) != rs_hash:
            out.delete.append((s, "built from an earlier pod template"))
        elif (s.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
            out.delete.append((s, f"standby {s['status']['phase'].lower()}"))
    doomed = {s["metadata"]["uid"] for s, _ in out.delete}
    live_standbys = [s for s in live_standbys if s["metadata"]["uid"] not in doomed]

    def current(p: dict) -> bool:
        owner = controller_of(p)
        return (labels_of(p).get(TEMPLATE_HASH_LABEL) == rs_hash and not is_standby(p)
                and (owner is None or owner.get("uid") == rs_uid))
    primaries = {p["metadata"]["name"]: p for p in pods if current(p)}
    by_primary: dict[str, list[dict]] = {}
    for s in live_standbys:
        by_primary.setdefault(labels_of(s).get(STANDBY_FOR_LABEL, ""), []).append(s)

    for name, group in sorted(by_primary.items()):
        primary = primaries.get(name)
        if primary is not None:
            node = primary["spec"].get("nodeName")
            astray = [s for s in group if node and s["spec"].get("nodeName") not in (None, node)]
            out.delete += [(s, "on another node than its primary") for s in astray]
            group = by_primary[name] = [s for s in group if s not in astray]
            if not group:
                continue
        if primary is None:
            dead = "primary gone" if replacement_wanted(rs, list(primaries.values()), name,
                                                        _time(group[0]["metadata"].get("creationTimestamp"))) else None
        elif is_terminating(primary):
            dead = "primary deleted" if replacement_wanted(rs, list(primaries.values()), name,
                                                           deletion_requested(primary)) else None
        else:
            dead = container_death(primary)
            if dead is None:
                extra = sorted(group, key=lambda s: (is_ready(s), s["metadata"]["name"]))[:max(0, len(group) - n)]
                out.delete += [(s, f"more than {n} standby(s) for {name}") for s in extra]
                continue
        if dead is None:  # a scale-down or a rollout removed the primary: its standbys go too
            out.delete += [(s, f"primary {name} removed by its ReplicaSet") for s in group]
            continue
        ready = [s for s in group if is_ready(s)]
        if not ready:
            continue  # nothing to promote yet; a standby turning Ready brings another pass
        chosen = _pick(ready)
        out.promote.append((chosen, name, dead))
        out.repoint += [(s, chosen["metadata"]["name"]) for s in group if s is not chosen]

    # Every Ready primary keeps N standbys. A pod promoted in this pass is not among
    # them yet: the next pass (its own label change is an event) sees it as a primary
    # with the standbys re-pointed to it, and tops them up.
    for name, primary in sorted(primaries.items()):
        if is_terminating(primary) or not is_ready(primary) or not primary["spec"].get("nodeName"):
            continue
        out.create += [primary] * max(0, n - len(by_primary.get(name, [])))
    return out


def selector_string(selector: dict) -> str:
    """A LabelSelector (matchLabels, matchExpressions) as the API's labelSelector query."""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], ",".join(e.get("values") or [])
        parts.append({"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})", "Exists": key,
                      "DoesNotExist": f"!{key}"}[op])
    return ",".join(parts)
