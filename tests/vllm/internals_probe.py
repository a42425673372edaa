"""Run in the vLLM venv by test_vllm_internals.py: checks each vLLM-internal fact the
adapter (src/weightcache/integrations/vllm.py) relies on, against the vLLM installed,
and prints one JSON object {fact: {"ok": bool, "detail": str}}.

A fact that stops holding after a vLLM upgrade fails its test by name, before anything
subtler breaks."""

import inspect
import json
import resource
import sys
import traceback

import torch
from torch import nn

FACTS = {}


def fact(fn):
    FACTS[fn.__name__] = fn
    return fn


def linear_layer(n=256, k=128):
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.randn(n, k), requires_grad=False)
    layer.bias = None
    return layer


@fact
def entry_point_registers_the_load_format():
    """vLLM's general plugins include ours; after loading them, `--load-format
    weightcache` resolves to the adapter's loader class."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    loader = get_model_loader(LoadConfig(load_format="weightcache"))
    return type(loader).__name__ == "WeightcacheModelLoader", type(loader).__qualname__


@fact
def base_loader_runs_create_load_then_post_process():
    """BaseModelLoader.load_model: create_model, then load_weights, then
    process_weights_after_loading (the adapter's load_model keeps that order)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    src = inspect.getsource(BaseModelLoader.load_model)
    order = [src.find(s) for s in ("self.create_model(", "self.load_weights(", "process_weights_after_loading(")]
    return all(i >= 0 for i in order) and order == sorted(order), f"positions {order}"


@fact
def post_processing_signature():
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    params = list(inspect.signature(process_weights_after_loading).parameters)
    return params == ["model", "model_config", "target_device"], str(params)


@fact
def cpu_linear_post_processing_repacks_and_drops_the_weight():
    """Unpatched, an fp32 linear layer's weight is repacked into oneDNN memory and the
    parameter replaced by an empty one: normal vLLM keeps no unpacked weight."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    layer = linear_layer()
    UnquantizedLinearMethod().process_weights_after_loading(layer)
    return layer.weight.numel() == 0 and callable(getattr(layer, "cpu_linear", None)), \
        f"weight numel after: {layer.weight.numel()}"


@fact
def onednn_handler_holds_a_private_copy():
    """The oneDNN handler copies the weight at creation: writing the weight afterwards
    does not change its output. So oneDNN on shared memory would still be private."""
    import vllm._custom_ops as ops

    w, x = torch.randn(256, 128), torch.randn(4, 128)
    handler = ops.create_onednn_mm(w.t(), 32)
    before = ops.onednn_mm(handler, x, None)
    w.mul_(2.0)
    after = ops.onednn_mm(handler, x, None)
    return torch.equal(before, after), "output unchanged after the weight was doubled"


@fact
def post_processing_looks_up_the_cpu_gemm_dispatch_at_call_time():
    """Both unquantized methods import dispatch_cpu_unquantized_gemm from
    vllm.model_executor.layers.utils when they run, so the adapter's shared_cpu_gemm()
    (which swaps it there for the duration of post-processing) takes effect: the weight
    stays the same tensor and the layer computes with F.linear."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from weightcache.integrations.vllm import shared_cpu_gemm

    results = []
    for method in (UnquantizedLinearMethod(), UnquantizedEmbeddingMethod()):
        layer = linear_layer()
        ptr = layer.weight.data_ptr()
        with shared_cpu_gemm():
            method.process_weights_after_loading(layer)
        results.append(layer.weight.data_ptr() == ptr and layer.cpu_linear is torch.nn.functional.linear)
    return all(results), f"linear, embedding: {results}"


@fact
def cpu_gemm_goes_through_layer_cpu_linear():
    """On CPU, unquantized linear and lm_head matmuls call layer.cpu_linear(x, weight,
    bias): what post-processing set there is the kernel that runs."""
    from vllm.model_executor.layers.utils import cpu_unquantized_gemm, dispatch_unquantized_gemm

    return dispatch_unquantized_gemm() is cpu_unquantized_gemm, dispatch_unquantized_gemm().__name__


@fact
def f_linear_matches_onednn_closely_not_bitwise():
    """What cpu_gemm=shared changes: F.linear and vLLM's oneDNN matmul agree to float32
    rounding (relative error < 1e-5), not bit for bit."""
    import vllm._custom_ops as ops

    torch.manual_seed(0)
    w, x = torch.randn(1024, 512) * 0.02, torch.randn(8, 512)
    ref = torch.nn.functional.linear(x, w)
    out = ops.onednn_mm(ops.create_onednn_mm(w.t(), 32), x, None)
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    return rel < 1e-5, f"max relative difference {rel:.2e}, bitwise equal: {torch.equal(out, ref)}"


@fact
def attention_post_processing_writes_its_scale_buffers():
    """Attention's post-processing fills _k_scale/_v_scale/_q_scale/_prob_scale in place
    (the SIGSEGV on read-only memory): they are buffers, kept private by the adapter."""
    from vllm.model_executor.layers.attention.attention import set_default_quant_scales

    layer = nn.Module()
    set_default_quant_scales(layer, register_buffer=True)
    names = ["_k_scale", "_v_scale", "_q_scale", "_prob_scale"]
    ptrs = {n: getattr(layer, n).data_ptr() for n in names}
    for n in names:
        getattr(layer, n).zero_()
    set_default_quant_scales(layer, register_buffer=False)
    in_place = all(getattr(layer, n).data_ptr() == ptrs[n] and getattr(layer, n).item() == 1.0 for n in names)
    buffers = all(n in layer._buffers for n in names)
    return in_place and buffers, f"written in place: {in_place}, registered as buffers: {buffers}"


@fact
def parameters_are_torch_empty_so_unwritten_pages_cost_nothing():
    """UnquantizedLinearMethod.create_weights allocates with torch.empty; on the CPU a
    large empty tensor adds no resident memory until written (a hit never writes it)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    src = inspect.getsource(UnquantizedLinearMethod.create_weights)
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()  # noqa: E731
    before = rss()
    t = torch.empty(256 << 20, dtype=torch.uint8)  # 256 MiB
    grown = rss() - before
    del t
    return "torch.empty(" in src and grown < (16 << 20), f"RSS grew {grown >> 20} MiB for 256 MiB empty"


@fact
def loader_extra_config_reaches_the_loader():
    """--model-loader-extra-config arrives as LoadConfig.model_loader_extra_config."""
    from vllm.config.load import LoadConfig
    from weightcache.integrations.vllm import WeightcacheModelLoader

    loader = WeightcacheModelLoader(LoadConfig(load_format="weightcache",
                                               model_loader_extra_config={"cpu_gemm": "onednn"}))
    return loader.cpu_gemm == "onednn", loader.cpu_gemm


def main():
    results = {}
    for name, fn in FACTS.items():
        try:
            ok, detail = fn()
        except Exception:
            ok, detail = False, traceback.format_exc()
        results[name] = {"ok": bool(ok), "detail": str(detail)}
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
