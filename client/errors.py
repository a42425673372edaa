"""Errors an engine or operator can act on: each says what was expected, what was
found, and what to do."""


class WeightCacheError(Exception):
    """Base of every error weightcache raises on purpose."""


class CheckpointError(WeightCacheError):
    """A model directory or safetensors file is missing, malformed or lies about itself."""


class UnsupportedQuantization(CheckpointError):
    """The checkpoint uses a quantization the cache refuses to serve."""


class ProtocolError(WeightCacheError):
    """A peer sent something the wire contract does not allow."""


class CacheUnavailable(WeightCacheError):
    """No daemon could serve this engine; `attempts` says what each socket answered."""

    def __init__(self, message: str, attempts: list[str] | None = None):
        self.attempts = list(attempts or [])
        detail = "".join(f"\n  - {a}" for a in self.attempts)
        super().__init__(message + detail)


class FingerprintMismatch(CacheUnavailable):
    """A daemon serves the cache, but for different weights or a different engine setup."""

    def __init__(self, socket_path: str, mismatches: list[tuple[str, str, str]]):
        self.socket_path = socket_path
        self.mismatches = mismatches
        fields = "; ".join(f"{f}: engine expects {e!r}, daemon has {a!r}" for f, e, a in mismatches)
        super().__init__(f"fingerprint mismatch at {socket_path}: {fields}")


class PeerRejected(CacheUnavailable):
    """The daemon refused this process (uid/gid not allowed, connection limit, protocol)."""


class BindError(WeightCacheError):
    """Attached tensors do not fit the module: names, shapes or dtypes left unmatched."""


class NotPublished(CacheUnavailable):
    """A store daemon answered, but no engine has published this cache yet: the engine
    loads its own way and publishes (docs/protocol.md, "Publishing")."""


class PublishFailed(CacheUnavailable):
    """The daemon would not take, or dropped, this engine's publication (permission,
    budget, a refused layout, a timeout); the message says which."""
