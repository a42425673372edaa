import json

import pytest

from weightcache.client import fingerprint as fp
from weightcache.synthetic import write_model


@pytest.fixture
def model(tmp_path):
    return write_model(tmp_path / "m", {"a": ("F32", (4, 4)), "b": ("BF16", (8,))})


def test_same_inputs_give_the_same_digest(model):
    assert fp.digest(fp.compute(model)) == fp.digest(fp.compute(model))


def test_differences_name_each_field_with_both_values(model):
    mine = fp.compute(model, revision="r1", parallel=fp.Parallelism(tp_size=2, tp_rank=1))
    theirs = fp.compute(model, revision="r2")
    assert fp.differences(mine, theirs) == [("revision", "r1", "r2"), ("tp_size", "2", "1"), ("tp_rank", "1", "0")]


def test_a_changed_header_changes_the_model_hash(model, tmp_path):
    before = fp.model_hash(model)
    write_model(model, {"a": ("F32", (4, 4)), "b": ("BF16", (9,))})
    assert fp.model_hash(model) != before


def test_a_changed_config_changes_the_model_hash(model):
    before = fp.model_hash(model)
    (model / "config.json").write_text(json.dumps({"model_type": "synthetic", "hidden_size": 2}))
    assert fp.model_hash(model) != before


@pytest.mark.parametrize("config, label", [
    ({}, "none"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "fp8-block"),
    ({"quantization_config": {"quant_method": "fp8"}}, "fp8"),
    ({"quantization_config": {"quant_method": "AWQ"}}, "awq"),
    ({"quantization_config": {"load_in_4bit": True}}, "bitsandbytes"),
    ({"quantization_config": {}}, "unknown"),
])
def test_quantization_labels(config, label):
    assert fp.quantization_of(config)[0] == label


def test_parallel_ranks_are_checked():
    with pytest.raises(ValueError, match="tp rank 2 is outside 0..1"):
        fp.Parallelism(tp_size=2, tp_rank=2)
