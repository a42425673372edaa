"""The daemon's Unix socket: check the peer, answer one request, count attached engines.

One thread per connection. An attached engine keeps its connection open; its EOF (exit,
crash, SIGKILL) is how the daemon learns it left, whatever PID namespace it runs in.
Every failure is answered on that connection alone: the daemon keeps serving others
and nothing resident changes.
"""

import errno
import itertools
import logging
import os
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass, field

from weightcache.client import fingerprint as fp
from weightcache.client import wire_pb2 as wire
from weightcache.client.errors import ProtocolError
from weightcache.client.protocol import (MAX_REQUEST_BYTES, PROTOCOL_VERSION, error_response, recv_message,
                                         send_message)

log = logging.getLogger("weightcache.daemon")
Error = wire.Error
_PEERCRED = struct.Struct("3i")
# What a successor sends on the handoff connection once its socket is published.
HANDOFF_DONE = b"\x01"


@dataclass(frozen=True)
class AccessPolicy:
    """Which peers may talk to the daemon, by the kernel's word (SO_PEERCRED)."""

    uids: frozenset[int]
    gids: frozenset[int] = frozenset()

    def allows(self, uid: int, gid: int, groups: tuple[int, ...] = ()) -> bool:
        return uid in self.uids or gid in self.gids or not self.gids.isdisjoint(groups)

    def describe(self) -> str:
        return f"allowed uids {sorted(self.uids)}, gids {sorted(self.gids)}"


@dataclass
class ResidentCache:
    """What the daemon serves: sealed slabs and how to read them."""

    name: str
    backend: str
    device: str
    fingerprint: "wire.Fingerprint"
    layout: "wire.Layout"
    slab_fds: list[int]
    model_path: str
    load_s: float
    started: float = field(default_factory=time.monotonic)

    @property
    def resident_bytes(self) -> int:
        return sum(s.size for s in self.layout.slabs)


# Linux's SO_PEERGROUPS (4.13+): the peer's supplementary groups at connect time. Python
# does not name it. In Kubernetes a pod gets a group through supplementalGroups, which
# SO_PEERCRED's single gid does not show.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_MAX_GROUPS = 65536


