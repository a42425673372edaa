"""The Helm chart against the real control plane: lint and template are clean, the values
schema refuses bad values naming the field, every rendered manifest passes the API
server's own dry run, the generated TLS material is a chain the API server would trust,
and a real `helm install` runs the operator, passes `helm test`, keeps its CA across an
upgrade, and - while no operator answers - refuses only the pods that opted in."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import tarfile
import tempfile
import threading
import uuid
from pathlib import Path

import pytest
import yaml

from cluster import testkit
from cluster.handle import wait_for

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "weightcache"
CRD_SOURCE = ROOT / "crds" / "weightcache.io_weightcaches.yaml"
# The test helm is built without helm's release ldflags, so `helm template` would assume
# Kubernetes 1.20 and refuse the chart's kubeVersion (>=1.29); install and upgrade ask
# the real API server.
KUBE_VERSION = "1.37.2"
CERT_MANAGER = ("--set", "webhook.tls.certManager.enabled=true")
VALUES = {"self-managed-tls": (), "cert-manager": CERT_MANAGER}
SYMLINK_NOTICE = "found symbolic link in path"  # helm's note that it followed crds/' link


def quiet(stderr: str) -> bool:
    """Nothing on stderr but helm's note about following the CRDs' symlinks."""
    return all(SYMLINK_NOTICE in line and ("weightcache.io_weightcaches.yaml" in line or
                                           "weightcache.io_weightcacheclasses.yaml" in line)
               for line in stderr.splitlines() if line.strip())


def template(cluster, *args, release="wc", namespace="weightcache-system", check=True):
    return cluster.helm("template", release, CHART, "--namespace", namespace, "--kube-version", KUBE_VERSION,
                        *args, check=check)


def render(cluster, *args, **kw) -> list[dict]:
    return [d for d in yaml.safe_load_all(template(cluster, *args, **kw).stdout) if d]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


# -- lint and template -------------------------------------------------------------------

@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
def test_lint_strict_is_clean(cluster, values):
    r = cluster.helm("lint", "--strict", CHART, *values)
    assert "1 chart(s) linted, 0 chart(s) failed" in r.stdout
    assert not [line for line in r.stdout.splitlines() if line.startswith(("[WARNING]", "[ERROR]"))], r.stdout
    assert quiet(r.stderr), r.stderr


@pytest.mark.parametrize("values, kinds", [
    ((), {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Namespace", "Service",
          "Deployment", "Secret", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
          "WeightCacheClass", "ClusterKopfPeering", "PodDisruptionBudget", "ConfigMap", "Pod", "Job",
          "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}),
    (CERT_MANAGER, {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Namespace",
                    "Service", "Deployment", "Issuer", "Certificate", "MutatingWebhookConfiguration",
                    "ValidatingWebhookConfiguration", "WeightCacheClass", "ClusterKopfPeering",
                    "PodDisruptionBudget", "ConfigMap", "Pod", "Job", "ValidatingAdmissionPolicy",
                    "ValidatingAdmissionPolicyBinding"}),
], ids=VALUES.keys())
def test_template_is_clean_and_renders_every_part(cluster, values, kinds):
    r = template(cluster, *values)
    assert quiet(r.stderr), r.stderr
    assert {d["kind"] for d in yaml.safe_load_all(r.stdout) if d} == kinds


def test_the_operator_runs_the_contract_command(cluster):
    dep = one(render(cluster, release="rel"), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] + c["args"] == [
        "weightcache", "operator", "--webhook-bind", "$(POD_IP):8443",
        "--tls-cert", "/etc/weightcache/tls/tls.crt", "--tls-key", "/etc/weightcache/tls/tls.key",
        "--health-bind", "$(POD_IP):8080", "--peering", "rel",
        "--daemon-image", "weightcache-daemon:0.1.0", "--agent-image", "weightcache-engine:0.1.0",
        "--daemon-namespace", "rel-daemons"]
    assert dep["spec"]["replicas"] == 2
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


def test_watched_namespaces_and_images_reach_the_command_line(cluster):
    docs = render(cluster, "--set", "operator.watchNamespaces={llm,batch}", "--set", "image.registry=ghcr.io/acme",
                  "--set", "image.tag=1.2.3", "--set-string", "operator.agentImage.tag=9", "--set", "operator.peering=wcp",
                  release="rel")
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[1:5] == ["--namespace", "llm", "--namespace", "batch"]
    assert args[args.index("--daemon-image") + 1] == "ghcr.io/acme/weightcache-daemon:1.2.3"
    assert args[args.index("--agent-image") + 1] == "ghcr.io/acme/weightcache-engine:9"
    assert args[args.index("--peering") + 1] == "wcp"
    # kopf patches the peering object but does not create it; the operator peers
    # cluster-wide also when it serves a few namespaces.
    assert one(docs, "ClusterKopfPeering")["metadata"]["name"] == "wcp"
    assert not [d for d in docs if d["kind"] == "KopfPeering"]


def test_the_webhook_selects_only_labelled_pods_outside_the_release_namespace(cluster):
    docs = render(cluster, release="rel", namespace="wc-sys")
    (hook,) = one(docs, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["clientConfig"]["service"] == {"name": "rel-webhook", "namespace": "wc-sys", "path": "/mutate-pods",
                                               "port": 8443}
    assert hook["objectSelector"] == {"matchExpressions": [
        {"key": "weightcache.io/cache", "operator": "Exists"},
        {"key": "app.kubernetes.io/name", "operator": "NotIn", "values": ["weightcache-daemon"]}]}
    assert hook["reinvocationPolicy"] == "IfNeeded"
    assert hook["namespaceSelector"] == {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["wc-sys", "rel-daemons", "kube-system"]}]}
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                              "resources": ["pods"], "scope": "Namespaced"}]
    assert (hook["failurePolicy"], hook["sideEffects"], hook["timeoutSeconds"]) == ("Fail", "None", 10)
    svc = one(docs, "Service", "rel-webhook")
    assert svc["spec"]["ports"] == [{"name": "webhook", "port": 8443, "targetPort": "webhook", "protocol": "TCP"}]
    ignore = render(cluster, "--set", "webhook.failurePolicy=Ignore", "--set-json", "webhook.excludeNamespaces=[]",
                    release="rel", namespace="wc-sys")
    (hook,) = one(ignore, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["failurePolicy"] == "Ignore"
    assert hook["namespaceSelector"]["matchExpressions"][0]["values"] == ["wc-sys", "rel-daemons"]  # its own, always


def test_cert_manager_mode_injects_the_ca_instead_of_generating_it(cluster):
    docs = render(cluster, *CERT_MANAGER, release="rel", namespace="wc-sys")
    mwc = one(docs, "MutatingWebhookConfiguration")
    assert mwc["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": "wc-sys/rel-webhook"}
    assert "caBundle" not in mwc["webhooks"][0]["clientConfig"]
    assert not [d for d in docs if d["kind"] == "Secret"]
    cert = one(docs, "Certificate", "rel-webhook")["spec"]
    assert cert["secretName"] == "rel-webhook-tls"  # the Secret the Deployment mounts
    assert "rel-webhook.wc-sys.svc" in cert["dnsNames"]
    assert cert["issuerRef"] == {"name": "rel-ca", "kind": "Issuer", "group": "cert-manager.io"}
    own = render(cluster, *CERT_MANAGER, "--set", "webhook.tls.certManager.issuerRef.name=corp",
                 "--set", "webhook.tls.certManager.issuerRef.kind=ClusterIssuer", release="rel", namespace="wc-sys")
    assert one(own, "Certificate")["spec"]["issuerRef"] == {"name": "corp", "kind": "ClusterIssuer",
                                                             "group": "cert-manager.io"}
    assert not [d for d in own if d["kind"] == "Issuer"]


# -- the values schema -------------------------------------------------------------------

@pytest.mark.parametrize("setting, needle", [
    ("webhook.failurePolicy=Maybe", "at '/webhook/failurePolicy': value must be one of 'Fail', 'Ignore'"),
    ("operator.replicas=0", "at '/operator/replicas': minimum: got 0, want 1"),
    ("webhook.timeoutSeconds=31", "at '/webhook/timeoutSeconds': maximum: got 31, want 30"),
    ("webhook.port=443", "at '/webhook/port'"),
    ("webhook.tls.certManager.enabled=yes", "at '/webhook/tls/certManager/enabled': got string, want boolean"),
    ("operator.image.repository=", "at '/operator/image/repository'"),
    ("operator.watchNamespaces[0]=Bad_NS", "at '/operator/watchNamespaces/0'"),
    ("webhook.tls.certManager.issuerRef.kind=Foo", "at '/webhook/tls/certManager/issuerRef/kind'"),
    ("webhook.tls.validityDays=1", "at '/webhook/tls/validityDays'"),
    ("image.pullPolicy=Sometimes", "at '/image/pullPolicy'"),
    # Tags are strings: a number from a values file or --set (1.10 read as 1.1) is refused.
    ("operator.image.tag=110", "at '/operator/image/tag': got number, want string"),
    ("replicas=2", "additional properties 'replicas' not allowed"),
    ("operator.replica=2", "at '/operator': additional properties 'replica' not allowed"),
])
def test_bad_values_are_refused_naming_the_field(cluster, setting, needle):
    r = template(cluster, "--set", setting, check=False)
    assert r.returncode != 0
    assert "values don't meet the specifications of the schema" in r.stderr and needle in r.stderr, r.stderr


def test_an_existing_service_account_must_be_named(cluster):
    r = template(cluster, "--set", "serviceAccount.create=false", check=False)
    assert r.returncode != 0 and "serviceAccount.name: set it to an existing ServiceAccount" in r.stderr, r.stderr
    docs = render(cluster, "--set", "serviceAccount.create=false", "--set", "serviceAccount.name=ops", release="rel")
    assert not [d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "ops"]
    assert one(docs, "ClusterRoleBinding", "rel-operator")["subjects"][0]["name"] == "ops"


# -- the API server's own checks -----------------------------------------------------------

@pytest.fixture(scope="module")
def chart_crds(cluster):
    """The chart's CRDs, applied for real: custom resources in a dry run need their CRD."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    for crd in ("weightcaches.weightcache.io", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"):
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=30s")
    return cluster


