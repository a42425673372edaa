"""Tensor parallel over every GPU of the machine: ONE daemon (`--device all`, cuda-vmm)
serves each GPU its rank's shard, and the engine's ranks (NCCL, one process per GPU)
attach at once and compute the same logits as the same engine loading from disk.

Needs at least two GPUs (the lent multi-GPU machine, through bench/gpu_multi_suite.sh);
skipped elsewhere.
"""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs at least two CUDA devices", allow_module_level=True)

from weightcache.client import gpu  # noqa: E402
from weightcache.synthetic_llama import llama_config, write_llama  # noqa: E402
from weightcache.tp_engine import report_from  # noqa: E402

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count()
TP = max(t for t in (2, 4, 8) if t <= GPUS and GPUS % t == 0)
# About 0.8 GB in bf16; every split (heads, key/value heads, 128x128 FP8 blocks) divides by 8.
DIMS = dict(hidden_size=2048, intermediate_size=8192, layers=4, heads=16, kv_heads=8, vocab_size=32000)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def run_engine(model, *args):
    return subprocess.run([sys.executable, "-m", "weightcache.tp_engine", "--model", str(model), "--device", "cuda",
                           "--nproc", str(TP), *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **NO_MULTICAST})


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-block"])
def test_tp_ranks_attach_their_gpus_shards_at_once_and_match_disk_bit_for_bit(tmp_path, socket_dir, daemons, fp8):
    model = write_llama(tmp_path / "llama", llama_config(**DIMS, fp8=fp8), device="cuda", shard_bytes=256 << 20)
    daemons.start(model, socket_dir, extra=["--backend", "cuda-vmm", "--device", "all", "--tp-size", str(TP)])
    cached = run_engine(model, "--source", "cache", "--socket-dir", socket_dir, "--verify-shards",
                        "--logits-out", tmp_path / "cache.pt")
    assert cached.returncode == 0, cached.stderr[-4000:]
    from_disk = run_engine(model, "--source", "disk", "--logits-out", tmp_path / "disk.pt")
    assert from_disk.returncode == 0, from_disk.stderr[-4000:]

    report = report_from(cached.stdout)
    uuids = gpu.visible_uuids()
    assert [r["device"] for r in report["ranks"]] == uuids[:TP]
    assert all(r["backend"] == "cuda-vmm" and uuids[r["rank"]] in r["socket"] for r in report["ranks"])
    assert report["shards_match_disk"] and report["ranks_agree"] and report["logits_finite"]
    actual, expected = torch.load(tmp_path / "cache.pt"), torch.load(tmp_path / "disk.pt")
    assert torch.equal(actual.view(torch.int16), expected.view(torch.int16))
