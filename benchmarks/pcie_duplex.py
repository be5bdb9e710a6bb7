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

With ``--gpus 0`` every GPU of the machine runs each case at the same time (do the GPUs
share the way to host memory?).

With ``--ring MIB`` the host side is a ring of that size instead of the whole transfer: each
direction moves the same bytes in ``--chunk-kib`` copies that cycle through the ring, and
every GPU reads the ring its neighbour writes (GPU i reads GPU i+1's). Does host memory that
was just written by a device, and stays in the CPU's last-level cache (Intel DDIO), let
both directions run faster than the DRAM-backed case?

``--wait`` (ring mode, ring = whole transfer) pipelines the two sides as a world-2 "ce"
collective does: the writer publishes each chunk with ``cuStreamWriteValue64``, the reader
waits for it before its copy, by ``value`` (``cuStreamWaitValue64``, the stream's front end
waits) or ``kernel`` (a one-thread kernel spins on the word, as the ce engine's first form
did on its copying stream). The difference between the two, and against ``none`` (no
waits), is what waiting costs.

    python benchmarks/pcie_duplex.py [--mib 128] [--iters 5] [--gpus 1] [--backing anon]
                                     [--cases ce/ce,sm/sm] [--ring 4 --chunk-kib 1024]
                                     [--wait none|value|kernel]
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics

import torch

from sparkccl.dataplane import cuda_runtime as CR


def host_buffer(nbytes: int, backing: str = "anon"):
    """Host memory to pin: ``anon`` (private, small pages), ``thp`` (private, transparent
    huge pages asked for), ``shm`` (a /dev/shm file, as the communicator's regions are),
    ``shmthp`` (the same, huge pages asked for: needs shmem_enabled = advise or always)."""
    if backing.startswith("shm"):
        import os
        import tempfile
        fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="sparkccl-duplex-")
        os.unlink(path)
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        if backing == "shmthp":
            mm.madvise(mmap.MADV_HUGEPAGE)
    else:
        mm = mmap.mmap(-1, nbytes)
        mm.madvise(mmap.MADV_HUGEPAGE if backing == "thp" else mmap.MADV_NOHUGEPAGE)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    t.fill_(1)  # fault the pages in before pinning
    return mm, t


def huge_kib() -> str:
    """This process's transparent-huge-page memory (anonymous, shared) from smaps_rollup."""
    try:
        lines = open("/proc/self/smaps_rollup").read().splitlines()
    except OSError:
        return "?"
    got = {ln.split(":")[0]: ln.split()[1] for ln in lines if "HugePages" in ln or "PmdMapped" in ln}
    return ", ".join(f"{k} {v} kB" for k, v in got.items())


KERNELS = r"""
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
// Spin until *f >= v (at most ~2 s of GPU time, so a bug cannot hang the benchmark).
extern "C" __global__ void spin(const volatile unsigned long long* f, unsigned long long v) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  while (*f < v) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > 2000000000ull) return;
  }
}
"""


