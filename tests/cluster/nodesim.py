"""The node simulator: plays the kubelet for the fake GPU nodes.

It watches pods bound to those nodes. For each one a PodWorker prepares the volumes,
runs init containers (native sidecars first and kept running), then the main ones,
and reports the pod's status until the pod is deleted, when it stops the containers
within the grace period and removes the pod object, as the kubelet does."""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .containers import Container, Launch, stamp
from .gpus import VISIBLE_DEVICES_ENV, GpuAllocator, gpu_limit
from .kube import ApiError, Rest
from .network import Network
from .podspec import (IMAGE_VENVS, condition, container_argv, container_env, container_mounts, image_repository,
                      is_runnable, is_sidecar, pod_groups, pod_phase, with_remapped_probes)
from .volumes import VolumeError, materialize, pod_kubeconfig

log = logging.getLogger("cluster.nodesim")
PODS = "/api/v1/pods"
# Env of the simulator that pod processes must not inherit.
PRIVATE_ENV = ("KUBECONFIG", "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER")


_VENVS: dict[str, tuple[str | None, str]] = {}
_VENVS_LOCK = threading.Lock()
VLLM_VENV_SH = Path(__file__).resolve().parents[1] / "vllm" / "venv.sh"


def venv_bin_of(name: str) -> tuple[str | None, str]:
    """(bin folder, "") of the venv an image's python comes from, or (None, why not).
    "vllm": the venv tests/vllm/venv.sh builds; looked up, never built, here (a test
    that runs vLLM pods builds it first, and installs this checkout into it)."""
    with _VENVS_LOCK:
        if name not in _VENVS:
            if name != "vllm":
                _VENVS[name] = (None, f"no venv named {name!r} in the simulator")
            else:
                check = subprocess.run(["bash", str(VLLM_VENV_SH), "--check"], capture_output=True)
                if check.returncode != 0:
                    return None, f"the vLLM venv is not built: run `bash {VLLM_VENV_SH}` (make vllm-venv)"
                out = subprocess.run(["bash", str(VLLM_VENV_SH), "--python"], capture_output=True, text=True,
                                     check=True).stdout.strip().splitlines()[-1]
                _VENVS[name] = (os.path.dirname(out), "")
        return _VENVS[name]


@dataclass(frozen=True)
class NodeSimConfig:
    state: Path  # the cluster's state folder
    nodes: tuple[str, ...]
    server: str
    ca: str
    net: Network
    gpus_per_node: int = 2

    def node_root(self, node: str) -> Path:
        """Where the node's hostPath volumes live: hostPath /x/y -> node_root/x/y."""
        return self.state / "nodes" / node / "root"

    def pod_dir(self, node: str, uid: str) -> Path:
        return self.state / "nodes" / node / "pods" / uid

    def host_ip(self, node: str) -> str:
        return self.net.node_ip(self.nodes.index(node))


class IpPool:
    """Loopback pod IPs: real listeners, distinct per pod."""

    def __init__(self, net: Network) -> None:
        self.net = net
        self._next = 0
        self._free: list[str] = []
        self._lock = threading.Lock()

    def take(self) -> str:
        with self._lock:
            if self._free:
                return self._free.pop(0)
            n, self._next = self._next, self._next + 1
            return self.net.pod_ip(n)

    def give(self, ip: str) -> None:
        with self._lock:
            self._free.append(ip)


