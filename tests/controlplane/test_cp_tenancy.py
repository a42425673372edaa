"""Multi-tenant safety (issue 13) as an attacker tries it: a tenant ServiceAccount that
may only create WeightCaches in its namespace (`kubectl --as`) asks for every escalation
a cache once gave - its own daemon image, env, priority, tolerations, host paths of
`/`, `/etc`, `/var/lib/kubelet`, host IPC - and each is refused by field and rule; its
legitimate cache becomes Ready with the daemons in the chart's namespace and nothing in
its own. The admin's side: a class that cannot create its pods makes the cache
Degraded with the reason; a DaemonSet whose cache is gone is removed; `helm uninstall`
deletes the caches first and leaves none Terminating.

The chart is installed as a user would (its default class, model root
/var/lib/weightcache/models); the tenant's namespace is Pod Security `baseline`, which
admits no daemon: none runs there.
"""

from __future__ import annotations

import json
import shutil
import uuid

import pytest

from cluster import wait_for
from cluster.testkit import condition, ready_now, wait_object
from weightcache.demo import packaged_model_dir
from weightcache.operator.manifests import daemonset_name

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "weightcache"
MODEL = "/var/lib/weightcache/models/all-MiniLM-L6-v2"  # inside the chart's default model root

pytestmark = pytest.mark.timeout(900)


class Tenancy:
    def __init__(self, cluster, release: str, release_ns: str, tenant_ns: str) -> None:
        self.cluster, self.release, self.release_ns, self.ns = cluster, release, release_ns, tenant_ns
        self.daemons_ns = f"{release}-daemons"
        self.tenant = f"system:serviceaccount:{tenant_ns}:tenant"

    def as_tenant(self, *args, **kw):
        return self.cluster.kubectl(*args, "-n", self.ns, "--as", self.tenant, **kw)

    def apply_as_tenant(self, manifest: dict):
        return self.as_tenant("apply", "-f", "-", input=json.dumps(manifest), check=False)

    def wc(self, name: str) -> dict | None:
        r = self.cluster.kubectl("get", "wc", name, "-n", self.ns, "-o", "json", check=False)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def wait_wc(self, name: str, check, what: str, timeout: float = 300) -> dict:
        return wait_object(lambda: self.wc(name), check, f"WeightCache {self.ns}/{name} {what}", timeout)

    def daemonsets(self, name: str) -> list[dict]:
        return self.cluster.kubectl_json("get", "ds", "-n", self.daemons_ns, "-l",
                                         f"weightcache.io/cache={name},weightcache.io/cache-namespace={self.ns}"
                                         )["items"]


def cache(name: str, **spec) -> dict:
    return {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCache", "metadata": {"name": name},
            "spec": {"model": {"path": MODEL}, "backend": "cpu", **spec}}


@pytest.fixture(scope="module")
def t(cluster):
    tag = uuid.uuid4().hex[:4]
    release, release_ns, ns = f"tn{tag}", f"tns-{tag}", f"tenant-{tag}"
    for node in cluster.nodes:
        shutil.copytree(packaged_model_dir(), cluster.node_root(node) / MODEL.lstrip("/"), dirs_exist_ok=True)
    cluster.create_namespace(ns, pod_security="baseline")
    cluster.create_namespace(release_ns, pod_security="restricted")
    tn = Tenancy(cluster, release, release_ns, ns)
    try:
        cluster.helm("install", release, CHART, "--namespace", release_ns, "--set", "operator.replicas=1",
                     timeout=240)
        cluster.kubectl("rollout", "status", f"deployment/{release}-operator", "-n", release_ns, "--timeout=300s",
                        timeout=330)
        # The tenant: WeightCaches in its own namespace, nothing else (no pods, no DaemonSets).
        cluster.kubectl("create", "serviceaccount", "tenant", "-n", ns)
        cluster.kubectl("create", "role", "caches", "-n", ns, "--verb=get,list,watch,create,update,patch,delete",
                        "--resource=weightcaches.weightcache.io")
        cluster.kubectl("create", "rolebinding", "caches", "-n", ns, "--role=caches", f"--serviceaccount={ns}:tenant")
        yield tn
    finally:
        for item in (cluster.kubectl_json("get", "wc", "-n", ns).get("items") or []):
            name = item["metadata"]["name"]
            cluster.kubectl("annotate", "wc", name, "-n", ns, "weightcache.io/force-delete=true", "--overwrite",
                            check=False)
            cluster.kubectl("delete", "wc", name, "-n", ns, "--timeout=120s", check=False, timeout=150)
        cluster.kubectl("delete", "wcc", f"{release}-broken", "--ignore-not-found", check=False)
        cluster.helm("uninstall", release, "--namespace", release_ns, "--wait", "--timeout", "120s",
                     check=False, timeout=180)
        for name in (ns, release_ns, tn.daemons_ns):
            cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


