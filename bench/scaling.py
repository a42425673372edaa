"""Weights-ready time against model size: the cache's attach stays flat, loading grows.

For each size, in one run, a fresh process per measurement (imports done before the
clock), medians of --repeats:

  cpu (default; 0.25 -> 8 GiB)
    attach            weightcache attach (connect, map the slabs, build every view),
                      then one byte of every page read: the bytes are usable in this
                      process (the first forward pass would fault them in otherwise)
    load_file cold    safetensors load_file of every shard, the files evicted from the
                      page cache first (posix_fadvise DONTNEED), then every page read:
                      on the CPU load_file maps the files, so the reads happen there
    load_file warm    the same with the files in the page cache
    per-tensor fd     another process holds every tensor in shared memory and passes
                      one fd per tensor: torch.multiprocessing (share_memory_, the
                      file_descriptor strategy), then every page read. This is what
                      PyTorch gives a CPU user for sharing weights between processes
                      without a cache; "file_system" is the same with a named file per
                      tensor. It is zero-copy on the receiving side, like the attach,
                      so the difference is one handle per tensor vs one per slab.
  --backend cuda-vmm (GPU; 1 -> 40 GiB), with bench/gpu_attach.py's children
    attach            cuda-vmm attach (fds imported, mapped read-only, views built)
    load_file cold    load_file(device="cuda"), files evicted first
    load_file warm    the same, files in the page cache
    per-tensor IPC    legacy CUDA IPC, one handle per tensor (torch.multiprocessing)

The checkpoints have --tensors-per-gib tensors (bf16), in shards of at most 2 GiB;
each is written, measured and deleted before the next (check `df`: the largest size
needs its bytes free, twice for the GPU's warm/cold files plus the daemon's load).
Writes bench/results/scaling-<backend>-<date>.json and a log-log plot beside it (PNG).

    .venv/bin/python bench/scaling.py                                  # cpu, 0.25 -> 8 GiB
    .venv/bin/python bench/scaling.py --sizes 0.25 0.5 --repeats 2      # a quick look
    python3 bench/scaling.py --backend cuda-vmm --out $OUT              # GPU, 1 -> 40 GiB
    .venv/bin/python bench/scaling.py --plot-only bench/results/scaling-cpu-20261201.json
"""

import argparse
import datetime
import json
import math
import pathlib
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from harness import repeat, run_child, write_report

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_SIZES = (0.25, 0.5, 1, 2, 4, 8)
GPU_SIZES = (1, 2, 4, 8, 16, 40)
SHARD_GIB = 2

# cpu children: print the milliseconds to every byte usable; "phases" on stderr says
# how long the handles alone took (before any page was read).
CHILD_CPU_ATTACH = """
import json, sys, time, torch
from weightcache.client import attach
from weightcache.demo_engine import touch
t = time.perf_counter()
a = attach(sys.argv[1], socket_dir=sys.argv[2], cache_name="bench")
mapped = (time.perf_counter() - t) * 1e3
touch(a.tensors)
ms = (time.perf_counter() - t) * 1e3
assert len(a.tensors) == int(sys.argv[3])
print("phases", json.dumps({"mapped_ms": mapped}), file=sys.stderr)
print(ms)
"""

CHILD_CPU_LOAD_FILE = """
import json, sys, time, torch
from weightcache.client import load_from_disk
from weightcache.demo_engine import touch
t = time.perf_counter()
tensors = load_from_disk(sys.argv[1])
mapped = (time.perf_counter() - t) * 1e3
touch(tensors)
ms = (time.perf_counter() - t) * 1e3
assert len(tensors) == int(sys.argv[3])
print("phases", json.dumps({"mapped_ms": mapped}), file=sys.stderr)
print(ms)
"""

CHILD_CPU_PER_TENSOR = """
import json, sys, time, torch, torch.multiprocessing as mp
from weightcache.client import load_from_disk
from weightcache.demo_engine import touch

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
    mapped = (time.perf_counter() - t) * 1e3
    touch(tensors)
    ms = (time.perf_counter() - t) * 1e3
    assert len(tensors) == int(sys.argv[3])
    del tensors
    mine.send("done")
    p.join()
    print("phases", json.dumps({"mapped_ms": mapped}), file=sys.stderr)
    print(ms)
"""

LABELS = {
    "attach": "weightcache attach, then every page read",
    "load_file_cold": "safetensors load_file, cold, then every page read",
    "load_file_warm": "safetensors load_file, page cache warm, then every page read",
    "per_tensor": "per-tensor sharing",
    "attach_mapped": "attach, handles only (pages faulted at first use)",
}


