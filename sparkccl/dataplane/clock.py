"""SPARKCCL_GPU_STAMPS: the GPU's publish stamps on the proxy's clock. One calibration per
CUDA data plane measures CLOCK_MONOTONIC - %globaltimer; the plane hands it to the publish
kernels (device state ``STATE_CLOCK``), whose ring entries then carry stamps the proxy can
compare with its own clock (native/src/proxy.cpp: publish -> first post)."""
from __future__ import annotations

import time

import numpy as np

from .. import layout
from .cuda_runtime import kernel_u64 as _n
from .cuda_runtime import u64_at as _u64
from .monitor import write_stderr

CLOCK_ROUNDS = 32  # handshakes of the calibration (the tightest one counts)
STATE_CLOCK = layout.protocol_constants()["STATE_CLOCK"]


def calibrate(gpu, register, rank: int, buf: np.ndarray, timeout_s: float = 2.0):
    """Measure CLOCK_MONOTONIC - %globaltimer and hand it to the publish kernels (device
    state STATE_CLOCK), so that the GPU's ring entries carry publish stamps on the
    proxy's clock (native/src/proxy.cpp: publish -> first post). Round k: the host notes
    its clock t0 and writes go[k]; sccl_clock_probe, spinning, writes its %globaltimer g;
    the host sees it at t1. The GPU read the clock within [t0, t1]: the offset is
    (t0 + t1) / 2 - g, within half the round trip, from the round of the shortest one.
    Not found in time (no stamps then): said on stderr, never an error.

    ``gpu``: the plane's device seam; ``register``: pins host memory for it (the plane's,
    which unpins it at close); ``buf``: 2 * CLOCK_ROUNDS uint64 words the probe uses, kept by
    the caller as long as it is pinned. Returns (offset, error) in ns, or None."""
    rounds = len(buf) // 2
    dev = register(buf.ctypes.data, buf.nbytes)
    go = [_u64(buf.ctypes.data + 8 * k) for k in range(rounds)]
    stamp = [_u64(buf.ctypes.data + 8 * (rounds + k)) for k in range(rounds)]
    ts, stream = gpu.probe_stream()
    gpu.launch_kernel(stream, "sccl_clock_probe", 1, 32, dev, dev + 8 * rounds,
                      _n(rounds), _n(int(timeout_s * 1e9)))
    best = None
    deadline = time.monotonic() + timeout_s
    try:
        for k in range(rounds):
            t0 = time.monotonic_ns()
            go[k].value = 1
            while stamp[k].value == 0 and time.monotonic() < deadline:
                pass
            t1 = time.monotonic_ns()
            g = stamp[k].value
            if g == 0:
                break
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, (t0 + t1) // 2 - g)
    finally:
        for w in go:  # (the probe ends also when a round was not seen)
            w.value = 1
        ts.synchronize()
    if best is None:
        write_stderr(f"sparkccl: rank {rank}: SPARKCCL_GPU_STAMPS: the GPU clock "
                     f"probe did not answer within {timeout_s:g} s: no publish stamps\n")
        return None
    rtt, offset = best
    return offset, (rtt + 1) // 2


def stamps(gpu, register, rank: int, state) -> tuple:
    """SPARKCCL_GPU_STAMPS: calibrate (:func:`calibrate`) and put the offset in the device
    state's STATE_CLOCK word, so the publishing kernels stamp ring entries. Returns
    ((offset, error) in ns or None, the probe's buffer: the caller keeps it as long as it is
    pinned). A measurement aid: a failure says so on stderr and is never an error."""
    buf = np.zeros(2 * CLOCK_ROUNDS, dtype=np.uint64)
    try:
        found = calibrate(gpu, register, rank, buf)
        if found is not None:
            word = (found[0] % (1 << 64)) or 1  # (0 means no stamps: 1 ns off instead)
            state[STATE_CLOCK] = word - (1 << 64) if word >= 1 << 63 else word
        return found, buf
    except Exception as e:  # noqa: BLE001 - a measurement aid: never a failure
        write_stderr(f"sparkccl: rank {rank}: SPARKCCL_GPU_STAMPS: the GPU clock calibration "
                     f"failed ({type(e).__name__}: {e}): no publish stamps\n")
        return None, buf
