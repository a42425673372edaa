"""`python -m weightcache.tp_engine`: a tensor-parallel Llama engine, one process per rank.

Each rank gets its shard either by attaching to its own device's cache (`--source
cache`: the GPU's UUID, or "cpu", with Parallelism(world size, rank); the daemon
socket named for that fingerprint is found among all of the cache directory's) or
from disk, cut by the same plan (`--source disk`). Then every rank runs the forward
pass of weightcache.llama_tp on the same tokens; rank 0 gathers the logits, checks
that the ranks agree, writes them (--logits-out) and prints one JSON report.

Ranks synchronise on a barrier before they ask for weights, so the report's
`load_wall_ms` is the wall time from that common start until the last rank held its
weights (every process has its device context and its imports done before it).

Processes come from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), or from `--nproc N`, which starts N ranks on this host.
GPUs use NCCL and rank r's `cuda:LOCAL_RANK`; `--device cpu` uses gloo. A rank that
cannot get its weights says why, and every rank exits 1 (none waits forever).
"""

import argparse
import hashlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

EXIT_FAILED = 1


def _die_with_parent() -> None:
    """In a rank, before exec: SIGTERM when the launcher dies, however it dies, so that no
    rank is left waiting in a collective for a group that is gone."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def launch_ranks(command: list[str], world_size: int, env: dict | None = None, **popen) -> list[subprocess.Popen]:
    """Start `command` once per rank on this host, with the torchrun environment."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**(os.environ if env is None else env), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size)}
    return [subprocess.Popen(command, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                             preexec_fn=_die_with_parent, **popen)
            for r in range(world_size)]


def report_from(stdout: str) -> dict:
    """The JSON report in an engine's output (other lines, such as NCCL's, may surround it)."""
    lines = [line for line in stdout.splitlines() if line.startswith('{"source"')]
    if not lines:
        raise ValueError(f"no tp_engine report in its output: {stdout[-2000:]!r}")
    return json.loads(lines[-1])


def wait_ranks(procs: list[subprocess.Popen]) -> int:
    """Wait for every rank; when one fails, stop the others (they would wait for it in a
    collective). Returns the first failure's exit code, or 0."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    failed = 0
    with ThreadPoolExecutor(len(procs)) as pool:
        pending = {pool.submit(p.wait): p for p in procs}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                code = pending.pop(future).returncode
                if code and not failed:
                    failed = code if code > 0 else EXIT_FAILED
                    for other in pending.values():
                        other.terminate()
    return failed


def _device(kind: str, local_rank: int) -> tuple[str, str]:
    """(torch device, weightcache device name) of this rank: cuda:LOCAL_RANK and its
    UUID, or cpu. Imports the driver bindings now, as an engine's start-up would."""
    if kind == "cpu":
        return "cpu", "cpu"
    import importlib

    import torch

    from weightcache.client.load import resolve_device

    importlib.import_module("weightcache.client.gpu")  # the driver bindings: start-up, not the attach's

    torch.cuda.set_device(local_rank)
    torch.empty(1, device=f"cuda:{local_rank}")  # this rank's context, before the clock
    return f"cuda:{local_rank}", resolve_device(f"cuda:{local_rank}")


def _get_weights(args, parallel, torch_device: str, wc_device: str) -> tuple[dict, dict]:
    """(tensors, what to report of how they came)."""
    from weightcache.client import attach, load_from_disk

    if args.source == "cache":
        attached = attach(args.model, socket_dir=args.socket_dir, cache_name=args.cache, device=wc_device,
                          parallel=parallel, timeout=args.timeout)
        return attached.tensors, {"socket": attached.socket_path, "backend": attached.backend,
                                  "resident_bytes": attached.resident_bytes, "attach_ms": attached.attach_ms,
                                  "phases_ms": attached.phases_ms, "_keep": attached}
    return load_from_disk(args.model, device=torch_device, parallel=parallel, tp_plan=args.tp_plan), {}


