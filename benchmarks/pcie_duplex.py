"""Does this GPU's link to host memory carry writes and reads at once, and with which engine?

The GPU-direct data plane moves every byte over the link twice per rank: it writes the own
slice into the peer's pinned region (device -> host) while it reads the peers' slices out
of the own region (host -> device). On nvidia-h200-x2 the 256 MiB all-gather took about the
*sum* of the two directions. This script times, on one GPU, 128 MiB each way (the per-link
traffic of that all-gather), alone and together, with each engine per direction:

  * ``ce``: a copy engine (``cudaMemcpyAsync`` to / from the registered host pointer; note
    that torch's ``copy_`` between a device tensor and a device view of pinned memory is
    such a memcpy too);
  * ``sm``: a kernel of 2 blocks per SM copying 16-byte vectors (plain v4 loads and
    stores, 4 loads in flight per thread: our kernels' copy loop);
  * ``smcv``: the same with ``ld.global.cv`` loads (what our wait kernels use on pinned
    memory).

Directions that run "together" are on two streams, started by one event. ``ce8``: the copy
engine in 8 pieces with a ``cuStreamWriteValue64`` flag after each.

    python benchmarks/pcie_duplex.py [--mib 128] [--iters 5]
"""
from __future__ import annotations

import argparse
import mmap
import statistics

import torch

from sparkccl.dataplane import cuda as C


def host_buffer(nbytes: int):
    mm = mmap.mmap(-1, nbytes)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    t.fill_(1)  # fault the pages in before pinning
    return mm, t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    from cuda.bindings import driver as drv
    from cuda.bindings import runtime as rt

    n = args.mib << 20
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    keep = []
    views, hosts = {}, {}
    for name in ("w", "r"):  # w: written by the GPU, r: read by the GPU
        mm, t = host_buffer(n + 4096)
        keep.append(mm)
        d = C.register_host(t.data_ptr(), n + 4096)
        hosts[name] = t.data_ptr()
        views[name] = C.device_view(d, n, dev)
    flag_dev = C.device_view(C.host_device_pointer(hosts["w"]) + n, 8, dev)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def ce(dst_ptr, src_ptr, nbytes, stream):
        (err,) = rt.cudaMemcpyAsync(dst_ptr, src_ptr, nbytes, rt.cudaMemcpyKind.cudaMemcpyDefault,
                                    stream.cuda_stream)
        assert int(err) == 0, err

    import cupy
    import numpy as np
    code = r"""
    struct V { unsigned x, y, z, w; };
    template <bool CV> __device__ void copy(V* d, const V* s, unsigned long long n) {
      for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
           i < n; i += (unsigned long long)gridDim.x * blockDim.x * 4) {
        V v[4];
        #pragma unroll
        for (int k = 0; k < 4; ++k) {
          unsigned long long j = i + k * (unsigned long long)gridDim.x * blockDim.x;
          if (j < n) {
            if (CV) asm volatile("ld.global.cv.v4.u32 {%0,%1,%2,%3}, [%4];"
                                 : "=r"(v[k].x), "=r"(v[k].y), "=r"(v[k].z), "=r"(v[k].w)
                                 : "l"(s + j));
            else asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                              : "=r"(v[k].x), "=r"(v[k].y), "=r"(v[k].z), "=r"(v[k].w)
                              : "l"(s + j));
          }
        }
        #pragma unroll
        for (int k = 0; k < 4; ++k) {
          unsigned long long j = i + k * (unsigned long long)gridDim.x * blockDim.x;
          if (j < n) asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(d + j),
                                  "r"(v[k].x), "r"(v[k].y), "r"(v[k].z), "r"(v[k].w) : "memory");
        }
      }
    }
    extern "C" __global__ void copy_plain(V* d, const V* s, unsigned long long n) { copy<false>(d, s, n); }
    extern "C" __global__ void copy_cv(V* d, const V* s, unsigned long long n) { copy<true>(d, s, n); }
    """
    kern = {"sm": cupy.RawKernel(code, "copy_plain"), "smcv": cupy.RawKernel(code, "copy_cv")}
    grid = 2 * torch.cuda.get_device_properties(dev).multi_processor_count

    def sm(engine, dst_ptr, src_ptr, stream):
        with cupy.cuda.ExternalStream(stream.cuda_stream):  # (cupy 13: Stream.from_external)
            kern[engine]((grid,), (256,), (np.uint64(dst_ptr), np.uint64(src_ptr), np.uint64(n // 16)))

    def write(engine, stream):
        with torch.cuda.stream(stream):
            if engine in kern:
                sm(engine, views["w"].data_ptr(), src.data_ptr(), stream)
            elif engine == "ce":
                ce(hosts["w"], src.data_ptr(), n, stream)
            elif engine == "ce8":  # 8 pieces, a flag after each (a copy-engine publish)
                piece = n // 8
                for c in range(8):
                    ce(hosts["w"] + c * piece, src.data_ptr() + c * piece, piece, stream)
                    (err,) = drv.cuStreamWriteValue64(stream.cuda_stream, flag_dev.data_ptr(),
                                                      c + 1, 0)
                    assert int(err) == 0, err

    def read(engine, stream):
        with torch.cuda.stream(stream):
            if engine in kern:
                sm(engine, dst.data_ptr(), views["r"].data_ptr(), stream)
            elif engine == "ce":
                ce(dst.data_ptr(), hosts["r"], n, stream)

    def run(w, r) -> float:
        main = torch.cuda.current_stream(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        main.synchronize()
        start.record(main)
        s1.wait_event(start)
        s2.wait_event(start)
        if w:
            write(w, s1)
        if r:
            read(r, s2)
        main.wait_stream(s1)
        main.wait_stream(s2)
        end.record(main)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    cases = [("ce", None), (None, "ce"), ("sm", None), (None, "sm"), (None, "smcv"),
             ("ce", "ce"), ("ce8", "ce"), ("sm", "sm"), ("sm", "smcv"), ("ce", "sm"),
             ("ce", "smcv"), ("sm", "ce")]
    props = torch.cuda.get_device_properties(dev)
    print(f"# {props.name}: {args.mib} MiB per direction, median of {args.iters}; "
          "GB/s = bytes moved (both directions) / time")
    print(f"{'write':>6} {'read':>6} {'ms':>8} {'GB/s':>8}   per direction")
    for w, r in cases:
        run(w, r)  # warm-up
        t = statistics.median(run(w, r) for _ in range(args.iters))
        moved = n * ((w is not None) + (r is not None))
        print(f"{w or '-':>6} {r or '-':>6} {t * 1e3:8.3f} {moved / t / 1e9:8.1f}   "
              f"{n / t / 1e9:8.1f}")
    torch.cuda.synchronize()
    for name in hosts:
        C.unregister_host(hosts[name])


if __name__ == "__main__":
    main()
