"""The expert-parallel kernels (``ep_kernels.cu``), compiled with NVRTC through the data
plane's compiler and cache (:mod:`sparkccl.dataplane.nvrtc`), each queued on the current
stream with no host read (capturable in a CUDA graph):

* ``sccl_ep_finalize``, the one-box MoE finalize for :meth:`sparkccl.ExpertParallel.combine`:
  every row computed with the data plane's own ``fin_unit`` (``dataplane/kernels/finalize.cu``),
  so the bits are those of the fused finalize and of its CPU twin;
* ``sccl_ep_pack`` / ``sccl_ep_unpack``, :meth:`sparkccl.ExpertParallel.dispatch`'s send
  blocks and its selection of this rank's entries (both modes), and ``sccl_ep_sized_plan``,
  the sized combine's plan of a dispatch: the same bytes as the torch path of
  ``expert_parallel.py``, which stays the specification (and the CPU path).
"""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from .dataplane import cuda_runtime, nvrtc
from .dataplane.cuda_runtime import kernel_u64, set_current

SOURCE = Path(__file__).with_name("ep_kernels.cu")
KERNEL = "sccl_ep_finalize"
KERNELS = (KERNEL, "sccl_ep_pack", "sccl_ep_unpack", "sccl_ep_sized_plan")
THREADS = 256  # EP_THREADS of ep_kernels.cu (the pack / unpack scans' shared arrays)
MAX_BLOCKS = 1024
SPREAD = 256  # pack / unpack: about this many blocks share the row copies
HT_SPREAD = 1024  # high-throughput unpack (prefill: up to ~500 MB of rows to copy)


class U64(int):
    """A 64-bit unsigned scalar kernel argument (the others are pointers)."""


_lock = threading.Lock()
_kernels: dict = {}
_streams: dict = {}


def source() -> str:
    """The kernel as the one text NVRTC compiles (the data plane's includes inlined)."""
    return nvrtc.source(SOURCE)


def compile_cubin(arch) -> bytes:
    return nvrtc.compile_cubin(arch, src=source())


def kernels(device_index: int) -> dict:
    """{name: kernel} for a device, compiled and loaded now (not at first launch: see the
    data plane's ``cuda_runtime`` on lazy loading)."""
    with _lock:
        k = _kernels.get(device_index)
        if k is None:
            set_current(device_index)
            cc = nvrtc.import_cuda_core()
            arch = nvrtc.arch_of(torch.cuda.get_device_capability(device_index))
            obj = cc.ObjectCode.from_cubin(compile_cubin(arch), name="sparkccl_ep_kernels")
            loaded = {name: obj.get_kernel(name) for name in KERNELS}
            cuda_runtime.load_now(loaded)
            k = _kernels[device_index] = loaded
        return k


def kernel(device_index: int, name: str = KERNEL):
    return kernels(device_index)[name]


def _stream(dev: torch.device):
    cc = nvrtc.import_cuda_core()
    h = int(torch.cuda.current_stream(dev).cuda_stream)
    stream = _streams.get(h)
    if stream is None:
        stream = _streams[h] = cc.Stream.from_handle(h)
    return stream


def launch(dev: torch.device, name: str, grid: tuple, args: list) -> None:
    """Queue kernel ``name`` on ``dev``'s current stream; ``args``: pointers (int) and
    :class:`U64` scalars, in the kernel's order."""
    k = kernel(dev.index, name)
    set_current(dev.index)
    cc = nvrtc.import_cuda_core()
    stream = _stream(dev)
    with torch.cuda.device(dev):
        config = cc.LaunchConfig(grid=grid[0] if len(grid) == 1 else grid, block=THREADS)
        cc.launch(stream, config, k,
                  *(kernel_u64(a) if isinstance(a, U64) else int(a) for a in args))


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def pack_args(*, idx, owner, E, W, Pd, Pc, limit, x, x_scales, row_bytes, scale_bytes, send,
              lay, pos, bad, bad_count, overflow, counts=None) -> list:
    """sccl_ep_pack's arguments. ``idx``: int64 / int32 [n, K]; ``send``: [W, lay.nbytes]
    uint8; ``counts`` (int32 [2W]): count only (high-throughput capacities)."""
    n, K = idx.shape
    return [_ptr(idx), U64(idx.dtype == torch.int64), _ptr(owner), U64(n), U64(K), U64(E),
            U64(W), U64(Pd), U64(Pc), U64(bool(limit)), _ptr(x), _ptr(x_scales),
            U64(row_bytes), U64(scale_bytes), _ptr(send), U64(lay.nbytes), U64(lay.scales_off),
            U64(lay.idx_off), U64(lay.x_off), _ptr(pos), _ptr(bad), _ptr(bad_count),
            _ptr(overflow), _ptr(counts)]


