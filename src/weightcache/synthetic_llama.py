"""Write a Llama checkpoint from a transformers config with random weights, without
building the model: the tensors are generated (on the GPU where given) and saved shard
by shard, so a 40 GB checkpoint takes as long as the disk needs to take it.

config.json is transformers' LlamaConfig, plus its `base_model_tp_plan` (which
to_dict() leaves out) so that daemons and engines shard by it. With fp8=True the
linear weights of the layers are block-wise FP8 (float8_e4m3fn with a float32
`weight_scale_inv` per block, quantization_config.weight_block_size), as DeepSeek-V3
and Qwen3 FP8 checkpoints store them; embeddings, norms and lm_head stay bf16.
"""

import json
import pathlib
from concurrent.futures import ThreadPoolExecutor

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FP8_BLOCK = (128, 128)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INIT_STD = 0.02  # transformers' initializer_range: keeps a deep random model's activations finite


def llama_config(*, hidden_size: int, intermediate_size: int, layers: int, heads: int, kv_heads: int,
                 vocab_size: int, fp8: bool = False) -> dict:
    """config.json of a Llama with these dimensions (bf16 weights, untied lm_head)."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab_size,
                         tie_word_embeddings=False, dtype="bfloat16")
    doc = {**config.to_dict(), "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16",
           "base_model_tp_plan": dict(config.base_model_tp_plan)}
    if fp8:
        doc["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                      "weight_block_size": list(FP8_BLOCK)}
    return doc


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def llama_specs(config: dict) -> dict:
    """Tensor name -> (safetensors dtype, shape), in the order a model lists them."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_out = config["num_attention_heads"] * head_dim(config)
    kv_out = config["num_key_value_heads"] * head_dim(config)
    shapes = {"self_attn.q_proj": (q_out, hidden), "self_attn.k_proj": (kv_out, hidden),
              "self_attn.v_proj": (kv_out, hidden), "self_attn.o_proj": (hidden, q_out),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    fp8 = "quantization_config" in config
    specs = {"model.embed_tokens.weight": ("BF16", (vocab, hidden))}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        specs[prefix + "input_layernorm.weight"] = ("BF16", (hidden,))
        for linear in LINEARS:
            out, inp = shapes[linear]
            if fp8:
                specs[prefix + linear + ".weight"] = ("F8_E4M3", (out, inp))
                specs[prefix + linear + ".weight_scale_inv"] = ("F32", (-(-out // FP8_BLOCK[0]), -(-inp // FP8_BLOCK[1])))
            else:
                specs[prefix + linear + ".weight"] = ("BF16", (out, inp))
        specs[prefix + "post_attention_layernorm.weight"] = ("BF16", (hidden,))
    specs["model.norm.weight"] = ("BF16", (hidden,))
    specs["lm_head.weight"] = ("BF16", (vocab, hidden))
    return specs


def quantize_block_fp8(weight, block=FP8_BLOCK):
    """(float8_e4m3fn weight, float32 scale_inv per block) with weight ≈ fp8 * scale_inv."""
    import torch

    rows, cols = weight.shape
    br, bc = block
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % bc, 0, -rows % br))
    blocks = padded.unflatten(0, (-1, br)).unflatten(2, (-1, bc))  # (row blocks, br, col blocks, bc)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    quantized = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized.flatten(2, 3).flatten(0, 1)[:rows, :cols].contiguous(), scale


def _generate(specs: dict, names: list[str], device: str, seed: int) -> dict:
    """The named tensors, on the CPU, generated on `device`; each from its own seed."""
    import torch

    out = {}
    for name in names:
        if name.endswith("_scale_inv"):
            continue  # made with its weight
        dtype, shape = specs[name]
        g = torch.Generator(device=device).manual_seed(seed + list(specs).index(name))
        values = torch.randn(shape, generator=g, device=device, dtype=torch.float32 if dtype == "F8_E4M3"
                             else torch.bfloat16)
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            values = values.mul_(INIT_STD).add_(1.0)
        else:
            values = values.mul_(INIT_STD)
        if dtype == "F8_E4M3":
            values, scale = quantize_block_fp8(values)
            out[name + "_scale_inv"] = scale.cpu()
        out[name] = values.cpu()
    return out


def shard_names(specs: dict, shard_bytes: int) -> list[list[str]]:
    """Consecutive tensors grouped into shards of at most shard_bytes (one tensor may be more)."""
    from weightcache.client.dtypes import DTYPES

    shards, size = [[]], 0
    for name, (dtype, shape) in specs.items():
        nbytes = DTYPES[dtype].itemsize
        for d in shape:
            nbytes *= d
        # A scale stays in its weight's shard.
        if shards[-1] and size + nbytes > shard_bytes and not name.endswith("_scale_inv"):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_llama(model_dir, config: dict, *, device: str = "cpu", shard_bytes: int = 5 << 30, seed: int = 0,
                writers: int = 4, on_shard=lambda name: None) -> pathlib.Path:
    """Write config.json, the shards and their index; returns model_dir. Shards are
    generated and written `writers` at a time (the disk, not Python, is the limit)."""
    from safetensors.torch import save_file

    model_dir = pathlib.Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    specs = llama_specs(config)
    shards = shard_names(specs, shard_bytes)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    def write(index: int) -> None:
        save_file(_generate(specs, shards[index], device, seed), model_dir / files[index], metadata={"format": "pt"})
        on_shard(files[index])

    with ThreadPoolExecutor(max(1, writers)) as pool:
        list(pool.map(write, range(len(shards))))
    weight_map = {name: file for names, file in zip(shards, files) for name in names}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model_dir
