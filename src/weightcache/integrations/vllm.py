"""vLLM's `--load-format weightcache`: the engine's weights from the node's cache.

Installed beside vLLM, weightcache registers this load format through vLLM's
`vllm.general_plugins` entry point (pyproject.toml); vLLM is imported here and nowhere
else in weightcache. Per start, by the WEIGHTCACHE_* policy (client/load.py):

- hit: the model is built without weight memory (its parameters are never written:
  uninitialised CPU pages cost nothing), and every parameter is re-pointed at the
  published copy, read-only. Nothing is read from disk.
- miss: vLLM's default loader fills the model from the checkpoint, the parameters are
  published (copied into the daemon's sealed slabs), and the model is re-pointed at the
  published copy: the first engine keeps no private copy either.
- disk (mode=off, or a failure the fallback allows): vLLM's default loader, private.

What is shared and what stays private (docs/engines.md):
- Shared, read-only: every parameter, as vLLM's weight loaders leave it (its own layout:
  fused qkv_proj / gate_up_proj, padded vocab, its own tensor-parallel cut), i.e. the
  state after `load_weights` and before `process_weights_after_loading`.
- Private: every buffer (rotary caches, the attention layers' q/k/v/prob scales that
  post-processing fills), computed by this engine exactly as a normal start computes
  them, and whatever post-processing creates.
- Post-processing runs for real, on those tensors. On vLLM's CPU build it would repack
  each linear weight (and the embedding / lm_head) into oneDNN memory of its own, which
  is a private copy of every weight; by default the adapter has those layers compute
  with torch's F.linear on the shared weight instead (vLLM's own fallback kernel, the
  one it uses where oneDNN is unavailable). That is the one difference from a normal
  start, and it is logged: greedy tokens are identical, logprobs agree to ~1e-5.
  `--model-loader-extra-config '{"cpu_gemm": "onednn"}'` keeps vLLM's oneDNN kernels
  (bit-identical to a normal start; the linear weights are then private again and the
  cache only saves the disk load).

Quantized checkpoints (and vLLM's online quantization) are refused by name: block FP8
on this CPU build would need post-processing that rewrites the weights.
"""

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time

import torch
from torch import nn
import vllm
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import get_model_architecture, process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from weightcache.client import fingerprint as fp
from weightcache.client.engine_cache import attach_or_publish
from weightcache.client.errors import BindError, UnsupportedQuantization, WeightCacheError

LOAD_FORMAT = "weightcache"
CPU_GEMMS = ("shared", "onednn")

# Under "vllm." so that vLLM's own log handler prints it beside its loader lines.
log = logging.getLogger("vllm.weightcache")


class UnsupportedVllmSetup(WeightCacheError):
    """A vLLM setting or model the adapter cannot serve faithfully from a shared copy."""


def register() -> None:
    """The `vllm.general_plugins` entry point: adds `--load-format weightcache`.
    vLLM calls it in every process it starts; registering twice is harmless."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not WeightcacheModelLoader:
        register_model_loader(LOAD_FORMAT)(WeightcacheModelLoader)


def tensor_settings(vllm_config: VllmConfig, model_config: ModelConfig) -> dict:
    """Every engine setting that changes the tensors the model holds after loading
    (besides dtype, revision and parallelism, which have fingerprint fields of their
    own). Port, context length, memory use and KV-cache size are left out on purpose."""
    model_class, architecture = get_model_architecture(model_config)
    hf_config = model_config.hf_config.to_dict()
    hf_config.pop("_name_or_path", None)  # where the model sits is not what it is
    parallel = vllm_config.parallel_config
    return {
        "architecture": architecture,
        "model_class": f"{model_class.__module__}.{model_class.__qualname__}",
        # The config vLLM built the model from: config.json after --hf-overrides and
        # vLLM's own adjustments (the checkpoint hash covers only the file).
        "hf_config_sha256": hashlib.sha256(json.dumps(hf_config, sort_keys=True, default=str).encode()).hexdigest(),
        "quantization": model_config.quantization,
        "model_impl": str(model_config.model_impl),
        "runner_type": str(model_config.runner_type),
        "convert_type": str(model_config.convert_type),
        "enable_expert_parallel": bool(parallel.enable_expert_parallel),
        # With expert parallelism each data-parallel rank holds other experts.
        "dp": [parallel.data_parallel_size, parallel.data_parallel_rank] if parallel.enable_expert_parallel else None,
    }


def expected_fingerprint(vllm_config: VllmConfig, model_config: ModelConfig):
    from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    pp = get_pp_group()
    parallel = fp.Parallelism(tp_size=get_tensor_model_parallel_world_size(), tp_rank=get_tensor_model_parallel_rank(),
                              pp_size=pp.world_size, pp_rank=pp.rank_in_group)
    return fp.for_engine(model_config.model, engine="vllm", engine_version=vllm.__version__,
                         dtype=str(model_config.dtype).removeprefix("torch."),
                         settings=tensor_settings(vllm_config, model_config), revision=model_config.revision or "",
                         parallel=parallel, device=fp.Device(kind="cpu"))


def shared_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What is published and bound: every parameter by its first name (tied
    parameters are one object, so binding one binds all its names)."""
    return {name: p.data for name, p in model.named_parameters()}


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: buf for name, buf in model.state_dict(keep_vars=True).items()
            if not isinstance(buf, nn.Parameter)}


@contextlib.contextmanager
def shared_cpu_gemm():
    """During post-processing: the unquantized linear and embedding layers compute with
    F.linear on their (shared) weight instead of repacking it into private oneDNN
    memory. vLLM's post-processing looks dispatch_cpu_unquantized_gemm up in
    vllm.model_executor.layers.utils when it runs (tests/vllm/test_vllm_internals.py)."""
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm

    def keep_weight(layer, remove_weight):
        if layer.weight.ndim != 2:  # conv / MoE expert weights: vLLM's own handling
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = keep_weight
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = original


