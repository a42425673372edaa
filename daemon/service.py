"""A daemon's life: claim the cache, load it, publish the socket, serve until told to stop.

The socket file appears only once the slabs are sealed and the server listens (bound
under a temporary name, then renamed), so its existence never means "loading"; still,
clients treat only a successful handshake as ready.
"""

import fcntl
import logging
import os
import pathlib
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from weightcache.client import fingerprint as fp
from weightcache.client.errors import CheckpointError, UnsupportedQuantization
from weightcache.signals import stop_on_signal
from weightcache.client.spawn import EXIT_ALREADY_SERVED
from weightcache.client import wire_pb2 as wire
from weightcache.client.attach import list_sockets, request
from weightcache.client.protocol import PROTOCOL_VERSION, check_cache_name, reachable, socket_name

from .backends import canonical_devices, make_backend
from .checkpoint import read_checkpoint
from .health import DaemonState, serve_http
from .layout import DEFAULT_MAX_SLAB_BYTES, plan_slabs, to_wire
from .loader import fill_slabs
from .sharding import plan_for, shard
from .server import HANDOFF_DONE, AccessPolicy, CacheServer, ResidentCache

log = logging.getLogger("weightcache.daemon")


class AlreadyServed(Exception):
    """Another live daemon holds this cache's lock."""


@dataclass(frozen=True)
class DaemonConfig:
    model_dir: pathlib.Path
    socket_dir: pathlib.Path
    name: str
    backend: str = "cpu"
    # GPU UUIDs or ordinals for the GPU backends, or ("all",); one socket per device.
    devices: tuple[str, ...] = ("0",)
    revision: str = ""
    parallel: fp.Parallelism = fp.Parallelism()
    tp_plan: pathlib.Path | None = None  # default: the config's base_model_tp_plan
    allow_uids: frozenset[int] = field(default_factory=lambda: frozenset({os.geteuid()}))
    allow_gids: frozenset[int] = frozenset()
    socket_group: int | None = None  # shares the directory (0750) and sockets (0660) with this group
    handshake_timeout: float = 5.0
    max_connections: int = 1024
    max_slab_bytes: int = DEFAULT_MAX_SLAB_BYTES
    load_workers: int = 16
    http_bind: tuple[str, int] | None = None  # health, readiness, metrics and status over HTTP
    take_over: bool = False  # a live daemon of this cache: take its slabs over instead of exiting


def prepare_socket_dir(path: pathlib.Path, group: int | None) -> None:
    """Create the directory private to the daemon (and the group, if one shares it).

    An existing directory is not re-permissioned (it may be someone else's), but one
    that anybody can write to is refused: another user could plant sockets there.
    """
    mode = 0o750 if group is not None else 0o700
    try:
        path.mkdir(parents=True, mode=mode)
        os.chmod(path, mode)  # mkdir's mode is filtered by the umask
        if group is not None:
            os.chown(path, -1, group)
    except FileExistsError:
        st = path.stat()
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(f"socket dir {path} exists and is not a directory") from None
        if st.st_mode & stat.S_IWOTH:
            raise PermissionError(f"socket dir {path} is writable by every user; give the daemon a directory "
                                  "of its own (mode 0700, or 0750 with --socket-group)") from None


def claim(socket_dir: pathlib.Path, name: str, device: str, *, after_handoff: bool = False) -> int:
    """Hold the (cache, device) lock for the daemon's lifetime; the kernel drops it when
    the process dies, however it dies, so a crashed daemon never blocks its successor.

    after_handoff: this daemon already serves the predecessor's slabs on its own socket;
    wait for the predecessor to exit, and keep the sockets."""
    lock_path = socket_dir / f".{name}__{device}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if after_handoff else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        raise AlreadyServed(f"another daemon already serves cache {name!r} on {device} (lock {lock_path})") from None
    if not after_handoff:
        # We hold the lock, so any socket of this cache and device is a dead daemon's.
        for entry in socket_dir.glob(f"{name}__{device}__*.sock"):
            entry.unlink(missing_ok=True)
    return fd


def ranks_for(parallel: fp.Parallelism, count: int) -> list[fp.Parallelism]:
    """Each served device's parallelism: one device keeps the configured rank; with
    several, device i holds tensor-parallel rank i % tp_size (all GPUs of a node, one
    daemon)."""
    if count == 1:
        return [parallel]
    if parallel.tp_rank:
        raise ValueError(f"--tp-rank {parallel.tp_rank} names one rank, but {count} devices are served; with "
                         "several devices, device i serves rank i % --tp-size")
    if count % parallel.tp_size:
        raise ValueError(f"{count} devices cannot be split into tensor-parallel groups of {parallel.tp_size}")
    return [replace(parallel, tp_rank=i % parallel.tp_size) for i in range(count)]


