"""Pods talking to the API as their service account, and the API calling a pod's
admission webhook through its Service: what the operator and its webhook will need."""

from __future__ import annotations

import base64
import json

from cluster import wait_for
from cluster.pki import make_serving_cert
from cluster.testkit import TEST_IMAGE, apply, container, is_ready, pod, pod_ip_env, wait_pod

# Reads $KUBECONFIG (JSON, as the simulator writes it) and asks the API who it is.
WHOAMI = """
import json, os, ssl, urllib.request
kc = json.load(open(os.environ['KUBECONFIG']))
server = kc['clusters'][0]['cluster']['server']
ctx = ssl.create_default_context(cafile=kc['clusters'][0]['cluster']['certificate-authority'])
req = urllib.request.Request(server + '/apis/authentication.k8s.io/v1/selfsubjectreviews', method='POST',
    data=json.dumps({'apiVersion': 'authentication.k8s.io/v1', 'kind': 'SelfSubjectReview'}).encode(),
    headers={'Authorization': 'Bearer ' + kc['users'][0]['user']['token'], 'Content-Type': 'application/json'})
print('user=' + json.load(urllib.request.urlopen(req, context=ctx))['status']['userInfo']['username'], flush=True)
"""


def test_pod_reaches_the_api_as_its_service_account(cluster, namespace):
    apply(cluster, namespace, pod("whoami", [container("main", TEST_IMAGE, ["python", "-c", WHOAMI])],
                                  restartPolicy="Never"))
    wait_pod(cluster, namespace, "whoami", lambda p: p["status"].get("phase") in ("Succeeded", "Failed"), "done")
    out = cluster.pod_log(namespace, "whoami", "main").read_text()
    assert f"user=system:serviceaccount:{namespace}:default" in out, out


# Denies objects labelled deny=yes: an HTTPS AdmissionReview server on $POD_IP.
WEBHOOK = """
import json, os, ssl, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers['Content-Length'])))['request']
        allowed = ((req['object'].get('metadata') or {}).get('labels') or {}).get('deny') != 'yes'
        resp = {'uid': req['uid'], 'allowed': allowed}
        if not allowed:
            resp['status'] = {'code': 403, 'message': 'denied by the test webhook'}
        body = json.dumps({'apiVersion': 'admission.k8s.io/v1', 'kind': 'AdmissionReview', 'response': resp}).encode()
        self.send_response(200)
        self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
srv = HTTPServer((os.environ['POD_IP'], int(sys.argv[2])), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1] + '/tls.crt', sys.argv[1] + '/tls.key')
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
srv.serve_forever()
"""


def _webhook_config(name: str, namespace: str, ca: bytes) -> dict:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [{
            "name": "deny.weightcache.test", "admissionReviewVersions": ["v1"], "sideEffects": "None",
            "failurePolicy": "Fail", "timeoutSeconds": 5,
            "clientConfig": {"service": {"name": "hook", "namespace": namespace, "path": "/validate", "port": 443},
                             "caBundle": base64.b64encode(ca).decode()},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                       "resources": ["configmaps"]}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "objectSelector": {"matchExpressions": [{"key": "deny", "operator": "Exists"}]},
        }],
    }


def test_admission_webhook_is_called_through_its_service(cluster, namespace, tmp_path):
    certs = make_serving_cert(tmp_path, [f"hook.{namespace}.svc", f"hook.{namespace}.svc.cluster.local"])
    cluster.kubectl("create", "secret", "tls", "hook-tls", "-n", namespace,
                    f"--cert={certs.path('tls.crt')}", f"--key={certs.path('tls.key')}")
    c = container("hook", TEST_IMAGE, ["python", "-c", WEBHOOK, "/certs", "8443"], env=pod_ip_env(),
                  ports=[{"name": "https", "containerPort": 8443}],
                  volumeMounts=[{"name": "certs", "mountPath": "/certs", "readOnly": True}],
                  readinessProbe={"tcpSocket": {"port": 8443}, "periodSeconds": 1})
    apply(cluster, namespace, pod("hook", [c], volumes=[{"name": "certs", "secret": {"secretName": "hook-tls"}}]))
    apply(cluster, namespace, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "hook"},
                               "spec": {"selector": {"app": "hook"}, "ports": [{"port": 443, "targetPort": "https"}]}})
    wait_pod(cluster, namespace, "hook", is_ready, "ready", timeout=60)
    name = f"deny-{namespace}"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(_webhook_config(name, namespace, certs.ca_crt.read_bytes())))
    try:
        def denied():
            cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "bad", "labels": {"deny": "yes"}}}
            r = cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(cm), check=False)
            return r.returncode != 0 and "denied by the test webhook" in r.stderr and r.stderr
        # The proxy picks up the Service within a poll: retry until the webhook answers.
        wait_for(denied, 30, "the webhook to deny a labelled ConfigMap", interval=0.5)
        ok = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "good", "labels": {"deny": "no"}}}
        cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(ok))
    finally:
        cluster.kubectl("delete", "validatingwebhookconfiguration", name, check=False)
