"""Bad input against a real daemon: raw sockets, hostile peers, bad model directories.

Every bad input gets a clear error on its own connection (or a clear exit at start), and
after each one a good client still attaches and verifies every byte against the disk.
"""

import json
import os
import socket
import struct
import subprocess
import sys
import threading

import pytest
import torch

from procs import wait_until
from weightcache.client import CacheUnavailable, PeerRejected, attach, list_sockets, query_status
from weightcache.client import wire_pb2 as wire
from weightcache.client.protocol import (MAGIC, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES, PROTOCOL_VERSION,
                                         encode_frame, recv_message)
from weightcache.synthetic import write_model

Error = wire.Error


# --- helpers ----------------------------------------------------------------------------

def cli(*args, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "weightcache", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def assert_good_client_attaches(sd, model):
    """A fresh `weightcache attach --verify` process attaches and every byte matches the disk."""
    done = cli("attach", "--socket-dir", sd, "--model", model, "--verify", "--json", "--timeout", "60")
    assert done.returncode == 0, f"good client failed ({done.returncode}): {done.stdout} {done.stderr}"
    result = json.loads(done.stdout)
    assert result["verified"] is True, result


def the_socket(sd):
    paths = list_sockets(sd)
    assert len(paths) == 1, paths
    return paths[0]


def connect(sd) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect(str(the_socket(sd)))
    return sock


def status_frame(version=PROTOCOL_VERSION) -> bytes:
    return encode_frame(wire.Request(protocol_version=version, status=wire.StatusRequest()))


def read_response(sock, timeout=60) -> "wire.Response":
    response, _ = recv_message(sock, wire.Response, max_bytes=MAX_RESPONSE_BYTES, timeout=timeout)
    return response


def assert_error(response, code, *needles):
    assert response.WhichOneof("kind") == "error", response
    assert response.error.code == code, (Error.Code.Name(response.error.code), response.error.message)
    for needle in needles:
        assert needle in response.error.message, f"{needle!r} not in {response.error.message!r}"


def assert_closed(sock):
    """The daemon closed its end after answering (EOF, or a reset for bytes it never read)."""
    sock.settimeout(60)
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass


def bad_frame_case(daemons, model, sd, data: bytes, code, *needles):
    daemons.start(model, sd)
    with connect(sd) as sock:
        sock.sendall(data)
        assert_error(read_response(sock), code, *needles)
        assert_closed(sock)
    assert_good_client_attaches(sd, model)


def fd_table(pid) -> set:
    """(fd, target) of every fd a process holds. Compared as a set, not a count: a baseline
    taken right after start may still hold the --ready-fd pipe the daemon closes then."""
    table = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            table.add((fd, os.readlink(f"/proc/{pid}/fd/{fd}")))
        except FileNotFoundError:
            pass
    return table


def try_attach(model, sd):
    try:
        return attach(model, socket_dir=sd, cache_name="test", timeout=60)
    except CacheUnavailable:
        return None


def attached_clients(sd):
    try:
        return query_status(the_socket(sd), timeout=60).attached_clients
    except PeerRejected:
        return None


# --- frames -----------------------------------------------------------------------------

def test_garbage_bytes_get_bad_request_and_others_keep_attaching(daemons, small_model, socket_dir):
    garbage = b"\0JNK" + os.urandom(4092)
    bad_frame_case(daemons, small_model, socket_dir, garbage, Error.BAD_REQUEST, "magic", repr(MAGIC))


def test_oversized_frame_is_refused_naming_the_limit_before_any_payload(daemons, small_model, socket_dir):
    header_only = struct.pack(">4sI", MAGIC, 1 << 30)  # the 1 GiB payload is never sent
    bad_frame_case(daemons, small_model, socket_dir, header_only, Error.BAD_REQUEST,
                   str(1 << 30), f"limit of {MAX_REQUEST_BYTES} bytes")


def test_payload_that_is_not_a_request_gets_bad_request(daemons, small_model, socket_dir):
    payload = b"\x0f" * 16  # wire type 7 does not exist: no protobuf parser accepts it
    bad_frame_case(daemons, small_model, socket_dir, struct.pack(">4sI", MAGIC, len(payload)) + payload,
                   Error.BAD_REQUEST, "not a Request")


def test_wrong_protocol_version_is_refused_naming_both_versions(daemons, small_model, socket_dir):
    bad_frame_case(daemons, small_model, socket_dir, status_frame(version=99), Error.UNSUPPORTED_PROTOCOL,
                   "protocol 99", f"speaks {PROTOCOL_VERSION}")


def test_request_without_an_action_gets_bad_request(daemons, small_model, socket_dir):
    bad_frame_case(daemons, small_model, socket_dir, encode_frame(wire.Request(protocol_version=PROTOCOL_VERSION)),
                   Error.BAD_REQUEST, "no action")


def test_half_open_connections_time_out_without_blocking_others(daemons, small_model, socket_dir):
    daemons.start(small_model, socket_dir, extra=["--handshake-timeout", "1"])
    silent, half = connect(socket_dir), connect(socket_dir)
    try:
        half.sendall(MAGIC)  # half of the 8-byte header, then nothing
        with attach(small_model, socket_dir=socket_dir, cache_name="test", timeout=60) as att:
            assert len(att.tensors) > 0
        for sock in (silent, half):
            assert_error(read_response(sock), Error.BAD_REQUEST, "no complete request within 1.0s")
            assert_closed(sock)
    finally:
        silent.close()
        half.close()
    assert_good_client_attaches(socket_dir, small_model)


def test_fds_sent_by_a_peer_are_not_kept_by_the_daemon(daemons, small_model, socket_dir):
    proc = daemons.start(small_model, socket_dir)
    baseline = fd_table(proc.pid)
    pipes = []
    for frame in (b"\0JNK" + os.urandom(1024), status_frame()):
        for _ in range(4):
            read_end, write_end = os.pipe()
            pipes.append(read_end)
            extra = [os.open("/dev/null", os.O_RDONLY), os.memfd_create("wc-test")]
            with connect(socket_dir) as sock:
                socket.send_fds(sock, [frame], [write_end, *extra])
                for fd in (write_end, *extra):
                    os.close(fd)
                response = read_response(sock)
                if frame.startswith(MAGIC):  # fds riding on a valid request are dropped, the request answered
                    assert response.WhichOneof("kind") == "status", response
                else:
                    assert_error(response, Error.BAD_REQUEST, "magic")
    wait_until(lambda: fd_table(proc.pid) <= baseline, timeout=60,
               what="the daemon to hold no fd beyond its baseline")
    assert len(os.listdir(f"/proc/{proc.pid}/fd")) <= len(baseline)
    for read_end in pipes:  # nobody holds a write end any more: each pipe reads EOF
        os.set_blocking(read_end, False)
        assert os.read(read_end, 1) == b""
        os.close(read_end)
    assert_good_client_attaches(socket_dir, small_model)


# --- peers ------------------------------------------------------------------------------

PEER_SCRIPT = r"""
import select, socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(60)
s.connect(sys.argv[1])
if sys.argv[3] == "late":  # write only once the daemon's answer is there
    select.select([s], [], [], 60)
s.sendall(bytes.fromhex(sys.argv[2]))
data = b""
try:
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
except ConnectionResetError:
    pass
sys.stdout.write(data.hex())
"""
NOBODY = 65534


def python_for_nobody() -> str:
    """An interpreter uid 65534 can run (the venv's may live under a private /root)."""
    for candidate in (sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3"):
        try:
            probe = subprocess.run([candidate, "-c", "pass"], user=NOBODY, group=NOBODY, extra_groups=[],
                                   capture_output=True, timeout=60, cwd="/")
        except PermissionError:
            continue
        if probe.returncode == 0:
            return candidate
    pytest.skip("no Python interpreter is executable by uid 65534")


def status_as_nobody(sd, when="prompt", groups=()) -> "wire.Response":
    """Send a status request from a process running as uid/gid 65534 (with these
    supplementary groups); the daemon's answer."""
    return send_as_nobody(the_socket(sd), status_frame(), when, groups)


def send_as_nobody(path, data: bytes, when="prompt", groups=()) -> "wire.Response":
    """Send raw bytes to the socket at PATH from a process running as uid/gid 65534
    (with these supplementary groups); the daemon's answer."""
    done = subprocess.run([python_for_nobody(), "-c", PEER_SCRIPT, str(path), data.hex(), when],
                          user=NOBODY, group=NOBODY, extra_groups=list(groups), capture_output=True, text=True,
                          timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr
    data = bytes.fromhex(done.stdout)
    magic, length = struct.unpack(">4sI", data[:8])
    assert magic == MAGIC and len(data) == 8 + length, data[:16]
    response = wire.Response()
    response.ParseFromString(data[8:])
    return response


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running a peer as uid 65534 needs root")


def start_shared_with_nobody(daemons, model, sd, extra=()):
    # The fixture's temporary parent is 0700: let others traverse it (the daemon's own
    # directory is then 0750 group 65534 and the socket 0660 group 65534).
    sd.parent.chmod(0o711)
    return daemons.start(model, sd, extra=["--socket-group", str(NOBODY), *extra])


@needs_root
@pytest.mark.parametrize("when", ["prompt", "late"])
def test_peer_with_wrong_uid_is_denied_naming_its_uid(daemons, small_model, socket_dir, when):
    start_shared_with_nobody(daemons, small_model, socket_dir)
    assert_error(status_as_nobody(socket_dir, when), Error.PERMISSION_DENIED, f"uid {NOBODY}", "not allowed")
    assert_good_client_attaches(socket_dir, small_model)


@needs_root
def test_peer_of_an_allowed_gid_gets_status(daemons, small_model, socket_dir):
    start_shared_with_nobody(daemons, small_model, socket_dir, extra=["--allow-gid", str(NOBODY)])
    response = status_as_nobody(socket_dir)
    assert response.WhichOneof("kind") == "status", response
    assert response.status.cache_name == "test"
    assert_good_client_attaches(socket_dir, small_model)


CLIENTS_GID = 4242  # a group the kernel reports only as supplementary (SO_PEERGROUPS)


@needs_root
def test_peer_with_an_allowed_supplementary_group_gets_status(daemons, small_model, socket_dir):
    # How a Kubernetes engine pod is let in: supplementalGroups, not its uid or primary gid.
    # The socket's file mode admits group 65534 either way, so the daemon's check decides.
    start_shared_with_nobody(daemons, small_model, socket_dir, extra=["--allow-gid", str(CLIENTS_GID)])
    response = status_as_nobody(socket_dir, groups=[CLIENTS_GID])
    assert response.WhichOneof("kind") == "status", response
    assert_error(status_as_nobody(socket_dir, groups=[]), Error.PERMISSION_DENIED, f"uid {NOBODY}", "groups []")
    assert_good_client_attaches(socket_dir, small_model)


def test_fingerprint_mismatch_names_the_differing_field_and_both_values(daemons, small_model, socket_dir):
    daemons.start(small_model, socket_dir)
    done = cli("attach", "--socket-dir", socket_dir, "--model", small_model, "--revision", "other", "--json",
               "--timeout", "60")
    assert done.returncode != 0
    message = json.loads(done.stdout)["message"]
    assert "revision" in message and "'other'" in message and "''" in message, message
    assert "revision" in done.stderr and "'other'" in done.stderr
    assert_good_client_attaches(socket_dir, small_model)


def test_64_clients_attaching_at_once_all_see_the_same_bytes(daemons, small_model, socket_dir):
    daemons.start(small_model, socket_dir)
    count = 64
    barrier = threading.Barrier(count)
    results, errors = [None] * count, []

    def one(i):
        try:
            barrier.wait(timeout=120)
            results[i] = attach(small_model, socket_dir=socket_dir, cache_name="test", timeout=120)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(f"client {i}: {exc!r}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    try:
        assert not errors, errors
        assert all(results), "some clients never returned"
        first = results[0].tensors
        for att in results[1:]:
            assert att.tensors.keys() == first.keys()
            for name, tensor in att.tensors.items():
                assert torch.equal(tensor.reshape(-1).view(torch.uint8), first[name].reshape(-1).view(torch.uint8)), name
        wait_until(lambda: attached_clients(socket_dir) == count, timeout=60, what=f"{count} attached clients")
    finally:
        for att in results:
            if att is not None:
                att.close()
    wait_until(lambda: attached_clients(socket_dir) == 0, timeout=60, what="attached clients back to 0")
    assert_good_client_attaches(socket_dir, small_model)


def test_connection_limit_answers_busy_and_frees_a_slot_on_close(daemons, small_model, socket_dir):
    daemons.start(small_model, socket_dir, extra=["--max-connections", "2"])
    held = [attach(small_model, socket_dir=socket_dir, cache_name="test", timeout=60) for _ in range(2)]
    try:
        with pytest.raises(CacheUnavailable) as info:
            attach(small_model, socket_dir=socket_dir, cache_name="test", timeout=60)
        assert "BUSY" in str(info.value) and "connection limit of 2" in str(info.value), str(info.value)
        with pytest.raises(PeerRejected, match="BUSY: connection limit of 2 reached"):
            query_status(the_socket(socket_dir), timeout=60)
        held.pop().close()
        held.append(wait_until(lambda: try_attach(small_model, socket_dir), timeout=60, what="a freed slot"))
    finally:
        for att in held:
            att.close()
    wait_until(lambda: attached_clients(socket_dir) == 0, timeout=60, what="attached clients back to 0")
    assert_good_client_attaches(socket_dir, small_model)


def test_refused_peer_that_writes_late_still_reads_the_reason(daemons, small_model, socket_dir):
    daemons.start(small_model, socket_dir, extra=["--max-connections", "1"])
    with attach(small_model, socket_dir=socket_dir, cache_name="test", timeout=60):
        with connect(socket_dir) as sock:  # the daemon answers before this peer has written a byte
            assert_error(read_response(sock), Error.BUSY, "connection limit of 1")
            assert sock.recv(1) == b""  # the daemon has ended its side...
            sock.sendall(status_frame())  # ...but still takes the request: no EPIPE for a slow peer
        for _ in range(50):  # the real client always gets the reason, never a broken pipe
            with pytest.raises(PeerRejected, match="connection limit of 1"):
                query_status(the_socket(socket_dir), timeout=60)
    assert_good_client_attaches(socket_dir, small_model)


def test_attach_refused_by_a_busy_daemon_raises_peer_rejected(daemons, small_model, socket_dir):
    daemons.start(small_model, socket_dir, extra=["--max-connections", "1"])
    with attach(small_model, socket_dir=socket_dir, cache_name="test", timeout=60):
        with pytest.raises(PeerRejected, match="connection limit"):
            attach(small_model, socket_dir=socket_dir, cache_name="test", timeout=60)


# --- daemon start -----------------------------------------------------------------------

def _corrupt_header(model):
    path = model / "model-00001-of-00002.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + path.read_bytes()[8:])


def _missing_shard(model):
    (model / "model-00002-of-00002.safetensors").unlink()


def _awq_config(model):
    (model / "config.json").write_text(json.dumps({"model_type": "synthetic", "quantization_config": {
        "quant_method": "awq", "bits": 4}}))


def _traversal_index(model):
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["a"] = "../model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize("spoil, needle", [
    (_corrupt_header, "the header length in its first 8 bytes is more than"),
    (_missing_shard, "missing from"),
    (_awq_config, "quantization 'awq' is not served"),
    (_traversal_index, "shard name '../model-00001-of-00002.safetensors' is not allowed"),
], ids=["corrupt-header", "missing-shard", "awq", "path-traversal-index"])
def test_bad_model_dir_stops_the_daemon_before_any_socket(tmp_path, socket_dir, spoil, needle):
    model = write_model(tmp_path / "bad", {"a": ("F32", (4, 4)), "b": ("BF16", (8,))}, shards=2)
    spoil(model)
    done = cli("daemon", "--model", model, "--socket-dir", socket_dir, "--name", "bad", timeout=180)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert needle in done.stderr, done.stderr
    assert not list(socket_dir.glob("*.sock")) and not list(socket_dir.glob("*.binding")), list(socket_dir.iterdir())


def test_second_daemon_for_a_served_cache_exits_75(daemons, small_model, socket_dir):
    daemons.start(small_model, socket_dir)
    done = cli("daemon", "--model", small_model, "--socket-dir", socket_dir, "--name", "test", timeout=180)
    assert done.returncode == 75, (done.returncode, done.stderr)
    assert "already serves" in done.stderr, done.stderr
    assert_good_client_attaches(socket_dir, small_model)


def test_stale_socket_is_reported_and_replaced_by_the_next_daemon(daemons, small_model, socket_dir):
    first = daemons.start(small_model, socket_dir)
    first.kill()
    first.wait()
    stale = the_socket(socket_dir)  # SIGKILL left the file behind
    status = cli("status", "--socket-dir", socket_dir, "--json")
    assert status.returncode == 0, status.stderr
    rows = json.loads(status.stdout)
    assert [(r["socket"], r["state"]) for r in rows] == [(str(stale), "unreachable")], rows
    done = cli("attach", "--socket-dir", socket_dir, "--model", small_model, "--json", "--timeout", "60")
    assert done.returncode != 0
    assert "stale" in done.stdout and "stale" in done.stderr, (done.stdout, done.stderr)
    second = daemons.start(small_model, socket_dir)
    assert query_status(the_socket(socket_dir), timeout=60).pid == second.pid
    assert_good_client_attaches(socket_dir, small_model)