def load(config: DaemonConfig, backend, parallel: fp.Parallelism, state: DaemonState) -> tuple[ResidentCache, list]:
    checkpoint = read_checkpoint(config.model_dir)
    tensors = shard(checkpoint.tensors, plan_for(checkpoint.config, config.tp_plan), parallel.tp_size,
                    parallel.tp_rank)
    plan = plan_slabs(tensors, max_slab_bytes=config.max_slab_bytes)
    state.expect(sum(t.nbytes for t in tensors))
    log.info("loading", extra={"fields": {"model": str(config.model_dir), "tensors": len(tensors),
                                          "bytes": sum(t.nbytes for t in tensors), "slabs": len(plan.slab_sizes),
                                          "backend": backend.name, "device": backend.device,
                                          "tp": f"{parallel.tp_rank}/{parallel.tp_size}"}})
    slabs = [backend.allocate(size, f"weightcache:{config.name}:{i}") for i, size in enumerate(plan.slab_sizes)]
    seconds = fill_slabs(plan, slabs, workers=config.load_workers, on_bytes=state.loaded)
    for slab in slabs:
        slab.seal()
    fingerprint = fp.compute(config.model_dir, revision=config.revision, parallel=parallel,
                             device=backend.fingerprint_device())
    layout = to_wire(plan)
    for entry, slab in zip(layout.slabs, slabs):
        entry.size = slab.size  # backends round up (e.g. to the VMM granularity); engines map it all
        entry.ipc_handle = slab.handle_bytes
    fds = [s.export_fd() for s in slabs]
    cache = ResidentCache(name=config.name, backend=backend.name, device=backend.device, fingerprint=fingerprint,
                          layout=layout, slab_fds=[fd for fd in fds if fd is not None],
                          model_path=str(config.model_dir), load_s=seconds)
    return cache, slabs


def publish(config: DaemonConfig, cache: ResidentCache) -> tuple[CacheServer, pathlib.Path]:
    final = config.socket_dir / socket_name(config.name, cache.device, fp.digest(cache.fingerprint))
    with reachable(final):
        pass  # a name too long even through the directory's fd fails here, before binding
    temporary = final.with_name(f".{os.getpid()}.{cache.device}.binding")
    temporary.unlink(missing_ok=True)
    with reachable(temporary) as address:
        server = CacheServer(address, cache, AccessPolicy(config.allow_uids, config.allow_gids),
                             handshake_timeout=config.handshake_timeout, max_connections=config.max_connections)
    os.chmod(temporary, 0o660 if config.socket_group is not None else 0o600)
    if config.socket_group is not None:
        os.chown(temporary, -1, config.socket_group)
    os.rename(temporary, final)
    server.published_inode = os.stat(final).st_ino  # a successor's socket may replace it later
    return server, final


def failure_reason(exc: BaseException, model_dir: pathlib.Path) -> str:
    """The CamelCase reason the status document (and the WeightCache) shows."""
    # A hostPath volume for a path missing on the node arrives as an empty directory.
    if not model_dir.is_dir() or not any(model_dir.iterdir()):
        return "ModelNotFound"
    if isinstance(exc, UnsupportedQuantization):
        return "UnsupportedQuantization"
    if isinstance(exc, CheckpointError):
        return "InvalidCheckpoint"
    return "LoadFailed"


class _HeldFd:
    """A slab handle taken over from a predecessor: this daemon only passes it on."""

    def __init__(self, fd: int):
        self.fd = fd

    def close(self) -> None:
        os.close(self.fd)


def take_over(config: DaemonConfig, device: str):
    """The live predecessor's slabs for this device, over its socket: (cache, slabs, the
    connection to answer once this daemon's socket is published). Nothing is read from disk."""
    paths = list_sockets(config.socket_dir, config.name, device)
    if not paths:
        raise AlreadyServed(f"cache {config.name!r} on {device} is locked by a daemon that serves no socket to "
                            "take over from")
    req = wire.Request(protocol_version=PROTOCOL_VERSION, client_name=f"successor-pid-{os.getpid()}")
    req.handoff.SetInParent()
    sock, response, fds = request(paths[0], req, timeout=config.handshake_timeout, accept_fds=True)
    att = response.attached
    if att.backend != config.backend:
        sock.close()
        raise ValueError(f"the running daemon serves backend {att.backend}; this one was started for {config.backend}")
    cache = ResidentCache(name=config.name, backend=att.backend, device=att.device, fingerprint=att.fingerprint,
                          layout=att.layout, slab_fds=fds, model_path=str(config.model_dir), load_s=0.0)
    log.info("taken over", extra={"fields": {"from": str(paths[0]), "bytes": cache.resident_bytes,
                                             "slabs": len(fds), "device": device}})
    return cache, [_HeldFd(fd) for fd in fds], sock


