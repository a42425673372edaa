"""What the end-to-end scenarios need from a cluster, and nothing else: kubectl and helm
against $KUBECONFIG, and a way to reach a pod's HTTP port.

Settings (environment variables):
  KUBECONFIG                        the cluster (required)
  WEIGHTCACHE_E2E_KUBECTL / _HELM   the binaries (default: `kubectl` / `helm` from PATH)
  WEIGHTCACHE_E2E_HELM_ARGS         extra `helm install` arguments, e.g. "--set image.tag=dev"
  WEIGHTCACHE_E2E_ENGINE_IMAGE      the image of the helper pods (model seeding, verifying
                                    attaches); default: the one examples/engine-deployment.yaml runs
  WEIGHTCACHE_E2E_NEXT_DAEMON_IMAGE the daemon image the upgrade scenario rolls to
                                    (default: the running one's tag + "-next")
  WEIGHTCACHE_E2E_POD_HTTP          `exec` (default: requests made by a helper pod, through
                                    `kubectl exec`; kind and real clusters) or `direct` (pod
                                    IPs routable from here: the test control plane)
  WEIGHTCACHE_E2E_TIMEOUT           seconds for the first image pulls and loads (default 600)
"""

from __future__ import annotations

import os
import shlex
import shutil
import uuid
from pathlib import Path

import pytest
import yaml

from kit import CACHE_YAML, CHART, ENGINE_YAML, TIMEOUT, Kube, PodHTTP, wait_for


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def kube() -> Kube:
    kubeconfig = os.environ.get("KUBECONFIG")
    if not kubeconfig:
        pytest.exit("e2e: set KUBECONFIG to the cluster to test (`make e2e` and `make e2e-kind` do)", returncode=2)
    kubectl = os.environ.get("WEIGHTCACHE_E2E_KUBECTL", "kubectl")
    helm = os.environ.get("WEIGHTCACHE_E2E_HELM", "helm")
    for tool in (kubectl, helm):
        if shutil.which(tool) is None:
            pytest.exit(f"e2e: {tool!r} not found (PATH, or WEIGHTCACHE_E2E_KUBECTL / WEIGHTCACHE_E2E_HELM)",
                        returncode=2)
    k = Kube(kubeconfig, kubectl, helm)
    if k.kubectl("get", "nodes", check=False).returncode != 0:
        pytest.exit(f"e2e: the cluster of KUBECONFIG={kubeconfig} does not answer `kubectl get nodes`", returncode=2)
    return k


@pytest.fixture(scope="session")
def pod_http(kube, app, engine_image):
    return PodHTTP(kube, os.environ.get("WEIGHTCACHE_E2E_POD_HTTP", "exec"), app, engine_image)


@pytest.fixture(scope="session")
def engine_image() -> str:
    default = yaml.safe_load(ENGINE_YAML.read_text())["spec"]["template"]["spec"]["containers"][0]["image"]
    return os.environ.get("WEIGHTCACHE_E2E_ENGINE_IMAGE", default)


class Release:
    def __init__(self, name: str, namespace: str) -> None:
        self.name, self.namespace = name, namespace


@pytest.fixture(scope="session")
def release(kube):
    """The chart, installed as its README says, with WEIGHTCACHE_E2E_HELM_ARGS; uninstalled
    at the end (its webhook must not outlive the run)."""
    tag = uuid.uuid4().hex[:4]
    rel = Release(f"wce2e{tag}", f"weightcache-e2e-{tag}")
    extra = shlex.split(os.environ.get("WEIGHTCACHE_E2E_HELM_ARGS", ""))
    try:
        kube.helm("install", rel.name, CHART, "--namespace", rel.namespace, "--create-namespace", *extra)
        yield rel
    finally:
        kube.helm("uninstall", rel.name, "--namespace", rel.namespace, "--wait", "--timeout", "180s", check=False)
        for ns in (rel.namespace, f"{rel.name}-daemons"):  # helm keeps the daemons' namespace
            kube.kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture(scope="session")
def app(kube, release, engine_image):
    """The user's namespace (Pod Security privileged, as the examples say), with the
    example's model put on every node by a short-lived DaemonSet; at the end the caches
    there are force-deleted and the namespace removed."""
    ns = f"llm-e2e-{uuid.uuid4().hex[:4]}"
    kube.kubectl("create", "namespace", ns)
    kube.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=privileged")
    try:
        seed_model(kube, ns, engine_image)
        yield ns
    finally:
        kube.kubectl("delete", "deployment", "--all", "-n", ns, "--wait=false", check=False)
        for item in (kube.get("wc", "-n", ns) or {}).get("items", []):
            name = item["metadata"]["name"]
            kube.kubectl("annotate", "wc", name, "-n", ns, "weightcache.io/force-delete=true", "--overwrite",
                         check=False)
            kube.kubectl("delete", "wc", name, "-n", ns, "--timeout=180s", check=False, timeout=200)
        kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def seed_model(kube: Kube, ns: str, image: str) -> None:
    """Step 2 of examples/weightcache.yaml on every schedulable node: copy the model the
    engine image ships to spec.model.path, by a DaemonSet whose init container copies;
    its pods are Ready once that is done."""
    path = Path(yaml.safe_load(CACHE_YAML.read_text())["spec"]["model"]["path"])
    script = ("import shutil, sys; from weightcache.demo import packaged_model_dir; "
              "shutil.copytree(packaged_model_dir(), sys.argv[1], dirs_exist_ok=True)")
    labels = {"app": "weightcache-e2e-seed"}
    ds = {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "model-seed", "labels": labels},
          "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": {
              "terminationGracePeriodSeconds": 1,
              "initContainers": [{"name": "copy", "image": image, "command": ["python", "-c", script],
                                  "args": [f"/models/{path.name}"], "securityContext": {"runAsUser": 0},
                                  "volumeMounts": [{"name": "models", "mountPath": "/models"}]}],
              "containers": [{"name": "done", "image": image, "command": ["sleep", "infinity"]}],
              "volumes": [{"name": "models", "hostPath": {"path": str(path.parent), "type": "DirectoryOrCreate"}}]}}}}
    kube.apply(ds, ns)

    def seeded():
        d = kube.json("get", "ds", "model-seed", "-n", ns)
        st = d.get("status") or {}
        return st.get("desiredNumberScheduled", 0) > 0 and st.get("numberReady") == st["desiredNumberScheduled"]
    wait_for(seeded, TIMEOUT, "the model copied to every node")
    kube.kubectl("delete", "ds", "model-seed", "-n", ns, "--wait=false")