def write_checkpoint_cpu(model_dir: pathlib.Path, tensors: int, gib: float, shards: int) -> None:
    """Random bytes as bf16 tensors (contents do not change load times), fsynced."""
    import torch
    from safetensors.torch import save_file

    from weightcache.synthetic import uniform_specs

    specs = uniform_specs(tensors, int(gib * (1 << 30)))
    names = list(specs)
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps({"model_type": "synthetic", "torch_dtype": "bfloat16"}))
    weight_map = {}
    for shard in range(shards):
        file_name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[shard::shards]
        data = {n: torch.empty(math.prod(specs[n][1]) * 2, dtype=torch.uint8).random_().view(torch.bfloat16)
                .view(specs[n][1]) for n in chunk}
        save_file(data, model_dir / file_name)
        weight_map.update({n: file_name for n in chunk})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def measure_cpu(model: pathlib.Path, work: pathlib.Path, tensors: int, repeats: int, files) -> tuple[dict, dict]:
    from weightcache import pagecache
    from weightcache.client import query_status
    from weightcache.client.attach import list_sockets
    from weightcache.client.spawn import spawn_daemon

    results, phases, extra = {}, {k: [] for k in ("attach", "load_file_cold", "load_file_warm", "per_tensor")}, {}
    socket_dir = work / "s"
    pagecache.evict(files)
    daemon = spawn_daemon(model, socket_dir, "bench", ["--log-level", "warning"], timeout=1800)
    try:
        extra["daemon_cold_load_s"] = query_status(list_sockets(socket_dir)[0]).load_s
        results["attach"] = repeat("attach", repeats, lambda: run_child(
            CHILD_CPU_ATTACH, work, model, socket_dir, tensors, phases=phases["attach"]))
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=120)

    cold_residency = []

    def cold():
        pagecache.evict(files)
        cold_residency.append(pagecache.resident_fraction(files))
        return run_child(CHILD_CPU_LOAD_FILE, work, model, socket_dir, tensors, phases=phases["load_file_cold"])

    results["load_file_cold"] = repeat("load_file cold", repeats, cold)
    pagecache.warm(files)
    results["load_file_warm"] = repeat("load_file warm", repeats, lambda: run_child(
        CHILD_CPU_LOAD_FILE, work, model, socket_dir, tensors, phases=phases["load_file_warm"]))
    results["per_tensor"] = repeat("per-tensor fd", repeats, lambda: run_child(
        CHILD_CPU_PER_TENSOR, work, model, socket_dir, tensors, phases=phases["per_tensor"]))
    for method, runs in phases.items():
        results[method]["mapped_ms"] = [p["mapped_ms"] for p in runs]
    mapped = results["attach"]["mapped_ms"]
    results["attach_mapped"] = {"median_ms": statistics.median(mapped), "min_ms": min(mapped), "samples_ms": mapped}
    extra["page_cache_before_cold"] = max(cold_residency)
    return results, extra


def measure_gpu(model: pathlib.Path, work: pathlib.Path, tensors: int, repeats: int, files, workers: int):
    import gpu_attach

    from weightcache import pagecache
    from weightcache.client import gpu, query_status
    from weightcache.client.attach import list_sockets

    device = gpu.device_uuid(0)
    socket_dir = work / "s"
    common = (model, socket_dir, device, tensors)
    results, extra = {}, {}
    pagecache.evict(files)
    vmm, _ = gpu_attach.serve(model, socket_dir, "cuda-vmm", device, work / "daemon.log", workers)
    try:
        extra["daemon_cold_load_s"] = query_status(list_sockets(socket_dir, device=device)[0]).load_s
        results["attach"] = repeat("attach cuda-vmm", repeats, lambda: run_child(
            gpu_attach.CHILD_ATTACH, work, *common, "cuda-vmm"))
    finally:
        gpu_attach.stop(vmm)
    cold_residency = []

    def cold():
        pagecache.evict(files)
        cold_residency.append(pagecache.resident_fraction(files))
        return run_child(gpu_attach.CHILD_LOAD_FILE, work, *common)

    results["load_file_cold"] = repeat("load_file cold", repeats, cold)
    pagecache.warm(files)
    results["load_file_warm"] = repeat("load_file warm", repeats,
                                       lambda: run_child(gpu_attach.CHILD_LOAD_FILE, work, *common))
    results["per_tensor"] = repeat("per-tensor IPC", repeats,
                                   lambda: run_child(gpu_attach.CHILD_PER_TENSOR_IPC, work, *common))
    extra["page_cache_before_cold"] = max(cold_residency)
    return results, extra


