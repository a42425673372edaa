"""Pure aggregation of what the operator observes into a WeightCache's status: the
DaemonSet, its pods, and each daemon's own `GET /status` report.

Per node the daemon's report wins (it knows loading progress, the failure reason, the
fingerprint and the bytes); where there is none yet, the pod's container states say
what they can (an image that cannot be pulled, a crash loop, still starting).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .manifests import is_store

READY, LOADING, FAILED = "ready", "loading", "failed"
HANDED_OVER = "handed-over"  # a daemon whose successor took its slabs over; it waits to be stopped
TAKING_OVER = "TakingOver"  # a new daemon's reason while it waits for the one it replaces
# The daemon flags that decide which weights it serves (the fingerprint): a daemon of an
# older template with the same ones serves what the current spec asks for (e.g. only the
# image changed) and stays ready until its successor has taken its slabs over.
WEIGHT_FLAGS = ("--model", "--backend", "--revision", "--tp-size", "--device", "--name", "--socket-dir")
REVISION_LABEL = "controller-revision-hash"  # the DaemonSet controller's pod-template hash

# Container waiting reasons that will not fix themselves by waiting.
_STUCK = frozenset({"CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "InvalidImageName",
                    "CreateContainerConfigError", "CreateContainerError", "RunContainerError"})
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


@dataclass
class NodeState:
    node: str
    state: str  # ready | loading | failed
    reason: str = ""
    message: str = ""
    devices: list[dict] = field(default_factory=list)
    progress: dict | None = None
    rollout: str = ""  # a daemon replacement under way on this node, while it stays ready


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB', 17179869184 -> '16 GiB'."""
    value, unit = float(n), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    text = f"{value:.1f}".rstrip("0").rstrip(".")
    return f"{text} {_UNITS[unit]}"


def _container_status(pod: dict, name: str = "daemon") -> dict:
    for s in (pod.get("status") or {}).get("containerStatuses") or []:
        if s.get("name") == name:
            return s
    return {}


def _pod_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def weight_args(args: list[str]) -> list[tuple[str, str]]:
    """The WEIGHT_FLAGS (flag, value) pairs of a daemon's args, in order."""
    return [(a, v) for a, v in zip(args, args[1:]) if a in WEIGHT_FLAGS]


def _daemon_args(pod: dict) -> list[str]:
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") == "daemon":
            return list(c.get("args") or [])
    return []


def node_state(pod: dict, report: dict | None, error: str = "", current: str | None = None,
               current_args: list[str] | None = None) -> NodeState:
    """One node's daemon from its pod and its report (None: not reachable, ERROR says why).
    CURRENT: the DaemonSet's pod-template hash; a pod of another is outdated, and an
    outdated daemon is not ready for this spec (engines would not match its fingerprint),
    unless CURRENT_ARGS (the template's daemon args) name the same weights it serves."""
    s = _node_state(pod, report, error)
    outdated = current is not None and (pod["metadata"].get("labels") or {}).get(REVISION_LABEL) != current
    if outdated and current_args is not None and weight_args(_daemon_args(pod)) == weight_args(current_args):
        outdated = False
    if outdated and s.state == READY:
        return NodeState(s.node, LOADING, "Outdated", "the daemon serves an earlier spec until the DaemonSet "
                         "replaces it", s.devices, None)
    return s


def _node_state(pod: dict, report: dict | None, error: str) -> NodeState:
    node = pod["spec"].get("nodeName") or "(unscheduled)"
    if report is not None and report.get("state") == HANDED_OVER:
        return NodeState(node, LOADING, "HandedOver", report.get("message") or "handed over to a successor")
    if report is not None:
        state = report.get("state") if report.get("state") in (READY, LOADING, FAILED) else LOADING
        return NodeState(node, state, report.get("reason") or "", report.get("message") or "",
                         list(report.get("devices") or []), report.get("progress"))
    cs = _container_status(pod)
    waiting = (cs.get("state") or {}).get("waiting") or {}
    if waiting.get("reason") in _STUCK:
        last = (cs.get("lastState") or {}).get("terminated") or {}
        detail = waiting.get("message") or ""
        if last:
            detail = (f"{detail}; " if detail else "") + f"last exit code {last.get('exitCode')}" + (
                f": {last['message'].strip()[-300:]}" if last.get("message") else "")
        return NodeState(node, FAILED, waiting["reason"], detail or f"daemon container is {waiting['reason']}")
    if _pod_ready(pod):  # the daemon's own /readyz said so, even if /status is out of reach from here
        return NodeState(node, READY, "", f"ready (status not reachable: {error})" if error else "ready")
    phase = (pod.get("status") or {}).get("phase") or "Pending"
    why = waiting.get("reason") or phase
    return NodeState(node, LOADING, "Starting", f"daemon pod is {why}" + (f"; status: {error}" if error else ""))


