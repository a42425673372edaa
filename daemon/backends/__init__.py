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


__all__ = ["BACKENDS", "Backend", "Slab", "make_backend"]
