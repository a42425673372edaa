"""The GPU backends on a real GPU: same protocol, slabs in device memory.

Runs where a CUDA device is present (the lent H200, through bench/gpu_suite.sh);
skipped on machines without one, such as CI.
"""

import json
import signal
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device on this machine", allow_module_level=True)

from weightcache.client import gpu  # noqa: E402
from weightcache.client import load_from_disk, query_status  # noqa: E402
from weightcache.client.attach import list_sockets  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_uuid():
    return gpu.device_uuid(0)


def checksum_of(model):
    from engine_proc import checksum

    return checksum(load_from_disk(model))


@pytest.mark.parametrize("backend", ["cuda-vmm", "cuda-ipc"])
@pytest.mark.parametrize("slab_mib", ["1024", "2"])
def test_engine_attaches_gpu_slabs_and_every_byte_matches_disk(small_model, socket_dir, daemons, gpu_uuid, backend,
                                                                slab_mib):
    daemons.start(small_model, socket_dir, extra=["--backend", backend, "--device", gpu_uuid, "--max-slab-mib", slab_mib])
    (path,) = list_sockets(socket_dir, device=gpu_uuid)
    status = query_status(path)
    assert status.backend == backend and status.device == gpu_uuid
    assert status.fingerprint.device_kind == "cuda" and status.fingerprint.compute_capability
    result = subprocess.run([sys.executable, "-m", "weightcache", "attach", "--socket-dir", str(socket_dir),
                             "--model", str(small_model), "--device", gpu_uuid, "--verify", "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["verified"] is True


def test_an_engine_writing_gpu_weights_fails_alone_and_bytes_stay(small_model, socket_dir, daemons, engines, gpu_uuid):
    daemons.start(small_model, socket_dir, extra=["--backend", "cuda-vmm", "--device", gpu_uuid])
    writer = engines(small_model, socket_dir, device=gpu_uuid, fallback="error")
    bystander = engines(small_model, socket_dir, device=gpu_uuid, fallback="error")
    assert writer.hello["source"] == "cache"
    writer.proc.stdin.write(b"write embed.weight\n")
    writer.proc.stdin.flush()
    assert writer.proc.wait(timeout=120) != 0
    assert "illegal" in open(writer.log_path).read().lower()
    assert bystander.ask("checksum")["checksum"] == checksum_of(small_model)


def test_engine_keeps_serving_after_daemon_sigkill_on_gpu(small_model, socket_dir, daemons, engines, gpu_uuid):
    # cuda-vmm only: a cuda-ipc mapping dies with the process that allocated it.
    daemon = daemons.start(small_model, socket_dir, extra=["--backend", "cuda-vmm", "--device", gpu_uuid])
    engine = engines(small_model, socket_dir, device=gpu_uuid, fallback="error")
    daemon.send_signal(signal.SIGKILL)
    daemon.wait()
    assert engine.ask("checksum")["checksum"] == checksum_of(small_model)