@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
def test_every_rendered_manifest_passes_server_side_dry_run(chart_crds, namespace, values):
    cluster = chart_crds
    docs = render(cluster, *values, release=f"dry-{uuid.uuid4().hex[:6]}", namespace=namespace)
    # cert-manager is not installed in the test cluster: its kinds cannot be dry-run here.
    unknown = [d for d in docs if d["apiVersion"].startswith("cert-manager.io/")]
    assert {d["kind"] for d in unknown} == ({"Issuer", "Certificate"} if values else set())
    checked = [d for d in docs if d not in unknown]
    # Admission looks up a pod's ServiceAccount, which a dry run of the same batch has not created.
    for sa in (d for d in checked if d["kind"] == "ServiceAccount"):
        testkit.apply(cluster, namespace, sa)
    # The daemons' namespace, which a dry run does not create either, holds the Role.
    (daemons_ns,) = [d["metadata"]["name"] for d in checked if d["kind"] == "Namespace"]
    cluster.create_namespace(daemons_ns)
    try:
        for ns in (namespace, daemons_ns):
            batch = [d for d in checked if (d["metadata"].get("namespace") or namespace) == ns]
            out = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-n", ns, "-f", "-",
                                  input="\n---\n".join(json.dumps(d) for d in batch)).stdout
            assert out.count("(server dry run)") == len(batch), out
        assert {d["kind"] for d in checked if d["metadata"].get("namespace") == daemons_ns} == {"Role", "RoleBinding"}
    finally:
        cluster.kubectl("delete", "namespace", daemons_ns, "--wait=false", check=False)


