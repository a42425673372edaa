"""Two generations of one cache on one node (a blue/green model revision change): each
has its own lock, both serve at once, engines attach to the one their revision names,
and a daemon asked to stay within a per-device byte allowance refuses before allocating."""

import subprocess
import sys

from weightcache.client import attach, compare_with_disk, list_sockets, query_status


def daemon_cli(model, socket_dir, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightcache", "daemon", "--model", str(model),
                           "--socket-dir", str(socket_dir), "--name", "gen", *extra],
                          capture_output=True, text=True, timeout=120)


def test_two_revisions_of_one_cache_serve_side_by_side(small_model, socket_dir, daemons, engines):
    blue = daemons.start(small_model, socket_dir, name="gen", extra=["--revision", "r1"])
    old_engine = engines(small_model, socket_dir, cache_name="gen", revision="r1", fallback="error")
    green = daemons.start(small_model, socket_dir, name="gen", extra=["--revision", "r2"])
    assert blue.poll() is None, "the first generation serves on beside the second"

    paths = list_sockets(socket_dir, "gen")
    assert len(paths) == 2
    assert {query_status(p).fingerprint.revision: query_status(p).pid for p in paths} == {"r1": blue.pid,
                                                                                          "r2": green.pid}
    new_engine = engines(small_model, socket_dir, cache_name="gen", revision="r2", fallback="error")
    assert old_engine.hello["source"] == new_engine.hello["source"] == "cache"
    assert old_engine.hello["checksum"] == new_engine.hello["checksum"]
    with attach(small_model, socket_dir=socket_dir, cache_name="gen", revision="r2") as attached:
        assert compare_with_disk(attached.tensors, small_model) == []

    # One generation is still one daemon: a second daemon of r2 refuses (the lock is per generation).
    again = daemon_cli(small_model, socket_dir, "--revision", "r2")
    assert again.returncode == 75 and "already serves" in again.stderr, again.stderr
    assert len(list_sockets(socket_dir, "gen")) == 2, "a refused daemon removes no live generation's socket"


def test_a_dead_generations_socket_is_cleared_and_a_live_ones_kept(small_model, socket_dir, daemons):
    live = daemons.start(small_model, socket_dir, name="gen", extra=["--revision", "r1"])
    dead = daemons.start(small_model, socket_dir, name="gen", extra=["--revision", "r2"])
    dead.kill()
    dead.wait()
    assert len(list_sockets(socket_dir, "gen")) == 2  # r2's socket left behind by the SIGKILL
    daemons.start(small_model, socket_dir, name="gen", extra=["--revision", "r3"])
    revisions = sorted(query_status(p).fingerprint.revision for p in list_sockets(socket_dir, "gen"))
    assert revisions == ["r1", "r3"] and live.poll() is None


def test_a_shard_over_the_device_allowance_is_refused_before_allocating(small_model, socket_dir):
    refused = daemon_cli(small_model, socket_dir, "--max-device-bytes", "1024")
    assert refused.returncode != 0
    assert "may allocate 1024" in refused.stderr and "nothing was allocated" in refused.stderr, refused.stderr[-2000:]
    assert list_sockets(socket_dir, "gen") == []


def test_a_shard_within_the_device_allowance_loads(small_model, socket_dir, daemons):
    daemons.start(small_model, socket_dir, name="gen", extra=["--max-device-bytes", str(1 << 40)])
    [path] = list_sockets(socket_dir, "gen")
    assert query_status(path).resident_bytes > 0
