"""Pure pieces of the node simulator: which images run as local processes, a container's
argv, env and volume folders, and the pod status a kubelet would report.

Pods are plain dicts here (the API's JSON form, camelCase keys)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

# Repository names (registry prefix, tag and digest ignored) whose containers run their
# command/args as a local process. Any other image is simulated: Running and Ready
# without a process.
RUNNABLE_IMAGES = frozenset({"weightcache-daemon", "weightcache-operator", "weightcache-engine",
                             "weightcache-test", "weightcache-vllm-cpu"})
# What each runnable image's ENTRYPOINT would be when a container gives no `command`.
# weightcache-test has none: its pods must say what to run.
IMAGE_ENTRYPOINTS = {
    "weightcache-daemon": ["weightcache"],
    "weightcache-operator": ["weightcache"],
    "weightcache-engine": ["weightcache"],
    "weightcache-test": [],
    # vLLM's CPU build with weightcache installed beside it (--load-format weightcache).
    "weightcache-vllm-cpu": ["python", "-m", "vllm.entrypoints.openai.api_server"],
}
# Images whose `python` is another venv's than the simulator's: the vLLM venv
# (tests/vllm/venv.sh; vLLM pins a torch of its own). Its bin folder leads PATH.
IMAGE_VENVS = {"weightcache-vllm-cpu": "vllm"}
# Set in every local process: mountPath -> host folder, for programs that want to know.
MOUNTS_ENV = "WEIGHTCACHE_SIM_MOUNTS"


def image_repository(image: str) -> str:
    """'ghcr.io/org/weightcache-daemon:0.1@sha256:..' -> 'weightcache-daemon'."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[0]


def is_runnable(image: str) -> bool:
    return image_repository(image) in RUNNABLE_IMAGES


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known vars replaced, $$ escapes, unknown left as is."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _VAR.sub(sub, text)


def remap_path(text: str, mounts: dict[str, str]) -> str:
    """Rewrite a path under a mountPath to the host folder behind it (longest mount wins).
    Applies to whole values and to `--flag=/path` forms."""
    prefix, sep, value = ("", "", text)
    if text.startswith("-") and "=" in text:
        prefix, sep, value = text.partition("=")
    for mount in sorted(mounts, key=len, reverse=True):
        if value == mount or value.startswith(mount.rstrip("/") + "/"):
            return prefix + sep + mounts[mount] + value[len(mount.rstrip("/")):]
    return text


def container_argv(container: dict, env: dict[str, str], mounts: dict[str, str]) -> list[str]:
    image = image_repository(container.get("image", ""))
    command = container.get("command") or IMAGE_ENTRYPOINTS.get(image, [])
    args = container.get("args") or []
    return [remap_path(expand(a, env), mounts) for a in [*command, *args]]


def with_remapped_probes(container: dict, env: dict[str, str], mounts: dict[str, str]) -> dict:
    """CONTAINER with its exec probes' commands expanded and remapped like its args."""
    out = dict(container)
    for key in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(key)
        if probe and "exec" in probe:
            cmd = [remap_path(expand(a, env), mounts) for a in probe["exec"].get("command") or []]
            out[key] = {**probe, "exec": {"command": cmd}}
    return out


def field_ref(pod: dict, path: str, pod_ip: str, host_ip: str) -> str:
    meta, spec = pod["metadata"], pod["spec"]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    return {
        "metadata.name": meta.get("name", ""), "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""), "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip, "status.podIPs": pod_ip, "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }.get(path, "")


_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
          "Ti": 2**40, "m": 0.001}


def quantity(q: str) -> float:
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(q))
    return float(m.group(1)) * _UNITS.get(m.group(2), 1) if m else 0.0


