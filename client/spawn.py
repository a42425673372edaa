"""Start a `weightcache daemon` process and wait until it serves.

The daemon writes "ready" to an inherited pipe once its socket is published, so the
caller waits on that pipe instead of polling for files.
"""

import os
import select
import subprocess
import sys

from .errors import CacheUnavailable

# A daemon that found another daemon already serving its cache exits with this code.
EXIT_ALREADY_SERVED = 75


class DaemonStartFailed(CacheUnavailable):
    def __init__(self, message: str, returncode: int | None):
        self.returncode = returncode
        super().__init__(message)


def spawn_daemon(model_dir, socket_dir, name: str, extra_args=(), *, detached: bool = False,
                 stdout=subprocess.DEVNULL, stderr=None, timeout: float = 600.0, env=None) -> subprocess.Popen:
    """Run the daemon and return its process once it serves (model_dir None: a store).

    detached: the daemon gets its own session and outlives the caller (mode=daemon).
    Raises DaemonStartFailed with the exit code when it exits or times out first.
    """
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightcache", "daemon", *(["--model", str(model_dir)] if model_dir else []),
         "--socket-dir", str(socket_dir), "--name", name, "--ready-fd", str(write_end), *extra_args],
        pass_fds=(write_end,), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env,
        start_new_session=detached,
    )
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], timeout)
        if ready and os.read(read_end, 16).startswith(b"ready"):
            # The daemon closes the pipe right after writing; wait for that too, so a
            # caller counting the daemon's fds never sees the pipe still open.
            if select.select([read_end], [], [], 5)[0]:
                os.read(read_end, 16)
            return proc
    finally:
        os.close(read_end)
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    what = f"daemon for {model_dir}" if model_dir else "store daemon"
    raise DaemonStartFailed(f"{what} (cache {name}) did not become ready within {timeout:.0f}s; "
                            f"it exited with code {code}", code)
