"""What the hot-standby test and bench/standby_failover.py share: the operator as a local
process with its webhook (scoped to one namespace), a cpu-backend WeightCache on one
node, example-engine Deployments and their Service, a watch of the Service's ready
endpoints, and the engine's own process id (its /status says it) for a real kill.

Not a test module: test_cp_standby.py and the bench import it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from cluster import wait_for
from procs import http
from test_cp_operator import Operator, start_operator, stop_operator

ENGINE_PORT, AGENT_PORT, DAEMON_PORT = 8000, 9401, 9400
ROLE, STANDBY_FOR = "weightcache.io/role", "weightcache.io/standby-for"


def is_ready(p: dict | None) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in ((p or {}).get("status") or {}).get("conditions") or [])


class Env:
    """The operator, its webhook for namespace NS, and what the tests put there."""

    def __init__(self, cluster, work: Path, ns: str) -> None:
        self.cluster, self.work, self.ns = cluster, work, ns
        self.operator: Operator | None = None
        self.hook = ""

    def start(self) -> "Env":
        self.operator, self.hook = start_operator(self.cluster, self.work, self.ns, "weightcache-standby",
                                                  only_ns=True)
        return self

    def stop(self) -> None:
        stop_operator(self.cluster, self.operator, self.hook, self.ns, workloads="deployments,services")

    def operator_log(self) -> str:
        return self.operator.log(self.operator.procs[-1]) if self.operator and self.operator.procs else ""

    # -- the model, the cache, the engines -------------------------------------------------
    def put_model(self, node: str, source: Path, path: str) -> None:
        dest = self.cluster.node_root(node) / path.lstrip("/")
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.symlink_to(source, target_is_directory=True)

    def create_cache(self, name: str, model: str, node: str) -> None:
        manifest = {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache", "metadata": {"name": name},
                    "spec": {"model": {"path": model}, "backend": "cpu", "clientPolicy": {"fallback": "error"},
                             "placement": {"nodeSelector": {"kubernetes.io/hostname": node}}}}
        self.cluster.kubectl("apply", "-n", self.ns, "-f", "-", input=json.dumps(manifest))

    def wait_cache_ready(self, name: str, timeout: float = 600) -> dict:
        def ready():
            wc = self.get("wc", name)
            conds = ((wc or {}).get("status") or {}).get("conditions") or []
            return wc if any(c["type"] == "Ready" and c["status"] == "True" for c in conds) else None
        try:
            return wait_for(ready, timeout, f"WeightCache {name} Ready", interval=0.5)
        except TimeoutError as e:
            raise AssertionError(f"{e}: {json.dumps((self.get('wc', name) or {}).get('status'))}\n"
                                 f"{self.operator_log()}") from None

    def daemon_status(self, cache: str) -> dict:
        (pod,) = self.pods(f"app.kubernetes.io/name=weightcache-daemon,weightcache.io/cache={cache}")
        return http(f"http://{pod['status']['podIP']}:{DAEMON_PORT}/status")[1]

    def apply(self, manifest: dict) -> None:
        self.cluster.kubectl("apply", "-n", self.ns, "-f", "-", input=json.dumps(manifest))

    def get(self, kind: str, name: str) -> dict | None:
        r = self.cluster.kubectl("get", kind, name, "-n", self.ns, "-o", "json", check=False)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def pods(self, selector: str) -> list[dict]:
        return self.cluster.kubectl_json("get", "pods", "-n", self.ns, "-l", selector)["items"]

    def events(self, kind: str, name: str, reason: str) -> list[dict]:
        return self.cluster.kubectl_json("get", "events", "-n", self.ns, "--field-selector",
                                         f"involvedObject.name={name},involvedObject.kind={kind},"
                                         f"reason={reason}")["items"]


def engine_deployment(name: str, model: str, cache: str | None, standbys: int | None, replicas: int = 1) -> dict:
    """`weightcache example-engine` serving MODEL: through CACHE (the webhook does the
    rest), or from disk (no cache: the model mounted by hand, WEIGHTCACHE_MODE=off)."""
    labels = {"app": name}
    template_labels = {**labels, **({"weightcache.io/cache": cache} if cache else {})}
    engine = {"name": "engine", "image": "weightcache-engine:test",
              "args": ["example-engine", "--model", model, "--http-bind", f"$(POD_IP):{ENGINE_PORT}"],
              "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
              "ports": [{"name": "http", "containerPort": ENGINE_PORT}],
              "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1}}
    spec = {"terminationGracePeriodSeconds": 5, "containers": [engine]}
    if not cache:
        engine["env"].append({"name": "WEIGHTCACHE_MODE", "value": "off"})
        engine["volumeMounts"] = [{"name": "model", "mountPath": model, "readOnly": True}]
        spec["volumes"] = [{"name": "model", "hostPath": {"path": model, "type": "Directory"}}]
    annotations = {"weightcache.io/hot-standby": str(standbys)} if standbys is not None else {}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "labels": labels, "annotations": annotations},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": template_labels}, "spec": spec}}}


def service(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"selector": {"app": name}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}


def engine_pid(pod: dict) -> int:
    """The engine's process id, as it says on /status (a local process here)."""
    return http(f"http://{pod['status']['podIP']}:{ENGINE_PORT}/status", timeout=10)[1]["pid"]


