"""Helpers of the end-to-end scenarios: kubectl and helm against one kubeconfig, a way
to reach a pod's HTTP port from where the tests run, and waits. Nothing here knows
which cluster it talks to."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "weightcache"
CACHE_YAML = ROOT / "examples" / "weightcache.yaml"
ENGINE_YAML = ROOT / "examples" / "engine-deployment.yaml"
TIMEOUT = float(os.environ.get("WEIGHTCACHE_E2E_TIMEOUT", "600"))


def wait_for(check, timeout: float, what: str, interval: float = 1.0):
    """Poll CHECK until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def condition(obj: dict | None, kind: str) -> dict:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return c
    return {}


def ready_now(obj: dict | None) -> bool:
    """Ready=True for the object's current generation."""
    c = condition(obj, "Ready")
    return c.get("status") == "True" and c.get("observedGeneration") == (obj or {})["metadata"]["generation"]


def pod_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


class Kube:
    """kubectl and helm as a user runs them, against one kubeconfig."""

    def __init__(self, kubeconfig: str, kubectl: str, helm: str) -> None:
        self.kubeconfig, self.kubectl_bin, self.helm_bin = kubeconfig, kubectl, helm

    def _run(self, argv: list[str], input: str | None, check: bool, timeout: float) -> subprocess.CompletedProcess:
        r = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "KUBECONFIG": self.kubeconfig})
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, argv))} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
        return r

    def kubectl(self, *args, input: str | None = None, check: bool = True, timeout: float = 120):
        return self._run([self.kubectl_bin, *map(str, args)], input, check, timeout)

    def helm(self, *args, check: bool = True, timeout: float = 300):
        return self._run([self.helm_bin, *map(str, args)], None, check, timeout)

    def json(self, *args) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def get(self, *args) -> dict | None:
        r = self.kubectl("get", *args, "-o", "json", check=False)
        if r.returncode == 0:
            return json.loads(r.stdout)
        assert "NotFound" in r.stderr, r.stderr
        return None

    def apply(self, manifest: dict, namespace: str):
        return self.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))

    def logs(self, namespace: str, pod: str, container: str) -> str | None:
        """The container's log, or None where the cluster serves none (the test control
        plane has no kubelet API)."""
        r = self.kubectl("logs", "-n", namespace, pod, "-c", container, check=False)
        return r.stdout if r.returncode == 0 else None


# Run inside the cluster by `exec` mode: one HTTP request, its status and JSON body printed.
_FETCH = """
import json, sys, urllib.error, urllib.request
url, body, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
req = urllib.request.Request(url, data=body.encode() if body else None)
try:
    with urllib.request.urlopen(req, timeout=timeout) as r:
        code, data = r.status, r.read()
except urllib.error.HTTPError as e:
    code, data = e.code, e.read()
print(json.dumps({"code": code, "body": json.loads(data or b"{}")}))
"""


class PodHTTP:
    """HTTP to a pod's port from where the tests run. `direct`: the pod IP is routable from
    here (the test control plane). `exec`: the request is made by a helper pod inside the
    cluster (`kubectl exec`), since the daemons and engines bind their pod IP only, which
    neither the host of a kind cluster nor `kubectl port-forward` (localhost) can reach."""

    HELPER = "weightcache-e2e-http"

    def __init__(self, kube: Kube, mode: str, namespace: str, image: str) -> None:
        if mode not in ("direct", "exec"):
            raise ValueError(f"WEIGHTCACHE_E2E_POD_HTTP={mode!r}: use `direct` or `exec`")
        self.kube, self.mode, self.namespace, self.image = kube, mode, namespace, image
        self.helper_ready = False

    def _helper(self) -> None:
        if self.helper_ready:
            return
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": self.HELPER},
               "spec": {"terminationGracePeriodSeconds": 1,
                        "containers": [{"name": "http", "image": self.image, "command": ["sleep", "infinity"]}]}}
        self.kube.apply(pod, self.namespace)
        self.kube.kubectl("wait", "-n", self.namespace, f"pod/{self.HELPER}", "--for=condition=Ready",
                          f"--timeout={TIMEOUT:.0f}s", timeout=TIMEOUT + 30)
        self.helper_ready = True

    def request(self, pod: dict, port: int, path: str, body: dict | None = None,
                timeout: float = 30) -> tuple[int, dict]:
        url = f"http://{pod['status']['podIP']}:{port}{path}"
        if self.mode == "direct":
            return _http(url, body, timeout)
        self._helper()
        r = self.kube.kubectl("exec", "-n", self.namespace, self.HELPER, "--", "python", "-c", _FETCH, url,
                              "" if body is None else json.dumps(body), timeout, check=False, timeout=timeout + 30)
        if r.returncode != 0:
            raise OSError(f"{url} from pod {self.HELPER}: {r.stderr.strip()[-500:]}")
        answer = json.loads(r.stdout)
        return answer["code"], answer["body"]

    def get(self, pod: dict, port: int, path: str, timeout: float = 30) -> tuple[int, dict]:
        return self.request(pod, port, path, None, timeout)

    def post(self, pod: dict, port: int, path: str, body: dict, timeout: float = 30) -> tuple[int, dict]:
        return self.request(pod, port, path, body, timeout)


def _http(url: str, body: dict | None, timeout: float) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


