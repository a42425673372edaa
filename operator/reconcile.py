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
import datetime
import hashlib
import json
import logging
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from . import status as st
from .kube import ApiError, Kube
from .manifests import (CACHE_LABEL, DAEMON_APP, DAEMON_HTTP_PORT, FORCE_DELETE_ANNOTATION, NAME_LABEL, NODE_READY,
                        Defaults, daemon_labels, daemonset_for, daemonset_name, node_label_key)

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
        self.emit = emit or (lambda cache, type, reason, message: None)
        self.http_timeout = http_timeout
        self._guard = threading.Lock()
        self._running: set[tuple[str, str]] = set()
        self._again: set[tuple[str, str]] = set()
        self._checked: dict[tuple[str, str], tuple] = {}
        self._key_locks: dict[tuple[str, str], threading.Lock] = {}
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="wc-status")

    # -- entry points ---------------------------------------------------------------------
    def reconcile(self, namespace: str, name: str) -> None:
        """Reconcile one cache; concurrent calls for the same cache coalesce into one more
        pass by the caller already running, so an event storm costs a pass or two."""
        key = (namespace, name)
        with self._guard:
            if key in self._running:
                self._again.add(key)
                return
            self._running.add(key)
        try:
            while True:
                with self._key_lock(key):
                    self._reconcile_once(namespace, name)
                with self._guard:
                    if key not in self._again:
                        self._running.discard(key)
                        return
                    self._again.discard(key)
        except BaseException:
            with self._guard:
                self._running.discard(key)
                self._again.discard(key)
            raise

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
        ds = self.kube.get_daemonset(ns, daemonset_name(name))
        pods = self._daemon_pods(ns, name, ds)
        states = self.observe(pods)
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
        self._sync_node_labels(ns, name, set())
        if ds is not None:
            if ds["metadata"].get("deletionTimestamp") is None:
                self.kube.delete_daemonset(ns, ds["metadata"]["name"])
            message = (f"waiting for {len(pods)} daemon pod(s) to stop and remove their sockets" if pods
                       else "waiting for the daemon DaemonSet to go")
            self._write_status(cache, st.aggregate(cache, ds, states, now(), deleting=("Deleting", message)))
            raise Waiting(message)
        if pods:
            raise Waiting(f"waiting for {len(pods)} daemon pod(s) to stop")
        self._checked.pop((ns, name), None)

    # -- one pass -------------------------------------------------------------------------
    def _reconcile_once(self, ns: str, name: str) -> None:
        cache = self.kube.get_cache(ns, name)
        if cache is None or cache["metadata"].get("deletionTimestamp"):
            return  # gone, or finalize() owns it now
        problem = None
        try:
            ds = self.ensure_daemonset(cache)
        except (ApiError, DaemonSetConflict) as e:
            reason = "DaemonSetConflict" if isinstance(e, DaemonSetConflict) else "DaemonSetRefused"
            problem, ds = (reason, str(e)), None
            log.warning("daemonset not reconciled", extra={"fields": {"cache": f"{ns}/{name}", "error": str(e)}})
        pods = self._daemon_pods(ns, name, ds)
        states = self.observe(pods, self.current_revision(ns, name, ds))
        self._sync_node_labels(ns, name, st.ready_nodes(states))
        self._write_status(cache, st.aggregate(cache, ds, states, now(), problem=problem), event_on_change=True)

    def ensure_daemonset(self, cache: dict, attempts: int = 3) -> dict:
        """The cache's DaemonSet as the builder says: created when missing; replaced when
        its spec drifted (a changed WeightCache, or a hand edit), else left alone.

        Drift is judged on the API's own defaulting: the desired object is sent as a
        dry-run replace and the returned spec compared with the live one. A write that
        lost a race with another writer (409) starts over from a fresh read."""
        for attempt in range(attempts):
            try:
                return self._ensure_daemonset(cache)
            except ApiError as e:
                if e.status != 409 or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _ensure_daemonset(self, cache: dict) -> dict:
        meta = cache["metadata"]
        ns, name = meta["namespace"], meta["name"]
        desired = daemonset_for(cache, self.defaults)
        actual = self.kube.get_daemonset(ns, desired["metadata"]["name"])
        if actual is None:
            created = self.kube.create_daemonset(desired)  # 409: someone else did; start over
            self.emit(cache, "Normal", "DaemonSetCreated", f"created DaemonSet {desired['metadata']['name']}")
            return created
        if not _owned_by(actual, meta["uid"]):
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
        candidate["metadata"]["ownerReferences"] = desired["metadata"]["ownerReferences"]
        candidate["spec"] = desired["spec"]
        dry = self.kube.replace_daemonset(candidate, dry_run=True)
        if dry["spec"] != actual["spec"] or _meta_key(dry) != _meta_key(actual):
            actual = self.kube.replace_daemonset(candidate)
            spec_changed = last is None or last[3] != digest
            self.emit(cache, "Normal" if spec_changed else "Warning",
                      "DaemonSetUpdated" if spec_changed else "DaemonSetRestored",
                      f"DaemonSet {actual['metadata']['name']} " +
                      ("updated to the WeightCache's spec" if spec_changed else "had been edited; put back"))
            log.info("daemonset replaced", extra={"fields": {"cache": f"{ns}/{name}", "spec_changed": spec_changed}})
        self._checked[(ns, name)] = (actual["metadata"]["uid"], actual["metadata"].get("generation"),
                                     _meta_key(actual), digest)
        return actual

    def _daemon_pods(self, ns: str, name: str, ds: dict | None) -> list[dict]:
        pods = self.kube.list_pods(ns, _selector(daemon_labels(name)))
        if ds is None:
            return pods
        uid = ds["metadata"]["uid"]
        return [p for p in pods if any(o.get("uid") == uid for o in p["metadata"].get("ownerReferences") or [])]

    def observe(self, pods: list[dict], current: str | None = None) -> list[st.NodeState]:
        """Each node's daemon; CURRENT is the DaemonSet's revision hash, when known, so
        that a daemon still running an older spec does not count as ready."""
        chosen = list(st.pick_pods(pods).values())
        reports = list(self._pool.map(lambda p: fetch_report(p, self.http_timeout), chosen))
        return [st.node_state(p, report, error, current) for p, (report, error) in zip(chosen, reports)]

    def current_revision(self, ns: str, name: str, ds: dict | None) -> str | None:
        """The pod-template hash the DaemonSet rolls its pods to (its newest ControllerRevision)."""
        if ds is None:
            return None
        uid = ds["metadata"]["uid"]
        revisions = [r for r in self.kube.list_controller_revisions(ns, _selector(daemon_labels(name)))
                     if any(o.get("uid") == uid for o in r["metadata"].get("ownerReferences") or [])]
        if not revisions:
            return None
        newest = max(revisions, key=lambda r: r.get("revision", 0))
        return (newest["metadata"].get("labels") or {}).get(st.REVISION_LABEL)

    def _sync_node_labels(self, ns: str, name: str, ready: set[str]) -> None:
        key = node_label_key(ns, name)
        labelled = {n["metadata"]["name"] for n in self.kube.list_nodes(key)}
        for node in sorted(ready - labelled):
            self.kube.label_node(node, key, NODE_READY)
        for node in sorted(labelled - ready):
            self.kube.label_node(node, key, None)

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


class DaemonSetConflict(Exception):
    """A DaemonSet of the cache's name exists that this WeightCache does not own."""


def _owned_by(obj: dict, uid: str) -> bool:
    return any(o.get("uid") == uid and o.get("controller") for o in obj["metadata"].get("ownerReferences") or [])


def _meta_key(obj: dict) -> str:
    meta = obj["metadata"]
    return json.dumps([meta.get("labels") or {}, meta.get("ownerReferences") or []], sort_keys=True)
