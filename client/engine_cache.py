"""What an engine with a layout of its own calls (vLLM, through its adapter): attach to
the published copy of its tensors, or load them its own way and publish them, by the
same WEIGHTCACHE_* policy as load_weights, saying which path it took and why.

    expected = fingerprint.for_engine(model_dir, engine="vllm", ...)
    loaded = attach_or_publish(expected, load=lambda: engine_tensors, model_dir=model_dir)
    # loaded.source: "cache" (attached), "published" (loaded, published, now holds the
    # shared copy) or "disk" (private: mode=off, or a failure the fallback allowed)

`load` runs only on a miss. On "cache" and "published" the tensors are read-only views
of the store's copy, so the engine keeps no private copy of what it shares.
"""

import logging
from dataclasses import replace

from .attach import attach
from .errors import CacheUnavailable, FingerprintMismatch, NotPublished
from .load import ClientSettings, LoadedWeights, resolve_device, start_daemon, write_report
from .publish import publish, store_sockets

log = logging.getLogger("weightcache.client")


def attach_or_publish(expected, load, *, model_dir=None, settings: ClientSettings | None = None,
                      client_name: str = "", **overrides) -> LoadedWeights:
    """The engine's tensors for fingerprint EXPECTED: the published copy when there is
    one, else load() published (where the policy allows), else load()'s own tensors.

    model_dir names the cache when WEIGHTCACHE_CACHE_NAME does not (as mode=daemon does)."""
    settings = replace(settings, **overrides) if settings else ClientSettings.from_env(**overrides)
    model_dir = model_dir or settings.model_dir
    loaded = _attach_or_publish(expected, load, model_dir, settings, client_name)
    if settings.report_file:
        write_report(settings.report_file, loaded)
    return loaded


def _attach_or_publish(expected, load, model_dir, settings: ClientSettings, client_name: str) -> LoadedWeights:
    if settings.mode == "off":
        return _private(load(), "mode=off")
    settings = replace(settings, device=resolve_device(settings.device))
    where = dict(socket_dir=settings.socket_dir, cache_name=settings.cache_name, device=settings.device,
                 timeout=settings.timeout, client_name=client_name)
    try:
        if settings.mode == "daemon" and not store_sockets(settings.socket_dir, settings.cache_name, settings.device):
            start_daemon(model_dir, settings, store=True)
        attached = attach(expected=expected, **where)
        log.info("attached", extra={"fields": {"socket": attached.socket_path, "attach_ms": round(attached.attach_ms, 2),
                                               "bytes": attached.resident_bytes}})
        return LoadedWeights(attached.tensors, "cache", f"attached to {attached.socket_path}", attached)
    except NotPublished as exc:
        why = f"nothing published yet ({exc})"
    except FingerprintMismatch as exc:
        if settings.fallback == "error":
            log.error("fingerprint mismatch; fallback=error", extra={"fields": {"reason": str(exc)}})
            raise
        why = f"the store holds other tensors ({', '.join(m[0] for m in exc.mismatches)} differ); published beside"
    except CacheUnavailable as exc:
        if settings.fallback == "error":
            log.error("attach failed; fallback=error", extra={"fields": {"reason": str(exc)}})
            raise
        log.warning("attach failed; loading privately (fallback=disk)", extra={"fields": {"reason": str(exc)}})
        return _private(load(), f"fallback to disk: {exc}")
    tensors = load()
    try:
        attached, wrote = publish(tensors, expected, **where)
    except CacheUnavailable as exc:
        if settings.fallback == "error":
            raise
        log.warning("publishing failed; keeping the engine's own copy (fallback=disk)",
                    extra={"fields": {"reason": str(exc)}})
        return _private(tensors, f"loaded; publishing failed: {exc}")
    source = "published" if wrote else "cache"
    reason = f"{why}: loaded and published to {attached.socket_path}" if wrote else \
        f"another engine published it meanwhile: attached to {attached.socket_path}"
    log.info(source, extra={"fields": {"socket": attached.socket_path, "bytes": attached.resident_bytes,
                                       "publish_ms": round(attached.attach_ms, 2)}})
    return LoadedWeights(attached.tensors, source, reason, attached)


def _private(tensors: dict, reason: str) -> LoadedWeights:
    log.info("engine keeps its own tensors", extra={"fields": {"reason": reason}})
    return LoadedWeights(tensors, "disk", reason)
