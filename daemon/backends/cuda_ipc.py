"""`cuda-ipc` (compatibility): one cudaMalloc'd slab per handle, legacy CUDA IPC.

For engines that can only open legacy IPC handles. Engines must share the daemon's IPC
and PID namespaces (pods with hostIPC and hostPID), and nothing can map the memory
read-only: prefer `cuda-vmm`, which needs neither.
"""

from weightcache.client import gpu

from .base import Backend, Slab
from .cuda_staging import Staging, copy_file_to_device, copy_rows_to_device


class IpcSlab(Slab):
    def __init__(self, size: int, ordinal: int, staging: Staging):
        self.size, self._ordinal, self._staging = size, ordinal, staging
        self._ptr = gpu.check(gpu.driver.cuMemAlloc(size), "cuMemAlloc")
        handle = gpu.check(gpu.driver.cuIpcGetMemHandle(self._ptr), "cuIpcGetMemHandle")
        self.handle_bytes = bytes(handle.reserved)

    def write_from_file(self, fd, file_offset, slab_offset, nbytes):
        copy_file_to_device(self._staging.get(self._ordinal), fd, file_offset, int(self._ptr) + slab_offset, nbytes)

    def write_rows_from_file(self, fd, file_offset, pitch, width, rows, slab_offset):
        copy_rows_to_device(self._staging.get(self._ordinal), fd, file_offset, pitch, width, rows,
                            int(self._ptr) + slab_offset)

    def seal(self):
        pass  # legacy IPC has no read-only mapping; see the module docstring

    def export_fd(self):
        return None  # the handle travels in the layout (Slab.ipc_handle), not as an fd

    def close(self):
        gpu.driver.cuMemFree(self._ptr)


class CudaIpcBackend(Backend):
    name = "cuda-ipc"

    def __init__(self, device: str = "0"):
        self._ordinal = gpu.ordinal_for(device)
        self.device = gpu.device_uuid(self._ordinal)
        gpu.make_current(self._ordinal)
        self._staging = Staging()

    def allocate(self, size, label):
        return IpcSlab(size, self._ordinal, self._staging)

    def fingerprint_device(self):
        return gpu.fingerprint_device(self.device)