def versions(backend: str) -> dict:
    import safetensors
    import torch

    import weightcache

    doc = {"python": platform.python_version(), "torch": torch.__version__, "safetensors": safetensors.__version__,
           "weightcache": weightcache.__version__, "kernel": platform.release()}
    if backend != "cpu":
        from weightcache.client import gpu

        doc["cuda_driver"] = gpu.driver_version()
    return doc


def device_name(backend: str) -> str:
    if backend == "cpu":
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), "cpu")
        import os

        return f"{os.cpu_count()} x {cpu} (cpu backend, memfd)"
    return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip().splitlines()[0] + " (cuda-vmm)"


def run(args, after_each=lambda report: None) -> dict:
    """Measure every size; AFTER_EACH gets the report so far once a size is done (a run
    cut short by a time limit keeps what it measured)."""
    work_root = pathlib.Path(tempfile.mkdtemp(prefix="wcs-", dir=args.work))  # short: socket paths
    sizes = []
    started = datetime.datetime.now(datetime.timezone.utc)
    try:
        for gib in args.sizes:
            tensors = max(8, round(gib * args.tensors_per_gib))
            shards = max(1, math.ceil(gib / SHARD_GIB))
            need = gib * (1 << 30) * 1.2 + (2 << 30)
            free = shutil.disk_usage(work_root).free
            if free < need:
                print(f"skipping {gib} GiB: {free / (1 << 30):.1f} GiB free in {work_root}, need "
                      f"{need / (1 << 30):.1f}", file=sys.stderr, flush=True)
                sizes.append({"gib": gib, "skipped": f"{free} bytes free, {int(need)} needed"})
                continue
            work = work_root / f"{gib:g}"
            model = work / "model"
            print(f"{gib:g} GiB, {tensors} tensors, {shards} shard(s): writing ...", file=sys.stderr, flush=True)
            start = time.perf_counter()
            if args.backend == "cpu":
                write_checkpoint_cpu(model, tensors, gib, shards)
            else:
                import gpu_attach

                gpu_attach.write_checkpoint(model, tensors, gib, shards)
            files = sorted(model.glob("*.safetensors"))
            write_s = time.perf_counter() - start
            if args.backend == "cpu":
                results, extra = measure_cpu(model, work, tensors, args.repeats, files)
            else:
                results, extra = measure_gpu(model, work, tensors, args.repeats, files, args.load_workers)
            sizes.append({"gib": gib, "bytes": sum(f.stat().st_size for f in files), "tensors": tensors,
                          "shards": shards, "write_s": write_s, **extra, "results": results})
            after_each(report_of(args, started, sizes))
            shutil.rmtree(work)
            summary = "  ".join(f"{k} {v['median_ms']:.1f}" for k, v in results.items())
            print(f"  {gib:g} GiB medians (ms): {summary}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work_root, ignore_errors=True)
    return report_of(args, started, sizes)


def report_of(args, started, sizes: list) -> dict:
    return {
        "benchmark": "scaling",
        "backend": args.backend,
        "date": started.isoformat(timespec="seconds"),
        "device": device_name(args.backend),
        "versions": versions(args.backend),
        "setup": {"sizes_gib": args.sizes, "tensors_per_gib": args.tensors_per_gib, "repeats": args.repeats,
                  "shard_gib": SHARD_GIB, "dtype": "BF16",
                  "ready_means": ("every byte usable in the engine process: on cpu, one byte of every page read "
                                  "after the handles (mapped_ms)" if args.backend == "cpu"
                                  else "the tensors on the GPU, synchronized"),
                  "cold_means": "the files evicted with posix_fadvise(DONTNEED) before each run"},
        "sizes": sizes,
        "methods": {k: v for k, v in LABELS.items() if any(k in s.get("results", {}) for s in sizes)},
    }


def plot(report: dict, png: pathlib.Path) -> pathlib.Path:
    """Log-log: weights-ready time (s) against model size (GiB), one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [s for s in report["sizes"] if "results" in s]
    fig, ax = plt.subplots(figsize=(7.5, 5.2), dpi=130)
    styles = {"attach": ("o", "-", "tab:green"), "attach_mapped": ("o", ":", "tab:green"),
              "load_file_cold": ("s", "-", "tab:red"), "load_file_warm": ("^", "-", "tab:orange"),
              "per_tensor": ("D", "-", "tab:blue")}
    labels = dict(LABELS)
    labels["per_tensor"] = ("per-tensor sharing (torch.multiprocessing, one fd per tensor)" if report["backend"] == "cpu"
                            else "per-tensor legacy CUDA IPC (one handle per tensor)")
    if report["backend"] != "cpu":
        labels["attach"] = "weightcache attach (cuda-vmm, read-only mapping)"
        labels["load_file_cold"] = 'safetensors load_file(device="cuda"), cold'
        labels["load_file_warm"] = 'safetensors load_file(device="cuda"), page cache warm'
    for method in ("load_file_cold", "load_file_warm", "per_tensor", "attach", "attach_mapped"):
        points = [(s["bytes"] / (1 << 30), s["results"][method]["median_ms"] / 1e3) for s in measured
                  if method in s["results"]]
        if not points:
            continue
        marker, line, color = styles[method]
        ax.plot(*zip(*points), marker=marker, linestyle=line, color=color, label=labels[method])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("model size (GiB, bf16)")
    ax.set_ylabel("weights ready (s), median of fresh processes")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("Time until an engine's weights are ready, by model size")
    v = report["versions"]
    fig.text(0.01, 0.01, f"{report['device']}, {report['date'][:10]}\ntorch {v['torch']}, safetensors "
             f"{v['safetensors']}; {report['setup']['tensors_per_gib']} tensors/GiB; median of "
             f"{report['setup']['repeats']} fresh processes; bench/scaling.py", fontsize=7, color="0.3")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(png)
    plt.close(fig)
    return png


def print_table(report: dict) -> None:
    methods = [m for m in ("attach", "attach_mapped", "load_file_warm", "load_file_cold", "per_tensor")
               if m in report["methods"]]
    print(f"{'GiB':>6} {'tensors':>8} " + " ".join(f"{m:>15}" for m in methods) + "   (median ms)")
    for s in report["sizes"]:
        if "results" not in s:
            print(f"{s['gib']:>6g} skipped: {s['skipped']}")
            continue
        print(f"{s['bytes'] / (1 << 30):>6.2f} {s['tensors']:>8} "
              + " ".join(f"{s['results'][m]['median_ms']:>15.1f}" for m in methods))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda-vmm"])
    parser.add_argument("--sizes", type=float, nargs="+", help="GiB (default: cpu 0.25..8, cuda-vmm 1..40)")
    parser.add_argument("--tensors-per-gib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--load-workers", type=int, default=16, help="the GPU daemon's readers")
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir()))
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    parser.add_argument("--plot-only", type=pathlib.Path, metavar="JSON", help="only draw JSON's plot (PNG beside it)")
    parser.add_argument("--into", type=pathlib.Path, metavar="JSON",
                        help="add this run's sizes to an earlier run's JSON (one size per call where a call's time "
                             "is limited); writes the merged report to --out")
    args = parser.parse_args()

    if args.plot_only:
        report = json.loads(args.plot_only.read_text())
        print(f"wrote {plot(report, args.plot_only.with_suffix('.png'))}")
        print_table(report)
        return 0
    args.sizes = args.sizes or list(CPU_SIZES if args.backend == "cpu" else GPU_SIZES)

    def save(report: dict) -> pathlib.Path:
        if args.into:
            report = merged(json.loads(args.into.read_text()), report)
        return write_report(args.out, f"scaling-{args.backend}-{{date}}", report)

    report = run(args, after_each=save)
    out = save(report)
    png = plot(json.loads(out.read_text()), out.with_suffix(".png"))
    print_table(json.loads(out.read_text()))
    print(f"wrote {out}\nwrote {png}")
    return 0


def merged(earlier: dict, report: dict) -> dict:
    """REPORT's sizes added to an earlier run's (one size per call where a call's time is limited)."""
    if earlier["backend"] != report["backend"]:
        raise SystemExit(f"the earlier run is a {earlier['backend']} run, not {report['backend']}")
    mine = {s["gib"] for s in report["sizes"]}
    report["sizes"] = sorted([s for s in earlier["sizes"] if s["gib"] not in mine] + report["sizes"],
                             key=lambda s: s["gib"])
    report["setup"]["sizes_gib"] = [s["gib"] for s in report["sizes"]]
    report["merged_from"] = earlier.get("merged_from", []) + [earlier["date"]]
    return report


if __name__ == "__main__":
    sys.exit(main())
