"""A daemon start that loses the race waits for the winner's socket of the right kind
(client/load._wait_for_socket): a store start is not satisfied by a loaded daemon's
socket of the same cache, nor a loaded start by a store's."""

import socket

import pytest

from weightcache.client.errors import CacheUnavailable
from weightcache.client.load import ClientSettings, _wait_for_socket


def listen(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen()
    return s


@pytest.mark.parametrize("present, store, waits", [
    ("race__cpu__0123456789ab.sock", True, True),    # a loaded daemon's: not the store it waits for
    ("race__cpu__published.sock", True, False),
    ("race__cpu__published.sock", False, True),      # a store's: not the loaded daemon it waits for
    ("race__cpu__0123456789ab.sock", False, False),
])
def test_the_loser_waits_for_a_socket_of_its_own_kind(tmp_path, present, store, waits):
    with listen(tmp_path / present):
        settings = ClientSettings(socket_dir=str(tmp_path), cache_name="race", start_timeout=0.3)
        if waits:
            with pytest.raises(CacheUnavailable, match="did not publish within"):
                _wait_for_socket(tmp_path, "race", settings, store)
        else:
            _wait_for_socket(tmp_path, "race", settings, store)
