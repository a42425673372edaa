"""Engine side of the memory backends: turn slab handles into read-only tensors, then
every weight into a view on its slab. Nothing here reads or copies weight bytes.

One importer per backend; the GPU backends add theirs beside `cpu`.
"""

import fcntl
import mmap
import os
import warnings

from . import wire_pb2 as wire
from .dtypes import DTYPES, torch_dtype
from .errors import ProtocolError

# The daemon seals its memfds; without SHRINK sealed, a shrinking owner could turn
# our reads into SIGBUS, so an unsealed fd is refused.
_REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE


def map_cpu_slab(fd: int, size: int):
    """Map a sealed memfd read-only as a uint8 tensor. The mapping outlives the fd."""
    import torch

    actual = os.fstat(fd).st_size
    if actual < size:
        raise ProtocolError(f"slab fd holds {actual} bytes but the layout says {size}")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & _REQUIRED_SEALS != _REQUIRED_SEALS:
        raise ProtocolError(f"slab fd is not sealed against writes and shrinking (seals={seals:#x})")
    region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: that is the point.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(region, dtype=torch.uint8)


IMPORTERS = {"cpu": map_cpu_slab}


def map_slabs(backend: str, layout: "wire.Layout", fds: list[int]) -> list:
    if backend not in IMPORTERS:
        raise ProtocolError(f"daemon serves backend {backend!r}; this client can map {sorted(IMPORTERS)}")
    if len(fds) != len(layout.slabs):
        raise ProtocolError(f"daemon sent {len(fds)} slab handles for {len(layout.slabs)} slabs")
    return [IMPORTERS[backend](fd, slab.size) for fd, slab in zip(fds, layout.slabs)]


def build_views(layout: "wire.Layout", slabs: list) -> dict:
    """Every tensor of the layout as a view on its slab, checked to stay inside it."""
    tensors = {}
    for tv in layout.tensors:
        if tv.dtype not in DTYPES or tv.slab >= len(slabs):
            raise ProtocolError(f"tensor {tv.name!r}: unknown dtype {tv.dtype!r} or slab {tv.slab}")
        itemsize = DTYPES[tv.dtype].itemsize
        slab = slabs[tv.slab]
        if tv.offset + tv.nbytes > slab.numel() or tv.nbytes % itemsize or tv.offset % itemsize:
            raise ProtocolError(f"tensor {tv.name!r}: bytes {tv.offset}+{tv.nbytes} do not fit slab {tv.slab}")
        shape, strides = tuple(tv.shape), tuple(tv.strides)
        if len(shape) != len(strides) or any(d < 0 for d in shape) or any(s < 0 for s in strides):
            raise ProtocolError(f"tensor {tv.name!r}: bad shape {shape} or strides {strides}")
        extent = 0 if 0 in shape else 1 + sum((d - 1) * s for d, s in zip(shape, strides))
        if extent * itemsize > tv.nbytes:
            raise ProtocolError(f"tensor {tv.name!r}: shape {shape} strides {strides} reach past its bytes")
        flat = slab.narrow(0, tv.offset, tv.nbytes).view(torch_dtype(tv.dtype))
        tensors[tv.name] = flat.as_strided(shape, strides)
    return tensors
