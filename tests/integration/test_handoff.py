"""A daemon upgrade without a reload: a successor takes the resident slabs over the
predecessor's socket, publishes, and the predecessor exits (or, supervised, waits for
SIGTERM); attached engines keep serving and new engines attach throughout, with the same
bytes and no cold load. Where there is nothing to take over, it loads, and says why."""

import fcntl
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import urllib.request

from cluster.procs import free_port
from procs import http_json, wait_until
from weightcache.client import attach, compare_with_disk, list_sockets, query_status
from weightcache.client import wire_pb2 as wire
from weightcache.client.attach import request
from weightcache.client.protocol import PROTOCOL_VERSION
from weightcache.daemon.backends import make_backend
from weightcache.daemon.health import DaemonState
from weightcache.daemon.service import DaemonConfig, claim, generation_key, load, prepare_socket_dir, publish


def log_events(path) -> list[str]:
    return [json.loads(line).get("msg", "") for line in pathlib.Path(path).read_text().splitlines()
            if line.startswith("{")]


def assert_the_successor_alone_serves(model, socket_dir, name: str) -> None:
    """A new attach matches the disk, and the successor holds the lock: a third daemon
    without --take-over is refused (exit 75)."""
    with attach(model, socket_dir=socket_dir, cache_name=name) as attached:
        assert compare_with_disk(attached.tensors, model) == []
    third = subprocess.run([sys.executable, "-m", "weightcache", "daemon", "--model", str(model),
                            "--socket-dir", str(socket_dir), "--name", name], capture_output=True, timeout=120)
    assert third.returncode == 75, third.stderr


def test_a_successor_takes_the_slabs_over_without_a_cold_load(small_model, socket_dir, daemons, engines):
    old = daemons.start(small_model, socket_dir, name="up")
    engine = engines(small_model, socket_dir, cache_name="up", fallback="error")
    before = engine.hello
    assert before["source"] == "cache"
    [path] = list_sockets(socket_dir)
    assert query_status(path).pid == old.pid

    new = daemons.start(small_model, socket_dir, name="up", extra=["--take-over"])
    assert old.wait(timeout=30) == 0, "the predecessor exits once the successor serves"
    [after_path] = list_sockets(socket_dir)
    assert after_path == path  # same fingerprint, same name, the successor's socket now
    status = query_status(path)
    assert (status.pid, status.load_s) == (new.pid, 0.0)
    events = log_events(new.log_path)
    assert "taken over" in events and "loading" not in events, events
    assert "handed over" in log_events(old.log_path)

    assert engine.ask("checksum")["checksum"] == before["checksum"]  # the engine attached to the old one serves on
    assert_the_successor_alone_serves(small_model, socket_dir, "up")


def test_a_successor_that_leaves_without_publishing_changes_nothing(small_model, socket_dir, daemons):
    old = daemons.start(small_model, socket_dir, name="keep")
    [path] = list_sockets(socket_dir)
    req = wire.Request(protocol_version=PROTOCOL_VERSION, client_name="fake-successor")
    req.handoff.SetInParent()
    sock, response, fds = request(path, req, timeout=10, accept_fds=True)
    assert response.WhichOneof("kind") == "attached" and fds
    sock.close()  # hung up without the "published" byte
    wait_until(lambda: "successor left without taking over; still serving" in
               pathlib.Path(old.log_path).read_text(), what="the daemon to log the abandoned handoff")
    assert old.poll() is None
    with attach(small_model, socket_dir=socket_dir, cache_name="keep") as attached:
        assert compare_with_disk(attached.tensors, small_model) == []


def test_take_over_with_nobody_to_take_over_from_loads_normally(small_model, socket_dir, daemons):
    daemons.start(small_model, socket_dir, name="fresh", extra=["--take-over"])
    [path] = list_sockets(socket_dir)
    assert query_status(path).load_s > 0



# -- supervised daemons (--http-bind, as in a pod) and fallbacks to a load ------------------
def http_status(port: int) -> tuple[int, dict]:
    return http_json(f"http://127.0.0.1:{port}/readyz", timeout=10)


