"""Container probes as the kubelet runs them: exec, httpGet, tcpSocket and grpc.

Each check returns (ok, message); ProbeState applies periods and thresholds."""

from __future__ import annotations

import http.client
import socket
import subprocess
import time
from dataclasses import dataclass, field


def _port(port, container: dict) -> int:
    """A probe's port: a number or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"no container port named {port!r}")


def exec_check(cmd: list[str], env: dict[str, str], cwd: str | None, timeout: float) -> tuple[bool, str]:
    try:
        r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"exec timed out after {timeout}s"
    except OSError as e:
        return False, f"exec failed: {e}"
    return r.returncode == 0, f"exit {r.returncode}: {r.stdout[-200:]!r}{r.stderr[-200:]!r}"


def http_check(host: str, port: int, path: str, scheme: str, headers: list[dict],
               timeout: float) -> tuple[bool, str]:
    cls = http.client.HTTPSConnection if scheme.upper() == "HTTPS" else http.client.HTTPConnection
    kw = {}
    if cls is http.client.HTTPSConnection:
        import ssl
        kw["context"] = ssl._create_unverified_context()  # the kubelet does not verify either
    try:
        conn = cls(host, port, timeout=timeout, **kw)
        conn.request("GET", path or "/", headers={h["name"]: h["value"] for h in headers})
        status = conn.getresponse().status
        conn.close()
    except (OSError, http.client.HTTPException) as e:
        return False, f"GET {path}: {e}"
    return 200 <= status < 400, f"GET {path}: HTTP {status}"


def tcp_check(host: str, port: int, timeout: float) -> tuple[bool, str]:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return False, f"tcp {host}:{port}: {e}"
    return True, "tcp ok"


def grpc_check(host: str, port: int, service: str, timeout: float) -> tuple[bool, str]:
    """grpc.health.v1.Health/Check with hand-encoded protobuf, needing only grpcio."""
    try:
        import grpc
    except ImportError:
        return False, "grpc probe needs the grpcio package"
    svc = service.encode()
    request = (b"\x0a" + bytes([len(svc)]) + svc) if svc else b""
    try:
        with grpc.insecure_channel(f"{host}:{port}") as ch:
            check = ch.unary_unary("/grpc.health.v1.Health/Check")
            reply = check(request, timeout=timeout)
    except grpc.RpcError as e:
        return False, f"grpc health: {e.code()}"
    return reply == b"\x08\x01", f"grpc health reply {reply!r}"  # status=SERVING(1)


def run_check(probe: dict, container: dict, host: str, env: dict[str, str], cwd: str | None) -> tuple[bool, str]:
    timeout = float(probe.get("timeoutSeconds") or 1)
    try:
        if "exec" in probe:
            return exec_check(probe["exec"]["command"], env, cwd, timeout)
        if "httpGet" in probe:
            h = probe["httpGet"]
            return http_check(h.get("host") or host, _port(h["port"], container), h.get("path", "/"),
                              h.get("scheme", "HTTP"), h.get("httpHeaders") or [], timeout)
        if "tcpSocket" in probe:
            t = probe["tcpSocket"]
            return tcp_check(t.get("host") or host, _port(t["port"], container), timeout)
        if "grpc" in probe:
            g = probe["grpc"]
            return grpc_check(host, int(g["port"]), g.get("service") or "", timeout)
    except ValueError as e:
        return False, str(e)
    return False, "probe has no handler"


@dataclass
class ProbeState:
    """Thresholds and timing of one probe on one container run."""
    probe: dict
    started: float = field(default_factory=time.monotonic)
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0
    ok: bool = False
    message: str = ""

    def __post_init__(self) -> None:
        self.next_at = self.started + float(self.probe.get("initialDelaySeconds") or 0)

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, message: str, now: float) -> None:
        self.next_at = now + float(self.probe.get("periodSeconds") or 10)
        self.message = message
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.probe.get("successThreshold") or 1):
                self.ok = True
        else:
            self.successes, self.failures = 0, self.failures + 1
            if self.failures >= int(self.probe.get("failureThreshold") or 3):
                self.ok = False

    @property
    def failed(self) -> bool:
        """The failure threshold is reached (liveness/startup: kill the container)."""
        return self.failures >= int(self.probe.get("failureThreshold") or 3)
