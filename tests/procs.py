"""Real processes for the tests: daemons and engines, and waiting on conditions.

Imported by conftest.py and by tests (`from procs import wait_until`).
"""

import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from weightcache.client.spawn import spawn_daemon

ENGINE = pathlib.Path(__file__).with_name("engine_proc.py")


def http_json(url: str, body: bytes | None = None, method: str | None = None, headers=None,
              timeout: float = 60) -> tuple[int, dict]:
    """(status, JSON body) of one HTTP request; error statuses are answers too."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def http(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    """GET, or POST a JSON body: (status, JSON answer)."""
    return http_json(url, None if body is None else json.dumps(body).encode(), timeout=timeout)


def wait_until(predicate, timeout: float = 10.0, what: str = "condition"):
    """Poll a condition (short interval, bounded) and return its first truthy value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def read_json_line(proc: subprocess.Popen, log_path, timeout: float) -> dict:
    """The next JSON line a child prints on its stdout; fails naming its exit code and log
    tail if it says nothing within TIMEOUT."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else b""
    if not line:
        raise AssertionError(f"{pathlib.Path(proc.args[1]).name} {proc.pid} said nothing (exit {proc.poll()}); "
                             f"stderr: {pathlib.Path(log_path).read_text()[-3000:]}")
    return json.loads(line)


class Daemons:
    def __init__(self, log_dir: pathlib.Path):
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, model_dir, socket_dir, name="test", extra=(), **kwargs) -> subprocess.Popen:
        log = open(self.log_dir / f"daemon-{len(self.procs)}.log", "wb")
        proc = spawn_daemon(model_dir, socket_dir, name, ["--log-level", "debug", *extra],
                            stderr=log, timeout=60, **kwargs)
        proc.log_path = log.name
        self.procs.append(proc)
        return proc

    def stop_all(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Engine:
    """A real engine process (tests/engine_proc.py) speaking JSON lines."""

    def __init__(self, model_dir, env: dict, log_path: pathlib.Path):
        self.stderr = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, str(ENGINE), str(model_dir)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, env={**os.environ, **env})
        self.log_path = log_path
        self.hello = self.read(timeout=60)

    def read(self, timeout: float = 30.0) -> dict:
        return read_json_line(self.proc, self.log_path, timeout)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.stderr.close()
