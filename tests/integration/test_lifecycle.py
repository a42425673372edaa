"""Real daemon and engine processes on the cpu backend: attach, share, survive kills."""

import json
import os
import signal
import subprocess
import sys

import pytest

from procs import wait_until
from weightcache.client import attach, compare_with_disk, query_status
from weightcache.client.attach import list_sockets
from weightcache.synthetic import uniform_specs, write_model


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "weightcache", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def status_of(socket_dir):
    (path,) = list_sockets(socket_dir)
    return query_status(path)


def disk_checksum(model_dir):
    from engine_proc import checksum

    from weightcache.client import load_from_disk

    return checksum(load_from_disk(model_dir))


def memfds_of_daemon(pid) -> dict[int, int]:
    """inode -> size of every weightcache memfd the daemon holds open."""
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(path).startswith("/memfd:weightcache:"):
                st = os.stat(path)
                found[st.st_ino] = st.st_size
        except FileNotFoundError:
            pass
    return found


def memfd_mappings_of(pid) -> dict[int, dict]:
    """inode -> size and private/anonymous kB of each weightcache memfd mapping (smaps)."""
    mappings, current = {}, None
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and fields[0][0] in "0123456789abcdef":
                current = None
                if len(fields) >= 6 and fields[5].startswith("/memfd:weightcache:"):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    current = mappings.setdefault(int(fields[4]), {"size": 0, "private_kb": 0, "anonymous_kb": 0})
                    current["size"] += end - start
            elif current is not None and fields[0] in ("Private_Dirty:", "Anonymous:"):
                current["private_kb" if fields[0] == "Private_Dirty:" else "anonymous_kb"] += int(fields[1])
    return mappings


def shmem_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem line in /proc/meminfo")


def test_attach_cli_verifies_every_tensor_against_disk(small_model, socket_dir, daemons):
    daemons.start(small_model, socket_dir)
    result = cli("attach", "--socket-dir", socket_dir, "--model", small_model, "--verify", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["verified"] is True
    assert report["tensors"] == 15
    assert report["bytes"] == status_of(socket_dir).resident_bytes
    assert set(report) >= {"attach_ms", "tensors", "bytes", "fingerprint", "verified"}
    assert set(report["phases_ms"]) == {"fingerprint", "handshake", "map", "views"}
    assert sum(report["phases_ms"].values()) <= report["attach_ms"] + 0.01


def test_status_json_describes_each_cache(small_model, socket_dir, daemons):
    proc = daemons.start(small_model, socket_dir, name="status-check")
    result = cli("status", "--socket-dir", socket_dir, "--json")
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)
    assert row["name"] == "status-check" and row["state"] == "ready"
    assert row["backend"] == "cpu" and row["device"] == "cpu" and row["pid"] == proc.pid
    assert row["tensors"] == 15 and row["attached_clients"] == 0 and row["uptime_s"] >= 0
    assert row["fingerprint_fields"]["tp_size"] == 1 and len(row["fingerprint"]) == 64


def test_sigterm_stops_the_daemon_cleanly_and_removes_its_socket(small_model, socket_dir, daemons):
    proc = daemons.start(small_model, socket_dir)
    assert list_sockets(socket_dir)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert list_sockets(socket_dir) == []


def test_eight_engines_attached_at_once_hold_one_copy(tmp_path, socket_dir, daemons, engines):
    model = write_model(tmp_path / "big", uniform_specs(64, 256 << 20))
    before_daemon = shmem_bytes()
    daemon = daemons.start(model, socket_dir)
    model_bytes = status_of(socket_dir).resident_bytes
    after_daemon = shmem_bytes()
    started = [engines(model, socket_dir, fallback="error") for _ in range(8)]

    assert all(e.hello["source"] == "cache" and e.hello["bytes"] == model_bytes for e in started)
    assert len({e.hello["checksum"] for e in started}) == 1
    assert status_of(socket_dir).attached_clients == 8
    # The daemon's load adds the model to the machine's shared memory once (Shmem is
    # machine-wide, hence the tolerance) ...
    assert abs((after_daemon - before_daemon) - model_bytes) < model_bytes * 0.15
    # ... its memfds hold exactly the model ...
    daemon_memfds = memfds_of_daemon(daemon.pid)
    assert sum(daemon_memfds.values()) == model_bytes
    for engine in started:
        mapped = memfd_mappings_of(engine.proc.pid)
        # ... every engine maps exactly those memfds, whole, and holds no private
        # copy of any page of them: eight engines, one physical copy.
        assert set(mapped) == set(daemon_memfds)
        assert all(m["size"] == daemon_memfds[inode] for inode, m in mapped.items())
        assert all(m["private_kb"] == 0 and m["anonymous_kb"] == 0 for m in mapped.values())


