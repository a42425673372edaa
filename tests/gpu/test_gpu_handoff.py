"""The daemon hand-off on a real GPU: a cuda-vmm daemon's slabs pass to its successor as
VMM fds (no reload; an engine's mapping and a new attach read the same bytes as the
disk), and a cuda-ipc daemon, whose memory dies with it, is refused and loaded beside,
with the reason in the log."""

import json
import pathlib
import signal
import socket
import urllib.error
import urllib.request

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device on this machine", allow_module_level=True)

from procs import wait_until  # noqa: E402
from weightcache.client import attach, compare_with_disk, gpu, list_sockets, query_status  # noqa: E402

pytestmark = pytest.mark.gpu


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def events(proc) -> list[str]:
    return [json.loads(line).get("msg", "") for line in pathlib.Path(proc.log_path).read_text().splitlines()
            if line.startswith("{")]


def readyz(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_cuda_vmm_slabs_are_handed_over_without_a_reload(small_model, socket_dir, daemons):
    uuid, old_port = gpu.device_uuid(0), free_port()
    old = daemons.start(small_model, socket_dir, name="vmm", extra=["--backend", "cuda-vmm", "--device", uuid,
                                                                    "--take-over", "--http-bind",
                                                                    f"127.0.0.1:{old_port}"])
    with attach(small_model, socket_dir=socket_dir, cache_name="vmm", device=uuid) as before:
        new = daemons.start(small_model, socket_dir, name="vmm", extra=["--backend", "cuda-vmm", "--device", uuid,
                                                                        "--take-over"])
        assert "taken over" in events(new) and "loading" not in events(new), events(new)
        [path] = list_sockets(socket_dir)
        status = query_status(path)
        assert (status.pid, status.load_s) == (new.pid, 0.0)
        code, doc = wait_until(lambda: (lambda r: r if r[1]["state"] == "handed-over" else None)(readyz(old_port)),
                               timeout=30, what="the predecessor to report handed-over")
        assert code == 503, doc
        old.send_signal(signal.SIGTERM)
        assert old.wait(timeout=60) == 0
        torch.cuda.synchronize()
        assert compare_with_disk(before.tensors, small_model) == []  # the first mapping outlives its daemon
    with attach(small_model, socket_dir=socket_dir, cache_name="vmm", device=uuid) as after:
        assert compare_with_disk(after.tensors, small_model) == []


def test_a_cuda_ipc_daemon_is_refused_and_loaded_beside(small_model, socket_dir, daemons):
    uuid = gpu.device_uuid(0)
    old = daemons.start(small_model, socket_dir, name="ipc", extra=["--backend", "cuda-ipc", "--device", uuid])
    new = daemons.start(small_model, socket_dir, name="ipc", extra=["--backend", "cuda-ipc", "--device", uuid,
                                                                    "--take-over"])
    got = events(new)
    assert "take-over refused; loading from disk instead" in got and "loading" in got, got
    refused = [json.loads(line) for line in pathlib.Path(new.log_path).read_text().splitlines()
               if '"take-over refused' in line][0]
    assert "cannot be handed over" in refused["reason"], refused
    [path] = list_sockets(socket_dir)
    assert query_status(path).pid == new.pid and query_status(path).load_s > 0
    assert old.poll() is None  # still serving the engines it has
    with attach(small_model, socket_dir=socket_dir, cache_name="ipc", device=uuid) as attached:
        assert compare_with_disk(attached.tensors, small_model) == []
