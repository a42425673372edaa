"""pytest glue: the session-scoped `cluster` fixture, a hook that builds missing
binaries before the first test (outside pytest-timeout's per-test limit), and a report
hook that names the cluster's log folder on failure. A conftest imports all three:

    from cluster.fixture import cluster, pytest_collection_finish, pytest_runtest_makereport
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from .binaries import BinariesMissing, ensure_binaries
from .handle import Cluster, start_cluster


def _state_dir() -> Path:
    # Short, so unix-socket paths under node roots stay under the 108-byte limit.
    return Path(tempfile.mkdtemp(prefix="wcc-", dir=os.environ.get("WEIGHTCACHE_CLUSTER_TMP", "/tmp")))


_binaries: dict[str, object] = {}  # "dir" or "error", once looked for


def _binaries_or_error(config) -> tuple[Path | None, str | None]:
    if not _binaries:
        capman = config.pluginmanager.getplugin("capturemanager")
        with capman.global_and_fixture_disabled():
            try:
                _binaries["dir"] = ensure_binaries(build=True, progress=sys.stderr)
            except BinariesMissing as e:
                _binaries["error"] = str(e)
    return _binaries.get("dir"), _binaries.get("error")


def pytest_collection_finish(session) -> None:
    """Build before any test runs when a selected test needs the cluster: a cold build
    takes far longer than the per-test timeout."""
    if session.config.option.collectonly:
        return
    if any("cluster" in getattr(item, "fixturenames", ()) for item in session.items):
        _binaries_or_error(session.config)


@pytest.fixture(scope="session")
def cluster(request) -> Cluster:
    """A running control plane with fake GPU nodes for the whole session.

    Builds the binaries first if they are missing (progress shown); fails, never
    skips, when they cannot be had: CI must have them."""
    bin_dir, missing = _binaries_or_error(request.config)
    if missing:
        pytest.fail(f"the control-plane test tier needs the upstream binaries: {missing}", pytrace=False)
    state = _state_dir()
    nodes = int(os.environ.get("WEIGHTCACHE_CLUSTER_NODES", "2"))
    clean = False
    try:
        with start_cluster(state, bin_dir, nodes=nodes) as c:
            yield c
        clean = True
    finally:
        # WEIGHTCACHE_KEEP_CLUSTER_LOGS=1 keeps them after a green run too.
        if clean and not request.session.testsfailed and not os.environ.get("WEIGHTCACHE_KEEP_CLUSTER_LOGS"):
            shutil.rmtree(state, ignore_errors=True)
        else:
            sys.stderr.write(f"\ntest cluster logs kept in {state / 'logs'}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    c = getattr(item, "funcargs", {}).get("cluster")
    if report.failed and isinstance(c, Cluster):
        report.sections.append(("test cluster", f"component and pod logs: {c.log_dir}"))
