"""The daemon's Unix socket: check the peer, answer one request, count attached engines.

One thread per connection. An attached engine keeps its connection open; its EOF (exit,
crash, SIGKILL) is how the daemon learns it left, whatever PID namespace it runs in.
A writer's connection carries its publication: Writable, the fill, the commit, and then
the attachment to what it published (docs/protocol.md, "Publishing"). Every failure is
answered on that connection alone: the daemon keeps serving others and nothing
resident changes.
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
from weightcache.client.protocol import (MAX_PUBLISH_REQUEST_BYTES, MAX_REQUEST_BYTES, PROTOCOL_VERSION, error_response,
                                         recv_message, send_message)

from .backends.base import SealRefused
from .catalog import Catalog, Entry, OverBudget, close_slabs
from .layout import DEFAULT_MAX_SLAB_BYTES, to_wire
from .publishing import PublicationRefused, plan_publication

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


NOBODY = AccessPolicy(frozenset())


@dataclass(frozen=True)
class Publishing:
    """What a store daemon lets writers do: who, on which backend, how long a fill may take."""

    writers: AccessPolicy
    backend: "object"  # backends.Backend: allocates the writers' slabs
    commit_timeout: float = 600.0
    max_slab_bytes: int = DEFAULT_MAX_SLAB_BYTES


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

    def __init__(self, path: str, catalog: Catalog, access: AccessPolicy, *, identity: "ResidentCache",
                 publishing: Publishing | None = None, handshake_timeout: float = 5.0, max_connections: int = 1024):
        """CATALOG holds what is served; IDENTITY names the cache, backend and device (a
        store's has no fingerprint); PUBLISHING is set for a store daemon."""
        self.catalog = catalog
        self.identity = identity
        self.access = access
        self.publishing = publishing
        self.writers = publishing.writers if publishing else NOBODY
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
        c = self.identity
        entries = self.catalog.entries()
        status = wire.Status(
            cache_name=c.name, backend=c.backend, device=c.device, uptime_s=time.monotonic() - c.started,
            pid=os.getpid(), model_path=c.model_path, load_s=c.load_s, store=self.catalog.store,
            budget_bytes=self.catalog.budget_bytes or 0, attached_clients=self.attached_clients,
            resident_bytes=sum(e.cache.resident_bytes for e in entries),
        )
        if not self.catalog.store:  # the loaded cache, as a daemon of one model always said
            status.fingerprint.CopyFrom(c.fingerprint)
            status.fingerprint_digest = fp.digest(c.fingerprint)
            status.tensors = len(c.layout.tensors.name)
        now = time.monotonic()
        for e in entries:
            status.caches.add(fingerprint=e.cache.fingerprint, fingerprint_digest=e.digest,
                              tensors=len(e.cache.layout.tensors.name), resident_bytes=e.cache.resident_bytes,
                              attached_clients=e.attached, age_s=now - e.committed_at,
                              publisher_uid=e.publisher_uid if e.publisher_uid is not None else 0)
        return status


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
        reader = self.server.access.allows(uid, gid, groups)
        self.writer = self.server.writers.allows(uid, gid, groups)
        if not (reader or self.writer):
            self._refuse_unread(Error.PERMISSION_DENIED,
                                f"peer uid {uid} gid {gid} groups {list(groups)} is not allowed by this daemon "
                                f"({self.server.access.describe()}); run the engine as an allowed user or start "
                                "the daemon with --allow-uid/--allow-gid")
            return
        # A publication declares every tensor; only a peer allowed to publish may send one that large.
        limit = MAX_PUBLISH_REQUEST_BYTES if self.writer else MAX_REQUEST_BYTES
        try:
            req, _ = recv_message(sock, wire.Request, max_bytes=limit, timeout=self.server.handshake_timeout)
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
        elif kind == "publish":
            self._publish(req)
        elif kind == "commit":
            self._refuse(Error.BAD_REQUEST, "a commit must follow a publish request on the same connection")
        else:
            self._refuse(Error.BAD_REQUEST, "the request names no action (attach, status, handoff or publish)")

    @staticmethod
    def _attached(cache: ResidentCache) -> "wire.Response":
        response = wire.Response(protocol_version=PROTOCOL_VERSION)
        att = response.attached
        att.cache_name, att.backend, att.device = cache.name, cache.backend, cache.device
        att.fingerprint.CopyFrom(cache.fingerprint)
        att.layout.CopyFrom(cache.layout)
        att.resident_bytes = cache.resident_bytes
        return response

    def _attach(self, req):
        entry, mismatches = self.server.catalog.find(req.attach.expected)
        if entry is None and mismatches:
            self._refuse(Error.FINGERPRINT_MISMATCH,
                         "fingerprint mismatch: " + ", ".join(m[0] for m in mismatches), mismatches)
            return
        if entry is None:
            self._refuse(Error.NOT_PUBLISHED, f"store {self.server.identity.name} on {self.server.identity.device} "
                                              "holds no published cache yet: an engine publishes one on its first "
                                              "start")
            return
        self._serve_attached(entry, req)

    def _serve_attached(self, entry: Entry, req):
        """Send ENTRY's layout and handles, and count the peer as attached until it goes."""
        if not self.server.catalog.attach(entry):
            self._refuse(Error.NOT_PUBLISHED, "the cache was evicted while attaching; retry")
            return
        try:
            if not self._send(self._attached(entry.cache), entry.cache.slab_fds):
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
        finally:
            self.server.catalog.detach(entry)

    def _publish(self, req):
        """A writer's publication: reserve, hand out writable slabs, wait for the commit,
        seal, serve. Anything short of a good commit frees the slabs."""
        publishing = self.server.publishing
        if publishing is None:
            self._refuse(Error.BAD_REQUEST, "this daemon serves the model it loaded; engines publish into a store "
                                            "daemon (`weightcache daemon` without --model)")
            return
        if not self.writer:
            self._refuse(Error.PERMISSION_DENIED, f"peer uid {self.peer['uid']} gid {self.peer['gid']} may attach but "
                                                  f"not publish (writers: {publishing.writers.describe()}; "
                                                  "--allow-publish-uid/--allow-publish-gid)")
            return
        backend = publishing.backend
        try:
            plan = plan_publication(req.publish, backend.fingerprint_device(), publishing.max_slab_bytes)
        except PublicationRefused as exc:
            self._refuse(Error.BAD_REQUEST, f"publication refused: {exc}")
            return
        digest = fp.digest(req.publish.fingerprint)
        try:
            got = self.server.catalog.reserve(digest, plan.nbytes, wait_s=publishing.commit_timeout)
        except OverBudget as exc:
            self._refuse(Error.OVER_BUDGET, str(exc))
            return
        except TimeoutError as exc:
            self._refuse(Error.BUSY, str(exc))
            return
        if isinstance(got, Entry):  # published already (maybe by a writer we waited for): attach to it
            log.info("already published; attaching the writer", extra={"fields": {**self.peer,
                                                                                  "fingerprint": digest[:12]}})
            self._serve_attached(got, req)
            return
        entry = self._fill(req, plan, got, backend, publishing.commit_timeout)
        if entry is not None:
            self._serve_attached(entry, req)

    def _fill(self, req, plan, reservation, backend, timeout: float) -> Entry | None:
        """Allocate, send Writable, wait for the commit and seal; None when the publication
        was dropped (the writer's side has been told why, if it is still there)."""
        identity, slabs, started = self.server.identity, [], time.monotonic()
        try:
            for i, size in enumerate(plan.slab_sizes):
                try:
                    slabs.append(backend.allocate(size, f"weightcache:{identity.name}:{reservation.digest[:12]}:{i}"))
                except Exception as exc:  # OSError (memfd, mmap), CudaError (out of device memory)
                    raise PublicationRefused(f"cannot allocate {size} bytes for slab {i}: {exc}") from None
            layout = to_wire(plan, slabs)
            response = wire.Response(protocol_version=PROTOCOL_VERSION)
            writable = response.writable
            writable.cache_name, writable.backend, writable.device = identity.name, backend.name, backend.device
            writable.layout.CopyFrom(layout)
            writable.commit_timeout_s = timeout
            fds = [s.export_fd() for s in slabs]
            if None in fds:
                raise PublicationRefused(f"the {backend.name} backend cannot hand out writable handles")
            if not self._send(response, fds):
                raise PublicationRefused("the writer left before its slabs were sent")
            log.info("publishing", extra={"fields": {**self.peer, "fingerprint": reservation.digest[:12],
                                                     "bytes": plan.nbytes, "tensors": len(layout.tensors.name)}})
            self._await_commit(timeout)
            for i, slab in enumerate(slabs):
                try:
                    slab.seal()
                except SealRefused as exc:
                    raise PublicationRefused(f"slab {i} cannot be sealed: {exc}") from None
            cache = ResidentCache(name=identity.name, backend=backend.name, device=backend.device,
                                  fingerprint=req.publish.fingerprint, layout=layout, slab_fds=fds,
                                  model_path="", load_s=time.monotonic() - started)
            entry = Entry(cache, slabs, publisher_uid=self.peer["uid"])
        except Exception as exc:
            close_slabs(slabs)
            self.server.catalog.drop(reservation)
            if not isinstance(exc, PublicationRefused):
                log.exception("publication failed", extra={"fields": self.peer})
                exc = f"the daemon failed ({type(exc).__name__}); see its log"
            self._refuse(Error.PUBLISH_FAILED, f"publication dropped: {exc}")
            return None
        self.server.catalog.commit(reservation, entry)
        log.info("published", extra={"fields": {**self.peer, "fingerprint": reservation.digest[:12],
                                                "engine": entry.cache.fingerprint.engine,
                                                "bytes": cache.resident_bytes, "fill_s": round(cache.load_s, 3)}})
        return entry

    def _await_commit(self, timeout: float) -> None:
        try:
            req, _ = recv_message(self.request, wire.Request, max_bytes=MAX_REQUEST_BYTES, timeout=timeout)
        except EOFError:
            raise PublicationRefused("the writer hung up before committing") from None
        except TimeoutError:
            raise PublicationRefused(f"no commit within {timeout:.0f}s") from None
        except (ProtocolError, OSError) as exc:
            raise PublicationRefused(f"instead of a commit: {exc}") from None
        if req.WhichOneof("kind") != "commit":
            raise PublicationRefused(f"expected a commit, got {req.WhichOneof('kind') or 'no action'}")

    def _handoff(self, req):
        """Give a successor daemon the slabs; stop once it has published and hung up."""
        cache = self.server.identity
        if self.peer["uid"] not in (os.geteuid(), 0):
            self._refuse(Error.PERMISSION_DENIED, f"only a daemon of uid {os.geteuid()} may take this cache over; "
                                                  f"peer uid {self.peer['uid']}")
            return
        if not cache.slab_fds:
            self._refuse(Error.BAD_REQUEST, f"the {cache.backend} backend's memory lives and dies with this process "
                                            "(legacy CUDA IPC handles): it cannot be handed over; load anew")
            return
        if self.server.catalog.store:
            self._refuse(Error.BAD_REQUEST, "a store daemon's publications cannot be handed over yet; start the new "
                                            "daemon beside it and let engines republish")
            return
        if not self._send(self._attached(cache), cache.slab_fds):
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
