"""etcd, kube-apiserver, kube-controller-manager and kube-scheduler on loopback.

The *_args functions are pure (ports and paths in, argv out); start_control_plane is
the thin shell that writes files, starts the processes and waits until each is healthy.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .network import Network
from .pki import Pki, make_pki
from .procs import ProcessSet, free_port

ADMISSION_PLUGINS = ("NamespaceLifecycle,LimitRanger,ServiceAccount,DefaultTolerationSeconds,"
                     "DefaultStorageClass,TaintNodesByCondition,Priority,PodSecurity,NodeRestriction,"
                     "MutatingAdmissionWebhook,ValidatingAdmissionWebhook,ResourceQuota")


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int

    @classmethod
    def pick(cls) -> "Ports":
        return cls(*(free_port() for _ in range(5)))


def etcd_args(bin_dir: Path, data_dir: Path, ports: Ports) -> list[str]:
    client = f"http://127.0.0.1:{ports.etcd_client}"
    peer = f"http://127.0.0.1:{ports.etcd_peer}"
    return [str(bin_dir / "etcd"), "--name=test", f"--data-dir={data_dir}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}", "--log-level=warn",
            # A test cluster's data is thrown away: fsync only slows every write down.
            "--unsafe-no-fsync=true"]


def admission_config(pod_security_default: str) -> dict:
    """PodSecurity defaults: namespaces without labels get POD_SECURITY_DEFAULT, so a chart
    must label the daemons' namespace privileged, as it must on a real cluster."""
    return {
        "apiVersion": "apiserver.config.k8s.io/v1",
        "kind": "AdmissionConfiguration",
        "plugins": [{
            "name": "PodSecurity",
            "configuration": {
                "apiVersion": "pod-security.admission.config.k8s.io/v1",
                "kind": "PodSecurityConfiguration",
                "defaults": {"enforce": pod_security_default, "enforce-version": "latest",
                             "audit": "restricted", "audit-version": "latest",
                             "warn": pod_security_default, "warn-version": "latest"},
                "exemptions": {"usernames": [], "runtimeClasses": [], "namespaces": ["kube-system"]},
            },
        }],
    }


def apiserver_args(bin_dir: Path, pki: Pki, ports: Ports, state: Path, net: Network) -> list[str]:
    p = pki.path
    return [str(bin_dir / "kube-apiserver"),
            "--bind-address=127.0.0.1", f"--secure-port={ports.apiserver}",
            "--advertise-address=127.0.0.1",
            f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
            f"--tls-cert-file={p('apiserver.crt')}", f"--tls-private-key-file={p('apiserver.key')}",
            f"--client-ca-file={p('ca.crt')}",
            f"--service-account-key-file={p('sa.pub')}",
            f"--service-account-signing-key-file={p('sa.key')}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            # ClusterIPs come from loopback, so that the service proxy can listen on
            # them: apiserver -> webhook Service traffic never leaves 127.0.0.0/8.
            f"--service-cluster-ip-range={net.service_cidr}",
            "--authorization-mode=Node,RBAC",
            f"--enable-admission-plugins={ADMISSION_PLUGINS}",
            f"--admission-control-config-file={state / 'admission.json'}",
            "--allow-privileged=true",
            f"--requestheader-client-ca-file={p('ca.crt')}", "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={p('front-proxy-client.crt')}",
            f"--proxy-client-key-file={p('front-proxy-client.key')}",
            # Webhooks reach their Service through its (loopback) ClusterIP, which the
            # node simulator proxies; see svcproxy.py for why not EndpointSlices.
            "--enable-aggregator-routing=false",
            # Its Endpoints would hold 127.0.0.1, which validation rejects; the service
            # proxy routes the `kubernetes` Service to the apiserver instead.
            "--endpoint-reconciler-type=none",
            f"--cert-dir={state / 'apiserver-certs'}",
            "--profiling=false", "--v=1"]


