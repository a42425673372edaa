"""What the daemon tells the outside world over HTTP: liveness, readiness, Prometheus
metrics and a status document the operator aggregates into the WeightCache.

`DaemonState` is written by the loading threads and read by HTTP threads; every read
takes a snapshot under its lock, so a scrape never sees a half-updated state.
"""

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from weightcache.client import fingerprint as fp

log = logging.getLogger("weightcache.daemon")

LOADING, READY, FAILED = "loading", "ready", "failed"
# A daemon that handed its slabs to a successor and waits to be stopped (its pod deleted):
# alive, but it serves nothing.
HANDED_OVER = "handed-over"


@dataclass
class DaemonState:
    cache: str
    backend: str
    model: str
    store: bool = False  # started without a model: engines publish into it
    state: str = LOADING
    reason: str = ""
    message: str = ""
    total_bytes: int = 0
    loaded_bytes: int = 0
    _started: float = field(default_factory=time.monotonic)
    _served: list = field(default_factory=list)  # (ResidentCache, CacheServer, socket path)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def expect(self, nbytes: int) -> None:
        with self._lock:
            self.total_bytes += nbytes

    def loaded(self, nbytes: int) -> None:
        with self._lock:
            self.loaded_bytes += nbytes

    def note(self, reason: str, message: str) -> None:
        """Why a daemon that is not ready yet is waiting (e.g. TakingOver)."""
        with self._lock:
            self.reason, self.message = reason, message

    def ready(self, served: list) -> None:
        with self._lock:
            self._served = list(served)
            self.state, self.reason, self.message = READY, "", ""

    def handed_over(self, message: str) -> None:
        with self._lock:
            self._served = []
            self.state, self.reason, self.message = HANDED_OVER, "HandedOver", message

    def fail(self, reason: str, message: str) -> None:
        with self._lock:
            self.state, self.reason, self.message = FAILED, reason, message

    def snapshot(self) -> dict:
        """The status document (the contract the operator reads; see docs/protocol.md)."""
        with self._lock:
            elapsed = time.monotonic() - self._started
            rate = self.loaded_bytes / elapsed if elapsed > 0 and self.state == LOADING else None
            remaining = self.total_bytes - self.loaded_bytes
            devices = [_device_status(cache, server, path) for cache, server, path in self._served]
            return {
                "cache": self.cache, "state": self.state, "reason": self.reason, "message": self.message,
                "backend": self.backend, "pid": os.getpid(), "model": self.model, "store": self.store,
                "progress": {"loaded_bytes": self.loaded_bytes, "total_bytes": self.total_bytes,
                             "bytes_per_s": rate, "eta_s": remaining / rate if rate else None},
                "devices": devices,
            }


def _device_status(cache, server, path) -> dict:
    """One device's part of the status document: the loaded cache's fingerprint (empty
    for a store) and every cache it serves, each with its own bytes and engines."""
    caches = [{"fingerprint": e.digest, "fingerprint_fields": fp.fields(e.cache.fingerprint),
               "engine": e.cache.fingerprint.engine, "tensors": len(e.cache.layout.tensors.name),
               "resident_bytes": e.cache.resident_bytes, "attached_clients": e.attached,
               "publisher_uid": e.publisher_uid}
              for e in server.catalog.entries()]
    store = server.catalog.store
    return {"device": cache.device, "socket": str(path),
            "fingerprint": "" if store else fp.digest(cache.fingerprint),
            "fingerprint_fields": {} if store else fp.fields(cache.fingerprint),
            "resident_bytes": sum(c["resident_bytes"] for c in caches), "tensors": sum(c["tensors"] for c in caches),
            "attached_clients": server.attached_clients,
            # 0 when the slabs were taken over from a predecessor: no cold load
            "load_s": round(cache.load_s, 3),
            "budget_bytes": server.catalog.budget_bytes, "evictions": server.catalog.evictions, "caches": caches}


