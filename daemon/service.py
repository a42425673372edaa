"""A daemon's life: claim the cache, load it, publish the socket, serve until told to stop.

Started without a model, the daemon is a store: it claims the cache, publishes its
sockets at once (empty) and serves what engines publish into them (server.py).

The socket file appears only once the slabs are sealed and the server listens (bound
under a temporary name, then renamed), so its existence never means "loading"; still,
clients treat only a successful handshake as ready.
"""

import fcntl
import hashlib
import logging
import os
import pathlib
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from weightcache.client import fingerprint as fp
from weightcache.client import wire_pb2 as wire
from weightcache.client.attach import connect, list_sockets, query_status
from weightcache.client.errors import CheckpointError, ProtocolError, UnsupportedQuantization
from weightcache.client.protocol import STORE_TAG, check_cache_name, reachable, socket_name
from weightcache.client.spawn import ALREADY_SERVED_LINE, EXIT_ALREADY_SERVED
from weightcache.client.tp_plan import plan_for

from weightcache.signals import stop_on_signal

from .backends import canonical_devices, make_backend
from .catalog import Catalog, OverBudget
from .checkpoint import read_checkpoint
from .health import DaemonState, serve_http
from .layout import DEFAULT_MAX_SLAB_BYTES, plan_slabs, to_wire
from .loader import fill_slabs
from .server import AccessPolicy, CacheServer, Publishing, ResidentCache
from .sharding import shard
from .succession import TakeOverRefused, release_locks, step_aside, take_over_from, tell_predecessor

log = logging.getLogger("weightcache.daemon")


class AlreadyServed(Exception):
    """Another live daemon holds this cache's lock."""


# What names a store daemon's lock in place of a model generation.
STORE_GENERATION = "store"


@dataclass(frozen=True)
class DaemonConfig:
    model_dir: pathlib.Path | None  # None: a store, filled by the engines that publish into it
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
    # The most bytes of slabs per device (None: no limit): the operator's share of a
    # per-GPU budget while another generation of the cache is resident beside this one.
    max_device_bytes: int | None = None
    # A store's writers (a separate permission from attaching) and how long one may fill.
    allow_publish_uids: frozenset[int] = frozenset()
    allow_publish_gids: frozenset[int] = frozenset()
    commit_timeout: float = 600.0

    @property
    def store(self) -> bool:
        return self.model_dir is None


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


def generation_key(model_dir: pathlib.Path, revision: str) -> str:
    """What tells two generations of one cache apart before anything is read: the model
    directory and the revision (both in the fingerprint). Two generations of a cache may
    serve side by side on a node (a blue/green model change); two daemons of one may not."""
    return hashlib.sha256(f"{model_dir}\0{revision}".encode()).hexdigest()[:12]


def _listening(path: pathlib.Path) -> bool:
    """Whether a live daemon accepts on this socket (a dead one's file refuses)."""
    try:
        connect(path, timeout=2.0).close()  # the server takes a connect-and-close as a probe
        return True
    except OSError:
        return False


def claim(socket_dir: pathlib.Path, name: str, device: str, generation: str, *, after_handoff: bool = False) -> int:
    """Hold the (cache, device, generation) lock for the daemon's lifetime; the kernel
    drops it when the process dies, however it dies, so a crashed daemon never blocks its
    successor. Another generation of the cache has a lock of its own and serves on.

    after_handoff: this daemon already serves the predecessor's slabs on its own socket;
    wait for the predecessor to exit, and keep the sockets."""
    lock_path = socket_dir / f".{name}__{device}__{generation}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if after_handoff else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        raise AlreadyServed(f"another daemon already serves cache {name!r} on {device} (lock {lock_path})") from None
    if not after_handoff:
        # A socket of this cache and device that nobody listens on is a dead daemon's;
        # a live one is another generation's, serving its engines.
        for entry in socket_dir.glob(f"{name}__{device}__*.sock"):
            if not _listening(entry):
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
    # The checkpoint's files stay open while it loads and are closed when it ends, also on
    # an error: the slabs are filled, and the fingerprint hashed, from the validated files.
    with read_checkpoint(config.model_dir) as checkpoint:
        return _load_checkpoint(checkpoint, config, backend, parallel, state)