def test_self_managed_tls_is_a_chain_the_api_server_would_trust(cluster):
    docs = render(cluster, release="rel", namespace="wc-sys")
    secret = one(docs, "Secret", "rel-webhook-tls")["data"]
    bundle = one(docs, "MutatingWebhookConfiguration")["webhooks"][0]["clientConfig"]["caBundle"]
    assert bundle == secret["ca.crt"]
    with tempfile.TemporaryDirectory() as tmp:
        crt, key = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
        crt.write_bytes(base64.b64decode(secret["tls.crt"]))
        key.write_bytes(base64.b64decode(secret["tls.key"]))
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(crt, key)
    client = ssl.create_default_context(cadata=base64.b64decode(bundle).decode())
    # The name the API server checks is the Service's: <service>.<namespace>.svc.
    assert handshake(server, client, "rel-webhook.wc-sys.svc") is None
    assert "Hostname mismatch" in handshake(server, client, "rel-webhook.elsewhere.svc")
    # Another render generates another CA: it must not trust this certificate.
    other_ca = one(render(cluster, release="rel", namespace="wc-sys"), "Secret")["data"]["ca.crt"]
    assert other_ca != bundle
    stranger = ssl.create_default_context(cadata=base64.b64decode(other_ca).decode())
    assert "certificate verify failed" in handshake(server, stranger, "rel-webhook.wc-sys.svc")


def handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, name: str) -> str | None:
    """A TLS handshake over a loopback socket pair: None, or the client's error."""
    a, b = socket.socketpair()
    errors: list[str] = []

    def serve():
        try:
            with server_ctx.wrap_socket(a, server_side=True) as s:
                s.recv(1)
        except (ssl.SSLError, OSError):
            pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with client_ctx.wrap_socket(b, server_hostname=name) as c:
            c.sendall(b"x")
    except ssl.SSLError as e:
        errors.append(str(e))
    finally:
        a.close()
        t.join(10)
    return errors[0] if errors else None


def test_the_packaged_chart_carries_the_crd_itself(cluster, tmp_path):
    cluster.helm("package", CHART, "--destination", tmp_path)
    (tgz,) = tmp_path.glob("weightcache-*.tgz")
    with tarfile.open(tgz) as tar:
        member = tar.getmember("weightcache/crds/weightcache.io_weightcaches.yaml")
        assert member.isfile()  # the content, not a link out of the chart
        assert tar.extractfile(member).read() == CRD_SOURCE.read_bytes()


# -- a real install ------------------------------------------------------------------------

class Release:
    def __init__(self, cluster, name: str, namespace: str) -> None:
        self.cluster, self.name, self.namespace = cluster, name, namespace

    def pods(self) -> list[dict]:
        return testkit.pods(self.cluster, self.namespace,
                            f"app.kubernetes.io/instance={self.name},app.kubernetes.io/component=operator")

    def logs(self) -> str:
        out = []
        for p in self.pods():
            path = self.cluster.pod_log(self.namespace, p["metadata"]["name"], "operator")
            tail = path.read_text()[-3000:] if path.exists() else "(no log)"
            out.append(f"--- {p['metadata']['name']} {p.get('status', {}).get('phase')}:\n{tail}")
        return "\n".join(out)

    def wait_operator_ready(self, timeout: float = 180) -> None:
        try:
            wait_for(lambda: (self.cluster.kubectl_json("get", "deployment", f"{self.name}-operator", "-n",
                                                        self.namespace).get("status", {}).get("readyReplicas") == 2),
                     timeout, f"both replicas of {self.name}-operator to be Ready")
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{self.logs()}") from None


