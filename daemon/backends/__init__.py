"""Memory backends by wire name. The GPU backends register here beside `cpu`."""

from .base import Backend, Slab
from .cpu import CpuBackend

def _cuda_vmm(device: str) -> Backend:
    from .cuda_vmm import CudaVmmBackend  # imports the CUDA driver bindings: only when asked for

    return CudaVmmBackend(device)


def _cuda_ipc(device: str) -> Backend:
    from .cuda_ipc import CudaIpcBackend

    return CudaIpcBackend(device)


BACKENDS = {"cpu": lambda device: CpuBackend(), "cuda-vmm": _cuda_vmm, "cuda-ipc": _cuda_ipc}


def make_backend(name: str, device: str = "0") -> Backend:
    """The backend `name` on `device` (a GPU UUID or this process's ordinal; ignored by cpu)."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not available; choose one of {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name](device)


def canonical_devices(name: str, requested) -> list[str]:
    """The devices a daemon serves, by the names its sockets carry: `cpu` for the cpu
    backend, GPU UUIDs for the others (ordinals and "all" resolved in this process)."""
    if name == "cpu":
        return ["cpu"]
    from weightcache.client import gpu

    if list(requested) == ["all"]:
        return gpu.visible_uuids()
    uuids = [gpu.device_uuid(gpu.ordinal_for(device)) for device in requested]
    repeated = sorted({u for u in uuids if uuids.count(u) > 1})
    if repeated:
        raise ValueError(f"device(s) named more than once: {', '.join(repeated)}")
    return uuids


__all__ = ["BACKENDS", "Backend", "Slab", "canonical_devices", "make_backend"]
