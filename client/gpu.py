"""The CUDA driver (cuda.bindings.driver) as both sides use it: devices by UUID,
virtual memory management (VMM) for `cuda-vmm`, legacy IPC handles for `cuda-ipc`.

The daemon creates slabs with cuMemCreate (POSIX-fd handle type) and exports an fd per
slab; an engine imports the fd, reserves an address range, maps it and sets READ-ONLY
access, then wraps it as a torch tensor. No shared IPC or PID namespace is needed, and
the physical memory lives as long as any process holds a handle or a mapping.

Devices are named by UUID ("GPU-…"): the ordinal of a GPU differs between processes
with different CUDA_VISIBLE_DEVICES, its UUID does not.

The driver bindings are imported with this module, not on first use: the import takes
tens of milliseconds, which belong to an engine's start-up with torch's, not to its
attach (weightcache.client imports this module only for GPU devices).
"""

import functools
import uuid as uuid_lib

from cuda.bindings import driver

from .errors import ProtocolError, WeightCacheError


class CudaError(WeightCacheError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


def check(result, call: str):
    """Unpack a cuda.bindings result tuple, raising CudaError on failure."""
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise CudaError(f"{call} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def device_uuid(ordinal: int) -> str:
    check(driver.cuInit(0), "cuInit")
    device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
    raw = check(driver.cuDeviceGetUuid(device), "cuDeviceGetUuid")
    return "GPU-" + str(uuid_lib.UUID(bytes=bytes(raw.bytes)))


@functools.lru_cache(maxsize=None)
def ordinal_for(device: str) -> int:
    """This process's ordinal for a GPU UUID (or an ordinal given as digits).

    Cached: an attach asks twice (fingerprint, then import), and the devices a process
    sees are fixed once the driver is initialised.
    """
    check(driver.cuInit(0), "cuInit")
    if device.isdigit():
        return int(device)
    visible = [uuid.lower() for uuid in visible_uuids()]
    if device.lower() in visible:
        return visible.index(device.lower())
    raise CudaError(f"GPU {device} is not visible to this process ({len(visible)} visible; check CUDA_VISIBLE_DEVICES)")


def visible_uuids() -> list[str]:
    """Every GPU this process sees, by UUID, in its ordinal order."""
    check(driver.cuInit(0), "cuInit")
    return [device_uuid(ordinal) for ordinal in range(check(driver.cuDeviceGetCount(), "cuDeviceGetCount"))]


def driver_version() -> str:
    version = check(driver.cuDriverGetVersion(), "cuDriverGetVersion")
    return f"{version // 1000}.{version % 1000 // 10}"


def make_current(ordinal: int) -> None:
    """Make the device's primary context (the one torch uses) current in this thread."""
    device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
    context = check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")


def location(ordinal: int):
    loc = driver.CUmemLocation()
    loc.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = ordinal
    return loc


def access(ordinal: int, read_only: bool):
    desc = driver.CUmemAccessDesc()
    desc.location = location(ordinal)
    flags = driver.CUmemAccess_flags
    desc.flags = flags.CU_MEM_ACCESS_FLAGS_PROT_READ if read_only else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def allocation_prop(ordinal: int):
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = location(ordinal)
    prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def granularity(ordinal: int) -> int:
    return check(driver.cuMemGetAllocationGranularity(
        allocation_prop(ordinal), driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity")


class _DeviceBuffer:
    """Device memory exposed through __cuda_array_interface__, so torch.as_tensor wraps
    it without a copy and keeps this object (and so the memory) alive with the tensor."""

    size: int
    ordinal: int
    ptr = None

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.size,), "typestr": "|u1", "data": (int(self.ptr), False), "version": 3,
                "strides": None, "stream": None}

    def tensor(self):
        import torch

        return torch.as_tensor(self, device=f"cuda:{self.ordinal}")

    def close(self) -> None:
        raise NotImplementedError

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the driver may already be gone
            pass


class Mapping(_DeviceBuffer):
    """VMM allocations mapped back to back in one reserved address range, so that one
    cuMemSetAccess covers them all and one tensor spans them; unmapped and released
    when the last tensor on them goes."""

    def __init__(self, handles: list, sizes: list[int], ordinal: int, read_only: bool):
        self.size, self.ordinal = sum(sizes), ordinal
        self._handles, self._mapped = list(handles), []
        self.ptr = check(driver.cuMemAddressReserve(self.size, 0, 0, 0), "cuMemAddressReserve")
        try:
            offset = 0
            for handle, size in zip(handles, sizes):
                check(driver.cuMemMap(int(self.ptr) + offset, size, 0, handle, 0), "cuMemMap")
                self._mapped.append((int(self.ptr) + offset, size))
                offset += size
            check(driver.cuMemSetAccess(self.ptr, self.size, [access(ordinal, read_only)], 1), "cuMemSetAccess")
        except CudaError:
            self.close()
            raise

    def close(self) -> None:
        for address, size in self._mapped:
            driver.cuMemUnmap(address, size)
        self._mapped = []
        if self.ptr is not None:
            driver.cuMemAddressFree(self.ptr, self.size)
            self.ptr = None
        for handle in self._handles:
            driver.cuMemRelease(handle)
        self._handles = []


class IpcMapping(_DeviceBuffer):
    """Another process's cudaMalloc'd memory opened through a legacy IPC handle.

    Legacy IPC cannot map read-only, and it needs the engine and the daemon to share
    the IPC and PID namespaces (hostIPC and hostPID pods): cuda-vmm needs neither.
    """

    def __init__(self, handle_bytes: bytes, size: int, ordinal: int):
        handle = driver.CUipcMemHandle()
        handle.reserved = handle_bytes
        self.size, self.ordinal = size, ordinal
        flags = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        self.ptr = check(driver.cuIpcOpenMemHandle(handle, flags), "cuIpcOpenMemHandle")

    def close(self) -> None:
        if self.ptr is not None:
            driver.cuIpcCloseMemHandle(self.ptr)
            self.ptr = None


def import_slabs(fds: list[int], sizes: list[int], device: str) -> list:
    """Map a daemon's slab fds read-only on `device`; one uint8 tensor per slab, all
    views on one mapping."""
    return split(import_mapping(fds, sizes, device, read_only=True).tensor(), sizes)


def import_mapping(fds: list[int], sizes: list[int], device: str, *, read_only: bool) -> Mapping:
    """Import slab fds and map them back to back on `device` (writable only for a
    publication's writer)."""
    ordinal = ordinal_for(device)
    make_current(ordinal)
    step = granularity(ordinal)
    if any(size % step for size in sizes):
        raise ProtocolError(f"slab sizes {sizes} are not multiples of the allocation granularity {step}")
    handle_type = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    handles = []
    try:
        for fd in fds:
            handles.append(check(driver.cuMemImportFromShareableHandle(fd, handle_type),
                                 "cuMemImportFromShareableHandle"))
    except CudaError:
        for handle in handles:
            driver.cuMemRelease(handle)
        raise
    return Mapping(handles, sizes, ordinal, read_only=read_only)


def split(whole, sizes: list[int]) -> list:
    """One uint8 view per slab of a mapping that holds them back to back."""
    slabs, offset = [], 0
    for size in sizes:
        slabs.append(whole.narrow(0, offset, size))
        offset += size
    return slabs


def import_ipc_slab(handle_bytes: bytes, size: int, device: str):
    """Open a daemon's cuda-ipc slab on `device` as a uint8 tensor (writable: see IpcMapping)."""
    ordinal = ordinal_for(device)
    make_current(ordinal)
    if len(handle_bytes) != 64:
        raise ProtocolError(f"cuda-ipc handle of {len(handle_bytes)} bytes; expected 64")
    return IpcMapping(handle_bytes, size, ordinal).tensor()


def fingerprint_device(device: str):
    """What the fingerprint records of a GPU: kind, compute capability, driver version."""
    from .fingerprint import Device

    ordinal = ordinal_for(device)
    handle = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
    attr = driver.CUdevice_attribute
    major = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, handle), "cuDeviceGetAttribute")
    minor = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, handle), "cuDeviceGetAttribute")
    return Device(kind="cuda", compute_capability=f"{major}.{minor}", driver_version=driver_version())
