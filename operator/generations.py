"""Model generations of a WeightCache, as pure functions: what a generation is, which
DaemonSet serves it, and what one reconcile pass should do when `spec.model` changes.

A generation is the model the daemons serve: `spec.model.path` and `spec.model.revision`.
Any other spec change (image, resources, env) rolls a generation's DaemonSet in place;
a model change starts a new generation. A cache has at most two generations at once,
each in its own DaemonSet "slot": `weightcache-<cache>` (slot a) and
`weightcache-<cache>-b` (slot b). Which slot holds the newer one is whichever was free.

- `InPlace` (the default): the generation's DaemonSet is updated to the new model only
  once no engine holds the old one (attached clients, engine pods admitted for it).
  Downtime: the engines stop, then the new generation loads from disk.
- `BlueGreen`: the new generation loads beside the old in the free slot, when the
  per-GPU budget leaves room for it beside the old one's resident bytes; engines move as
  their pods roll; the old DaemonSet goes once no engine holds it. The operator cannot
  read the new checkpoint (it is on the nodes), so it gives the new daemons the bytes
  the budget leaves (`--max-device-bytes`) and each daemon checks its planned shard
  against that before allocating; a refusal (reason OverBudget) falls back to waiting
  as InPlace does.
"""

from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass, field

from .manifests import (Defaults, daemon_labels, daemonset_for, daemonset_name, node_label_key)
from .status import FAILED, READY, NodeState, human_bytes, merge_conditions
from .status import LOADING as LOADING_STATE

GENERATION_LABEL = "weightcache.io/generation"  # on a DaemonSet, and on engine pods (annotation)
SLOT_LABEL = "weightcache.io/slot"  # slot b's selector; slot a keeps the selector it always had
REVISION_ANNOTATION = "weightcache.io/revision"  # on a DaemonSet; on an engine pod (template): the revision it needs
MODEL_PATH_ANNOTATION = "weightcache.io/model-path"
MAX_BYTES_FLAG = "--max-device-bytes"
SLOTS = ("a", "b")
IN_PLACE, BLUE_GREEN = "InPlace", "BlueGreen"
# Phases of a generation in status.generations.
ACTIVE, LOADING, DRAINING, PENDING, OVER_BUDGET, RELEASING = (
    "Active", "Loading", "Draining", "Pending", "OverBudget", "Releasing")

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
_FACTORS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
            "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50}


@dataclass(frozen=True)
class Generation:
    revision: str
    path: str

    @property
    def key(self) -> str:
        """10 hex digits naming the generation in labels (model path and revision)."""
        return hashlib.sha256(f"{self.path}\0{self.revision}".encode()).hexdigest()[:10]

    def describe(self) -> str:
        return f"revision {self.revision!r}" if self.revision else f"model {self.path} (no revision)"


def desired_generation(cache: dict) -> Generation:
    model = cache["spec"]["model"]
    return Generation(revision=model.get("revision", ""), path=model["path"])


