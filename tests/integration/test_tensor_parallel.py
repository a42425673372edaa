"""Tensor-parallel caches: each rank's slabs hold exactly the slice of each tensor that
rank's engine expects, compared with slicing the full tensor from disk."""

import json

import pytest
import torch

from weightcache.client import FingerprintMismatch, Parallelism, attach, load_from_disk
from weightcache.synthetic import write_model

PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.down_proj": "rowwise",
}
SPECS = {
    "model.embed_tokens.weight": ("F32", (50, 8)),
    "model.layers.0.self_attn.q_proj.weight": ("BF16", (16, 8)),
    "model.layers.0.self_attn.q_proj.bias": ("F32", (16,)),
    "model.layers.0.self_attn.o_proj.weight": ("BF16", (8, 16)),
    "model.layers.0.self_attn.o_proj.bias": ("F32", (8,)),
    "model.layers.0.mlp.down_proj.weight": ("F16", (4, 6, 16)),
    "model.norm.weight": ("F32", (8,)),
}
SPLIT_DIM = {
    "model.layers.0.self_attn.q_proj.weight": 0,
    "model.layers.0.self_attn.q_proj.bias": 0,
    "model.layers.0.self_attn.o_proj.weight": 1,
    "model.layers.0.mlp.down_proj.weight": 2,
}


def expected_shard(full, name, tp_size, tp_rank):
    dim = SPLIT_DIM.get(name)
    return full if dim is None else torch.chunk(full, tp_size, dim)[tp_rank]


def check_every_rank(model, socket_dir, daemons, tp_size, extra=()):
    full = load_from_disk(model)
    for rank in range(tp_size):
        daemons.start(model, socket_dir, name=f"tp{rank}",
                      extra=["--tp-size", str(tp_size), "--tp-rank", str(rank), *extra])
    for rank in range(tp_size):
        with attach(model, socket_dir=socket_dir, cache_name=f"tp{rank}",
                    parallel=Parallelism(tp_size=tp_size, tp_rank=rank)) as att:
            assert set(att.tensors) == set(full)
            for name, tensor in att.tensors.items():
                want = expected_shard(full[name], name, tp_size, rank)
                assert tensor.shape == want.shape, name
                assert torch.equal(tensor.view(torch.uint8), want.contiguous().view(torch.uint8)), name


def test_two_ranks_from_the_configs_base_model_tp_plan(tmp_path, socket_dir, daemons):
    config = {"model_type": "synthetic", "torch_dtype": "float32", "base_model_tp_plan": PLAN}
    model = write_model(tmp_path / "m", SPECS, shards=2, config=config)
    check_every_rank(model, socket_dir, daemons, 2)


def test_four_ranks_from_a_plan_file(tmp_path, socket_dir, daemons):
    model = write_model(tmp_path / "m", SPECS)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    check_every_rank(model, socket_dir, daemons, 4, extra=["--tp-plan", str(plan)])


def test_an_engine_of_another_rank_is_refused_naming_the_rank(tmp_path, socket_dir, daemons):
    config = {"model_type": "synthetic", "base_model_tp_plan": PLAN}
    model = write_model(tmp_path / "m", SPECS, config=config)
    daemons.start(model, socket_dir, name="tp0", extra=["--tp-size", "2", "--tp-rank", "0"])
    with pytest.raises(FingerprintMismatch, match="tp_rank: engine expects '1', daemon has '0'"):
        attach(model, socket_dir=socket_dir, cache_name="tp0", parallel=Parallelism(tp_size=2, tp_rank=1))
