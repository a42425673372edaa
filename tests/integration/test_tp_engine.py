"""The tensor-parallel engine on the cpu backend: two gloo ranks, one cache per rank.

A Llama generated from a transformers config (bf16, and block-wise FP8) is served by
two daemons (`--tp-size 2 --tp-rank r`); the engine's ranks attach to their own cache
and run the forward pass, which must equal the same engine loading its shards from
disk bit for bit.
"""

import json
import subprocess
import sys

import pytest
import torch

from weightcache.client import CheckpointError, Parallelism, attach, load_from_disk, load_weights
from weightcache.llama_tp import LlamaShape, UnsupportedModel, dequantize_block_fp8
from weightcache.synthetic_llama import llama_config, write_llama
from weightcache.tp_engine import report_from

TP = 2
# The split an engine expects for a Llama (rows of q/k/v/gate/up, columns of o/down);
# written out here, not taken from the plan code under test.
SPLIT_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1}


def expected_dim(name: str):
    parts = name.split(".")
    return SPLIT_DIM.get(parts[-2]) if len(parts) >= 2 else None


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    bf16 = llama_config(hidden_size=64, intermediate_size=128, layers=2, heads=4, kv_heads=2, vocab_size=128)
    # FP8 blocks are 128x128: every split dim is a whole number of blocks per rank.
    fp8 = llama_config(hidden_size=256, intermediate_size=512, layers=2, heads=2, kv_heads=2, vocab_size=256, fp8=True)
    return {"bf16": write_llama(root / "bf16", bf16, shard_bytes=40_000),
            "fp8": write_llama(root / "fp8", fp8, shard_bytes=400_000)}


def start_rank_caches(daemons, model, socket_dir):
    for rank in range(TP):
        daemons.start(model, socket_dir, name=f"r{rank}", extra=["--tp-size", str(TP), "--tp-rank", str(rank)])


def run_engine(model, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightcache.tp_engine", "--model", str(model), "--device", "cpu",
                           "--nproc", str(TP), *map(str, args)], capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_tp_forward_on_attached_shards_is_bit_identical_to_disk(models, variant, socket_dir, daemons, tmp_path):
    model = models[variant]
    start_rank_caches(daemons, model, socket_dir)
    cached = run_engine(model, "--source", "cache", "--socket-dir", socket_dir, "--verify-shards",
                        "--logits-out", tmp_path / "cache.pt")
    assert cached.returncode == 0, cached.stderr
    from_disk = run_engine(model, "--source", "disk", "--logits-out", tmp_path / "disk.pt")
    assert from_disk.returncode == 0, from_disk.stderr
    cache_report, disk_report = report_from(cached.stdout), report_from(from_disk.stdout)
    assert [r["socket"].rsplit("/", 1)[1].split("__")[0] for r in cache_report["ranks"]] == ["r0", "r1"]
    assert cache_report["shards_match_disk"] and cache_report["ranks_agree"] and cache_report["logits_finite"]
    expected, actual = torch.load(tmp_path / "disk.pt"), torch.load(tmp_path / "cache.pt")
    assert actual.shape == (2, 32, json.loads((model / "config.json").read_text())["vocab_size"])
    assert torch.equal(actual.view(torch.int16), expected.view(torch.int16))
    assert cache_report["logits_sha256"] == disk_report["logits_sha256"]


@pytest.mark.parametrize("variant", ["bf16", "fp8"])
def test_each_rank_holds_exactly_its_slice_of_every_tensor(models, variant, socket_dir, daemons):
    model = models[variant]
    start_rank_caches(daemons, model, socket_dir)
    full = load_from_disk(model)
    for rank in range(TP):
        parallel = Parallelism(tp_size=TP, tp_rank=rank)
        from_disk = load_from_disk(model, parallel=parallel)
        with attach(model, socket_dir=socket_dir, parallel=parallel) as attached:
            assert attached.cache_name == f"r{rank}" and set(attached.tensors) == set(full) == set(from_disk)
            for name, tensor in attached.tensors.items():
                dim = expected_dim(name)
                want = full[name] if dim is None else torch.chunk(full[name], TP, dim)[rank]
                for got in (tensor, from_disk[name]):
                    assert got.dtype == want.dtype and got.shape == want.shape, name
                    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), name


def test_a_rank_attached_to_the_other_ranks_cache_is_refused_naming_tp_rank(models, socket_dir, daemons):
    model = models["bf16"]
    start_rank_caches(daemons, model, socket_dir)
    result = run_engine(model, "--source", "cache", "--socket-dir", socket_dir, "--cache", "r0")
    assert result.returncode == 1
    assert "rank 1: FingerprintMismatch" in result.stderr
    assert "tp_rank: engine expects '1', daemon has '0'" in result.stderr


def test_a_tp_engine_loading_from_disk_by_policy_gets_its_own_shard(models):
    loaded = load_weights(models["bf16"], mode="off", tp_size=TP, tp_rank=1)
    full = load_from_disk(models["bf16"])
    name = "model.layers.1.mlp.down_proj.weight"
    assert loaded.source == "disk" and torch.equal(loaded.tensors[name], torch.chunk(full[name], TP, 1)[1])


def test_what_the_plan_or_the_model_cannot_split_is_refused_by_name(models, tmp_path):
    with pytest.raises(CheckpointError, match="does not split into 3 equal parts"):
        load_from_disk(models["bf16"], parallel=Parallelism(tp_size=3, tp_rank=0))
    config = json.loads((models["bf16"] / "config.json").read_text())
    with pytest.raises(UnsupportedModel, match="4 attention heads and 2 key/value heads do not split over 4"):
        LlamaShape.from_config(config, 4)
    unplanned = tmp_path / "unplanned"
    write_llama(unplanned, {k: v for k, v in config.items() if k != "base_model_tp_plan"})
    with pytest.raises(CheckpointError, match="needs a plan"):
        load_from_disk(unplanned, parallel=Parallelism(tp_size=2, tp_rank=0))
    # An FP8 shard cut inside a block would be scaled wrongly: refused, not computed.
    with pytest.raises(UnsupportedModel, match="cut inside a block"):
        dequantize_block_fp8(torch.zeros(64, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 2), (128, 128))
