"""GPU benchmark, in one run on one checkpoint: how long an engine waits for its weights.

  attach cuda-vmm        connect -> views bound (handshake, fd import, map read-only)
  attach cuda-ipc        the same through one legacy IPC handle per slab
  per-tensor legacy IPC  a process holds every tensor on the GPU and passes one
                         handle per tensor (torch.multiprocessing / reduce_tensor)
  load_file cold / warm  safetensors.torch.load_file(device="cuda"), page cache dropped / warm
  daemon cold load       weightcache daemon --backend cuda-vmm, page cache dropped
  disk read rate         the files read with large sequential reads, page cache dropped

Each measurement runs in a fresh process (imports done before the clock starts).
Needs root for /proc/sys/vm/drop_caches. Prints a table, writes JSON to --out.

    python3 bench/gpu_attach.py --gib 40 --tensors 2000 --out $OUT
"""

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from harness import disk_read_rate, drop_page_cache, print_table, repeat, run_child, stop, write_report

ROOT = pathlib.Path(__file__).resolve().parents[1]

CHILD_ATTACH = """
import json, sys, time, torch
from weightcache.client import attach
torch.empty(1, device="cuda")  # an engine has its CUDA context before it asks for weights
t = time.perf_counter()
import weightcache.client.gpu  # the driver bindings: start-up, like torch's import; timed apart
bindings_ms = (time.perf_counter() - t) * 1e3
t = time.perf_counter()
a = attach(sys.argv[1], socket_dir=sys.argv[2], device=sys.argv[3])
torch.cuda.synchronize()
ms = (time.perf_counter() - t) * 1e3
assert len(a.tensors) == int(sys.argv[4]) and a.backend == sys.argv[5], (len(a.tensors), a.backend)
print("phases", json.dumps({**{k: round(v, 2) for k, v in a.phases_ms.items()},
                            "bindings_import_before_clock": round(bindings_ms, 2)}), file=sys.stderr)
print(ms)
"""

CHILD_LOAD_FILE = """
import sys, time, torch
from weightcache.client import load_from_disk
torch.cuda.init(); torch.empty(1, device="cuda")
t = time.perf_counter()
tensors = load_from_disk(sys.argv[1], device="cuda")
torch.cuda.synchronize()
ms = (time.perf_counter() - t) * 1e3
assert len(tensors) == int(sys.argv[4])
print(ms)
"""

CHILD_PER_TENSOR_IPC = """
import sys, time, torch, torch.multiprocessing as mp
from weightcache.client import load_from_disk

def producer(model_dir, queue, go):
    tensors = load_from_disk(model_dir, device="cuda")
    torch.cuda.synchronize()
    go.send("loaded")
    go.recv()
    queue.put(tensors)
    go.recv()

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    queue, (mine, theirs) = ctx.Queue(), ctx.Pipe()
    p = ctx.Process(target=producer, args=(sys.argv[1], queue, theirs))
    p.start()
    torch.cuda.init(); torch.empty(1, device="cuda")
    assert mine.recv() == "loaded"
    t = time.perf_counter()
    mine.send("go")
    tensors = queue.get()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    assert len(tensors) == int(sys.argv[4])
    del tensors
    mine.send("done")
    p.join()
    print(ms)
"""