def kubeconfig(server: str, ca: Path, crt: Path, key: Path, user: str) -> dict:
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"client-certificate": str(crt), "client-key": str(key)}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": user, "namespace": "default"}}],
    }


def component_args(bin_dir: Path, name: str, kubeconfig_path: Path, port: int, state: Path,
                   pki: Pki, net: Network) -> list[str]:
    """kube-controller-manager or kube-scheduler."""
    kc = str(kubeconfig_path)
    args = [str(bin_dir / name), f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}", "--bind-address=127.0.0.1", f"--secure-port={port}",
            "--leader-elect=false", f"--cert-dir={state / (name + '-certs')}", "--v=1"]
    if name == "kube-controller-manager":
        args += [f"--service-account-private-key-file={pki.path('sa.key')}",
                 f"--root-ca-file={pki.ca_crt}", "--use-service-account-credentials=true",
                 f"--cluster-signing-cert-file={pki.ca_crt}",
                 f"--cluster-signing-key-file={pki.path('ca.key')}",
                 f"--service-cluster-ip-range={net.service_cidr}",
                 "--allocate-node-cidrs=false", "--controllers=*"]
    return args


def _get(url: str, ctx: ssl.SSLContext | None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=ctx) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def wait_healthy(name: str, url: str, procs: ProcessSet, deadline: float, log: Path,
                 ctx: ssl.SSLContext | None = None) -> None:
    while not _get(url, ctx):
        dead = procs.dead()
        if dead:
            raise RuntimeError(f"{dead[0][0]} exited with status {dead[0][1]} while waiting for {name}; "
                               f"see {log.parent}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not healthy at {url} in time; see {log}")
        time.sleep(0.1)


@dataclass(frozen=True)
class ControlPlane:
    server: str
    kubeconfig: Path
    ports: Ports
    pki: Pki


def start_control_plane(bin_dir: Path, state: Path, procs: ProcessSet, net: Network, timeout: float = 90,
                        pod_security_default: str = "baseline") -> ControlPlane:
    """Start the four components in STATE, return once every one answers its health check."""
    deadline = time.monotonic() + timeout
    logs = state / "logs"
    pki = make_pki(state / "pki", net.kubernetes_service_ip)
    ports = Ports.pick()
    (state / "admission.json").write_text(json.dumps(admission_config(pod_security_default), indent=1))
    server = f"https://127.0.0.1:{ports.apiserver}"
    configs = {}
    for stem in ("admin", "controller-manager", "scheduler"):
        path = state / f"{stem}.kubeconfig"
        path.write_text(json.dumps(kubeconfig(server, pki.ca_crt, pki.path(f"{stem}.crt"),
                                              pki.path(f"{stem}.key"), stem), indent=1))
        configs[stem] = path

    procs.start("etcd", etcd_args(bin_dir, state / "etcd-data", ports), logs / "etcd.log")
    wait_healthy("etcd", f"http://127.0.0.1:{ports.etcd_client}/health", procs, deadline, logs / "etcd.log")

    procs.start("kube-apiserver", apiserver_args(bin_dir, pki, ports, state, net), logs / "kube-apiserver.log")
    ca_ctx = ssl.create_default_context(cafile=str(pki.ca_crt))
    wait_healthy("kube-apiserver", f"{server}/readyz", procs, deadline, logs / "kube-apiserver.log", ca_ctx)

    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE  # their self-signed serving certs; loopback only
    for name, stem, port in (("kube-controller-manager", "controller-manager", ports.controller_manager),
                             ("kube-scheduler", "scheduler", ports.scheduler)):
        procs.start(name, component_args(bin_dir, name, configs[stem], port, state, pki, net), logs / f"{name}.log")
    for name, port in (("kube-controller-manager", ports.controller_manager),
                       ("kube-scheduler", ports.scheduler)):
        wait_healthy(name, f"https://127.0.0.1:{port}/healthz", procs, deadline, logs / f"{name}.log", insecure)
    return ControlPlane(server=server, kubeconfig=configs["admin"], ports=ports, pki=pki)
