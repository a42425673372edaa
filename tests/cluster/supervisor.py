"""The cluster's supervisor process: starts the control plane, the fake GPU nodes and
the node simulator, announces readiness with a file, and tears everything down on
SIGTERM/SIGINT. Run as `python -m cluster run` (the fixture and `make cluster-up` do)."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from .controlplane import start_control_plane
from .kube import Rest
from .network import claim_network
from .nodes import NodeKeeper, node_names
from .nodesim import NodeSimConfig, NodeSimulator
from .procs import ProcessSet
from .svcproxy import ServiceProxy

log = logging.getLogger("cluster.supervisor")
READY_FILE = "ready.json"  # written (atomically) once the cluster is usable
FAILED_FILE = "failed.txt"  # written when start-up failed, with the reason


def _wait(what: str, check, deadline: float) -> None:
    while True:
        try:
            if check():
                return
        except Exception as e:  # not there yet (404, connection refused): keep polling
            last = e
        else:
            last = None
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what} ({last})")
        time.sleep(0.1)


def _nodes_schedulable(rest: Rest, names: list[str]) -> bool:
    """Ready and without the not-ready taint that the node lifecycle controller lifts."""
    for name in names:
        node = rest.get(f"/api/v1/nodes/{name}")
        if any(t["key"].startswith("node.kubernetes.io/") for t in node["spec"].get("taints") or []):
            return False
    return True


def run(state: Path, bin_dir: Path, n_nodes: int, gpus: int, timeout: float, pod_security: str) -> None:
    state.mkdir(parents=True, exist_ok=True)
    (state / "logs").mkdir(exist_ok=True)
    logging.basicConfig(filename=state / "logs" / "supervisor.log", level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s %(threadName)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    t0 = time.monotonic()
    deadline = t0 + timeout
    procs = ProcessSet()
    keeper = sim = proxy = None
    try:
        net, _slot_lock = claim_network()  # the lock is held until this process ends
        log.info("network slot %d: services %s", net.slot, net.service_cidr)
        cp = start_control_plane(bin_dir, state, procs, net, timeout=timeout, pod_security_default=pod_security)
        log.info("control plane healthy after %.1f s", time.monotonic() - t0)
        p = cp.pki.path
        rest = Rest.from_server(cp.server, str(cp.pki.ca_crt), str(p("admin.crt")), str(p("admin.key")))
        names = node_names(n_nodes)
        keeper = NodeKeeper(rest, names, gpus, net)
        keeper.register()
        sim = NodeSimulator(rest, NodeSimConfig(state, tuple(names), cp.server, str(cp.pki.ca_crt), net, gpus))
        sim.start()
        proxy = ServiceProxy(rest, ("127.0.0.1", cp.ports.apiserver), net.service_cidr)
        proxy.start()
        _wait("nodes to become schedulable", lambda: _nodes_schedulable(rest, names), deadline)
        _wait("the default service account",
              lambda: rest.get("/api/v1/namespaces/default/serviceaccounts/default"), deadline)
        info = {"kubeconfig": str(cp.kubeconfig), "server": cp.server, "bin_dir": str(bin_dir),
                "nodes": names, "gpus_per_node": gpus, "state": str(state), "log_dir": str(state / "logs"),
                "pid": os.getpid(), "start_seconds": round(time.monotonic() - t0, 2)}
        tmp = state / (READY_FILE + ".tmp")
        tmp.write_text(json.dumps(info, indent=1))
        tmp.rename(state / READY_FILE)
        log.info("cluster ready after %.1f s", info["start_seconds"])
        while not stop.wait(0.5):
            dead = procs.dead()
            if dead:
                log.error("%s exited with status %s; stopping the cluster", *dead[0])
                break
    except BaseException as e:
        log.exception("cluster start-up failed")
        (state / FAILED_FILE).write_text(f"{type(e).__name__}: {e}\n")
        raise
    finally:
        log.info("stopping")
        for part in (proxy, sim, keeper):
            if part is not None:
                part.stop()
        procs.stop_all()
        (state / READY_FILE).unlink(missing_ok=True)
        log.info("stopped")