def write_checkpoint(model_dir: pathlib.Path, tensors: int, gib: float, shards: int) -> None:
    """Random bf16 tensors, generated on the GPU (fast), saved shard by shard."""
    import torch
    from safetensors.torch import save_file

    from weightcache.synthetic import uniform_specs

    specs = uniform_specs(tensors, int(gib * (1 << 30)))
    names = list(specs)
    model_dir.mkdir(parents=True)
    (model_dir / "config.json").write_text(json.dumps({"model_type": "synthetic", "torch_dtype": "bfloat16"}))
    weight_map = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for shard in range(shards):
        file_name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[shard::shards]
        data = {n: torch.randn(specs[n][1], generator=g, device="cuda", dtype=torch.bfloat16).cpu() for n in chunk}
        save_file(data, model_dir / file_name)
        weight_map.update({n: file_name for n in chunk})
        print(f"  wrote {file_name}", file=sys.stderr, flush=True)
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def serve(model, socket_dir, backend, device, log_path, workers):
    from weightcache.client.spawn import spawn_daemon

    with open(log_path, "wb") as log:
        start = time.perf_counter()
        proc = spawn_daemon(model, socket_dir, backend.replace("cuda-", ""), ["--backend", backend, "--device", device, "--load-workers", str(workers)],
                            stderr=log, timeout=1800)
        return proc, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--gib", type=float, default=40.0)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--load-workers", type=int, default=16)
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir()))
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    import safetensors
    import torch

    from weightcache.client import gpu, query_status
    from weightcache.client.attach import list_sockets

    device = gpu.device_uuid(0)
    work = pathlib.Path(tempfile.mkdtemp(prefix="wcb-", dir=args.work))
    model, sockets = work / "model", work / "s"
    print(f"writing {args.tensors} tensors, {args.gib} GiB ...", file=sys.stderr, flush=True)
    write_checkpoint(model, args.tensors, args.gib, args.shards)
    files = sorted(model.glob("*.safetensors"))
    results, loads = {}, {}

    loads["disk_read"] = disk_read_rate(files, args.load_workers)
    print(f"  disk: {loads['disk_read']['gb_per_s']:.2f} GB/s", file=sys.stderr, flush=True)

    drop_page_cache()
    vmm, wall = serve(model, sockets, "cuda-vmm", device, work / "daemon-vmm.log", args.load_workers)
    status = query_status(list_sockets(sockets, device=device)[0])
    loads["daemon_cold_load"] = {"seconds": status.load_s, "wall_to_ready_s": wall,
                                 "gb_per_s": status.resident_bytes / status.load_s / 1e9}
    common = (model, sockets, device, args.tensors)
    phases = {"cuda-vmm": [], "cuda-ipc": []}
    results["attach_cuda_vmm"] = repeat("attach cuda-vmm", args.repeats, lambda: run_child(
        CHILD_ATTACH, work, *common, "cuda-vmm", phases=phases["cuda-vmm"]))
    stop(vmm)

    ipc, _ = serve(model, sockets, "cuda-ipc", device, work / "daemon-ipc.log", args.load_workers)
    results["attach_cuda_ipc"] = repeat("attach cuda-ipc", args.repeats, lambda: run_child(
        CHILD_ATTACH, work, *common, "cuda-ipc", phases=phases["cuda-ipc"]))
    stop(ipc)

    results["per_tensor_legacy_ipc"] = repeat("per-tensor IPC", args.repeats,
                                              lambda: run_child(CHILD_PER_TENSOR_IPC, work, *common))

    def cold_load_file():
        drop_page_cache()
        return run_child(CHILD_LOAD_FILE, work, *common)

    results["load_file_cold"] = repeat("load_file cold", min(args.repeats, 2), cold_load_file)
    results["load_file_warm"] = repeat("load_file warm", min(args.repeats, 3),
                                       lambda: run_child(CHILD_LOAD_FILE, work, *common))
    loads["load_file_cold"] = {"seconds": results["load_file_cold"]["median_ms"] / 1e3}

    vmm_ms = results["attach_cuda_vmm"]["median_ms"]
    report = {
        "benchmark": "gpu_attach",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "safetensors": safetensors.__version__, "cuda_driver": gpu.driver_version()},
        "model": {"tensors": args.tensors, "bytes": status.resident_bytes, "dtype": "BF16", "shards": args.shards},
        "repeats": args.repeats,
        "attach": results,
        "attach_phases_ms": {backend: {key: statistics.median(p[key] for p in runs) for key in runs[0]}
                             for backend, runs in phases.items()},
        "loads": loads,
        "ratios": {
            "per_tensor_ipc_over_vmm_attach": results["per_tensor_legacy_ipc"]["median_ms"] / vmm_ms,
            "load_file_cold_over_daemon_cold_load": loads["load_file_cold"]["seconds"] / status.load_s,
            "daemon_cold_load_share_of_disk_rate": loads["daemon_cold_load"]["gb_per_s"] / loads["disk_read"]["gb_per_s"],
        },
    }
    out = write_report(args.out, f"gpu_attach-{{date}}-{args.gib:g}gib", report)

    print(f"\n{report['device']}; {args.tensors} tensors, {status.resident_bytes / 1e9:.1f} GB bf16")
    print_table(results, "attach_cuda_vmm", "vmm attach")
    print(f"disk read (cold):      {loads['disk_read']['gb_per_s_by_readers']} GB/s")
    print(f"daemon cold load:      {status.load_s:.1f} s ({loads['daemon_cold_load']['gb_per_s']:.2f} GB/s, "
          f"{100 * report['ratios']['daemon_cold_load_share_of_disk_rate']:.0f}% of disk)")
    print(f"load_file cold:        {loads['load_file_cold']['seconds']:.1f} s "
          f"({report['ratios']['load_file_cold_over_daemon_cold_load']:.2f}x the daemon's)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
