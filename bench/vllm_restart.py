"""vLLM server restart, `--load-format auto` vs `--load-format weightcache`, in one run.

Real vLLM (its CPU build, from the vLLM venv: `make vllm-venv`) serving a generated
Llama (bf16 checkpoint, served in float32: ~2.2 GiB of engine tensors by default).
Each sample is a fresh api_server process, timed from Popen to

  ready            /health answers 200
  first token      the first greedy completion (8 tokens) has come back

The two load formats alternate, so both see the same machine state; the checkpoint is
in the page cache (auto's best case; --cold drops it before every start, root only).
weightcache's first start publishes into an empty store daemon and is reported on its
own; the medians are over the starts that attach. Prints a table and writes JSON under
bench/results/.

    .venv/bin/python bench/vllm_restart.py                  # 10 layers, 3 starts each
    .venv/bin/python bench/vllm_restart.py --layers 2 --repeats 1   # a quick look
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from harness import drop_page_cache, write_report

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
from server import VllmServer, vllm_python  # noqa: E402

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
# The 64 MiB KV cache holds 1024 tokens of this model, not its 2048 (not a fingerprint setting).
EXTRA_ARGS = ("--max-model-len", "1024")


def model(work: pathlib.Path, layers: int) -> pathlib.Path:
    """A Llama-2-1B-like shape with LAYERS layers (10: 1.16 GB bf16 on disk)."""
    from weightcache.synthetic_llama import llama_config, write_llama

    config = llama_config(hidden_size=2048, intermediate_size=5632, layers=layers, heads=16, kv_heads=4,
                          vocab_size=32000)
    return write_llama(work / f"llama-h2048-l{layers}", config)


def start(python, model_dir, log, load_format, env, cold) -> dict:
    if cold:
        drop_page_cache()
    with VllmServer(python, model_dir, log, load_format=load_format, env=env,
                    extra_args=EXTRA_ARGS, ready_timeout=900) as server:
        tokens = server.complete(PROMPT, 8)
        first = time.monotonic() - server.started_at
        sample = {"ready_s": server.ready_s, "first_completion_s": first, "tokens": tokens}
        text = log.read_text()
        if load_format == "weightcache":
            line = [x for x in text.splitlines() if "weightcache: {" in x][-1]
            sample["adapter"] = json.loads(line.split("weightcache: ", 1)[1])
        loading = [x for x in text.splitlines() if "Loading weights took" in x]
        if loading:  # vLLM's own figure for its disk load (load_weights only)
            sample["vllm_loading_weights_s"] = float(loading[-1].split("took ")[1].split()[0])
    print(f"  {load_format:>11}: ready {sample['ready_s']:.1f} s, first completion {first:.1f} s"
          + (f", {sample['adapter']['source']}, weights phase {sample['adapter']['weights_ms']:.0f} ms"
             if "adapter" in sample else ""), file=sys.stderr, flush=True)
    return sample


def summary(samples: list[dict]) -> dict:
    out = {}
    for key in ("ready_s", "first_completion_s"):
        values = [s[key] for s in samples]
        out[key] = {"median": statistics.median(values), "min": min(values), "samples": values}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="attaching starts (and auto starts) to time")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every start (root)")
    parser.add_argument("--work", type=pathlib.Path, default=None, help="where the model goes (default: a temp dir)")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    python = vllm_python()
    if python is None:
        sys.exit("no vLLM venv: `make vllm-venv` builds it")
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="vllm-restart-"))
    work.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    model_dir = model(work, args.layers)
    checkpoint_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    print(f"model: {model_dir} ({checkpoint_bytes / 2**30:.2f} GiB bf16, written in {time.monotonic() - t:.0f} s)",
          file=sys.stderr)

    from weightcache.client.spawn import spawn_daemon

    socket_dir = pathlib.Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp")) / "s"
    daemon_log = open(work / "daemon.log", "wb")
    daemon = spawn_daemon(None, socket_dir, "bench", ["--backend", "cpu", "--allow-publish-uid", str(os.getuid())],
                          stdout=daemon_log, stderr=daemon_log, timeout=60)
    env = {"WEIGHTCACHE_MODE": "client", "WEIGHTCACHE_SOCKET_DIR": str(socket_dir), "WEIGHTCACHE_CACHE_NAME": "bench",
           "WEIGHTCACHE_FALLBACK": "error"}
    runs = {"auto": [], "weightcache": []}
    try:
        publish = start(python, model_dir, work / "publish.log", "weightcache", env, args.cold)
        assert publish["adapter"]["source"] == "published", publish["adapter"]
        for i in range(args.repeats):
            runs["auto"].append(start(python, model_dir, work / f"auto-{i}.log", "auto", {}, args.cold))
            runs["weightcache"].append(start(python, model_dir, work / f"wc-{i}.log", "weightcache", env, args.cold))
            assert runs["weightcache"][-1]["adapter"]["source"] == "cache"
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
    tokens = {json.dumps(s["tokens"]) for s in [publish, *runs["auto"], *runs["weightcache"]]}
    results = {name: summary(samples) for name, samples in runs.items()}

    versions = subprocess.run([python, "-c", "import json, torch, vllm, weightcache; print(json.dumps("
                               "{'vllm': vllm.__version__, 'torch': torch.__version__, "
                               "'weightcache': weightcache.__version__}))"],
                              capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    versions = json.loads(versions)
    print(f"\nvLLM {versions['vllm']} restart, {checkpoint_bytes / 2**30:.2f} GiB bf16 "
          f"checkpoint served in float32, {args.repeats} fresh servers each, "
          f"{'cold' if args.cold else 'warm'} page cache")
    print(f"{'load format':<26} {'ready median s':>15} {'min':>7} {'first completion s':>19} {'min':>7}")
    for name, r in results.items():
        print(f"{name:<26} {r['ready_s']['median']:>15.1f} {r['ready_s']['min']:>7.1f} "
              f"{r['first_completion_s']['median']:>19.1f} {r['first_completion_s']['min']:>7.1f}")
    print(f"{'weightcache (publishing)':<26} {publish['ready_s']:>15.1f} {'':>7} {publish['first_completion_s']:>19.1f}")
    speedup = results["auto"]["ready_s"]["median"] - results["weightcache"]["ready_s"]["median"]
    print(f"ready {speedup:.1f} s sooner with weightcache; greedy tokens identical across all starts: {len(tokens) == 1}")

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    report = {
        "benchmark": "vllm_restart",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {**versions, "python": platform.python_version()},
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
                    "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        "model": {"layers": args.layers, "hidden_size": 2048, "checkpoint_bytes": checkpoint_bytes,
                  "served_dtype": "float32", "engine_tensor_bytes": publish["adapter"]["shared_bytes"]},
        "page_cache": "cold" if args.cold else "warm",
        "server_flags": "--distributed-executor-backend uni --kv-cache-memory-bytes 67108864 --enforce-eager "
                        "--skip-tokenizer-init --max-model-len 1024, VLLM_ENABLE_V1_MULTIPROCESSING=0",
        "results": results, "publishing_start": publish, "samples": runs,
        "tokens_identical": len(tokens) == 1,
    }
    print(f"wrote {write_report(args.out, 'vllm_restart-{date}', report)}")


if __name__ == "__main__":
    main()
