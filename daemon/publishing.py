"""The daemon's half of publishing: check what a writer declares, plan its slabs.

Pure functions: the server (server.py) does the I/O. A writer is trusted with the
bytes it writes (that is what the publish permission grants) but not with the daemon:
every field it sends is bounded and checked here before anything is allocated, and
no refusal echoes bytes it refused.
"""

from dataclasses import dataclass

from weightcache.client import wire_pb2 as wire
from weightcache.client.dtypes import DTYPES
from weightcache.client.fingerprint import Device
from weightcache.client.mapping import span
from weightcache.client.protocol import LAYOUT_VERSION

from .layout import SlabPlan, plan_slabs

MAX_TENSORS = 1_000_000
MAX_NAME_BYTES = 1024
MAX_NDIM = 16


class PublicationRefused(Exception):
    """What a writer declared cannot be published; the message names the problem."""


@dataclass(frozen=True)
class DeclaredTensor:
    """A tensor a writer will fill, as plan_slabs places it (declaration order)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    nbytes: int
    offset: int  # its index in the declaration: plan_slabs keeps that order
    path: str = ""


def check_fingerprint(fingerprint: "wire.Fingerprint", device: Device) -> None:
    """A publication names its engine, speaks this layout version, and was made for the
    device it will live on."""
    if not fingerprint.engine:
        raise PublicationRefused("the fingerprint names no engine: a published cache must say which engine's layout "
                                 "it holds (Fingerprint.engine), so that it can never pass for the checkpoint's layout")
    if fingerprint.layout_version != LAYOUT_VERSION:
        raise PublicationRefused(f"layout version {fingerprint.layout_version}; this daemon lays out version "
                                 f"{LAYOUT_VERSION}")
    for name, ours in (("device_kind", device.kind), ("compute_capability", device.compute_capability),
                       ("driver_version", device.driver_version)):
        if getattr(fingerprint, name) != ours:
            raise PublicationRefused(f"the fingerprint's {name} is {getattr(fingerprint, name)!r}, but this daemon's "
                                     f"device has {ours!r}")


def declared_tensors(table: "wire.TensorTable") -> list[DeclaredTensor]:
    """The writer's tensor table, checked: consistent columns, unique printable names,
    known dtypes, non-negative shapes and strides; nbytes is what the strides span."""
    names, dtypes, ndims = list(table.name), list(table.dtype), list(table.ndim)
    shapes, strides = list(table.shape), list(table.strides)
    count = len(names)
    if not count:
        raise PublicationRefused("the publication declares no tensors")
    if count > MAX_TENSORS:
        raise PublicationRefused(f"the publication declares {count} tensors; at most {MAX_TENSORS} are allowed")
    if len(dtypes) != count or len(ndims) != count or len(shapes) != sum(ndims) or len(strides) != len(shapes):
        raise PublicationRefused("the tensor table's columns have different lengths (name, dtype, ndim, shape, "
                                 "strides must describe the same tensors)")
    out, seen, pos = [], set(), 0
    for i in range(count):
        name = names[i]
        size = len(name.encode())
        if not 0 < size <= MAX_NAME_BYTES or not name.isprintable():
            raise PublicationRefused(f"tensor #{i}'s name ({size} bytes) is not allowed: 1-{MAX_NAME_BYTES} bytes of "
                                     "printable characters")
        if name in seen:
            raise PublicationRefused(f"tensor {name!r} is declared more than once")
        seen.add(name)
        dtype = DTYPES.get(dtypes[i])
        if dtype is None:
            raise PublicationRefused(f"tensor {name!r}: dtype #{i} is not one of {', '.join(DTYPES)}")
        if ndims[i] > MAX_NDIM:
            raise PublicationRefused(f"tensor {name!r} has {ndims[i]} dimensions; at most {MAX_NDIM}")
        shape, stride = tuple(shapes[pos:pos + ndims[i]]), tuple(strides[pos:pos + ndims[i]])
        pos += ndims[i]
        if any(d < 0 for d in shape) or any(s < 0 for s in stride):
            raise PublicationRefused(f"tensor {name!r}: shape {list(shape)} and strides {list(stride)} must not be "
                                     "negative")
        out.append(DeclaredTensor(name, dtypes[i], shape, stride, span(shape, stride) * dtype.itemsize, i))
    return out


def plan_publication(request: "wire.PublishRequest", device: Device, max_slab_bytes: int) -> SlabPlan:
    check_fingerprint(request.fingerprint, device)
    try:
        return plan_slabs(declared_tensors(request.tensors), max_slab_bytes=max_slab_bytes)
    except ValueError as exc:  # more slabs than one message carries
        raise PublicationRefused(str(exc)) from None
