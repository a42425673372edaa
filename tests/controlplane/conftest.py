"""Control-plane tier: a real kube-apiserver/etcd/controller-manager/scheduler built from
upstream modules plus the node simulator (tests/cluster). The code lives in the
`cluster` package under tests/; this conftest puts tests/ on sys.path so that it
imports the same way whether or not tests/ is a package."""

from __future__ import annotations

import re
import sys
import uuid
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent.parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from cluster.fixture import (cluster, pytest_collection_finish,  # noqa: E402,F401
                             pytest_runtest_makereport)


@pytest.fixture
def namespace(cluster, request):
    """A fresh namespace (Pod Security: privileged) per test, deleted afterwards."""
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower())[:30].strip("-")
    name = f"t-{base}-{uuid.uuid4().hex[:5]}"
    cluster.create_namespace(name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
