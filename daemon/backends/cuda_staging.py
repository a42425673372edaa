"""Host-to-device loading shared by the GPU backends.

File ranges stream through a pinned staging buffer per loader thread and are copied
to the device asynchronously on that thread's stream; with several loader threads,
one thread's disk read overlaps another's copy.
"""

import os
import threading

from weightcache.client import gpu
from weightcache.client.errors import CheckpointError

STAGING_BYTES = 64 << 20


class Staging(threading.local):
    """One pinned host buffer and one stream per loader thread."""

    def get(self, ordinal: int):
        if not hasattr(self, "buffer"):
            import torch

            torch.cuda.set_device(ordinal)  # pinned memory must not start a context on GPU 0
            gpu.make_current(ordinal)
            self.buffer = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
            self.view = memoryview(self.buffer.numpy())
            self.stream = gpu.check(gpu.driver.cuStreamCreate(1), "cuStreamCreate")  # non-blocking
        return self


def copy_file_to_device(stage, fd: int, file_offset: int, dst_ptr: int, nbytes: int) -> None:
    done = 0
    while done < nbytes:
        want = min(nbytes - done, STAGING_BYTES)
        got = os.preadv(fd, [stage.view[:want]], file_offset + done)
        if got == 0:
            raise CheckpointError(f"file ended {nbytes - done} bytes early at offset {file_offset + done}; "
                                  "was it changed while loading?")
        gpu.check(gpu.driver.cuMemcpyHtoDAsync(dst_ptr + done, stage.buffer.data_ptr(), got, stage.stream),
                  "cuMemcpyHtoDAsync")
        # The buffer is reused for the next read: wait for this copy first.
        gpu.check(gpu.driver.cuStreamSynchronize(stage.stream), "cuStreamSynchronize")
        done += got


def copy_rows_to_device(stage, fd: int, file_offset: int, pitch: int, width: int, rows: int, dst_ptr: int) -> None:
    """`rows` pieces of `width` bytes, `pitch` apart in the file, packed at dst_ptr: read
    the span into the staging buffer, then one 2-D copy per batch of rows."""
    if width > STAGING_BYTES:
        raise CheckpointError(f"a row of {width} bytes does not fit the {STAGING_BYTES}-byte staging buffer")
    per_batch = max(1, (STAGING_BYTES - width) // pitch + 1)
    for first in range(0, rows, per_batch):
        count = min(per_batch, rows - first)
        span = (count - 1) * pitch + width
        got = os.preadv(fd, [stage.view[:span]], file_offset + first * pitch)
        if got < span:
            raise CheckpointError(f"file ended early at offset {file_offset + first * pitch + got}; "
                                  "was it changed while loading?")
        copy = gpu.driver.CUDA_MEMCPY2D()
        copy.srcMemoryType = gpu.driver.CUmemorytype.CU_MEMORYTYPE_HOST
        copy.srcHost = stage.buffer.data_ptr()
        copy.srcPitch = pitch
        copy.dstMemoryType = gpu.driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
        copy.dstDevice = dst_ptr + first * width
        copy.dstPitch = width
        copy.WidthInBytes = width
        copy.Height = count
        gpu.check(gpu.driver.cuMemcpy2DAsync(copy, stage.stream), "cuMemcpy2DAsync")
        gpu.check(gpu.driver.cuStreamSynchronize(stage.stream), "cuStreamSynchronize")

