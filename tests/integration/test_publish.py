"""Engine-published caches against real store daemons (the writer protocol): real writer
and reader processes, real fds, real kills, hostile writers and readers.

A store daemon serves nothing until a writer commits; what it serves is sealed by the
kernel; a writer that dies, dawdles or lies leaves nothing served and nothing held; a
reader can never publish; and whatever goes wrong on one connection, everyone else
keeps reading the same bytes.
"""

import ctypes
import fcntl
import json
import mmap
import os
import pathlib
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile

import pytest
import torch
from cluster.procs import free_port
from procs import Daemons, read_json_line, wait_until
from prometheus_client.parser import text_string_to_metric_families
from publisher_proc import ENGINE, checksum, fingerprint, tensors
from test_bad_input import NOBODY, assert_closed, assert_error, needs_root, send_as_nobody
from test_daemon_http import get
from weightcache.client import (FingerprintMismatch, NotPublished, PublishFailed, attach, attach_or_publish,
                                list_sockets, publish, query_status)
from weightcache.client import wire_pb2 as wire
from weightcache.client.fingerprint import digest
from weightcache.client.protocol import (MAGIC, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES, PROTOCOL_VERSION, encode_frame,
                                         recv_message, send_message)
from weightcache.client.publish import declare, fill

from weightcache.synthetic import write_model

Error = wire.Error
WRITER = pathlib.Path(__file__).parents[1] / "publisher_proc.py"


# --- stores, writers, readers ------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory) -> pathlib.Path:
    """The checkpoint the engines' fingerprints name (its tensors are not what they publish)."""
    return write_model(tmp_path_factory.mktemp("models") / "tiny", {"w": ("F32", (2, 2))})


class Store:
    def __init__(self, proc, socket_dir, name, port=None):
        self.proc, self.socket_dir, self.name, self.port = proc, socket_dir, name, port
        self.path = socket_dir / f"{name}__cpu__published.sock"

    def caches(self) -> dict:
        """digest -> CacheEntry of every cache the store serves now."""
        return {c.fingerprint_digest: c for c in query_status(self.path, timeout=60).caches}

    def memfds(self) -> int:
        """How many of the daemon's fds are its slabs (memfds it named weightcache:...)."""
        count = 0
        for fd in os.listdir(f"/proc/{self.proc.pid}/fd"):
            try:
                count += os.readlink(f"/proc/{self.proc.pid}/fd/{fd}").startswith("/memfd:weightcache")
            except FileNotFoundError:
                pass
        return count

    def attach(self, expected, **kwargs):
        return attach(expected=expected, socket_dir=self.socket_dir, cache_name=self.name, timeout=60, **kwargs)

    def publish(self, named, expected):
        return publish(named, expected, socket_dir=self.socket_dir, cache_name=self.name, timeout=60)


def short_socket_dir() -> pathlib.Path:
    # Short on purpose (a Unix socket path fits 107 bytes); the parent lets uid 65534 through.
    parent = pathlib.Path(tempfile.mkdtemp(prefix="wcp-", dir="/tmp"))
    parent.chmod(0o711)
    return parent / "s"


def start_store(daemons: Daemons, name, *extra, http=False) -> Store:
    socket_dir = short_socket_dir()
    port = free_port() if http else None
    args = ["--allow-publish-uid", str(os.geteuid()), *extra, *(["--http-bind", f"127.0.0.1:{port}"] if http else [])]
    return Store(daemons.start(None, socket_dir, name, extra=args), socket_dir, name, port)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One store for the tests that each publish fingerprints of their own (a daemon start
    costs seconds here): readers of uid 65534's group may attach; only this uid publishes."""
    daemons = Daemons(tmp_path_factory.mktemp("shared-store"))
    readers = ["--socket-group", str(NOBODY), "--allow-gid", str(NOBODY)] if os.geteuid() == 0 else []
    store = start_store(daemons, "shared", "--commit-timeout", "60", *readers, http=True)
    yield store
    daemons.stop_all()
    shutil.rmtree(store.socket_dir.parent, ignore_errors=True)


@pytest.fixture
def store_dirs():
    made = []
    yield made
    for path in made:
        shutil.rmtree(path.parent, ignore_errors=True)


