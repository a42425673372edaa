"""The WeightCache CRD against a real kube-apiserver: defaults, explain, printer
columns, and invalid resources refused with messages that name the field."""

from __future__ import annotations

import json
import pathlib

import pytest

from cluster.handle import wait_for

CRDS = pathlib.Path(__file__).resolve().parents[2] / "crds"


@pytest.fixture(scope="module")
def crd(cluster):
    cluster.kubectl("apply", "-f", str(CRDS / "weightcache.io_weightcaches.yaml"),
                    "-f", str(CRDS / "weightcache.io_weightcacheclasses.yaml"))
    for name in ("weightcaches.weightcache.io", "weightcacheclasses.weightcache.io"):
        wait_for(lambda: cluster.kubectl("get", "crd", name, "-o",
                                         "jsonpath={.status.conditions[?(@.type=='Established')].status}"
                                         ).stdout == "True", timeout=30, what=f"CRD {name} to be established")
    return cluster


def cache(name: str, **spec) -> dict:
    return {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache", "metadata": {"name": name},
            "spec": {"model": {"path": "/models/llama"}, **spec}}


def create(cluster, namespace, manifest, check=True):
    return cluster.kubectl("create", "--validate=strict", "-n", namespace, "-f", "-", input=json.dumps(manifest),
                           check=check)


def test_a_minimal_cache_gets_its_defaults(crd, namespace):
    create(crd, namespace, cache("llama"))
    got = crd.kubectl_json("get", "wc", "llama", "-n", namespace)["spec"]
    assert got["backend"] == "cuda-vmm" and got["dtype"] == "auto" and got["quantization"] == "none"
    assert got["parallelism"] == {"tensor": 1, "pipeline": 1, "data": 1}
    assert got["clientPolicy"] == {"fallback": "disk"}
    assert got["source"] == "Checkpoint"


def test_get_shows_the_printer_columns(crd, namespace):
    create(crd, namespace, cache("shown"))
    header = crd.kubectl("get", "wc", "-n", namespace).stdout.splitlines()[0].split()
    assert header == ["NAME", "READY", "NODES", "BACKEND", "SIZE", "CLIENTS", "ROLLOUT", "AGE"]
    wide = crd.kubectl("get", "wc", "-n", namespace, "-o", "wide").stdout.splitlines()[0].split()
    assert wide == ["NAME", "READY", "NODES", "BACKEND", "SOURCE", "SIZE", "CLIENTS", "ROLLOUT", "FINGERPRINT", "AGE"]


def test_explain_documents_the_fields(crd):
    out = crd.kubectl("explain", "wc.spec.placement").stdout
    assert "gpuUUIDs" in out and "by UUID" in out and "gpusPerNode" in out
    assert "fp8-block" in crd.kubectl("explain", "wc.spec.quantization").stdout


@pytest.mark.parametrize("spec, needle", [
    ({"parallelism": {"tensor": 8, "pipeline": 2}, "placement": {"gpusPerNode": 8}},
     "tensor * pipeline must fit the GPUs of one node"),
    ({"parallelism": {"tensor": 4}, "placement": {"gpuUUIDs": ["GPU-00000000-0000-0000-0000-000000000001"]}},
     "tensor * pipeline must fit"),
    ({"placement": {"gpusPerNode": 2, "gpuUUIDs": ["GPU-00000000-0000-0000-0000-000000000001"]}},
     "set gpusPerNode or gpuUUIDs, not both"),
    ({"backend": "cuda-ipc"}, "allowHostIPC: true"),
    ({"quantization": "awq"}, 'spec.quantization: Unsupported value: "awq"'),
    ({"backend": "rdma"}, 'spec.backend: Unsupported value: "rdma"'),
    ({"parallelism": {"tensor": 0}}, "spec.parallelism.tensor"),
    ({"placement": {"gpuUUIDs": ["0"]}}, "spec.placement.gpuUUIDs[0]"),
    ({"model": {"path": "models/llama"}}, "model.path must be an absolute path"),
    ({"model": {"path": "/models/../etc"}}, "model.path must not contain '..'"),
    ({"model": {"path": "/m", "volume": {"hostPath": {"path": "/a"}, "persistentVolumeClaim": {"claimName": "c"}}}},
     "spec.model.volume"),
    ({"replicas": 3}, 'unknown field "spec.replicas"'),
    ({"source": "Engine"}, 'spec.source: Unsupported value: "Engine"'),
    ({"source": "Published", "backend": "cuda-ipc", "allowHostIPC": True}, "source Published needs handles"),
    # What the admin decides is refused by name, not silently dropped.
    ({"daemon": {"image": "attacker/evil:1"}}, "spec.daemon: the daemons' image, env, resources and priority are "
                                               "the cluster admin's"),
    ({"daemon": {"env": [{"name": "LD_PRELOAD", "value": "/x.so"}]}}, "spec.daemon: "),
    ({"daemon": {"priorityClassName": "system-node-critical"}}, "spec.daemon: "),
    ({"placement": {"tolerations": [{"operator": "Exists"}]}}, "spec.placement.tolerations: which taints the "
                                                               "daemons tolerate is the cluster admin's"),
])
def test_invalid_caches_are_refused_naming_the_field(crd, namespace, spec, needle):
    manifest = cache("bad")
    manifest["spec"].update(spec)
    result = create(crd, namespace, manifest, check=False)
    assert result.returncode != 0
    assert needle in result.stderr, result.stderr


