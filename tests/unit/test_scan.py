"""The static scan (scan/run.py, `make scan`) fails when it should: on a finding nothing
justifies, on a skip that matches nothing, on a set that scanned nothing, on a skip hidden
in a manifest's annotation, and on a chart whose render fails, warns or is empty. Real
checkov (its pinned venv, built once into the cache `make scan` uses: ~1 min cold) and
the project's helm; the scan of the real chart and operator objects is `make scan`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from weightcache.operator.manifests import daemonset_name

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


scan = _load("weightcache_scan_run", ROOT / "scan" / "run.py")


@pytest.fixture(scope="session")
def checkov() -> str:
    return scan.checkov_binary()


@pytest.fixture(scope="session")
def helm() -> tuple[str, str]:
    return scan.helm_and_kube_version()


def privileged_pod(name="bad", **annotations) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "t", "annotations": annotations},
            "spec": {"containers": [{"name": "c", "image": "busybox:1", "securityContext": {"privileged": True}}]}}


def skip(check, kind="Pod", name="bad", number=1, set_=None) -> "scan.Skip":
    return scan.Skip(number, [check] if isinstance(check, str) else list(check), [kind], name, set_,
                     "a reason long enough for the loader to take it")


@pytest.fixture(scope="module")
def bad_pod_scans(checkov, tmp_path_factory):
    """One checkov run on a privileged pod; each test judges it against its own skips."""
    return scan.run_scans([("operator", "t", [privileged_pod()])], checkov, tmp_path_factory.mktemp("bad"))


def judge(scans, skips):
    return scan.evaluate(scans, skips, expected_sets=("operator",))


def test_a_privileged_pod_fails_the_scan(bad_pod_scans):
    report = judge(bad_pod_scans, [])
    assert not report.ok
    failed = {(f.resource.kind, f.resource.name, f.check) for f in report.unskipped}
    assert ("Pod", "bad", "CKV_K8S_16") in failed  # privileged
    assert ("Pod", "bad", "CKV2_WC_1") not in failed  # no hostPath: the custom check ran and passed
    assert report.counts["operator"]["t"]["resources"] == 1


def test_skipping_all_but_one_finding_still_fails_on_that_one(bad_pod_scans):
    checks = {f.check for f in judge(bad_pod_scans, []).findings}
    report = judge(bad_pod_scans, [skip(sorted(checks - {"CKV_K8S_16"}))])
    assert [(f.resource.name, f.check) for f in report.unskipped] == [("bad", "CKV_K8S_16")]
    assert not report.ok and not report.stale
    # and with that one skipped too, the scan passes: the skips, not luck, decide
    assert judge(bad_pod_scans, [skip(sorted(checks))]).ok


def test_a_skip_that_matches_nothing_fails_the_scan(bad_pod_scans):
    checks = sorted({f.check for f in judge(bad_pod_scans, []).findings})
    stale = skip("CKV_K8S_16", name="gone-*", number=2)
    report = judge(bad_pod_scans, [skip(checks), stale])
    assert not report.unskipped and not report.ok
    assert [(s.number, c) for s, c in report.stale] == [(2, "CKV_K8S_16")]
    # one id of a list that no longer matches is stale on its own
    report = judge(bad_pod_scans, [skip(checks + ["CKV_K8S_18"])])
    assert [c for _, c in report.stale] == ["CKV_K8S_18"]


def test_a_skip_only_covers_its_own_set_and_kind(bad_pod_scans):
    checks = sorted({f.check for f in judge(bad_pod_scans, []).findings})
    assert len(judge(bad_pod_scans, [skip(checks, set_="chart")]).unskipped) == len(checks)
    assert len(judge(bad_pod_scans, [skip(checks, kind="Deployment")]).unskipped) == len(checks)


def test_a_set_with_nothing_scanned_fails(checkov, tmp_path):
    report = scan.scan_documents([("operator", "t", [])], [], checkov, expected_sets=("operator",))
    assert not report.ok and report.counts["operator"]["t"]["resources"] == 0
    assert any("0 resources scanned" in p for p in report.problems)
    # and a set that never ran at all fails the same way
    report = scan.evaluate([], [], expected_sets=("chart",))
    assert any("set 'chart': 0 resources scanned" in p for p in report.problems)


def test_a_skip_in_a_manifest_annotation_fails(checkov):
    pod = privileged_pod(**{"checkov.io/skip1": "CKV_K8S_16=hidden here"})
    report = scan.scan_documents([("operator", "t", [pod])], [], checkov, expected_sets=("operator",))
    assert any("CKV_K8S_16 through an annotation" in p for p in report.problems), report.problems
    assert not report.ok


def test_a_workload_without_check_results_fails():
    """checkov silently not checking a kind (as it silently skipped the chart) is a failure."""
    scans = [scan.Scan("operator", "t", {"000-Pod-x.yaml": scan.Resource("operator", "t", "Pod", "t", "x")},
                       {"results": {"passed_checks": [], "failed_checks": []}, "summary": {"resource_count": 1}})]
    report = scan.evaluate(scans, [], expected_sets=("operator",))
    assert any("Pod t/x got no check result" in p for p in report.problems)


def write_chart(root: Path, templates: dict[str, str], values: str = "") -> Path:
    root.mkdir()
    (root / "Chart.yaml").write_text("apiVersion: v2\nname: tiny\nversion: 0.1.0\n")
    (root / "values.yaml").write_text(values)
    (root / "templates").mkdir()
    for name, text in templates.items():
        (root / "templates" / name).write_text(text)
    return root


CONFIGMAP = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\ndata:\n  a: {{ .Values.a | toJson | quote }}\n"


def test_a_chart_that_renders_renders_at_the_given_kube_version(helm, tmp_path):
    binary, kube_version = helm
    assert kube_version.startswith("v1.")
    chart = write_chart(tmp_path / "ok", {"cm.yaml": CONFIGMAP.replace("{{ .Values.a | toJson | quote }}",
                                                                       "{{ .Capabilities.KubeVersion.Version }}")})
    (doc,) = scan.render_chart(binary, kube_version, [], chart)
    assert doc["data"]["a"] == kube_version


def test_a_chart_whose_render_fails_warns_or_is_empty_stops_the_scan(helm, tmp_path):
    binary, kube_version = helm
    failing = write_chart(tmp_path / "fail", {"cm.yaml": '{{ fail "the value x is required" }}'})
    with pytest.raises(scan.SetupError, match="the value x is required"):
        scan.render_chart(binary, kube_version, [], failing)
    # a warning on stderr with status 0: what made checkov drop the chart and pass
    warning = write_chart(tmp_path / "warn", {"cm.yaml": CONFIGMAP}, values="a: 1\n")
    with pytest.raises(scan.SetupError, match="warning: skipped value"):
        scan.render_chart(binary, kube_version, ["--set", "a.b=1"], warning)
    empty = write_chart(tmp_path / "empty", {"NOTES.txt": "nothing to install"})
    with pytest.raises(scan.SetupError, match="rendered no objects"):
        scan.render_chart(binary, kube_version, [], empty)


def test_the_skip_list_loads_and_refuses_entries_without_a_reason(tmp_path):
    skips = scan.load_skips()
    assert skips and all(s.reason for s in skips)
    bad = tmp_path / "skips.yaml"
    bad.write_text("- {check: CKV_K8S_16, kind: Pod, name: x, reason: ok}\n")
    with pytest.raises(scan.SetupError, match="the reason must say why"):
        scan.load_skips(bad)
    bad.write_text("- {check: CKV_K8S_16, kind: Pod, reason: a reason long enough for the loader to take it}\n")
    with pytest.raises(scan.SetupError, match="needs check, kind, name and reason"):
        scan.load_skips(bad)


def test_the_operator_objects_cover_every_backend_and_source():
    """scan/generated.py builds, through the operator's own builders, a daemon per cache
    and a mutated engine pod per cache (what `make scan` then checks)."""
    docs = scan.operator_documents()
    daemons = {d["metadata"]["name"]: d for d in docs if d["kind"] == "DaemonSet"}
    names = {daemonset_name("ml", n) for n in ("cpu", "gpu-vmm", "gpu-ipc", "gpu-store")}
    assert set(daemons) >= names | {daemonset_name("ml", "gpu-vmm") + "-b"}
    engines = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Pod"}
    assert {"baseline-engine", "engine-cpu", "engine-gpu-ipc", "engine-gpu-store", "engine-gpu-vmm-standby"} <= set(engines)
    # the mutated pods really are mutated: the agent sidecar is there, the baseline has none
    assert all(any(c["name"] == "weightcache-agent" for c in p["spec"].get("initContainers", []))
               for n, p in engines.items() if n != "baseline-engine")
    assert not engines["baseline-engine"]["spec"].get("initContainers")
