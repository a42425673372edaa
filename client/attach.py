"""Attach to a daemon's resident weights: handshake, map the slabs, build the views."""

import os
import pathlib
import socket
import time
from dataclasses import dataclass, field

from . import fingerprint as fp
from . import wire_pb2 as wire
from .errors import CacheUnavailable, FingerprintMismatch, NotPublished, PeerRejected, ProtocolError, PublishFailed
from .mapping import build_views, map_slabs
from .protocol import MAX_RESPONSE_BYTES, PROTOCOL_VERSION, parse_socket_name, reachable, recv_message, send_message

Error = wire.Error


@dataclass
class AttachedWeights:
    """Read-only tensors that live in a daemon's slabs.

    Keep this object while the tensors are in use: its open connection is how the
    daemon counts this engine as attached. The tensors stay valid after close() and
    even after the daemon exits; the memory goes when the last mapping does.
    """

    tensors: dict
    fingerprint: "wire.Fingerprint"
    cache_name: str
    backend: str
    device: str
    socket_path: str
    resident_bytes: int
    attach_ms: float
    phases_ms: dict  # where attach_ms went: fingerprint, handshake, map, views
    _sock: socket.socket = field(repr=False)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def list_sockets(socket_dir, cache_name: str | None = None, device: str | None = None) -> list[pathlib.Path]:
    """Socket files under socket_dir, optionally only those of one cache and device."""
    try:
        entries = sorted(os.listdir(socket_dir))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        parsed = parse_socket_name(entry)
        if parsed is None:
            continue
        name, dev, _ = parsed
        if (cache_name is None or name == cache_name) and (device is None or dev == device):
            found.append(pathlib.Path(socket_dir) / entry)
    return found


