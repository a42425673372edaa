"""Device memory with cuda-vmm: engines add no weight memory, and the weights are freed
only when the last process holding them exits (engines outlive the daemon)."""

import signal

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device on this machine", allow_module_level=True)

from procs import wait_until  # noqa: E402
from weightcache.client import gpu  # noqa: E402
from weightcache.synthetic import uniform_specs, write_model  # noqa: E402

pytestmark = pytest.mark.gpu

MODEL_BYTES = 4 << 30


def used_bytes() -> int:
    free, total = torch.cuda.mem_get_info(0)
    return total - free


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("big") / "m", uniform_specs(256, MODEL_BYTES))


def test_four_engines_add_contexts_not_weights_and_memory_goes_with_the_last_holder(big_model, socket_dir,
                                                                                    daemons, engines):
    uuid = gpu.device_uuid(0)
    torch.cuda.init()
    torch.empty(1, device="cuda")  # this process's own context, before the baseline
    baseline = used_bytes()
    daemon = daemons.start(big_model, socket_dir, extra=["--backend", "cuda-vmm", "--device", uuid])
    after_daemon = used_bytes()
    assert after_daemon - baseline >= MODEL_BYTES

    first = engines(big_model, socket_dir, device=uuid, fallback="error")
    after_one = used_bytes()
    rest = [engines(big_model, socket_dir, device=uuid, fallback="error") for _ in range(3)]
    after_four = used_bytes()
    assert all(e.hello["source"] == "cache" for e in [first, *rest])
    per_engine = (after_four - after_one) / 3
    # An engine's CUDA context is a few hundred MiB; a copy of the weights would be 4 GiB.
    assert per_engine < MODEL_BYTES / 4, f"each engine added {per_engine / 2**20:.0f} MiB"

    daemon.send_signal(signal.SIGKILL)
    daemon.wait()
    for engine in [first, *rest][:-1]:
        engine.stop()
    # One engine still maps the weights: they stay.
    assert used_bytes() - baseline >= MODEL_BYTES
    assert rest[-1].ask("checksum")["checksum"] == first.hello["checksum"]
    rest[-1].stop()
    wait_until(lambda: used_bytes() - baseline < MODEL_BYTES / 4, timeout=60,
               what="the weights' device memory to be freed after the last holder exited")
