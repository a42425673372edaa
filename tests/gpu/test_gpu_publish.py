"""Engine-published caches on cuda-vmm (issue 12, the GPU part; vLLM's CUDA build is not
installable on the GPU machine, so the engine is tests/gpu/fused_engine.py, which has a
fused layout of its own): publish, exit, attach read-only bit-identical; a writer killed
mid-write leaves nothing served; the memory goes with the last holder."""

import pathlib
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device on this machine", allow_module_level=True)

from procs import read_json_line, wait_until  # noqa: E402
from weightcache.client import gpu, query_status  # noqa: E402
from weightcache.client.publish import store_sockets  # noqa: E402

from weightcache.synthetic import write_model  # noqa: E402

pytestmark = pytest.mark.gpu

ENGINE = pathlib.Path(__file__).with_name("fused_engine.py")
CACHE = "fused"
GIB = 4.0


def used_bytes() -> int:
    free, total = torch.cuda.mem_get_info(0)
    return total - free


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # The checkpoint the engine "loaded" (its identity goes into the fingerprint).
    return write_model(tmp_path_factory.mktemp("fused") / "m", {"w": ("BF16", (16, 16))})


class Proc:
    def __init__(self, mode, model_dir, socket_dir, log_dir):
        self.log = open(log_dir / f"{mode}-{id(self)}.log", "wb")
        self.proc = subprocess.Popen([sys.executable, str(ENGINE), mode, str(model_dir), str(socket_dir), CACHE,
                                      str(GIB)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)

    def read(self, timeout=180) -> dict:
        return read_json_line(self.proc, self.log.name, timeout)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def store(daemons, socket_dir):
    uuid = gpu.device_uuid(0)
    import os

    daemons.start(None, socket_dir, CACHE, ["--backend", "cuda-vmm", "--device", uuid,
                                             "--allow-publish-uid", str(os.geteuid()), "--commit-timeout", "120"])
    return store_sockets(socket_dir, CACHE, uuid)[0]


def test_published_on_cuda_vmm_survives_its_writer_and_attaches_read_only_bit_identical(model_dir, socket_dir, store,
                                                                                     tmp_path):
    torch.empty(1, device="cuda")
    baseline = used_bytes()
    writer = Proc("publish", model_dir, socket_dir, tmp_path)
    published = writer.read()
    assert published["source"] == "published"
    # The writer's own private weights and the published copy compute the same logits.
    assert published["output"] == published["own_output"]
    writer.stop()
    assert writer.proc.returncode == 0
    status = query_status(store)
    assert [c.fingerprint.engine for c in status.caches] == ["fused-test-engine"]
    assert status.caches[0].resident_bytes >= GIB * 2**30 * 0.9
    readers = [Proc("attach", model_dir, socket_dir, tmp_path) for _ in range(2)]
    answers = [r.read() for r in readers]
    assert {a["output"] for a in answers} == {published["output"]}
    assert all(a["source"] == "cache" and a["tensors"] == published["tensors"] for a in answers)
    # Two readers add their CUDA contexts, not a copy of the weights each.
    assert used_bytes() - baseline < status.caches[0].resident_bytes * 1.5
    for r in readers:
        r.stop()


def test_a_cuda_vmm_writer_killed_mid_write_leaves_nothing_served_and_frees_its_memory(model_dir, socket_dir, store,
                                                                                      tmp_path):
    torch.empty(1, device="cuda")
    baseline = used_bytes()
    writer = Proc("stall", model_dir, socket_dir, tmp_path)
    assert writer.read()["filling"]
    assert used_bytes() - baseline > GIB * 2**30  # its private weights and the slabs it is filling
    writer.proc.send_signal(signal.SIGKILL)
    writer.proc.wait()
    writer.stop()
    wait_until(lambda: used_bytes() - baseline < GIB * 2**30 / 4, timeout=60,
               what="the killed writer's slabs to be freed by the store")
    assert list(query_status(store).caches) == []
    # The store still takes a publication afterwards, and serves it.
    again = Proc("publish", model_dir, socket_dir, tmp_path)
    assert again.read()["source"] == "published"
    again.stop()
    reader = Proc("attach", model_dir, socket_dir, tmp_path)
    assert reader.read()["source"] == "cache"
    reader.stop()


def test_published_memory_goes_with_the_last_holder(model_dir, socket_dir, store, daemons, tmp_path):
    torch.empty(1, device="cuda")
    baseline = used_bytes()
    writer = Proc("publish", model_dir, socket_dir, tmp_path)
    out = writer.read()["output"]
    writer.stop()
    reader = Proc("attach", model_dir, socket_dir, tmp_path)
    assert reader.read()["output"] == out
    held = query_status(store).caches[0].resident_bytes
    daemons.procs[-1].send_signal(signal.SIGKILL)  # the store dies; the reader maps the memory still
    daemons.procs[-1].wait()
    assert used_bytes() - baseline >= held
    reader.stop()
    wait_until(lambda: used_bytes() - baseline < held / 4, timeout=60,
               what="the published memory to be freed once the last holder exited")
