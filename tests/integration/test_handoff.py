"""A daemon upgrade without a reload: a successor takes the resident slabs over the
predecessor's socket, publishes, and the predecessor exits; attached engines keep
serving and new engines attach throughout, with the same bytes and no cold load."""

import json
import pathlib
import subprocess
import sys

from procs import wait_until
from weightcache.client import attach, compare_with_disk, list_sockets, query_status
from weightcache.client import wire_pb2 as wire
from weightcache.client.attach import request
from weightcache.client.protocol import PROTOCOL_VERSION


def log_events(path) -> list[str]:
    return [json.loads(line).get("msg", "") for line in pathlib.Path(path).read_text().splitlines()
            if line.startswith("{")]


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
    with attach(small_model, socket_dir=socket_dir, cache_name="up") as attached:
        assert compare_with_disk(attached.tensors, small_model) == []
    # The successor holds the lock: a third daemon without --take-over still refuses.
    third = subprocess.run([sys.executable, "-m", "weightcache", "daemon", "--model", str(small_model),
                            "--socket-dir", str(socket_dir), "--name", "up"], capture_output=True, timeout=120)
    assert third.returncode == 75, third.stderr


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

