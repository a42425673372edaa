"""The operator's Kubernetes calls: plain JSON dicts over the official client's
connection and credentials (kubeconfig or in-cluster), so that what the pure builders
make is exactly what is sent, and what is read is the API's own JSON form."""

from __future__ import annotations

import json
import urllib.parse

from .classes import CLASS_PLURAL
from .manifests import GROUP, PLURAL, VERSION

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class ApiError(Exception):
    def __init__(self, status: int, body: str, what: str) -> None:
        try:
            message = json.loads(body).get("message") or body
        except (ValueError, AttributeError):
            message = body
        super().__init__(f"{what}: HTTP {status}: {str(message)[:500]}")
        self.status = status
        self.message = str(message)


def load_api_client(pool: int = 32):
    """An official-client ApiClient from $KUBECONFIG / ~/.kube/config, else in-cluster."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_kube_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_incluster_config(client_configuration=configuration)
    configuration.connection_pool_maxsize = pool
    return client.ApiClient(configuration)


class Kube:
    def __init__(self, api_client, timeout: float = 15.0) -> None:
        self.api = api_client
        self.timeout = timeout

    def request(self, method: str, path: str, body=None, query: dict | None = None,
                content_type: str = "application/json", missing_ok: bool = False):
        method, url, headers, data, _ = self.api.param_serialize(
            method=method, resource_path=path, query_params=list((query or {}).items()),
            header_params={"Content-Type": content_type, "Accept": "application/json"}, body=body,
            auth_settings=["BearerToken"])
        resp = self.api.call_api(method, url, header_params=headers, body=data, _request_timeout=self.timeout)
        resp.read()
        text = resp.data.decode() if isinstance(resp.data, bytes) else (resp.data or "")
        if resp.status == 404 and missing_ok:
            return None
        if resp.status >= 300:
            raise ApiError(resp.status, text, f"{method} {urllib.parse.unquote(path)}")
        return json.loads(text) if text else {}

    # -- paths ------------------------------------------------------------------------
    @staticmethod
    def cache_path(ns: str, name: str = "") -> str:
        return f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}" + (f"/{name}" if name else "")

    @staticmethod
    def daemonset_path(ns: str, name: str = "") -> str:
        return f"/apis/apps/v1/namespaces/{ns}/daemonsets" + (f"/{name}" if name else "")

    # -- the calls the operator makes -------------------------------------------------
    def list_classes(self) -> list[dict]:
        return self.request("GET", f"/apis/{GROUP}/{VERSION}/{CLASS_PLURAL}")["items"]

    def get_namespace_labels(self, ns: str) -> dict[str, str]:
        found = self.request("GET", f"/api/v1/namespaces/{ns}", missing_ok=True) or {}
        return (found.get("metadata") or {}).get("labels") or {}

    def get_cache(self, ns: str, name: str) -> dict | None:
        return self.request("GET", self.cache_path(ns, name), missing_ok=True)

    def patch_cache_status(self, ns: str, name: str, status: dict) -> dict | None:
        return self.request("PATCH", self.cache_path(ns, name) + "/status", {"status": status},
                            content_type=MERGE, missing_ok=True)

    def get_daemonset(self, ns: str, name: str) -> dict | None:
        return self.request("GET", self.daemonset_path(ns, name), missing_ok=True)

    def create_daemonset(self, ds: dict, dry_run: bool = False) -> dict:
        return self.request("POST", self.daemonset_path(ds["metadata"]["namespace"]), ds,
                            query={"dryRun": "All"} if dry_run else None)

    def replace_daemonset(self, ds: dict, dry_run: bool = False) -> dict:
        meta = ds["metadata"]
        return self.request("PUT", self.daemonset_path(meta["namespace"], meta["name"]), ds,
                            query={"dryRun": "All"} if dry_run else None)

    def delete_daemonset(self, ns: str, name: str) -> None:
        # Foreground: the DaemonSet goes only after its pods, i.e. after each daemon
        # had its SIGTERM and removed its sockets.
        self.request("DELETE", self.daemonset_path(ns, name), {"propagationPolicy": "Foreground"},
                     missing_ok=True)

    def list_pods(self, ns: str, selector: str) -> list[dict]:
        return self.request("GET", f"/api/v1/namespaces/{ns}/pods", query={"labelSelector": selector})["items"]

    def list_events(self, ns: str, field_selector: str) -> list[dict]:
        return self.request("GET", f"/api/v1/namespaces/{ns}/events", query={"fieldSelector": field_selector})["items"]

    def list_controller_revisions(self, ns: str, selector: str) -> list[dict]:
        return self.request("GET", f"/apis/apps/v1/namespaces/{ns}/controllerrevisions",
                            query={"labelSelector": selector})["items"]

    def list_nodes(self, selector: str = "") -> list[dict]:
        return self.request("GET", "/api/v1/nodes", query={"labelSelector": selector} if selector else None)["items"]

    def label_node(self, node: str, key: str, value: str | None) -> None:
        self.request("PATCH", f"/api/v1/nodes/{node}", {"metadata": {"labels": {key: value}}},
                     content_type=MERGE, missing_ok=True)

    # -- hot standby: the Deployment, its ReplicaSets, and the pods the operator makes ----
    def get_deployment(self, ns: str, name: str) -> dict | None:
        return self.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments/{name}", missing_ok=True)

    def list_replicasets(self, ns: str, selector: str) -> list[dict]:
        return self.request("GET", f"/apis/apps/v1/namespaces/{ns}/replicasets",
                            query={"labelSelector": selector})["items"]

    def create_pod(self, pod: dict) -> dict:
        return self.request("POST", f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods", pod)

    def patch_pod(self, ns: str, name: str, patch: dict) -> dict:
        return self.request("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}", patch, content_type=MERGE)

    def delete_pod(self, ns: str, name: str, uid: str) -> None:
        self.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}", {"preconditions": {"uid": uid}},
                     missing_ok=True)

    def list_daemonsets(self, ns: str, selector: str) -> list[dict]:
        return self.request("GET", self.daemonset_path(ns), query={"labelSelector": selector})["items"]

    def list_deployments(self, ns: str, selector: str) -> list[dict]:
        return self.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments",
                            query={"labelSelector": selector})["items"]

    def patch_deployment(self, ns: str, name: str, patch: dict) -> dict | None:
        return self.request("PATCH", f"/apis/apps/v1/namespaces/{ns}/deployments/{name}", patch,
                            content_type=MERGE, missing_ok=True)

    def patch_node_labels(self, node: str, labels: dict[str, str | None]) -> None:
        self.request("PATCH", f"/api/v1/nodes/{node}", {"metadata": {"labels": labels}},
                     content_type=MERGE, missing_ok=True)
