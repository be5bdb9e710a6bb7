"""Bandwidth of each GPU data-plane kernel against the pinned-memory roof (run on a GPU).

One process, one rank of a world of W, no proxy: the flag words are preset so that every
wait is satisfied at once, and the publish ring is overwritten freely (nothing consumes
it). So each kernel runs at its own speed, and what is timed is the kernel alone.

Roofs, measured in the same run on the same buffers:
  * ``sm d2p`` / ``sm p2d``: torch's ``copy_`` between device memory and a device view of
    the mapped pinned region (despite the label, torch turns that copy into a
    ``cudaMemcpyAsync``, i.e. a copy engine; ``benchmarks/pcie_duplex.py`` times SM copies);
  * ``dma d2h`` / ``dma h2d``: cudaMemcpyAsync to/from a pinned CPU tensor (copy engines).

Kernels and the bytes counted against the roof (L = per-rank slice):
  * ag publish: L written to pinned (plus L to the device result);
  * ag wait: (W-1) L read from pinned, written to the device result;
  * rs publish: W L written to pinned;
  * rs wait: (W-1) L read from pinned (own chunk from device), L written to device;
  * ag / rs (both kernels back to back, still without a network).

    python benchmarks/kernel_roofline.py [--world 4] [--min-mib 1] [--max-mib 64] [--iters 20]
"""
from __future__ import annotations

import argparse
import ctypes
import mmap

import numpy as np
import torch

from sparkccl import _native as N
from sparkccl import layout as L
from sparkccl.dataplane import cuda as C
from sparkccl.plan.build import build_plan
from sparkccl.plan.model import REGION_SLOTS, Region


class Buf:
    def __init__(self, nbytes: int):
        self.mm = mmap.mmap(-1, nbytes)
        self.t = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.addr = self.t.data_ptr()


class BenchPlane(C.CudaDataPlane):
    """No proxy: nothing reads the ring entries, so the ring's tail is set far ahead of every
    index (the kernels' ring wait, kernels/wait.cu ring_room, then never waits)."""

    def __init__(self, *a, ctl_addr: int, **kw):
        ctypes.c_uint64.from_address(ctl_addr + L.CTL_RING_TAIL).value = 1 << 62
        super().__init__(*a, ctl_addr=ctl_addr, **kw)


def timed(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--min-mib", type=float, default=1)
    ap.add_argument("--max-mib", type=float, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    W = args.world
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda", torch.cuda.current_device())
    max_slice = int(args.max_mib * (1 << 20))
    plan = build_plan("mesh", W, 0, 2)
    ctl = Buf(L.control_bytes(plan.num_flag_words))
    N.init_control(ctl.addr, 0)
    flags = np.frombuffer(ctl.mm, dtype=np.uint64, offset=L.FLAGS_OFFSET, count=plan.num_flag_words)
    flags[:] = 1 << 62  # every wait is satisfied at once
    stride = L.slot_stride(W * max_slice)
    ag = Buf(REGION_SLOTS[Region.AG] * stride)
    rs = Buf((REGION_SLOTS[Region.RS_SEND] + REGION_SLOTS[Region.RS_RECV]) * stride)
    dp = BenchPlane(N, plan=plan, ctl_addr=ctl.addr, flags_addr=ctl.addr + L.FLAGS_OFFSET,
                    ag=ag.t, ag_stride=stride, timeout_s=30.0, device=dev)
    half = REGION_SLOTS[Region.RS_SEND] * stride
    dp.attach_rs(rs.t[:half], stride, rs.t[half:], stride)
    props = torch.cuda.get_device_properties(dev)
    print(f"# {props.name} ({props.multi_processor_count} SMs), world {W}, {args.dtype}; "
          f"GB/s = bytes over the pinned link / time (1 GB = 1e9 B)")
    print(f"{'slice':>10} {'kernel':>12} {'time_us':>10} {'GB/s':>8} {'roof':>8} {'%roof':>6}")
    seq = [-1]  # the data plane numbers collectives from 0, one per call

    def nxt():
        seq[0] += 1
        return seq[0]

    size = int(args.min_mib * (1 << 20))
    try:
        while size <= max_slice:
            Lb = size
            x = torch.randn(Lb // 2, device=dev).to(torch.bfloat16).view(torch.uint8)
            out_ag = torch.empty(W * Lb, dtype=torch.uint8, device=dev)
            esize = torch.empty((), dtype=dtype).element_size()
            x_rs = torch.randn(W * Lb // esize, device=dev).to(dtype).view(torch.uint8)
            out_rs = torch.empty(Lb, dtype=torch.uint8, device=dev)
            pin_view = dp.ag[:Lb]
            pin_cpu = torch.empty(Lb, dtype=torch.uint8, pin_memory=True)
            dbuf = torch.empty(Lb, dtype=torch.uint8, device=dev)
            roofs = {
                "sm d2p": timed(lambda: pin_view.copy_(dbuf), args.iters),
                "sm p2d": timed(lambda: dbuf.copy_(pin_view), args.iters),
                "dma d2h": timed(lambda: pin_cpu.copy_(dbuf, non_blocking=True), args.iters),
                "dma h2d": timed(lambda: dbuf.copy_(pin_cpu, non_blocking=True), args.iters),
            }
            write_roof = Lb / roofs["sm d2p"]
            read_roof = Lb / roofs["sm p2d"]
            rows = []
            for name, t in roofs.items():
                rows.append((name, t, Lb / t, None))
            for phases, label, nbytes, roof in (
                    (("publish",), "ag publish", Lb, write_roof),
                    (("wait",), "ag wait", (W - 1) * Lb, read_roof),
                    (("publish", "wait"), "ag", W * Lb, None)):
                dp.phases = phases
                t = timed(lambda: dp.all_gather(nxt(), x, out_ag, 0, Lb), args.iters)
                rows.append((label, t, nbytes / t, roof))
            for phases, label, nbytes, roof in (
                    (("publish",), "rs publish", W * Lb, write_roof),
                    (("wait",), "rs wait", (W - 1) * Lb, read_roof),
                    (("publish", "wait"), "rs", (2 * W - 1) * Lb, None)):
                dp.phases = phases
                t = timed(lambda: dp.reduce_scatter(nxt(), x_rs, 0, Lb, Lb, out_rs, 0, dtype),
                          args.iters)
                rows.append((label, t, nbytes / t, roof))
            dp.phases = ("publish", "wait")
            for name, t, bw, roof in rows:
                r = f"{roof / 1e9:8.1f} {100 * bw / roof:5.0f}%" if roof else f"{'':>8} {'':>6}"
                print(f"{Lb / (1 << 20):8.1f}Mi {name:>12} {t * 1e6:10.1f} {bw / 1e9:8.1f} {r}")
            size *= 2
        dp.synchronize()
    finally:
        dp.close()


if __name__ == "__main__":
    main()
