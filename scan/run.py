"""`make scan`: checkov on what this project puts in a cluster, failing on every finding
that scan/skips.yaml does not justify. README.md beside this file says what is scanned,
how to run it and how to add a skip.

Two sets, each rendered to plain YAML files (one object a file) in a temporary folder:
- chart: `helm template` of charts/weightcache with an explicit --kube-version (the test
  control plane's), once per values variant in CHART_VARIANTS; helm failing, writing
  anything to stderr but a known notice, or rendering nothing stops the scan;
- operator: what the operator generates for representative caches, from its pure
  builders (scan/generated.py): daemon DaemonSets, mutated engine pods, a hot standby.

Each folder is one checkov run (`--framework kubernetes`, JSON, the custom checks in
checks/), in a clean environment (checkov reads CKV_* variables and a .checkov.yaml from
its working folder, either of which could skip checks unseen). The scan fails on a
finding no skip entry matches, on a skip entry (check id) that matched nothing, on a set
in which nothing was checked, on a workload object that got no check result, on
checkov's own parsing errors, and on a check skipped by an annotation in a manifest
(`checkov.io/skip*`): skips live in skips.yaml, with their reasons, or nowhere.

Exit status: 0 clean, 1 findings or problems (listed), 2 the scan could not run.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CHART = ROOT / "charts" / "weightcache"
SKIPS = HERE / "skips.yaml"
CHECKS = HERE / "checks"
RELEASE, RELEASE_NAMESPACE = "weightcache", "weightcache-system"
CHART_SET, OPERATOR_SET = "chart", "operator"
SETS = (CHART_SET, OPERATOR_SET)

# Values the chart is rendered with; each variant is rendered and checked on its own.
CHART_VARIANTS = {
    "default": [],
    "cert-manager": ["--set", "webhook.tls.certManager.enabled=true"],
}
# What helm may write to stderr without failing the scan: the chart's CRD is a symlink to
# crds/ on purpose (tests/unit/test_chart.py). Any other line is an error or a warning
# someone has to read, so it fails.
HELM_NOTICES = (re.compile(r"found symbolic link in path: .* Contents of linked file included and used$"),)
# Kinds that run containers: each must get check results, or it was not really scanned.
WORKLOADS = {"Pod", "Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job", "CronJob"}
SKIP_KEYS = {"check", "kind", "name", "set", "reason"}
MIN_REASON = 30  # characters: a reason is a sentence a reviewer can check, not "ok"


class SetupError(RuntimeError):
    """The scan could not run (helm, checkov, a builder failed); the message says which."""


@dataclass(frozen=True, order=True)
class Resource:
    set: str
    variant: str
    kind: str
    namespace: str
    name: str

    def label(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}" if self.namespace else f"{self.kind} {self.name}"


@dataclass
class Skip:
    number: int  # 1-based place in skips.yaml, as the table names it
    checks: list[str]
    kinds: list[str]
    name: str  # a glob (fnmatch)
    set: str | None
    reason: str
    used: set[str] = field(default_factory=set)  # the check ids it matched

    def matches(self, resource: Resource, check: str) -> bool:
        return (check in self.checks and resource.kind in self.kinds and fnmatch.fnmatchcase(resource.name, self.name)
                and self.set in (None, resource.set))


@dataclass
class Finding:
    resource: Resource
    check: str
    title: str
    skip: Skip | None = None


@dataclass
class Scan:
    """One checkov run: the objects written to its folder (by file name) and its report."""
    set: str
    variant: str
    files: dict[str, Resource]
    report: dict


@dataclass
class Report:
    checkov: str
    counts: dict  # set -> variant -> {documents, resources, passed, failed}
    findings: list[Finding]
    stale: list[tuple[Skip, str]]  # (entry, check id) that matched no finding
    problems: list[str]

    @property
    def unskipped(self) -> list[Finding]:
        return [f for f in self.findings if f.skip is None]

    @property
    def ok(self) -> bool:
        return not (self.unskipped or self.stale or self.problems)


# -- the skip list ---------------------------------------------------------------------
def load_skips(path: Path = SKIPS) -> list[Skip]:
    """skips.yaml's entries, each checked: a check id (or a list of them), the kind and
    name (glob) of the objects it covers, optionally the set, and a reason."""
    entries = yaml.safe_load(path.read_text()) or []
    if not isinstance(entries, list):
        raise SetupError(f"{path}: expected a list of skip entries, got {type(entries).__name__}")
    skips = []
    for number, e in enumerate(entries, 1):
        where = f"{path.name} entry {number}"
        if not isinstance(e, dict) or not {"check", "kind", "name", "reason"} <= set(e) or set(e) - SKIP_KEYS:
            raise SetupError(f"{where}: needs check, kind, name and reason (and may have set), got {e!r}")
        checks = [e["check"]] if isinstance(e["check"], str) else list(e["check"])
        kinds = [e["kind"]] if isinstance(e["kind"], str) else list(e["kind"])
        if not checks or not all(re.fullmatch(r"CKV2?_[A-Z0-9]+_\d+", c) for c in checks):
            raise SetupError(f"{where}: check must be a checkov id (CKV_K8S_16) or a list of them, got {e['check']!r}")
        if e.get("set") not in (None, *SETS):
            raise SetupError(f"{where}: set must be one of {', '.join(SETS)}, got {e['set']!r}")
        reason = " ".join(str(e["reason"]).split())
        if len(reason) < MIN_REASON:
            raise SetupError(f"{where}: the reason must say why ({MIN_REASON}+ characters), got {reason!r}")
        if not kinds or not all(isinstance(k, str) and k for k in kinds):
            raise SetupError(f"{where}: kind must be an object kind (DaemonSet) or a list of them, got {e['kind']!r}")
        skips.append(Skip(number, checks, kinds, str(e["name"]), e.get("set"), reason))
    return skips


# -- inputs ----------------------------------------------------------------------------
def _binaries_module():
    """tests/cluster/binaries.py (stdlib only), without importing the cluster package."""
    spec = importlib.util.spec_from_file_location("weightcache_cluster_binaries", ROOT / "tests" / "cluster" / "binaries.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def helm_and_kube_version() -> tuple[str, str]:
    """The project's helm (built by `make cluster-build` if absent) and the Kubernetes
    version of the test control plane, from the kubectl built beside it."""
    binaries = _binaries_module()
    try:
        bin_dir = binaries.ensure_binaries(build=True)
    except binaries.BinariesMissing as e:
        raise SetupError(str(e)) from None
    out = subprocess.run([str(bin_dir / "kubectl"), "version", "--client", "-o", "json"], capture_output=True,
                         text=True, timeout=60)
    if out.returncode != 0:
        raise SetupError(f"{bin_dir}/kubectl version failed: {out.stderr.strip()}")
    return str(bin_dir / "helm"), json.loads(out.stdout)["clientVersion"]["gitVersion"]


def render_chart(helm: str, kube_version: str, values_args: list[str], chart: Path = CHART) -> list[dict]:
    """`helm template` of CHART as it installs (CRDs and test hooks included); SetupError
    when helm fails, writes anything but a known notice to stderr, or renders nothing."""
    cmd = [helm, "template", RELEASE, str(chart), "--namespace", RELEASE_NAMESPACE, "--kube-version", kube_version,
           "--include-crds", *values_args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    noise = [line for line in out.stderr.splitlines()
             if line.strip() and not any(n.search(line) for n in HELM_NOTICES)]
    if out.returncode != 0 or noise:
        raise SetupError(f"helm template failed (status {out.returncode}): {' '.join(cmd)}\n"
                         + "\n".join(noise or out.stderr.splitlines()))
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    if not docs:
        raise SetupError(f"helm template rendered no objects: {' '.join(cmd)}")
    return docs


def operator_documents() -> list[dict]:
    """scan/generated.py's objects (it imports the operator: run this in the project venv)."""
    spec = importlib.util.spec_from_file_location("weightcache_scan_generated", HERE / "generated.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        docs = module.documents()
    except Exception as e:  # a builder changed under us: say so, never scan less silently
        raise SetupError(f"scan/generated.py could not build the operator's objects: {type(e).__name__}: {e}") from e
    if not docs:
        raise SetupError("scan/generated.py built no objects")
    return docs


def write_documents(docs: list[dict], set_: str, variant: str, folder: Path) -> dict[str, Resource]:
    """One file an object, so that every result names the object it is about (a graph
    check reports a Pod it derived from a workload, in the workload's file)."""
    folder.mkdir(parents=True)
    files = {}
    for i, doc in enumerate(docs):
        meta = doc.get("metadata") or {}
        r = Resource(set_, variant, str(doc.get("kind")), str(meta.get("namespace") or ""),
                     str(meta.get("name") or meta.get("generateName") or f"unnamed-{i}"))
        file = f"{i:03d}-{re.sub(r'[^A-Za-z0-9.-]+', '_', r.kind + '-' + r.name)}.yaml"
        (folder / file).write_text(yaml.safe_dump(doc, sort_keys=False))
        files[file] = r
    return files


# -- checkov ---------------------------------------------------------------------------
def checkov_binary() -> str:
    """The pinned checkov, its venv built first if needed (scan/venv.sh; ~1 min cold)."""
    out = subprocess.run(["bash", str(HERE / "venv.sh")], stdout=subprocess.PIPE, text=True, timeout=900)
    if out.returncode != 0 or not out.stdout.strip():
        raise SetupError(f"building checkov's venv failed (status {out.returncode}); see the lines above")
    return out.stdout.strip().splitlines()[-1]


def _checkov_env() -> dict[str, str]:
    """No CKV_*/BC_* or other settings of the caller's: only what a process needs."""
    return {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR", "XDG_CACHE_HOME")}


def start_checkov(checkov: str, folder: Path) -> subprocess.Popen:
    cmd = [checkov, "--directory", str(folder), "--framework", "kubernetes", "--output", "json", "--skip-download",
           "--external-checks-dir", str(CHECKS)]
    return subprocess.Popen(cmd, cwd=folder, env=_checkov_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish_checkov(proc: subprocess.Popen, folder: Path) -> dict:
    out, err = proc.communicate(timeout=600)
    # 0: every check passed; 1: some failed. Anything else, or no JSON, is checkov failing.
    try:
        report = json.loads(out)
    except json.JSONDecodeError:
        report = None
    if proc.returncode not in (0, 1) or report is None:
        raise SetupError(f"checkov failed on {folder} (status {proc.returncode}):\n{err.strip()[-3000:]}")
    if isinstance(report, list):  # one entry a framework; only kubernetes runs
        report = next((r for r in report if r.get("check_type") == "kubernetes"), {})
    return report


def run_scans(inputs: list[tuple[str, str, list[dict]]], checkov: str, workdir: Path) -> list[Scan]:
    """INPUTS (set, variant, objects), each written to its own folder under WORKDIR and
    checked by its own checkov run (the runs go in parallel)."""
    started = []
    try:
        for set_, variant, docs in inputs:
            folder = workdir / f"{set_}-{variant}"
            files = write_documents(docs, set_, variant, folder)
            started.append((set_, variant, files, folder, start_checkov(checkov, folder)))
        return [Scan(s, v, files, finish_checkov(proc, folder)) for s, v, files, folder, proc in started]
    finally:  # one run failing leaves no other behind
        for *_, proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# -- judging ---------------------------------------------------------------------------
def evaluate(scans: list[Scan], skips: list[Skip], expected_sets=SETS) -> Report:
    findings: dict[tuple[Resource, str], Finding] = {}
    problems, counts, version = [], {}, ""
    for scan in scans:
        results = scan.report.get("results") or {}
        summary = scan.report.get("summary") or scan.report
        version = summary.get("checkov_version", version)
        checked: dict[Resource, int] = {}
        passed = results.get("passed_checks") or []
        failed = results.get("failed_checks") or []
        for kind_of_result, entries in (("passed", passed), ("failed", failed), ("skipped", results.get("skipped_checks") or [])):
            for r in entries:
                resource = scan.files.get(Path(r.get("file_path", "")).name)
                if resource is None:
                    problems.append(f"{scan.set}:{scan.variant}: checkov reported {r.get('check_id')} on "
                                    f"{r.get('file_path')!r}, which the scan did not write")
                    continue
                checked[resource] = checked.get(resource, 0) + 1
                if kind_of_result == "skipped":
                    problems.append(f"{resource.set}:{resource.variant}: {resource.label()}: checkov skipped "
                                    f"{r['check_id']} through an annotation in the manifest "
                                    f"({(r.get('check_result') or {}).get('suppress_comment', '')!r}); skips belong in "
                                    f"scan/skips.yaml, with a reason")
                elif kind_of_result == "failed":
                    key = (resource, r["check_id"])
                    if key not in findings:
                        skip = next((s for s in skips if s.matches(resource, r["check_id"])), None)
                        if skip:
                            skip.used.add(r["check_id"])
                        findings[key] = Finding(resource, r["check_id"], r.get("check_name", ""), skip)
        for e in results.get("parsing_errors") or []:
            problems.append(f"{scan.set}:{scan.variant}: checkov could not parse {e}")
        for resource in scan.files.values():
            if resource.kind in WORKLOADS and not checked.get(resource):
                problems.append(f"{resource.set}:{resource.variant}: {resource.label()} got no check result: "
                                f"checkov did not scan it")
        counts.setdefault(scan.set, {})[scan.variant] = {
            "documents": len(scan.files), "resources": summary.get("resource_count", 0),
            "passed": len(passed), "failed": len(failed)}
    for set_ in expected_sets:
        variants = counts.get(set_, {})
        if not sum(v["resources"] for v in variants.values()) or not sum(v["passed"] + v["failed"] for v in variants.values()):
            problems.append(f"set {set_!r}: 0 resources scanned ({sum(v['documents'] for v in variants.values())} "
                            f"objects written): a scan that checks nothing must not pass")
    stale = [(s, c) for s in skips for c in s.checks if c not in s.used]
    return Report(version, counts, sorted(findings.values(), key=lambda f: (f.resource, f.check)), stale, problems)


def scan_documents(inputs: list[tuple[str, str, list[dict]]], skips: list[Skip], checkov: str,
                   expected_sets=SETS, keep: Path | None = None) -> Report:
    """The whole judgement on INPUTS (set, variant, objects): what tests call on tiny
    manifests and main() on the real ones. KEEP: a folder to leave the files in."""
    workdir = Path(tempfile.mkdtemp(prefix="weightcache-scan-"))
    try:
        return evaluate(run_scans(inputs, checkov, workdir), skips, expected_sets)
    finally:
        if keep:
            shutil.copytree(workdir, keep, dirs_exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)


# -- output ----------------------------------------------------------------------------
def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def print_report(report: Report, out=sys.stdout) -> None:
    rows = [(f"{f.resource.set}:{f.resource.variant}", f.resource.label(), f.check,
             "skipped" if f.skip else "FAILED", f"[{f.skip.number}] {f.skip.reason}" if f.skip else f.title)
            for f in report.findings]
    header = ("SET", "RESOURCE", "CHECK", "RESULT", "WHY (skips.yaml entry) / WHAT FAILED")
    widths = [max([len(header[i])] + [len(r[i]) for r in rows]) for i in range(4)]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + _clip(r[4], 90), file=out)
    for f in report.unskipped:
        print(f"\nFAILED {f.check} on {f.resource.label()} ({f.resource.set}:{f.resource.variant}): {f.title}\n"
              f"  fix it, or add an entry with the reason to scan/skips.yaml (scan/README.md says how)", file=out)
    for s, check in report.stale:
        print(f"\nSTALE skips.yaml entry {s.number} ({check} on {'/'.join(s.kinds)} {s.name}): it matched no finding; "
              f"remove it (or that check id from it)", file=out)
    for p in report.problems:
        print(f"\nPROBLEM {p}", file=out)
    print(file=out)
    for set_, variants in report.counts.items():
        for variant, c in variants.items():
            print(f"{set_}:{variant}: {c['documents']} objects, {c['resources']} resources scanned, "
                  f"{c['passed']} checks passed, {c['failed']} failed", file=out)
    skipped = len(report.findings) - len(report.unskipped)
    print(f"scan {'passed' if report.ok else 'FAILED'} (checkov {report.checkov}): {len(report.findings)} findings, "
          f"{skipped} skipped with a reason, {len(report.unskipped)} not skipped, {len(report.stale)} stale skips, "
          f"{len(report.problems)} problems", file=out)


def report_json(report: Report) -> dict:
    return {
        "ok": report.ok, "checkov": report.checkov, "counts": report.counts,
        "findings": [{**asdict(f.resource), "check": f.check, "title": f.title, "skipped": f.skip is not None,
                      "skip_entry": f.skip.number if f.skip else None, "reason": f.skip.reason if f.skip else None}
                     for f in report.findings],
        "stale_skips": [{"entry": s.number, "check": c, "kinds": s.kinds, "name": s.name} for s, c in report.stale],
        "problems": report.problems,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the report as JSON (for scripts), not the table")
    ap.add_argument("--keep", type=Path, help="leave the rendered manifests (one file an object) in this folder")
    ap.add_argument("--skips", type=Path, default=SKIPS, help="the skip list (default: scan/skips.yaml)")
    args = ap.parse_args(argv)
    start = time.monotonic()
    try:
        skips = load_skips(args.skips)
        helm, kube_version = helm_and_kube_version()
        inputs = [(CHART_SET, variant, render_chart(helm, kube_version, values)) for variant, values in CHART_VARIANTS.items()]
        inputs.append((OPERATOR_SET, "generated", operator_documents()))
        report = scan_documents(inputs, skips, checkov_binary(), keep=args.keep)
    except SetupError as e:
        print(f"scan could not run: {e}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report_json(report), sys.stdout, indent=2)
        print()
    else:
        print(f"chart rendered with --kube-version {kube_version}; {len(skips)} skip entries", file=sys.stdout)
        print_report(report)
        print(f"({time.monotonic() - start:.1f} s)")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
