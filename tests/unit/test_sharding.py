import pathlib

import pytest

from weightcache.client.errors import CheckpointError
from weightcache.client.tp_plan import TpPlan, plan_for, shard_dim
from weightcache.daemon.checkpoint import TensorSource
from weightcache.daemon.sharding import shard

LLAMA_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.down_proj": "rowwise",
}


def src(name, shape, dtype="BF16", offset=1000):
    numel = 1
    for d in shape:
        numel *= d
    return TensorSource(name, dtype, tuple(shape), pathlib.Path("m.safetensors"), offset, numel * 2)


def test_patterns_match_whole_segments_after_any_prefix():
    plan = TpPlan.from_dict(LLAMA_PLAN, "test")
    assert plan.style_of("model.layers.3.self_attn.q_proj") == "colwise"
    assert plan.style_of("layers.12.mlp.down_proj") == "rowwise"
    assert plan.style_of("model.layers.3.self_attn.q_proj_extra") is None
    assert plan.style_of("model.layers.x.y.self_attn.q_proj") is None
    assert plan.style_of("model.norm") is None


def test_colwise_splits_weight_and_bias_rows_rowwise_splits_columns_and_replicates_bias():
    plan = TpPlan.from_dict(LLAMA_PLAN, "test")
    assert shard_dim(plan, "model.layers.0.self_attn.q_proj.weight", 2) == 0
    assert shard_dim(plan, "model.layers.0.self_attn.q_proj.bias", 1) == 0
    assert shard_dim(plan, "model.layers.0.self_attn.o_proj.weight", 2) == 1
    assert shard_dim(plan, "model.layers.0.self_attn.o_proj.bias", 1) is None
    assert shard_dim(plan, "model.norm.weight", 1) is None


def test_a_row_shard_is_one_contiguous_range_and_a_column_shard_is_strided_rows():
    plan = TpPlan.from_dict(LLAMA_PLAN, "test")
    q, o = src("layers.0.self_attn.q_proj.weight", (8, 6)), src("layers.0.self_attn.o_proj.weight", (4, 8))
    q1, o1 = shard([q, o], plan, 2, 1)
    assert (q1.shape, q1.offset, q1.nbytes, q1.rows) == ((4, 6), 1000 + 48, 48, 1)
    assert (o1.shape, o1.offset, o1.nbytes, o1.rows, o1.pitch) == ((4, 4), 1000 + 8, 32, 4, 16)


def test_uneven_splits_and_unknown_styles_are_refused():
    plan = TpPlan.from_dict(LLAMA_PLAN, "test")
    with pytest.raises(CheckpointError, match="does not split into 3 equal parts"):
        shard([src("layers.0.self_attn.q_proj.weight", (8, 6))], plan, 3, 0)
    with pytest.raises(CheckpointError, match="style 'diagonal'"):
        TpPlan.from_dict({"x": "diagonal"}, "plan.json")


def test_tensor_parallel_without_a_plan_says_how_to_give_one(tmp_path):
    assert plan_for({}, None) is None
    with pytest.raises(CheckpointError, match="--tp-plan"):
        shard([src("a", (2,))], None, 2, 0)
    (tmp_path / "plan.json").write_text('["colwise"]')
    with pytest.raises(CheckpointError, match="JSON object"):
        plan_for({}, tmp_path / "plan.json")
    assert plan_for({"base_model_tp_plan": LLAMA_PLAN}, None).style_of("layers.1.mlp.down_proj") == "rowwise"
