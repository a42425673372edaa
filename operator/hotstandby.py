"""Hot standby, the I/O shell: read the Deployment, its current ReplicaSet, its pods and
its standbys; do what standby.plan says (promote, re-point, delete, create); post an
Event on the Deployment for each promotion.

Watch-driven: every event of a Deployment that asks for standbys, and of any pod of it
(a primary dying, being deleted, a standby turning Ready), runs a pass; there is no
timer. Passes of one Deployment never overlap; events during a pass fold into one more.
Level-triggered like the cache reconciler: each pass starts from what the API holds.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from typing import Callable

from . import standby as sb
from .kube import ApiError, Kube
from .mutation import AGENT_PORT
from .passes import SerialPasses

log = logging.getLogger("weightcache.operator.standby")

# (object, type, reason, message) -> posts a Kubernetes Event about the object.
EmitFn = Callable[[dict, str, str, str], None]


def attached_gpus(pod: dict, timeout: float) -> list[str]:
    """The GPU UUIDs the pod's engine attached, from its agent's GET /status (the
    engine's report: "device", or "devices" for an engine on several GPUs); [] when
    not known (yet)."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return []
    try:
        with urllib.request.urlopen(f"http://{ip}:{AGENT_PORT}/status", timeout=timeout) as resp:
            doc = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            doc = json.loads(e.read())
        except ValueError:
            return []
    except (OSError, ValueError):
        return []
    engine = doc.get("engine") or {}
    devices = engine.get("devices") or ([engine["device"]] if engine.get("device") else [])
    return [d for d in devices if isinstance(d, str) and d.startswith("GPU-")]


class StandbyController:
    def __init__(self, kube: Kube, emit: EmitFn | None = None, http_timeout: float = 2.0) -> None:
        self.kube = kube
        self.emit = emit or (lambda obj, type, reason, message: None)
        self.http_timeout = http_timeout
        self._guard = threading.Lock()  # guards _enabled (pod and Deployment events race)
        self._passes = SerialPasses()
        self._enabled: set[tuple[str, str]] = set()  # Deployments seen asking for standbys
        self._refused: dict[tuple[str, str], str] = {}  # the last refusal posted, per Deployment

    # -- which events matter ----------------------------------------------------------
    def deployment_event(self, deployment: dict) -> None:
        meta = deployment["metadata"]
        key = (meta["namespace"], meta["name"])
        asks = sb.HOT_STANDBY_ANNOTATION in (meta.get("annotations") or {})
        with self._guard:
            known = key in self._enabled
            if asks:
                self._enabled.add(key)
            else:
                self._enabled.discard(key)
        if asks or known:  # known: the annotation was just removed; its standbys go
            self.reconcile(*key)

    def pod_event(self, pod: dict) -> None:
        ns, deployment = pod["metadata"].get("namespace"), sb.deployment_of(pod)
        if deployment is None:
            return
        with self._guard:
            known = (ns, deployment) in self._enabled
        if known or sb.ROLE_LABEL in sb.labels_of(pod):
            self.reconcile(ns, deployment)

    # -- passes -----------------------------------------------------------------------
    def reconcile(self, ns: str, name: str) -> None:
        self._passes.run((ns, name), lambda: self._pass(ns, name))

    def _pass(self, ns: str, name: str) -> bool:
        """One pass; True when it lost a race (a 409) and should run again."""
        deployment = self.kube.get_deployment(ns, name)
        if deployment is None:
            return False  # the garbage collector removes its standbys
        try:
            n = sb.wanted_standbys(deployment)
        except sb.StandbyRefused as e:
            self._refuse(deployment, str(e))
            return False
        self._refused.pop((ns, name), None)
        uid = deployment["metadata"]["uid"]
        standbys = [p for p in self.kube.list_pods(ns, f"{sb.ROLE_LABEL}={sb.STANDBY}")
                    if (sb.controller_of(p) or {}).get("uid") == uid]
        if n == 0 and not standbys:
            return False
        selector = sb.selector_string(deployment["spec"]["selector"])
        rs = sb.current_replicaset(deployment, self.kube.list_replicasets(ns, selector))
        pods = self.kube.list_pods(ns, selector)
        return self._execute(deployment, rs, sb.plan(deployment, rs, pods, standbys, n))

    def _execute(self, deployment: dict, rs: dict | None, plan: sb.Plan) -> bool:
        ns, name = deployment["metadata"]["namespace"], deployment["metadata"]["name"]
        again = False
        for standby, dead, why in plan.promote:
            s = standby["metadata"]["name"]
            try:
                self.kube.patch_pod(ns, s, sb.promotion_patch(standby, dead))
            except ApiError as e:
                if e.status in (404, 409):
                    again = True  # changed or gone meanwhile: decide again from a fresh read
                    continue
                raise
            message = f"promoted standby {s} on node {standby['spec'].get('nodeName')} to replace {dead} ({why})"
            log.info("standby promoted", extra={"fields": {
                "deployment": f"{ns}/{name}", "standby": s, "replaces": dead, "why": why,
                "node": standby["spec"].get("nodeName")}})
            self.emit(deployment, "Normal", "StandbyPromoted", message)
        for standby, target in plan.repoint:
            try:
                self.kube.patch_pod(ns, standby["metadata"]["name"], sb.repoint_patch(standby, target))
            except ApiError as e:
                if e.status not in (404, 409):
                    raise
                again = True
        for standby, why in plan.delete:
            log.info("standby deleted", extra={"fields": {"deployment": f"{ns}/{name}",
                                                         "standby": standby["metadata"]["name"], "why": why}})
            self.kube.delete_pod(ns, standby["metadata"]["name"], standby["metadata"]["uid"])
        for primary in plan.create:
            self._create(deployment, rs, primary)
        return again

    def _create(self, deployment: dict, rs: dict, primary: dict) -> None:
        ns, name = deployment["metadata"]["namespace"], deployment["metadata"]["name"]
        gpus = attached_gpus(primary, self.http_timeout) if sb.uses_device_plugin_gpus(rs["spec"]["template"]["spec"]) \
            else None
        try:
            pod = sb.standby_pod(deployment, rs, primary, gpus)
        except sb.NotYet as e:
            log.debug("standby not created yet", extra={"fields": {"deployment": f"{ns}/{name}", "why": str(e)}})
            return
        except sb.StandbyRefused as e:
            self._refuse(deployment, str(e))
            return
        try:
            created = self.kube.create_pod(pod)
        except ApiError as e:
            self._refuse(deployment, f"could not create a standby for {primary['metadata']['name']}: {e}")
            return
        log.info("standby created", extra={"fields": {
            "deployment": f"{ns}/{name}", "standby": created["metadata"]["name"],
            "primary": primary["metadata"]["name"], "node": primary["spec"].get("nodeName")}})

    def _refuse(self, deployment: dict, message: str) -> None:
        """A Warning Event on the Deployment, once per distinct problem."""
        key = (deployment["metadata"]["namespace"], deployment["metadata"]["name"])
        if self._refused.get(key) == message:
            return
        self._refused[key] = message
        log.warning("hot standby refused", extra={"fields": {"deployment": "/".join(key), "why": message}})
        self.emit(deployment, "Warning", "HotStandbyRefused", message)
