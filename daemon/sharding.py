"""Tensor-parallel sharding of file regions: what a rank's slabs hold.

The plan (which dim of each tensor a rank holds) is weightcache.client.tp_plan, shared
with engines that load from disk. Pure: sources in, sharded sources out. A shard along
dim 0 is one contiguous file range; a shard along the last dim is `rows` equal pieces
`pitch` bytes apart, which the loader copies as a 2-D region.
"""

from dataclasses import replace

from weightcache.client.dtypes import DTYPES
from weightcache.client.errors import CheckpointError
from weightcache.client.tp_plan import TpPlan, shard_bounds, shard_dim

from .checkpoint import TensorSource


def shard_source(t: TensorSource, dim: int, tp_size: int, tp_rank: int) -> TensorSource:
    """This rank's slice of `t` along `dim` (0 or the last), as a file region."""
    start, stop = shard_bounds(t.name, t.shape, dim, tp_size, tp_rank)
    itemsize = DTYPES[t.dtype].itemsize
    shape = list(t.shape)
    shape[dim] = stop - start
    if dim == 0:
        part = t.nbytes // tp_size
        return replace(t, shape=tuple(shape), offset=t.offset + tp_rank * part, nbytes=part)
    row_bytes = t.shape[-1] * itemsize
    width = shape[-1] * itemsize
    rows = t.nbytes // row_bytes if row_bytes else 0
    return replace(t, shape=tuple(shape), offset=t.offset + start * itemsize, nbytes=rows * width, rows=rows,
                   pitch=row_bytes)


def shard(tensors, plan: TpPlan | None, tp_size: int, tp_rank: int) -> tuple[TensorSource, ...]:
    if tp_size == 1:
        return tuple(tensors)
    if plan is None:
        raise CheckpointError(f"tensor parallel size {tp_size} needs a plan: the model config has no "
                              "base_model_tp_plan; pass --tp-plan FILE (a JSON object of module pattern -> style)")
    out = []
    for t in tensors:
        dim = shard_dim(plan, t.name, len(t.shape))
        out.append(t if dim is None else shard_source(t, dim, tp_size, tp_rank))
    return tuple(out)