def test_a_supervised_predecessor_hands_over_then_waits_for_sigterm(small_model, socket_dir, daemons, engines):
    """In a pod (restartPolicy Always) an exit would restart the old daemon, which would take
    the slabs back: with --http-bind it reports handed-over, serves nothing and waits."""
    old_port, new_port = free_port(), free_port()
    old = daemons.start(small_model, socket_dir, name="pod", extra=["--take-over", "--http-bind",
                                                                    f"127.0.0.1:{old_port}"])
    engine = engines(small_model, socket_dir, cache_name="pod", fallback="error")
    new = daemons.start(small_model, socket_dir, name="pod", extra=["--take-over", "--http-bind",
                                                                    f"127.0.0.1:{new_port}"])
    code, doc = wait_until(lambda: (lambda r: r if r[1]["state"] == "handed-over" else None)(http_status(old_port)),
                           timeout=30, what="the predecessor to report handed-over")
    assert code == 503 and doc["reason"] == "HandedOver" and doc["devices"] == [], doc
    assert old.poll() is None, "a supervised predecessor waits to be stopped"
    with urllib.request.urlopen(f"http://127.0.0.1:{old_port}/healthz", timeout=10) as r:
        assert r.status == 200  # alive: the kubelet's liveness probe must not restart it
    code, doc = http_status(new_port)
    assert code == 200 and doc["state"] == "ready", doc
    [path] = list_sockets(socket_dir)
    assert query_status(path).pid == new.pid and query_status(path).load_s == 0.0
    events = log_events(new.log_path)
    assert "taken over" in events and "loading" not in events, events

    old.send_signal(signal.SIGTERM)
    assert old.wait(timeout=30) == 0
    assert list_sockets(socket_dir) == [path], "the stopped predecessor left the successor's socket alone"
    assert engine.ask("checksum")["checksum"] == engine.hello["checksum"]
    assert_the_successor_alone_serves(small_model, socket_dir, "pod")


def test_a_predecessor_that_cannot_hand_over_is_loaded_beside(small_model, socket_dir, daemons):
    """A cuda-ipc daemon's memory dies with it (it serves no fds): the real server refuses
    the hand-off, and the successor says so and loads from disk instead of failing."""
    config = DaemonConfig(model_dir=small_model.resolve(), socket_dir=socket_dir, name="ipc")
    prepare_socket_dir(socket_dir, None)
    lock = claim(socket_dir, "ipc", "cpu", generation_key(config.model_dir, ""))
    cache, slabs = load(config, make_backend("cpu", "cpu"), config.parallel,
                        DaemonState(cache="ipc", backend="cpu", model=str(small_model)))
    cache.slab_fds = []  # what a cuda-ipc daemon serves: handles in the layout, no fds
    server, path = publish(config, cache)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        new = daemons.start(small_model, socket_dir, name="ipc", extra=["--take-over"])
        events = log_events(new.log_path)
        assert "take-over refused; loading from disk instead" in events and "loading" in events, events
        assert "taken over" not in events
        assert query_status(path).pid == new.pid and query_status(path).load_s > 0  # its socket replaced ours
        with attach(small_model, socket_dir=socket_dir, cache_name="ipc") as attached:
            assert compare_with_disk(attached.tensors, small_model) == []
    finally:
        server.shutdown()
        server.server_close()
        for slab in slabs:
            slab.close()
        os.close(lock)  # "the predecessor exits": the successor takes its lock

    def successor_holds_the_lock():
        fd = os.open(socket_dir / f".ipc__cpu__{generation_key(config.model_dir, '')}.lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    wait_until(successor_holds_the_lock, timeout=30, what="the successor to take the lock")
    assert new.poll() is None


def test_take_over_leaves_another_revision_alone_and_loads(small_model, socket_dir, daemons):
    old = daemons.start(small_model, socket_dir, name="rev", extra=["--revision", "r1"])
    new = daemons.start(small_model, socket_dir, name="rev", extra=["--revision", "r2", "--take-over"])
    events = log_events(new.log_path)
    assert "loading" in events and "taken over" not in events, events
    by_pid = {query_status(p).pid: query_status(p) for p in list_sockets(socket_dir)}
    assert set(by_pid) == {old.pid, new.pid}  # both generations serve
    assert by_pid[new.pid].load_s > 0 and by_pid[new.pid].fingerprint.revision == "r2"
    assert old.poll() is None
