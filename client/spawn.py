"""Start a `weightcache daemon` process and wait until it serves.

The daemon writes "ready" to an inherited pipe once its socket is published, so the
caller waits on that pipe instead of polling for files.
"""

import os
import select
import subprocess
import sys

from .errors import CacheUnavailable

# A daemon that found another daemon already serving its cache exits with this code,
# and says so on its ready pipe first.
EXIT_ALREADY_SERVED = 75
ALREADY_SERVED_LINE = b"already-served\n"
# A detached daemon is started by this short-lived launcher, so that it is nobody's
# descendant: an engine that kills its own process tree on exit (vLLM's server does)
# must not take the node's cache with it.
_LAUNCHER = ("import os, subprocess, sys; fd = int(sys.argv[1]); "
             "subprocess.Popen(sys.argv[2:], pass_fds=(fd,), start_new_session=True, close_fds=True)")


class DaemonStartFailed(CacheUnavailable):
    def __init__(self, message: str, returncode: int | None):
        self.returncode = returncode
        super().__init__(message)


def spawn_daemon(model_dir, socket_dir, name: str, extra_args=(), *, detached: bool = False,
                 stdout=subprocess.DEVNULL, stderr=None, timeout: float = 600.0, env=None) -> subprocess.Popen:
    """Run the daemon and return its process once it serves (model_dir None: a store).

    detached: the daemon gets its own session, is reparented away from the caller
    (through a launcher that exits at once) and outlives it (mode=daemon); the process
    returned is then the launcher's.
    Raises DaemonStartFailed with the exit code when it exits or times out first.
    """
    read_end, write_end = os.pipe()
    command = [sys.executable, "-m", "weightcache", "daemon", *(["--model", str(model_dir)] if model_dir else []),
               "--socket-dir", str(socket_dir), "--name", name, "--ready-fd", str(write_end), *extra_args]
    if detached:
        command = [sys.executable, "-c", _LAUNCHER, str(write_end), *command]
    proc = subprocess.Popen(command, pass_fds=(write_end,), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                            env=env)
    os.close(write_end)
    said = b""
    try:
        ready, _, _ = select.select([read_end], [], [], timeout)
        said = os.read(read_end, 32) if ready else b""
        if said.startswith(b"ready"):
            # The daemon closes the pipe right after writing; wait for that too, so a
            # caller counting the daemon's fds never sees the pipe still open.
            if select.select([read_end], [], [], 5)[0]:
                os.read(read_end, 16)
            return proc
    finally:
        os.close(read_end)
    if said.startswith(ALREADY_SERVED_LINE.strip()):
        raise DaemonStartFailed(f"another daemon already serves cache {name}", EXIT_ALREADY_SERVED)
    if detached:
        proc.wait()
        raise DaemonStartFailed(f"the detached daemon (cache {name}) exited or stalled before it served within "
                                f"{timeout:.0f}s; see its log", None)
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    what = f"daemon for {model_dir}" if model_dir else "store daemon"
    raise DaemonStartFailed(f"{what} (cache {name}) did not become ready within {timeout:.0f}s; "
                            f"it exited with code {code}", code)
