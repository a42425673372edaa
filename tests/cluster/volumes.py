"""Materialises a pod's volumes as host folders: hostPath under the node's root,
emptyDir and the rest under the pod's folder, with ConfigMap, Secret, downward API
and service-account token contents written as files."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from .kube import ApiError, Rest
from .podspec import field_ref, volume_dirs

TOKEN_SECONDS = 3600


class VolumeError(Exception):
    """A volume's source is missing; the kubelet retries, and so does the pod worker."""


def _write(path: Path, data: bytes, mode: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if mode is not None:
        path.chmod(mode)


def _object_data(rest: Rest, ns: str, kind: str, name: str, optional: bool) -> dict[str, bytes]:
    plural = "configmaps" if kind == "configMap" else "secrets"
    try:
        obj = rest.get(f"/api/v1/namespaces/{ns}/{plural}/{name}")
    except ApiError as e:
        if e.status == 404 and optional:
            return {}
        raise VolumeError(f"{kind} {ns}/{name}: {e}") from e
    if kind == "secret":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return out


def _write_keys(dest: Path, data: dict[str, bytes], items: list[dict] | None, mode: int | None) -> None:
    if items:
        for it in items:
            if it["key"] in data:
                _write(dest / it["path"], data[it["key"]], it.get("mode", mode))
    else:
        for k, v in data.items():
            _write(dest / k, v, mode)


def service_account_token(rest: Rest, pod: dict, audience: str | None, seconds: int) -> str:
    meta = pod["metadata"]
    sa = pod["spec"].get("serviceAccountName") or "default"
    spec = {"expirationSeconds": max(seconds, 600),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}
    if audience:
        spec["audiences"] = [audience]
    r = rest.create(f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{sa}/token", {"spec": spec})
    return r["status"]["token"]


def _projected(rest: Rest, pod: dict, dest: Path, vol: dict, ctx: dict) -> None:
    ns, mode = pod["metadata"]["namespace"], vol.get("defaultMode")
    for src in vol.get("sources") or []:
        if "serviceAccountToken" in src:
            t = src["serviceAccountToken"]
            token = service_account_token(rest, pod, t.get("audience"), t.get("expirationSeconds") or TOKEN_SECONDS)
            _write(dest / t["path"], token.encode(), mode)
            ctx.setdefault("token", token)
        elif "configMap" in src or "secret" in src:
            kind = "configMap" if "configMap" in src else "secret"
            ref = src[kind]
            _write_keys(dest, _object_data(rest, ns, kind, ref["name"], ref.get("optional", False)),
                        ref.get("items"), mode)
        elif "downwardAPI" in src:
            _downward(pod, dest, src["downwardAPI"], ctx, mode)


def _downward(pod: dict, dest: Path, dapi: dict, ctx: dict, mode: int | None) -> None:
    for it in dapi.get("items") or []:
        if "fieldRef" in it:
            path = it["fieldRef"]["fieldPath"]
            if path in ("metadata.labels", "metadata.annotations"):
                kv = pod["metadata"].get(path.split(".")[1]) or {}
                value = "\n".join(f'{k}="{v}"' for k, v in sorted(kv.items()))
            else:
                value = field_ref(pod, path, ctx["pod_ip"], ctx["host_ip"])
            _write(dest / it["path"], value.encode(), it.get("mode", mode))


def materialize(rest: Rest, pod: dict, node_root: Path, pod_dir: Path, ctx: dict) -> dict[str, Path]:
    """Create every volume's folder and contents; volume name -> host folder. CTX carries
    pod_ip/host_ip in, and gets the pod's service-account token (if mounted) out."""
    dirs = volume_dirs(pod, node_root, pod_dir)
    ns = pod["metadata"]["namespace"]
    for vol in pod["spec"].get("volumes") or []:
        dest = dirs[vol["name"]]
        if "hostPath" in vol:
            kind = vol["hostPath"].get("type") or ""
            (dest.parent if kind in ("File", "FileOrCreate", "Socket", "CharDevice", "BlockDevice")
             else dest).mkdir(parents=True, exist_ok=True)
            if kind == "FileOrCreate":
                dest.touch(exist_ok=True)
            continue
        dest.mkdir(parents=True, exist_ok=True)
        if "configMap" in vol or "secret" in vol:
            kind = "configMap" if "configMap" in vol else "secret"
            ref = vol[kind]
            name = ref.get("name") or ref.get("secretName")
            _write_keys(dest, _object_data(rest, ns, kind, name, ref.get("optional", False)),
                        ref.get("items"), ref.get("defaultMode"))
        elif "projected" in vol:
            _projected(rest, pod, dest, vol["projected"], ctx)
        elif "downwardAPI" in vol:
            _downward(pod, dest, vol["downwardAPI"], ctx, vol["downwardAPI"].get("defaultMode"))
    return dirs


def pod_kubeconfig(server: str, ca: str, token: str) -> str:
    """What a pod's in-cluster config would give it, as a kubeconfig (KUBECONFIG), since
    a local process cannot see /var/run/secrets/kubernetes.io/serviceaccount."""
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "pod",
        "clusters": [{"name": "c", "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "pod", "context": {"cluster": "c", "user": "sa"}}],
    }, indent=1)
