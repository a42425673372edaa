"""Engine-published caches on the GPU: publish and attach times for a fused-layout model
(vLLM's shape of tensors: fused q/k/v and gate/up, padded vocabulary) on cuda-vmm,
against what an engine would otherwise do on a restart, in the same run: share every
tensor through legacy CUDA IPC (vLLM's and SGLang's own caches) or load its
safetensors again (cold and warm). Medians of fresh processes.

    python bench/gpu_publish.py --gib 16 --repeats 5 --work . --out bench/results

The engine is tests/gpu/fused_engine.py (the GPU tests use it too). Prints a table and
writes bench/results/gpu_publish-<date>-<gib>gib.json.
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

from harness import drop_page_cache, print_table, repeat, run_child, stop, write_report

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENGINE = ROOT / "tests" / "gpu" / "fused_engine.py"
CACHE = "fused"

# Legacy CUDA IPC per tensor, as vLLM's ipc_cache and SGLang's weight cache share.
CHILD_PER_TENSOR_IPC = """
import sys, time, torch, torch.multiprocessing as mp
sys.path.insert(0, sys.argv[2])
from fused_engine import fused_tensors

def producer(gib, queue, go):
    tensors = fused_tensors(gib)
    torch.cuda.synchronize()
    go.send("made")
    go.recv()
    queue.put(tensors)
    go.recv()

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    queue, (mine, theirs) = ctx.Queue(), ctx.Pipe()
    p = ctx.Process(target=producer, args=(float(sys.argv[1]), queue, theirs))
    p.start()
    torch.cuda.init(); torch.empty(1, device="cuda")
    assert mine.recv() == "made"
    t = time.perf_counter()
    mine.send("go")
    tensors = queue.get()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    del tensors
    mine.send("done")
    p.join()
    print(ms)
"""

CHILD_SAVE = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from fused_engine import fused_tensors
from safetensors.torch import save_file
save_file({k: v.cpu() for k, v in fused_tensors(float(sys.argv[1])).items()}, sys.argv[3])
print(0)
"""

CHILD_LOAD_FILE = """
import sys, time, torch
from safetensors.torch import load_file
torch.cuda.init(); torch.empty(1, device="cuda")
t = time.perf_counter()
tensors = load_file(sys.argv[3], device="cuda")
torch.cuda.synchronize()
print((time.perf_counter() - t) * 1e3)
"""


def engine(mode: str, model_dir, socket_dir, gib: float) -> dict:
    out = subprocess.run([sys.executable, str(ENGINE), mode, str(model_dir), str(socket_dir), CACHE, str(gib)],
                         input=b"", capture_output=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"fused engine ({mode}) failed:\n{out.stderr.decode()[-4000:]}")
    return json.loads(out.stdout.splitlines()[0])


def start_store(socket_dir, device, log_path):
    from weightcache.client.spawn import spawn_daemon

    with open(log_path, "ab") as log:
        return spawn_daemon(None, socket_dir, CACHE, ["--backend", "cuda-vmm", "--device", device,
                                                      "--allow-publish-uid", str(os.geteuid())],
                            stderr=log, timeout=300)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir()))
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()

    import safetensors
    import torch
    from weightcache.client import gpu

    from weightcache.synthetic import write_model

    device = gpu.device_uuid(0)
    work = pathlib.Path(tempfile.mkdtemp(prefix="wcp-", dir=args.work))
    model = write_model(work / "identity", {"w": ("BF16", (16, 16))})  # the checkpoint identity in the fingerprint
    results, publishes, outputs = {}, [], set()

    def publish_once() -> float:
        store = start_store(work / "s", device, work / "store.log")
        try:
            answer = engine("publish", model, work / "s", args.gib)
        finally:
            stop(store)
        assert answer["source"] == "published" and answer["output"] == answer["own_output"]
        publishes.append(answer)
        return answer["publish_ms"]

    results["publish"] = repeat("publish (fill + commit)", min(args.repeats, 3), publish_once)

    store = start_store(work / "s", device, work / "store.log")
    first = engine("publish", model, work / "s", args.gib)
    attaches = []

    def attach_once() -> float:
        answer = engine("attach", model, work / "s", args.gib)
        attaches.append(answer)
        outputs.add(answer["output"])
        return answer["attach_ms"]

    results["attach_cuda_vmm"] = repeat("attach cuda-vmm", args.repeats, attach_once)
    stop(store)
    assert outputs == {first["output"]}, "an attached engine computed other logits than the writer"

    results["per_tensor_legacy_ipc"] = repeat("per-tensor IPC", args.repeats, lambda: run_child(
        CHILD_PER_TENSOR_IPC, work, args.gib, ENGINE.parent))
    checkpoint = work / "fused.safetensors"
    run_child(CHILD_SAVE, work, args.gib, ENGINE.parent, checkpoint)

    def cold() -> float:
        drop_page_cache()
        return run_child(CHILD_LOAD_FILE, work, args.gib, ENGINE.parent, checkpoint)

    results["load_file_cold"] = repeat("load_file cold", min(args.repeats, 2), cold)
    results["load_file_warm"] = repeat("load_file warm", min(args.repeats, 3), lambda: run_child(
        CHILD_LOAD_FILE, work, args.gib, ENGINE.parent, checkpoint))
    checkpoint.unlink()

    attach_ms = results["attach_cuda_vmm"]["median_ms"]
    report = {
        "benchmark": "gpu_publish",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "safetensors": safetensors.__version__, "cuda_driver": gpu.driver_version()},
        "model": {"layout": "fused qkv_proj / gate_up_proj, padded vocab (tests/gpu/fused_engine.py)",
                  "tensors": first["tensors"], "bytes": first["bytes"], "dtype": "BF16"},
        "repeats": args.repeats,
        "results": results,
        "publish_phases_ms": {k: statistics.median(p["phases_ms"][k] for p in publishes)
                              for k in publishes[0]["phases_ms"]},
        "attach_phases_ms": {k: statistics.median(a["phases_ms"][k] for a in attaches) for k in attaches[0]["phases_ms"]},
        "outputs_identical": True,
        "ratios": {name: r["median_ms"] / attach_ms for name, r in results.items() if name != "attach_cuda_vmm"},
    }
    out = write_report(args.out, f"gpu_publish-{{date}}-{args.gib:g}gib", report)
    print(f"\n{report['device']}; {first['tensors']} fused tensors, {first['bytes'] / 2**30:.1f} GiB bf16")
    print_table(results, "attach_cuda_vmm", "vmm attach")
    print(f"logits of every attached engine identical to the writer's: {report['outputs_identical']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
