"""Certificates and keys of a throwaway test cluster, made with the openssl CLI (no
Python crypto dependency). Each identity is a client certificate whose CN/O are the
user and group that RBAC's bootstrap policy expects."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

# (file stem, CN, O) of the client identities the control plane uses.
CLIENTS = (
    ("admin", "kubernetes-admin", "system:masters"),
    ("controller-manager", "system:kube-controller-manager", ""),
    ("scheduler", "system:kube-scheduler", ""),
    ("front-proxy-client", "front-proxy-client", ""),  # the aggregator's identity
)


@dataclass(frozen=True)
class Pki:
    dir: Path

    def path(self, name: str) -> Path:
        return self.dir / name

    @property
    def ca_crt(self) -> Path:
        return self.path("ca.crt")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _key(cwd: Path, name: str) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", name, cwd=cwd)


def _subject(cn: str, org: str) -> str:
    return f"/CN={cn}" + (f"/O={org}" if org else "")


def _signed(cwd: Path, stem: str, cn: str, org: str, ext: str) -> None:
    _key(cwd, f"{stem}.key")
    _openssl("req", "-new", "-key", f"{stem}.key", "-subj", _subject(cn, org), "-out", f"{stem}.csr", cwd=cwd)
    (cwd / f"{stem}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{stem}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "30", "-extfile", f"{stem}.ext", "-out", f"{stem}.crt", cwd=cwd)


def server_ext(dns: list[str], ips: list[str]) -> str:
    san = ",".join([f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips])
    return (f"basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            f"extendedKeyUsage=serverAuth\nsubjectAltName={san}\n")


CLIENT_EXT = ("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
              "extendedKeyUsage=clientAuth\n")


def make_pki(dir: Path, service_ip: str) -> Pki:
    """CA, apiserver serving cert, service-account key pair and client certs in DIR."""
    dir.mkdir(parents=True, exist_ok=True)
    _key(dir, "ca.key")
    _openssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=weightcache-test-ca", "-days", "30",
             "-out", "ca.crt", cwd=dir)
    dns = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
           "kubernetes.default.svc.cluster.local"]
    _signed(dir, "apiserver", "kube-apiserver", "", server_ext(dns, ["127.0.0.1", service_ip]))
    for stem, cn, org in CLIENTS:
        _signed(dir, stem, cn, org, CLIENT_EXT)
    _key(dir, "sa.key")
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=dir)
    return Pki(dir)


def make_serving_cert(dir: Path, dns: list[str]) -> Pki:
    """A fresh CA (ca.crt) and a server certificate (tls.crt, tls.key) for DNS names, as a
    webhook or an aggregated API server needs."""
    dir.mkdir(parents=True, exist_ok=True)
    _key(dir, "ca.key")
    _openssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=weightcache-test-serving-ca", "-days", "30",
             "-out", "ca.crt", cwd=dir)
    _signed(dir, "tls", dns[0], "", server_ext(dns, []))
    return Pki(dir)