@pytest.fixture(scope="module")
def release(cluster):
    """The chart installed into a fresh namespace whose Pod Security level is
    `restricted`: the operator's pods (and the test pod) must meet it to exist at all."""
    name, namespace = f"wc-{uuid.uuid4().hex[:6]}", f"wc-system-{uuid.uuid4().hex[:5]}"
    cluster.create_namespace(namespace, pod_security="restricted")
    cluster.helm("install", name, CHART, "--namespace", namespace, timeout=180)
    yield Release(cluster, name, namespace)
    cluster.helm("uninstall", name, "--namespace", namespace, "--wait", "--timeout", "120s", check=False, timeout=180)
    for ns in (namespace, f"{name}-daemons"):  # helm keeps the daemons' namespace (resource-policy: keep)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_install_establishes_the_crds_and_creates_the_peering(release):
    c = release.cluster
    for crd in ("weightcaches.weightcache.io", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"):
        c.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=30s")
    c.kubectl("get", "clusterkopfpeering", release.name)
    installed = c.kubectl_json("get", "crd", "weightcaches.weightcache.io")
    source = yaml.safe_load(CRD_SOURCE.read_text())
    assert installed["spec"]["versions"][0]["schema"] == source["spec"]["versions"][0]["schema"]


def test_the_operator_replicas_start_and_become_ready(release):
    release.wait_operator_ready()
    pods = release.pods()
    assert len(pods) == 2 and all(testkit.is_ready(p) for p in pods)
    sa = pods[0]["spec"]["serviceAccountName"]
    assert sa == f"{release.name}-operator"


@pytest.mark.parametrize("verb, resource, allowed", [
    ("patch", "weightcaches.weightcache.io", True), ("patch", "weightcaches.weightcache.io/status", True),
    ("watch", "daemonsets.apps", True), ("watch", "pods", True),
    ("patch", "nodes", True), ("create", "events", True), ("patch", "clusterkopfpeerings.kopf.dev", True),
    ("watch", "customresourcedefinitions.apiextensions.k8s.io", True), ("watch", "namespaces", True),
    # Hot standby: it creates, promotes (patch) and deletes standby pods, and reads the
    # Deployments and ReplicaSets they come from.
    ("create", "pods", True), ("patch", "pods", True), ("delete", "pods", True), ("watch", "deployments.apps", True),
    ("list", "replicasets.apps", True),
    # ... and nothing more: it never needs to read secrets, write workloads, or remove what
    # it does not own.
    ("update", "pods", False), ("delete", "deployments.apps", False), ("delete", "replicasets.apps", False),
    ("get", "secrets", False), ("list", "secrets", False),
    ("delete", "nodes", False), ("delete", "weightcaches.weightcache.io", False),
    ("create", "weightcaches.weightcache.io", False), ("update", "weightcaches.weightcache.io/status", False),
    ("update", "customresourcedefinitions.apiextensions.k8s.io", False), ("create", "deployments.apps", False),
    ("patch", "mutatingwebhookconfigurations.admissionregistration.k8s.io", False), ("delete", "events", False),
    # DaemonSets are written only in the daemons' namespace (below), never elsewhere; no
    # owner reference crosses namespaces, so no finalizer rights on the caches.
    ("create", "daemonsets.apps", False), ("update", "daemonsets.apps", False), ("delete", "daemonsets.apps", False),
    ("update", "weightcaches.weightcache.io/finalizers", False), ("list", "events", False),
])
def test_the_operator_may_do_its_job_and_nothing_more(release, verb, resource, allowed):
    who = f"system:serviceaccount:{release.namespace}:{release.name}-operator"
    resource, _, sub = resource.partition("/")
    r = release.cluster.kubectl("auth", "can-i", verb, resource, *(["--subresource", sub] if sub else []),
                                "--as", who, "--all-namespaces", check=False)
    assert r.stdout.strip() == ("yes" if allowed else "no"), (verb, resource, r.stdout, r.stderr)


@pytest.mark.parametrize("verb, resource, allowed", [
    ("create", "daemonsets.apps", True), ("update", "daemonsets.apps", True), ("patch", "daemonsets.apps", True),
    ("delete", "daemonsets.apps", True), ("list", "controllerrevisions.apps", True), ("list", "events", True),
    ("create", "deployments.apps", False), ("get", "secrets", False), ("create", "roles.rbac.authorization.k8s.io", False),
])
def test_in_the_daemons_namespace_it_may_run_the_daemons_and_nothing_more(release, verb, resource, allowed):
    who = f"system:serviceaccount:{release.namespace}:{release.name}-operator"
    r = release.cluster.kubectl("auth", "can-i", verb, resource, "--as", who, "-n", f"{release.name}-daemons",
                                check=False)
    assert r.stdout.strip() == ("yes" if allowed else "no"), (verb, resource, r.stdout, r.stderr)


def _as_operator(release, *args, input=None):
    who = f"system:serviceaccount:{release.namespace}:{release.name}-operator"
    return release.cluster.kubectl(*args, "--as", who, "--dry-run=server", input=input, check=False)


def _pod(name: str, labels: dict) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
                       "spec": {"containers": [{"name": "c", "image": "attacker.example/any:1"}]}})


def test_the_operator_may_create_only_standby_pods_and_touch_only_its_node_labels(release, namespace):
    """What RBAC cannot narrow, the chart's ValidatingAdmissionPolicy does: the API server
    refuses the operator's ServiceAccount any pod that is not a hot standby, any pod in
    kube-system, and any change of a node but its cache.weightcache.io/* labels."""
    r = _as_operator(release, "create", "-n", namespace, "-f", "-", input=_pod("any", {"app": "x"}))
    assert r.returncode != 0 and "only hot-standby pods" in r.stderr, r.stderr
    r = _as_operator(release, "create", "-n", "kube-system", "-f", "-",
                     input=_pod("sb", {"weightcache.io/role": "standby"}))
    assert r.returncode != 0 and "no pods in kube-system" in r.stderr, r.stderr
    r = _as_operator(release, "create", "-n", namespace, "-f", "-", input=_pod("sb", {"weightcache.io/role": "standby"}))
    assert r.returncode == 0, r.stderr  # a standby: allowed (dry run)
    node = release.cluster.nodes[0]
    r = _as_operator(release, "label", "node", node, "team=attacker")
    assert r.returncode != 0 and "only a node's labels cache.weightcache.io/*" in r.stderr, r.stderr
    r = _as_operator(release, "taint", "node", node, "x=y:NoSchedule")
    assert r.returncode != 0 and "nothing else of it" in r.stderr, r.stderr
    r = _as_operator(release, "label", "node", node, "cache.weightcache.io/0123456789=ready")
    assert r.returncode == 0, r.stderr


