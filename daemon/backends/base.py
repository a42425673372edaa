"""The one small interface every memory backend implements (cpu, cuda-vmm, cuda-ipc).

The daemon allocates slabs, fills them from files, seals them, and hands out one
exportable handle per slab; the engine-side half lives in weightcache.client.mapping.
"""

from abc import ABC, abstractmethod

from weightcache.client.fingerprint import Device


class SealRefused(Exception):
    """A slab could not be made immutable (a writer still maps it writable, or tampered
    with it); the message says what was found."""


class Slab(ABC):
    size: int

    @abstractmethod
    def write_from_file(self, fd: int, file_offset: int, slab_offset: int, nbytes: int) -> None:
        """Copy nbytes of a file into the slab. Safe to call from several threads at
        once for disjoint ranges."""

    @abstractmethod
    def write_rows_from_file(self, fd: int, file_offset: int, pitch: int, width: int, rows: int,
                             slab_offset: int) -> None:
        """Copy `rows` pieces of `width` bytes, `pitch` bytes apart in the file, into the
        slab back to back (a tensor-parallel shard along the last dim)."""

    @abstractmethod
    def seal(self) -> None:
        """Make the slab immutable; called once, after filling, before it is served
        read-only. Raises SealRefused when the slab cannot be trusted to stay as filled."""

    @abstractmethod
    def export_fd(self) -> int | None:
        """The handle engines receive over SCM_RIGHTS (the slab keeps ownership), or
        None for a backend whose handle travels as bytes (handle_bytes)."""

    handle_bytes: bytes = b""

    @abstractmethod
    def close(self) -> None:
        """Drop the daemon's reference; engines that mapped the slab keep the memory."""


class Backend(ABC):
    name: str  # as on the wire: "cpu", "cuda-vmm", "cuda-ipc"
    device: str  # "cpu" or a GPU UUID

    @abstractmethod
    def allocate(self, size: int, label: str) -> Slab:
        """A new slab of at least `size` bytes; `label` names it in /proc and logs."""

    @abstractmethod
    def fingerprint_device(self) -> Device:
        """What the fingerprint records of this backend's device."""
