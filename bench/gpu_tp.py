"""Multi-GPU tensor-parallel benchmark, in one run: a Llama checkpoint (70B-shaped
layers, bf16, >= --gib) written once, then for each TP size:

  daemon cold load    ONE daemon, --device all --tp-size T, every GPU loading its shard
                      in parallel, page cache dropped; vs the disk's read rate
  attach, all ranks   weightcache.tp_engine --source cache: T ranks (NCCL) attach at once
                      to their own GPU's cache; wall time from a common barrier until the
                      last rank holds its views. The first run also compares every shard
                      with the disk's bytes and runs the forward pass
  per-tensor IPC      T ranks at once, each receiving its shard from a process that holds
                      it, one legacy CUDA IPC handle per tensor (torch reduce_tensor)
  disk, all ranks     tp_engine --source disk: each rank reads its shard (same plan),
                      page cache dropped (cold); warm at the end of the run
  bit-identity        the logits of the attached engine == those of the disk engine

and a block-wise FP8 variant (few layers) for correctness at the largest TP size.
Each measurement runs in fresh processes. Progress is printed with timestamps and
the JSON is rewritten after every step, so a run cut short still tells where it was.
Needs root (drop_caches) and >= 2 GPUs.

    python3 bench/gpu_tp.py --gib 40 --work . --out $OUT
"""

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from harness import disk_read_rate, drop_page_cache, print_table, write_report

ROOT = pathlib.Path(__file__).resolve().parents[1]
STARTED = time.monotonic()
# Llama-3-70B's layer shapes: every split (heads, key/value heads, FP8 blocks) divides by 8.
SHAPE = {"hidden_size": 8192, "intermediate_size": 28672, "heads": 64, "kv_heads": 8, "vocab_size": 128256}
# The disk's cold read rate is measured on this much of the checkpoint: a sequential rate
# needs no more, and the run's time goes to the daemon's and the engines' cold loads.
DISK_SAMPLE_BYTES = 16 << 30
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

CHILD_PER_TENSOR_IPC = """
import json, os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp

def producer(model_dir, socket_dir, rank, world, queue, pipe):
    # The shard in ordinary cudaMalloc'd memory, as an engine that loaded it holds it.
    from weightcache.client import Parallelism, attach
    from weightcache.client.load import resolve_device
    torch.cuda.set_device(rank)
    with attach(model_dir, socket_dir=socket_dir, device=resolve_device(f"cuda:{rank}"),
                parallel=Parallelism(tp_size=world, tp_rank=rank)) as attached:
        tensors = {name: t.clone() for name, t in attached.tensors.items()}
    torch.cuda.synchronize()
    pipe.send("loaded")
    pipe.recv()
    queue.put(tensors)
    pipe.recv()

if __name__ == "__main__":
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ctx = mp.get_context("spawn")
    queue, (mine, theirs) = ctx.Queue(), ctx.Pipe()
    p = ctx.Process(target=producer, args=(sys.argv[1], sys.argv[2], rank, world, queue, theirs))
    p.start()
    torch.cuda.set_device(rank)
    torch.empty(1, device="cuda")
    dist.init_process_group("gloo")  # a barrier and the gathering of timings only
    assert mine.recv() == "loaded"
    dist.barrier()
    start = time.monotonic()
    mine.send("go")
    tensors = queue.get()
    torch.cuda.synchronize()
    end = time.monotonic()
    spans = [None] * world
    dist.all_gather_object(spans, (start, end, len(tensors)))
    del tensors
    mine.send("done")
    p.join()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"load_wall_ms": (max(s[1] for s in spans) - min(s[0] for s in spans)) * 1e3,
                          "tensors": [s[2] for s in spans]}))
"""


