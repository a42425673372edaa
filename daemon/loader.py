"""Stream a checkpoint's file ranges into the planned slabs, in parallel, with progress."""

import logging
import os
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

from .layout import SlabPlan

log = logging.getLogger("weightcache.daemon")

# Large enough to stream at disk speed, small enough to spread over the workers.
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class Read:
    path: str
    file_offset: int
    slab: int
    slab_offset: int
    nbytes: int


def plan_reads(plan: SlabPlan, chunk_bytes: int = CHUNK_BYTES) -> list[Read]:
    """Merge tensors that sit back to back both in their file and in their slab into
    one read, then cut reads into chunks so every worker has something to do."""
    merged: list[Read] = []
    for p in plan.placements:
        src = p.source
        if src.nbytes == 0:
            continue
        last = merged[-1] if merged else None
        if (last and last.path == str(src.path) and last.slab == p.slab
                and last.file_offset + last.nbytes == src.offset
                and last.slab_offset + last.nbytes == p.offset):
            merged[-1] = Read(last.path, last.file_offset, last.slab, last.slab_offset, last.nbytes + src.nbytes)
        else:
            merged.append(Read(str(src.path), src.offset, p.slab, p.offset, src.nbytes))
    chunks = []
    for r in merged:
        for start in range(0, r.nbytes, chunk_bytes):
            n = min(chunk_bytes, r.nbytes - start)
            chunks.append(Read(r.path, r.file_offset + start, r.slab, r.slab_offset + start, n))
    return chunks


def fill_slabs(plan: SlabPlan, slabs, *, workers: int = 8, progress_every_s: float = 2.0) -> float:
    """Fill every slab from the files; returns the seconds it took."""
    reads = plan_reads(plan)
    total = sum(r.nbytes for r in reads)
    fds = {path: os.open(path, os.O_RDONLY | os.O_CLOEXEC) for path in {r.path for r in reads}}
    start = time.perf_counter()
    done_bytes = 0
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="load") as pool:
            pending = {pool.submit(slabs[r.slab].write_from_file, fds[r.path], r.file_offset, r.slab_offset, r.nbytes): r
                       for r in reads}
            while pending:
                finished, _ = wait(pending, timeout=progress_every_s, return_when=FIRST_EXCEPTION)
                for future in finished:
                    future.result()  # re-raises a worker's error here
                    done_bytes += pending.pop(future).nbytes
                _log_progress(done_bytes, total, time.perf_counter() - start)
    finally:
        for fd in fds.values():
            os.close(fd)
    return time.perf_counter() - start


def _log_progress(done: int, total: int, elapsed: float) -> None:
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = (total - done) / rate if rate > 0 else None
    log.info("loading", extra={"fields": {
        "bytes": done, "total": total, "percent": round(100 * done / total, 1) if total else 100.0,
        "rate_mb_s": round(rate / 1e6, 1), "eta_s": None if eta is None else round(eta, 1)}})
