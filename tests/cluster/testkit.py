"""Manifest builders and waits for tests against the simulated cluster (pure builders;
the waits poll through Cluster.kubectl)."""

from __future__ import annotations

import json

from .handle import Cluster, wait_for

TEST_IMAGE = "weightcache-test:latest"  # runnable: its command runs as a local process
SIMULATED_IMAGE = "registry.k8s.io/pause:3.10"  # not runnable: status simulated only
NOSEC = {"allowPrivilegeEscalation": False}


def container(name: str, image: str, command: list[str] | None = None, **extra) -> dict:
    c = {"name": name, "image": image}
    if command:
        c["command"] = command
    c.update(extra)
    return c


def pod_ip_env() -> list[dict]:
    return [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]


def pod(name: str, containers: list[dict], **spec) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"containers": containers, "terminationGracePeriodSeconds": 5, **spec}}


def deployment(name: str, image: str, replicas: int = 1, command: list[str] | None = None) -> dict:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "strategy": {"type": "RollingUpdate",
                                  "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"terminationGracePeriodSeconds": 5,
                                           "containers": [container("main", image, command)]}}}}


def daemonset(name: str, image: str) -> dict:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, "labels": labels},
            "spec": {"selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"terminationGracePeriodSeconds": 5,
                                           "nodeSelector": {"nvidia.com/gpu.present": "true"},
                                           "containers": [container("main", image)]}}}}


def apply(cluster: Cluster, namespace: str, manifest: dict) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))


def get(cluster: Cluster, namespace: str, kind: str, name: str) -> dict | None:
    r = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def pods(cluster: Cluster, namespace: str, selector: str) -> list[dict]:
    return cluster.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]


def is_ready(p: dict | None) -> bool:
    conds = ((p or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def container_status(p: dict, name: str) -> dict:
    for s in (p.get("status") or {}).get("containerStatuses") or []:
        if s["name"] == name:
            return s
    return {}


def wait_pod(cluster: Cluster, namespace: str, name: str, check, what: str, timeout: float = 60) -> dict:
    return wait_for(lambda: (lambda p: p if p and check(p) else None)(get(cluster, namespace, "pod", name)),
                    timeout, f"pod {namespace}/{name} {what}")


def wait_gone(cluster: Cluster, namespace: str, kind: str, name: str, timeout: float = 60) -> None:
    wait_for(lambda: get(cluster, namespace, kind, name) is None, timeout, f"{kind} {namespace}/{name} gone")


def wait_object(read, check, what: str, timeout: float, detail=lambda: "") -> dict:
    """The object READ() returns once CHECK(it) holds; else an AssertionError that shows
    its last status (and DETAIL(), e.g. the operator's log) beside what was awaited."""
    def probe():
        obj = read()
        return obj if obj is not None and check(obj) else None
    try:
        return wait_for(probe, timeout, what)
    except TimeoutError as e:
        extra = detail()
        raise AssertionError(f"{e}; last status: {json.dumps((read() or {}).get('status'))}"
                             + (f"\n{extra}" if extra else "")) from None


def condition(obj: dict | None, kind: str) -> dict:
    """The status condition of this type ({} when absent)."""
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return c
    return {}


def ready_now(obj: dict | None) -> bool:
    """Ready=True for the current generation (not a stale Ready of an earlier spec)."""
    c = condition(obj, "Ready")
    return c.get("status") == "True" and c.get("observedGeneration") == obj["metadata"]["generation"]
