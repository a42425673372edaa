"""What an engine calls: get its weights from the cache or from disk, by policy, and
say which path it took and why.

Modes (argument or WEIGHTCACHE_MODE):
  off     load from disk; the cache is not asked.
  client  attach to a running daemon; if that fails, WEIGHTCACHE_FALLBACK decides:
          `disk` loads from disk and reports why, `error` raises.
  daemon  like client, but first start a daemon for this model if none serves it.

With WEIGHTCACHE_REPORT_FILE set, the path taken is also written there as JSON (the
agent sidecar serves it): {"source", "reason", "attach_ms", "fingerprint", "pid", ...}.
"""

import json
import logging
import os
import pathlib
import time
import uuid
from dataclasses import dataclass, fields, replace

from .attach import AttachedWeights, attach, list_sockets
from .disk import load_from_disk
from .errors import CacheUnavailable, FingerprintMismatch
from .fingerprint import Parallelism
from .fingerprint import digest as fingerprint_digest
from .protocol import STORE_TAG, parse_socket_name
from .spawn import EXIT_ALREADY_SERVED, DaemonStartFailed, spawn_daemon

log = logging.getLogger("weightcache.client")

MODES = ("off", "client", "daemon")
FALLBACKS = ("disk", "error")
DEFAULT_SOCKET_DIR = "/run/weightcache"


@dataclass(frozen=True)
class ClientSettings:
    mode: str = "client"
    fallback: str = "disk"
    socket_dir: str = DEFAULT_SOCKET_DIR
    cache_name: str | None = None
    model_dir: str = ""  # used when load_weights is given none
    # "cpu", a GPU UUID, or "cuda"/"cuda:N": the UUID of that torch device (the webhook
    # sets "cuda": which GPU a pod got is known only inside it).
    device: str = "cpu"
    revision: str = ""
    tp_size: int = 1
    tp_rank: int = 0
    timeout: float = 10.0
    # How long mode=daemon waits for a daemon it started to finish loading.
    start_timeout: float = 600.0
    report_file: str = ""  # where to write which path was taken (JSON); "" for nowhere

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"weightcache mode {self.mode!r} is not one of {', '.join(MODES)} (WEIGHTCACHE_MODE)")
        if self.fallback not in FALLBACKS:
            raise ValueError(
                f"weightcache fallback {self.fallback!r} is not one of {', '.join(FALLBACKS)} (WEIGHTCACHE_FALLBACK)"
            )

    @classmethod
    def from_env(cls, env=None, **overrides) -> "ClientSettings":
        """Settings from WEIGHTCACHE_<FIELD> variables (the webhook sets them), then
        explicit arguments; arguments that are None are ignored."""
        env = os.environ if env is None else env
        values = {}
        for f in fields(cls):
            raw = env.get(f"WEIGHTCACHE_{f.name.upper()}")
            if raw is not None:
                values[f.name] = f.type(raw) if f.type in (int, float) else raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclass
class LoadedWeights:
    tensors: dict
    # "cache" (attached), "published" (this engine loaded and published it, and holds the
    # published copy) or "disk" (private tensors)
    source: str
    reason: str  # why this source: the mode, or the failure that made it fall back
    attached: AttachedWeights | None = None
    load_ms: float | None = None  # disk loads only; attaches have attached.attach_ms

    @property
    def resident_bytes(self) -> int:
        """Bytes the daemon holds for this engine (count them when sizing a KV cache)."""
        return self.attached.resident_bytes if self.attached else 0


def load_weights(model_dir=None, settings: ClientSettings | None = None, **overrides) -> LoadedWeights:
    """The model's tensors, from the cache when the mode and the daemon allow.

    model_dir defaults to WEIGHTCACHE_MODEL_DIR (settings.model_dir)."""
    settings = replace(settings, **overrides) if settings else ClientSettings.from_env(**overrides)
    model_dir = model_dir or settings.model_dir
    if not model_dir:
        raise ValueError("load_weights needs a model directory: pass model_dir or set WEIGHTCACHE_MODEL_DIR")
    loaded = _load(model_dir, settings)
    if settings.report_file:
        write_report(settings.report_file, loaded)
    return loaded


def _load(model_dir, settings: ClientSettings) -> LoadedWeights:
    if settings.mode == "off":
        return _from_disk(model_dir, settings, "mode=off")
    settings = replace(settings, device=resolve_device(settings.device))
    try:
        attached = _attach(model_dir, settings)
    except CacheUnavailable as exc:
        if settings.fallback == "error":
            log.error("attach failed; fallback=error", extra={"fields": {"reason": str(exc)}})
            raise
        log.warning("attach failed; loading from disk (fallback=disk)", extra={"fields": {"reason": str(exc)}})
        return _from_disk(model_dir, settings, f"fallback to disk: {exc}")
    log.info("attached", extra={"fields": {"socket": attached.socket_path, "attach_ms": round(attached.attach_ms, 2),
                                           "bytes": attached.resident_bytes}})
    return LoadedWeights(attached.tensors, "cache", f"attached to {attached.socket_path}", attached)


