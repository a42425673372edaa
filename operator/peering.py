"""kopf peering, for two or more operator replicas: the peering CRDs (kopf's own
definitions, which the chart ships too) and the ClusterKopfPeering object the replicas
share. Replicas with distinct priorities: the highest works, the others pause until its
keep-alive record expires."""

from __future__ import annotations

import logging

from .kube import ApiError, Kube

log = logging.getLogger("weightcache.operator")

GROUP, VERSION = "kopf.dev", "v1"


def _crd(kind: str, plural: str, scope: str) -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {"scope": scope, "group": GROUP,
                 "names": {"kind": kind, "plural": plural, "singular": plural[:-1]},
                 "versions": [{"name": VERSION, "served": True, "storage": True,
                               "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                                   "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}]},
    }


def peering_crds() -> list[dict]:
    """ClusterKopfPeering and KopfPeering, as kopf defines them."""
    return [_crd("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
            _crd("KopfPeering", "kopfpeerings", "Namespaced")]


def peering_object(name: str) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ClusterKopfPeering", "metadata": {"name": name}}


class PeeringUnavailable(RuntimeError):
    pass


def ensure_peering(kube: Kube, name: str) -> None:
    """Create the ClusterKopfPeering NAME unless it exists (or this operator may not
    create it): with mandatory peering, kopf stays paused until it sees that object."""
    path = f"/apis/{GROUP}/{VERSION}/clusterkopfpeerings"
    try:
        if kube.request("GET", f"{path}/{name}", missing_ok=True) is None:
            try:
                kube.request("POST", path, peering_object(name))
            except ApiError as e:
                if e.status != 403:
                    raise
                # Not ours to create: the installer makes it (the chart does, after the
                # Deployment, and would fail on an object it finds already there). Paused
                # by mandatory peering, kopf starts working once it appears.
                log.info("waiting for the peering object to be created", extra={"fields": {"peering": name}})
    except ApiError as e:
        if e.status == 409:
            return
        if e.status == 404:
            raise PeeringUnavailable(
                "kopf's peering CRDs (clusterkopfpeerings.kopf.dev) are not installed; the chart ships them, "
                "or apply `weightcache operator --print-peering-crds`") from e
        raise PeeringUnavailable(f"cannot ensure the ClusterKopfPeering {name!r}: {e}") from e