def log(message: str) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
    print(f"[{stamp} +{time.monotonic() - STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


def llama_config_for(gib: float, fp8: bool = False, layers: int | None = None) -> dict:
    """A Llama of SHAPE's layers, with as many layers as reach `gib` GiB (bf16)."""
    from weightcache.synthetic_llama import llama_config

    h, i, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    kv_out = SHAPE["kv_heads"] * h // SHAPE["heads"]
    per_layer = 2 * (2 * h * h + 2 * kv_out * h + 3 * h * i + 2 * h)
    if layers is None:
        layers = max(1, math.ceil((gib * (1 << 30) - 2 * 2 * v * h) / per_layer))
    return llama_config(hidden_size=h, intermediate_size=i, layers=layers, heads=SHAPE["heads"],
                        kv_heads=SHAPE["kv_heads"], vocab_size=v, fp8=fp8)


def sample_files(files: list[pathlib.Path], at_least: int) -> list[pathlib.Path]:
    """The first files that hold at_least bytes (all of them if they hold less)."""
    chosen, size = [], 0
    for path in files:
        if size >= at_least:
            break
        chosen.append(path)
        size += path.stat().st_size
    return chosen


def checkpoint_bytes(model: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in model.glob("*.safetensors"))


def write_model(path: pathlib.Path, config: dict) -> dict:
    import torch

    from weightcache.synthetic_llama import write_llama

    start = time.perf_counter()
    write_llama(path, config, device="cuda", on_shard=lambda name: log(f"  wrote {name}"))
    seconds = time.perf_counter() - start
    torch.cuda.empty_cache()  # the generator's blocks go back to GPU 0 before the daemon needs it
    size = checkpoint_bytes(path)
    log(f"wrote {path.name}: {size / 1e9:.1f} GB, {config['num_hidden_layers']} layers in {seconds:.0f} s")
    return {"bytes": size, "layers": config["num_hidden_layers"], "write_s": seconds,
            "quantization": "fp8-block" if "quantization_config" in config else "none"}


def start_daemon(model, sockets, name: str, tp: int, log_path: pathlib.Path, workers: int) -> tuple:
    """One daemon for every GPU (--device all), device i serving rank i % tp. Returns
    (process, seconds to ready, each device's load)."""
    from weightcache.client import query_status
    from weightcache.client.attach import list_sockets
    from weightcache.client.spawn import spawn_daemon

    with open(log_path, "wb") as log_file:
        start = time.perf_counter()
        proc = spawn_daemon(model, sockets, name, ["--backend", "cuda-vmm", "--device", "all", "--tp-size", str(tp),
                                                   "--load-workers", str(workers)], stderr=log_file, timeout=300)
        wall = time.perf_counter() - start
    devices = []
    for path in list_sockets(sockets, name):
        status = query_status(path)
        devices.append({"device": status.device, "tp_rank": status.fingerprint.tp_rank, "load_s": status.load_s,
                        "bytes": status.resident_bytes})
    return proc, wall, sorted(devices, key=lambda d: d["device"])


def stop_daemon(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


def run_engine(model, source: str, tp: int, log_path: pathlib.Path, *extra) -> dict:
    """weightcache.tp_engine with tp ranks on GPUs 0..tp-1; its report."""
    from weightcache.tp_engine import report_from

    with open(log_path, "ab") as log_file:
        out = subprocess.run([sys.executable, "-m", "weightcache.tp_engine", "--model", str(model), "--source", source,
                              "--device", "cuda", "--nproc", str(tp), *map(str, extra)],
                             stdout=subprocess.PIPE, stderr=log_file, timeout=300, env={**os.environ, **NO_MULTICAST})
    if out.returncode != 0:
        raise RuntimeError(f"tp_engine --source {source} failed ({out.returncode}); see {log_path}:\n"
                           + log_path.read_text()[-3000:])
    return report_from(out.stdout.decode())


def run_per_tensor_ipc(model, sockets, tp: int, work: pathlib.Path, log_path: pathlib.Path) -> dict:
    from weightcache.tp_engine import launch_ranks, wait_ranks

    script = work / "per_tensor_ipc.py"
    script.write_text(CHILD_PER_TENSOR_IPC)
    report = work / "per_tensor_ipc.json"
    with open(log_path, "ab") as log_file, open(report, "wb") as out:
        procs = launch_ranks([sys.executable, str(script), str(model), str(sockets)], tp,
                             env={**os.environ, **NO_MULTICAST}, stdout=out, stderr=log_file)
        code = wait_ranks(procs)
    if code:
        raise RuntimeError(f"per-tensor IPC ranks failed ({code}); see {log_path}:\n" + log_path.read_text()[-3000:])
    return json.loads(report.read_text().strip().splitlines()[-1])


def logits_identical(a: pathlib.Path, b: pathlib.Path) -> bool:
    import torch

    x, y = torch.load(a), torch.load(b)
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(torch.int16), y.view(torch.int16))


def summary(samples: list[float]) -> dict:
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "samples_ms": samples}


class Run:
    """The report, rewritten after every step."""

    def __init__(self, out: pathlib.Path, name: str, report: dict):
        self.out, self.name, self.report = out, name, report

    def save(self) -> pathlib.Path:
        return write_report(self.out, self.name, self.report)