class PodWorker:
    def __init__(self, sim: "NodeSimulator", pod: dict) -> None:
        self.sim, self.rest, self.cfg = sim, sim.rest, sim.cfg
        self.pod = pod
        meta, spec = pod["metadata"], pod["spec"]
        self.ns, self.name, self.uid, self.node = meta["namespace"], meta["name"], meta["uid"], spec["nodeName"]
        self.key = f"{self.ns}/{self.name}"
        self.host_ip = self.cfg.host_ip(self.node)
        self.pod_ip = self.host_ip if spec.get("hostNetwork") else sim.ips.take()
        self.start_time = stamp()
        self.deleting = threading.Event()
        self.gone = threading.Event()  # the object is gone already: no final delete
        self.grace = float(spec.get("terminationGracePeriodSeconds", 30))
        self.init: list[Container] = []
        self.main: list[Container] = []
        self.init_done = False
        self.failed_init: Container | None = None
        self._conds: dict[str, tuple[bool, str]] = {}
        self._last: str = ""
        self._thread = threading.Thread(target=self._run, name=f"pod-{self.key}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def delete(self, grace: float | None, gone: bool = False) -> None:
        if grace is not None:
            self.grace = min(self.grace, grace)
        if gone:
            self.gone.set()
        self.deleting.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    # -- setup ------------------------------------------------------------------------
    def _lookup(self, kind: str, name: str, key: str | None):
        plural = "configmaps" if kind == "configMap" else "secrets"
        try:
            obj = self.rest.get(f"/api/v1/namespaces/{self.ns}/{plural}/{name}")
        except ApiError:
            return None
        data = obj.get("data") or {}
        if kind == "secret":
            data = {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}
        return data if key is None else data.get(key)

    def _launch(self, spec: dict, vols: dict, base_env: dict, restart_policy: str) -> Launch:
        log_path = self.cfg.state / "logs" / "pods" / f"{self.ns}_{self.name}_{spec['name']}.log"
        if not is_runnable(spec.get("image", "")):
            return Launch(None, {}, None, log_path, self.pod_ip, restart_policy, self.grace)
        mounts = container_mounts(spec, vols)
        base_env = dict(base_env)
        if gpu_limit(spec):
            base_env[VISIBLE_DEVICES_ENV] = ",".join(self.sim.gpus.allocate(self.node, self.uid, gpu_limit(spec)))
        venv_bin, error = None, ""
        venv = IMAGE_VENVS.get(image_repository(spec.get("image", "")))
        if venv:
            venv_bin, error = venv_bin_of(venv)
        env = container_env(self.pod, spec, base_env, self.pod_ip, self.host_ip, self._lookup, mounts, venv_bin)
        argv = container_argv(spec, env, mounts)
        spec.update(with_remapped_probes(spec, env, mounts))
        cwd = None
        if spec.get("workingDir"):
            cwd = mounts.get(spec["workingDir"], spec["workingDir"])
            if not os.path.isdir(cwd):
                cwd = None
        return Launch(argv, env, cwd, log_path, self.pod_ip, restart_policy, self.grace,
                      tuple(pod_groups(self.pod)), error)

    def _prepare(self) -> tuple[dict, dict]:
        pod_dir = self.cfg.pod_dir(self.node, self.uid)
        ctx = {"pod_ip": self.pod_ip, "host_ip": self.host_ip}
        while True:
            try:
                vols = materialize(self.rest, self.pod, self.cfg.node_root(self.node), pod_dir, ctx)
                break
            except (VolumeError, ApiError) as e:
                log.warning("pod %s: volumes not ready: %s", self.key, e)
                self._report(waiting_reason="ContainerCreating")
                if self.deleting.wait(1):
                    return {}, {}
        base = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}
        if "token" in ctx:
            kc = pod_dir / "kubeconfig"
            kc.write_text(pod_kubeconfig(self.cfg.server, self.cfg.ca, ctx["token"]))
            base["KUBECONFIG"] = str(kc)
        return vols, base

    # -- lifecycle --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._lifecycle()
        except Exception:
            log.exception("pod %s: simulator error", self.key)
        finally:
            self._finish()

    def _lifecycle(self) -> None:
        spec = self.pod["spec"]
        policy = spec.get("restartPolicy", "Always")
        self._report()
        vols, base = self._prepare()
        if self.deleting.is_set():
            return
        init_policy = "Never" if policy == "Never" else "OnFailure"
        for i, c in enumerate(spec.get("initContainers") or []):
            sidecar = is_sidecar(c)
            c = dict(c)
            cont = Container(c, self._launch(c, vols, base, "Always" if sidecar else init_policy),
                             f"{self.uid[:8]}-init{i}")
            self.init.append(cont)
            cont.start()
            # A sidecar gates the next container until it has started; a plain init
            # container until it has exited 0 (restarting per the pod's policy).
            while not self.deleting.is_set():
                if (cont.started if sidecar else cont.done):
                    break
                self._report()
                self.deleting.wait(0.1)
            if not sidecar and cont.exit_code != 0 and not self.deleting.is_set():
                self.failed_init = cont
                break
        if self.deleting.is_set() or self.failed_init:
            self._hold()
            return
        self.init_done = True
        for i, c in enumerate(spec.get("containers") or []):
            c = dict(c)
            cont = Container(c, self._launch(c, vols, base, policy), f"{self.uid[:8]}-c{i}")
            self.main.append(cont)
            cont.start()
        self._hold()

    def _hold(self) -> None:
        """Report status until deletion is asked for. Once every main container has
        finished for good, sidecars are stopped (in reverse), as the kubelet does."""
        sidecars_stopped = False
        while not self.deleting.wait(0.2):
            self._report()
            if not sidecars_stopped and self.main and all(c.done for c in self.main):
                for c in reversed(self.init):
                    c.stop(self.grace)
                sidecars_stopped = True

    def _finish(self) -> None:
        # Main containers first (in parallel), then sidecars in reverse: the kubelet's order.
        for group in (self.main, list(reversed(self.init))):
            for c in group:
                c.stop(self.grace)
            for c in group:
                c.join(self.grace + 15)
        self.sim.forget(self)
        if not self.gone.is_set():
            try:
                self.rest.delete(f"/api/v1/namespaces/{self.ns}/pods/{self.name}",
                                 {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}})
            except ApiError as e:
                if e.status not in (404, 409):
                    log.warning("pod %s: final delete failed: %s", self.key, e)
        if self.pod_ip != self.host_ip:
            self.sim.ips.give(self.pod_ip)
        self.sim.gpus.release(self.node, self.uid)
        shutil.rmtree(self.cfg.pod_dir(self.node, self.uid), ignore_errors=True)

    # -- status -----------------------------------------------------------------------
    def _cond(self, kind: str, ok: bool, reason: str | None = None) -> dict:
        prev = self._conds.get(kind)
        t = prev[1] if prev and prev[0] == ok else stamp()
        self._conds[kind] = (ok, t)
        return condition(kind, ok, t, reason)

    def status(self, waiting_reason: str = "PodInitializing") -> dict:
        spec = self.pod["spec"]
        init = [c.status() for c in self.init]
        init += [_waiting(c, "PodInitializing") for c in (spec.get("initContainers") or [])[len(init):]]
        main = [c.status() for c in self.main]
        main += [_waiting(c, waiting_reason) for c in (spec.get("containers") or [])[len(main):]]
        phase = "Failed" if self.failed_init else pod_phase(spec.get("restartPolicy", "Always"), self.init_done,
                                                              [dict(s, _will_restart=not c.done)
                                                               for s, c in zip(main, self.main)] or main)
        sidecars_ready = all(c.status()["ready"] for c in self.init if is_sidecar(c.spec))
        ready = self.init_done and bool(main) and all(s["ready"] for s in main) and sidecars_ready
        st = {
            "phase": phase, "hostIP": self.host_ip, "hostIPs": [{"ip": self.host_ip}],
            "podIP": self.pod_ip, "podIPs": [{"ip": self.pod_ip}], "startTime": self.start_time,
            "conditions": [
                self._cond("PodReadyToStartContainers", True),
                self._cond("Initialized", self.init_done, "ContainersNotInitialized"),
                self._cond("ContainersReady", ready, "ContainersNotReady"),
                self._cond("Ready", ready, "ContainersNotReady"),
                self._cond("PodScheduled", True),
            ],
            "initContainerStatuses": init, "containerStatuses": main,
        }
        if not init:
            del st["initContainerStatuses"]
        return st

    def _report(self, waiting_reason: str = "PodInitializing") -> None:
        st = self.status(waiting_reason)
        body = json.dumps(st, sort_keys=True)
        if body == self._last:
            return
        try:
            self.rest.patch(f"/api/v1/namespaces/{self.ns}/pods/{self.name}/status", {"status": st})
            self._last = body
        except ApiError as e:
            if e.status == 404:
                self.delete(0, gone=True)
            else:
                log.warning("pod %s: status update failed: %s", self.key, e)