def connect(path: pathlib.Path, timeout: float) -> socket.socket:
    """A stream connection to a daemon's socket (paths over 107 bytes too)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        with reachable(path) as name:
            sock.connect(name)
    except BaseException:
        sock.close()
        raise
    return sock


def request(path: pathlib.Path, req: "wire.Request", timeout: float, accept_fds: bool = False):
    """Send one request and read the response; returns (socket, response, fds).

    Error responses are raised as the matching exception; the socket is closed then.
    """
    sock = connect(path, timeout)
    try:
        send_message(sock, req)
        response, fds = recv_message(sock, wire.Response, max_bytes=MAX_RESPONSE_BYTES,
                                     timeout=timeout, accept_fds=accept_fds)
    except BaseException:
        sock.close()
        raise
    if response.WhichOneof("kind") == "error":
        sock.close()
        for fd in fds:
            os.close(fd)
        err = response.error
        if err.code == Error.FINGERPRINT_MISMATCH:
            raise FingerprintMismatch(str(path), [(m.field, m.expected, m.actual) for m in err.mismatches])
        if err.code == Error.NOT_PUBLISHED:
            raise NotPublished(f"{path}: {err.message}")
        if err.code in (Error.OVER_BUDGET, Error.PUBLISH_FAILED):
            raise PublishFailed(f"{path}: daemon refused: {Error.Code.Name(err.code)}: {err.message}")
        raise PeerRejected(f"{path}: daemon refused: {Error.Code.Name(err.code)}: {err.message}")
    return sock, response, fds


def attach(model_dir=None, *, socket_dir, cache_name: str | None = None, device: str = "cpu",
           revision: str = "", parallel: fp.Parallelism = fp.Parallelism(),
           expected: "wire.Fingerprint | None" = None, client_name: str = "",
           timeout: float = 10.0) -> AttachedWeights:
    """Attach to the daemon serving this model on this device.

    The expected fingerprint is computed from model_dir (config.json and headers only)
    unless given. Every socket of the cache and device is tried, the one named for
    this fingerprint first. Raises FingerprintMismatch (naming each differing field)
    or CacheUnavailable (saying what each socket answered).
    """
    import torch  # noqa: F401  (engines have it loaded already; keep its import out of attach_ms)

    start = time.perf_counter()
    if expected is None:
        if model_dir is None:
            raise ValueError("attach needs model_dir or an expected fingerprint")
        if device == "cpu":
            described = fp.Device(kind="cpu")
        else:
            from .gpu import fingerprint_device

            described = fingerprint_device(device)
        expected = fp.compute(model_dir, revision=revision, parallel=parallel, device=described)
    phases = {"fingerprint": (time.perf_counter() - start) * 1e3}
    short = fp.digest(expected)[:12]
    candidates = sorted(list_sockets(socket_dir, cache_name, device),
                        key=lambda p: parse_socket_name(p.name)[2] != short)
    if not candidates:
        raise CacheUnavailable(
            f"no weightcache daemon socket for cache {cache_name or '(any)'} on device {device} in {socket_dir}"
        )
    req = wire.Request(protocol_version=PROTOCOL_VERSION, client_name=client_name or f"pid-{os.getpid()}")
    req.attach.expected.CopyFrom(expected)
    attempts, refusals = [], []
    for path in candidates:
        try:
            sock, response, fds = request(path, req, timeout, accept_fds=True)
        except (FingerprintMismatch, PeerRejected, NotPublished) as exc:
            refusals.append(exc)
            attempts.append(str(exc))
            continue
        except (ConnectionRefusedError, FileNotFoundError):
            attempts.append(f"{path}: no daemon listening (a stale socket file)")
            continue
        except (ProtocolError, TimeoutError, EOFError, OSError) as exc:
            attempts.append(f"{path}: {exc}")
            continue
        phases["handshake"] = (time.perf_counter() - start) * 1e3 - sum(phases.values())
        try:
            return finish_attach(sock, response, fds, path, start, phases)
        except BaseException:
            sock.close()
            raise
    if refusals:
        # A daemon that answered and refused says more than a dead socket: raise its
        # reason (a fingerprint mismatch first, then an empty store), with every attempt attached.
        refusal = next((r for r in refusals if isinstance(r, FingerprintMismatch)),
                       next((r for r in refusals if isinstance(r, NotPublished)), refusals[0]))
        refusal.attempts = attempts
        raise refusal
    raise CacheUnavailable(f"no daemon could serve cache {cache_name or '(any)'} on {device}", attempts)


def finish_attach(sock, response, fds, path, start, phases) -> AttachedWeights:
    """Map an Attached response's slabs read-only and build its views; the socket stays
    open as the attachment."""
    if response.WhichOneof("kind") != "attached":
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"{path}: expected an Attached response, got {response.WhichOneof('kind')}")
    att = response.attached
    try:
        slabs = map_slabs(att.backend, att.layout, fds, att.device)
    finally:
        for fd in fds:
            os.close(fd)
    phases["map"] = (time.perf_counter() - start) * 1e3 - sum(phases.values())
    tensors = build_views(att.layout, slabs)
    phases["views"] = (time.perf_counter() - start) * 1e3 - sum(phases.values())
    sock.settimeout(None)
    return AttachedWeights(
        tensors=tensors, fingerprint=att.fingerprint, cache_name=att.cache_name, backend=att.backend,
        device=att.device, socket_path=str(path), resident_bytes=att.resident_bytes,
        attach_ms=(time.perf_counter() - start) * 1000, phases_ms=phases, _sock=sock,
    )


def query_status(path: pathlib.Path, timeout: float = 5.0) -> "wire.Status":
    req = wire.Request(protocol_version=PROTOCOL_VERSION, client_name=f"status-pid-{os.getpid()}")
    req.status.SetInParent()
    sock, response, _ = request(path, req, timeout)
    sock.close()
    if response.WhichOneof("kind") != "status":
        raise ProtocolError(f"{path}: expected a Status response, got {response.WhichOneof('kind')}")
    return response.status