def test_1_the_tenant_may_create_caches_and_nothing_else(t):
    for verb, resource, allowed in [("create", "weightcaches.weightcache.io", "yes"), ("create", "pods", "no"),
                                    ("create", "daemonsets.apps", "no"), ("create", "weightcacheclasses.weightcache.io", "no")]:
        r = t.as_tenant("auth", "can-i", verb, resource, check=False)
        assert r.stdout.strip() == allowed, (verb, resource, r.stdout, r.stderr)


@pytest.mark.parametrize("spec, says", [
    ({"daemon": {"image": "attacker.example/evil:1"}},
     "spec.daemon: the daemons' image, env, resources and priority are the cluster admin's"),
    ({"daemon": {"env": [{"name": "LD_PRELOAD", "value": "/tmp/x.so"}]}}, "spec.daemon: the daemons' image"),
    ({"daemon": {"priorityClassName": "system-node-critical"}}, "spec.daemon: the daemons' image"),
    ({"placement": {"tolerations": [{"operator": "Exists"}]}},
     "spec.placement.tolerations: which taints the daemons tolerate is the cluster admin's"),
    ({"model": {"path": "/"}}, "spec.model.path: '/' is outside the model roots of WeightCacheClass"),
    ({"model": {"path": "/etc"}}, "spec.model.path: '/etc' is outside the model roots"),
    ({"model": {"path": "/var/lib/kubelet"}}, "spec.model.path: '/var/lib/kubelet' is outside the model roots"),
    ({"model": {"path": "/var/lib/weightcache/models2"}}, "spec.model.path: '/var/lib/weightcache/models2' is outside"),
    ({"model": {"path": MODEL, "volume": {"hostPath": {"path": "/etc"}}}},
     "spec.model.volume.hostPath.path: '/etc' is outside the model roots"),
    ({"model": {"path": "/m", "volume": {"persistentVolumeClaim": {"claimName": "models"}}}},
     "spec.model.volume.persistentVolumeClaim: the daemons run in the operator's namespace"),
    ({"backend": "cuda-ipc", "allowHostIPC": True}, "spec.backend: 'cuda-ipc' is not allowed by WeightCacheClass"),
    ({"className": "platinum"}, "spec.className: WeightCacheClass 'platinum' does not exist"),
], ids=["image", "env", "priority", "tolerations", "root", "etc", "kubelet", "sibling-root", "volume-etc", "pvc",
        "host-ipc", "no-class"])
def test_2_each_escalation_is_refused_naming_the_field_and_the_rule(t, spec, says):
    manifest = cache("evil")
    manifest["spec"].update(spec)
    r = t.apply_as_tenant(manifest)
    assert r.returncode != 0 and says in r.stderr, r.stderr
    assert t.wc("evil") is None and t.daemonsets("evil") == []


def test_3_a_change_to_an_escalation_is_refused_too(t):
    assert t.apply_as_tenant(cache("edit")).returncode == 0
    bad = cache("edit", model={"path": "/etc"})
    r = t.apply_as_tenant(bad)
    assert r.returncode != 0 and "spec.model.path: '/etc' is outside" in r.stderr, r.stderr
    assert t.wc("edit")["spec"]["model"]["path"] == MODEL  # the admitted spec stands
    t.as_tenant("delete", "wc", "edit", "--timeout=120s", timeout=150)


