import os
import socket
import struct

import pytest

from weightcache.client import wire_pb2 as wire
from weightcache.client.errors import ProtocolError
from weightcache.client.protocol import (MAGIC, PROTOCOL_VERSION, parse_socket_name, recv_message, send_message,
                                         socket_name)


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def test_a_message_and_its_fds_arrive_together(pair, tmp_path):
    a, b = pair
    path = tmp_path / "f"
    path.write_bytes(b"slab")
    fd = os.open(path, os.O_RDONLY)
    msg = wire.Response(protocol_version=PROTOCOL_VERSION)
    msg.attached.cache_name = "c" * 100_000  # larger than one socket read
    send_message(a, msg, [fd, fd])
    os.close(fd)
    got, fds = recv_message(b, wire.Response, max_bytes=1 << 20, timeout=5, accept_fds=True)
    assert got == msg and len(fds) == 2
    assert os.read(fds[0], 4) == b"slab"
    for f in fds:
        os.close(f)


def test_an_oversized_frame_is_refused_before_its_payload_is_read(pair):
    a, b = pair
    a.sendall(struct.pack(">4sI", MAGIC, 10_000_000))
    with pytest.raises(ProtocolError, match="exceeds the limit of 65536 bytes"):
        recv_message(b, wire.Request, max_bytes=65536, timeout=5)


def test_bad_magic_is_named(pair):
    a, b = pair
    a.sendall(b"GET / HTTP/1.1\r\n")
    with pytest.raises(ProtocolError, match="expected magic"):
        recv_message(b, wire.Request, max_bytes=65536, timeout=5)


def test_a_peer_closing_mid_frame_is_an_error_and_before_a_frame_is_eof(pair):
    a, b = pair
    a.sendall(struct.pack(">4sI", MAGIC, 100) + b"x" * 10)
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError, match="mid-frame"):
        recv_message(b, wire.Request, max_bytes=65536, timeout=5)
    c, d = socket.socketpair()
    c.close()
    with pytest.raises(EOFError):
        recv_message(d, wire.Request, max_bytes=65536, timeout=5)
    d.close()


def test_a_silent_peer_times_out(pair):
    _, b = pair
    with pytest.raises(TimeoutError):
        recv_message(b, wire.Request, max_bytes=65536, timeout=0.05)


def test_socket_names_round_trip_and_reject_bad_parts():
    name = socket_name("llama-70b", "GPU-0a1b2c3d-0000-1111-2222-333344445555", "ab" * 32)
    assert parse_socket_name(name) == ("llama-70b", "GPU-0a1b2c3d-0000-1111-2222-333344445555", "ab" * 6)
    with pytest.raises(ValueError, match="cache name"):
        socket_name("../etc", "cpu", "00" * 32)
    with pytest.raises(ValueError, match="GPU UUID"):
        socket_name("ok", "0", "00" * 32)
    assert parse_socket_name("notes.txt") is None
