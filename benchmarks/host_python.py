"""The Python of a planned CUDA collective, per call, on a machine without a GPU.

    .venv/bin/python benchmarks/host_python.py [--iters 20000] [--profile]

An eager CUDA call after the first of its shape is the Communicator's checks, the data
plane's plan lookup and account, and one native call (``LaunchPlan.issue``: on the H200
about 4.5 us of cuLaunchKernel, see benchmarks/driver_calls.cu). This measures everything
but that native call: a ``Communicator`` over rank 0 of an in-process world of the CPU
emulation (tests/test_cuda_dataplane.py; the kernels compiled as host C++, so g++ is
needed), its launch-plan issue replaced by a no-op once the plans exist. The host time a
GPU machine measures is this plus the driver's part (benchmarks/host_time_cuda_h200.txt).

Each call is timed alone (perf_counter_ns); the p50 over ``--iters`` calls is printed for
all-gather (64 KiB of int32 per rank, ``out=`` given) and reduce-scatter (bf16, ``out=``).
Virtual machines run the same Python at speeds that differ by up to 2x from one process
(or minute) to the next (seen here and on the H200 machine), so each call alternates with
a fixed pure-Python reference workload (:func:`reference_work`, 200 dict stores and a sum)
and the ratio of the two p50s is printed too: that ratio is what to compare across trees.
``--profile`` adds cProfile's table of the all-gather calls.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def reference_work() -> int:
    """A fixed pure-Python workload: the CPU's speed at running Python, now."""
    d = {}
    for i in range(200):
        d[i] = i * 3
    return sum(d.values())


def measure(iters: int, profile: bool) -> dict:
    import test_cuda_dataplane as T  # the CPU emulation of the kernels and the streams

    import sparkccl._native as nat
    from sparkccl.comm import Communicator

    with T.World("emu", "mesh", 2, max_slice=1 << 16, direct=True, mode="fused") as w:
        xs = [torch.arange(4096, dtype=torch.int32) + r for r in range(2)]
        rs = [torch.ones(8192, dtype=torch.bfloat16)] * 2
        for _ in range(3):  # the plans of both shapes, on both ranks
            w.all_gather(xs)
            w.reduce_scatter(rs)
            w.sync()
        dp = w.dps[0]

        # (rank 1 issues nothing: nothing may run, and there is no event to wait for)
        dp.gpu.issue_plan = lambda plan, args: (None, None)
        # A Communicator of rank 0 around the data plane, as wiring.py would build it.
        comm = object.__new__(Communicator)
        comm.device, comm.world_size, comm.rank = torch.device("cpu"), 2, 0
        comm._closed, comm._lock, comm._nat = False, threading.Lock(), nat
        comm.max_slice, comm.seq, comm._rs_count, comm._handout = 1 << 16, dp._seq_next, 0, None
        comm._wiring = types.SimpleNamespace(dp=dp, ctl_addr=w.ctl[0].addr, rs_ready=True,
                                             ensure_rs=lambda: None)
        comm._calls_ready()  # (what the constructor finds once)
        T._emu_current.stream = w.be.streams[0]
        x, out = torch.ones(4096, dtype=torch.int32), torch.empty(8192, dtype=torch.int32)
        xr, outr = torch.ones(8192, dtype=torch.bfloat16), torch.empty(4096, dtype=torch.bfloat16)
        calls = {"all_gather": lambda: comm.all_gather(x, out=out),
                 "reduce_scatter": lambda: comm.reduce_scatter(xr, out=outr)}
        hits = dp.plans.stats["hits"]
        res = {}
        clock = time.perf_counter_ns
        ref = []
        for name, fn in calls.items():
            fn()
            each = []
            for _ in range(iters):
                t = clock()
                fn()
                t1 = clock()
                reference_work()
                ref.append(clock() - t1)
                each.append(t1 - t)
            each.sort()
            res[name] = each[len(each) // 2] / 1e3
        ref.sort()
        res["reference"] = ref[len(ref) // 2] / 1e3
        res["planned"] = dp.plans.stats["hits"] - hits == 2 * (iters + 1)
        if profile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.runcall(lambda: [calls["all_gather"]() for _ in range(iters)])
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)
        return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    r = measure(a.iters, a.profile)
    ref = r["reference"]
    print(f"host_python: Python per planned call (native issue not counted), p50 of {a.iters}: "
          f"all_gather {r['all_gather']:.2f} us ({r['all_gather'] / ref:.2f}x reference), "
          f"reduce_scatter {r['reduce_scatter']:.2f} us ({r['reduce_scatter'] / ref:.2f}x); "
          f"reference work {ref:.2f} us"
          f"{'' if r['planned'] else ' (NOT every call replayed its plan)'}")


if __name__ == "__main__":
    main()