def resolve_device(device: str) -> str:
    """The GPU UUID that daemons name their sockets by, for "cuda" (torch's current
    device) or "cuda:N"; any other device as given."""
    if device != "cuda" and not device.startswith("cuda:"):
        return device
    import torch

    ordinal = torch.cuda.current_device() if device == "cuda" else int(device.removeprefix("cuda:"))
    return "GPU-" + str(uuid.UUID(bytes=bytes(torch.cuda.get_device_properties(ordinal).uuid.bytes)))


def engine_report(loaded: "LoadedWeights") -> dict:
    """What the engine tells the agent (and people): which path, why, how fast."""
    att = loaded.attached
    return {"source": loaded.source, "reason": loaded.reason, "attach_ms": round(att.attach_ms, 3) if att else None,
            "fingerprint": fingerprint_digest(att.fingerprint) if att else None, "pid": os.getpid(),
            "socket": att.socket_path if att else None, "device": att.device if att else None,
            "resident_bytes": loaded.resident_bytes, "load_ms": loaded.load_ms,
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write_report(path, loaded: "LoadedWeights") -> None:
    """Write the report by rename, so a reader never sees half of it. A report that
    cannot be written is logged, not raised: it must not cost the engine its weights."""
    path = pathlib.Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(engine_report(loaded)) + "\n")
        os.replace(temporary, path)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        log.warning("could not write the engine report", extra={"fields": {"path": str(path), "error": str(exc)}})


def _from_disk(model_dir, settings, reason) -> LoadedWeights:
    start = time.perf_counter()
    # A tensor-parallel engine gets its own shard, as it would from its rank's cache.
    tensors = load_from_disk(model_dir, parallel=Parallelism(tp_size=settings.tp_size, tp_rank=settings.tp_rank))
    ms = (time.perf_counter() - start) * 1e3
    log.info("loaded from disk", extra={"fields": {"reason": reason, "ms": round(ms)}})
    return LoadedWeights(tensors, "disk", reason, load_ms=round(ms, 3))


def _attach(model_dir, settings) -> AttachedWeights:
    def once():
        return attach(model_dir, socket_dir=settings.socket_dir, cache_name=settings.cache_name,
                      device=settings.device, revision=settings.revision, timeout=settings.timeout,
                      parallel=Parallelism(tp_size=settings.tp_size, tp_rank=settings.tp_rank))

    if settings.mode == "client":
        return once()
    try:
        return once()
    except FingerprintMismatch:
        pass  # a daemon for other weights: start one for ours beside it
    except CacheUnavailable:
        pass
    start_daemon(model_dir, settings)
    return once()


def start_daemon(model_dir, settings: ClientSettings, *, store: bool = False) -> None:
    """Start a detached daemon for this model and wait until it serves; with STORE, a
    store daemon (no model) that this user may publish into.

    The daemon outlives this process (that is the point of a cache); its log goes to
    <socket_dir>/<cache>.daemon.log (<cache>.store.log for a store). If another daemon
    for the same cache wins the start race, wait for that one instead.
    """
    name = settings.cache_name or default_cache_name(model_dir)
    socket_dir = pathlib.Path(settings.socket_dir)
    socket_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    log_path = socket_dir / f"{name}.{'store' if store else 'daemon'}.log"
    if store:
        args = ["--allow-publish-uid", str(os.geteuid())]
    else:
        args = ["--revision", settings.revision, "--tp-size", str(settings.tp_size), "--tp-rank", str(settings.tp_rank)]
    if settings.device != "cpu":
        args += ["--backend", "cuda-vmm", "--device", settings.device]
    with open(log_path, "ab") as log_file:
        try:
            spawn_daemon(None if store else model_dir, socket_dir, name, args, detached=True,
                         stdout=log_file, stderr=log_file, timeout=settings.start_timeout)
        except DaemonStartFailed as exc:
            if exc.returncode != EXIT_ALREADY_SERVED:
                raise DaemonStartFailed(f"{exc}; see {log_path}", exc.returncode) from None
            _wait_for_socket(socket_dir, name, settings, store)


def _wait_for_socket(socket_dir, name, settings, store: bool) -> None:
    """Wait for the daemon that won the start race to publish its socket: a store's when
    STORE, else a loaded daemon's (a socket of the other kind is another daemon, and
    would not do). Its ready pipe belongs to whoever started it, so polling the directory
    is the condition left to us; the attach that follows still checks it with a handshake."""
    def published() -> bool:
        return any((parse_socket_name(p.name)[2] == STORE_TAG) == store
                   for p in list_sockets(socket_dir, name, settings.device))

    deadline = time.monotonic() + settings.start_timeout
    while not published():
        if time.monotonic() > deadline:
            raise CacheUnavailable(f"another {'store' if store else 'daemon'} is starting cache {name} but did not "
                                   f"publish within {settings.start_timeout:.0f}s")
        time.sleep(0.05)


def default_cache_name(model_dir) -> str:
    base = pathlib.Path(model_dir).resolve().name.lower()
    cleaned = "".join(c if c.isalnum() or c in "-." else "-" for c in base).strip("-.")
    return cleaned[:63] or "model"