@pytest.fixture
def own_store(store_dirs, daemons):  # daemons stop before their dirs go
    """start(name, *extra, http=False): a store of this test's own, stopped after it."""
    def start(name, *extra, http=False):
        store = start_store(daemons, name, *extra, http=http)
        store_dirs.append(store.socket_dir)
        return store
    return start


class Child:
    """A publisher_proc.py process speaking JSON lines; stdin held open until finish().

    held=True: it gets ready (torch imported: seconds here) and acts only on release(),
    so that it can start while another process works. release_fd: the read end of a
    pipe several children share; closing its write end lets them all go at once."""

    def __init__(self, log_path, *args, held=False, release_fd=None, env=None):
        self.log = open(log_path, "wb")
        self.log_path = log_path
        self._release = None
        if held:
            release_fd, self._release = os.pipe()
        env = {**os.environ, **(env or {})}
        if release_fd is not None:
            env["PUBLISHER_RELEASE_FD"] = str(release_fd)
        self.proc = subprocess.Popen([sys.executable, str(WRITER), *map(str, args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     pass_fds=() if release_fd is None else (release_fd,))
        if held:
            os.close(release_fd)

    def read(self, timeout=120) -> dict:
        return read_json_line(self.proc, self.log_path, timeout)

    def release(self) -> None:
        assert self.read() == {"pid": self.proc.pid, "ready": True}
        os.close(self._release)
        self._release = None

    def finish(self, timeout=60) -> int:
        """Let it go (stdin EOF) and wait for its exit code."""
        self.proc.stdin.close()
        return self.proc.wait(timeout=timeout)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()
        if self._release is not None:
            os.close(self._release)


@pytest.fixture
def children(tmp_path):
    started = []

    def start(*args, **kwargs) -> Child:
        child = Child(tmp_path / f"child-{len(started)}.log", *args, **kwargs)
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()


def publish_request(expected, table) -> "wire.Request":
    req = wire.Request(protocol_version=PROTOCOL_VERSION, client_name="test-writer")
    req.publish.fingerprint.CopyFrom(expected)
    req.publish.tensors.CopyFrom(table)
    return req


def read_response(sock, timeout=60):
    return recv_message(sock, wire.Response, max_bytes=MAX_RESPONSE_BYTES, timeout=timeout, accept_fds=True)


def open_publication(store, expected, named):
    """A writer step by step: connect, ask to publish NAMED; (socket, response, fds)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect(str(store.path))
    send_message(sock, publish_request(expected, declare(named)))
    response, fds = read_response(sock)
    return sock, response, fds


def send_commit(sock):
    commit = wire.Request(protocol_version=PROTOCOL_VERSION)
    commit.commit.SetInParent()
    send_message(sock, commit)
    return read_response(sock)


def close_all(fds):
    for fd in fds:
        os.close(fd)


def raw_exchange(store, data: bytes) -> "wire.Response":
    """Send raw bytes from this process; the daemon's answer, after which it closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        sock.connect(str(store.path))
        sock.sendall(data)
        response, fds = read_response(sock)
        close_all(fds)
        assert_closed(sock)
    return response


def as_nobody(store, data: bytes) -> "wire.Response":
    """Send raw bytes from a process of uid/gid 65534 (a reader by the store's --allow-gid)."""
    return send_as_nobody(store.path, data)


def same_bytes(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and checksum(got) == checksum(want)


# --- a publication's life ----------------------------------------------------------------

def test_published_cache_outlives_its_writer_and_a_fresh_reader_sees_the_written_bytes(shared, model, children):
    writer = children("publish", model, shared.socket_dir, shared.name, 7, "default")
    reader = children("attach", model, shared.socket_dir, shared.name, "default", held=True)
    wrote = writer.read()
    assert wrote["wrote"] is True and wrote["checksum"] == checksum(tensors(7)), wrote
    assert writer.finish() == 0
    [entry] = [c for c in shared.caches().values() if c.fingerprint_digest == digest(fingerprint(model))]
    wait_until(lambda: shared.caches()[entry.fingerprint_digest].attached_clients == 0, timeout=30,
               what="the writer's departure counted")
    assert entry.fingerprint.engine == ENGINE and entry.publisher_uid == os.geteuid()
    assert entry.tensors == len(tensors(7))

    reader.release()  # a fresh process: it has not talked to the store before
    assert reader.read()["checksum"] == checksum(tensors(7))
    with shared.attach(fingerprint(model)) as here:  # the store still serves, here too
        assert same_bytes(here.tensors, tensors(7))
    assert reader.finish() == 0


def test_readers_never_see_a_publication_before_its_commit(own_store, model):
    store = own_store("precommit")
    expected, named = fingerprint(model, case="precommit"), tensors(1)
    sock, response, fds = open_publication(store, expected, named)
    try:
        assert response.WhichOneof("kind") == "writable", response
        fill(response.writable, fds, named)
        close_all(fds)
        with pytest.raises(NotPublished, match="holds no published cache"):
            store.attach(expected)
        assert store.caches() == {}
        attached, sealed = send_commit(sock)
        assert attached.WhichOneof("kind") == "attached", attached
        close_all(sealed)
        assert list(store.caches()) == [digest(expected)]
        with store.attach(expected) as reader:
            assert same_bytes(reader.tensors, named)
    finally:
        sock.close()


def test_writer_killed_mid_write_leaves_nothing_served_or_held(shared, model, children):
    expected, named = fingerprint(model, case="killed"), tensors(3)
    before = shared.memfds()
    writer = children("hold-writable", shared.path, encode_frame(publish_request(expected, declare(named))).hex())
    assert writer.read()["written"] > 0
    assert shared.memfds() > before  # its slabs, reserved while it writes
    assert digest(expected) not in shared.caches()
    writer.proc.send_signal(signal.SIGKILL)
    writer.proc.wait()
    wait_until(lambda: shared.memfds() == before, timeout=30, what="the dead writer's slabs freed")
    assert digest(expected) not in shared.caches()
    with pytest.raises(FingerprintMismatch):  # other caches are served; not this one
        shared.attach(expected)
    attached, wrote = shared.publish(named, expected)  # the fingerprint is free again
    with attached:
        assert wrote is True and same_bytes(attached.tensors, named)


def test_writer_that_never_commits_is_dropped_after_the_commit_timeout(own_store, model):
    store = own_store("slow", "--commit-timeout", "1")
    expected = fingerprint(model, case="slow")
    before = store.memfds()
    sock, response, fds = open_publication(store, expected, tensors(4))
    try:
        assert response.WhichOneof("kind") == "writable" and response.writable.commit_timeout_s == 1.0, response
        dropped, _ = read_response(sock, timeout=30)  # this writer just waits
        assert_error(dropped, Error.PUBLISH_FAILED, "publication dropped", "no commit within 1s")
        assert_closed(sock)
    finally:
        sock.close()
        close_all(fds)
    wait_until(lambda: store.memfds() == before, timeout=30, what="the dropped publication's slabs freed")
    assert store.caches() == {}
    with pytest.raises(NotPublished):
        store.attach(expected)


def test_two_writers_racing_for_one_fingerprint_one_writes_the_other_attaches(shared, model, children):
    release_read, release_write = os.pipe()
    try:
        writers = [children("publish", model, shared.socket_dir, shared.name, seed, "race", release_fd=release_read)
                   for seed in (11, 12)]
        for writer in writers:
            assert writer.read() == {"pid": writer.proc.pid, "ready": True}
    finally:
        os.close(release_read)
        os.close(release_write)  # both go
    results = {w.proc.pid: w.read() for w in writers}
    winners = [r for r in results.values() if r["wrote"]]
    assert len(winners) == 1, results
    seed = 11 if results[writers[0].proc.pid]["wrote"] else 12
    assert {r["checksum"] for r in results.values()} == {checksum(tensors(seed))}, results
    race = digest(fingerprint(model, case="race"))
    entry = shared.caches()[race]
    assert entry.attached_clients == 2
    with shared.attach(fingerprint(model, case="race")) as reader:
        assert same_bytes(reader.tensors, tensors(seed))
    for writer in writers:
        assert writer.finish() == 0


# --- who may write, and what cannot be changed --------------------------------------------

@needs_root
def test_a_reader_may_attach_but_never_publish(shared, model):
    status_request = wire.Request(protocol_version=PROTOCOL_VERSION, status=wire.StatusRequest())
    status = as_nobody(shared, encode_frame(status_request))
    assert status.WhichOneof("kind") == "status", status  # a reader, by its group
    expected = fingerprint(model, case="nobody")
    refused = as_nobody(shared, encode_frame(publish_request(expected, declare(tensors(5)))))
    assert_error(refused, Error.PERMISSION_DENIED, f"uid {NOBODY}", "may attach but not publish",
                 "--allow-publish-uid")
    assert digest(expected) not in shared.caches()


def test_publishing_a_published_fingerprint_again_attaches_and_changes_nothing(shared, model):
    expected = fingerprint(model, case="again")
    first, wrote = shared.publish(tensors(21), expected)
    with first:
        assert wrote is True
        second, wrote_again = shared.publish(tensors(22), expected)  # other bytes, same fingerprint
        with second:
            assert wrote_again is False
            assert same_bytes(second.tensors, tensors(21)) and same_bytes(first.tensors, tensors(21))
    with shared.attach(expected) as reader:
        assert same_bytes(reader.tensors, tensors(21))


def _mprotect_writable(fd, size) -> int:
    """Map FD read-only and shared, then ask the kernel to make the mapping writable: errno (0: it did)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        return 0 if libc.mprotect(addr, size, mmap.PROT_READ | mmap.PROT_WRITE) == 0 else ctypes.get_errno()
    finally:
        libc.munmap(addr, size)


def test_writer_keeping_a_dup_of_its_slab_cannot_change_it_after_the_commit(shared, model):
    expected, named = fingerprint(model, case="dup"), tensors(6)
    sock, response, fds = open_publication(shared, expected, named)
    kept = os.dup(fds[0])
    size = response.writable.layout.slabs[0].size
    try:
        fill(response.writable, fds, named)
        close_all(fds)
        attached, sealed = send_commit(sock)
        assert attached.WhichOneof("kind") == "attached", attached
        close_all(sealed)
        with pytest.raises(PermissionError):
            os.pwrite(kept, b"\xff" * 16, 0)
        with pytest.raises(PermissionError):
            mmap.mmap(kept, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.ftruncate(kept, 0)
        with pytest.raises(PermissionError):  # F_SEAL_SEAL: no seal can be added, none removed
            fcntl.fcntl(kept, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
        assert _mprotect_writable(kept, size) != 0
        with shared.attach(expected) as reader:
            assert same_bytes(reader.tensors, named)
    finally:
        os.close(kept)
        sock.close()


def test_writer_still_mapping_a_slab_writable_at_commit_publishes_nothing(shared, model):
    expected, named = fingerprint(model, case="mapped"), tensors(8)
    before = shared.memfds()
    sock, response, fds = open_publication(shared, expected, named)
    region = mmap.mmap(fds[0], response.writable.layout.slabs[0].size, flags=mmap.MAP_SHARED,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        fill(response.writable, fds, named)  # its own mappings are gone; this one stays
        dropped, _ = send_commit(sock)
        assert_error(dropped, Error.PUBLISH_FAILED, "publication dropped", "still maps it writable")
        assert_closed(sock)
    finally:
        region.close()
        close_all(fds)
        sock.close()
    assert digest(expected) not in shared.caches()
    wait_until(lambda: shared.memfds() == before, timeout=30, what="the refused slabs freed")


@pytest.mark.parametrize("resize", ["grow", "shrink"])
def test_writer_cannot_resize_its_slabs_behind_the_daemons_back(shared, model, resize):
    """A writer is trusted with the bytes, not with the daemon: a slab grown past what it
    declared (and what the budget counts) or shrunk below what readers map is never served."""
    expected, named = fingerprint(model, case=f"resize-{resize}"), tensors(9)
    sock, response, fds = open_publication(shared, expected, named)
    size = response.writable.layout.slabs[0].size
    try:
        fill(response.writable, fds, named)
        try:
            os.ftruncate(fds[0], 64 << 20 if resize == "grow" else 0)
            resized = True
        except PermissionError:  # sealed against resizing from the start: what we want
            resized = False
        close_all(fds)
        answer, sealed = send_commit(sock)
        close_all(sealed)
        if resized:
            assert_error(answer, Error.PUBLISH_FAILED, "publication dropped")
    finally:
        sock.close()
    served = shared.caches().get(digest(expected))
    if served is not None:  # only the slab it declared, whole
        assert served.resident_bytes == size
        with shared.attach(expected) as reader:
            assert same_bytes(reader.tensors, named)


def test_publication_too_large_to_allocate_is_refused_and_leaks_nothing(shared, model):
    """No --max-device-bytes here: a declared petabyte must still get an answer, not a hang-up."""
    expected = fingerprint(model, case="petabyte")
    before = shared.memfds()
    table = wire.TensorTable(name=["huge"], dtype=["U8"], ndim=[1], shape=[1 << 50], strides=[1])
    refused = raw_exchange(shared, encode_frame(publish_request(expected, table)))
    assert refused.WhichOneof("kind") == "error", refused
    assert refused.error.code in (Error.OVER_BUDGET, Error.PUBLISH_FAILED), refused.error
    assert str(1 << 50) in refused.error.message, refused.error.message
    wait_until(lambda: shared.memfds() == before, timeout=30, what="no slab left behind")
    assert digest(expected) not in shared.caches()


# --- garbage -----------------------------------------------------------------------------

def _table(**columns) -> "wire.TensorTable":
    base = dict(name=["w"], dtype=["F32"], ndim=[2], shape=[2, 3], strides=[3, 1])
    return wire.TensorTable(**{**base, **columns})


def _fingerprint_with(model, **fields):
    fp = fingerprint(model, case="garbage")
    for name, value in fields.items():
        setattr(fp, name, value)
    return fp


GARBAGE = {
    "inconsistent-columns": (dict(table=_table(name=["w", "v"])), "columns have different lengths"),
    "duplicate-names": (dict(table=_table(name=["w", "w"], dtype=["F32", "F32"], ndim=[1, 1], shape=[2, 2],
                                          strides=[1, 1])), "'w' is declared more than once"),
    "unknown-dtype": (dict(table=_table(dtype=["F128"])), "dtype #0 is not one of"),
    "negative-dimension": (dict(table=_table(shape=[2, -3])), "must not be negative"),
    "too-many-dimensions": (dict(table=_table(ndim=[17], shape=[1] * 17, strides=[1] * 17)), "at most 16"),
    "zero-tensors": (dict(table=wire.TensorTable()), "declares no tensors"),
    "no-engine": (dict(fields={"engine": ""}), "names no engine"),
    "wrong-device-kind": (dict(fields={"device_kind": "cuda"}), "device_kind is 'cuda'"),
    "wrong-layout-version": (dict(fields={"layout_version": 7}), "layout version 7"),
}


@pytest.fixture
def bystander(shared, model):
    """A reader of an already-published cache, attached while the garbage arrives."""
    expected = fingerprint(model, case="bystander")
    if digest(expected) not in shared.caches():
        shared.publish(tensors(31), expected)[0].close()
    with shared.attach(expected) as reader:
        yield reader
    with shared.attach(expected) as after:  # a fresh reader: nothing resident changed
        assert same_bytes(after.tensors, tensors(31)) and same_bytes(reader.tensors, tensors(31))


@pytest.mark.parametrize("case", GARBAGE)
def test_bad_publication_is_refused_naming_the_problem(shared, model, bystander, case):
    spec, needle = GARBAGE[case]
    request = publish_request(_fingerprint_with(model, **spec.get("fields", {})), spec.get("table", _table()))
    before = shared.caches()
    assert_error(raw_exchange(shared, encode_frame(request)), Error.BAD_REQUEST, "publication refused", needle)
    assert shared.caches().keys() == before.keys()
    assert same_bytes(bystander.tensors, tensors(31))


@pytest.mark.parametrize("name", ["w\x00secret", "w\x1b[31msecret", "w\u202esecret"], ids=["nul", "escape", "bidi"])
def test_unprintable_tensor_name_is_refused_without_echoing_it(shared, model, bystander, name):
    request = publish_request(fingerprint(model, case="garbage"), _table(name=[name]))
    refused = raw_exchange(shared, encode_frame(request))
    assert_error(refused, Error.BAD_REQUEST, "tensor #0's name", "printable")
    assert "secret" not in refused.error.message and name not in refused.error.message


def test_name_that_is_not_utf8_is_refused_without_echoing_it(shared, model, bystander):
    payload = publish_request(fingerprint(model, case="garbage"), _table(name=["wSECRET"])).SerializeToString()
    payload = payload.replace(b"wSECRET", b"w\xff\xfeCRET")
    refused = raw_exchange(shared, struct.pack(">4sI", MAGIC, len(payload)) + payload)
    assert_error(refused, Error.BAD_REQUEST, "not a Request")
    assert "CRET" not in refused.error.message


def test_commit_without_a_publish_is_refused(shared, bystander):
    commit = wire.Request(protocol_version=PROTOCOL_VERSION)
    commit.commit.SetInParent()
    assert_error(raw_exchange(shared, encode_frame(commit)), Error.BAD_REQUEST, "a commit must follow a publish")


def test_anything_but_a_commit_after_writable_drops_the_publication(shared, model, bystander):
    expected = fingerprint(model, case="not-a-commit")
    sock, response, fds = open_publication(shared, expected, tensors(2))
    try:
        close_all(fds)
        sock.sendall(encode_frame(wire.Request(protocol_version=PROTOCOL_VERSION, status=wire.StatusRequest())))
        dropped, _ = read_response(sock)
        assert_error(dropped, Error.PUBLISH_FAILED, "expected a commit, got status")
    finally:
        sock.close()
    assert digest(expected) not in shared.caches()


def test_random_bytes_get_bad_request(shared, bystander):
    assert_error(raw_exchange(shared, b"\0JNK" + os.urandom(4092)), Error.BAD_REQUEST, "magic")


@needs_root
def test_large_publish_request_from_a_reader_is_refused_from_its_header(shared, bystander):
    header_only = struct.pack(">4sI", MAGIC, MAX_REQUEST_BYTES + 1)  # the payload never comes
    refused = as_nobody(shared, header_only)
    assert_error(refused, Error.BAD_REQUEST, str(MAX_REQUEST_BYTES + 1), f"limit of {MAX_REQUEST_BYTES} bytes")


# --- room on the device, and what the outside world sees ----------------------------------

def _block(value: float, elements: int = 1024) -> dict:
    return {"w": torch.full((elements,), value, dtype=torch.float32)}  # 4 bytes each, 256-aligned slabs


def test_idle_caches_are_evicted_for_room_and_attached_ones_never(own_store, model):
    store = own_store("budget", "--max-device-bytes", "9000", http=True)
    a, b, c, d = (fingerprint(model, case=f"budget-{x}") for x in "abcd")
    held_a, _ = store.publish(_block(1.0), a)  # its writer stays attached
    with held_a:
        held_b, _ = store.publish(_block(2.0), b)
        held_b.close()
        wait_until(lambda: store.caches()[digest(b)].attached_clients == 0, timeout=30, what="b idle")
        held_c, wrote = store.publish(_block(3.0), c)  # 4096 + 4096 + 4096 > 9000: b must go
        with held_c:
            assert wrote is True
            assert set(store.caches()) == {digest(a), digest(c)}
            metrics = get(store.port, "/metrics")[1].decode()
            assert 'weightcache_evictions{cache="budget",device="cpu"} 1.0' in metrics, metrics
            with pytest.raises(PublishFailed, match="OVER_BUDGET.*budget is 9000 bytes"):
                store.publish(_block(4.0, 2048), d)  # 8192 beside the 8192 attached engines hold
            assert set(store.caches()) == {digest(a), digest(c)}
            assert same_bytes(held_a.tensors, _block(1.0)) and same_bytes(held_c.tensors, _block(3.0))
    wait_until(lambda: all(e.attached_clients == 0 for e in store.caches().values()), timeout=30, what="all idle")
    held_d, wrote = store.publish(_block(4.0, 2048), d)  # now both idle caches make room
    with held_d:
        assert wrote is True and set(store.caches()) == {digest(d)}
        assert query_status(store.path).budget_bytes == 9000
    with pytest.raises(FingerprintMismatch):
        store.attach(b)


def _samples(port, name) -> list:
    text = get(port, "/metrics")[1].decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def test_status_and_metrics_list_each_published_cache_with_its_engine_and_bytes(shared, model):
    first, other = fingerprint(model, case="seen"), fingerprint(model, case="seen", engine="otherengine")
    with shared.publish(tensors(41), first)[0] as one, shared.publish(_block(5.0), other)[0] as two:
        code, body = get(shared.port, "/status")
        assert code == 200
        [device] = json.loads(body)["devices"]
        listed = {c["fingerprint"]: c for c in device["caches"]}
        for expected, held in ((first, one), (other, two)):
            entry = listed[digest(expected)]
            assert entry["engine"] == expected.engine
            assert entry["resident_bytes"] == held.resident_bytes > 0
            assert entry["tensors"] == len(held.tensors)
            assert entry["publisher_uid"] == os.geteuid()
            assert entry["fingerprint_fields"]["engine_settings_hash"] == expected.engine_settings_hash
            samples = [s for s in _samples(shared.port, "weightcache_cache_resident_bytes")
                       if s.labels["fingerprint"] == digest(expected)[:12]]
            assert [(s.labels["engine"], s.labels["cache"], s.value) for s in samples] == \
                [(expected.engine, "shared", float(held.resident_bytes))]
        [caches] = _samples(shared.port, "weightcache_caches")
        assert caches.value == len(shared.caches()) == len(device["caches"])


# --- engines, and the store's own death ---------------------------------------------------

def _gone(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_attach_or_publish_starts_a_store_then_publishes_then_attaches(model, children, store_dirs):
    socket_dir = short_socket_dir()
    store_dirs.append(socket_dir)
    env = {"WEIGHTCACHE_MODE": "daemon", "WEIGHTCACHE_SOCKET_DIR": str(socket_dir), "WEIGHTCACHE_FALLBACK": "disk"}
    try:
        first = children("engine", model, 51, env=env)
        second = children("engine", model, 52, env=env, held=True)
        got = first.read()
        assert (got["source"], got["checksum"]) == ("published", checksum(tensors(51))), got
        assert "nothing published yet" in got["reason"]
        assert first.finish() == 0
        second.release()
        got = second.read()
        assert (got["source"], got["checksum"]) == ("cache", checksum(tensors(51))), got
        assert second.finish() == 0

        where = dict(mode="client", socket_dir=str(socket_dir), model_dir=model)
        other_dtype = fingerprint(model, dtype="float16")
        with pytest.raises(FingerprintMismatch) as info:
            attach_or_publish(other_dtype, load=lambda: tensors(53), fallback="error", **where)
        assert [m[0] for m in info.value.mismatches] == ["dtype"], info.value.mismatches
        beside = attach_or_publish(other_dtype, load=lambda: tensors(53), fallback="disk", **where)
        with beside.attached:
            assert beside.source == "published" and "dtype" in beside.reason, beside.reason
            assert same_bytes(beside.tensors, tensors(53))
            [path] = list_sockets(socket_dir)
            assert len(query_status(path).caches) == 2
    finally:
        for path in list_sockets(socket_dir):
            pid = query_status(path).pid
            os.kill(pid, signal.SIGTERM)
            wait_until(lambda: _gone(pid), timeout=30, what=f"the store {pid} to stop")


def test_readers_keep_identical_bytes_after_the_store_is_sigkilled(own_store, model):
    store = own_store("mortal")
    expected = fingerprint(model, case="mortal")
    written, _ = store.publish(tensors(61), expected)
    with written, store.attach(expected) as reader:
        store.proc.kill()
        store.proc.wait()
        assert same_bytes(reader.tensors, tensors(61)) and same_bytes(written.tensors, tensors(61))
        assert checksum(reader.tensors) == checksum(tensors(61))  # read again, every byte
