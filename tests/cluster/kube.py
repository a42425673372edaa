"""A minimal Kubernetes REST client on the standard library, for the simulator's own
traffic (plain JSON dicts, exact patch types, streaming watches). Tests use the
official client through Cluster.api_client instead."""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Iterator


class ApiError(Exception):
    def __init__(self, status: int, body: str, what: str) -> None:
        super().__init__(f"{what}: HTTP {status}: {body[:500]}")
        self.status = status


MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


@dataclass
class Rest:
    host: str
    port: int
    ca: str
    cert: str
    key: str

    @classmethod
    def from_server(cls, server: str, ca: str, cert: str, key: str) -> "Rest":
        u = urllib.parse.urlsplit(server)
        return cls(u.hostname, u.port, ca, cert, key)

    def _conn(self, timeout: float | None) -> http.client.HTTPSConnection:
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        return http.client.HTTPSConnection(self.host, self.port, context=ctx, timeout=timeout)

    def request(self, method: str, path: str, body=None, params: dict | None = None,
                content_type: str = "application/json", timeout: float = 30) -> dict:
        if params:
            path += "?" + urllib.parse.urlencode(params)
        conn = self._conn(timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": content_type,
                                                           "Accept": "application/json"})
            resp = conn.getresponse()
            text = resp.read().decode()
        finally:
            conn.close()
        if resp.status >= 300:
            raise ApiError(resp.status, text, f"{method} {path}")
        return json.loads(text) if text else {}

    def get(self, path: str, **params) -> dict:
        return self.request("GET", path, params=params or None)

    def create(self, path: str, body: dict) -> dict:
        return self.request("POST", path, body)

    def patch(self, path: str, body: dict, kind: str = MERGE) -> dict:
        return self.request("PATCH", path, body, content_type=kind)

    def delete(self, path: str, body: dict | None = None) -> dict:
        return self.request("DELETE", path, body)

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 240) -> Iterator[dict]:
        """Events of one watch call, until the server ends it."""
        params = {"watch": "1", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(timeout_seconds)}
        conn = self._conn(timeout_seconds + 30)
        try:
            conn.request("GET", path + "?" + urllib.parse.urlencode(params))
            resp = conn.getresponse()
            if resp.status >= 300:
                raise ApiError(resp.status, resp.read().decode(), f"WATCH {path}")
            for line in resp:
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()
