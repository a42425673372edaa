"""Probes, sidecars and Services of locally run containers."""

from __future__ import annotations

import time
import urllib.request

from cluster import wait_for
from cluster.procs import free_port
from cluster.testkit import (TEST_IMAGE, apply, container, container_status, get, is_ready, pod, pod_ip_env,
                             wait_pod)

# Serves HTTP on $POD_IP:PORT, but only once the file GATE exists: readiness must follow.
GATED_SERVER = ("import os, sys, time, runpy; gate = sys.argv[1]\n"
                "while not os.path.exists(gate): time.sleep(0.05)\n"
                "sys.argv = ['http.server', sys.argv[2], '--bind', os.environ['POD_IP']]\n"
                "runpy.run_module('http.server', run_name='__main__')")


def _gated_pod(name: str, port: int) -> dict:
    c = container("web", TEST_IMAGE, ["python", "-c", GATED_SERVER, "/gate/open", str(port)],
                  env=pod_ip_env(), ports=[{"name": "http", "containerPort": port}],
                  volumeMounts=[{"name": "gate", "mountPath": "/gate"}],
                  readinessProbe={"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1})
    return pod(name, [c], volumes=[{"name": "gate", "hostPath": {"path": f"/var/gate-{name}"}}])


def test_pod_is_ready_only_when_its_readiness_probe_succeeds(cluster, namespace):
    port = free_port()
    apply(cluster, namespace, _gated_pod("gated", port))
    p = wait_pod(cluster, namespace, "gated", lambda p: container_status(p, "web").get("state", {}).get("running"),
                 "running")
    # Running, process up, but nothing listens yet: the probe fails, so not Ready.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert not is_ready(get(cluster, namespace, "pod", "gated"))
        time.sleep(0.3)
    gate = cluster.node_root(p["spec"]["nodeName"]) / "var/gate-gated/open"
    gate.touch()
    p = wait_pod(cluster, namespace, "gated", is_ready, "ready", timeout=30)
    with urllib.request.urlopen(f"http://{p['status']['podIP']}:{port}/", timeout=5) as r:
        assert r.status == 200


def test_service_clusterip_reaches_ready_pod(cluster, namespace):
    port = free_port()
    apply(cluster, namespace, _gated_pod("svc-backend", port))
    p = wait_pod(cluster, namespace, "svc-backend", lambda p: p["spec"].get("nodeName"), "scheduled")
    (cluster.node_root(p["spec"]["nodeName"]) / "var/gate-svc-backend").mkdir(parents=True, exist_ok=True)
    (cluster.node_root(p["spec"]["nodeName"]) / "var/gate-svc-backend/open").touch()
    apply(cluster, namespace, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "backend"},
                               "spec": {"selector": {"app": "svc-backend"},
                                        "ports": [{"port": 80, "targetPort": "http"}]}})
    wait_pod(cluster, namespace, "svc-backend", is_ready, "ready", timeout=30)
    ip = cluster.kubectl_json("get", "service", "backend", "-n", namespace)["spec"]["clusterIP"]

    def get_ok():
        try:
            with urllib.request.urlopen(f"http://{ip}:80/", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False
    wait_for(get_ok, 20, f"service backend at {ip}:80")


def test_liveness_failure_restarts_the_container(cluster, namespace):
    c = container("main", TEST_IMAGE, ["python", "-c", "import time; time.sleep(3600)"],
                  livenessProbe={"exec": {"command": ["false"]}, "periodSeconds": 1, "failureThreshold": 2})
    apply(cluster, namespace, pod("unlive", [c]))
    p = wait_pod(cluster, namespace, "unlive", lambda p: container_status(p, "main").get("restartCount", 0) >= 1,
                 "restarted by liveness", timeout=60)
    assert container_status(p, "main")["lastState"]["terminated"]["exitCode"] in (137, 143)


def test_native_sidecar_starts_first_and_gates_main(cluster, namespace):
    # The sidecar becomes "started" only when its startup probe sees its marker file;
    # main records whether the marker existed when main started.
    sidecar = container("side", TEST_IMAGE,
                        ["python", "-c", "import sys, time, pathlib; time.sleep(1); "
                         "pathlib.Path(sys.argv[1], 'side').write_text('up'); time.sleep(3600)", "/w"],
                        restartPolicy="Always", volumeMounts=[{"name": "w", "mountPath": "/w"}],
                        startupProbe={"exec": {"command": ["test", "-f", "/w/side"]}, "periodSeconds": 1,
                                      "failureThreshold": 30})
    main = container("main", TEST_IMAGE,
                     ["python", "-c", "import os, sys, time; d = sys.argv[1]; "
                      "open(d + '/main', 'w').write(str(os.path.exists(d + '/side'))); time.sleep(3600)", "/w"],
                     volumeMounts=[{"name": "w", "mountPath": "/w"}])
    apply(cluster, namespace, pod("sidecar", [main], initContainers=[sidecar],
                                  volumes=[{"name": "w", "hostPath": {"path": "/var/sidecar"}}]))
    p = wait_pod(cluster, namespace, "sidecar", is_ready, "ready", timeout=60)
    marker = cluster.node_root(p["spec"]["nodeName"]) / "var/sidecar/main"
    assert wait_for(lambda: marker.exists() and marker.read_text(), 10, "main's marker") == "True"
    side = p["status"]["initContainerStatuses"][0]
    assert side["started"] and side["state"].get("running")


GRPC_HEALTH_SERVER = ("import os, sys, grpc\n"
                      "from concurrent import futures\n"
                      "check = grpc.unary_unary_rpc_method_handler(lambda req, ctx: b'\\x08\\x01')\n"
                      "server = grpc.server(futures.ThreadPoolExecutor(2))\n"
                      "server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(\n"
                      "    'grpc.health.v1.Health', {'Check': check}),))\n"
                      "server.add_insecure_port(os.environ['POD_IP'] + ':' + sys.argv[1])\n"
                      "server.start(); server.wait_for_termination()")


def test_grpc_readiness_probe(cluster, namespace):
    port = free_port()
    c = container("grpc", TEST_IMAGE, ["python", "-c", GRPC_HEALTH_SERVER, str(port)], env=pod_ip_env(),
                  readinessProbe={"grpc": {"port": port}, "periodSeconds": 1, "timeoutSeconds": 2})
    apply(cluster, namespace, pod("grpc", [c]))
    p = wait_pod(cluster, namespace, "grpc", is_ready, "ready via grpc health", timeout=60)
    assert container_status(p, "grpc")["ready"]


def test_sidecar_stops_after_main_completes(cluster, namespace):
    sidecar = container("side", TEST_IMAGE, ["python", "-c", "import time; time.sleep(3600)"], restartPolicy="Always")
    main = container("main", TEST_IMAGE, ["python", "-c", "print('done')"])
    apply(cluster, namespace, pod("job", [main], initContainers=[sidecar], restartPolicy="Never"))

    def finished(p):
        side = (p["status"].get("initContainerStatuses") or [{}])[0]
        return p["status"].get("phase") == "Succeeded" and "terminated" in side.get("state", {})
    wait_pod(cluster, namespace, "job", finished, "succeeded with its sidecar stopped", timeout=60)
