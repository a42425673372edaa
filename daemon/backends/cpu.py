"""`cpu`: slabs are sealed memfds, mapped read-only by engines.

Runs on any Linux machine with the same protocol as the GPU backends, which makes it
the embedded default for CI and the demo. Sealing (no writes, no resizing) lets the
kernel, not engine discipline, guarantee nobody changes the bytes after loading.
"""

import fcntl
import mmap
import os

from weightcache.client.errors import CheckpointError
from weightcache.client.fingerprint import Device

from .base import Backend, SealRefused, Slab

# The size is fixed from the start (a writer filling a published slab must not resize
# it behind the daemon's back); writes and further seals end when the slab is sealed.
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_SEALS = _SIZE_SEALS | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


def _read_fully(fd: int, target: memoryview, file_offset: int) -> None:
    done, nbytes = 0, len(target)
    while done < nbytes:
        n = os.preadv(fd, [target[done:]], file_offset + done)
        if n == 0:
            raise CheckpointError(f"file ended {nbytes - done} bytes early at offset {file_offset + done}; "
                                  "was it changed while loading?")
        done += n


class MemfdSlab(Slab):
    def __init__(self, size: int, label: str):
        self.size = size
        self._fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, size)
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)
            self._map = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self._fd)
            raise
        self._view = memoryview(self._map)

    def write_from_file(self, fd, file_offset, slab_offset, nbytes):
        _read_fully(fd, self._view[slab_offset:slab_offset + nbytes], file_offset)

    def write_rows_from_file(self, fd, file_offset, pitch, width, rows, slab_offset):
        import numpy as np

        span = (rows - 1) * pitch + width
        region = bytearray(span)
        _read_fully(fd, memoryview(region), file_offset)
        src = np.lib.stride_tricks.as_strided(np.frombuffer(region, dtype=np.uint8), (rows, width), (pitch, 1))
        dst = np.frombuffer(self._view[slab_offset:slab_offset + rows * width], dtype=np.uint8).reshape(rows, width)
        dst[:] = src

    def seal(self):
        # F_SEAL_WRITE is refused while a writable shared mapping exists: drop ours first.
        if self._map is not None:
            self._view.release()
            self._map.close()
            self._map = None
        try:
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, _SEALS)
        except PermissionError:  # somebody else added F_SEAL_SEAL first
            raise SealRefused("its seals were locked by another process (F_SEAL_SEAL) before the daemon sealed it")
        except OSError as exc:  # EBUSY: a writable shared mapping remains, in a writer
            raise SealRefused(f"{exc.strerror}: a process still maps it writable; unmap every slab before "
                              "committing") from None
        seals, actual = fcntl.fcntl(self._fd, fcntl.F_GET_SEALS), os.fstat(self._fd).st_size
        if seals & _SEALS != _SEALS or actual != self.size:
            raise SealRefused(f"it holds {actual} bytes with seals {seals:#x}; expected {self.size} bytes sealed "
                              f"{_SEALS:#x}")

    def export_fd(self):
        return self._fd

    def close(self):
        os.close(self._fd)


class CpuBackend(Backend):
    name = "cpu"
    device = "cpu"

    def allocate(self, size, label):
        return MemfdSlab(size, label)

    def fingerprint_device(self):
        return Device(kind="cpu")
