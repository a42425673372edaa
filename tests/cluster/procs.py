"""Child processes of the test cluster: started in their own process groups, logged
to files, and ended by group at teardown, so that nothing we started outlives us and
nothing we did not start is touched."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1
try:  # resolved here, not in the forked child, where imports and lookups are unsafe
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago on HOST (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # Runs in the child before exec: if the spawning thread of the supervisor dies
    # (SIGKILL included), the kernel SIGKILLs the child instead of leaving an orphan.
    # So spawn() must be called from a thread that lives as long as the child.
    os.setsid()
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None,
          cwd: str | None = None) -> subprocess.Popen:
    """Start ARGV in a new session (its own process group), output appended to LOG_PATH."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab", buffering=0) as log:
        log.write(f"--- {time.strftime('%H:%M:%S')} exec {argv!r}\n".encode())
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, preexec_fn=_die_with_parent, close_fds=True)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send SIG to PROC's process group (which spawn() made PROC the leader of)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(proc: subprocess.Popen, grace: float) -> int | None:
    """SIGTERM the group, SIGKILL it after GRACE seconds; returns the exit status."""
    if proc.poll() is None:
        signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=max(grace, 0))
        except subprocess.TimeoutExpired:
            pass
    # The leader may be gone while its children in the group live on: kill them too.
    signal_group(proc, signal.SIGKILL)
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return None


class ProcessSet:
    """The named long-running processes of the control plane, stopped in reverse order."""

    def __init__(self) -> None:
        self._procs: list[tuple[str, subprocess.Popen]] = []
        self._lock = threading.Lock()

    def start(self, name: str, argv: list[str], log_path: Path, **kw) -> subprocess.Popen:
        proc = spawn(argv, log_path, **kw)
        with self._lock:
            self._procs.append((name, proc))
        return proc

    def dead(self) -> list[tuple[str, int]]:
        """(name, exit status) of every process that has exited."""
        with self._lock:
            return [(n, p.returncode) for n, p in self._procs if p.poll() is not None]

    def stop_all(self, grace: float = 5.0) -> None:
        with self._lock:
            procs, self._procs = self._procs, []
        for _, proc in reversed(procs):
            stop(proc, grace)
