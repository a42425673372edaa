"""Workloads through the real controllers and scheduler, run by the node simulator."""

from __future__ import annotations

import os
import time

from cluster import wait_for
from cluster.testkit import (SIMULATED_IMAGE, TEST_IMAGE, apply, container, daemonset, deployment, get,
                             is_ready, pod, pods, wait_pod)


def test_deployment_of_simulated_image_becomes_ready(cluster, namespace):
    apply(cluster, namespace, deployment("web", SIMULATED_IMAGE, replicas=2))
    cluster.kubectl("rollout", "status", "deployment/web", "-n", namespace, "--timeout=60s")
    ps = pods(cluster, namespace, "app=web")
    assert len(ps) == 2 and all(is_ready(p) for p in ps)
    assert all(p["spec"]["nodeName"] in cluster.nodes for p in ps)
    assert all(p["status"]["podIP"].startswith("127.") for p in ps)


def test_daemonset_lands_one_pod_per_gpu_node(cluster, namespace):
    apply(cluster, namespace, daemonset("agent", SIMULATED_IMAGE))
    cluster.kubectl("rollout", "status", "daemonset/agent", "-n", namespace, "--timeout=60s")
    ps = pods(cluster, namespace, "app=agent")
    assert sorted(p["spec"]["nodeName"] for p in ps) == sorted(cluster.nodes)
    assert all(is_ready(p) for p in ps)