def resource_ref(container: dict, ref: dict) -> str:
    kind, _, res = ref["resource"].partition(".")
    value = ((container.get("resources") or {}).get(kind) or {}).get(res)
    if value is None:
        return "0"
    divisor = quantity(ref.get("divisor") or "1")
    return str(int(-(-quantity(value) // divisor)))  # the kubelet rounds up


def pod_groups(pod: dict) -> list[int]:
    """The supplementary groups the kubelet gives a pod's processes beyond their own:
    securityContext.supplementalGroups and fsGroup (the daemon admits engines by one)."""
    sc = (pod.get("spec") or {}).get("securityContext") or {}
    groups = [int(g) for g in sc.get("supplementalGroups") or []]
    if sc.get("fsGroup") is not None:
        groups.append(int(sc["fsGroup"]))
    return sorted(set(groups))


def container_env(pod: dict, container: dict, base: dict[str, str], pod_ip: str, host_ip: str,
                  lookup, mounts: dict[str, str], venv_bin: str | None = None) -> dict[str, str]:
    """The process env: BASE (the simulator's own, for PATH and the venv), then envFrom,
    then env, in the kubelet's order. LOOKUP(kind, name, key) reads a ConfigMap/Secret
    value (kind 'configMap'|'secret'; key None = the whole data dict). VENV_BIN leads
    PATH (default: the simulator's own venv)."""
    env = dict(base)
    env["HOSTNAME"] = pod["metadata"]["name"]
    venv_bin = venv_bin or os.path.dirname(sys.executable)  # so `weightcache` resolves to this venv's
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", os.defpath)
    env[MOUNTS_ENV] = ",".join(f"{k}={v}" for k, v in sorted(mounts.items()))
    for src in container.get("envFrom") or []:
        kind = "configMap" if "configMapRef" in src else "secret"
        ref = src.get("configMapRef") or src.get("secretRef") or {}
        data = lookup(kind, ref["name"], None) or {}
        env.update({src.get("prefix", "") + k: v for k, v in data.items()})
    for var in container.get("env") or []:
        name, vf = var["name"], var.get("valueFrom")
        if vf is None:
            env[name] = expand(var.get("value", ""), env)
        elif "fieldRef" in vf:
            env[name] = field_ref(pod, vf["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "resourceFieldRef" in vf:
            env[name] = resource_ref(container, vf["resourceFieldRef"])
        else:
            kind = "configMap" if "configMapKeyRef" in vf else "secret"
            ref = vf.get("configMapKeyRef") or vf.get("secretKeyRef")
            value = lookup(kind, ref["name"], ref["key"])
            if value is not None:
                env[name] = value
    return {k: remap_path(v, mounts) for k, v in env.items()}


def volume_dirs(pod: dict, node_root: Path, pod_dir: Path) -> dict[str, Path]:
    """Volume name -> host folder. hostPath lives under the node's root (shared by the
    node's pods only), everything else under the pod's own folder."""
    out = {}
    for vol in pod["spec"].get("volumes") or []:
        if "hostPath" in vol:
            out[vol["name"]] = node_root / vol["hostPath"]["path"].lstrip("/")
        else:
            out[vol["name"]] = pod_dir / "volumes" / vol["name"]
    return out


def container_mounts(container: dict, vols: dict[str, Path]) -> dict[str, str]:
    """mountPath -> host folder (or file, for subPath) for one container."""
    out = {}
    for vm in container.get("volumeMounts") or []:
        base = vols.get(vm["name"])
        if base is not None:
            out[vm["mountPath"]] = str(base / vm["subPath"]) if vm.get("subPath") else str(base)
    return out


def is_sidecar(container: dict) -> bool:
    return container.get("restartPolicy") == "Always"


def should_restart(policy: str, exit_code: int) -> bool:
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


def condition(kind: str, ok: bool, t: str, reason: str | None = None) -> dict:
    c = {"type": kind, "status": "True" if ok else "False", "lastProbeTime": None, "lastTransitionTime": t}
    if reason and not ok:
        c["reason"] = reason
    return c


def pod_phase(pod_policy: str, init_done: bool, main: list[dict]) -> str:
    """Phase from the main containers' statuses (dicts with 'state')."""
    if not init_done or not main:
        return "Pending"
    terminated = [s["state"].get("terminated") for s in main]
    if all(terminated) and not any(s.get("_will_restart") for s in main):
        return "Succeeded" if all(t["exitCode"] == 0 for t in terminated) else "Failed"
    if any("running" in s["state"] or "terminated" in s["state"] or s.get("restartCount", 0) for s in main):
        return "Running"
    return "Pending"
