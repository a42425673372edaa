"""Fixtures shared by the unit and process tests: synthetic models, real daemon and
engine processes, cleaned up even when a test fails."""

import pathlib
import shutil
import tempfile

import pytest

from procs import Daemons, Engine
from weightcache.synthetic import write_model

# Every dtype the wire carries, odd shapes included, over two shards with an index.
SMALL_MODEL_SPECS = {
    "embed.weight": ("F32", (1000, 64)),
    "layers.0.attn.weight": ("BF16", (64, 192)),
    "layers.0.attn.bias": ("F16", (192,)),
    "layers.0.mlp.weight": ("BF16", (256, 64)),
    "layers.1.attn.weight": ("BF16", (64, 192)),
    "layers.1.mlp.weight": ("F64", (16, 3, 5)),
    "layers.1.mask": ("BOOL", (7, 9)),
    "positions": ("I64", (512,)),
    "quant.table": ("U8", (1000,)),
    "quant.signed": ("I8", (33,)),
    "counts": ("I32", (13,)),
    "scalar": ("F32", ()),
    "empty": ("F32", (0, 4)),
    "fp8.weight": ("F8_E4M3", (128, 64)),
    "fp8.alt": ("F8_E5M2", (64, 3)),
}


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> pathlib.Path:
    return write_model(tmp_path_factory.mktemp("models") / "small", SMALL_MODEL_SPECS, shards=2)


@pytest.fixture
def socket_dir():
    # Short on purpose: a Unix socket path must fit in 107 bytes.
    path = pathlib.Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp")) / "s"
    yield path
    shutil.rmtree(path.parent, ignore_errors=True)


@pytest.fixture
def daemons(tmp_path):
    d = Daemons(tmp_path)
    yield d
    d.stop_all()


@pytest.fixture
def engines(tmp_path):
    started: list[Engine] = []

    def start(model_dir, socket_dir, **env) -> Engine:
        full = {"WEIGHTCACHE_SOCKET_DIR": str(socket_dir), **{f"WEIGHTCACHE_{k.upper()}": str(v) for k, v in env.items()}}
        engine = Engine(model_dir, full, tmp_path / f"engine-{len(started)}.log")
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()
