"""cuda-python plumbing of the CUDA data plane: the runtime module, error checks, the kernels
per device (compiled by :mod:`.nvrtc`), pinning shared memory for the GPU, device views of
pinned memory. Nothing here knows about plans or collectives.

cuda-python is imported lazily: CPU users never need it.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

from . import nvrtc

_lock = threading.Lock()
_kernels: dict[int, dict] = {}  # device index -> {name: Kernel}
_tls = threading.local()


def runtime():
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        try:
            from cuda import cudart as rt  # type: ignore[no-redef]  (cuda-python < 12.6)
        except ImportError as e:
            raise nvrtc.CudaUnavailable(f"the CUDA data plane needs cuda-python's cuda.bindings: "
                                        f"{e}; install it with {nvrtc.INSTALL_HINT}") from e
    return rt


def check(what: str, result):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        rt = runtime()
        try:
            name = rt.cudaGetErrorName(err)[1].decode()
            text = rt.cudaGetErrorString(err)[1].decode()
        except Exception:
            name, text = str(err), ""
        raise RuntimeError(f"sparkccl: {what} failed: {name} ({text})")
    return result[1:] if isinstance(result, tuple) else ()


def set_current(device_index: int) -> None:
    """Make the device's primary context (torch's) current for cuda.core on this thread."""
    cur = getattr(_tls, "devices", None)
    if cur is None:
        cur = _tls.devices = set()
    if device_index not in cur:
        cc = nvrtc.import_cuda_core()
        cc.Device(device_index).set_current()
        cur.add(device_index)


def kernels_for(device_index: int) -> dict:
    """The compiled kernels for a device (compiled or read from the cache once per process)."""
    with _lock:
        k = _kernels.get(device_index)
        if k is None:
            set_current(device_index)
            cap = torch.cuda.get_device_capability(device_index)
            k = _kernels[device_index] = nvrtc.load_kernels(nvrtc.arch_of(cap))
            load_now(k)
        return k


def load_now(kernels: dict) -> None:
    """Load every kernel into the current context now, not at its first launch. Under CUDA's
    lazy loading (the default) a first launch may need a context synchronization; if a
    kernel of this context is then spinning on a flag whose writer is the kernel being
    launched (another rank's wait on this process's GPU), it deadlocks until the timeout.
    Seen on H200 with several ranks in one process: the first proxy-path publish kernel,
    launched while another rank's direct kernel waited for its data. Best effort: without
    cuFuncLoad (CUDA < 12.4) kernels still load on first use."""
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        return
    for kern in kernels.values():
        try:
            h = kern.handle
            if isinstance(h, drv.CUkernel):
                err, h = drv.cuKernelGetFunction(h)
                if int(err) != 0:
                    continue
            drv.cuFuncLoad(h)
        except Exception:
            pass


def check_available(device=None) -> None:
    """Raise a clear error if the CUDA data plane cannot run here (no GPU, no cuda-python,
    no NVRTC, GPU older than sm_80)."""
    if not torch.cuda.is_available():
        raise nvrtc.CudaUnavailable("device='cuda' needs a CUDA build of torch and a visible GPU "
                                    "(torch.cuda.is_available() is False)")
    nvrtc.import_cuda_core()
    runtime()
    nvrtc.nvrtc_version()
    idx = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    nvrtc.arch_of(torch.cuda.get_device_capability(idx))


class AlreadyRegistered(RuntimeError):
    """cudaHostRegister: the range is already pinned in this process."""


def register_host(addr: int, size: int) -> int:
    """Pin ``[addr, addr + size)`` (a shared-memory mapping) for the current device, mapped
    into the GPU's address space; returns the device pointer."""
    rt = runtime()
    flags = rt.cudaHostRegisterMapped | rt.cudaHostRegisterPortable
    res = rt.cudaHostRegister(addr, size, flags)
    err = res[0] if isinstance(res, tuple) else res
    if int(err) == int(rt.cudaError_t.cudaErrorHostMemoryAlreadyRegistered):
        rt.cudaGetLastError()  # not sticky: clear it, later launches must not see it
        raise AlreadyRegistered(f"cudaHostRegister({addr:#x}, {size}): already registered")
    check(f"cudaHostRegister({addr:#x}, {size})", res)
    return host_device_pointer(addr)


def host_device_pointer(addr: int) -> int:
    """Device pointer of pinned, mapped host memory (registered in this process)."""
    rt = runtime()
    (dev,) = check("cudaHostGetDevicePointer", rt.cudaHostGetDevicePointer(addr, 0))
    return int(dev)



def unregister_host(addr: int) -> None:
    rt = runtime()
    check(f"cudaHostUnregister({addr:#x})", rt.cudaHostUnregister(addr))


class _CudaArray:
    """Just enough ``__cuda_array_interface__`` for ``torch.as_tensor`` to wrap a device
    pointer (no copy, no ownership)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None,
                                         "stream": None}


def device_view(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A CUDA uint8 tensor over ``nbytes`` at device pointer ``ptr`` (mapped pinned memory)."""
    return torch.as_tensor(_CudaArray(ptr, nbytes), device=device)


def u64_at(addr: int) -> ctypes.c_uint64:
    return ctypes.c_uint64.from_address(addr)



def kernel_u64(v: int):
    """A 64-bit unsigned kernel argument."""
    return np.uint64(v)
