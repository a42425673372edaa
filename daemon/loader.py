"""Stream a checkpoint's file ranges into the planned slabs, in parallel, with progress.

The ranges are read from the checkpoint's open files (the ones its headers were
validated in), never from a path opened again: what was checked is what is loaded.
"""

import logging
import pathlib
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

from weightcache.client.errors import CheckpointError
from weightcache.client.modelfiles import ModelFiles

from .layout import SlabPlan

log = logging.getLogger("weightcache.daemon")

# Large enough to stream at disk speed, small enough to spread over the workers.
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class Read:
    """nbytes from a file into a slab; with rows > 1, rows pieces pitch bytes apart in
    the file, packed back to back in the slab."""

    path: str
    file_offset: int
    slab: int
    slab_offset: int
    nbytes: int
    rows: int = 1
    pitch: int = 0


def plan_reads(plan: SlabPlan, chunk_bytes: int = CHUNK_BYTES) -> list[Read]:
    """Merge tensors that sit back to back both in their file and in their slab into
    one read, then cut reads into chunks so every worker has something to do."""
    merged: list[Read] = []
    strided: list[Read] = []
    for p in plan.placements:
        src = p.source
        if src.nbytes == 0:
            continue
        if src.rows > 1:
            strided += _row_chunks(Read(str(src.path), src.offset, p.slab, p.offset, src.nbytes, src.rows, src.pitch),
                                   chunk_bytes)
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
    return chunks + strided


def _row_chunks(r: Read, chunk_bytes: int) -> list[Read]:
    """Cut a strided read into pieces of whole rows that span at most chunk_bytes of file."""
    width = r.nbytes // r.rows
    per_chunk = max(1, chunk_bytes // r.pitch)
    out = []
    for first in range(0, r.rows, per_chunk):
        rows = min(per_chunk, r.rows - first)
        out.append(Read(r.path, r.file_offset + first * r.pitch, r.slab, r.slab_offset + first * width,
                        rows * width, rows, r.pitch))
    return out


def fill_slabs(plan: SlabPlan, slabs, files: ModelFiles, *, workers: int = 8, progress_every_s: float = 2.0,
               on_bytes=lambda nbytes: None) -> float:
    """Fill every slab from FILES (the checkpoint's open files, which stay its to close);
    returns the seconds it took. on_bytes(n) hears of each finished read (the daemon's
    status counts them)."""
    reads = plan_reads(plan)
    total = sum(r.nbytes for r in reads)
    fds = {path: _validated_fd(files, path) for path in {r.path for r in reads}}
    start = time.perf_counter()
    done_bytes = 0
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="load") as pool:
        pending = {pool.submit(_copy, slabs[r.slab], fds[r.path], r): r for r in reads}
        while pending:
            finished, _ = wait(pending, timeout=progress_every_s, return_when=FIRST_EXCEPTION)
            for future in finished:
                future.result()  # re-raises a worker's error here
                nbytes = pending.pop(future).nbytes
                done_bytes += nbytes
                on_bytes(nbytes)
            _log_progress(done_bytes, total, time.perf_counter() - start)
    return time.perf_counter() - start


def _validated_fd(files: ModelFiles, path: str) -> int:
    """The open fd of the checkpoint file a tensor source names (never a new open)."""
    name = pathlib.PurePath(path).name
    if str(files.path(name)) != path:
        raise CheckpointError(f"{path}: not a file of the checkpoint in {files.model_dir}")
    return files.fd(name)


def _copy(slab, fd: int, r: Read) -> None:
    if r.rows > 1:
        slab.write_rows_from_file(fd, r.file_offset, r.pitch, r.nbytes // r.rows, r.rows, r.slab_offset)
    else:
        slab.write_from_file(fd, r.file_offset, r.slab_offset, r.nbytes)


def _log_progress(done: int, total: int, elapsed: float) -> None:
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = (total - done) / rate if rate > 0 else None
    log.info("loading", extra={"fields": {
        "bytes": done, "total": total, "percent": round(100 * done / total, 1) if total else 100.0,
        "rate_mb_s": round(rate / 1e6, 1), "eta_s": None if eta is None else round(eta, 1)}})
