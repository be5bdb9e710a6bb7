"""The one-box MoE finalize on the GPU, for :meth:`sparkccl.ExpertParallel.combine`:
``sccl_ep_finalize`` (``ep_kernels.cu``) computes every row with the data plane's own
``fin_unit`` (``dataplane/kernels/finalize.cu``), so the bits are those of the fused
finalize and of its CPU twin, with no host read (capturable in a CUDA graph). Compiled with
NVRTC through the data plane's compiler and cache (:mod:`sparkccl.dataplane.nvrtc`).
"""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from .dataplane import cuda_runtime, nvrtc
from .dataplane.cuda_runtime import kernel_u64, set_current

SOURCE = Path(__file__).with_name("ep_kernels.cu")
KERNEL = "sccl_ep_finalize"
THREADS = 256
MAX_BLOCKS = 1024

_lock = threading.Lock()
_kernels: dict = {}
_streams: dict = {}


def source() -> str:
    """The kernel as the one text NVRTC compiles (the data plane's includes inlined)."""
    return nvrtc.source(SOURCE)


def compile_cubin(arch) -> bytes:
    return nvrtc.compile_cubin(arch, src=source())


def kernel(device_index: int):
    """The compiled kernel for a device, loaded now (not at first launch: see the data
    plane's ``cuda_runtime`` on lazy loading)."""
    with _lock:
        k = _kernels.get(device_index)
        if k is None:
            set_current(device_index)
            cc = nvrtc.import_cuda_core()
            arch = nvrtc.arch_of(torch.cuda.get_device_capability(device_index))
            obj = cc.ObjectCode.from_cubin(compile_cubin(arch), name="sparkccl_ep_kernels")
            loaded = {KERNEL: obj.get_kernel(KERNEL)}
            cuda_runtime.load_now(loaded)
            k = _kernels[device_index] = loaded[KERNEL]
        return k


def finalize_rows(f, out: torch.Tensor, bad: torch.Tensor) -> None:
    """``out`` (bf16 ``[f.num_tokens, f.H]``) = the finalize rows of ``f``
    (:class:`sparkccl.finalize.FinalizeInputs`, on ``out``'s device), queued on the current
    stream. ``bad``: uint32 ``[4]``, the kernel's record of a ``pos`` outside ``[0, R)``."""
    dev = out.device
    k = kernel(dev.index)
    set_current(dev.index)
    cc = nvrtc.import_cuda_core()
    h = int(torch.cuda.current_stream(dev).cuda_stream)
    stream = _streams.get(h)
    if stream is None:
        stream = _streams[h] = cc.Stream.from_handle(h)
    units = f.num_tokens * (f.H // 8)
    grid = max(1, min(MAX_BLOCKS, -(-units // THREADS)))
    n = kernel_u64
    with torch.cuda.device(dev):
        cc.launch(stream, cc.LaunchConfig(grid=grid, block=THREADS), k,
                  f.y.data_ptr(), 0 if f.scales is None else f.scales.data_ptr(),
                  f.pos.data_ptr(), f.weights.data_ptr(), f.shared.data_ptr(), bad.data_ptr(),
                  n(f.num_tokens), n(f.topk), n(f.H), n(f.R), n(1 if f.fp8 else 0),
                  out.data_ptr())
