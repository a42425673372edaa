"""Fake GPU nodes: Node objects that look like GPU workers to the scheduler and the
operator, kept Ready by renewing their Leases as a kubelet would."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import uuid

from .kube import STRATEGIC, ApiError, Rest
from .network import Network

log = logging.getLogger("cluster.nodes")

GPU_RESOURCE = "nvidia.com/gpu"
# Comma-separated GPU UUIDs of a node, in device-index order.
GPU_UUIDS_ANNOTATION = "nvidia.com/gpu.uuids"
GPU_PRODUCT = "NVIDIA-H200"
LEASE_SECONDS = 40
RENEW_SECONDS = 10


def gpu_uuids(node: str, count: int) -> list[str]:
    """Stable, node-unique UUIDs in nvidia-smi's GPU-xxxxxxxx-... form."""
    return [f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}.gpu{i}.weightcache.test')}" for i in range(count)]


def node_names(count: int) -> list[str]:
    return [f"gpu-node-{i}" for i in range(count)]


LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"


def stamp(micro: bool = False) -> str:
    """Now in the API's RFC 3339 form (MicroTime for leases)."""
    fmt = "%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ"
    return dt.datetime.now(dt.timezone.utc).strftime(fmt)


def node_manifest(name: str, index: int, gpus: int) -> dict:
    uuids = gpu_uuids(name, gpus)
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                "beta.kubernetes.io/os": "linux", "beta.kubernetes.io/arch": "amd64",
                "node.kubernetes.io/instance-type": "sim-gpu", "topology.kubernetes.io/zone": "sim-a",
                "nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": str(gpus),
                "nvidia.com/gpu.product": GPU_PRODUCT, "weightcache.test/simulated": "true",
            },
            "annotations": {GPU_UUIDS_ANNOTATION: ",".join(uuids),
                            "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {},
    }


def node_status(ip: str, gpus: int) -> dict:
    t = stamp()
    res = {"cpu": "16", "memory": "128Gi", "pods": "110", "ephemeral-storage": "500Gi", GPU_RESOURCE: str(gpus)}
    cond = [
        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "simulated kubelet is posting ready status"},
        {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory", "message": ""},
        {"type": "DiskPressure", "status": "False", "reason": "KubeletHasNoDiskPressure", "message": ""},
        {"type": "PIDPressure", "status": "False", "reason": "KubeletHasSufficientPID", "message": ""},
    ]
    for c in cond:
        c["lastHeartbeatTime"] = t
        c["lastTransitionTime"] = t
    return {"status": {
        "capacity": res, "allocatable": res, "conditions": cond,
        "addresses": [{"type": "InternalIP", "address": ip}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux", "osImage": "weightcache node simulator",
                     "kernelVersion": "sim", "containerRuntimeVersion": "sim://1", "kubeletVersion": "v1.37.2",
                     "kubeProxyVersion": "", "machineID": "", "systemUUID": "", "bootID": ""},
    }}


def lease_manifest(node: str, node_uid: str) -> dict:
    return {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": node, "namespace": "kube-node-lease",
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}]},
        "spec": {"holderIdentity": node, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": stamp(micro=True)},
    }


class NodeKeeper:
    """Registers the nodes and renews their leases until stopped."""

    def __init__(self, rest: Rest, names: list[str], gpus: int, net: Network) -> None:
        self.rest = rest
        self.net = net
        self.names = names
        self.gpus = gpus
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-keeper", daemon=True)

    def register(self) -> None:
        for i, name in enumerate(self.names):
            try:
                node = self.rest.create("/api/v1/nodes", node_manifest(name, i, self.gpus))
            except ApiError as e:
                if e.status != 409:
                    raise
                node = self.rest.get(f"/api/v1/nodes/{name}")
            self.rest.patch(f"/api/v1/nodes/{name}/status", node_status(self.net.node_ip(i), self.gpus), STRATEGIC)
            self._renew(name, node["metadata"]["uid"])
        self._thread.start()

    def _renew(self, name: str, uid: str | None = None) -> None:
        path = f"{LEASES}/{name}"
        try:
            self.rest.patch(path, {"spec": {"renewTime": stamp(micro=True)}})
        except ApiError as e:
            if e.status != 404:
                raise
            uid = uid or self.rest.get(f"/api/v1/nodes/{name}")["metadata"]["uid"]
            self.rest.create(LEASES, lease_manifest(name, uid))

    def _run(self) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            for name in self.names:
                try:
                    self._renew(name)
                except Exception as e:  # keep renewing the others; the next round retries
                    log.warning("lease renewal of %s failed: %s", name, e)

    def stop(self) -> None:
        self._stop.set()