def test_helm_test_passes(release):
    release.wait_operator_ready()
    r = release.cluster.helm("test", release.name, "--namespace", release.namespace, "--timeout", "150s",
                             check=False, timeout=200)
    log = release.cluster.pod_log(release.namespace, f"{release.name}-test", "check")
    detail = log.read_text() if log.exists() else "(no test pod log)"
    assert r.returncode == 0, f"{r.stdout}{r.stderr}\n{detail}"
    assert "Phase:          Succeeded" in r.stdout
    checks = [json.loads(line) for line in detail.splitlines() if line.startswith("{")]
    assert [c["check"] for c in checks if c["ok"]] == [
        "crd weightcaches.weightcache.io", "crd clusterkopfpeerings.kopf.dev", "crd kopfpeerings.kopf.dev",
        f"clusterkopfpeering {release.name}", "webhook pods.weightcache.io"], detail


def test_an_upgrade_keeps_the_webhook_certificate(release):
    c = release.cluster

    def tls_state():
        secret = c.kubectl_json("get", "secret", f"{release.name}-webhook-tls", "-n", release.namespace)["data"]
        bundle = c.kubectl_json("get", "mutatingwebhookconfiguration", release.name)["webhooks"][0]["clientConfig"]
        dep = c.kubectl_json("get", "deployment", f"{release.name}-operator", "-n", release.namespace)
        return secret, bundle["caBundle"], dep["spec"]["template"]["metadata"]["annotations"]["checksum/webhook-tls"]

    before = tls_state()
    assert before[0]["ca.crt"] == before[1]
    c.helm("upgrade", release.name, CHART, "--namespace", release.namespace, "--reuse-values",
           "--set", "webhook.timeoutSeconds=12", timeout=180)
    after = tls_state()
    assert after == before  # same CA, same serving certificate, no needless rollout
    assert c.kubectl_json("get", "mutatingwebhookconfiguration", release.name)["webhooks"][0]["timeoutSeconds"] == 12


def test_while_no_operator_answers_only_labelled_pods_are_refused(release, namespace):
    """failurePolicy Fail, scoped by the label: with the operator scaled to zero, a pod
    that opted in is refused naming the webhook; an unlabelled pod, or one in the
    release's own namespace, is admitted as usual."""
    c = release.cluster
    c.kubectl("scale", "deployment", f"{release.name}-operator", "-n", release.namespace, "--replicas=0")
    try:
        wait_for(lambda: not release.pods(), 60, "the operator pods to be gone")

        def create(ns, labels):
            manifest = testkit.pod("probe", [testkit.container("main", testkit.SIMULATED_IMAGE,
                                                               securityContext=RESTRICTED)])
            manifest["metadata"]["labels"].update(labels)
            manifest["spec"]["securityContext"] = {"runAsNonRoot": True, "runAsUser": 1000,
                                                   "seccompProfile": {"type": "RuntimeDefault"}}
            return c.kubectl("create", "--dry-run=server", "-n", ns, "-f", "-", input=json.dumps(manifest),
                             check=False)

        refused = create(namespace, {"weightcache.io/cache": "minilm"})
        assert refused.returncode != 0
        assert 'failed calling webhook "pods.weightcache.io"' in refused.stderr, refused.stderr
        assert create(namespace, {}).returncode == 0
        own = create(release.namespace, {"weightcache.io/cache": "minilm"})
        assert own.returncode == 0, own.stderr
    finally:
        c.kubectl("scale", "deployment", f"{release.name}-operator", "-n", release.namespace, "--replicas=2")


RESTRICTED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
