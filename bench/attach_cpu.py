"""How long an engine waits for its weights, three ways, on the cpu backend, in one run.

  weightcache attach   connect, handshake, map the slabs, build every view (this project)
  load_file            safetensors.torch.load_file of every shard (what an engine does
                       without a cache; the files are in the page cache, its best case)
  per-tensor sharing   another process already holds every tensor in shared memory and
                       passes one handle per tensor (torch.multiprocessing, the way
                       reference implementations share weights)

Each measurement runs in a fresh process with torch already imported, so only the
weight path is timed. Prints a table and writes JSON under bench/results/.

    .venv/bin/python bench/attach_cpu.py                 # 2,000 tensors, 4 GiB
    .venv/bin/python bench/attach_cpu.py --gib 0.25 --repeats 2   # a quick look
"""

import argparse
import datetime
import pathlib
import platform
import signal
import sys
import tempfile

from harness import drop_page_cache, print_table, repeat, run_child, write_report

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Each child prints one float: milliseconds from request to every tensor usable.
CHILD_ATTACH = """
import sys, time, torch
from weightcache.client import attach
t = time.perf_counter()
a = attach(sys.argv[1], socket_dir=sys.argv[2], cache_name="bench")
ms = (time.perf_counter() - t) * 1e3
assert len(a.tensors) == int(sys.argv[3])
print(ms)
"""

CHILD_LOAD_FILE = """
import sys, time, torch
from weightcache.client import load_from_disk
t = time.perf_counter()
tensors = load_from_disk(sys.argv[1])
ms = (time.perf_counter() - t) * 1e3
assert len(tensors) == int(sys.argv[3])
print(ms)
"""

CHILD_PER_TENSOR = """
import sys, time, torch, torch.multiprocessing as mp
from weightcache.client import load_from_disk

def producer(model_dir, queue, go):
    tensors = {n: t.share_memory_() for n, t in load_from_disk(model_dir).items()}  # one segment per tensor
    go.send("loaded")
    go.recv()
    queue.put(tensors)
    go.recv()  # keep the segments alive until the consumer has them

if __name__ == "__main__":
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    ctx = mp.get_context("spawn")
    queue, (mine, theirs) = ctx.Queue(), ctx.Pipe()
    p = ctx.Process(target=producer, args=(sys.argv[1], queue, theirs))
    p.start()
    assert mine.recv() == "loaded"
    t = time.perf_counter()
    mine.send("go")
    tensors = queue.get()
    ms = (time.perf_counter() - t) * 1e3
    assert len(tensors) == int(sys.argv[3])
    mine.send("done")
    p.join()
    print(ms)
"""


def cold_start() -> str:
    """Flush the new checkpoint (its write-back must not race the daemon's reads) and,
    where permitted (root), drop the page cache so the daemon's load is a cold one."""
    try:
        drop_page_cache()
        return "dropped before the daemon's load"
    except OSError:
        return "warm (no permission to drop it)"


def versions() -> dict:
    import safetensors
    import torch

    import weightcache

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    return {"python": platform.python_version(), "torch": torch.__version__, "safetensors": safetensors.__version__,
            "weightcache": weightcache.__version__, "cpu": cpu, "kernel": platform.release()}


def main() -> int:
    parser = argparse.ArgumentParser(description="attach vs load_file vs per-tensor sharing (cpu backend)")
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    from weightcache.client import query_status
    from weightcache.client.attach import list_sockets
    from weightcache.client.spawn import spawn_daemon
    from weightcache.synthetic import uniform_specs, write_model

    with tempfile.TemporaryDirectory(prefix="wc-bench-") as tmp:
        tmp = pathlib.Path(tmp)
        print(f"writing a {args.tensors}-tensor, {args.gib} GiB bf16 checkpoint ...", file=sys.stderr, flush=True)
        model = write_model(tmp / "model", uniform_specs(args.tensors, int(args.gib * (1 << 30))), shards=args.shards)
        page_cache = cold_start()
        socket_dir = tmp / "s"
        daemon = spawn_daemon(model, socket_dir, "bench", ["--log-level", "warning"], timeout=1800)
        try:
            status = query_status(list_sockets(socket_dir)[0])
            common = (model, socket_dir, args.tensors)
            results = {"weightcache_attach": repeat("attach", args.repeats,
                                                    lambda: run_child(CHILD_ATTACH, tmp, *common, timeout=600))}
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait()
        results["safetensors_load_file_warm"] = repeat(
            "load_file", args.repeats, lambda: run_child(CHILD_LOAD_FILE, tmp, *common, timeout=600))
        results["per_tensor_sharing"] = repeat(
            "per-tensor", args.repeats, lambda: run_child(CHILD_PER_TENSOR, tmp, *common, timeout=600))

    attach_ms = results["weightcache_attach"]["median_ms"]
    report = {
        "benchmark": "attach_cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cpu (memfd backend)",
        "versions": versions(),
        "model": {"tensors": args.tensors, "bytes": status.resident_bytes, "dtype": "BF16", "shards": args.shards},
        "daemon_cold_load_s": status.load_s,
        "page_cache": page_cache,
        "repeats": args.repeats,
        "results": results,
        "ratios_vs_attach": {k: v["median_ms"] / attach_ms for k, v in results.items()},
    }
    out = write_report(args.out, "attach_cpu-{date}", report)

    print(f"\n{args.tensors} tensors, {status.resident_bytes / (1 << 30):.2f} GiB, median of {args.repeats} fresh processes")
    print_table(results, "weightcache_attach", "attach")
    print(f"daemon cold load: {status.load_s:.2f} s (page cache {page_cache})\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
