import pytest
import torch

from weightcache.client import BindError, bind


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.LayerNorm(4)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("positions", torch.arange(6), persistent=False)


def meta_model():
    with torch.device("meta"):
        return Tied()


def weights():
    return {"embed.weight": torch.randn(10, 4), "norm.weight": torch.ones(4), "norm.bias": torch.zeros(4),
            "scale": torch.full((4,), 2.0)}


def test_binds_without_copying_and_keeps_tied_weights_tied():
    model, w = meta_model(), weights()
    bind(model, w)
    assert model.embed.weight.data_ptr() == w["embed.weight"].data_ptr()
    assert model.head.weight is model.embed.weight
    assert model.scale.data_ptr() == w["scale"].data_ptr()
    assert model.positions.is_meta  # non-persistent and absent: left to the module


def test_the_tied_weight_may_come_under_either_name():
    w = weights()
    w["head.weight"] = w.pop("embed.weight")
    model = meta_model()
    bind(model, w)
    assert model.head.weight is model.embed.weight


def test_a_non_persistent_buffer_present_in_the_checkpoint_is_bound():
    model, w = meta_model(), {**weights(), "positions": torch.arange(6)}
    bind(model, w)
    assert torch.equal(model.positions, torch.arange(6))


def test_every_problem_is_reported_at_once():
    w = weights()
    del w["norm.bias"]
    w["scale"] = torch.ones(5)
    w["embed.weight"] = w["embed.weight"].half()
    w["extra"] = torch.ones(1)
    with pytest.raises(BindError) as info:
        bind(meta_model(), w)
    message = str(info.value)
    assert "missing: norm.bias" in message
    assert "mismatch: scale expects (4,)" in message
    assert "mismatch: embed.weight" in message and "torch.float16" in message
    assert "unexpected: extra" in message