def _load_checkpoint(checkpoint, config: DaemonConfig, backend, parallel: fp.Parallelism,
                     state: DaemonState) -> tuple[ResidentCache, list]:
    tensors = shard(checkpoint.tensors, plan_for(checkpoint.config, config.tp_plan), parallel.tp_size,
                    parallel.tp_rank)
    plan = plan_slabs(tensors, max_slab_bytes=config.max_slab_bytes)
    state.expect(sum(t.nbytes for t in tensors))
    planned = sum(plan.slab_sizes)
    if config.max_device_bytes is not None and planned > config.max_device_bytes:
        raise OverBudget(f"the shard needs {planned} bytes on {backend.device}, but this daemon may allocate "
                         f"{config.max_device_bytes} (--max-device-bytes: what the per-GPU budget leaves beside "
                         "the generation already resident); nothing was allocated")
    log.info("loading", extra={"fields": {"model": str(config.model_dir), "tensors": len(tensors),
                                          "bytes": sum(t.nbytes for t in tensors), "slabs": len(plan.slab_sizes),
                                          "backend": backend.name, "device": backend.device,
                                          "tp": f"{parallel.tp_rank}/{parallel.tp_size}"}})
    slabs = [backend.allocate(size, f"weightcache:{config.name}:{i}") for i, size in enumerate(plan.slab_sizes)]
    seconds = fill_slabs(plan, slabs, checkpoint.files, workers=config.load_workers, on_bytes=state.loaded)
    for slab in slabs:
        slab.seal()
    fingerprint = fp.compute(checkpoint.files, revision=config.revision, parallel=parallel,
                             device=backend.fingerprint_device())
    layout = to_wire(plan, slabs)
    fds = [s.export_fd() for s in slabs]
    cache = ResidentCache(name=config.name, backend=backend.name, device=backend.device, fingerprint=fingerprint,
                          layout=layout, slab_fds=[fd for fd in fds if fd is not None],
                          model_path=str(config.model_dir), load_s=seconds)
    return cache, slabs


def empty_store(config: DaemonConfig, device: str) -> tuple[ResidentCache, list, None]:
    """A store's device before any engine published: nothing resident, nothing to load."""
    identity = ResidentCache(name=config.name, backend=config.backend, device=device, fingerprint=wire.Fingerprint(),
                             layout=wire.Layout(), slab_fds=[], model_path="", load_s=0.0)
    return identity, [], None


def publish(config: DaemonConfig, cache: ResidentCache) -> tuple[CacheServer, pathlib.Path]:
    if config.store:
        catalog = Catalog(config.max_device_bytes, store=True)
        publishing = Publishing(AccessPolicy(config.allow_publish_uids, config.allow_publish_gids),
                                make_backend(config.backend, cache.device),
                                commit_timeout=config.commit_timeout, max_slab_bytes=config.max_slab_bytes)
        tag = STORE_TAG
    else:
        catalog, publishing, tag = Catalog(config.max_device_bytes), None, fp.digest(cache.fingerprint)
        catalog.add_loaded(cache)
    final = config.socket_dir / socket_name(config.name, cache.device, tag)
    with reachable(final):
        pass  # a name too long even through the directory's fd fails here, before binding
    temporary = final.with_name(f".{os.getpid()}.{cache.device}.binding")
    temporary.unlink(missing_ok=True)
    with reachable(temporary) as address:
        server = CacheServer(address, catalog, AccessPolicy(config.allow_uids, config.allow_gids), identity=cache,
                             publishing=publishing, handshake_timeout=config.handshake_timeout,
                             max_connections=config.max_connections)
    os.chmod(temporary, 0o660 if config.socket_group is not None else 0o600)
    if config.socket_group is not None:
        os.chown(temporary, -1, config.socket_group)
    os.rename(temporary, final)
    server.published_inode = os.stat(final).st_ino  # a successor's socket may replace it later
    return server, final


def failure_reason(exc: BaseException, model_dir: pathlib.Path | None) -> str:
    """The CamelCase reason the status document (and the WeightCache) shows."""
    # A hostPath volume for a path missing on the node arrives as an empty directory.
    if model_dir is not None and (not model_dir.is_dir() or not any(model_dir.iterdir())):
        return "ModelNotFound"
    if isinstance(exc, OverBudget):
        return "OverBudget"
    if isinstance(exc, UnsupportedQuantization):
        return "UnsupportedQuantization"
    if isinstance(exc, CheckpointError):
        return "InvalidCheckpoint"
    return "LoadFailed"


def _same_generation(path: pathlib.Path, config: DaemonConfig) -> bool:
    """Whether the daemon on PATH serves this daemon's generation (model and revision):
    beside it, another generation of the cache may serve its own engines."""
    try:
        status = query_status(path, timeout=config.handshake_timeout)
    except Exception:  # a dead or refusing socket is nobody to take over from
        return False
    return status.model_path == str(config.model_dir) and status.fingerprint.revision == config.revision


def succeed(config: DaemonConfig, device: str, generation: str, parallel: fp.Parallelism, state: DaemonState,
            poll_s: float = 0.2):
    """For a device whose lock a live daemon of this generation holds (--take-over).
    Returns (lock fd, None) when that daemon goes first (nobody to take over from: load),
    (None, (cache, slabs, connection)) after a hand-off, or (None, None) when it cannot
    hand over (load beside it; its lock follows when it exits).

    A daemon still loading has no socket yet: wait for it rather than load a second copy."""
    said = None
    while True:
        try:
            return claim(config.socket_dir, config.name, device, generation), None
        except AlreadyServed:
            pass
        paths = [p for p in list_sockets(config.socket_dir, config.name, device) if _same_generation(p, config)]
        if paths:
            try:
                return None, take_over_from(paths[0], config, parallel)
            except TakeOverRefused as exc:
                log.warning("take-over refused; loading from disk instead",
                            extra={"fields": {"device": device, "reason": str(exc)}})
                state.note("TakeOverRefused", f"{device}: {exc}; loading from disk")
                return None, None
            except (OSError, EOFError, ProtocolError) as exc:
                why = f"the running daemon did not answer on {paths[0].name}: {exc}"
        else:
            why = "the running daemon has not published its socket yet (still loading)"
        if why != said:
            log.info("waiting to take over", extra={"fields": {"device": device, "why": why}})
            state.note("TakingOver", f"{device}: {why}")
            said = why
        time.sleep(poll_s)


