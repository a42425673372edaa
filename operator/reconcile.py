"""The reconcile loop's I/O shell: read what exists (the WeightCache, its DaemonSet, the
daemon pods and each daemon's `GET /status`), make the DaemonSet, the node labels and
the status what the pure builders say, and nothing more.

Level-triggered: every call starts from what the API holds now, so it can run twice,
after a crash, or on any event with the same result. The only memory kept here is a
shortcut (which DaemonSet generation was last checked against which desired spec); a
fresh process simply checks again.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import hashlib
import json
import logging
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from . import classes
from . import generations as gens
from . import managed
from . import status as st
from .kube import ApiError, Kube
from .manifests import (CACHE_LABEL, CACHE_NAMESPACE_LABEL, DAEMON_APP, DAEMON_HTTP_PORT, FORCE_DELETE_ANNOTATION,
                        NAME_LABEL, NODE_READY, Defaults, daemon_labels, daemonset_for, is_store, node_label_key,
                        owned_by)
from .passes import SerialPasses

log = logging.getLogger("weightcache.operator")

# (cache, type, reason, message) -> posts a Kubernetes Event about the cache.
EmitFn = Callable[[dict, str, str, str], None]


class Waiting(Exception):
    """Deletion cannot finish yet; the message says what it waits for."""

    def __init__(self, message: str) -> None:
        super().__init__(f"waiting: {message}")
        self.reason_message = message


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# A FailedCreate older than this is history: the DaemonSet controller retries a refused
# creation with a backoff capped well below it, so a lasting refusal keeps its Event fresh.
FAILED_CREATE_WINDOW_S = 600


def _now_minus(seconds: float) -> str:
    t = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=seconds)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _event_time(event: dict) -> str:
    """When a core/v1 Event last happened (RFC 3339 strings compare in time order once
    cut to whole seconds)."""
    when = ((event.get("series") or {}).get("lastObservedTime") or event.get("lastTimestamp")
            or event.get("eventTime") or (event.get("metadata") or {}).get("creationTimestamp") or "")
    return when[:19] + "Z" if when else ""


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def engine_selector(name: str) -> str:
    return f"{CACHE_LABEL}={name},{NAME_LABEL}!={DAEMON_APP}"


def fetch_report(pod: dict, timeout: float) -> tuple[dict | None, str]:
    """A daemon pod's `GET /status` JSON, or (None, why not)."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip or (pod.get("status") or {}).get("phase") != "Running":
        return None, ""
    url = f"http://{ip}:{DAEMON_HTTP_PORT}/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read()), ""
    except urllib.error.HTTPError as e:  # the body is still the status JSON (e.g. 503)
        try:
            return json.loads(e.read()), ""
        except ValueError:
            return None, f"HTTP {e.code} from {url}"
    except (OSError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"


class Reconciler:
    def __init__(self, kube: Kube, defaults: Defaults = Defaults(), emit: EmitFn | None = None,
                 http_timeout: float = 2.0) -> None:
        self.kube = kube
        self.defaults = defaults
        self.daemon_ns = defaults.daemon_namespace
        self.emit = emit or (lambda cache, type, reason, message: None)
        self.http_timeout = http_timeout
        self._guard = threading.Lock()  # guards _key_locks
        self._passes = SerialPasses()
        self._checked: dict[tuple[str, str], tuple] = {}
        self._key_locks: dict[tuple[str, str], threading.Lock] = {}
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="wc-status")

    # -- entry points ---------------------------------------------------------------------
    def reconcile(self, namespace: str, name: str) -> None:
        """Reconcile one cache; concurrent calls for the same cache coalesce into one more
        pass by the caller already running, so an event storm costs a pass or two."""
        key = (namespace, name)

        def one_pass() -> bool:
            with self._key_lock(key):
                self._reconcile_once(namespace, name)
            return False

        self._passes.run(key, one_pass)

    def _key_lock(self, key: tuple[str, str]) -> threading.Lock:
        with self._guard:
            return self._key_locks.setdefault(key, threading.Lock())

    def finalize(self, cache: dict) -> None:
        """Deletion: wait while engines use the cache (unless forced), then remove the node
        labels and the DaemonSet and wait for its daemons to stop. Raises Waiting.
        Never concurrent with a reconcile pass of the same cache, which could otherwise
        put back the DaemonSet just deleted."""
        meta = cache["metadata"]
        key = (meta["namespace"], meta["name"])
        with self._key_lock(key):
            self._finalize(cache)
        with self._guard:
            self._key_locks.pop(key, None)

    def _finalize(self, cache: dict) -> None:
        meta = cache["metadata"]
        ns, name = meta["namespace"], meta["name"]
        force = (meta.get("annotations") or {}).get(FORCE_DELETE_ANNOTATION) == "true"
        daemonsets = self.cache_daemonsets(ns, name, meta["uid"])  # every generation's
        ds = daemonsets[0] if daemonsets else None
        pods = self._daemon_pods(ns, name, None)
        # Each generation's daemons on their own: two on one node each count their clients.
        states = [s for d in daemonsets for s in self.observe(self._daemon_pods(ns, name, d))] if daemonsets \
            else self.observe(pods)
        if not force:
            engines = sorted(p["metadata"]["name"] for p in self.kube.list_pods(ns, engine_selector(name)))
            attached = sum(int(d.get("attached_clients") or 0) for s in states for d in s.devices)
            if engines or attached:
                shown = ", ".join(engines[:5]) + (f" and {len(engines) - 5} more" if len(engines) > 5 else "")
                message = (f"deletion waits for {attached} attached client(s) and {len(engines)} engine pod(s) "
                           f"labelled {CACHE_LABEL}={name}" + (f" ({shown})" if engines else "") +
                           f"; stop them, or annotate the WeightCache {FORCE_DELETE_ANNOTATION}=\"true\"")
                self._write_status(cache, st.aggregate(cache, ds, states, now(),
                                                       deleting=("DeletionBlocked", message)), event_on_change=True)
                raise Waiting(message)
        self._sync_labels(ns, name, {})
        if daemonsets:
            for d in daemonsets:
                if d["metadata"].get("deletionTimestamp") is None:
                    self.kube.delete_daemonset(self.daemon_ns, d["metadata"]["name"])
            message = (f"waiting for {len(pods)} daemon pod(s) to stop and remove their sockets" if pods
                       else "waiting for the daemon DaemonSet to go")
            self._write_status(cache, st.aggregate(cache, ds, states, now(), deleting=("Deleting", message)))
            raise Waiting(message)
        if pods:
            raise Waiting(f"waiting for {len(pods)} daemon pod(s) to stop")
        for slot in gens.SLOTS:
            self._checked.pop((self.daemon_ns, gens.slot_daemonset_name(ns, name, slot)), None)

    # -- one pass -------------------------------------------------------------------------
    def _reconcile_once(self, ns: str, name: str) -> None:
        cache = self.kube.get_cache(ns, name)
        labelled = self._labelled_daemonsets(ns, name)  # one list: the orphans and the cache's own
        self._delete_orphans(labelled, ns, name, None if cache is None else cache["metadata"]["uid"])
        if cache is None or cache["metadata"].get("deletionTimestamp"):
            return  # gone, or finalize() owns it now
        desired = gens.desired_generation(cache)
        strategy, budget = gens.rollout_of(cache["spec"])
        live = self.observe_generations(cache, _owned(labelled, cache["metadata"]["uid"]))
        decided = gens.plan(desired, strategy, budget, live, store=is_store(cache["spec"]))
        problem, kept = None, {}
        try:
            cls = self.class_of(cache)
        except classes.ClassRefused as e:
            # Nothing is created or changed for a cache its class refuses; daemons made
            # before (the class changed since) keep serving what they serve: deleting them
            # is the cache owner's decision, or the admin's, not a side effect of an edit.
            problem, cls = ("ClassRefused", str(e)), None
            decided = dataclasses.replace(decided, keep=[], delete=[])
        for slot, generation, allowance in decided.keep:
            want = gens.generation_daemonset(cache, generation, slot, self.defaults, allowance, cls)
            try:
                kept[slot] = self.ensure_daemonset(cache, want)
            except (ApiError, DaemonSetConflict) as e:
                reason = "DaemonSetConflict" if isinstance(e, DaemonSetConflict) else "DaemonSetRefused"
                problem = problem or (reason, str(e))
                log.warning("daemonset not reconciled", extra={"fields": {"cache": f"{ns}/{name}", "error": str(e)}})
                continue
            problem = problem or self.pod_creation_problem(kept[slot])
        for o in live:
            if o.slot in decided.delete and o.daemonset["metadata"].get("deletionTimestamp") is None:
                self.kube.delete_daemonset(self.daemon_ns, o.daemonset["metadata"]["name"])
                self.emit(cache, "Normal", "GenerationReleased", f"{o.generation.describe()}: no engine holds it; "
                          f"deleted DaemonSet {o.daemonset['metadata']['name']}")
        # The spec's generation, observed after this pass's writes (a DaemonSet just
        # created or updated has no daemon ready for it yet).
        target = next((o for o in live if o.generation == desired), None)
        ds = kept.get(decided.target_slot)
        if ds is not None and (target is None or target.slot != decided.target_slot or
                               target.daemonset["metadata"].get("generation") != ds["metadata"].get("generation")):
            target = self._observed(ds, desired, decided.target_slot, target.engine_pods if target else [])
        current = [o for o in live if o.generation != desired and o.slot != decided.target_slot]
        current = ([target] if target is not None else []) + current
        if target is None:  # the old generation serves while the spec's waits
            serving = next((o for o in current if o.held), None)
            ds, states = (serving.daemonset, serving.states) if serving else (None, [])
        else:
            states = target.states
        self._sync_labels(ns, name, self._wanted_labels(ns, name, target, [o for o in current
                                                                           if o.slot not in decided.delete]))
        status = st.aggregate(cache, ds, gens.states_for_status(states), now(), problem=problem)
        entries = gens.generations_status(desired, current, decided)
        status = gens.with_generations(status, entries, decided, sum(o.attached for o in current),
                                       (cache.get("status") or {}).get("conditions") or [], now())
        self._write_status(cache, status, event_on_change=True)
        self._gate_rollouts({**cache, "status": status})

    def _gate_rollouts(self, cache: dict) -> None:
        """Pause or resume the cache's managed engine Deployments (see managed.py)."""
        ns, name = cache["metadata"]["namespace"], cache["metadata"]["name"]
        for d in self.kube.list_deployments(ns, f"{CACHE_LABEL}={name}"):
            if not managed.is_managed(d):
                continue
            decided = managed.gate(d, cache)
            patch = managed.patch_for(d, decided)
            if patch is None:
                continue
            self.kube.patch_deployment(ns, d["metadata"]["name"], patch)
            # Items of a list carry no kind: the Event's object reference needs it.
            self.emit({**d, "apiVersion": "apps/v1", "kind": "Deployment"}, "Normal",
                      "RolloutPaused" if decided.pause else "RolloutResumed", decided.message)
            log.info("managed rollout", extra={"fields": {"deployment": f"{ns}/{d['metadata']['name']}",
                                                          "paused": decided.pause, "reason": decided.reason}})

    def class_of(self, cache: dict) -> dict:
        """The WeightCacheClass CACHE is served under, or ClassRefused naming every rule of
        it the cache breaks (read fresh: a class can change at any time)."""
        return classes.check(cache, self.kube.list_classes(),
                             self.kube.get_namespace_labels(cache["metadata"]["namespace"]))

    def observe_generations(self, cache: dict, daemonsets: list[dict]) -> list[gens.Observed]:
        """Each live DaemonSet of the cache (DAEMONSETS, those it owns) with its generation,
        daemon states and the engine pods admitted for it."""
        meta = cache["metadata"]
        ns, name = meta["namespace"], meta["name"]
        engines: dict[str, list[str]] = {}
        for p in self.kube.list_pods(ns, engine_selector(name)):
            if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            engines.setdefault(gens.engine_generation(p) or "", []).append(p["metadata"]["name"])
        out = []
        for ds in daemonsets:
            generation = gens.generation_of_daemonset(ds)
            out.append(self._observed(ds, generation, gens.slot_of(ds), sorted(engines.get(generation.key, []))))
        return out

    def _observed(self, ds: dict, generation: gens.Generation, slot: str, engine_pods: list[str]) -> gens.Observed:
        labels = ds["metadata"]["labels"]
        ns, name = labels[CACHE_NAMESPACE_LABEL], labels[CACHE_LABEL]
        states = self.observe(self._daemon_pods(ns, name, ds), self.current_revision(ns, name, ds), template_args(ds))
        return gens.Observed(generation, slot, ds, states, engine_pods)

    def cache_daemonsets(self, ns: str, name: str, uid: str) -> list[dict]:
        """The DaemonSets this cache owns (one per generation, at most two), in the daemons'
        namespace."""
        return _owned(self._labelled_daemonsets(ns, name), uid)

    def _labelled_daemonsets(self, ns: str, name: str) -> list[dict]:
        """Every DaemonSet labelled for NS/NAME in the daemons' namespace, whoever owns it."""
        return self.kube.list_daemonsets(self.daemon_ns, _selector(daemon_labels(ns, name)))

    def _delete_orphans(self, labelled: list[dict], ns: str, name: str, uid: str | None) -> None:
        """Those of LABELLED (for NS/NAME) that no live cache owns (UID: the live cache's,
        None: none): the cache went while no operator ran its finalizer (forced off, the
        CRD deleted), or it was made again under the same name (another uid). Nothing else
        would ever delete them."""
        for d in labelled:
            if not owned_by(d, uid) and d["metadata"].get("deletionTimestamp") is None:
                self.kube.delete_daemonset(self.daemon_ns, d["metadata"]["name"])
                log.info("orphan daemonset deleted", extra={"fields": {
                    "daemonset": d["metadata"]["name"], "cache": f"{ns}/{name}"}})

    def pod_creation_problem(self, ds: dict) -> tuple[str, str] | None:
        """(reason, message) when the DaemonSet lacks pods because their creation is refused
        (Pod Security, a quota, a missing PriorityClass...): the DaemonSet controller says
        so only in FailedCreate Events on it, which nothing else would read."""
        st_ = ds.get("status") or {}
        if st_.get("currentNumberScheduled", 0) >= st_.get("desiredNumberScheduled", 0) and \
                st_.get("observedGeneration") == ds["metadata"].get("generation"):
            return None
        events = self.kube.list_events(self.daemon_ns, ",".join([
            "involvedObject.kind=DaemonSet", f"involvedObject.name={ds['metadata']['name']}",
            f"involvedObject.uid={ds['metadata']['uid']}", "reason=FailedCreate"]))
        latest = max(events, key=_event_time, default=None)
        if latest is None or _event_time(latest) < _now_minus(FAILED_CREATE_WINDOW_S):
            return None
        return ("DaemonPodsRefused", f"DaemonSet {self.daemon_ns}/{ds['metadata']['name']} cannot create its pods: "
                                     f"{latest.get('message', '')[:600]}")

    def _wanted_labels(self, ns: str, name: str, target: gens.Observed | None,
                       live: list[gens.Observed]) -> dict[str, set[str]]:
        """Node -> the label keys of this cache it should carry: the cache-wide key where
        the spec's generation is ready, and each live generation's own key where it is."""
        wanted: dict[str, set[str]] = {}
        if target is not None:
            for node in st.ready_nodes(target.states):
                wanted.setdefault(node, set()).add(node_label_key(ns, name))
        for o in live:
            for node in st.ready_nodes(o.states):
                wanted.setdefault(node, set()).add(gens.generation_node_label_key(ns, name, o.generation))
        return wanted

    def ensure_daemonset(self, cache: dict, desired: dict | None = None, attempts: int = 3) -> dict:
        """The cache's DaemonSet as the builder says: created when missing; replaced when
        its spec drifted (a changed WeightCache, or a hand edit), else left alone.

        Drift is judged on the API's own defaulting: the desired object is sent as a
        dry-run replace and the returned spec compared with the live one. A write that
        lost a race with another writer (409) starts over from a fresh read."""
        for attempt in range(attempts):
            try:
                return self._ensure_daemonset(cache, desired)
            except ApiError as e:
                if e.status != 409 or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _ensure_daemonset(self, cache: dict, desired: dict | None = None) -> dict:
        meta = cache["metadata"]
        desired = desired or daemonset_for(cache, self.defaults)
        ns, name = desired["metadata"]["namespace"], desired["metadata"]["name"]  # the shortcut is per DaemonSet
        actual = self.kube.get_daemonset(ns, name)
        if actual is None:
            created = self.kube.create_daemonset(desired)  # 409: someone else did; start over
            self.emit(cache, "Normal", "DaemonSetCreated", f"created DaemonSet {desired['metadata']['name']}")
            return created
        if not owned_by(actual, meta["uid"]):
            raise DaemonSetConflict(f"DaemonSet {ns}/{actual['metadata']['name']} exists and is not owned by this "
                                    f"WeightCache; delete or rename it")
        digest = hashlib.sha256(json.dumps(desired, sort_keys=True).encode()).hexdigest()
        seen = (actual["metadata"]["uid"], actual["metadata"].get("generation"), _meta_key(actual), digest)
        last = self._checked.get((ns, name))
        if last == seen:
            return actual
        candidate = copy.deepcopy(actual)
        candidate.pop("status", None)
        candidate["metadata"]["labels"] = {**(actual["metadata"].get("labels") or {}), **desired["metadata"]["labels"]}
        candidate["metadata"]["annotations"] = {**(actual["metadata"].get("annotations") or {}),
                                                **(desired["metadata"].get("annotations") or {})}
        candidate["spec"] = desired["spec"]
        dry = self.kube.replace_daemonset(candidate, dry_run=True)
        if dry["spec"] != actual["spec"] or _meta_key(dry) != _meta_key(actual):
            actual = self.kube.replace_daemonset(candidate)
            spec_changed = last is None or last[3] != digest
            self.emit(cache, "Normal" if spec_changed else "Warning",
                      "DaemonSetUpdated" if spec_changed else "DaemonSetRestored",
                      f"DaemonSet {actual['metadata']['name']} " +
                      ("updated to the WeightCache's spec" if spec_changed else "had been edited; put back"))
            log.info("daemonset replaced", extra={"fields": {"daemonset": f"{ns}/{name}", "spec_changed": spec_changed}})
        self._checked[(ns, name)] = (actual["metadata"]["uid"], actual["metadata"].get("generation"),
                                     _meta_key(actual), digest)
        return actual

    def _daemon_pods(self, ns: str, name: str, ds: dict | None) -> list[dict]:
        pods = self.kube.list_pods(self.daemon_ns, _selector(daemon_labels(ns, name)))
        if ds is None:
            return pods
        uid = ds["metadata"]["uid"]
        return [p for p in pods if any(o.get("uid") == uid for o in p["metadata"].get("ownerReferences") or [])]

    def observe(self, pods: list[dict], current: str | None = None,
                current_args: list[str] | None = None) -> list[st.NodeState]:
        """Each node's daemon; CURRENT is the DaemonSet's revision hash and CURRENT_ARGS its
        daemon args, when known, so that a daemon still running an older spec does not
        count as ready unless it serves the same weights. Every pod of a node is asked:
        during a surge rollout two daemons share it, and the node is ready while either serves."""
        placed = [p for p in pods if p["spec"].get("nodeName")]
        reports = list(self._pool.map(lambda p: fetch_report(p, self.http_timeout), placed))
        by_node: dict[str, list] = {}
        for p, (report, error) in zip(placed, reports):
            by_node.setdefault(p["spec"]["nodeName"], []).append((p, st.node_state(p, report, error, current,
                                                                                    current_args)))
        return [st.for_node(node_pods) for node_pods in by_node.values()]

    def current_revision(self, ns: str, name: str, ds: dict | None) -> str | None:
        """The pod-template hash the DaemonSet rolls its pods to (its newest ControllerRevision)."""
        if ds is None:
            return None
        uid = ds["metadata"]["uid"]
        revisions = [r for r in self.kube.list_controller_revisions(self.daemon_ns, _selector(daemon_labels(ns, name)))
                     if any(o.get("uid") == uid for o in r["metadata"].get("ownerReferences") or [])]
        if not revisions:
            return None
        newest = max(revisions, key=lambda r: r.get("revision", 0))
        return (newest["metadata"].get("labels") or {}).get(st.REVISION_LABEL)

    def _sync_labels(self, ns: str, name: str, wanted: dict[str, set[str]]) -> None:
        """Make this cache's node labels (the cache-wide key and the per-generation keys,
        all starting with node_label_key) exactly WANTED: node -> keys set to ready."""
        prefix = node_label_key(ns, name)
        for n in self.kube.list_nodes():
            node = n["metadata"]["name"]
            have = {k for k, v in (n["metadata"].get("labels") or {}).items() if k.startswith(prefix)}
            want = wanted.get(node, set())
            change = {**{k: NODE_READY for k in sorted(want - have)}, **{k: None for k in sorted(have - want)}}
            if change:
                self.kube.patch_node_labels(node, change)

    def _write_status(self, cache: dict, new: dict, event_on_change: bool = False) -> None:
        old = cache.get("status") or {}
        if all(old.get(k) == v for k, v in new.items()):
            return
        meta = cache["metadata"]
        self.kube.patch_cache_status(meta["namespace"], meta["name"], new)
        if event_on_change:
            self._events_for(cache, old, new)

    def _events_for(self, cache: dict, old: dict, new: dict) -> None:
        for kind in ("Ready", "Degraded", "Progressing"):
            before, after = st.condition(old, kind), st.condition(new, kind)
            if (before.get("status"), before.get("reason")) == (after.get("status"), after.get("reason")):
                continue
            if kind == "Ready" and after["status"] == "True":
                self.emit(cache, "Normal", "Ready", after["message"])
            elif kind == "Degraded" and after["status"] == "True":
                self.emit(cache, "Warning", after["reason"], after["message"])
            elif kind == "Progressing" and after["reason"] == "DeletionBlocked":
                self.emit(cache, "Warning", "DeletionBlocked", after["message"])
            elif kind == "Progressing" and after["reason"] in gens.WAIT_EVENTS:
                self.emit(cache, gens.WAIT_EVENTS[after["reason"]], after["reason"], after["message"])


def template_args(ds: dict | None) -> list[str] | None:
    """The daemon container's args in the DaemonSet's pod template."""
    for c in ((ds or {}).get("spec") or {}).get("template", {}).get("spec", {}).get("containers") or []:
        if c.get("name") == "daemon":
            return list(c.get("args") or [])
    return None


class DaemonSetConflict(Exception):
    """A DaemonSet of the cache's name exists that this WeightCache does not own."""


def _owned(daemonsets: list[dict], uid: str) -> list[dict]:
    """The DaemonSets of the cache of UID, in name order (slot a before slot b)."""
    return sorted((d for d in daemonsets if owned_by(d, uid)), key=lambda d: d["metadata"]["name"])


def _meta_key(obj: dict) -> str:
    meta = obj["metadata"]
    return json.dumps([meta.get("labels") or {}, meta.get("ownerReferences") or []], sort_keys=True)