def bench_tp(run: Run, tp: int, model, work, logs, args) -> dict:
    """Every measurement of one TP size; the results as they come, in run.report."""
    result = run.report["tp"].setdefault(str(tp), {})
    sockets, attach_ms, identical = work / f"s{tp}", [], {}
    drop_page_cache()
    log(f"TP={tp}: daemon cold load, one daemon for every GPU")
    daemon, wall, devices = start_daemon(model, sockets, f"tp{tp}", tp, logs / f"daemon-tp{tp}.log", args.load_workers)
    load_s = max(d["load_s"] for d in devices)
    result["daemon_cold_load"] = {
        "wall_to_ready_s": wall, "load_s": load_s, "devices": devices,
        "checkpoint_gb_per_s": run.report["model"]["bytes"] / load_s / 1e9,
        "device_bytes_gb_per_s": sum(d["bytes"] for d in devices) / load_s / 1e9}
    disk = run.report.get("disk_read", {}).get("gb_per_s")
    if disk:
        result["daemon_cold_load"]["share_of_disk_rate"] = result["daemon_cold_load"]["checkpoint_gb_per_s"] / disk
    log(f"  loaded in {load_s:.1f} s ({result['daemon_cold_load']['checkpoint_gb_per_s']:.2f} GB/s of checkpoint), "
        f"ready after {wall:.1f} s")
    run.save()
    try:
        for i in range(args.repeats):
            first = i == 0
            extra = ["--verify-shards", "--logits-out", work / f"cache-tp{tp}.pt"] if first else []
            report = run_engine(model, "cache", tp, logs / f"engine-tp{tp}.log", "--socket-dir", sockets, *extra)
            attach_ms.append(report["load_wall_ms"])
            log(f"  attach, {tp} ranks: {attach_ms[-1]:.1f} ms "
                f"(per rank {[round(r['attach_ms'], 1) for r in report['ranks']]})")
            if first:
                result["attach_first_run"] = {k: report[k] for k in ("ranks", "ranks_agree", "shards_match_disk",
                                                                     "logits_finite", "logits_sha256")}
                log(f"  shards match disk: {report['shards_match_disk']}, ranks agree: {report['ranks_agree']}")
            result["attach_all_ranks"] = summary(attach_ms)
            run.save()

        drop_page_cache()
        report = run_engine(model, "disk", tp, logs / f"engine-tp{tp}.log", "--logits-out", work / f"disk-tp{tp}.pt")
        result["disk_all_ranks_cold"] = summary([report["load_wall_ms"]])
        identical["bf16"] = logits_identical(work / f"cache-tp{tp}.pt", work / f"disk-tp{tp}.pt")
        result["logits_identical_attach_vs_disk"] = identical["bf16"]
        log(f"  disk cold, {tp} ranks: {report['load_wall_ms'] / 1e3:.1f} s; logits identical: {identical['bf16']}")
        run.save()

        ipc = []
        for _ in range(args.ipc_repeats):
            ipc.append(run_per_tensor_ipc(model, sockets, tp, work, logs / f"ipc-tp{tp}.log")["load_wall_ms"])
            log(f"  per-tensor IPC, {tp} ranks: {ipc[-1]:.1f} ms")
            result["per_tensor_ipc_all_ranks"] = summary(ipc)
            run.save()
    finally:
        stop_daemon(daemon)
    return result


def bench_disk_warm(run: Run, tp: int, model, logs) -> None:
    """Each rank's shard from the page cache (last: the least needed figure)."""
    report = run_engine(model, "disk", tp, logs / f"engine-tp{tp}.log")
    run.report["tp"][str(tp)]["disk_all_ranks_warm"] = summary([report["load_wall_ms"]])
    log(f"TP={tp}: disk warm, {tp} ranks: {report['load_wall_ms'] / 1e3:.1f} s")
    run.save()


def bench_fp8(run: Run, tp: int, work, logs, args) -> None:
    config = llama_config_for(0, fp8=True, layers=args.fp8_layers)
    model = work / "llama-fp8"
    run.report["fp8"] = {"tp": tp, "model": write_model(model, config)}
    run.save()
    sockets = work / "s-fp8"
    daemon, wall, devices = start_daemon(model, sockets, "fp8", tp, logs / "daemon-fp8.log", args.load_workers)
    try:
        run.report["fp8"]["daemon"] = {"wall_to_ready_s": wall, "devices": devices}
        cached = run_engine(model, "cache", tp, logs / "engine-fp8.log", "--socket-dir", sockets, "--verify-shards",
                            "--logits-out", work / "cache-fp8.pt")
        run_engine(model, "disk", tp, logs / "engine-fp8.log", "--logits-out", work / "disk-fp8.pt")
    finally:
        stop_daemon(daemon)
    run.report["fp8"].update({
        "shards_match_disk": cached["shards_match_disk"], "ranks_agree": cached["ranks_agree"],
        "logits_finite": cached["logits_finite"],
        "logits_identical_attach_vs_disk": logits_identical(work / "cache-fp8.pt", work / "disk-fp8.pt")})
    log(f"FP8 (TP={tp}): shards match disk: {cached['shards_match_disk']}, logits identical: "
        f"{run.report['fp8']['logits_identical_attach_vs_disk']}")
    run.save()