def peer_groups(sock: socket.socket) -> tuple[int, ...]:
    """The peer's supplementary group ids, as the kernel recorded them."""
    size = 64
    while True:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * size)
        except OSError as exc:
            if exc.errno != errno.ERANGE or size >= _MAX_GROUPS:
                raise
            size *= 16
            continue
        return struct.unpack(f"{len(raw) // 4}I", raw)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel recorded it."""
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))


class CacheServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False
    # 64 engines starting at once must not find the backlog full.
    request_queue_size = 512

    def __init__(self, path: str, cache: ResidentCache, access: AccessPolicy, *,
                 handshake_timeout: float = 5.0, max_connections: int = 1024):
        self.cache = cache
        self.access = access
        self.handshake_timeout = handshake_timeout
        self.slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections
        self._clients: dict[int, dict] = {}
        self._clients_lock = threading.Lock()
        self._ids = itertools.count(1)
        # Set once a successor that took the slabs over has published its socket.
        self.handed_off = threading.Event()
        super().__init__(path, _Connection)

    @property
    def attached_clients(self) -> int:
        with self._clients_lock:
            return len(self._clients)

    def register(self, info: dict) -> int:
        with self._clients_lock:
            client_id = next(self._ids)
            self._clients[client_id] = info
            return client_id

    def unregister(self, client_id: int) -> None:
        with self._clients_lock:
            self._clients.pop(client_id, None)

    def status(self) -> "wire.Status":
        c = self.cache
        return wire.Status(
            cache_name=c.name, backend=c.backend, device=c.device, fingerprint=c.fingerprint,
            fingerprint_digest=fp.digest(c.fingerprint), tensors=len(c.layout.tensors.name),
            resident_bytes=c.resident_bytes, attached_clients=self.attached_clients,
            uptime_s=time.monotonic() - c.started, pid=os.getpid(), model_path=c.model_path, load_s=c.load_s,
        )


class _Connection(socketserver.BaseRequestHandler):
    server: CacheServer

    def handle(self):
        if not self.server.slots.acquire(blocking=False):
            self._refuse_unread(Error.BUSY, f"connection limit of {self.server.max_connections} reached; retry later")
            return
        try:
            self._serve()
        finally:
            self.server.slots.release()

    def _serve(self):
        sock = self.request
        pid, uid, gid = peer_credentials(sock)
        groups = peer_groups(sock)
        self.peer = {"pid": pid, "uid": uid, "gid": gid}
        if not self.server.access.allows(uid, gid, groups):
            self._refuse_unread(Error.PERMISSION_DENIED,
                                f"peer uid {uid} gid {gid} groups {list(groups)} is not allowed by this daemon "
                                f"({self.server.access.describe()}); run the engine as an allowed user or start "
                                "the daemon with --allow-uid/--allow-gid")
            return
        try:
            req, _ = recv_message(sock, wire.Request, max_bytes=MAX_REQUEST_BYTES, timeout=self.server.handshake_timeout)
        except EOFError:
            return  # a connect-and-close probe
        except TimeoutError:
            self._refuse(Error.BAD_REQUEST, f"no complete request within {self.server.handshake_timeout}s")
            return
        except (ProtocolError, OSError) as exc:
            self._refuse(Error.BAD_REQUEST, str(exc))
            return
        if req.protocol_version != PROTOCOL_VERSION:
            self._refuse(Error.UNSUPPORTED_PROTOCOL,
                         f"client speaks protocol {req.protocol_version}, this daemon speaks {PROTOCOL_VERSION}; "
                         "upgrade the older side")
            return
        kind = req.WhichOneof("kind")
        if kind == "status":
            self._send(wire.Response(protocol_version=PROTOCOL_VERSION, status=self.server.status()))
        elif kind == "attach":
            self._attach(req)
        elif kind == "handoff":
            self._handoff(req)
        else:
            self._refuse(Error.BAD_REQUEST, "the request names no action (attach, status or handoff)")

    def _attached(self) -> "wire.Response":
        cache = self.server.cache
        response = wire.Response(protocol_version=PROTOCOL_VERSION)
        att = response.attached
        att.cache_name, att.backend, att.device = cache.name, cache.backend, cache.device
        att.fingerprint.CopyFrom(cache.fingerprint)
        att.layout.CopyFrom(cache.layout)
        att.resident_bytes = cache.resident_bytes
        return response

    def _attach(self, req):
        cache = self.server.cache
        mismatches = fp.differences(req.attach.expected, cache.fingerprint)
        if mismatches:
            self._refuse(Error.FINGERPRINT_MISMATCH,
                         "fingerprint mismatch: " + ", ".join(m[0] for m in mismatches), mismatches)
            return
        if not self._send(self._attached(), cache.slab_fds):
            return
        client_id = self.server.register({**self.peer, "name": req.client_name})
        log.debug("engine attached", extra={"fields": {**self.peer, "client": req.client_name,
                                                       "attached": self.server.attached_clients}})
        try:
            self._hold()
        finally:
            self.server.unregister(client_id)
            log.debug("engine detached", extra={"fields": {**self.peer, "client": req.client_name,
                                                           "attached": self.server.attached_clients}})

    def _handoff(self, req):
        """Give a successor daemon the slabs; stop once it has published and hung up."""
        cache = self.server.cache
        if self.peer["uid"] not in (os.geteuid(), 0):
            self._refuse(Error.PERMISSION_DENIED, f"only a daemon of uid {os.geteuid()} may take this cache over; "
                                                  f"peer uid {self.peer['uid']}")
            return
        if not cache.slab_fds:
            self._refuse(Error.BAD_REQUEST, f"the {cache.backend} backend's memory lives and dies with this process "
                                            "(legacy CUDA IPC handles): it cannot be handed over; load anew")
            return
        if not self._send(self._attached(), cache.slab_fds):
            return
        log.info("handing over", extra={"fields": {**self.peer, "client": req.client_name}})
        sock = self.request
        sock.settimeout(None)
        try:
            published = sock.recv(1) == HANDOFF_DONE
        except OSError:
            published = False
        if published:
            self.server.handed_off.set()
        else:  # the successor died or gave up: nothing changes here
            log.warning("successor left without taking over; still serving", extra={"fields": self.peer})

    def _hold(self):
        """Block until the engine goes; anything it sends meanwhile is read and dropped."""
        sock = self.request
        sock.settimeout(None)
        try:
            while sock.recv(4096):
                pass
        except OSError:
            pass

    def _send(self, response, fds=()) -> bool:
        try:
            self.request.settimeout(self.server.handshake_timeout)
            send_message(self.request, response, fds)
            return True
        except OSError as exc:
            log.warning("could not answer peer", extra={"fields": {**getattr(self, "peer", {}), "error": str(exc)}})
            return False

    def _refuse_unread(self, code, message):
        """Refuse before reading the request. A peer that writes its request after our answer
        would get EPIPE from a closed socket and never read the reason: so end our side
        (the peer reads the answer, then EOF) and drop what it sends until it closes, within
        the handshake timeout and the size of one request."""
        self._refuse(code, message)
        sock = self.request
        deadline = time.monotonic() + self.server.handshake_timeout
        budget = 8 + MAX_REQUEST_BYTES
        try:
            sock.shutdown(socket.SHUT_WR)
            while budget > 0 and (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                data = sock.recv(min(budget, 65536))
                if not data:
                    break
                budget -= len(data)
        except OSError:
            pass

    def _refuse(self, code, message, mismatches=()):
        log.warning("refused", extra={"fields": {**getattr(self, "peer", {}), "code": Error.Code.Name(code),
                                                 "reason": message}})
        self._send(error_response(code, message, mismatches))
