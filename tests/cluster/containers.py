"""One container of a simulated pod: a local process (runnable images) or a stand-in
that is simply running (other images), with probes, restarts and a kubelet-shaped
status. Each container has its own thread, which also owns its process (see procs.spawn)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import procs
from .podspec import should_restart
from .probes import ProbeState, run_check

log = logging.getLogger("cluster.containers")
BACKOFF_MAX = 10.0  # the kubelet's is 5 minutes; tests want to see restarts quickly
# terminationMessagePolicy FallbackToLogsOnError: the kubelet's limits on the log tail
# it puts into the termination message (kubecontainer.MaxContainerTerminationMessageLog*).
TAIL_LINES, TAIL_BYTES = 80, 2048


def log_tail(path: Path, offset: int, max_lines: int = TAIL_LINES, max_bytes: int = TAIL_BYTES) -> str:
    """What the kubelet makes of a failed container's log: its last MAX_LINES lines, of
    which at most the last MAX_BYTES. Only this run's output counts (from OFFSET on, less
    the header line procs.spawn writes). MAX_BYTES + 1 bytes from the end are enough: if
    they hold more than MAX_LINES lines, the line cut falls inside them; if not, the
    byte cut does."""
    try:
        with open(path, "rb") as f:
            start = max(offset, f.seek(0, 2) - max_bytes - 1)
            f.seek(start)
            data = f.read()
    except OSError:
        return ""
    if start == offset and data.startswith(b"--- "):
        data = data.partition(b"\n")[2]
    tail = b"".join(data.splitlines(keepends=True)[-max_lines:])[-max_bytes:]
    return tail.decode(errors="replace")


def stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class Launch:
    """How to run one container, as resolved by the pod worker."""
    argv: list[str] | None  # None: simulated image, no process
    env: dict[str, str]
    cwd: str | None
    log_path: Path
    host: str  # the pod IP, where network probes connect
    restart_policy: str  # Always | OnFailure | Never, for this container
    grace: float  # terminationGracePeriodSeconds
    groups: tuple[int, ...] = ()  # supplementary groups the process gets beside its own
    error: str = ""  # why the process cannot be started at all (a StartError, as a runtime says)


class Container:
    def __init__(self, spec: dict, launch: Launch, container_id: str) -> None:
        self.spec = spec
        self.name = spec["name"]
        self.launch = launch
        self.container_id = container_id
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._grace = launch.grace
        self.restart_count = 0
        self.state: dict = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict = {}
        self.ready = False
        self.started = False  # startup probe passed (or none) while running
        self.done = False  # terminated and will not restart
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, name=f"container-{self.name}", daemon=True)

    # -- control, from the pod worker -------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, grace: float) -> None:
        self._grace = min(self._grace, grace)
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def status(self) -> dict:
        with self._lock:
            s = {"name": self.name, "image": self.spec.get("image", ""),
                 "imageID": f"sim://{self.spec.get('image', '')}",
                 "containerID": f"sim://{self.container_id}-{self.restart_count}",
                 "ready": self.ready, "started": self.started, "restartCount": self.restart_count,
                 "state": dict(self.state), "lastState": dict(self.last_state)}
            return s

    # -- the container's own thread -----------------------------------------------------
    def _set(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, v)

    def _run(self) -> None:
        try:
            if self.launch.argv is None:
                self._simulate()
            else:
                self._supervise()
        except Exception:  # a bug here must show in the logs, not hang the pod silently
            log.exception("container %s crashed in the simulator", self.name)
            self._terminated(128, "SimulatorError", stamp())
            self._set(done=True)

    def _simulate(self) -> None:
        t = stamp()
        self._set(state={"running": {"startedAt": t}}, started=True, ready=True)
        self._stop.wait()
        self._terminated(0, "Completed", t)
        self._set(done=True)

    def _terminated(self, code: int, reason: str, started_at: str, message: str = "") -> None:
        term = {"exitCode": code, "reason": reason, "startedAt": started_at, "finishedAt": stamp(),
                "containerID": f"sim://{self.container_id}-{self.restart_count}"}
        if message:
            term["message"] = message
        self._set(state={"terminated": term}, ready=False, exit_code=code)

    def _supervise(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            code = self._run_once()
            if self._stop.is_set():
                break
            if not should_restart(self.launch.restart_policy, code):
                break
            with self._lock:
                self.last_state = dict(self.state)
                self.state = {"waiting": {"reason": "CrashLoopBackOff",
                                          "message": f"back-off {backoff:.1f}s restarting failed container"}}
            if self._stop.wait(backoff):
                break
            backoff = min(backoff * 2, BACKOFF_MAX)
            with self._lock:
                self.restart_count += 1
        self._set(done=True, ready=False)

    def _run_once(self) -> int:
        """Start the process, probe it until it exits or is killed; its exit code."""
        launch, t0 = self.launch, stamp()
        if not launch.argv:
            self._terminated(127, "ContainerCannotRun", t0, "no command: image has no entrypoint here")
            return 127
        if launch.error:
            self._terminated(128, "StartError", t0, launch.error)
            return 128
        log_start = launch.log_path.stat().st_size if launch.log_path.exists() else 0
        try:
            proc = procs.spawn(launch.argv, launch.log_path, env=launch.env, cwd=launch.cwd, groups=launch.groups)
        except OSError as e:
            self._terminated(127, "StartError", t0, str(e))
            return 127
        startup = self._probe("startupProbe")
        readiness, liveness = self._probe("readinessProbe"), self._probe("livenessProbe")
        self._set(state={"running": {"startedAt": t0}}, started=startup is None,
                  ready=startup is None and readiness is None)
        reason, message = None, ""
        while True:
            code = proc.poll()
            if code is not None:
                break
            if self._stop.is_set():
                reason = "Completed"
                break
            now = time.monotonic()
            if startup is not None and not self.started:
                if startup.due(now):
                    startup.record(*run_check(startup.probe, self.spec, launch.host, launch.env, launch.cwd), now)
                    if startup.ok:
                        self._set(started=True, ready=readiness is None)
                        if readiness is not None:
                            readiness.next_at = now  # the kubelet probes readiness right after startup
                    elif startup.failed:
                        reason, message = "Error", f"startup probe failed: {startup.message}"
                        break
            elif self.started:
                if readiness is not None and readiness.due(now):
                    readiness.record(*run_check(readiness.probe, self.spec, launch.host, launch.env, launch.cwd), now)
                    self._set(ready=readiness.ok)
                if liveness is not None and liveness.due(now):
                    liveness.record(*run_check(liveness.probe, self.spec, launch.host, launch.env, launch.cwd), now)
                    if liveness.failed:
                        reason, message = "Error", f"liveness probe failed: {liveness.message}"
                        break
            self._stop.wait(0.05)
        self._set(ready=False)
        if code is None:
            grace = self._grace
            if liveness is not None and liveness.failed:
                grace = float(liveness.probe.get("terminationGracePeriodSeconds") or grace)
            code = procs.stop(proc, grace)
            code = 137 if code is None else (128 - code if code < 0 else code)
            reason = "Error" if reason == "Error" else ("Completed" if code == 0 else "Error")
        else:
            code = 128 - code if code < 0 else code
            reason = "Completed" if code == 0 else "Error"
        if code != 0 and self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            # No terminationMessagePath file here, so the log always stands in; the
            # kubelet appends it to any message of its own, after ": ".
            tail = log_tail(launch.log_path, log_start)
            message = f"{message}: {tail}" if message and tail else (message or tail)
        self._terminated(code, reason, t0, message)
        log.info("container %s exited %s (%s)", self.name, code, reason)
        return code

    def _probe(self, key: str) -> ProbeState | None:
        probe = self.spec.get(key)
        return ProbeState(probe) if probe else None