def print_summary(report: dict) -> None:
    print(f"\n{report['device']} x{report['gpus']}; {report['model']['bytes'] / 1e9:.1f} GB bf16 "
          f"({report['model']['layers']} layers); disk {report.get('disk_read', {}).get('gb_per_s', 0):.2f} GB/s")
    for tp, r in report["tp"].items():
        print(f"\nTP={tp}")
        methods = {k: r[k] for k in ("attach_all_ranks", "per_tensor_ipc_all_ranks", "disk_all_ranks_cold",
                                     "disk_all_ranks_warm") if k in r}
        if "attach_all_ranks" in methods:
            print_table(methods, "attach_all_ranks", "attach")
        load = r.get("daemon_cold_load")
        if load:
            share = load.get("share_of_disk_rate")
            print(f"daemon cold load: {load['load_s']:.1f} s, {load['checkpoint_gb_per_s']:.2f} GB/s"
                  + (f" ({100 * share:.0f}% of disk)" if share else ""))
        print(f"logits attach == disk: {r.get('logits_identical_attach_vs_disk')}; "
              f"shards == disk: {r.get('attach_first_run', {}).get('shards_match_disk')}")
    if "fp8" in report:
        print(f"\nFP8 (TP={report['fp8']['tp']}): shards == disk: {report['fp8'].get('shards_match_disk')}; "
              f"logits attach == disk: {report['fp8'].get('logits_identical_attach_vs_disk')}")


def default_tp_sizes(gpus: int) -> list[int]:
    return [t for t in (2, 4, 8) if t <= gpus and gpus % t == 0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=40.0, help="bf16 checkpoint size to reach, GiB (default 40)")
    parser.add_argument("--tp-sizes", type=lambda s: [int(t) for t in s.split(",")],
                        help="comma-separated TP sizes (default: 2, 4, 8 where they divide the GPU count)")
    parser.add_argument("--repeats", type=int, default=3, help="attach runs per TP size")
    parser.add_argument("--ipc-repeats", type=int, default=2, help="per-tensor IPC runs per TP size")
    parser.add_argument("--fp8-layers", type=int, default=4, help="layers of the FP8 variant (0: skip it)")
    parser.add_argument("--load-workers", type=int, default=16)
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir()))
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    import safetensors
    import torch

    from weightcache.client import gpu

    gpus = torch.cuda.device_count()
    tp_sizes = args.tp_sizes or default_tp_sizes(gpus)
    if gpus < 2 or not tp_sizes or any(t < 2 or gpus % t for t in tp_sizes):
        print(f"needs >= 2 GPUs and TP sizes of 2 or more that divide their count; found {gpus} GPU(s), "
              f"TP sizes {tp_sizes}", file=sys.stderr)
        return 2
    work = pathlib.Path(tempfile.mkdtemp(prefix="wctp-", dir=args.work))
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    run = Run(args.out, f"gpu_tp-{{date}}-{args.gib:g}gib", {
        "benchmark": "gpu_tp", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True).stdout.splitlines()[0],
        "gpus": gpus, "versions": {"python": platform.python_version(), "torch": torch.__version__,
                                   "safetensors": safetensors.__version__, "cuda_driver": gpu.driver_version(),
                                   "nccl": str(torch.cuda.nccl.version())},
        "repeats": {"attach": args.repeats, "per_tensor_ipc": args.ipc_repeats, "disk_cold": 1, "disk_warm": 1},
        "tp": {}})
    log(f"{gpus} GPUs, TP sizes {tp_sizes}; writing the bf16 checkpoint under {work}")
    model = work / "llama-bf16"
    run.report["model"] = write_model(model, llama_config_for(args.gib))
    run.save()
    run.report["disk_read"] = disk_read_rate(sample_files(sorted(model.glob("*.safetensors")), DISK_SAMPLE_BYTES),
                                             args.load_workers, readers=(args.load_workers,))
    log(f"disk read, cold: {run.report['disk_read']['gb_per_s']:.2f} GB/s")
    run.save()
    for tp in tp_sizes:
        bench_tp(run, tp, model, work, logs, args)
    if args.fp8_layers:
        bench_fp8(run, max(tp_sizes), work, logs, args)
    for tp in tp_sizes:
        bench_disk_warm(run, tp, model, logs)
    out = run.save()
    print_summary(run.report)
    print(f"wrote {out}")
    ok = all(r.get("logits_identical_attach_vs_disk") and r.get("attach_first_run", {}).get("shards_match_disk")
             for r in run.report["tp"].values())
    ok = ok and (not args.fp8_layers or (run.report["fp8"]["logits_identical_attach_vs_disk"]
                                         and run.report["fp8"]["shards_match_disk"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
