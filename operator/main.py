"""`weightcache operator`: the kopf operator (WeightCache -> DaemonSet, status, node
labels, finalizer) and the pod webhook, in one process.

    weightcache operator --webhook-bind 0.0.0.0:8443 --tls-cert tls.crt --tls-key tls.key \\
        --health-bind 0.0.0.0:8080 --peering weightcache --daemon-image IMG --agent-image IMG
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys

from weightcache import logs

from .manifests import Defaults

EXIT_BAD_INPUT = 2


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def add_command(sub) -> None:
    d = Defaults()
    p = sub.add_parser("operator", help="run the Kubernetes operator and the pod webhook (foreground)",
                       description="Reconcile each WeightCache to its daemon DaemonSet, aggregate the daemons' status, "
                                   "label the nodes where a cache is ready, hold deletion while engines are attached, "
                                   "and mutate engine pods labelled weightcache.io/cache (webhook path /mutate-pods).")
    p.add_argument("--namespace", action="append", default=[], metavar="NS",
                   help="serve WeightCaches of this namespace (repeatable; default: all namespaces)")
    p.add_argument("--webhook-bind", type=_host_port, default=("0.0.0.0", 8443), metavar="HOST:PORT",
                   help="HTTPS address of the pod webhook (default 0.0.0.0:8443)")
    p.add_argument("--tls-cert", help="the webhook's serving certificate (PEM)")
    p.add_argument("--tls-key", help="the webhook's private key (PEM)")
    p.add_argument("--no-webhook", action="store_true", help="do not serve the pod webhook (no TLS files needed)")
    p.add_argument("--health-bind", type=_host_port, default=("0.0.0.0", 8080), metavar="HOST:PORT",
                   help="plain HTTP address of GET /healthz (default 0.0.0.0:8080)")
    p.add_argument("--peering", default="weightcache", metavar="NAME",
                   help="the ClusterKopfPeering the replicas share (created if missing; default: weightcache)")
    p.add_argument("--priority", type=int, default=None,
                   help="peering priority; the highest live replica works, the others stand by "
                        "(default: random, so that two replicas never tie)")
    p.add_argument("--peering-lifetime", type=int, default=20, metavar="SECONDS",
                   help="how long a silent replica counts as alive: a killed active replica is taken over "
                        "after at most this long (default 20)")
    p.add_argument("--daemon-image", default=d.daemon_image, help=f"daemon image when a cache names none "
                                                                  f"(default {d.daemon_image})")
    p.add_argument("--daemon-namespace", default=d.daemon_namespace, metavar="NS",
                   help="the namespace every cache's daemons run in, the admin's: it must admit them (Pod Security "
                        f"privileged: they mount host directories); tenants' namespaces hold no daemon "
                        f"(default {d.daemon_namespace})")
    p.add_argument("--agent-image", default=d.agent_image, help=f"image of the engine pods' agent sidecar "
                                                                f"(default {d.agent_image})")
    p.add_argument("--client-gid", type=int, default=d.client_gid,
                   help=f"group engine pods are given and daemons admit on their sockets (default {d.client_gid})")
    p.add_argument("--poll-interval", type=float, default=2.0, metavar="SECONDS",
                   help="how often each cache's daemons are asked for their status (default 2)")
    p.add_argument("--print-peering-crds", action="store_true",
                   help="print kopf's peering CRDs as JSON (a v1 List, for kubectl apply -f -) and exit")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_command)


def _configure_logging(level: str) -> None:
    from .handlers import QuietWaits

    logs.configure(level)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logs.JsonFormatter())
    handler.addFilter(QuietWaits())
    for name in ("kopf", "aiohttp"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(level.upper())
        lg.propagate = False
    logging.getLogger("aiohttp.access").setLevel(max(logging.WARNING, logging.getLevelName(level.upper())))


def operator_settings(args, priority: int):
    """kopf's settings for this project: state in annotations under weightcache.io (the
    WeightCache status schema is strict), explicit events only, the webhook served from
    the given certificate and never self-registered (the chart ships its configuration)."""
    import kopf

    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = "weightcache.io/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="weightcache.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="weightcache.io", key="last-handled-configuration")
    settings.posting.enabled = True
    settings.posting.loggers = False  # only the events the operator means to post
    settings.posting.reporting_component = "weightcache-operator"
    settings.posting.event_name_prefix = "weightcache-"
    settings.peering.priority = priority
    settings.peering.lifetime = args.peering_lifetime
    settings.peering.stealth = True
    settings.execution.max_workers = 32
    # Pods that use a cache: the daemons, and the engines (hot standby watches those).
    settings.watching.label_selectors["v1", "pods"] = "weightcache.io/cache"
    settings.watching.label_selectors["apps/v1", "daemonsets"] = "app.kubernetes.io/name=weightcache-daemon"
    settings.admission.managed = None
    if not args.no_webhook:
        host, port = args.webhook_bind
        settings.admission.server = kopf.WebhookServer(addr=host, port=port, certfile=args.tls_cert,
                                                       pkeyfile=args.tls_key)
    return settings


def run_command(args) -> int:
    if args.print_peering_crds:
        from .peering import peering_crds

        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": peering_crds()}, indent=2))
        return 0
    if not args.no_webhook and not (args.tls_cert and args.tls_key):
        print("weightcache operator: the webhook needs --tls-cert and --tls-key (or --no-webhook)", file=sys.stderr)
        return EXIT_BAD_INPUT
    _configure_logging(args.log_level)

    import kopf

    from .handlers import emit_event, register
    from .hotstandby import StandbyController
    from .kube import Kube, load_api_client
    from .peering import PeeringUnavailable, ensure_peering
    from .reconcile import Reconciler

    kube = Kube(load_api_client())
    try:
        ensure_peering(kube, args.peering)
    except PeeringUnavailable as e:
        print(f"weightcache operator: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    defaults = Defaults(daemon_image=args.daemon_image, agent_image=args.agent_image, client_gid=args.client_gid,
                        daemon_namespace=args.daemon_namespace)
    priority = args.priority if args.priority is not None else random.randint(1, 2**31 - 1)
    registry = kopf.OperatorRegistry()
    register(registry, Reconciler(kube, defaults, emit=emit_event), kube, defaults, poll_interval=args.poll_interval,
             standbys=StandbyController(kube, emit=emit_event))
    health_host, health_port = args.health_bind
    logging.getLogger("weightcache.operator").info("starting", extra={"fields": {
        "peering": args.peering, "priority": priority, "namespaces": args.namespace or "all"}})
    asyncio.run(kopf.operator(
        registry=registry, settings=operator_settings(args, priority),
        clusterwide=not args.namespace, namespaces=args.namespace,
        peering_name=args.peering, priority=priority,
        liveness_endpoint=f"http://{health_host}:{health_port}/healthz",
    ))
    return 0
