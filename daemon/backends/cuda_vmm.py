"""`cuda-vmm` (the GPU default): slabs from the CUDA driver's virtual memory API.

Each slab is one cuMemCreate allocation with the POSIX-fd handle type, mapped
read-write in the daemon for the load; engines import the exported fd and map it
READ-ONLY. The daemon's slabs are its own allocations, never PyTorch's caching
allocator's (whose memory cannot be exported as fds).
"""

import os

from weightcache.client import gpu

from .base import Backend, Slab
from .cuda_staging import Staging, copy_file_to_device, copy_rows_to_device


class VmmSlab(Slab):
    def __init__(self, size: int, ordinal: int, staging: Staging):
        self.size, self._ordinal, self._staging = size, ordinal, staging
        handle = gpu.check(gpu.driver.cuMemCreate(size, gpu.allocation_prop(ordinal), 0), "cuMemCreate")
        self._mapping = gpu.Mapping([handle], [size], ordinal, read_only=False)
        handle_type = gpu.driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._fd = gpu.check(gpu.driver.cuMemExportToShareableHandle(handle, handle_type, 0),
                             "cuMemExportToShareableHandle")

    def write_from_file(self, fd, file_offset, slab_offset, nbytes):
        copy_file_to_device(self._staging.get(self._ordinal), fd, file_offset, int(self._mapping.ptr) + slab_offset,
                            nbytes)

    def write_rows_from_file(self, fd, file_offset, pitch, width, rows, slab_offset):
        copy_rows_to_device(self._staging.get(self._ordinal), fd, file_offset, pitch, width, rows,
                            int(self._mapping.ptr) + slab_offset)

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
        self._ordinal = gpu.ordinal_for(device)
        self.device = gpu.device_uuid(self._ordinal)
        gpu.make_current(self._ordinal)
        self._granularity = gpu.granularity(self._ordinal)
        self._staging = Staging()

    def allocate(self, size, label):
        gpu.make_current(self._ordinal)  # a store allocates on the writer's connection thread
        rounded = -(-size // self._granularity) * self._granularity
        return VmmSlab(rounded, self._ordinal, self._staging)

    def fingerprint_device(self):
        return gpu.fingerprint_device(self.device)
