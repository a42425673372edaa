"""weightcache.client: what an inference engine imports.

    from weightcache.client import load_weights, bind

    weights = load_weights("/models/llama")        # cache or disk, per WEIGHTCACHE_* settings
    with torch.device("meta"):                      # or accelerate.init_empty_weights()
        model = build_model(config)
    bind(model, weights.tensors)                    # zero-copy, read-only, fails loudly
    print(weights.source, weights.reason, weights.resident_bytes)

This package imports nothing from weightcache.daemon or weightcache.operator; it owns
the wire contract (wire_pb2, protocol, fingerprint) that the daemon imports.
"""

from .attach import AttachedWeights, attach, list_sockets, query_status
from .bind import bind
from .disk import compare_with_disk, load_from_disk
from .engine_cache import attach_or_publish
from .errors import (BindError, CacheUnavailable, CheckpointError, FingerprintMismatch, NotPublished, PeerRejected,
                     ProtocolError, PublishFailed, UnsupportedQuantization, WeightCacheError)
from .fingerprint import Device, Parallelism
from .load import ClientSettings, LoadedWeights, load_weights
from .publish import publish

__all__ = [
    "AttachedWeights", "BindError", "CacheUnavailable", "CheckpointError", "ClientSettings", "Device",
    "FingerprintMismatch", "LoadedWeights", "NotPublished", "Parallelism", "PeerRejected", "ProtocolError",
    "PublishFailed", "UnsupportedQuantization", "WeightCacheError", "attach", "attach_or_publish", "bind",
    "compare_with_disk", "list_sockets", "load_from_disk", "load_weights", "publish", "query_status",
]
