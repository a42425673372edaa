"""GPU assignment, as the NVIDIA device plugin does it: a container that limits
nvidia.com/gpu gets that many of its node's GPU UUIDs, exclusively, in
NVIDIA_VISIBLE_DEVICES."""

from __future__ import annotations

import threading

from .nodes import GPU_RESOURCE, gpu_uuids

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"


def gpu_limit(container: dict) -> int:
    limits = (container.get("resources") or {}).get("limits") or {}
    return int(limits.get(GPU_RESOURCE, 0) or 0)


class GpuAllocator:
    def __init__(self, nodes: tuple[str, ...], per_node: int) -> None:
        self._owner: dict[str, dict[str, str | None]] = {n: dict.fromkeys(gpu_uuids(n, per_node)) for n in nodes}
        self._lock = threading.Lock()

    def allocate(self, node: str, owner: str, count: int) -> list[str]:
        """COUNT free UUIDs of NODE for OWNER (a pod uid); fewer if the node has fewer free
        (the scheduler should have prevented that)."""
        with self._lock:
            free = [u for u, o in self._owner[node].items() if o is None][:count]
            for u in free:
                self._owner[node][u] = owner
            return free

    def release(self, node: str, owner: str) -> None:
        with self._lock:
            for u, o in self._owner[node].items():
                if o == owner:
                    self._owner[node][u] = None
