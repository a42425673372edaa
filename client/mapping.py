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


def map_cpu_slab(fd: int, size: int, device: str = "cpu"):
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


def map_cuda_vmm_slab(fd: int, size: int, device: str):
    from .cuda_vmm import import_slab

    return import_slab(fd, size, device)


IMPORTERS = {"cpu": map_cpu_slab, "cuda-vmm": map_cuda_vmm_slab}


def map_slabs(backend: str, layout: "wire.Layout", fds: list[int], device: str = "cpu") -> list:
    if backend not in IMPORTERS:
        raise ProtocolError(f"daemon serves backend {backend!r}; this client can map {sorted(IMPORTERS)}")
    if len(fds) != len(layout.slabs):
        raise ProtocolError(f"daemon sent {len(fds)} slab handles for {len(layout.slabs)} slabs")
    return [IMPORTERS[backend](fd, slab.size, device) for fd, slab in zip(fds, layout.slabs)]


def build_views(layout: "wire.Layout", slabs: list) -> dict:
    """Every tensor of the layout as a view on its slab, checked to stay inside it.

    One as_strided per tensor on a per-(slab, dtype) typed view of the slab: this loop
    is the whole per-tensor cost of attaching, so it does nothing else.
    """
    tensors = {}
    typed = {}
    sizes = [slab.numel() for slab in slabs]
    for tv in layout.tensors:
        name, dtype_name, index, offset, nbytes = tv.name, tv.dtype, tv.slab, tv.offset, tv.nbytes
        dtype = DTYPES.get(dtype_name)
        if dtype is None or index >= len(slabs):
            raise ProtocolError(f"tensor {name!r}: unknown dtype {dtype_name!r} or slab {index}")
        itemsize = dtype.itemsize
        if offset + nbytes > sizes[index] or nbytes % itemsize or offset % itemsize:
            raise ProtocolError(f"tensor {name!r}: bytes {offset}+{nbytes} do not fit slab {index}")
        shape, strides = tuple(tv.shape), tuple(tv.strides)
        extent = 1
        for d, s in zip(shape, strides):
            if d < 0 or s < 0:
                extent = -1
                break
            extent = 0 if d == 0 or extent == 0 else extent + (d - 1) * s
        if len(shape) != len(strides) or extent < 0 or extent * itemsize > nbytes:
            raise ProtocolError(f"tensor {name!r}: shape {shape} strides {strides} do not fit its {nbytes} bytes")
        base = typed.get((index, dtype_name))
        if base is None:
            whole = sizes[index] - sizes[index] % itemsize
            base = typed[(index, dtype_name)] = slabs[index].narrow(0, 0, whole).view(torch_dtype(dtype_name))
        tensors[name] = base.as_strided(shape, strides, offset // itemsize)
    return tensors