def claim_when_free(config: DaemonConfig, generation: str, devices: list[str], locks: dict) -> None:
    """Take each device's lock as the other daemon lets go (a thread: that may take long)."""
    for device in devices:
        locks[device] = claim(config.socket_dir, config.name, device, generation, after_handoff=True)


def load_and_publish(config: DaemonConfig, devices: list[str], state: DaemonState, locks: dict,
                     generation: str) -> list:
    """Load every device in parallel (each in its own thread: a CUDA context is current
    per thread), or, where a live daemon holds a device's lock (not in LOCKS), take its
    slabs over; then publish their sockets. Returns (cache, server, path, slabs, handoff
    connection) each; LOCKS gains the locks taken on the way."""
    parallels = ranks_for(config.parallel, len(devices))

    def one(device: str, parallel: fp.Parallelism):
        if config.store:
            return empty_store(config, device)
        if device not in locks:
            lock, taken = succeed(config, device, generation, parallel, state)
            if taken is not None:
                return taken
            if lock is not None:
                locks[device] = lock
        return (*load(config, make_backend(config.backend, device), parallel, state), None)

    with ThreadPoolExecutor(max_workers=len(devices), thread_name_prefix="device") as pool:
        loaded = list(pool.map(one, devices, parallels))
    served = []
    for cache, slabs, handoff in loaded:
        server, path = publish(config, cache)
        served.append((cache, server, path, slabs, handoff))
    return served


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
    locks: dict[str, int] = {}  # device -> lock fd; missing while another live daemon holds it
    if config.store and config.take_over:
        raise ValueError("--take-over needs --model: a store daemon's publications cannot be handed over yet")
    if config.store and config.backend == "cuda-ipc":
        raise ValueError("a store needs handles that a writer can fill and that outlive the daemon: use --backend "
                         "cpu or cuda-vmm (cuda-ipc memory dies with the process that allocated it)")
    generation = STORE_GENERATION if config.store else generation_key(config.model_dir, config.revision)
    for device in devices:
        try:
            locks[device] = claim(config.socket_dir, config.name, device, generation)
        except AlreadyServed as exc:
            if not config.take_over:
                log.error(str(exc))
                release_locks(locks)
                if ready_fd is not None:  # a detached daemon's starter cannot see its exit code
                    os.write(ready_fd, ALREADY_SERVED_LINE)
                return EXIT_ALREADY_SERVED
    state = DaemonState(cache=config.name, backend=config.backend, model=str(config.model_dir or ""),
                        store=config.store)
    http = serve_http(*config.http_bind, state) if config.http_bind else None
    try:
        served = load_and_publish(config, devices, state, locks, generation)
    except Exception as exc:
        if http is None:
            raise
        stop = stop_on_signal()
        release_locks(locks)  # it serves nothing: a successor must not wait for it
        state.fail(failure_reason(exc, config.model_dir), str(exc))
        log.error("load failed", extra={"fields": {"reason": state.reason, "error": str(exc)}})
        stop.wait()
        http.shutdown()
        return 1
    for cache, server, path, _, _ in served:
        threading.Thread(target=server.serve_forever, name="accept", daemon=True).start()
        log.info("ready", extra={"fields": {"socket": str(path),
                                            "fingerprint": "store" if config.store else fp.digest(cache.fingerprint)[:12],
                                            "tensors": len(cache.layout.tensors.name), "bytes": cache.resident_bytes,
                                            "load_s": round(cache.load_s, 3)}})
    for *_, handoff in served:
        if handoff is not None:
            tell_predecessor(handoff)
    stop = stop_on_signal()
    # Ready once it serves, before the other daemon lets go of the lock: a supervisor
    # stops that one only when this one is ready.
    state.ready([(cache, server, path) for cache, server, path, *_ in served])
    waiting = [d for d in devices if d not in locks]
    if waiting:
        threading.Thread(target=claim_when_free, args=(config, generation, waiting, locks), name="lock",
                         daemon=True).start()
    # With HTTP the daemon runs supervised (a pod would restart it if it exited): after a
    # hand-off it reports handed-over and waits for SIGTERM.
    servers = [server for _, server, *_ in served]
    threading.Thread(target=step_aside, args=(servers, locks, state, stop, http is not None), name="handoff",
                     daemon=True).start()
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
        server.catalog.close()
    if http is not None:
        http.shutdown()
    release_locks(locks)
    log.info("stopped", extra={"fields": {"attached_at_exit": attached,
                                          "shutdown_ms": round((time.monotonic() - started) * 1e3, 1)}})
    return 0