def test_4_the_legitimate_cache_is_ready_with_its_daemons_in_the_admin_s_namespace(t):
    c = t.cluster
    assert t.apply_as_tenant(cache("mini")).returncode == 0
    wc = t.wait_wc("mini", ready_now, "Ready on every node")
    n = len(c.nodes)
    assert wc["status"]["readyNodes"] == f"{n}/{n}", wc["status"]
    (ds,) = t.daemonsets("mini")
    assert ds["metadata"]["name"] == daemonset_name(t.ns, "mini") and ds["metadata"]["namespace"] == t.daemons_ns
    pod = ds["spec"]["template"]["spec"]
    (daemon,) = pod["containers"]
    assert daemon["securityContext"]["privileged"] is False and "hostIPC" not in pod
    assert daemon["image"].startswith("weightcache-daemon:")  # the operator's, not anyone's choice
    # The tenant's namespace (baseline) holds nothing of the cache's.
    assert c.kubectl_json("get", "pods,ds", "-n", t.ns)["items"] == []
    t.as_tenant("delete", "wc", "mini", "--timeout=120s", timeout=150)
    wait_for(lambda: t.daemonsets("mini") == [], 120, "the DaemonSet deleted with its cache")


def test_5_pods_that_cannot_be_created_make_the_cache_degraded_with_the_reason(t):
    c = t.cluster
    broken = f"{t.release}-broken"
    klass = {"apiVersion": "weightcache.io/v1alpha1", "kind": "WeightCacheClass", "metadata": {"name": broken},
             "spec": {"modelRoots": ["/var/lib/weightcache/models"], "backends": ["cpu"],
                      "daemon": {"priorityClassName": "no-such-priority"}}}
    c.kubectl("apply", "-f", "-", input=json.dumps(klass))
    assert t.apply_as_tenant(cache("prio", className=broken)).returncode == 0
    wc = t.wait_wc("prio", lambda o: condition(o, "Degraded").get("reason") == "DaemonPodsRefused",
                   "Degraded because its daemon pods are refused", timeout=120)
    message = condition(wc, "Degraded")["message"]
    assert "cannot create its pods" in message and "no-such-priority" in message, message
    assert condition(wc, "Ready")["status"] != "True"


def test_6_a_daemonset_whose_cache_is_gone_is_removed(t):
    c = t.cluster
    labels = {"app.kubernetes.io/name": "weightcache-daemon", "weightcache.io/cache": "ghost",
              "weightcache.io/cache-namespace": t.ns}
    orphan = {"apiVersion": "apps/v1", "kind": "DaemonSet",
              "metadata": {"name": "wc-ghost-orphan", "namespace": t.daemons_ns,
                           "labels": {**labels, "weightcache.io/cache-uid": "gone"}},
              "spec": {"selector": {"matchLabels": labels},
                       "template": {"metadata": {"labels": labels},
                                    "spec": {"nodeSelector": {"no-such-node": "x"},
                                             "containers": [{"name": "daemon", "image": "registry.k8s.io/pause:3.10"}]}}}}
    c.kubectl("apply", "-f", "-", input=json.dumps(orphan))
    wait_for(lambda: c.kubectl("get", "ds", "wc-ghost-orphan", "-n", t.daemons_ns, check=False).returncode != 0,
             60, "the orphan DaemonSet deleted by the operator")


def test_7_helm_uninstall_deletes_the_caches_first_and_leaves_none_terminating(t):
    c = t.cluster
    assert t.apply_as_tenant(cache("last")).returncode == 0
    t.wait_wc("last", ready_now, "Ready before the uninstall")
    r = c.helm("uninstall", t.release, "--namespace", t.release_ns, "--wait", "--timeout", "300s", timeout=360)
    assert r.returncode == 0, r.stderr
    # The pre-delete Job deleted every cache while the operator still ran their finalizers.
    assert c.kubectl_json("get", "wc", "-n", t.ns)["items"] == []
    assert c.kubectl_json("get", "ds", "-n", t.daemons_ns)["items"] == []
    assert c.kubectl_json("get", "validatingwebhookconfigurations,mutatingwebhookconfigurations", "-l",
                          f"app.kubernetes.io/instance={t.release}")["items"] == []