def _created(pod: dict) -> str:
    return pod["metadata"].get("creationTimestamp") or ""


def for_node(pods: list[tuple[dict, NodeState]]) -> NodeState:
    """One node's state from all its daemon pods (pod, state): during a surge rollout the
    old daemon serves until the new one beside it has taken its slabs over, so the node
    is ready while either serves, and `rollout` says what is under way."""
    ready = [(p, s) for p, s in pods if s.state == READY]
    if not ready:
        live = [(p, s) for p, s in pods if s.reason != "HandedOver"] or pods
        return max(live, key=lambda ps: (ps[0]["metadata"].get("deletionTimestamp") is None, _created(ps[0])))[1]
    serving, s = max(ready, key=lambda ps: _created(ps[0]))
    others = [o for p, o in pods if p is not serving and p["metadata"].get("deletionTimestamp") is None]
    if any(o.reason == TAKING_OVER for o in others):
        note = "hand-off in progress: a new daemon is taking the resident slabs over"
    elif any(o.reason == "HandedOver" or o.state == READY for o in others):
        note = "hand-off done: the new daemon serves; the old daemon's pod is being replaced"
    elif others:
        note = "a new daemon pod is starting beside the serving one, to take its slabs over"
    else:
        return s
    return NodeState(s.node, READY, s.reason, s.message, s.devices, s.progress, rollout=note)


def _condition(kind: str, ok: bool, reason: str, message: str, generation: int) -> dict:
    return {"type": kind, "status": "True" if ok else "False", "reason": reason, "message": message,
            "observedGeneration": generation}


def merge_conditions(old: list[dict], new: list[dict], now: str) -> list[dict]:
    """NEW with lastTransitionTime kept from OLD where a condition's status did not change."""
    before = {c.get("type"): c for c in old or []}
    out = []
    for c in new:
        prev = before.get(c["type"])
        t = prev.get("lastTransitionTime") if prev and prev.get("status") == c["status"] else None
        out.append({**c, "lastTransitionTime": t or now})
    return out


def _progress_text(s: NodeState) -> str:
    p = s.progress or {}
    total, loaded = p.get("total_bytes") or 0, p.get("loaded_bytes") or 0
    if not total:
        return f"{s.node}: {s.message or s.reason or 'loading'}"
    eta = p.get("eta_s")
    return (f"{s.node}: {100 * loaded // total}% of {human_bytes(total)}"
            + (f", eta {eta:.0f} s" if isinstance(eta, (int, float)) else ""))


def rollout_pending(daemonset: dict | None) -> bool:
    if not daemonset:
        return False
    st, gen = daemonset.get("status") or {}, daemonset["metadata"].get("generation", 0)
    return st.get("observedGeneration", 0) < gen or \
        st.get("updatedNumberScheduled", 0) < st.get("desiredNumberScheduled", 0)