def parse_quantity(value) -> int:
    """A Kubernetes quantity of bytes ("80Gi", "80G", 85899345920) as an int."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _QUANTITY.match(str(value).strip())
    if not m:
        raise ValueError(f"{value!r} is not a byte quantity (e.g. 80Gi, 80G or a number of bytes)")
    return int(float(m.group(1)) * _FACTORS[m.group(2)])


def rollout_of(spec: dict) -> tuple[str, int | None]:
    """(strategy, per-GPU budget in bytes or None) from spec.rollout."""
    rollout = spec.get("rollout") or {}
    budget = rollout.get("memoryBudgetPerGPU")
    return rollout.get("strategy", IN_PLACE), (parse_quantity(budget) if budget is not None else None)


# -- DaemonSets of generations ----------------------------------------------------------------
def slot_daemonset_name(namespace: str, name: str, slot: str) -> str:
    return daemonset_name(namespace, name) if slot == "a" else f"{daemonset_name(namespace, name)}-{slot}"


def generation_node_label_key(namespace: str, name: str, generation: Generation) -> str:
    """`cache.weightcache.io/<hash10>-<gen10>`: the nodes where that generation is ready
    (the cache-wide key marks the spec's generation)."""
    return f"{node_label_key(namespace, name)}-{generation.key}"


def generation_daemonset(cache: dict, generation: Generation, slot: str, defaults: Defaults = Defaults(),
                         max_device_bytes: int | None = None, cls: dict | None = None) -> dict:
    """daemonset_for the cache with its model set to GENERATION, in SLOT, labelled with
    the generation; MAX_DEVICE_BYTES: the allowance of a generation loaded beside another."""
    at = copy.deepcopy(cache)
    at["spec"]["model"]["path"] = generation.path
    at["spec"]["model"]["revision"] = generation.revision
    ds = daemonset_for(at, defaults, cls)
    meta = ds["metadata"]
    meta["name"] = slot_daemonset_name(cache["metadata"]["namespace"], cache["metadata"]["name"], slot)
    meta["labels"][GENERATION_LABEL] = generation.key
    meta["annotations"] = {**(meta.get("annotations") or {}), REVISION_ANNOTATION: generation.revision,
                           MODEL_PATH_ANNOTATION: generation.path}
    if slot != "a":
        # Slot a's selector is the one it always had (a selector cannot change); slot b's
        # adds the slot, so the two DaemonSets never claim each other's pods.
        labels = {**daemon_labels(cache["metadata"]["namespace"], cache["metadata"]["name"]), SLOT_LABEL: slot}
        ds["spec"]["selector"] = {"matchLabels": labels}
        ds["spec"]["template"]["metadata"]["labels"] = {**ds["spec"]["template"]["metadata"]["labels"], **labels}
    if max_device_bytes is not None:
        container = ds["spec"]["template"]["spec"]["containers"][0]
        container["args"] = [*container["args"], MAX_BYTES_FLAG, str(max_device_bytes)]
    return ds


def slot_of(ds: dict) -> str:
    labels = ds["spec"].get("selector", {}).get("matchLabels") or {}
    return labels.get(SLOT_LABEL, "a")


def generation_of_daemonset(ds: dict) -> Generation:
    """The generation a DaemonSet serves, from its annotations (or, for one made before
    generations existed, from the daemon's arguments)."""
    ann = ds["metadata"].get("annotations") or {}
    if MODEL_PATH_ANNOTATION in ann:
        return Generation(revision=ann.get(REVISION_ANNOTATION, ""), path=ann[MODEL_PATH_ANNOTATION])
    args = ds["spec"]["template"]["spec"]["containers"][0].get("args") or []
    return Generation(revision=_arg(args, "--revision") or "", path=_arg(args, "--model") or "")


def allowance_of(ds: dict) -> int | None:
    value = _arg(ds["spec"]["template"]["spec"]["containers"][0].get("args") or [], MAX_BYTES_FLAG)
    return int(value) if value is not None else None


def _arg(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args[:-1]):
        if a == flag:
            return args[i + 1]
    return None


# -- what is observed of each generation --------------------------------------------------------
@dataclass
class Observed:
    """One live DaemonSet of the cache: its generation, slot and what its daemons and
    the engine pods say."""

    generation: Generation
    slot: str
    daemonset: dict
    states: list[NodeState] = field(default_factory=list)
    engine_pods: list[str] = field(default_factory=list)  # engine pods admitted for this generation

    @property
    def attached(self) -> int:
        return sum(int(d.get("attached_clients") or 0) for s in self.states for d in s.devices)

    @property
    def attachments_unknown(self) -> bool:
        """A ready daemon whose report could not be read: it may have clients."""
        return any(s.state == READY and not s.devices for s in self.states)

    @property
    def held(self) -> bool:
        return self.attached > 0 or bool(self.engine_pods) or self.attachments_unknown

    @property
    def resident_per_gpu(self) -> int:
        """The most bytes one GPU holds for this generation (resident, or planned while loading)."""
        resident = [int(d.get("resident_bytes") or 0) for s in self.states for d in s.devices]
        planned = [int((s.progress or {}).get("total_bytes") or 0) for s in self.states]
        return max(resident + planned, default=0)

    @property
    def over_budget(self) -> list[NodeState]:
        return [s for s in self.states if s.state == FAILED and s.reason == "OverBudget"]

    @property
    def ready_count(self) -> int:
        return sum(1 for s in self.states if s.state == READY)

    @property
    def desired_count(self) -> int:
        return max(len(self.states), ((self.daemonset.get("status") or {}).get("desiredNumberScheduled") or 0))


def holders_text(o: Observed) -> str:
    parts = []
    if o.attached:
        parts.append(f"{o.attached} attached client(s)")
    if o.engine_pods:
        shown = ", ".join(o.engine_pods[:5]) + (f" and {len(o.engine_pods) - 5} more" if len(o.engine_pods) > 5 else "")
        parts.append(f"{len(o.engine_pods)} engine pod(s) ({shown})")
    if o.attachments_unknown and not parts:
        parts.append("daemons whose attached clients cannot be read")
    return " and ".join(parts) or "nothing"


# -- the decision --------------------------------------------------------------------------------
@dataclass
class Plan:
    """What one pass does: DaemonSets to keep as (slot, generation, allowance), slots to
    delete, and why the spec's generation waits (reason, message) when it does."""

    keep: list[tuple[str, Generation, int | None]] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    target_slot: str | None = None
    waiting: tuple[str, str] | None = None


def plan(desired: Generation, strategy: str, budget: int | None, live: list[Observed], store: bool = False) -> Plan:
    """The pass for DESIRED (the spec's generation) given the LIVE DaemonSets of the cache.

    STORE (spec.source Published): one store serves every generation (its daemon names
    no model; engines of a new revision publish beside the old one's tensors, and the
    store evicts idle ones when its budget needs room), so a model change just moves
    the one DaemonSet to the new generation, in place, never waiting: its pods do not
    change. A second store of the cache on a node could not start (its lock is held)."""
    if store:
        slot = next((o.slot for o in live if o.generation == desired), None) or \
            (live[0].slot if live else SLOTS[0])
        return Plan(keep=[(slot, desired, None)], delete=[o.slot for o in live if o.slot != slot], target_slot=slot)
    target = next((o for o in live if o.generation == desired), None)
    others = [o for o in live if o is not target]
    held = [o for o in others if o.held]
    out = Plan()
    out.delete = [o.slot for o in others if not o.held]

    if target is not None:
        out.target_slot = target.slot
        allowance = allowance_of(target.daemonset)
        if target.over_budget and not held:
            # Alone now, the allowance no longer applies: the refused load runs without it.
            # (One loaded within it keeps it: changing the arguments would reload it.)
            allowance = None
        out.keep = [(target.slot, desired, allowance)] + [(o.slot, o.generation, allowance_of(o.daemonset))
                                                          for o in held]
        if target.over_budget and held:
            out.waiting = ("OverBudget", f"{desired.describe()} does not fit the per-GPU budget beside "
                           f"{_names(held)}: {target.over_budget[0].message}; falling back to InPlace: it loads "
                           f"once {_holders(held)} are gone")
        return out

    if not held:
        # Nobody uses what is there: the spec's generation takes over a slot in place.
        out.target_slot = others[0].slot if others else "a"
        out.delete = [o.slot for o in others if o.slot != out.target_slot]
        out.keep = [(out.target_slot, desired, None)]
        return out

    out.keep = [(o.slot, o.generation, allowance_of(o.daemonset)) for o in held]
    if strategy != BLUE_GREEN:
        out.waiting = ("WaitingForEngines", f"InPlace: {desired.describe()} loads once {_holders(held)} of "
                       f"{_names(held)} are gone (engines stop, then the new generation loads from disk)")
        return out
    if len(held) > 1:
        out.waiting = ("WaitingForEngines", f"BlueGreen: two generations are resident ({_names(held)}); "
                       f"{desired.describe()} loads once one of them is released")
        return out
    old = held[0]
    resident = old.resident_per_gpu
    room = (budget or 0) - resident
    if budget is None or room <= 0:
        out.waiting = ("BudgetExceeded", f"BlueGreen: {_names(held)} holds {human_bytes(resident)} per GPU and the "
                       f"budget is {human_bytes(budget or 0)}: no room for {desired.describe()} beside it; "
                       f"falling back to InPlace: it loads once {_holders(held)} are gone")
        return out
    out.target_slot = next(s for s in SLOTS if s != old.slot)
    out.keep.insert(0, (out.target_slot, desired, room))
    return out


def _names(observed: list[Observed]) -> str:
    return ", ".join(o.generation.describe() for o in observed)


def _holders(observed: list[Observed]) -> str:
    return " and ".join(holders_text(o) for o in observed)


# -- status.generations ---------------------------------------------------------------------------
def generations_status(desired: Generation, live: list[Observed], decided: Plan) -> list[dict]:
    """One entry per generation, the spec's first: revision, model path, DaemonSet,
    fingerprint, ready nodes, attached clients, engine pods, bytes per GPU, phase."""
    entries = []
    target = next((o for o in live if o.generation == desired), None)
    if target is None:
        entries.append({"revision": desired.revision, "modelPath": desired.path, "key": desired.key,
                        "daemonSet": "", "fingerprint": "", "readyNodes": "0/0", "attachedClients": 0,
                        "enginePods": 0, "bytesPerGPU": 0, "phase": PENDING,
                        "message": decided.waiting[1] if decided.waiting else "creating its DaemonSet"})
    for o in sorted(live, key=lambda o: o is not target):
        prints = sorted({d.get("fingerprint") for s in o.states if s.state == READY for d in s.devices
                         if d.get("fingerprint")})
        if o is target:
            if o.over_budget:
                phase, message = OVER_BUDGET, o.over_budget[0].message
            elif o.ready_count == o.desired_count and o.desired_count:
                phase, message = ACTIVE, "serves the spec's model"
            else:
                phase, message = LOADING, f"ready on {o.ready_count}/{o.desired_count} nodes"
        elif not o.held:
            phase, message = RELEASING, "no engine holds it; its DaemonSet is deleted"
        elif target is not None:
            phase, message = DRAINING, f"kept for {holders_text(o)}"
        else:
            phase, message = ACTIVE, f"serves {holders_text(o)} while the spec's model waits"
        entries.append({"revision": o.generation.revision, "modelPath": o.generation.path, "key": o.generation.key,
                        "daemonSet": o.daemonset["metadata"]["name"], "fingerprint": prints[0] if prints else "",
                        "readyNodes": f"{o.ready_count}/{o.desired_count}", "attachedClients": o.attached,
                        "enginePods": len(o.engine_pods), "bytesPerGPU": o.resident_per_gpu, "phase": phase,
                        "message": message})
    return entries


def rollout_summary(entries: list[dict]) -> str:
    """One line for the printer column: "r1 Draining 3/3 -> r2 Active 3/3", oldest first."""
    return " -> ".join(f"{e['revision'] or '-'} {e['phase']} {e['readyNodes']}" for e in reversed(entries))


def generation_for_revision(cache: dict, revision: str) -> Generation | None:
    """The generation an engine pod that names REVISION needs: the spec's, or one the
    status lists as still served."""
    desired = desired_generation(cache)
    if desired.revision == revision:
        return desired
    for e in (cache.get("status") or {}).get("generations") or []:
        if e.get("revision") == revision and e.get("phase") in (ACTIVE, LOADING, DRAINING):
            return Generation(revision=revision, path=e["modelPath"])
    return None


def engine_generation(pod: dict) -> str | None:
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(GENERATION_LABEL)


# Progressing reasons of a waiting generation, and the type of the Event each posts.
WAIT_EVENTS = {"WaitingForEngines": "Normal", "BudgetExceeded": "Warning", "OverBudget": "Warning"}


def states_for_status(states: list[NodeState]) -> list[NodeState]:
    """A daemon that refused to load over its budget is not a failure of the cache: the
    generation waits (said in Progressing), so it counts as loading, not Degraded."""
    return [NodeState(s.node, LOADING_STATE, s.reason, s.message, s.devices, s.progress)
            if s.state == FAILED and s.reason == "OverBudget" else s for s in states]


def with_generations(status: dict, entries: list[dict], decided: Plan, attached: int, old_conditions: list[dict],
                     now: str) -> dict:
    """STATUS (the spec's generation, from status.aggregate) with the generations listed,
    the printer column's summary, every generation's attached clients, and conditions
    that say what a model change waits for."""
    out = {**status, "generations": entries, "rollout": rollout_summary(entries), "attachedClients": attached}
    conditions = {c["type"]: {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status["conditions"]}
    older = entries[1:]
    if decided.waiting:
        reason, message = decided.waiting
        conditions["Progressing"].update(status="True", reason=reason, message=message)
        if entries and entries[0]["phase"] == PENDING:
            conditions["Ready"].update(status="False", reason=reason, message=message)
    elif older:
        kept = "; ".join(f"{e['revision'] or e['modelPath']} {e['phase']}: {e['message']}" for e in older)
        if conditions["Progressing"]["status"] == "True":
            conditions["Progressing"]["message"] = f"BlueGreen: {conditions['Progressing']['message']}; {kept}"
        else:
            conditions["Progressing"].update(status="True", reason="Draining", message=kept)
    out["conditions"] = merge_conditions(old_conditions, list(conditions.values()), now)
    return out