def test_cuda_ipc_is_accepted_when_host_ipc_is_allowed(crd, namespace):
    create(crd, namespace, cache("ipc", backend="cuda-ipc", allowHostIPC=True))
    assert crd.kubectl_json("get", "wc", "ipc", "-n", namespace)["spec"]["backend"] == "cuda-ipc"


def test_status_is_a_subresource_with_a_strict_schema(crd, namespace):
    create(crd, namespace, cache("st"))
    patch = {"status": {"readyNodes": "1/2", "attachedClients": 3, "size": "16 GiB", "bogus": 1}}
    crd.kubectl("patch", "wc", "st", "-n", namespace, "--subresource=status", "--type=merge", "-p", json.dumps(patch))
    got = crd.kubectl_json("get", "wc", "st", "-n", namespace)
    assert got["status"] == {"readyNodes": "1/2", "attachedClients": 3, "size": "16 GiB"}  # unknown field pruned
    row = crd.kubectl("get", "wc", "st", "-n", namespace, "--no-headers").stdout.split()
    assert row[1:5] == ["1/2", "cuda-vmm", "16", "GiB"] and row[5] == "3"


def test_a_published_cache_is_accepted_and_its_caches_kept_in_status(crd, namespace):
    create(crd, namespace, cache("pub", source="Published", backend="cpu"))
    entry = {"engine": "vllm", "engineVersion": "0.32.0", "dtype": "float32", "fingerprint": "f" * 64, "nodes": 1,
             "attachedClients": 2, "bytesPerGPU": 12345, "size": "12.1 KiB"}
    crd.kubectl("patch", "wc", "pub", "-n", namespace, "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": {"caches": [entry]}}))
    assert crd.kubectl_json("get", "wc", "pub", "-n", namespace)["status"]["caches"] == [entry]
    assert "first engine on the node" in crd.kubectl("explain", "wc.spec.source").stdout


def test_a_gpu_cache_name_must_fit_the_daemons_socket_name(crd, namespace):
    long_name = "a" * 29
    result = create(crd, namespace, cache(long_name), check=False)
    assert result.returncode != 0 and "a GPU cache's name is at most 28 characters" in result.stderr, result.stderr
    create(crd, namespace, cache("a" * 28))
    create(crd, namespace, cache(long_name, backend="cpu"))


def klass(name: str, **spec) -> dict:
    return {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCacheClass", "metadata": {"name": name},
            "spec": {"modelRoots": ["/models"], **spec}}


def test_a_class_gets_its_defaults_and_columns(crd):
    crd.kubectl("create", "--validate=strict", "-f", "-", input=json.dumps(klass("crd-pool")))
    try:
        got = crd.kubectl_json("get", "wcc", "crd-pool")["spec"]
        assert got["backends"] == ["cuda-vmm", "cpu"] and got["allowHostIPC"] is False
        header = crd.kubectl("get", "wcc", "crd-pool").stdout.splitlines()[0].split()
        assert header == ["NAME", "DEFAULT", "MODEL", "ROOTS", "BACKENDS", "AGE"]
    finally:
        crd.kubectl("delete", "wcc", "crd-pool")


@pytest.mark.parametrize("spec, needle", [
    ({"modelRoots": ["/"]}, "modelRoots: each must be an absolute directory other than /"),
    ({"modelRoots": ["models"]}, "modelRoots: each must be an absolute directory"),
    ({"modelRoots": ["/models/../etc"]}, "modelRoots: each must be a plain absolute path"),
    ({"modelRoots": []}, "spec.modelRoots"),
    ({"backends": ["rdma"]}, 'Unsupported value: "rdma"'),
])
def test_invalid_classes_are_refused_naming_the_field(crd, spec, needle):
    r = crd.kubectl("create", "--validate=strict", "-f", "-", input=json.dumps(klass("crd-bad", **spec)), check=False)
    assert r.returncode != 0 and needle in r.stderr, r.stderr
