"""The writer's side of publishing: an engine that loaded the model its own way hands its
tensors to a store daemon, which then serves them read-only to every later engine.

    attached, published = publish(tensors, expected, socket_dir=..., cache_name=..., device=...)

The daemon answers with writable slabs (cpu: memfds; cuda-vmm: VMM fds) and where each
tensor goes; this side copies every tensor in, unmaps the writable slabs, and commits;
the daemon seals them and answers as to any attach, so the writer ends up holding the
published copy read-only, like its readers. If the fingerprint is published already
(another writer won the race) the daemon answers with that copy and nothing is written.
docs/protocol.md, "Publishing", is the reader's version.
"""

import gc
import mmap
import os
import time

from . import wire_pb2 as wire
from .attach import AttachedWeights, finish_attach, list_sockets, request
from .dtypes import wire_name
from .errors import CacheUnavailable, ProtocolError, PublishFailed
from .mapping import build_views, contiguous_strides
from .protocol import MAX_RESPONSE_BYTES, PROTOCOL_VERSION, STORE_TAG, parse_socket_name, recv_message, send_message


def declare(tensors: dict) -> "wire.TensorTable":
    """The tensor table a writer sends: name, dtype, shape and contiguous strides (the
    published copy of every tensor is contiguous, whatever the engine's strides were)."""
    table = wire.TensorTable()
    for name, tensor in tensors.items():
        shape = tuple(tensor.shape)
        table.name.append(name)
        table.dtype.append(wire_name(tensor.dtype))
        table.ndim.append(len(shape))
        table.shape.extend(shape)
        table.strides.extend(contiguous_strides(shape))
    return table


def store_sockets(socket_dir, cache_name: str | None, device: str) -> list:
    return [p for p in list_sockets(socket_dir, cache_name, device) if parse_socket_name(p.name)[2] == STORE_TAG]


def publish(tensors: dict, expected: "wire.Fingerprint", *, socket_dir, cache_name: str | None = None,
            device: str = "cpu", timeout: float = 60.0, client_name: str = "") -> tuple[AttachedWeights, bool]:
    """Publish TENSORS under EXPECTED into the store serving this cache and device.

    Returns (the published copy, attached read-only; True if this call wrote it, False
    if it was published already). Raises CacheUnavailable when no store answers, and
    PublishFailed (permission, budget, refused layout, timeout) naming why.
    """
    start = time.perf_counter()
    req = wire.Request(protocol_version=PROTOCOL_VERSION, client_name=client_name or f"pid-{os.getpid()}")
    req.publish.fingerprint.CopyFrom(expected)
    req.publish.tensors.CopyFrom(declare(tensors))
    attempts = []
    for path in store_sockets(socket_dir, cache_name, device):
        try:
            sock, response, fds = request(path, req, timeout, accept_fds=True)
        except (ConnectionRefusedError, FileNotFoundError):
            attempts.append(f"{path}: no daemon listening (a stale socket file)")
            continue
        phases = {"handshake": (time.perf_counter() - start) * 1e3}
        try:
            if response.WhichOneof("kind") == "attached":
                return finish_attach(sock, response, fds, path, start, phases), False
            if response.WhichOneof("kind") != "writable":
                raise ProtocolError(f"{path}: expected Writable or Attached, got {response.WhichOneof('kind')}")
            try:
                fill(response.writable, fds, tensors)
            finally:
                for fd in fds:
                    os.close(fd)
            phases["fill"] = (time.perf_counter() - start) * 1e3 - sum(phases.values())
            return _commit(sock, path, timeout, start, phases), True
        except BaseException:
            sock.close()
            raise
    raise CacheUnavailable(f"no store daemon for cache {cache_name or '(any)'} on device {device} in {socket_dir} "
                           "(a store is `weightcache daemon` started without --model)", attempts)


def _commit(sock, path, timeout, start, phases) -> AttachedWeights:
    commit = wire.Request(protocol_version=PROTOCOL_VERSION)
    commit.commit.SetInParent()
    send_message(sock, commit)
    response, fds = recv_message(sock, wire.Response, max_bytes=MAX_RESPONSE_BYTES, timeout=timeout,
                                 accept_fds=True)
    if response.WhichOneof("kind") == "error":
        for fd in fds:
            os.close(fd)
        err = response.error
        raise PublishFailed(f"{path}: daemon refused the commit: {wire.Error.Code.Name(err.code)}: {err.message}")
    phases["commit"] = (time.perf_counter() - start) * 1e3 - sum(phases.values())
    return finish_attach(sock, response, fds, path, start, phases)


def fill(writable: "wire.Writable", fds: list[int], tensors: dict) -> None:
    """Copy every tensor into its place in the writable slabs, then unmap them: the
    daemon cannot seal a memfd that anybody still maps writable."""
    layout = writable.layout
    if len(fds) != len(layout.slabs):
        raise ProtocolError(f"daemon sent {len(fds)} fds for {len(layout.slabs)} writable slabs")
    if set(layout.tensors.name) != set(tensors):
        raise ProtocolError("the daemon's layout names other tensors than this writer declared")
    sizes = [slab.size for slab in layout.slabs]
    if writable.backend == "cpu":
        regions = [mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                   for fd, size in zip(fds, sizes)]
        _copy_into(layout, [_frombuffer(region) for region in regions], tensors)
        for region in regions:
            _unmap(region)
    elif writable.backend == "cuda-vmm":
        import torch

        from .gpu import import_mapping, split

        mapping = import_mapping(fds, sizes, writable.device, read_only=False)
        _copy_into(layout, split(mapping.tensor(), sizes), tensors)
        torch.cuda.synchronize(mapping.ordinal)
        mapping.close()
    else:
        raise ProtocolError(f"the daemon offers writable {writable.backend} slabs; this client fills cpu and cuda-vmm")


def _unmap(region) -> None:
    """Close a writable mapping. The views on it went with _copy_into's frame; a full
    collection (hundreds of ms with torch loaded) only if something still holds one."""
    try:
        region.close()
    except BufferError:
        gc.collect()
        try:
            region.close()
        except BufferError:
            raise PublishFailed("a view of a writable slab is still alive, so it cannot be unmapped and sealed; "
                                "drop every reference to the writable views before committing") from None


def _frombuffer(region):
    import torch

    return torch.frombuffer(region, dtype=torch.uint8)


def _copy_into(layout, slabs, tensors) -> None:
    views = build_views(layout, slabs)
    for name, view in views.items():
        view.copy_(tensors[name])