def test_rolling_update_goes_through_the_controller_manager(cluster, namespace):
    apply(cluster, namespace, deployment("roll", SIMULATED_IMAGE, replicas=3))
    cluster.kubectl("rollout", "status", "deployment/roll", "-n", namespace, "--timeout=60s")
    old = {p["metadata"]["name"] for p in pods(cluster, namespace, "app=roll")}
    new_image = "registry.k8s.io/pause:3.9"
    cluster.kubectl("set", "image", "deployment/roll", f"main={new_image}", "-n", namespace)
    cluster.kubectl("rollout", "status", "deployment/roll", "-n", namespace, "--timeout=90s")
    wait_for(lambda: len(pods(cluster, namespace, "app=roll")) == 3, 30, "old pods to terminate")
    now = pods(cluster, namespace, "app=roll")
    assert not old & {p["metadata"]["name"] for p in now}
    assert all(p["spec"]["containers"][0]["image"] == new_image and is_ready(p) for p in now)
    rs = cluster.kubectl_json("get", "replicasets", "-n", namespace, "-l", "app=roll")["items"]
    assert sorted(r["status"].get("replicas", 0) for r in rs) == [0, 3]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is not alive: it is only waiting for the simulator to reap it.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_deleting_a_pod_ends_its_process(cluster, namespace):
    program = ("import os, sys, time; d = sys.argv[1]; os.makedirs(d, exist_ok=True); "
               "open(os.path.join(d, 'pid'), 'w').write(str(os.getpid())); time.sleep(3600)")
    p = pod("sleeper", [container("main", TEST_IMAGE, ["python", "-c", program, "/data/out"],
                                  volumeMounts=[{"name": "data", "mountPath": "/data"}])],
            volumes=[{"name": "data", "hostPath": {"path": "/var/lib/sleeper", "type": "DirectoryOrCreate"}}])
    apply(cluster, namespace, p)
    running = wait_pod(cluster, namespace, "sleeper", is_ready, "ready")
    pid_file = cluster.node_root(running["spec"]["nodeName"]) / "var/lib/sleeper/out/pid"
    pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30, "pid file"))
    assert _alive(pid)
    cluster.kubectl("delete", "pod", "sleeper", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(lambda: not _alive(pid), 10, f"process {pid} to end")
    assert get(cluster, namespace, "pod", "sleeper") is None


def test_hostpath_is_shared_per_node_only(cluster, namespace):
    # Writers on every node put their node's name into the same hostPath folder.
    program = "import os, sys; open(sys.argv[1] + '/' + os.environ['NODE'], 'w').write('x')"
    for node in cluster.nodes:
        c = container("main", TEST_IMAGE, ["python", "-c", program, "/shared"],
                      env=[{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                      volumeMounts=[{"name": "s", "mountPath": "/shared"}])
        apply(cluster, namespace, pod(f"w-{node}", [c], nodeName=node, restartPolicy="Never",
                                      volumes=[{"name": "s", "hostPath": {"path": "/run/shared"}}]))
    for node in cluster.nodes:
        wait_pod(cluster, namespace, f"w-{node}", lambda p: p["status"].get("phase") == "Succeeded", "succeeded")
        assert sorted(os.listdir(cluster.node_root(node) / "run/shared")) == [node]


def test_failing_container_reports_exit_code_and_restarts(cluster, namespace):
    c = container("main", TEST_IMAGE, ["python", "-c", "import sys; sys.exit(3)"])
    apply(cluster, namespace, pod("crash", [c], restartPolicy="OnFailure"))
    p = wait_pod(cluster, namespace, "crash",
                 lambda p: (p["status"].get("containerStatuses") or [{}])[0].get("restartCount", 0) >= 1,
                 "restarted")
    last = p["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] == 3 and last["reason"] == "Error"
    apply(cluster, namespace, pod("once", [c], restartPolicy="Never"))
    p = wait_pod(cluster, namespace, "once", lambda p: p["status"].get("phase") == "Failed", "failed")
    assert p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3
    assert p["status"]["containerStatuses"][0]["restartCount"] == 0


def test_deletion_grace_period_then_sigkill(cluster, namespace):
    # The process ignores SIGTERM: it must live through the grace period, then be killed.
    program = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               "open(sys.argv[1] + '/pid', 'w').write(str(os.getpid())); time.sleep(3600)")
    p = pod("stubborn", [container("main", TEST_IMAGE, ["python", "-c", program, "/data"],
                                   volumeMounts=[{"name": "data", "mountPath": "/data"}])],
            volumes=[{"name": "data", "emptyDir": {}}], terminationGracePeriodSeconds=2)
    apply(cluster, namespace, p)
    running = wait_pod(cluster, namespace, "stubborn", is_ready, "ready")
    pid_file = cluster.pod_volume(running, "data") / "pid"
    pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30, "pid file"))
    t0 = time.monotonic()
    cluster.kubectl("delete", "pod", "stubborn", "-n", namespace, "--wait=false")
    wait_for(lambda: not _alive(pid), 15, f"process {pid} to be killed")
    took = time.monotonic() - t0
    assert 1.5 <= took < 10, f"killed after {took:.1f} s; grace was 2 s"
    wait_for(lambda: get(cluster, namespace, "pod", "stubborn") is None, 15, "pod object removed")


def test_gpu_pods_get_distinct_gpu_uuids_of_their_node(cluster, namespace):
    node = cluster.nodes[0]
    program = "import os; print('gpus=' + os.environ['NVIDIA_VISIBLE_DEVICES'], flush=True)"
    for i in range(2):
        c = container("main", TEST_IMAGE, ["python", "-c", program],
                      resources={"limits": {"nvidia.com/gpu": "1"}})
        apply(cluster, namespace, pod(f"gpu{i}", [c], nodeSelector={"kubernetes.io/hostname": node},
                                      restartPolicy="Never"))
    for i in range(2):
        wait_pod(cluster, namespace, f"gpu{i}", lambda p: p["status"].get("phase") == "Succeeded", "succeeded")
    # The log's first line is the simulator's own "exec [...]" record; the output follows.
    seen = [cluster.pod_log(namespace, f"gpu{i}", "main").read_text().splitlines()[-1].removeprefix("gpus=")
            for i in range(2)]
    node_uuids = cluster.kubectl_json("get", "node", node)["metadata"]["annotations"]["nvidia.com/gpu.uuids"]
    assert len(set(seen)) == 2 and set(seen) <= set(node_uuids.split(",")), (seen, node_uuids)
