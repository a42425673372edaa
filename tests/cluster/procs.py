"""Child processes of the test cluster: started in their own process groups, logged
to files, and ended by group at teardown, so that nothing we started outlives us and
nothing we did not start is touched."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

# setpriv (util-linux) sets the parent-death signal and then execs the command. It
# replaces a preexec_fn: Python code between fork and exec in this many-threaded
# supervisor can deadlock on a lock another thread held at fork time. That would hang
# the child before exec, and any sibling Popen waiting for its exec pipe with it.
_SETPRIV = shutil.which("setpriv")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago on HOST (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None,
          cwd: str | None = None, groups: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start ARGV in a new session (its own process group), output appended to LOG_PATH.

    If the spawning thread of the supervisor dies (SIGKILL included), the kernel
    SIGKILLs the child instead of leaving an orphan (PR_SET_PDEATHSIG, through
    setpriv). So spawn() must be called from a thread that lives as long as the child.

    GROUPS: supplementary groups added to the child's (a pod's supplementalGroups), set
    between fork and exec by subprocess itself (no Python runs there); only root may,
    so elsewhere they are left out.
    """
    extra = None
    if groups and os.geteuid() == 0:
        extra = sorted(set(os.getgroups()) | set(groups))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [_SETPRIV, "--pdeathsig", "KILL", "--", *argv] if _SETPRIV else list(argv)
    with open(log_path, "ab", buffering=0) as log:
        log.write(f"--- {time.strftime('%H:%M:%S')} exec {argv!r}\n".encode())
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, start_new_session=True, close_fds=True, extra_groups=extra)


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
