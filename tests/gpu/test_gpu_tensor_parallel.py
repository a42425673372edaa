"""Tensor-parallel shards loaded into GPU slabs (strided rows copied as 2-D regions)
match slices of the full tensors."""

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device on this machine", allow_module_level=True)

from weightcache.client import Parallelism, attach, gpu, load_from_disk  # noqa: E402
from weightcache.synthetic import write_model  # noqa: E402

pytestmark = pytest.mark.gpu

PLAN = {"layers.*.q_proj": "colwise", "layers.*.o_proj": "rowwise"}
SPECS = {"layers.0.q_proj.weight": ("BF16", (4096, 512)), "layers.0.q_proj.bias": ("F32", (4096,)),
         "layers.0.o_proj.weight": ("BF16", (512, 40960)), "norm.weight": ("F32", (512,))}
SPLIT = {"layers.0.q_proj.weight": 0, "layers.0.q_proj.bias": 0, "layers.0.o_proj.weight": 1}


@pytest.mark.parametrize("backend", ["cuda-vmm", "cuda-ipc"])
def test_each_rank_holds_its_slice_on_the_gpu(tmp_path, socket_dir, daemons, backend):
    uuid = gpu.device_uuid(0)
    model = write_model(tmp_path / "m", SPECS, config={"model_type": "synthetic", "base_model_tp_plan": PLAN})
    full = load_from_disk(model)
    for rank in range(2):
        daemons.start(model, socket_dir, name=f"r{rank}",
                      extra=["--backend", backend, "--device", uuid, "--tp-size", "2", "--tp-rank", str(rank)])
        with attach(model, socket_dir=socket_dir, cache_name=f"r{rank}", device=uuid,
                    parallel=Parallelism(tp_size=2, tp_rank=rank)) as att:
            for name, tensor in att.tensors.items():
                dim = SPLIT.get(name)
                want = full[name] if dim is None else torch.chunk(full[name], 2, dim)[rank]
                assert torch.equal(tensor.cpu().view(torch.uint8), want.contiguous().view(torch.uint8)), name
