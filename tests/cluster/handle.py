"""The test-side view of a running cluster (Cluster) and the context manager that
starts one in a supervisor process and stops it again (start_cluster)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterator

from . import procs
from .supervisor import FAILED_FILE, READY_FILE

TESTS_DIR = Path(__file__).resolve().parent.parent  # on PYTHONPATH, so `-m cluster` imports


@dataclass
class Cluster:
    kubeconfig: Path
    server: str
    bin_dir: Path
    nodes: list[str]
    gpus_per_node: int
    state: Path
    log_dir: Path
    start_seconds: float
    pid: int
    wall_start_seconds: float = 0.0  # as the caller saw it, interpreter start included
    _extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_ready_file(cls, path: Path) -> "Cluster":
        info = json.loads(path.read_text())
        return cls(kubeconfig=Path(info["kubeconfig"]), server=info["server"], bin_dir=Path(info["bin_dir"]),
                   nodes=list(info["nodes"]), gpus_per_node=info["gpus_per_node"], state=Path(info["state"]),
                   log_dir=Path(info["log_dir"]), start_seconds=info["start_seconds"], pid=info["pid"])

    # -- tools ------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "HELM_CACHE_HOME": str(self.state / "helm/cache"),
                "HELM_CONFIG_HOME": str(self.state / "helm/config"), "HELM_DATA_HOME": str(self.state / "helm/data")}

    def _tool(self, tool: str, args, input: str | None, check: bool, timeout: float) -> subprocess.CompletedProcess:
        argv = [str(self.bin_dir / tool), *map(str, args)]
        r = subprocess.run(argv, input=input, capture_output=True, text=True, env=self.env(), timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{tool} {' '.join(map(str, args))} failed ({r.returncode}):\n{r.stdout}{r.stderr}"
                                 f"\n(cluster logs: {self.log_dir})")
        return r

    def kubectl(self, *args, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:
        return self._tool("kubectl", args, input, check, timeout)

    def helm(self, *args, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        return self._tool("helm", args, None, check, timeout)

    def kubectl_json(self, *args) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    @cached_property
    def api_client(self):
        """An official-client ApiClient authenticated as cluster admin."""
        from kubernetes import config
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    # -- simulated nodes --------------------------------------------------------------
    def node_root(self, node: str) -> Path:
        """The host folder behind hostPath volumes on NODE: hostPath /a/b is node_root/a/b."""
        return self.state / "nodes" / node / "root"

    def pod_volume(self, pod: dict, volume: str) -> Path:
        """The host folder behind a pod's non-hostPath volume (emptyDir, configMap, ...)."""
        node, uid = pod["spec"]["nodeName"], pod["metadata"]["uid"]
        return self.state / "nodes" / node / "pods" / uid / "volumes" / volume

    def pod_log(self, namespace: str, pod: str, container: str) -> Path:
        """Output of a simulated container's process (no kubelet serves `kubectl logs`)."""
        return self.log_dir / "pods" / f"{namespace}_{pod}_{container}.log"

    def create_namespace(self, name: str, pod_security: str | None = "privileged",
                         timeout: float = 30) -> None:
        """A namespace (labelled for the Pod Security level given) whose default
        ServiceAccount exists, so that pods can be created in it at once."""
        labels = {"pod-security.kubernetes.io/enforce": pod_security} if pod_security else {}
        manifest = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
        self.kubectl("apply", "-f", "-", input=json.dumps(manifest))
        wait_for(lambda: self.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
                 timeout, f"default service account in {name}")

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True


def wait_for(check: Callable[[], object], timeout: float, what: str, interval: float = 0.1):
    """Poll CHECK until it returns something truthy; that value, or TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def supervisor_argv(state: Path, bin_dir: Path, nodes: int, gpus: int, timeout: float,
                    pod_security: str) -> list[str]:
    return [sys.executable, "-m", "cluster", "run", "--state", str(state), "--bin-dir", str(bin_dir),
            "--nodes", str(nodes), "--gpus", str(gpus), "--timeout", str(timeout),
            "--pod-security-default", pod_security]


def spawn_supervisor(argv: list[str], state: Path, detach: bool) -> subprocess.Popen:
    """DETACH: outlives the caller (make cluster-up); else it dies with the caller."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))}
    state.mkdir(parents=True, exist_ok=True)
    log = state / "supervisor.out"
    if detach:
        with open(log, "ab") as out:
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    start_new_session=True)
    return procs.spawn(argv, log, env=env)


def wait_ready(proc: subprocess.Popen, state: Path, timeout: float) -> Cluster:
    deadline = time.monotonic() + timeout
    while not (state / READY_FILE).exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            why = (state / FAILED_FILE).read_text().strip() if (state / FAILED_FILE).exists() else \
                ("exited with status %s" % proc.returncode if proc.returncode is not None else "timed out")
            procs.stop(proc, 10)
            raise RuntimeError(f"test cluster did not start: {why}; logs in {state / 'logs'} "
                               f"and {state / 'supervisor.out'}")
        time.sleep(0.05)
    return Cluster.from_ready_file(state / READY_FILE)


def stop_pid(pid: int, timeout: float = 60) -> None:
    """SIGTERM a supervisor we started (by pid) and wait for it; SIGKILL if it hangs.
    Its children die with it (PR_SET_PDEATHSIG)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def start_cluster(state: Path, bin_dir: Path, nodes: int = 2, gpus: int = 2, timeout: float = 120,
                  pod_security: str = "baseline") -> Iterator[Cluster]:
    """A running cluster for the duration of the with-block; stopped even on failure."""
    t0 = time.monotonic()
    proc = spawn_supervisor(supervisor_argv(state, bin_dir, nodes, gpus, timeout, pod_security), state,
                            detach=False)
    try:
        c = wait_ready(proc, state, timeout + 10)
        c.wall_start_seconds = round(time.monotonic() - t0, 2)
        yield c
    finally:
        procs.stop(proc, 60)