def _waiting(spec: dict, reason: str) -> dict:
    return {"name": spec["name"], "image": spec.get("image", ""), "imageID": "", "ready": False,
            "started": False, "restartCount": 0, "state": {"waiting": {"reason": reason}}, "lastState": {}}


class NodeSimulator:
    """Watches all pods, runs a PodWorker for each one bound to a simulated node."""

    def __init__(self, rest: Rest, cfg: NodeSimConfig) -> None:
        self.rest, self.cfg = rest, cfg
        self.ips = IpPool(cfg.net)
        self.gpus = GpuAllocator(cfg.nodes, cfg.gpus_per_node)
        self.workers: dict[str, PodWorker] = {}  # by pod uid
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nodesim", daemon=True)
        for node in cfg.nodes:
            cfg.node_root(node).mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        self._thread.start()

    def forget(self, worker: PodWorker) -> None:
        with self._lock:
            self.workers.pop(worker.uid, None)

    def _seen(self, pod: dict, gone: bool = False) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        if spec.get("nodeName") not in self.cfg.nodes:
            return
        with self._lock:
            w = self.workers.get(meta["uid"])
            if w is None and not gone and not meta.get("deletionTimestamp"):
                w = self.workers[meta["uid"]] = PodWorker(self, pod)
                w.start()
        if w is None:
            if meta.get("deletionTimestamp") and not gone:  # e.g. left over: just remove it
                try:
                    self.rest.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                     {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
                except ApiError:
                    pass
            return
        if gone:
            w.delete(0, gone=True)
        elif meta.get("deletionTimestamp"):
            w.delete(meta.get("deletionGracePeriodSeconds"))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                listing = self.rest.get(PODS)
                live = {p["metadata"]["uid"] for p in listing["items"]}
                with self._lock:
                    vanished = [w for uid, w in self.workers.items() if uid not in live]
                for w in vanished:
                    w.delete(0, gone=True)
                for p in listing["items"]:
                    self._seen(p)
                rv = listing["metadata"]["resourceVersion"]
                while not self._stop.is_set():
                    for ev in self.rest.watch(PODS, rv):
                        if ev["type"] == "ERROR":
                            raise ApiError(ev["object"].get("code", 500), json.dumps(ev["object"]), "watch")
                        rv = ev["object"]["metadata"]["resourceVersion"]
                        if ev["type"] != "BOOKMARK":
                            self._seen(ev["object"], gone=ev["type"] == "DELETED")
                        if self._stop.is_set():
                            return
            except Exception as e:  # relist after any watch failure (410 Gone included)
                if not self._stop.is_set():
                    log.info("pod watch restarting: %s", e)
                    self._stop.wait(0.5)

    def stop(self, timeout: float = 30) -> None:
        """Kill every pod process (grace 0: the cluster is going away)."""
        self._stop.set()
        with self._lock:
            workers = list(self.workers.values())
        for w in workers:
            w.delete(0, gone=True)
        deadline = time.monotonic() + timeout
        for w in workers:
            w.join(max(0.1, deadline - time.monotonic()))
