"""The small HTTP servers of the runtime helpers (agent, example engine): JSON replies,
a bound on request bodies, quiet access logs, a clean shutdown.

Standard library only (http.server): these run beside engines, where every extra
dependency is one more thing to pin in someone else's image.
"""

import argparse
import json
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_BODY_BYTES = 1 << 20


class BadRequest(Exception):
    """A request the client must fix; the message says how. Answered with `status`."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        self.status = status
        super().__init__(message)


def host_port(value: str) -> tuple[str, int]:
    """'HOST:PORT' (or '[v6]:PORT') for argparse."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT (e.g. 127.0.0.1:9401)")
    return host.strip("[]"), int(port)


class JsonHandler(BaseHTTPRequestHandler):
    """Subclasses implement routes with send_json / read_json."""

    protocol_version = "HTTP/1.1"  # keep-alive for probes and clients that reuse connections

    def send_json(self, status: int, doc) -> None:
        body = (json.dumps(doc) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_error_json(self, status: int, message: str) -> None:
        self.send_json(status, {"error": HTTPStatus(status).phrase, "message": message})

    def read_json(self, max_bytes: int = MAX_BODY_BYTES):
        """The request body parsed as JSON; BadRequest naming what is wrong with it."""
        length = self.headers.get("Content-Length")
        if length is None:
            raise BadRequest("the request needs a Content-Length header", HTTPStatus.LENGTH_REQUIRED)
        if not length.isdigit() or int(length) > max_bytes:
            self.close_connection = True  # the body stays unread: this connection cannot be reused
        if not length.isdigit():
            raise BadRequest(f"Content-Length {length!r} is not a number")
        if int(length) > max_bytes:
            raise BadRequest(f"the body is {length} bytes; the limit is {max_bytes}",
                             HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadRequest(f"the body is not valid JSON: {exc}") from None

    def route(self) -> str:
        return self.path.split("?", 1)[0]

    def answer_probe(self, route: str, ready, status) -> bool:
        """/healthz, /ready and /status as every weightcache sidecar and engine answers
        them (ready() -> bool, status() -> dict); False for any other route."""
        if route == "/healthz":
            self.send_json(HTTPStatus.OK, {"ok": True})
        elif route == "/ready":
            self.send_json(HTTPStatus.OK if ready() else HTTPStatus.SERVICE_UNAVAILABLE, status())
        elif route == "/status":
            self.send_json(HTTPStatus.OK, status())
        else:
            return False
        return True

    def log_message(self, *args):  # probes arrive every few seconds: keep the log quiet
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


def serve(host: str, port: int, handler: type[JsonHandler]) -> ThreadingHTTPServer:
    """Bind now (so a busy port fails the command at once) and serve on a thread."""
    server = (_Server6 if ":" in host else _Server)((host, port), handler)
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server