def load_and_publish(config: DaemonConfig, devices: list[str], state: DaemonState, handed: set[str]) -> list:
    """Load every device in parallel (each in its own thread: a CUDA context is current
    per thread), or take it over from a live predecessor where `handed` names it; then
    publish their sockets. Returns (cache, server, path, slabs, handoff connection) each."""
    parallels = ranks_for(config.parallel, len(devices))

    def one(device: str, parallel: fp.Parallelism):
        if device in handed:
            return take_over(config, device)
        return (*load(config, make_backend(config.backend, device), parallel, state), None)

    with ThreadPoolExecutor(max_workers=len(devices), thread_name_prefix="device") as pool:
        loaded = list(pool.map(one, devices, parallels))
    served = []
    for cache, slabs, handoff in loaded:
        server, path = publish(config, cache)
        served.append((cache, server, path, slabs, handoff))
    return served


def _stop_once_handed_off(servers: list, stop: threading.Event) -> None:
    """A successor took every device over: this daemon's work is done."""
    for server in servers:
        server.handed_off.wait()
    log.info("handed over", extra={"fields": {"devices": len(servers)}})
    stop.set()


def _still_ours(path: pathlib.Path, server) -> bool:
    try:
        return os.stat(path).st_ino == server.published_inode
    except FileNotFoundError:
        return False


def run(config: DaemonConfig, ready_fd: int | None = None) -> int:
    """Load, serve until SIGTERM or SIGINT, clean up. Returns the process exit code.

    Signals keep their default action while loading, so a pod being deleted never waits
    for a load. Without HTTP, a load that fails raises (the CLI exits 2 naming the problem). With
    HTTP, the daemon stays up and reports the failure, so that a pod shows why it is
    not ready instead of restarting into the same error.
    """
    import torch  # noqa: F401  (the fingerprint records its version; import it before loading, not after)

    check_cache_name(config.name)
    devices = canonical_devices(config.backend, config.devices)
    prepare_socket_dir(config.socket_dir, config.socket_group)
    locks, handed = [], set()
    for device in devices:
        try:
            locks.append(claim(config.socket_dir, config.name, device))
        except AlreadyServed as exc:
            if not config.take_over:
                log.error(str(exc))
                return EXIT_ALREADY_SERVED
            handed.add(device)
    state = DaemonState(cache=config.name, backend=config.backend, model=str(config.model_dir))
    http = serve_http(*config.http_bind, state) if config.http_bind else None
    try:
        served = load_and_publish(config, devices, state, handed)
    except Exception as exc:
        if http is None:
            raise
        stop = stop_on_signal()
        state.fail(failure_reason(exc, config.model_dir), str(exc))
        log.error("load failed", extra={"fields": {"reason": state.reason, "error": str(exc)}})
        stop.wait()
        http.shutdown()
        return 1
    for cache, server, path, _, _ in served:
        threading.Thread(target=server.serve_forever, name="accept", daemon=True).start()
        log.info("ready", extra={"fields": {"socket": str(path), "fingerprint": fp.digest(cache.fingerprint)[:12],
                                            "tensors": len(cache.layout.tensors.name), "bytes": cache.resident_bytes,
                                            "load_s": round(cache.load_s, 3)}})
    for device, (*_, handoff) in zip(devices, served):
        if handoff is not None:  # our socket serves: the predecessor may go, and leaves us its lock
            handoff.sendall(HANDOFF_DONE)
            handoff.close()
            locks.append(claim(config.socket_dir, config.name, device, after_handoff=True))
    stop = stop_on_signal()
    servers = [server for _, server, *_ in served]
    threading.Thread(target=_stop_once_handed_off, args=(servers, stop), name="handoff", daemon=True).start()
    state.ready([(cache, server, path) for cache, server, path, *_ in served])
    if ready_fd is not None:
        os.write(ready_fd, b"ready\n")
        os.close(ready_fd)
    stop.wait()
    started = time.monotonic()
    attached = 0
    for cache, server, path, slabs, _ in served:
        if _still_ours(path, server):
            path.unlink(missing_ok=True)
        server.shutdown()
        server.server_close()
        attached += server.attached_clients
        for slab in slabs:
            slab.close()
    if http is not None:
        http.shutdown()
    for fd in locks:
        os.close(fd)
    log.info("stopped", extra={"fields": {"attached_at_exit": attached,
                                          "shutdown_ms": round((time.monotonic() - started) * 1e3, 1)}})
    return 0
