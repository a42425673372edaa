"""Framing of wire messages on a Unix stream socket, and the names sockets get.

A frame is an 8-byte header (4 magic bytes, a big-endian uint32 payload length)
followed by one serialized protobuf message (wire_pb2.Request or wire_pb2.Response).
File descriptors travel as SCM_RIGHTS ancillary data on the frame's first bytes.
docs/protocol.md is the reader's version of this file.
"""

import contextlib
import os
import re
import socket
import struct
import time

from . import wire_pb2 as wire
from .errors import ProtocolError

PROTOCOL_VERSION = 1
LAYOUT_VERSION = 1

MAGIC = b"WCF1"
_HEADER = struct.Struct(">4sI")

# A request is a fingerprint and a few names; anything larger is hostile or broken.
MAX_REQUEST_BYTES = 64 * 1024
# A publication declares every tensor (names, shapes, strides): ~60 bytes each. Only a
# peer allowed to publish may send a request this large.
MAX_PUBLISH_REQUEST_BYTES = 16 * 1024 * 1024
# A layout of 100,000 tensors is about 10 MB; leave room, but stay bounded.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
# Linux accepts at most 253 fds in one SCM_RIGHTS message (SCM_MAX_FD).
MAX_FDS_PER_FRAME = 253

SOCKET_SUFFIX = ".sock"
# A store daemon's sockets carry this in place of a fingerprint digest: they serve every
# fingerprint engines publish into them.
STORE_TAG = "published"
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")
_DEVICE_RE = re.compile(r"^(cpu|GPU-[0-9a-fA-F-]{36})$")
# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


def check_cache_name(name: str) -> str:
    """Cache names become file names and Kubernetes names: DNS-label-like only."""
    if not _NAME_RE.match(name):
        raise ValueError(
            f"cache name {name!r} is not allowed: use 1-63 lowercase letters, digits, '-' or '.', "
            "starting and ending with a letter or digit"
        )
    return name


@contextlib.contextmanager
def reachable(path):
    """A name for the socket at `path` that fits sun_path, for bind() or connect().

    A node's socket directory (/run/weightcache/<namespace>/<cache>/) and a socket name
    holding a GPU UUID easily exceed 107 bytes together. A longer path is reached through
    an fd of its directory, held for the call: /proc/self/fd/<fd>/<name>, which the
    kernel resolves like the directory itself; only the name then counts.
    """
    path = str(path)
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        yield path
        return
    directory, name = os.path.split(path)
    fd = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        short = f"/proc/self/fd/{fd}/{name}"
        if len(os.fsencode(short)) > MAX_SOCKET_PATH:
            raise ValueError(f"socket name {name!r} is {len(os.fsencode(name))} bytes; even reached through its "
                             f"directory's fd ({short}) it exceeds the {MAX_SOCKET_PATH} bytes a Unix socket "
                             "allows: use a shorter cache name")
        yield short
    finally:
        os.close(fd)


def socket_name(cache_name: str, device: str, digest: str) -> str:
    """One socket per (cache, device, fingerprint): two jobs on a node never collide."""
    if not _DEVICE_RE.match(device):
        raise ValueError(f"device {device!r} must be 'cpu' or a GPU UUID (GPU-xxxxxxxx-...)")
    return f"{check_cache_name(cache_name)}__{device}__{digest[:12]}{SOCKET_SUFFIX}"


def parse_socket_name(file_name: str) -> tuple[str, str, str] | None:
    """(cache name, device, short digest) of a socket file name, or None for other files."""
    if not file_name.endswith(SOCKET_SUFFIX):
        return None
    parts = file_name[: -len(SOCKET_SUFFIX)].split("__")
    if len(parts) != 3:
        return None
    return parts[0], parts[1], parts[2]


def encode_frame(message) -> bytes:
    payload = message.SerializeToString()
    return _HEADER.pack(MAGIC, len(payload)) + payload


def send_message(sock: socket.socket, message, fds: list[int] = ()) -> None:
    """Send one frame; the fds ride on its first bytes."""
    data = encode_frame(message)
    if len(fds) > MAX_FDS_PER_FRAME:
        raise ProtocolError(f"{len(fds)} fds in one frame; the limit is {MAX_FDS_PER_FRAME}")
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    if data:
        sock.sendall(data)


class _Deadline:
    def __init__(self, timeout: float | None):
        self.end = None if timeout is None else time.monotonic() + timeout

    def apply(self, sock: socket.socket) -> None:
        if self.end is None:
            sock.settimeout(None)
            return
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed while waiting for a frame")
        sock.settimeout(left)


def recv_message(sock: socket.socket, message_type, *, max_bytes: int, timeout: float | None,
                 accept_fds: bool = False):
    """Read one frame within `timeout` seconds; return (message, fds).

    Without accept_fds, any fds a peer sends are dropped by the kernel (a plain recv
    offers no room for them), so a hostile client cannot make the daemon hold fds.
    Raises EOFError if the peer closes before the first byte, ProtocolError for a bad
    frame, TimeoutError when the deadline passes.
    """
    deadline = _Deadline(timeout)
    fds: list[int] = []
    header = _read_exact(sock, _HEADER.size, deadline, fds if accept_fds else None, eof_ok=True)
    if header is None:
        raise EOFError("peer closed the connection")
    try:
        magic, length = _HEADER.unpack(header)
        if magic != MAGIC:
            raise ProtocolError(f"bad frame: expected magic {MAGIC!r}, got {magic!r} (not a weightcache peer?)")
        if length > max_bytes:
            raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_bytes} bytes")
        payload = _read_exact(sock, length, deadline, fds if accept_fds else None, eof_ok=False)
        message = message_type()
        try:
            message.ParseFromString(payload)
        except Exception as exc:  # protobuf raises DecodeError, sometimes others
            raise ProtocolError(f"bad frame: payload is not a {message_type.__name__} ({exc})") from None
        return message, fds
    except BaseException:
        for fd in fds:
            _close_quietly(fd)
        raise


def _read_exact(sock, n, deadline, fds, eof_ok):
    chunks = []
    got = 0
    while got < n:
        deadline.apply(sock)
        if fds is not None:
            data, new_fds, flags, _ = socket.recv_fds(sock, n - got, MAX_FDS_PER_FRAME)
            fds.extend(new_fds)
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError("file descriptors were truncated in transit (MSG_CTRUNC)")
        else:
            data = sock.recv(n - got)
        if not data:
            if eof_ok and got == 0:
                return None
            raise ProtocolError(f"peer closed the connection mid-frame ({got} of {n} bytes)")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def error_response(code, message: str, mismatches=()) -> "wire.Response":
    response = wire.Response(protocol_version=PROTOCOL_VERSION)
    response.error.code = code
    response.error.message = message
    for field, expected, actual in mismatches:
        response.error.mismatches.add(field=field, expected=expected, actual=actual)
    return response
