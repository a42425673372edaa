"""The page cache, for measurements: evict a model's files from it, and see how much of
them it holds. Neither needs root: eviction asks the kernel with
posix_fadvise(POSIX_FADV_DONTNEED) per file, after fsync (dirty pages cannot be dropped);
residency is mincore(2) over a read-only mapping of each file.

Pages that some process still maps are not evicted; `resident_fraction` after
`evict` says whether it worked, so a "cold" figure can say how cold it was.
"""

import ctypes
import ctypes.util
import mmap
import os
import pathlib

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
_MAP_FAILED = ctypes.c_void_p(-1).value
_LOW_BIT = bytes(b & 1 for b in range(256))


def evict(paths) -> None:
    """Drop the files' pages from the page cache (written back first)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths, chunk: int = 64 << 20) -> None:
    """Read the files once, so their pages are in the page cache."""
    buffer = memoryview(bytearray(chunk))
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def resident_bytes(path) -> tuple[int, int]:
    """(bytes of the file in the page cache, file size). Mapping a file reads nothing."""
    size = pathlib.Path(path).stat().st_size
    if size == 0:
        return 0, 0
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap({path}) failed")
        try:
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore({path}): {os.strerror(err)}")
            resident = bytes(vec).translate(_LOW_BIT).count(1)  # bit 0: resident; the rest reserved
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)
    return min(resident * mmap.PAGESIZE, size), size


def resident_fraction(paths) -> float:
    """The share of the files' bytes that the page cache holds (0.0 to 1.0)."""
    held = total = 0
    for path in paths:
        r, s = resident_bytes(path)
        held, total = held + r, total + s
    return held / total if total else 0.0
