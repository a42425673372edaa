"""`helm test` for the weightcache chart: does the API server have what it relies on?

- each CRD named by --crd is Established;
- the ClusterKopfPeering named by --peering exists (kopf never creates it);
- every webhook of the MutatingWebhookConfiguration: its Service exists, and a TLS
  connection to it verifies against the configuration's own caBundle for the Service's
  DNS name `<service>.<namespace>.svc` (what the API server checks), then answers HTTP.

Prints one JSON line per check and exits 1 if any failed. Runs in the operator image
(python + the kubernetes client), in the cluster (in-cluster token) or with $KUBECONFIG.
"""

from __future__ import annotations

import argparse
import base64
import json
import socket
import ssl
import sys

from kubernetes import client, config


def crd_established(api: client.ApiextensionsV1Api, name: str) -> str:
    crd = api.read_custom_resource_definition(name)
    for cond in crd.status.conditions or []:
        if cond.type == "Established":
            if cond.status == "True":
                return "established"
            raise RuntimeError(f"Established={cond.status}: {cond.reason}: {cond.message}")
    raise RuntimeError("no Established condition yet")


def peering_exists(api: client.CustomObjectsApi, name: str) -> str:
    api.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", name)
    return "exists"


def webhook_answers_tls(core: client.CoreV1Api, service_ref, ca_bundle: str | None, timeout: float) -> str:
    if not ca_bundle:
        raise RuntimeError("caBundle is empty (with cert-manager: is its cainjector running?)")
    svc = core.read_namespaced_service(service_ref.name, service_ref.namespace)
    host = svc.spec.cluster_ip
    port = service_ref.port or 443
    dns_name = f"{service_ref.name}.{service_ref.namespace}.svc"
    ctx = ssl.create_default_context(cadata=base64.b64decode(ca_bundle).decode())
    with socket.create_connection((host, port), timeout=timeout) as raw:
        with ctx.wrap_socket(raw, server_hostname=dns_name) as tls:
            request = f"GET {service_ref.path or '/'} HTTP/1.1\r\nHost: {dns_name}\r\nConnection: close\r\n\r\n"
            tls.sendall(request.encode())
            status_line = tls.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
    if not status_line.startswith("HTTP/"):
        raise RuntimeError(f"TLS verified, but the answer was not HTTP: {status_line!r}")
    return f"TLS verified for {dns_name} at {host}:{port}; answered {status_line!r}"


def _fail(message: str) -> str:
    raise RuntimeError(message)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--webhook-configuration", required=True, help="MutatingWebhookConfiguration name")
    p.add_argument("--peering", required=True, help="ClusterKopfPeering name")
    p.add_argument("--crd", action="append", default=[], help="a CRD that must be Established (repeatable)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per network connection")
    args = p.parse_args(argv)

    config.load_config()  # $KUBECONFIG if set, else the pod's in-cluster token
    ext, core = client.ApiextensionsV1Api(), client.CoreV1Api()
    checks = [(f"crd {name}", lambda name=name: crd_established(ext, name)) for name in args.crd]
    checks.append((f"clusterkopfpeering {args.peering}",
                   lambda: peering_exists(client.CustomObjectsApi(), args.peering)))
    mwc = client.AdmissionregistrationV1Api().read_mutating_webhook_configuration(args.webhook_configuration)
    for hook in mwc.webhooks or []:
        ref, bundle = hook.client_config.service, hook.client_config.ca_bundle
        checks.append((f"webhook {hook.name}", lambda ref=ref, bundle=bundle: webhook_answers_tls(
            core, ref, bundle, args.timeout)))
    if not mwc.webhooks:
        checks.append(("webhooks", lambda: _fail(f"{args.webhook_configuration} has no webhooks")))

    failed = 0
    for what, check in checks:
        try:
            print(json.dumps({"check": what, "ok": True, "detail": check()}), flush=True)
        except Exception as e:  # every failure is reported, then the exit code says it
            failed += 1
            print(json.dumps({"check": what, "ok": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
