"""One rank's Llama forward pass in tensor parallel, in plain torch ops.

The split is transformers' base_model_tp_plan for Llama: q/k/v/gate/up are
column-parallel (a rank holds its heads and its part of the MLP's width), o/down are
row-parallel (a rank holds the matching input columns; their outputs are summed over
the group with all_reduce); embeddings, norms and lm_head are replicated, so every
rank ends with the same logits. Block-wise FP8 weights are dequantized per block to
bf16 before the first use, on the rank's own shard.

Pure given its inputs: the weights (views on a cache's slabs or tensors from disk, as
the same names and shapes), the config, the tokens and the process group.
"""

from dataclasses import dataclass

LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class UnsupportedModel(ValueError):
    """A config this forward pass does not implement, or weights that do not fit it."""


@dataclass(frozen=True)
class LlamaShape:
    """What one rank needs to know of the model: sizes, and its share of the heads."""

    layers: int
    hidden: int
    heads: int  # this rank's attention heads
    kv_heads: int  # this rank's key/value heads
    head_dim: int
    eps: float
    rope_theta: float
    tied: bool

    @classmethod
    def from_config(cls, config: dict, tp_size: int) -> "LlamaShape":
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        if heads % tp_size or kv_heads % tp_size:
            raise UnsupportedModel(f"{heads} attention heads and {kv_heads} key/value heads do not split over "
                                   f"{tp_size} ranks; the tensor-parallel size must divide both")
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
            raise UnsupportedModel(f"rope {rope.get('rope_type') or config.get('rope_scaling')!r}: only the default "
                                   "rotary embedding is implemented")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise UnsupportedModel("attention or MLP biases are not implemented")
        return cls(layers=config["num_hidden_layers"], hidden=config["hidden_size"], heads=heads // tp_size,
                   kv_heads=kv_heads // tp_size,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   eps=config.get("rms_norm_eps", 1e-6),
                   rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
                   tied=bool(config.get("tie_word_embeddings")))


def dequantize_block_fp8(weight, scale_inv, block: tuple[int, int], name: str = "weight"):
    """bf16 from float8 weights and one float32 scale per (block[0] x block[1]) block."""
    import torch

    rows, cols = weight.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != want:
        raise UnsupportedModel(f"{name}: {tuple(scale_inv.shape)} scales for a {rows}x{cols} weight; blocks of "
                               f"{block[0]}x{block[1]} need {want} (is the shard cut inside a block?)")
    scales = scale_inv.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scales).to(torch.bfloat16)


def compute_weights(tensors: dict, config: dict) -> dict:
    """The weights as the forward uses them: bf16 as they are (no copy), block-wise FP8
    dequantized (a new tensor per weight; the shared scales and bytes stay untouched)."""
    qc = config.get("quantization_config") or {}
    block = qc.get("weight_block_size")
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        if scale is not None:
            if not block:
                raise UnsupportedModel(f"{name} has scales but the config has no quantization_config.weight_block_size")
            tensor = dequantize_block_fp8(tensor, scale, tuple(block), name)
        out[name] = tensor
    return out


def _rms_norm(x, weight, eps: float):
    import torch

    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def _rotary(positions, shape: LlamaShape, dtype):
    import torch

    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, device=positions.device,
                                                        dtype=torch.float32) / shape.head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x, cos, sin):
    import torch

    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def forward(weights: dict, shape: LlamaShape, tokens, all_reduce):
    """Logits [batch, seq, vocab] of this rank (every rank's are equal). `all_reduce`
    sums a tensor over the tensor-parallel group in place (torch.distributed.all_reduce)."""
    import torch
    import torch.nn.functional as F

    def w(name):
        try:
            return weights[name]
        except KeyError:
            raise UnsupportedModel(f"the weights have no {name!r}; is this a Llama checkpoint?") from None

    batch, seq = tokens.shape
    h = F.embedding(tokens, w("model.embed_tokens.weight"))
    cos, sin = _rotary(torch.arange(seq, device=tokens.device), shape, h.dtype)
    group = shape.heads // shape.kv_heads
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        x = _rms_norm(h, w(p + "input_layernorm.weight"), shape.eps)
        q = F.linear(x, w(p + "self_attn.q_proj.weight")).view(batch, seq, shape.heads, shape.head_dim).transpose(1, 2)
        k = F.linear(x, w(p + "self_attn.k_proj.weight")).view(batch, seq, shape.kv_heads, shape.head_dim).transpose(1, 2)
        v = F.linear(x, w(p + "self_attn.v_proj.weight")).view(batch, seq, shape.kv_heads, shape.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = F.linear(attn.transpose(1, 2).reshape(batch, seq, shape.heads * shape.head_dim),
                       w(p + "self_attn.o_proj.weight"))
        all_reduce(out)
        h = h + out
        x = _rms_norm(h, w(p + "post_attention_layernorm.weight"), shape.eps)
        out = F.linear(F.silu(F.linear(x, w(p + "mlp.gate_proj.weight"))) * F.linear(x, w(p + "mlp.up_proj.weight")),
                       w(p + "mlp.down_proj.weight"))
        all_reduce(out)
        h = h + out
    h = _rms_norm(h, w("model.norm.weight"), shape.eps)
    return F.linear(h, w("model.embed_tokens.weight" if shape.tied else "lm_head.weight"))