def test_an_engine_writing_an_attached_weight_dies_alone(small_model, socket_dir, daemons, engines):
    daemons.start(small_model, socket_dir)
    writer = engines(small_model, socket_dir, fallback="error")
    bystander = engines(small_model, socket_dir, fallback="error")
    writer.proc.stdin.write(b"write embed.weight\n")
    writer.proc.stdin.flush()
    assert writer.proc.wait(timeout=30) == -signal.SIGSEGV
    assert bystander.ask("checksum")["checksum"] == disk_checksum(small_model)
    result = cli("attach", "--socket-dir", socket_dir, "--model", small_model, "--verify", "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["verified"] is True


def test_engines_keep_serving_after_the_daemon_is_sigkilled(small_model, socket_dir, daemons, engines):
    daemon = daemons.start(small_model, socket_dir)
    running = [engines(small_model, socket_dir, fallback="error") for _ in range(2)]
    expected = disk_checksum(small_model)
    daemon.kill()
    daemon.wait()
    for engine in running:
        assert engine.ask("checksum")["checksum"] == expected

    strict = subprocess.run([sys.executable, "tests/engine_proc.py", str(small_model)], capture_output=True, text=True,
                            env={**os.environ, "WEIGHTCACHE_SOCKET_DIR": str(socket_dir),
                                 "WEIGHTCACHE_FALLBACK": "error"}, timeout=120, input="")
    assert strict.returncode != 0 and "stale socket" in strict.stderr

    lenient = engines(small_model, socket_dir, fallback="disk")
    assert lenient.hello["source"] == "disk" and "stale socket" in lenient.hello["reason"]
    assert lenient.hello["checksum"] == expected

    daemons.start(small_model, socket_dir)
    again = engines(small_model, socket_dir, fallback="error")
    assert again.hello["source"] == "cache" and again.hello["checksum"] == expected
    assert all(e.ask("checksum")["checksum"] == expected for e in running)


def test_sigkilled_engines_are_uncounted_and_leak_nothing(small_model, socket_dir, daemons, engines):
    daemon = daemons.start(small_model, socket_dir)
    fd_dir = f"/proc/{daemon.pid}/fd"
    baseline_fds = len(os.listdir(fd_dir))
    started = [engines(small_model, socket_dir, fallback="error") for _ in range(3)]
    assert status_of(socket_dir).attached_clients == 3
    started[0].proc.kill()
    wait_until(lambda: status_of(socket_dir).attached_clients == 2, what="client count to drop to 2")
    for engine in started[1:]:
        engine.proc.kill()
    wait_until(lambda: status_of(socket_dir).attached_clients == 0, what="client count to drop to 0")
    wait_until(lambda: len(os.listdir(fd_dir)) == baseline_fds, what="daemon fds back to baseline")


def test_mode_off_reads_disk_and_says_so(small_model, socket_dir, engines):
    engine = engines(small_model, socket_dir, mode="off")
    assert engine.hello["source"] == "disk" and engine.hello["reason"] == "mode=off"
    assert engine.hello["bytes"] == 0


def test_mode_daemon_starts_a_detached_daemon_then_attaches(small_model, socket_dir, engines):
    engine = engines(small_model, socket_dir, mode="daemon", cache_name="auto", fallback="error")
    try:
        assert engine.hello["source"] == "cache"
        status = status_of(socket_dir)
        assert status.cache_name == "auto" and status.attached_clients == 1
        engine.stop()
        # The daemon outlives the engine that started it; a second engine reuses it.
        second = engines(small_model, socket_dir, mode="daemon", cache_name="auto", fallback="error")
        assert second.hello["source"] == "cache" and status_of(socket_dir).pid == status.pid
    finally:
        os.kill(status_of(socket_dir).pid, signal.SIGTERM)


def test_a_bad_mode_is_named_in_the_error(small_model, socket_dir):
    env = {**os.environ, "WEIGHTCACHE_MODE": "sometimes", "WEIGHTCACHE_SOCKET_DIR": str(socket_dir)}
    result = subprocess.run([sys.executable, "tests/engine_proc.py", str(small_model)], capture_output=True,
                            text=True, env=env, timeout=60, input="")
    assert result.returncode != 0 and "WEIGHTCACHE_MODE" in result.stderr and "'sometimes'" in result.stderr


@pytest.mark.parametrize("command", ["daemon", "attach", "status", "demo"])
def test_every_subcommand_has_help(command):
    result = cli(command, "--help")
    assert result.returncode == 0 and "usage: weightcache" in result.stdout


def test_a_socket_directory_longer_than_a_unix_socket_path_still_serves(small_model, socket_dir, daemons):
    # /run/weightcache/<namespace>/<cache>/ plus a GPU UUID in the name passes the
    # 107 bytes of sun_path on real nodes; both sides go through the directory's fd.
    deep = socket_dir / ("d" * 60) / ("e" * 60)
    daemons.start(small_model, deep, name="long")
    [path] = list_sockets(deep)
    assert len(str(path)) > 107
    with attach(small_model, socket_dir=deep, cache_name="long") as attached:
        assert compare_with_disk(attached.tensors, small_model) == []
    assert query_status(path).cache_name == "long"
