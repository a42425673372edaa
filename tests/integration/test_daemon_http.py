"""The daemon's HTTP side (what probes, Prometheus and the operator read), against real
daemon processes: readiness only once the socket serves, attached clients counted live,
and a failed load reported with its reason while the process stays up."""

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from cluster.procs import free_port
from procs import wait_until
from weightcache.client import attach, list_sockets
from weightcache.client.fingerprint import digest
from weightcache.synthetic import write_model


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def status(port: int) -> dict:
    code, body = get(port, "/status")
    assert code == 200, (code, body)
    return json.loads(body)


def start_raw(model, socket_dir, port, log_path, *extra) -> subprocess.Popen:
    """A daemon started as a pod starts it (no ready fd): the test watches HTTP instead."""
    log = open(log_path, "wb")
    return subprocess.Popen([sys.executable, "-m", "weightcache", "daemon", "--model", str(model),
                             "--socket-dir", str(socket_dir), "--name", "web", "--http-bind", f"127.0.0.1:{port}",
                             *extra], stdout=log, stderr=log, stdin=subprocess.DEVNULL)


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=30)


def test_ready_daemon_reports_its_cache_and_counts_clients(small_model, socket_dir, daemons):
    port = free_port()
    daemons.start(small_model, socket_dir, name="web", extra=["--http-bind", f"127.0.0.1:{port}"])
    assert get(port, "/healthz")[0] == 200
    assert get(port, "/readyz")[0] == 200
    doc = status(port)
    assert (doc["cache"], doc["state"], doc["reason"], doc["backend"]) == ("web", "ready", "", "cpu")
    assert doc["progress"]["loaded_bytes"] == doc["progress"]["total_bytes"] > 0
    [device] = doc["devices"]
    assert device["socket"] == str(list_sockets(socket_dir)[0])
    assert device["attached_clients"] == 0

    with attach(small_model, socket_dir=socket_dir, cache_name="web") as attached:
        assert device["fingerprint"] == digest(attached.fingerprint)
        assert device["resident_bytes"] == attached.resident_bytes
        assert device["tensors"] == len(attached.tensors)
        wait_until(lambda: status(port)["devices"][0]["attached_clients"] == 1, what="one attached client")
        code, metrics = get(port, "/metrics")
        assert code == 200
        text = metrics.decode()
        assert 'weightcache_ready{cache="web"} 1.0' in text
        assert 'weightcache_attached_clients{cache="web",device="cpu"} 1.0' in text
        assert f'weightcache_resident_bytes{{cache="web",device="cpu"}} {float(attached.resident_bytes)}' in text
    wait_until(lambda: status(port)["devices"][0]["attached_clients"] == 0, what="the client's departure counted")
    code, body = get(port, "/nope")
    assert code == 404 and b"/readyz" in body


@pytest.mark.parametrize("case, reason", [("missing", "ModelNotFound"), ("empty", "ModelNotFound"),
                                          ("corrupt", "InvalidCheckpoint"),
                                          ("quantized", "UnsupportedQuantization")])
def test_failed_load_stays_up_and_says_why(tmp_path, socket_dir, case, reason):
    model = tmp_path / "model"
    if case == "empty":  # what a hostPath volume gives for a path missing on the node
        model.mkdir()
    if case == "corrupt":
        write_model(model, {"w": ("F32", [4, 4])})
        (model / "model.safetensors").write_bytes(b"\xff" * 64)
    elif case == "quantized":
        write_model(model, {"w": ("F32", [4, 4])}, config={"quantization_config": {"quant_method": "awq"}})
    port = free_port()
    proc = start_raw(model, socket_dir, port, tmp_path / "daemon.log")
    try:
        doc = wait_until(lambda: get(port, "/status")[0] == 200 and status(port)["state"] == "failed" and status(port),
                         timeout=60, what="the daemon to report a failed load")
        assert doc["reason"] == reason, doc
        assert doc["message"] and doc["devices"] == []
        if case in ("missing", "empty"):
            assert str(model) in doc["message"]
        if case == "quantized":
            assert "awq" in doc["message"]
        assert proc.poll() is None, "a failed load must not exit while HTTP reports it"
        assert get(port, "/healthz")[0] == 200
        code, body = get(port, "/readyz")
        assert code == 503 and json.loads(body)["reason"] == reason
        assert f'weightcache_failed{{cache="web",reason="{reason}"}} 1.0' in get(port, "/metrics")[1].decode()
        assert list_sockets(socket_dir) == []
    finally:
        code = stop(proc)
    assert code == 1


def test_http_bind_is_checked(small_model, socket_dir):
    done = subprocess.run([sys.executable, "-m", "weightcache", "daemon", "--model", str(small_model),
                           "--socket-dir", str(socket_dir), "--http-bind", "9400"], capture_output=True, text=True)
    assert done.returncode == 2 and "HOST:PORT" in done.stderr
