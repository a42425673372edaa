"""A daemon's life: claim the cache, load it, publish the socket, serve until told to stop.

The socket file appears only once the slabs are sealed and the server listens (bound
under a temporary name, then renamed), so its existence never means "loading"; still,
clients treat only a successful handshake as ready.
"""

import fcntl
import logging
import os
import pathlib
import signal
import stat
import threading
import time
from dataclasses import dataclass, field

from weightcache.client import fingerprint as fp
from weightcache.client.spawn import EXIT_ALREADY_SERVED
from weightcache.client.protocol import MAX_SOCKET_PATH, check_cache_name, socket_name

from .backends import make_backend
from .checkpoint import read_checkpoint
from .layout import DEFAULT_MAX_SLAB_BYTES, plan_slabs, to_wire
from .loader import fill_slabs
from .sharding import plan_for, shard
from .server import AccessPolicy, CacheServer, ResidentCache

log = logging.getLogger("weightcache.daemon")


class AlreadyServed(Exception):
    """Another live daemon holds this cache's lock."""


@dataclass(frozen=True)
class DaemonConfig:
    model_dir: pathlib.Path
    socket_dir: pathlib.Path
    name: str
    backend: str = "cpu"
    device: str = "0"  # GPU UUID or ordinal for the GPU backends
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


def claim(socket_dir: pathlib.Path, name: str, device: str) -> int:
    """Hold the (cache, device) lock for the daemon's lifetime; the kernel drops it when
    the process dies, however it dies, so a crashed daemon never blocks its successor."""
    lock_path = socket_dir / f".{name}__{device}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise AlreadyServed(f"another daemon already serves cache {name!r} on {device} (lock {lock_path})") from None
    # We hold the lock, so any socket of this cache and device is a dead daemon's.
    for entry in socket_dir.glob(f"{name}__{device}__*.sock"):
        entry.unlink(missing_ok=True)
    return fd


def load(config: DaemonConfig, backend) -> tuple[ResidentCache, list]:
    checkpoint = read_checkpoint(config.model_dir)
    par = config.parallel
    tensors = shard(checkpoint.tensors, plan_for(checkpoint.config, config.tp_plan), par.tp_size, par.tp_rank)
    plan = plan_slabs(tensors, max_slab_bytes=config.max_slab_bytes)
    log.info("loading", extra={"fields": {"model": str(config.model_dir), "tensors": len(tensors),
                                          "bytes": sum(t.nbytes for t in tensors), "slabs": len(plan.slab_sizes),
                                          "backend": backend.name, "tp": f"{par.tp_rank}/{par.tp_size}"}})
    slabs = [backend.allocate(size, f"weightcache:{config.name}:{i}") for i, size in enumerate(plan.slab_sizes)]
    seconds = fill_slabs(plan, slabs, workers=config.load_workers)
    for slab in slabs:
        slab.seal()
    fingerprint = fp.compute(config.model_dir, revision=config.revision, parallel=config.parallel,
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
    if len(str(final)) > MAX_SOCKET_PATH:
        raise ValueError(f"socket path {final} is {len(str(final))} bytes; Unix sockets allow {MAX_SOCKET_PATH}. "
                         "Use a shorter --socket-dir or --name.")
    temporary = final.with_name(f".{os.getpid()}.binding")
    temporary.unlink(missing_ok=True)
    server = CacheServer(str(temporary), cache, AccessPolicy(config.allow_uids, config.allow_gids),
                         handshake_timeout=config.handshake_timeout, max_connections=config.max_connections)
    os.chmod(temporary, 0o660 if config.socket_group is not None else 0o600)
    if config.socket_group is not None:
        os.chown(temporary, -1, config.socket_group)
    os.rename(temporary, final)
    return server, final


def run(config: DaemonConfig, ready_fd: int | None = None) -> int:
    """Load, serve until SIGTERM or SIGINT, clean up. Returns the process exit code."""
    import torch  # noqa: F401  (the fingerprint records its version; import it before loading, not after)

    check_cache_name(config.name)
    backend = make_backend(config.backend, config.device)
    prepare_socket_dir(config.socket_dir, config.socket_group)
    try:
        lock_fd = claim(config.socket_dir, config.name, backend.device)
    except AlreadyServed as exc:
        log.error(str(exc))
        return EXIT_ALREADY_SERVED
    stop = threading.Event()
    cache, slabs = load(config, backend)
    server, path = publish(config, cache)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, name="accept", daemon=True)
    thread.start()
    log.info("ready", extra={"fields": {"socket": str(path), "fingerprint": fp.digest(cache.fingerprint)[:12],
                                        "tensors": len(cache.layout.tensors.name), "bytes": cache.resident_bytes,
                                        "load_s": round(cache.load_s, 3)}})
    if ready_fd is not None:
        os.write(ready_fd, b"ready\n")
        os.close(ready_fd)
    stop.wait()
    started = time.monotonic()
    path.unlink(missing_ok=True)
    server.shutdown()
    server.server_close()
    for slab in slabs:
        slab.close()
    os.close(lock_fd)
    log.info("stopped", extra={"fields": {"attached_at_exit": server.attached_clients,
                                          "shutdown_ms": round((time.monotonic() - started) * 1e3, 1)}})
    return 0
