"""The hand-off of a live daemon's resident slabs to its successor, both sides (an
upgrade without a reload; docs/protocol.md, "Hand-off").

Successor: `take_over_from()` asks the running daemon for its slab fds over its socket
(nothing is read from disk), and refuses, so that the caller loads instead, when that
daemon cannot hand over (`cuda-ipc` memory dies with its process) or serves other
weights than this daemon was started for; `tell_predecessor()` once its own socket
serves. Predecessor: `step_aside()` stops accepting once the successor serves, lets
it have the lock, and then exits, or under a supervisor waits to be stopped.
"""

import logging
import os
import pathlib
import select
import threading

from weightcache.client import fingerprint as fp
from weightcache.client import wire_pb2 as wire
from weightcache.client.attach import request
from weightcache.client.errors import PeerRejected
from weightcache.client.protocol import PROTOCOL_VERSION

from .server import HANDOFF_DONE, ResidentCache

log = logging.getLogger("weightcache.daemon")

# The fingerprint fields that say which weights are served (as opposed to the device,
# driver and torch a daemon runs with): slabs are taken over only where these agree.
WEIGHT_FIELDS = ("model_hash", "revision", "tp_size", "tp_rank", "pp_size", "pp_rank", "dp_size", "dp_rank",
                 "quantization", "quantization_config_hash", "dtype", "layout_version")


class TakeOverRefused(Exception):
    """The live daemon cannot hand its slabs over, or serves other weights: load instead."""


class _HeldFd:
    """A slab handle taken over from a predecessor: this daemon only passes it on."""

    def __init__(self, fd: int):
        self.fd = fd

    def close(self) -> None:
        os.close(self.fd)


def _other_weights(mine: dict, theirs: "wire.Fingerprint") -> list[str]:
    """Each weight-defining field where the running daemon's fingerprint differs from what
    this daemon's configuration would load ("field: theirs -> ours")."""
    served = fp.fields(theirs)
    return [f"{k}: {served[k]!r} -> {mine[k]!r}" for k in WEIGHT_FIELDS if served[k] != mine[k]]


def take_over_from(path: pathlib.Path, config, parallel: fp.Parallelism):
    """One hand-off: (cache, slabs, the connection to answer once this daemon's socket is
    published). Raises TakeOverRefused, or OSError/EOFError/ProtocolError when the
    daemon did not answer (worth another try)."""
    # What this daemon would load (config.json and the headers, no weight bytes).
    mine = fp.fields(fp.compute(config.model_dir, revision=config.revision, parallel=parallel))
    req = wire.Request(protocol_version=PROTOCOL_VERSION, client_name=f"successor-pid-{os.getpid()}")
    req.handoff.SetInParent()
    try:
        sock, response, fds = request(path, req, timeout=config.handshake_timeout, accept_fds=True)
    except PeerRejected as exc:
        raise TakeOverRefused(str(exc)) from None
    att = response.attached
    problem = ""
    if response.WhichOneof("kind") != "attached":
        problem = f"{path}: expected an Attached answer, got {response.WhichOneof('kind')}"
    elif att.backend != config.backend:
        problem = f"the running daemon serves backend {att.backend}; this one was started for {config.backend}"
    elif differing := _other_weights(mine, att.fingerprint):
        problem = "the running daemon serves other weights (" + "; ".join(differing) + ")"
    if problem:
        sock.close()  # without the "published" byte: the running daemon changes nothing
        for fd in fds:
            os.close(fd)
        raise TakeOverRefused(problem)
    cache = ResidentCache(name=config.name, backend=att.backend, device=att.device, fingerprint=att.fingerprint,
                          layout=att.layout, slab_fds=fds, model_path=str(config.model_dir), load_s=0.0)
    log.info("taken over", extra={"fields": {"from": str(path), "bytes": cache.resident_bytes,
                                             "slabs": len(fds), "device": att.device}})
    return cache, [_HeldFd(fd) for fd in fds], sock


def tell_predecessor(connection) -> None:
    """This daemon's socket serves: the predecessor may go, and leaves us its lock."""
    try:
        connection.sendall(HANDOFF_DONE)
    except OSError:
        pass  # it stopped meanwhile (its pod deleted): its lock comes to us all the same
    finally:
        connection.close()


def release_locks(locks: dict) -> None:
    """Close every lock fd in LOCKS (device -> fd), also when another thread does the same."""
    while True:
        try:
            os.close(locks.popitem()[1])
        except KeyError:
            return


def _stop_accepting(server) -> None:
    """Close the listening socket, serving the connections already queued on it (engines
    that connected just before the successor's socket replaced this one)."""
    server.shutdown()
    server.timeout = 0
    try:
        while select.select([server.socket], [], [], 0)[0]:
            server.handle_request()
    except (OSError, ValueError):
        pass  # SIGTERM came meanwhile and the daemon's own shutdown closed it
    server.server_close()


def step_aside(servers: list, locks: dict, state, stop: threading.Event, stay: bool) -> None:
    """Once a successor took every device over and serves it: stop accepting and release
    the locks. Then exit, or with STAY (a supervised daemon, whose pod would restart it
    if it exited) report handed-over and wait for SIGTERM. Attached engines' connections
    stay open until this process ends; their memory is the successor's too."""
    for server in servers:
        server.handed_off.wait()
    log.info("handed over", extra={"fields": {"devices": len(servers), "waiting_for_sigterm": stay}})
    if stay:
        state.handed_over("a successor took the slabs over and serves them; this daemon serves nothing and "
                          "waits to be stopped")
    for server in servers:
        _stop_accepting(server)
    release_locks(locks)
    if not stay:
        stop.set()