def pack_grid(W: int, Pd: int, count_only: bool) -> tuple:
    return (W, 1 if count_only else max(1, min(Pd, SPREAD // W)))


def unpack_args(*, got, lay, owner, experts, rank, E, W, Pd, K, cap, Pc, limit, row_bytes,
                scale_bytes, rx, xs, counts, src_rank, src_token, src_k, feed, offsets=None,
                count_only=False, ret_counts=None) -> list:
    """sccl_ep_unpack's arguments. Low-latency: ``rx`` [E_local * cap, row_bytes] bytes.
    High-throughput: ``offsets`` (int64 [E_local + 1]) and ``rx`` [R, row_bytes]; first
    ``count_only`` (writes ``counts`` alone; the other outputs may be None). ``ret_counts``
    (int64 [W], needed but by ``count_only``): the rows combine returns to each source (its
    entries held here, at most Pc)."""
    return [_ptr(got), U64(lay.nbytes), U64(lay.scales_off), U64(lay.idx_off), U64(lay.x_off),
            _ptr(owner),
            _ptr(experts), U64(rank), U64(E), U64(W), U64(Pd), U64(K), U64(cap), U64(Pc),
            U64(bool(limit)), U64(row_bytes), U64(scale_bytes), _ptr(rx), _ptr(xs),
            _ptr(counts), _ptr(src_rank), _ptr(src_token), _ptr(src_k), _ptr(feed),
            _ptr(offsets), U64(bool(count_only)), _ptr(ret_counts)]


def unpack_grid(El: int, rows: int, spread: int = SPREAD) -> tuple:
    """``rows``: the most rows a local expert can take (low-latency: cap; high-throughput:
    its mean, R / E_local). Prefill passes a larger ``spread``: its copies dwarf the
    re-scan of the received ids that every extra block costs."""
    return (El, max(1, min(rows, spread // El)))


def sized_plan(feed: torch.Tensor, ret_counts: torch.Tensor, pos: torch.Tensor, W: int,
               Pc: int, row_bytes: int) -> tuple:
    """The sized combine's (feed, header, pos) of a dispatch in one launch
    (``sccl_ep_sized_plan``; :meth:`sparkccl.ExpertParallel._sized_plan`'s torch ops are the
    specification): int64 ``[W * (Pc + 1)]``, int64 ``[W]``, int32 like ``pos``."""
    dev = feed.device
    feed2 = torch.empty(W * (Pc + 1), dtype=torch.int64, device=dev)
    header = torch.empty(W, dtype=torch.int64, device=dev)
    pos2 = torch.empty_like(pos)
    most = max(W * (Pc + 1), pos.numel())
    grid = max(1, min(MAX_BLOCKS, -(-most // THREADS)))
    launch(dev, "sccl_ep_sized_plan", (grid,),
           [feed.data_ptr(), ret_counts.data_ptr(), pos.data_ptr(), U64(W), U64(Pc),
            U64(pos.numel()), U64(row_bytes), feed2.data_ptr(), header.data_ptr(),
            pos2.data_ptr()])
    return feed2, header, pos2


def finalize_rows(f, out: torch.Tensor, bad: torch.Tensor) -> None:
    """``out`` (bf16 ``[f.num_tokens, f.H]``) = the finalize rows of ``f``
    (:class:`sparkccl.finalize.FinalizeInputs`, on ``out``'s device), queued on the current
    stream. ``bad``: uint32 ``[4]``, the kernel's record of a ``pos`` outside ``[0, R)``."""
    n = U64
    units = f.num_tokens * (f.H // 8)
    grid = max(1, min(MAX_BLOCKS, -(-units // THREADS)))
    launch(out.device, KERNEL, (grid,),
           [f.y.data_ptr(), _ptr(f.scales), f.pos.data_ptr(), f.weights.data_ptr(),
            f.shared.data_ptr(), bad.data_ptr(), n(f.num_tokens), n(f.topk), n(f.H), n(f.R),
            n(1 if f.fp8 else 0), out.data_ptr()])
