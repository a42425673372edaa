"""Memory backends by wire name. The GPU backends register here beside `cpu`."""

from .base import Backend, Slab
from .cpu import CpuBackend

BACKENDS = {"cpu": CpuBackend}


def make_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not available here; choose one of {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]()


__all__ = ["BACKENDS", "Backend", "Slab", "make_backend"]