class Rig:
    """One GPU's buffers: 'w' pinned host memory the GPU writes, 'r' pinned host memory it
    reads, a device source and destination, and two streams (one per direction)."""

    def __init__(self, index: int, n: int, backing: str = "anon", ring: int = 0,
                 chunk: int = 1 << 20):
        import cupy
        self.dev = dev = torch.device("cuda", index)
        self.n, self.ring, self.chunk = n, ring, chunk
        host = ring or n
        self.keep, self.views, self.hosts, self.pinned = [], {}, {}, []
        with torch.cuda.device(dev):
            for name in ("w", "r"):  # w: written by the GPU, r: read by the GPU
                mm, t = host_buffer(host + (2 << 20), backing)
                self.keep.append(mm)
                d = CR.register_host(t.data_ptr(), host + (2 << 20))
                self.hosts[name] = t.data_ptr()
                self.pinned.append(t.data_ptr())
                self.views[name] = CR.device_view(d, host, dev)
            self.flag = CR.device_view(CR.host_device_pointer(self.hosts["w"]) + host, 8, dev)
            ctypes.c_uint64.from_address(self.hosts["w"] + host).value = 0  # (filled with 1s)
            self.src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
            self.dst = torch.empty(n, dtype=torch.uint8, device=dev)
            self.s1, self.s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
            with cupy.cuda.Device(index):
                self.kern = {"sm": cupy.RawKernel(KERNELS, "copy_plain"),
                             "smcv": cupy.RawKernel(KERNELS, "copy_cv")}
                self.spin = cupy.RawKernel(KERNELS, "spin")
        self.wait, self.base = "none", 0  # --wait; flag values of this run are base + chunk + 1
        self.grid = 2 * torch.cuda.get_device_properties(dev).multi_processor_count

    def _ce(self, dst_ptr, src_ptr, nbytes, stream):
        from cuda.bindings import runtime as rt
        (err,) = rt.cudaMemcpyAsync(dst_ptr, src_ptr, nbytes, rt.cudaMemcpyKind.cudaMemcpyDefault,
                                    stream.cuda_stream)
        assert int(err) == 0, err

    def _sm(self, engine, dst_ptr, src_ptr, stream, nbytes=None):
        import cupy
        import numpy as np
        count = (nbytes or self.n) // 16
        with cupy.cuda.Device(self.dev.index), cupy.cuda.ExternalStream(stream.cuda_stream):
            self.kern[engine]((self.grid,), (256,),
                              (np.uint64(dst_ptr), np.uint64(src_ptr), np.uint64(count)))

    def read_ring_of(self, peer: "Rig") -> None:
        """Read the ring ``peer`` writes (ring mode: host memory a device just wrote)."""
        self.hosts["r"], self.views["r"] = peer.hosts["w"], peer.views["w"]
        self.peer = peer

    def _wait_chunk(self, i: int, stream) -> None:
        """Order the read of chunk i after the writer's publish of it (--wait)."""
        from cuda.bindings import driver as drv
        import cupy
        import numpy as np
        flag, value = self.peer.flag.data_ptr(), self.peer.base + i + 1
        if self.wait == "value":
            (err,) = drv.cuStreamWaitValue64(stream.cuda_stream, flag, value,
                                             drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
            assert int(err) == 0, err
        elif self.wait == "kernel":
            with cupy.cuda.Device(self.dev.index), cupy.cuda.ExternalStream(stream.cuda_stream):
                self.spin((1,), (32,), (np.uint64(flag), np.uint64(value)))

    def _ring(self, engine, to_host: bool, stream):
        """Move n bytes in chunk-sized copies, the host side cycling through the ring."""
        host = self.hosts["w" if to_host else "r"]
        hview = self.views["w" if to_host else "r"].data_ptr()
        dev_buf = self.src if to_host else self.dst
        from cuda.bindings import driver as drv
        for i, off in enumerate(range(0, self.n, self.chunk)):
            h = off % self.ring
            d = dev_buf.data_ptr() + off
            if not to_host and self.wait != "none":
                self._wait_chunk(i, stream)
            if engine == "ce":
                self._ce(host + h if to_host else d, d if to_host else host + h, self.chunk, stream)
            else:
                self._sm(engine, hview + h if to_host else d, d if to_host else hview + h,
                         stream, self.chunk)
            if to_host and self.wait != "none":  # publish chunk i (a fenced value write)
                (err,) = drv.cuStreamWriteValue64(stream.cuda_stream, self.flag.data_ptr(),
                                                  self.base + i + 1, 0)
                assert int(err) == 0, err

    def _write(self, engine, stream):
        from cuda.bindings import driver as drv
        if self.ring and engine in ("ce", "sm"):
            self._ring(engine, True, stream)
        elif engine in self.kern:
            self._sm(engine, self.views["w"].data_ptr(), self.src.data_ptr(), stream)
        elif engine == "ce":
            self._ce(self.hosts["w"], self.src.data_ptr(), self.n, stream)
        elif engine == "ce8":  # 8 pieces, a flag after each (a copy-engine publish)
            piece = self.n // 8
            for c in range(8):
                self._ce(self.hosts["w"] + c * piece, self.src.data_ptr() + c * piece, piece,
                         stream)
                (err,) = drv.cuStreamWriteValue64(stream.cuda_stream, self.flag.data_ptr(),
                                                  c + 1, 0)
                assert int(err) == 0, err

    def _read(self, engine, stream):
        if self.ring and engine in ("ce", "sm", "smcv"):
            self._ring(engine, False, stream)
        elif engine in self.kern:
            self._sm(engine, self.dst.data_ptr(), self.views["r"].data_ptr(), stream)
        elif engine == "ce":
            self._ce(self.dst.data_ptr(), self.hosts["r"], self.n, stream)

    def launch(self, w, r, gate: int):
        """Queue one run of the case behind the pinned word at device pointer ``gate`` (the
        GPUs start together once the host sets it, however long queueing took); returns its
        (start, end) events."""
        from cuda.bindings import driver as drv
        with torch.cuda.device(self.dev):
            main = torch.cuda.current_stream(self.dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            (err,) = drv.cuStreamWaitValue32(main.cuda_stream, gate, 1,
                                             drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
            assert int(err) == 0, err
            start.record(main)
            self.s1.wait_event(start)
            self.s2.wait_event(start)
            if w:
                with torch.cuda.stream(self.s1):
                    self._write(w, self.s1)
            if r:
                with torch.cuda.stream(self.s2):
                    self._read(r, self.s2)
            main.wait_stream(self.s1)
            main.wait_stream(self.s2)
            end.record(main)
        return start, end

    def close(self):
        torch.cuda.synchronize(self.dev)
        for h in self.pinned:
            CR.unregister_host(h)


def run(rigs, w, r, gated: bool = True) -> float:
    """Seconds of the slowest GPU, every GPU running the case at once (``gated``: queued
    first, then started together; the warm-up runs ungated, since a first launch that loads
    a module must not queue behind a closed gate)."""
    for rig in rigs:
        torch.cuda.synchronize(rig.dev)
        rig.base += 1 << 20  # fresh flag values: every wait of this run waits for this run
    gate_host = rigs[0].hosts["w"] + (rigs[0].ring or rigs[0].n) + 64
    gate = ctypes.c_uint32.from_address(gate_host)
    gate.value = 0 if gated else 1
    gate_dev = CR.host_device_pointer(gate_host)
    events = [rig.launch(w, r, gate_dev) for rig in rigs]
    gate.value = 1
    for _, end in events:
        end.synchronize()
    return max(s.elapsed_time(e) for s, e in events) / 1e3


def main() -> None:
    import warnings
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # cupy's ExternalStream
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=128, help="per direction (fractions too)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--gpus", type=int, default=1,
                    help="run every case on this many GPUs at once (0: all of them)")
    ap.add_argument("--backing", choices=["anon", "thp", "shm", "shmthp"], default="anon",
                    help="host memory: small pages, transparent huge pages, or /dev/shm")
    ap.add_argument("--cases", default="all", help="'all' or e.g. 'ce/ce,sm/sm' (write/read)")
    ap.add_argument("--ring", type=float, default=0,
                    help="host ring of this many MiB, read by the neighbour GPU (0: none)")
    ap.add_argument("--chunk-kib", type=int, default=1024, help="copy size in ring mode")
    ap.add_argument("--wait", choices=["none", "value", "kernel"], default="none",
                    help="ring mode: the reader waits for each chunk's publish, and how")
    args = ap.parse_args()
    n = int(args.mib * (1 << 20)) // 16 * 16
    ring, chunk = int(args.ring * (1 << 20)), args.chunk_kib << 10
    if ring and (ring % chunk or n % chunk):
        ap.error("--ring and --mib must be whole multiples of --chunk-kib")
    if args.wait != "none" and ring != n:
        ap.error("--wait needs --ring equal to --mib (each chunk written once)")
    count = args.gpus or torch.cuda.device_count()
    rigs = [Rig(i, n, args.backing, ring, chunk) for i in range(count)]
    if ring:
        for i, rig in enumerate(rigs):
            rig.read_ring_of(rigs[(i + 1) % count])
            rig.wait = args.wait
    cases = [("ce", None), (None, "ce"), ("sm", None), (None, "sm"), (None, "smcv"),
             ("ce", "ce"), ("ce8", "ce"), ("sm", "sm"), ("sm", "smcv"), ("ce", "sm"),
             ("ce", "smcv"), ("sm", "ce")]
    if args.cases != "all":
        cases = [tuple(None if e == "-" else e for e in c.split("/")) for c in args.cases.split(",")]
    props = torch.cuda.get_device_properties(rigs[0].dev)
    print(f"# {props.name} x {count} at once: {args.mib:g} MiB per direction per GPU, median "
          f"of {args.iters}, time of the slowest GPU; GB/s = bytes one GPU moved (both "
          f"directions) / time; host memory {args.backing} ({huge_kib()})"
          + (f"; ring {args.ring:g} MiB in {args.chunk_kib} KiB copies, read by the neighbour"
             f", waits: {args.wait}" if ring else ""))
    print(f"{'write':>6} {'read':>6} {'ms':>8} {'GB/s':>8}   per direction")
    if args.wait != "none":  # a reader whose chunks nobody writes would wait forever
        cases = [(w, r) for w, r in cases if w and r]
    for w, r in cases:
        run(rigs, w, r, gated=False)  # warm-up
        t = statistics.median(run(rigs, w, r) for _ in range(args.iters))
        moved = n * ((w is not None) + (r is not None))
        print(f"{w or '-':>6} {r or '-':>6} {t * 1e3:8.3f} {moved / t / 1e9:8.1f}   "
              f"{n / t / 1e9:8.1f}")
    for rig in rigs:
        rig.close()


if __name__ == "__main__":
    main()