def kill_engine(pod: dict) -> float:
    """SIGKILL the pod's engine process; the monotonic time of the kill."""
    pid = engine_pid(pod)
    t = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return t


class EndpointsWatch:
    """The Service's ready endpoint addresses, as the EndpointSlice controller computes
    them (pods whose labels match the selector, Ready, not being deleted), from a watch
    of the namespace's pods, with the monotonic time each change arrived.

    Why not the EndpointSlices themselves: the apiserver refuses loopback addresses in
    them ("may not be in the loopback range"), and the simulator's pod IPs are loopback
    addresses, so the real controller's writes fail here (FailedToUpdateEndpointSlices);
    its input, the pods, is what can be watched."""

    def __init__(self, cluster, ns: str, selector: dict) -> None:
        from kubernetes import client

        self.api = client.CoreV1Api(cluster.api_client)
        self.ns, self.selector = ns, dict(selector)
        self.history: list[tuple[float, frozenset]] = []
        self._pods: dict[str, str] = {}  # uid -> pod IP, of the pods that are endpoints now
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="endpoints-watch")
        self._thread.start()

    def _endpoint(self, pod) -> str | None:
        labels = pod.metadata.labels or {}
        if pod.metadata.deletion_timestamp or any(labels.get(k) != v for k, v in self.selector.items()):
            return None
        ready = any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))
        return pod.status.pod_ip if ready and pod.status.pod_ip else None

    def _set(self, pod, gone: bool = False) -> None:
        ip = None if gone else self._endpoint(pod)
        if ip:
            self._pods[pod.metadata.uid] = ip
        else:
            self._pods.pop(pod.metadata.uid, None)

    def _run(self) -> None:
        from kubernetes import watch

        while not self._stop.is_set():
            try:
                listing = self.api.list_namespaced_pod(self.ns)
                with self._cond:
                    self._pods = {}
                    for pod in listing.items:
                        self._set(pod)
                    self._record()
                w = watch.Watch()
                for ev in w.stream(self.api.list_namespaced_pod, self.ns,
                                   resource_version=listing.metadata.resource_version, timeout_seconds=60):
                    with self._cond:
                        self._set(ev["object"], gone=ev["type"] == "DELETED")
                        self._record()
                    if self._stop.is_set():
                        w.stop()
            except Exception:  # relist after any failure of the watch
                self._stop.wait(0.2)

    def _record(self) -> None:
        ready = frozenset(self._pods.values())
        if not self.history or self.history[-1][1] != ready:
            self.history.append((time.monotonic(), ready))
        self._cond.notify_all()

    def ready(self) -> frozenset:
        with self._cond:
            return self.history[-1][1] if self.history else frozenset()

    def wait(self, check, after: float, timeout: float, what: str) -> float:
        """The first time at or after AFTER when CHECK(ready addresses) held."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for t, ready in self.history:
                    if t >= after and check(ready):
                        return t
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out after {timeout}s waiting for the Service endpoints: {what}; "
                                       f"ready now: {sorted(self.history[-1][1]) if self.history else []}")
                self._cond.wait(left)

    def stop(self) -> None:
        self._stop.set()
