"""`weightcache uninstall-caches`: the chart's pre-delete step. Every WeightCache is deleted
(forced: engines attached keep their mappings, new ones fall back as their policy says)
while the operator still runs to finalize them, so that none is left `Terminating` with
a finalizer nobody will ever remove once the operator is gone.

    weightcache uninstall-caches --timeout 300 [--json]
"""

from __future__ import annotations

import json
import sys

from .manifests import FORCE_DELETE_ANNOTATION, GROUP, PLURAL, VERSION

EXIT_LEFT = 1


def add_command(sub) -> None:
    p = sub.add_parser("uninstall-caches", help="delete every WeightCache and wait until the operator finalized them",
                       description="What `helm uninstall` runs first (a pre-delete hook): every WeightCache in the "
                                   "cluster is annotated weightcache.io/force-delete and deleted, and the command waits "
                                   "while the operator, still running, removes their daemons and finalizers. Exits "
                                   "non-zero, naming what is left, if that takes longer than --timeout.")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="how long to wait for the caches to go (default 300)")
    p.add_argument("--namespace", action="append", default=[], metavar="NS",
                   help="only the caches of this namespace (repeatable; the operator's --namespace; default: all)")
    p.add_argument("--json", action="store_true", help="print the outcome as one JSON object")
    p.set_defaults(func=run_command)


def _names(caches: list[dict]) -> list[str]:
    return sorted(f"{c['metadata']['namespace']}/{c['metadata']['name']}" for c in caches)


def run_command(args) -> int:
    from kubernetes import client, watch

    from .kube import MERGE, Kube, load_api_client

    kube = Kube(load_api_client())
    listing = kube.request("GET", f"/apis/{GROUP}/{VERSION}/{PLURAL}")
    found = [c for c in listing["items"] if not args.namespace or c["metadata"]["namespace"] in args.namespace]
    for c in found:
        meta = c["metadata"]
        one = kube.cache_path(meta["namespace"], meta["name"])
        kube.request("PATCH", one, {"metadata": {"annotations": {FORCE_DELETE_ANNOTATION: "true"}}},
                     content_type=MERGE, missing_ok=True)
        kube.request("DELETE", one, missing_ok=True)
    uids = {c["metadata"]["uid"] for c in found}
    waiting = set(uids)
    if waiting:  # each one's DELETED event, from the list's resourceVersion on
        stream = watch.Watch()
        for event in stream.stream(client.CustomObjectsApi(kube.api).list_cluster_custom_object, GROUP, VERSION,
                                   PLURAL, resource_version=listing["metadata"]["resourceVersion"],
                                   timeout_seconds=max(1, int(args.timeout))):
            if event["type"] == "DELETED":
                waiting.discard(event["object"]["metadata"]["uid"])
            if not waiting:
                stream.stop()
    left = [c for c in kube.request("GET", f"/apis/{GROUP}/{VERSION}/{PLURAL}")["items"]
            if c["metadata"]["uid"] in uids]
    outcome = {"deleted": _names(found), "left": _names(left)}
    if args.json:
        print(json.dumps(outcome))
    elif left:
        print(f"weightcache uninstall-caches: {len(left)} WeightCache(s) still there after {args.timeout:.0f} s: "
              f"{', '.join(outcome['left'])}; is the operator running? `kubectl get wc -A` shows why each waits",
              file=sys.stderr)
    else:
        print(f"deleted {len(found)} WeightCache(s)" + (f": {', '.join(outcome['deleted'])}" if found else ""))
    return EXIT_LEFT if left else 0
