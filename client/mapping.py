"""Engine side of the memory backends: turn slab handles into read-only tensors, then
every weight into a view on its slab. Nothing here reads or copies weight bytes.

One importer per backend; the GPU backends add theirs beside `cpu`.
"""

import fcntl
import gc
import mmap
import os
import warnings

from . import wire_pb2 as wire
from .dtypes import DTYPES, torch_dtype
from .errors import ProtocolError

# The daemon seals its memfds; without SHRINK sealed, a shrinking owner could turn
# our reads into SIGBUS, so an unsealed fd is refused.
_REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE


def map_cpu_slab(slab: "wire.Slab", fd: int, device: str):
    """Map a sealed memfd read-only as a uint8 tensor. The mapping outlives the fd."""
    import torch

    actual = os.fstat(fd).st_size
    if actual < slab.size:
        raise ProtocolError(f"slab fd holds {actual} bytes but the layout says {slab.size}")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & _REQUIRED_SEALS != _REQUIRED_SEALS:
        raise ProtocolError(f"slab fd is not sealed against writes and shrinking (seals={seals:#x})")
    region = mmap.mmap(fd, slab.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: that is the point.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(region, dtype=torch.uint8)


def map_cpu_slabs(slabs, fds, device):
    return [map_cpu_slab(slab, fd, device) for slab, fd in zip(slabs, fds)]


def map_cuda_vmm_slabs(slabs, fds, device):
    from .gpu import import_slabs

    return import_slabs(fds, [slab.size for slab in slabs], device)


def map_cuda_ipc_slabs(slabs, fds, device):
    from .gpu import import_ipc_slab

    return [import_ipc_slab(slab.ipc_handle, slab.size, device) for slab in slabs]


# backend -> (importer of all slabs, whether each slab comes with an fd)
IMPORTERS = {"cpu": (map_cpu_slabs, True), "cuda-vmm": (map_cuda_vmm_slabs, True),
             "cuda-ipc": (map_cuda_ipc_slabs, False)}


def map_slabs(backend: str, layout: "wire.Layout", fds: list[int], device: str = "cpu") -> list:
    if backend not in IMPORTERS:
        raise ProtocolError(f"daemon serves backend {backend!r}; this client can map {sorted(IMPORTERS)}")
    importer, with_fds = IMPORTERS[backend]
    expected = len(layout.slabs) if with_fds else 0
    if len(fds) != expected:
        raise ProtocolError(f"daemon sent {len(fds)} fds for {len(layout.slabs)} {backend} slabs; expected {expected}")
    return importer(layout.slabs, fds, device)


def contiguous_strides(shape) -> tuple[int, ...]:
    """Row-major strides, in elements, of a tensor of SHAPE."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def span(shape, strides) -> int:
    """Elements from a tensor's first to one past its last, for these (non-negative) strides."""
    if any(d == 0 for d in shape):
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(shape, strides))


def build_views(layout: "wire.Layout", slabs: list) -> dict:
    """Every tensor of the layout as a view on its slab (see _build_views).

    Thousands of new objects would run the cycle collector over the engine's whole
    heap (torch's included) several times; none of them can form a cycle.
    """
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _build_views(layout, slabs)
    finally:
        if collecting:
            gc.enable()


def _build_views(layout: "wire.Layout", slabs: list) -> dict:
    """Every tensor of the layout as a view on its slab, checked to stay inside it.

    This is the whole per-tensor cost of attaching, so the per-tensor work is only to
    sort tensors into groups of one slab, dtype, shape, strides and size; each group is
    checked once (its extent) and by its extreme offsets. Tensors of a group that repeat
    at a fixed distance (a transformer's layers) become ONE strided tensor unbound into
    views in C++; the rest get one as_strided each.
    """
    t = layout.tensors
    names, dtypes, slab_of, offsets, nbytes, ndims = (list(t.name), list(t.dtype), list(t.slab), list(t.offset),
                                                      list(t.nbytes), list(t.ndim))
    shapes, strides = list(t.shape), list(t.strides)
    count = len(names)
    if any(len(column) != count for column in (dtypes, slab_of, offsets, nbytes, ndims)) \
            or len(shapes) != sum(ndims) or len(strides) != len(shapes):
        raise ProtocolError("the layout's tensor table has columns of different lengths")
    groups: dict[tuple, list] = {}  # (slab, dtype, shape, strides, nbytes) -> [(byte offset, name)]
    pos = 0
    for i in range(count):
        end = pos + ndims[i]
        key = (slab_of[i], dtypes[i], tuple(shapes[pos:end]), tuple(strides[pos:end]), nbytes[i])
        pos = end
        groups.setdefault(key, []).append((offsets[i], names[i]))
    sizes = [slab.numel() for slab in slabs]
    for key, members in groups.items():
        _check_group(key, members, sizes)
    tensors, typed = {}, {}
    _views_by_group(groups, slabs, sizes, typed, tensors)
    if len(tensors) != count:
        raise ProtocolError(f"the layout names {count - len(tensors)} tensor(s) more than once")
    return tensors


def _check_group(key: tuple, members: list, sizes: list) -> None:
    """Every tensor of one group lies inside its slab, aligned, within its own bytes."""
    index, dtype_name, shape, stride, size = key
    dtype = DTYPES.get(dtype_name)
    if dtype is None or index >= len(sizes):
        raise ProtocolError(f"tensor {members[0][1]!r}: unknown dtype {dtype_name!r} or slab {index}")
    itemsize = dtype.itemsize
    extent = -1 if any(d < 0 for d in shape) or any(s < 0 for s in stride) else span(shape, stride)
    if extent < 0 or extent * itemsize > size or size % itemsize:
        raise ProtocolError(f"tensor {members[0][1]!r}: shape {list(shape)} strides {list(stride)} do not fit its "
                            f"{size} bytes")
    last = max(offset for offset, _ in members)
    if last + size > sizes[index] or any(offset % itemsize for offset, _ in members):
        offset, name = next((o, n) for o, n in members if o + size > sizes[index] or o % itemsize)
        raise ProtocolError(f"tensor {name!r}: bytes {offset}+{size} do not fit slab {index}")


def _views_by_group(groups: dict, slabs: list, sizes: list, typed: dict, tensors: dict) -> None:
    for (index, dtype_name, shape, stride, _), members in groups.items():
        itemsize = DTYPES[dtype_name].itemsize
        if (index, dtype_name) not in typed:
            whole = sizes[index] - sizes[index] % itemsize
            base = slabs[index].narrow(0, 0, whole).view(torch_dtype(dtype_name))
            # as_strided counts from the start of the storage, and a slab may be a view
            # into a larger mapping (cuda-vmm maps every slab in one range).
            typed[(index, dtype_name)] = (base, base.storage_offset())
        base, start = typed[(index, dtype_name)]
        for first, step, run in evenly_spaced_runs(sorted(members)):
            first, step = first // itemsize, step // itemsize
            if len(run) == 1:
                tensors[run[0]] = base.as_strided(shape, stride, start + first)
            else:
                stacked = base.as_strided((len(run), *shape), (step, *stride), start + first)
                tensors.update(zip(run, stacked.unbind(0)))


def evenly_spaced_runs(members: list[tuple[int, str]]):
    """Split (offset, name) pairs sorted by offset into runs at one fixed, positive
    distance; yields (first offset, distance, names)."""
    i = 0
    while i < len(members):
        j = i + 1
        step = members[j][0] - members[i][0] if j < len(members) else 0
        while step > 0 and j < len(members) and members[j][0] - members[j - 1][0] == step:
            j += 1
        yield members[i][0], step, [name for _, name in members[i:j]]
        i = j
