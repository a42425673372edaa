"""Plan where each tensor lives: a few large slabs, each tensor at an aligned offset.

Pure: takes tensor sources, returns a plan; the backend allocates it, the loader
fills it, and to_wire() is what engines receive.
"""

from dataclasses import dataclass

from weightcache.client import wire_pb2 as wire
from weightcache.client.mapping import contiguous_strides
from weightcache.client.protocol import LAYOUT_VERSION, MAX_FDS_PER_FRAME

from .checkpoint import TensorSource

# 256 bytes: what cudaMalloc guarantees and what vectorized kernels assume.
DEFAULT_ALIGNMENT = 256
DEFAULT_MAX_SLAB_BYTES = 8 << 30


@dataclass(frozen=True)
class Placement:
    source: TensorSource
    slab: int
    offset: int


@dataclass(frozen=True)
class SlabPlan:
    alignment: int
    slab_sizes: tuple[int, ...]
    placements: tuple[Placement, ...]

    @property
    def nbytes(self) -> int:
        return sum(self.slab_sizes)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_slabs(tensors, *, alignment: int = DEFAULT_ALIGNMENT,
               max_slab_bytes: int = DEFAULT_MAX_SLAB_BYTES) -> SlabPlan:
    """Pack tensors in file order (so loading reads sequentially) into slabs of at most
    max_slab_bytes; a larger tensor gets a slab of its own."""
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment {alignment} must be a power of two")
    ordered = sorted(tensors, key=lambda t: (str(t.path), t.offset, t.name))
    sizes: list[int] = []
    placements = []
    cursor = None
    for t in ordered:
        need = _round_up(t.nbytes, alignment)
        if cursor is None or (cursor + need > max_slab_bytes and cursor > 0):
            sizes.append(0)
            cursor = 0
        placements.append(Placement(t, len(sizes) - 1, cursor))
        cursor += need
        sizes[-1] = cursor
    sizes = [max(s, alignment) for s in sizes] or [alignment]
    if len(sizes) > MAX_FDS_PER_FRAME:
        raise ValueError(f"the plan needs {len(sizes)} slabs; at most {MAX_FDS_PER_FRAME} fit one message. "
                         f"Raise the slab size (now {max_slab_bytes} bytes).")
    return SlabPlan(alignment, tuple(sizes), tuple(placements))


def to_wire(plan: SlabPlan, slabs=()) -> "wire.Layout":
    """The layout engines receive; with SLABS, each slab's size is the one its backend
    allocated (rounded up, e.g. to the VMM granularity: engines map it all) and its
    handle bytes are included (cuda-ipc)."""
    layout = wire.Layout(version=LAYOUT_VERSION, alignment=plan.alignment)
    for index, size in enumerate(plan.slab_sizes):
        layout.slabs.add(index=index, size=size)
    for entry, slab in zip(layout.slabs, slabs):
        entry.size = slab.size
        entry.ipc_handle = slab.handle_bytes
    table = layout.tensors
    for p in sorted(plan.placements, key=lambda p: p.source.name):
        table.name.append(p.source.name)
        table.dtype.append(p.source.dtype)
        table.slab.append(p.slab)
        table.offset.append(p.offset)
        table.nbytes.append(p.source.nbytes)
        table.ndim.append(len(p.source.shape))
        table.shape.extend(p.source.shape)
        # A checkpoint's tensors are contiguous; a published one's strides are the writer's.
        table.strides.extend(getattr(p.source, "strides", None) or contiguous_strides(p.source.shape))
    return layout
