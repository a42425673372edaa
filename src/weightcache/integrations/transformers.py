"""transformers: one call that returns a ready model, its weights from the cache (or
from disk, per policy), for engines that would otherwise call `from_pretrained`.

    from transformers import AutoModelForCausalLM
    from weightcache.integrations.transformers import from_pretrained

    model, weights = from_pretrained("/models/llama", AutoModelForCausalLM)
    print(weights.source, weights.reason)     # "cache" / "disk", and why
    # keep `weights` while the model serves: its connection counts the engine attached

The steps are the three of docs/engines.md: build the model on the meta device
(accelerate's `init_empty_weights(include_buffers=False)`: parameters take no memory and
are not initialised), get the weights through `weightcache.client.load_weights` (mode,
fallback, socket dir, device ... from WEIGHTCACHE_* or keyword arguments), and `bind`
every parameter and persistent buffer to them without a copy. Buffers the checkpoint
does not hold (rotary `inv_freq`, position ids) are computed at construction, as
`from_pretrained` does, and moved to the weights' device.

transformers and accelerate are imported here alone (installed by the `demo` extra).
"""

import logging
import time
from dataclasses import replace

from weightcache.client import ClientSettings, LoadedWeights, bind, load_weights

log = logging.getLogger("weightcache.integrations.transformers")


def from_pretrained(model_dir=None, model_class=None, *, dtype=None, config=None,
                    settings: ClientSettings | None = None, phases_ms: dict | None = None, **overrides) -> tuple:
    """(model in eval mode, LoadedWeights) for the checkpoint in model_dir.

    model_class: a transformers Auto class (default AutoModel) or a model class such as
    LlamaForCausalLM. dtype: the model's dtype (default: the config's, as
    `from_config` builds it); it must be the checkpoint's, or bind says which tensors
    differ. config: a config object to use instead of model_dir's config.json.
    settings / overrides: as for `weightcache.client.load_weights` (e.g. mode="off",
    fallback="error", socket_dir=..., cache_name=..., device="cuda"). phases_ms: a dict
    to fill with where the time went (build, weights, bind: milliseconds each).

    Raises BindError (naming every missing, unexpected or mismatched tensor) rather
    than return a half-bound model; CacheUnavailable / FingerprintMismatch when the
    policy is fallback=error and the cache cannot serve.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModel

    settings = replace(settings, **overrides) if settings else ClientSettings.from_env(**overrides)
    model_dir = model_dir or settings.model_dir
    if not model_dir:
        raise ValueError("from_pretrained needs a model directory: pass model_dir or set WEIGHTCACHE_MODEL_DIR")
    if settings.tp_size > 1:
        raise ValueError(f"from_pretrained builds the whole model; tensor parallel size {settings.tp_size} needs an "
                         "engine that builds its rank's shard (see weightcache.tp_engine)")
    model_class = model_class or AutoModel
    config = config or AutoConfig.from_pretrained(model_dir)

    phases = {} if phases_ms is None else phases_ms
    start = time.perf_counter()
    build = getattr(model_class, "from_config", None) or model_class._from_config  # Auto classes / model classes
    with init_empty_weights(include_buffers=False):  # parameters on meta: no memory, no init
        model = build(config) if dtype is None else build(config, dtype=dtype)
    phases["build"] = (time.perf_counter() - start) * 1e3

    start = time.perf_counter()
    loaded = load_weights(model_dir, settings)
    phases["weights"] = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    try:
        bind(model, loaded.tensors)
        if loaded.source == "disk" and settings.device != "cpu":
            model.to(_torch_device(settings.device))  # the engine's own copy on its GPU, as from_pretrained + .to()
            on_device = model.state_dict()
            loaded.tensors = {name: on_device[name] for name in loaded.tensors}  # let the mapped files go
        else:
            _move_buffers(model, _device_of(loaded.tensors))
    except BaseException:
        if loaded.attached is not None:
            loaded.attached.close()
        raise
    phases["bind"] = (time.perf_counter() - start) * 1e3
    log.info("model ready", extra={"fields": {"model_class": type(model).__name__, "source": loaded.source,
                                              **{f"{k}_ms": round(v, 2) for k, v in phases.items()}}})
    return model.eval(), loaded


def _device_of(tensors: dict):
    for tensor in tensors.values():
        return tensor.device
    return None


def _torch_device(device: str):
    """torch's device for a client device name: "cuda", "cuda:N" or a GPU UUID."""
    import torch

    from weightcache.client.load import resolve_device

    if device.startswith("cuda"):
        return torch.device(device)
    for ordinal in range(torch.cuda.device_count()):
        if resolve_device(f"cuda:{ordinal}") == device:
            return torch.device("cuda", ordinal)
    raise ValueError(f"no CUDA device has the UUID {device!r} (WEIGHTCACHE_DEVICE)")


def _move_buffers(model, device) -> None:
    """Buffers that bind left alone (computed at construction, on the CPU) go where the
    weights are; bound weights are never touched."""
    if device is None or device.type == "cpu":
        return
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


__all__ = ["LoadedWeights", "from_pretrained"]
