"""What the control-plane benchmarks share: a generated model big enough that loading it
from disk is not trivially short, a one-node test cluster with the operator and a Ready
cache of that model, and what a report records about the machine."""

from __future__ import annotations

import pathlib
import platform
import shutil
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "controlplane")]

from cluster.binaries import ensure_binaries  # noqa: E402
from cluster.handle import start_cluster  # noqa: E402
from standbykit import Env  # noqa: E402

MODEL = "/m/b/big"  # where the model lies on the simulated node
CACHE = "big"


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def write_big_model(out: pathlib.Path, gib: float) -> dict:
    """A BERT (all-MiniLM-L6-v2's tokenizer, random float32 weights) of about GIB GiB,
    with every tensor the example engine binds."""
    from accelerate import init_empty_weights
    from transformers import AutoModel, BertConfig

    from weightcache.demo import packaged_model_dir
    from weightcache.synthetic import write_model

    hidden = 1536
    per_layer = 12 * hidden * hidden * 4  # attention 4h^2 + MLP 8h^2, float32
    layers = max(1, round((gib * 2**30 - 30522 * hidden * 4) / per_layer))
    config = BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=12,
                        intermediate_size=4 * hidden, torch_dtype="float32")
    with init_empty_weights(include_buffers=False):
        model = AutoModel.from_config(config)
    specs = {name: ("F32", tuple(t.shape)) for name, t in model.state_dict().items()}
    write_model(out, specs, shards=4, config=config.to_dict())
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(packaged_model_dir() / name, out / name)
    total = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return {"layers": layers, "hidden": hidden, "tensors": len(specs), "bytes": total}


@contextmanager
def cache_on_one_node(prefix: str, gib: float):
    """(env, node, model description): a fresh cluster of one node with the operator and
    the WeightCache CACHE of a ~GIB GiB model, Ready; everything goes on exit."""
    work = pathlib.Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    try:
        log(f"writing a ~{gib} GiB model to {work / 'big'} ...")
        model = write_big_model(work / "big", gib)
        log(f"  {model}")
        with start_cluster(work / "c", ensure_binaries(build=True, progress=sys.stderr), nodes=1) as cluster:
            env = Env(cluster, work / "op", f"{prefix}-{uuid.uuid4().hex[:4]}")
            node = cluster.nodes[0]
            try:
                env.start()
                env.put_model(node, work / "big", MODEL)
                env.create_cache(CACHE, MODEL, node)
                t = time.monotonic()
                env.wait_cache_ready(CACHE)
                log(f"cache Ready after {time.monotonic() - t:.1f} s")
                yield env, node, model
            except Exception:
                log(env.operator_log())
                raise
            finally:
                env.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def cpu_model() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def versions() -> dict:
    import kopf
    import safetensors
    import torch
    import transformers

    from weightcache import __version__
    return {"weightcache": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "safetensors": safetensors.__version__,
            "kopf": kopf.__version__, "kernel": platform.release()}