class WeightcacheModelLoader(BaseModelLoader):
    """`--load-format weightcache` (see the module docstring)."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        extra = dict(load_config.model_loader_extra_config or {})
        self.cpu_gemm = extra.pop("cpu_gemm", "shared")
        if self.cpu_gemm not in CPU_GEMMS:
            raise ValueError(f"weightcache: cpu_gemm {self.cpu_gemm!r} is not one of {', '.join(CPU_GEMMS)}")
        if extra:
            raise ValueError(f"weightcache: unknown --model-loader-extra-config keys {sorted(extra)} "
                             f"(known: cpu_gemm)")
        self.disk = DefaultModelLoader(dataclasses.replace(load_config, load_format="auto",
                                                           model_loader_extra_config={}))
        self.report: dict = {}

    def download_model(self, model_config: ModelConfig) -> None:
        self.disk.download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        raise UnsupportedVllmSetup("weightcache maps weights read-only: reloading them in place "
                                   "(reload_weights / RL weight refit) needs --load-format auto")

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        self._refuse(vllm_config, model_config)
        target_device = torch.device(vllm_config.device_config.device if self.load_config.device is None
                                     else self.load_config.device)
        expected = expected_fingerprint(vllm_config, model_config)
        start = time.perf_counter()
        with set_default_torch_dtype(model_config.dtype):
            with target_device:
                # Parameters are torch.empty: on the CPU, pages nobody writes cost nothing.
                model = self.create_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
            loaded = attach_or_publish(expected, load=lambda: self._load(model, model_config),
                                       model_dir=model_config.model, client_name=f"vllm-{os.getpid()}")
            if loaded.source in ("cache", "published"):
                bind_shared(model, loaded.tensors)
            weights_ms = (time.perf_counter() - start) * 1e3
            shared = loaded.source in ("cache", "published") and self.cpu_gemm == "shared"
            with shared_cpu_gemm() if shared else contextlib.nullcontext():
                process_weights_after_loading(model, model_config, target_device)
            post_ms = (time.perf_counter() - start) * 1e3 - weights_ms
        model._weightcache = loaded  # keeps the mapping and the daemon connection alive
        self.report = {**report(model, loaded, weights_ms, self.cpu_gemm), "post_processing_ms": round(post_ms, 1)}
        log.info("weightcache: %s", json.dumps(self.report))
        return model.eval()

    def _load(self, model: nn.Module, model_config: ModelConfig) -> dict:
        """A miss: vLLM's default loader fills the model; its parameters are published."""
        before = {name: buf.clone() for name, buf in persistent_buffers(model).items()}
        self.disk.load_weights(model, model_config)
        changed = [name for name, buf in persistent_buffers(model).items()
                   if name in before and not torch.equal(before[name], buf)]
        if changed:  # data from the checkpoint in buffers, which are not published
            raise UnsupportedVllmSetup(f"weightcache: the checkpoint fills buffers {changed}; only parameters "
                                       "are published, so a later engine would lack them")
        return shared_tensors(model)

    def _refuse(self, vllm_config: VllmConfig, model_config: ModelConfig) -> None:
        if model_config.quantization is not None:
            raise UnsupportedQuantization(
                f"weightcache's vLLM adapter serves unquantized models only; this one uses "
                f"{model_config.quantization!r} (vLLM's post-processing rewrites quantized weights after loading, "
                f"which a read-only shared copy cannot take on this build). Use --load-format auto.")
        if vllm_config.device_config.device_type != "cpu":
            raise UnsupportedVllmSetup(f"weightcache's vLLM adapter runs on vLLM's CPU build (memfd slabs); "
                                       f"device {vllm_config.device_config.device_type!r} is not supported yet")
        if not os.path.isdir(model_config.model):
            raise UnsupportedVllmSetup(f"weightcache needs a local model directory (its identity is hashed from "
                                       f"config.json and the safetensors headers); got {model_config.model!r}")


def bind_shared(model: nn.Module, tensors: dict) -> None:
    """Point every parameter at its shared tensor (same Parameter objects, so vLLM's
    parameter classes, their weight loaders and tied weights stay as they are)."""
    params = dict(model.named_parameters())
    problems = [f"missing: {n}" for n in params if n not in tensors]
    problems += [f"unexpected: {n}" for n in tensors if n not in params]
    problems += [f"mismatch: {n} expects {tuple(p.shape)} {p.dtype}, got {tuple(tensors[n].shape)} "
                 f"{tensors[n].dtype}" for n, p in params.items()
                 if n in tensors and (tensors[n].shape != p.shape or tensors[n].dtype != p.dtype)]
    if problems:
        raise BindError(f"{len(problems)} problem(s) binding the published tensors to {type(model).__name__}:\n  "
                        + "\n  ".join(problems))
    for name, param in params.items():
        param.data = tensors[name]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def report(model: nn.Module, loaded, weights_ms: float, cpu_gemm: str) -> dict:
    """Which path, why, and what is shared and what private (bytes)."""
    shared_ptrs = set()
    if loaded.source in ("cache", "published"):
        shared_ptrs = {t.untyped_storage().data_ptr() for t in loaded.tensors.values()}
    shared = private = 0
    seen = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        if t.untyped_storage().data_ptr() in shared_ptrs:
            shared += _nbytes(t)
        else:
            private += _nbytes(t)
    return {"source": loaded.source, "reason": loaded.reason, "weights_ms": round(weights_ms, 1),
            "cpu_gemm": cpu_gemm if loaded.source != "disk" else "onednn",
            "shared_bytes": shared, "private_tensor_bytes": private, "resident_bytes": loaded.resident_bytes}
