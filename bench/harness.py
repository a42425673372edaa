"""What the benchmarks share: a timed child process, repeats, the page cache, the table.

Imported by the scripts beside it (run as files, so their folder is on sys.path).
"""

import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time


def run_child(code: str, work: pathlib.Path, *args, timeout: float = 900, phases: list | None = None) -> float:
    """Run `code` in a fresh interpreter; it prints the milliseconds it measured last.

    A file, not `python -c`: the spawn start method re-imports the child's __main__.
    Lines the child writes to stderr as "phases {json}" are passed on, and kept in
    `phases` when given.
    """
    script = pathlib.Path(work) / "child.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{out.stderr[-4000:]}")
    for line in out.stderr.splitlines():
        if line.startswith("phases "):
            print(f"    {line}", file=sys.stderr, flush=True)
            if phases is not None:
                phases.append(json.loads(line.removeprefix("phases ")))
    return float(out.stdout.strip().splitlines()[-1])


def write_report(out_dir: pathlib.Path, name: str, report: dict) -> pathlib.Path:
    """The run's JSON as bench/results/<name>-<date>.json (or under out_dir)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name.replace('{date}', time.strftime('%Y%m%d'))}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out


def repeat(label: str, n: int, fn) -> dict:
    samples = []
    for i in range(n):
        samples.append(fn())
        print(f"  {label}: {i + 1}/{n}: {samples[-1]:.1f} ms", file=sys.stderr, flush=True)
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "samples_ms": samples}


def stop(proc, timeout: float = 120) -> None:
    """SIGTERM a daemon the benchmark started and wait for it."""
    import signal

    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=timeout)


def drop_page_cache() -> None:
    """Flush dirty pages, then drop the page cache (root only; raises OSError otherwise)."""
    os.sync()
    pathlib.Path("/proc/sys/vm/drop_caches").write_text("3\n")


def print_table(results: dict, baseline: str, baseline_label: str) -> None:
    """Median, min and the ratio to `baseline` for every method in `results`."""
    base = results[baseline]["median_ms"]
    print(f"{'method':<32} {'median ms':>11} {'min ms':>10} {'vs ' + baseline_label:>16}")
    for name, r in results.items():
        print(f"{name:<32} {r['median_ms']:>11.1f} {r['min_ms']:>10.1f} {r['median_ms'] / base:>15.1f}x")


def disk_read_rate(files, workers: int, readers: tuple[int, ...] | None = None) -> dict:
    """Every file read once per reader count, cold cache, 64 MiB reads: by default one
    stream and `workers` threads over 64 MiB chunks, as the daemon's loader reads. The
    fastest is the ceiling."""
    from concurrent.futures import ThreadPoolExecutor

    chunk = 64 << 20
    jobs = [(path, offset) for path in files for offset in range(0, path.stat().st_size, chunk)]
    total = sum(path.stat().st_size for path in files)
    buffers = threading.local()

    def read(job):
        path, offset = job
        if not hasattr(buffers, "view"):
            buffers.view = memoryview(bytearray(chunk))
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.preadv(fd, [buffers.view], offset)
        finally:
            os.close(fd)

    rates = {}
    for threads in readers or (1, workers):
        drop_page_cache()
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            assert sum(pool.map(read, jobs)) == total
        rates["one_stream" if threads == 1 else f"{threads}_threads"] = total / (time.perf_counter() - start) / 1e9
    return {"bytes": total, "gb_per_s_by_readers": rates, "gb_per_s": max(rates.values())}
