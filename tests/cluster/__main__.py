"""CLI: python -m cluster {build,up,down,run,status} (with tests/ on PYTHONPATH).

  build   build or reuse the binaries; prints the bin dir
  up      start a cluster in the background; prints the kubeconfig path once healthy
  down    stop the cluster that `up` started
  run     the supervisor itself, in the foreground (what `up` and the fixture start)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

DEFAULT_STATE = Path(os.environ.get("WEIGHTCACHE_CLUSTER_DIR", "/tmp/weightcache-cluster"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster")
    ap.add_argument("command", choices=["build", "up", "down", "run", "status"])
    ap.add_argument("--state", type=Path, default=DEFAULT_STATE)
    ap.add_argument("--bin-dir", type=Path)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--pod-security-default", default="baseline")
    a = ap.parse_args(argv)

    from .binaries import ensure_binaries
    from .handle import spawn_supervisor, stop_pid, supervisor_argv, wait_ready
    from .supervisor import READY_FILE, run

    if a.command == "build":
        print(ensure_binaries())
    elif a.command == "run":
        run(a.state, a.bin_dir or ensure_binaries(), a.nodes, a.gpus, a.timeout, a.pod_security_default)
    elif a.command == "up":
        if (a.state / READY_FILE).exists():
            info = json.loads((a.state / READY_FILE).read_text())
            if _alive(info["pid"]):
                print(f"a cluster is already up (pid {info['pid']}); `make cluster-down` first", file=sys.stderr)
                return 1
        bin_dir = a.bin_dir or ensure_binaries()
        shutil.rmtree(a.state, ignore_errors=True)
        proc = spawn_supervisor(supervisor_argv(a.state, bin_dir, a.nodes, a.gpus, a.timeout,
                                                a.pod_security_default), a.state, detach=True)
        c = wait_ready(proc, a.state, a.timeout + 10)
        print(f"cluster up in {c.start_seconds:.1f} s (pid {c.pid}); nodes: {' '.join(c.nodes)}; logs: {c.log_dir}",
              file=sys.stderr)
        print(f"export KUBECONFIG={c.kubeconfig}  PATH={c.bin_dir}:$PATH", file=sys.stderr)
        print(c.kubeconfig)
    elif a.command == "down":
        ready = a.state / READY_FILE
        if not ready.exists():
            print(f"no cluster is up in {a.state}", file=sys.stderr)
            return 0
        pid = json.loads(ready.read_text())["pid"]
        stop_pid(pid)
        ready.unlink(missing_ok=True)
        print(f"cluster (pid {pid}) stopped; logs kept in {a.state / 'logs'}", file=sys.stderr)
    elif a.command == "status":
        ready = a.state / READY_FILE
        print(ready.read_text() if ready.exists() else "down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
