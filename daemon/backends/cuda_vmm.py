"""`cuda-vmm` (the GPU default): slabs from the CUDA driver's virtual memory API.

Each slab is one cuMemCreate allocation with the POSIX-fd handle type, mapped
read-write in the daemon for the load; engines import the exported fd and map it
READ-ONLY. The daemon's slabs are its own allocations, never PyTorch's caching
allocator's (whose memory cannot be exported as fds).

The load streams file ranges through a pinned staging buffer per worker thread and
copies them to the device asynchronously on that worker's stream; the workers' reads
and copies overlap one another.
"""

import os
import threading

from weightcache.client import cuda_vmm as vmm
from weightcache.client.errors import CheckpointError

from .base import Backend, Slab

STAGING_BYTES = 64 << 20


class _Staging(threading.local):
    """One pinned host buffer and one stream per loader thread."""

    def get(self, ordinal: int):
        if not hasattr(self, "buffer"):
            import torch

            torch.cuda.set_device(ordinal)  # pinned memory must not start a context on GPU 0
            vmm.make_current(ordinal)
            self.buffer = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
            self.view = memoryview(self.buffer.numpy())
            self.stream = vmm.check(vmm._driver().cuStreamCreate(1), "cuStreamCreate")  # non-blocking
        return self


class VmmSlab(Slab):
    def __init__(self, size: int, ordinal: int, staging: _Staging):
        driver = vmm._driver()
        self.size, self._ordinal, self._staging = size, ordinal, staging
        handle = vmm.check(driver.cuMemCreate(size, vmm.allocation_prop(ordinal), 0), "cuMemCreate")
        self._mapping = vmm.Mapping(handle, size, ordinal, read_only=False)
        handle_type = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._fd = vmm.check(driver.cuMemExportToShareableHandle(handle, handle_type, 0),
                             "cuMemExportToShareableHandle")

    def write_from_file(self, fd, file_offset, slab_offset, nbytes):
        driver = vmm._driver()
        stage = self._staging.get(self._ordinal)
        done = 0
        while done < nbytes:
            want = min(nbytes - done, STAGING_BYTES)
            got = os.preadv(fd, [stage.view[:want]], file_offset + done)
            if got == 0:
                raise CheckpointError(f"file ended {nbytes - done} bytes early at offset {file_offset + done}; "
                                      "was it changed while loading?")
            dst = int(self._mapping.ptr) + slab_offset + done
            vmm.check(driver.cuMemcpyHtoDAsync(dst, stage.buffer.data_ptr(), got, stage.stream), "cuMemcpyHtoDAsync")
            # The buffer is reused for the next read: wait for this copy first.
            vmm.check(driver.cuStreamSynchronize(stage.stream), "cuStreamSynchronize")
            done += got

    def seal(self):
        pass  # engines map read-only; the daemon never writes after the load

    def export_fd(self):
        return self._fd

    def close(self):
        os.close(self._fd)
        self._mapping.close()


class CudaVmmBackend(Backend):
    name = "cuda-vmm"

    def __init__(self, device: str = "0"):
        self._ordinal = vmm.ordinal_for(device)
        self.device = vmm.device_uuid(self._ordinal)
        vmm.make_current(self._ordinal)
        self._granularity = vmm.granularity(self._ordinal)
        self._staging = _Staging()

    def allocate(self, size, label):
        rounded = -(-size // self._granularity) * self._granularity
        return VmmSlab(rounded, self._ordinal, self._staging)

    def fingerprint_device(self):
        return vmm.fingerprint_device(self.device)
