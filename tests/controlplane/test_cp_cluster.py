"""The cluster itself: fast cold start, fake GPU nodes Ready, the built tools work."""

from __future__ import annotations

import json

from cluster.nodes import GPU_RESOURCE, GPU_UUIDS_ANNOTATION

COLD_START_LIMIT_S = 30


def test_cold_start_is_fast(cluster):
    # Measured by the supervisor from the first process start to nodes schedulable.
    # wall_start_seconds: as the fixture saw it, from spawning the supervisor.
    took = max(cluster.start_seconds, cluster.wall_start_seconds)
    assert took < COLD_START_LIMIT_S, f"cluster took {took:.1f} s to come up (logs: {cluster.log_dir})"


def test_fake_gpu_nodes_are_ready(cluster):
    out = cluster.kubectl("get", "nodes", "--no-headers").stdout
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()}
    assert rows == {n: "Ready" for n in cluster.nodes}, out
    nodes = cluster.kubectl_json("get", "nodes")["items"]
    for node in nodes:
        assert node["status"]["allocatable"][GPU_RESOURCE] == str(cluster.gpus_per_node)
        uuids = node["metadata"]["annotations"][GPU_UUIDS_ANNOTATION].split(",")
        assert len(uuids) == cluster.gpus_per_node and all(u.startswith("GPU-") for u in uuids)
        assert node["metadata"]["labels"]["kubernetes.io/hostname"] == node["metadata"]["name"]
    all_uuids = [u for n in nodes for u in n["metadata"]["annotations"][GPU_UUIDS_ANNOTATION].split(",")]
    assert len(set(all_uuids)) == len(all_uuids)


def test_nodes_hold_leases(cluster):
    leases = cluster.kubectl_json("get", "leases", "-n", "kube-node-lease")["items"]
    assert {lease["metadata"]["name"] for lease in leases} >= set(cluster.nodes)


def test_kubectl_and_helm_versions(cluster):
    v = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert v["clientVersion"]["gitVersion"] == "v1.37.2"
    assert v["serverVersion"]["gitVersion"] == "v1.37.2"
    helm = cluster.helm("version", "--short").stdout
    assert helm.startswith("v3.22.0"), helm


def test_helm_installs_a_chart(cluster, namespace, tmp_path):
    chart = tmp_path / "hello"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: hello\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hi\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n")
    cluster.helm("install", "rel", str(chart), "-n", namespace, "--set", "greeting=hello", "--wait")
    cm = cluster.kubectl_json("get", "configmap", "rel-cm", "-n", namespace)
    assert cm["data"]["greeting"] == "hello"
    assert "rel" in cluster.helm("list", "-n", namespace, "-q").stdout.split()
    cluster.helm("uninstall", "rel", "-n", namespace, "--wait")
    assert cluster.kubectl("get", "configmap", "rel-cm", "-n", namespace, check=False).returncode != 0


def test_pod_security_admission_is_on(cluster):
    # Namespaces without a label get the "baseline" level, which forbids hostPath.
    name = "psa-check"
    cluster.create_namespace(name, pod_security=None)
    try:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hp"},
               "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}],
                        "volumes": [{"name": "h", "hostPath": {"path": "/var/run/x"}}]}}
        r = cluster.kubectl("apply", "-n", name, "-f", "-", input=json.dumps(pod), check=False)
        assert r.returncode != 0 and "hostPath" in r.stderr, r.stderr
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_official_client_talks_to_the_cluster(cluster):
    from kubernetes import client
    nodes = client.CoreV1Api(cluster.api_client).list_node()
    assert sorted(n.metadata.name for n in nodes.items) == sorted(cluster.nodes)