def aggregate(cache: dict, daemonset: dict | None, states: list[NodeState], now: str,
              problem: tuple[str, str] | None = None, deleting: tuple[str, str] | None = None) -> dict:
    """The operator-owned part of CACHE's status.

    STATES: one per node with a daemon pod. PROBLEM (reason, message): the operator could
    not do its part (e.g. the DaemonSet was refused). DELETING (reason, message): the
    cache is being deleted and what that waits for."""
    generation = cache["metadata"].get("generation", 0)
    desired = max(len(states), ((daemonset or {}).get("status") or {}).get("desiredNumberScheduled", 0))
    by = {READY: [], LOADING: [], FAILED: []}
    for s in sorted(states, key=lambda s: s.node):
        by[s.state].append(s)
    ready, failed = len(by[READY]), len(by[FAILED])
    loading = desired - ready - failed  # nodes without a pod yet are loading too
    ready_devices = [d for s in by[READY] for d in s.devices]
    prints = Counter(d.get("fingerprint") for d in ready_devices if d.get("fingerprint"))
    fingerprint = sorted(prints.items(), key=lambda kv: (-kv[1], kv[0]))[0][0] if prints else ""
    per_gpu = max((int(d.get("resident_bytes") or 0) for d in ready_devices), default=0)
    attached = sum(int(d.get("attached_clients") or 0) for s in states for d in s.devices)

    failures = [{"node": s.node, "reason": s.reason or "Failed", "message": s.message} for s in by[FAILED]]
    reasons = sorted({f["reason"] for f in failures})
    degraded_msg = "; ".join(f"{f['node']}: {f['reason']}: {f['message']}" for f in failures)
    if problem:
        reasons = [problem[0]] + reasons
        degraded_msg = "; ".join(filter(None, [problem[1], degraded_msg]))
    degraded = _condition("Degraded", bool(reasons), reasons[0] if len(reasons) == 1 else
                          ("NodesFailed" if reasons else "NoFailures"), degraded_msg or "no node reports a failure",
                          generation)

    rolling = rollout_pending(daemonset)
    if deleting:
        progressing = _condition("Progressing", True, deleting[0], deleting[1], generation)
    elif loading > 0:
        text = "; ".join(_progress_text(s) for s in by[LOADING]) or f"{loading} node(s) starting their daemon"
        # Only daemons of an earlier spec left to replace: that is the rollout, not a load.
        outdated = len(by[LOADING]) == loading and all(s.reason == "Outdated" for s in by[LOADING])
        progressing = _condition("Progressing", True, "RollingOut" if outdated else "Loading", text, generation)
    elif rolling or any(s.rollout for s in states):
        notes = "; ".join(f"{s.node}: {s.rollout}" for s in sorted(states, key=lambda s: s.node) if s.rollout)
        progressing = _condition("Progressing", True, "RollingOut", notes or "the daemon DaemonSet is rolling out",
                                 generation)
    else:
        progressing = _condition("Progressing", False, "Stable", "nothing in progress", generation)

    store = is_store(cache.get("spec") or {})
    caches = published_caches(states) if store else []
    summary = store_summary(ready, desired, caches) if store else f"{ready}/{desired} nodes ready"
    if deleting:
        ready_c = _condition("Ready", False, "Deleting", deleting[1], generation)
    elif desired == 0:
        ready_c = _condition("Ready", False, problem[0] if problem else "NoMatchingNodes",
                             problem[1] if problem else "no node matches the placement", generation)
    elif ready == desired:
        ready_c = _condition("Ready", True, "AllNodesReady", summary, generation)
    else:
        ready_c = _condition("Ready", False, "NodesFailed" if failed else "NodesLoading", summary, generation)

    old = (cache.get("status") or {}).get("conditions") or []
    out = {
        "observedGeneration": generation,
        "conditions": merge_conditions(old, [ready_c, progressing, degraded], now),
        "nodes": {"desired": desired, "loading": loading, "ready": ready, "failed": failed, "failures": failures},
        "readyNodes": f"{ready}/{desired}",
        "fingerprint": fingerprint,
        "bytesPerGPU": per_gpu,
        "size": human_bytes(per_gpu) if per_gpu else "",
        "attachedClients": attached,
    }
    if store or "caches" in (cache.get("status") or {}):  # [] clears a store's list after a switch
        out["caches"] = caches
    return out


MAX_CACHES = 32  # status.caches holds at most this many entries (the CRD's maxItems)


def published_caches(states: list[NodeState]) -> list[dict]:
    """What engines published into the ready stores, one entry per fingerprint: the
    engine, its version and dtype, on how many nodes, the engines attached to it and
    the most bytes one device holds for it. Most widely held first."""
    by: dict[str, dict] = {}
    for s in states:
        if s.state != READY:
            continue
        for d in s.devices:
            for c in d.get("caches") or []:
                digest = c.get("fingerprint") or ""
                fields = c.get("fingerprint_fields") or {}
                e = by.setdefault(digest, {"engine": c.get("engine") or fields.get("engine") or "",
                                           "engineVersion": str(fields.get("engine_version") or ""),
                                           "dtype": str(fields.get("dtype") or ""), "fingerprint": digest,
                                           "nodes": set(), "attachedClients": 0, "bytesPerGPU": 0})
                e["nodes"].add(s.node)
                e["attachedClients"] += int(c.get("attached_clients") or 0)
                e["bytesPerGPU"] = max(e["bytesPerGPU"], int(c.get("resident_bytes") or 0))
    out = [{**e, "nodes": len(e["nodes"]), "size": human_bytes(e["bytesPerGPU"])} for e in by.values()]
    out.sort(key=lambda e: (-e["nodes"], -e["attachedClients"], e["engine"], e["fingerprint"]))
    return out[:MAX_CACHES]


def store_summary(ready: int, desired: int, caches: list[dict]) -> str:
    """The Ready message of a store cache: it is ready when it serves, empty or not."""
    head = f"store ready on {ready}/{desired} nodes"
    if not caches:
        return f"{head}; empty: the first engine on each node publishes"
    shown = "; ".join(f"{c['engine'] or 'engine'} {c['engineVersion']} {c['dtype']} ({c['size']}) on "
                      f"{c['nodes']}/{desired} nodes, {c['attachedClients']} attached".replace("  ", " ")
                      for c in caches[:3])
    more = f" and {len(caches) - 3} more" if len(caches) > 3 else ""
    return f"{head}; {len(caches)} published: {shown}{more}"


def ready_nodes(states: list[NodeState]) -> set[str]:
    return {s.node for s in states if s.state == READY}


def condition(status: dict | None, kind: str) -> dict:
    for c in (status or {}).get("conditions") or []:
        if c.get("type") == kind:
            return c
    return {}
