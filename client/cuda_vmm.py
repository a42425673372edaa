"""CUDA virtual memory management (cuda.bindings.driver): the pieces both sides use.

The daemon creates slabs with cuMemCreate (POSIX-fd handle type) and exports an fd per
slab; an engine imports the fd, reserves an address range, maps it and sets READ-ONLY
access, then wraps it as a torch tensor. No shared IPC or PID namespace is needed, and
the physical memory lives as long as any process holds a handle or a mapping.

Devices are named by UUID ("GPU-…"): the ordinal of a GPU differs between processes
with different CUDA_VISIBLE_DEVICES, its UUID does not.
"""

import uuid as uuid_lib

from .errors import ProtocolError, WeightCacheError


class CudaError(WeightCacheError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


def _driver():
    from cuda.bindings import driver

    return driver


def check(result, call: str):
    """Unpack a cuda.bindings result tuple, raising CudaError on failure."""
    driver = _driver()
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise CudaError(f"{call} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def device_uuid(ordinal: int) -> str:
    driver = _driver()
    check(driver.cuInit(0), "cuInit")
    device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
    raw = check(driver.cuDeviceGetUuid(device), "cuDeviceGetUuid")
    return "GPU-" + str(uuid_lib.UUID(bytes=bytes(raw.bytes)))


def ordinal_for(device: str) -> int:
    """This process's ordinal for a GPU UUID (or an ordinal given as digits)."""
    driver = _driver()
    check(driver.cuInit(0), "cuInit")
    if device.isdigit():
        return int(device)
    count = check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
    for ordinal in range(count):
        if device_uuid(ordinal).lower() == device.lower():
            return ordinal
    raise CudaError(f"GPU {device} is not visible to this process ({count} visible; check CUDA_VISIBLE_DEVICES)")


def driver_version() -> str:
    version = check(_driver().cuDriverGetVersion(), "cuDriverGetVersion")
    return f"{version // 1000}.{version % 1000 // 10}"


def make_current(ordinal: int) -> None:
    """Make the device's primary context (the one torch uses) current in this thread."""
    driver = _driver()
    device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
    context = check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")


def location(ordinal: int):
    driver = _driver()
    loc = driver.CUmemLocation()
    loc.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = ordinal
    return loc


def access(ordinal: int, read_only: bool):
    driver = _driver()
    desc = driver.CUmemAccessDesc()
    desc.location = location(ordinal)
    flags = driver.CUmemAccess_flags
    desc.flags = flags.CU_MEM_ACCESS_FLAGS_PROT_READ if read_only else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def allocation_prop(ordinal: int):
    driver = _driver()
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = location(ordinal)
    prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def granularity(ordinal: int) -> int:
    driver = _driver()
    return check(driver.cuMemGetAllocationGranularity(
        allocation_prop(ordinal), driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity")


class Mapping:
    """A mapped VMM allocation; unmapped and released when the last tensor on it goes.

    Exposes __cuda_array_interface__ so torch.as_tensor wraps it without a copy and
    keeps this object alive as long as the tensor.
    """

    def __init__(self, handle, size: int, ordinal: int, read_only: bool):
        driver = _driver()
        self.size, self.ordinal, self._handle = size, ordinal, handle
        self.ptr = check(driver.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
        try:
            check(driver.cuMemMap(self.ptr, size, 0, handle, 0), "cuMemMap")
            check(driver.cuMemSetAccess(self.ptr, size, [access(ordinal, read_only)], 1), "cuMemSetAccess")
        except CudaError:
            self.close()
            raise

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.size,), "typestr": "|u1", "data": (int(self.ptr), False), "version": 3,
                "strides": None, "stream": None}

    def tensor(self):
        import torch

        return torch.as_tensor(self, device=f"cuda:{self.ordinal}")

    def close(self) -> None:
        driver = _driver()
        if self.ptr is not None:
            driver.cuMemUnmap(self.ptr, self.size)
            driver.cuMemAddressFree(self.ptr, self.size)
            self.ptr = None
        if self._handle is not None:
            driver.cuMemRelease(self._handle)
            self._handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the driver may already be gone
            pass


def import_slab(fd: int, size: int, device: str):
    """Map a daemon's slab fd read-only on `device` and return it as a uint8 tensor."""
    driver = _driver()
    ordinal = ordinal_for(device)
    make_current(ordinal)
    handle_type = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    handle = check(driver.cuMemImportFromShareableHandle(fd, handle_type), "cuMemImportFromShareableHandle")
    if size % granularity(ordinal):
        driver.cuMemRelease(handle)
        raise ProtocolError(f"slab size {size} is not a multiple of the allocation granularity")
    return Mapping(handle, size, ordinal, read_only=True).tensor()


def fingerprint_device(device: str):
    """What the fingerprint records of a GPU: kind, compute capability, driver version."""
    from .fingerprint import Device

    driver = _driver()
    ordinal = ordinal_for(device)
    handle = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
    attr = driver.CUdevice_attribute
    major = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, handle), "cuDeviceGetAttribute")
    minor = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, handle), "cuDeviceGetAttribute")
    return Device(kind="cuda", compute_capability=f"{major}.{minor}", driver_version=driver_version())
