"""A userspace kube-proxy for ClusterIP Services.

Why: simulated pods have loopback pod IPs, and the API rejects loopback addresses in
Endpoints and EndpointSlices, so `--enable-aggregator-routing` cannot route a webhook
Service to its pods. ClusterIPs come from a loopback range instead (controlplane.
Network.service_cidr), and this proxy listens on each Service's clusterIP:port and forwards
TCP to a Ready pod matching the selector. The apiserver's webhook calls, and tests,
reach Services exactly as in a cluster."""

from __future__ import annotations

import ipaddress
import itertools
import logging
import socket
import threading

from .kube import Rest

log = logging.getLogger("cluster.svcproxy")
POLL_SECONDS = 0.5


def _ready(pod: dict) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds) and pod["status"].get("podIP")


def _matches(selector: dict, pod: dict) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def target_port(svc_port: dict, pod: dict) -> int | None:
    """A Service port's targetPort on POD: a number, or a named container port."""
    target = svc_port.get("targetPort", svc_port["port"])
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for c in pod["spec"].get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == target:
                return int(p["containerPort"])
    return None


def backends(svc: dict, svc_port: dict, pods: list[dict]) -> list[tuple[str, int]]:
    ns, sel = svc["metadata"]["namespace"], svc["spec"].get("selector") or {}
    out = []
    for pod in pods:
        if pod["metadata"]["namespace"] == ns and _matches(sel, pod) and _ready(pod):
            port = target_port(svc_port, pod)
            if port:
                out.append((pod["status"]["podIP"], port))
    return sorted(out)


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Listener:
    def __init__(self, ip: str, port: int) -> None:
        self.sock = socket.create_server((ip, port), reuse_port=False)
        self.backends: list[tuple[str, int]] = []
        self._rr = itertools.count()
        self.closed = False
        threading.Thread(target=self._accept, name=f"svc-{ip}:{port}", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        targets = list(self.backends)
        if not targets:
            client.close()  # like a Service without endpoints: connection refused/reset
            return
        target = targets[next(self._rr) % len(targets)]
        try:
            upstream = socket.create_connection(target, timeout=5)
            upstream.settimeout(None)
        except OSError:
            client.close()
            return
        threading.Thread(target=_pipe, args=(client, upstream), daemon=True).start()
        _pipe(upstream, client)

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class ServiceProxy:
    def __init__(self, rest: Rest, apiserver: tuple[str, int], service_cidr: str) -> None:
        self.rest = rest
        self.apiserver = apiserver
        self.net = ipaddress.ip_network(service_cidr)
        self.listeners: dict[tuple[str, int], _Listener] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="svcproxy", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _sync(self) -> None:
        services = self.rest.get("/api/v1/services")["items"]
        pods = self.rest.get("/api/v1/pods")["items"]
        wanted: dict[tuple[str, int], list[tuple[str, int]]] = {}
        for svc in services:
            ip = svc["spec"].get("clusterIP")
            if not ip or ip == "None" or ipaddress.ip_address(ip) not in self.net:
                continue
            for sp in svc["spec"].get("ports") or []:
                if sp.get("protocol", "TCP") != "TCP":
                    continue
                if (svc["metadata"]["namespace"], svc["metadata"]["name"]) == ("default", "kubernetes"):
                    wanted[(ip, sp["port"])] = [self.apiserver]
                else:
                    wanted[(ip, sp["port"])] = backends(svc, sp, pods)
        for key in set(self.listeners) - set(wanted):
            self.listeners.pop(key).close()
        for key, targets in wanted.items():
            if key not in self.listeners:
                try:
                    self.listeners[key] = _Listener(*key)
                except OSError as e:
                    log.warning("cannot listen on %s:%s: %s", *key, e)
                    continue
            self.listeners[key].backends = targets

    def _run(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                self._sync()
            except Exception as e:  # the next round retries
                log.info("service sync failed: %s", e)

    def stop(self) -> None:
        self._stop.set()
        for lst in self.listeners.values():
            lst.close()