def shard_differences(mine: dict, reference: dict) -> list[str]:
    """Names whose dtype, shape or bytes differ, and names on one side only."""
    import torch

    problems = [f"{n}: only in the reference" for n in sorted(set(reference) - set(mine))]
    problems += [f"{n}: not in the reference" for n in sorted(set(mine) - set(reference))]
    for name in sorted(set(mine) & set(reference)):
        a, b = mine[name], reference[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(f"{name}: {tuple(a.shape)} {a.dtype} vs reference {tuple(b.shape)} {b.dtype}")
        elif not torch.equal(a.contiguous().view(torch.uint8), b.to(a.device).contiguous().view(torch.uint8)):
            problems.append(f"{name}: bytes differ")
    return problems


def _fail_together(dist, error: str | None) -> list:
    """Every rank's error (or None), known to all: a rank that failed still joins the
    collective, so the others stop instead of waiting for it."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return errors


def run(args) -> int:
    import torch
    import torch.distributed as dist

    from weightcache.client import Parallelism, load_from_disk
    from weightcache.client.modelfiles import read_config

    from .llama_tp import LlamaShape, compute_weights, forward

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    torch_device, wc_device = _device(args.device, local)
    if args.device == "cpu":
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device(torch_device))
    try:
        config = read_config(pathlib.Path(args.model))
        shape = LlamaShape.from_config(config, world)
        parallel = Parallelism(tp_size=world, tp_rank=rank)
        dist.barrier()
        start = time.monotonic()
        error, tensors, info = None, {}, {}
        try:
            tensors, info = _get_weights(args, parallel, torch_device, wc_device)
            if torch_device != "cpu":
                torch.cuda.synchronize()
        except Exception as exc:  # reported by every rank below, instead of one rank hanging the group
            error = f"rank {rank}: {type(exc).__name__}: {exc}"
        end = time.monotonic()
        errors = _fail_together(dist, error)
        if any(errors):
            if rank == 0:
                print("\n".join(e for e in errors if e), file=sys.stderr)
            return EXIT_FAILED
        mine = {"rank": rank, "device": wc_device, "start": start, "end": end, "load_ms": (end - start) * 1e3,
                "tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                **{k: v for k, v in info.items() if not k.startswith("_")}}
        if args.verify_shards:
            mine["shard_problems"] = shard_differences(tensors, load_from_disk(
                args.model, device=torch_device, parallel=parallel, tp_plan=args.tp_plan))[:20]
        tokens = torch.randint(0, config["vocab_size"], (args.batch, args.seq),
                               generator=torch.Generator().manual_seed(args.seed)).to(torch_device)
        with torch.inference_mode():
            logits = forward(compute_weights(tensors, config), shape, tokens, dist.all_reduce)
        gathered = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(gathered, logits)
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
        if rank == 0:
            _report(args, logits, gathered, ranks)
        return 0
    finally:
        dist.destroy_process_group()


def _report(args, logits, gathered, ranks) -> None:
    import torch

    as_bits = logits.cpu().contiguous().view(torch.int16 if logits.element_size() == 2 else torch.uint8)
    if args.logits_out:
        torch.save(logits.cpu(), args.logits_out)
    report = {
        "source": args.source, "tp_size": len(ranks), "device": args.device, "model": str(args.model),
        "load_wall_ms": (max(r["end"] for r in ranks) - min(r["start"] for r in ranks)) * 1e3,
        "ranks_agree": all(torch.equal(g.view(as_bits.dtype).cpu(), as_bits) for g in gathered),
        "logits_sha256": hashlib.sha256(as_bits.numpy().tobytes()).hexdigest(),
        "logits_finite": bool(torch.isfinite(logits).all()),
        "ranks": [{k: v for k, v in r.items() if k not in ("start", "end")} for r in ranks],
    }
    if args.verify_shards:
        report["shards_match_disk"] = not any(r["shard_problems"] for r in ranks)
    print(json.dumps(report, default=str))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m weightcache.tp_engine", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, type=pathlib.Path, help="model directory (config.json, *.safetensors)")
    p.add_argument("--source", required=True, choices=["cache", "disk"], help="attach to the cache, or load from disk")
    p.add_argument("--socket-dir", type=pathlib.Path, help="the daemons' socket directory (--source cache)")
    p.add_argument("--cache", help="cache name (default: whichever socket serves this rank's fingerprint)")
    p.add_argument("--tp-plan", type=pathlib.Path, help="plan file for --source disk (default: the config's)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda (NCCL, cuda:LOCAL_RANK) or cpu (gloo)")
    p.add_argument("--nproc", type=int, help="start this many ranks here (instead of a torchrun environment)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    p.add_argument("--verify-shards", action="store_true",
                   help="also load each rank's shard from disk and compare every tensor's bytes")
    p.add_argument("--logits-out", type=pathlib.Path, help="rank 0 saves the logits here (torch.save)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a daemon's answer")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.source == "cache" and args.socket_dir is None:
        parser().error("--source cache needs --socket-dir")
    if "RANK" not in os.environ:
        if not args.nproc:
            parser().error("no torchrun environment (RANK, WORLD_SIZE, ...): pass --nproc N to start N ranks here")
        return wait_ranks(launch_ranks([sys.executable, "-m", "weightcache.tp_engine", *argv], args.nproc))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