class StateCollector:
    """Prometheus metrics computed from the state at scrape time."""

    def __init__(self, state: DaemonState):
        self.state = state

    def collect(self):
        doc = self.state.snapshot()
        labels = ["cache", "device"]
        ready = GaugeMetricFamily("weightcache_ready", "1 once every device's socket is published", labels=["cache"])
        ready.add_metric([doc["cache"]], 1.0 if doc["state"] == READY else 0.0)
        failed = GaugeMetricFamily("weightcache_failed", "1 if loading failed (see /status for the reason)",
                                   labels=["cache", "reason"])
        failed.add_metric([doc["cache"], doc["reason"]], 1.0 if doc["state"] == FAILED else 0.0)
        loaded = GaugeMetricFamily("weightcache_load_bytes", "bytes read into slabs so far", labels=["cache"])
        loaded.add_metric([doc["cache"]], doc["progress"]["loaded_bytes"])
        total = GaugeMetricFamily("weightcache_load_total_bytes", "bytes the load will read", labels=["cache"])
        total.add_metric([doc["cache"]], doc["progress"]["total_bytes"])
        resident = GaugeMetricFamily("weightcache_resident_bytes", "bytes held in slabs", labels=labels)
        clients = GaugeMetricFamily("weightcache_attached_clients", "engines attached now", labels=labels)
        load_s = GaugeMetricFamily("weightcache_load_seconds", "seconds the slabs took to load from disk; 0 when "
                                   "taken over from a predecessor daemon", labels=labels)
        each = ["cache", "device", "fingerprint", "engine"]
        cache_bytes = GaugeMetricFamily("weightcache_cache_resident_bytes", "bytes held for one cache (fingerprint)",
                                        labels=each)
        cache_clients = GaugeMetricFamily("weightcache_cache_attached_clients", "engines attached to one cache",
                                          labels=each)
        caches = GaugeMetricFamily("weightcache_caches", "caches served (a store: those engines published)",
                                   labels=labels)
        evictions = GaugeMetricFamily("weightcache_evictions", "idle caches evicted to make room for publications",
                                      labels=labels)
        for d in doc["devices"]:
            resident.add_metric([doc["cache"], d["device"]], d["resident_bytes"])
            clients.add_metric([doc["cache"], d["device"]], d["attached_clients"])
            load_s.add_metric([doc["cache"], d["device"]], d["load_s"])
            caches.add_metric([doc["cache"], d["device"]], len(d["caches"]))
            evictions.add_metric([doc["cache"], d["device"]], d["evictions"])
            for c in d["caches"]:
                key = [doc["cache"], d["device"], c["fingerprint"][:12], c["engine"]]
                cache_bytes.add_metric(key, c["resident_bytes"])
                cache_clients.add_metric(key, c["attached_clients"])
        yield from (ready, failed, loaded, total, resident, clients, load_s, caches, evictions, cache_bytes,
                    cache_clients)


def serve_http(host: str, port: int, state: DaemonState) -> ThreadingHTTPServer:
    """Start the health/metrics/status server on a background thread."""
    registry = CollectorRegistry()
    registry.register(StateCollector(state))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._send(HTTPStatus.OK, b"ok\n", "text/plain")
            elif path == "/readyz":
                doc = state.snapshot()
                code = HTTPStatus.OK if doc["state"] == READY else HTTPStatus.SERVICE_UNAVAILABLE
                self._send(code, json.dumps(doc).encode(), "application/json")
            elif path == "/status":
                self._send(HTTPStatus.OK, json.dumps(state.snapshot()).encode(), "application/json")
            elif path == "/metrics":
                self._send(HTTPStatus.OK, generate_latest(registry), CONTENT_TYPE_LATEST)
            else:
                self._send(HTTPStatus.NOT_FOUND, b"not found: try /healthz, /readyz, /status, /metrics\n",
                           "text/plain")

        def _send(self, code, body: bytes, content_type: str):
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # probes arrive every few seconds: keep the log quiet
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    log.info("http", extra={"fields": {"bind": f"{host}:{server.server_address[1]}"}})
    return server
