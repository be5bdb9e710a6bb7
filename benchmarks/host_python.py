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
all-gather (64 KiB of int32 per rank, ``out=`` given), reduce-scatter (bf16, ``out=``) and
the one-shot all-reduce of the decode regime (8 KiB of bf16, with ``out=`` and without: a
fresh result tensor per call, as a model's layer makes).
Virtual machines run the same Python at speeds that differ by up to 2x from one process
(or minute) to the next (seen here and on the H200 machine), so each call alternates with
a fixed pure-Python reference workload (:func:`reference_work`, 200 dict stores and a sum)
and the ratio of the two p50s is printed too: that ratio is what to compare across trees.
``--profile`` adds cProfile's table of each kind of call (``--only NAME``: one of them).
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


def measure(iters: int, profile: bool, only: str | None = None) -> dict:
    import test_cuda_dataplane as T  # the CPU emulation of the kernels and the streams

    import sparkccl._native as nat
    from sparkccl import allreduce as AR
    from sparkccl.comm import Communicator
    from sparkccl.config import DEFAULT_ALLREDUCE_ONESHOT_BYTES

    with T.World("emu", "mesh", 2, max_slice=1 << 16, direct=True, mode="fused") as w:
        ar_n = 4096  # 8 KiB of bf16: the one-shot all-reduce (decode)
        ar_L = 2 * ar_n
        # The padding the Communicator's one-shot call says (comm._one_shot_all_reduce): the
        # plan's key holds it, so the ranks' warm-up calls here must say the same.
        ar_pad = AR.zero_bytes(ar_L, ar_L, 2, 0, ar_L)

        def dev(t):
            return w.keep(w.be.to_dev(t))

        # The plans of every shape, on both ranks, with the keys the Communicator's calls
        # make (its all-gather passes the caller's dtype: int32, not bytes).
        for _ in range(3):
            for r in range(2):
                with w.be.on(r):
                    w.dps[r].all_gather(w.seq, dev(torch.arange(4096, dtype=torch.int32) + r),
                                        dev(torch.empty(8192, dtype=torch.int32)), 0, 4 * 4096)
            w.seq += 1
            w.reduce_scatter([torch.ones(8192, dtype=torch.bfloat16)] * 2)
            for r in range(2):
                with w.be.on(r):
                    w.dps[r].all_reduce_one_shot(w.seq, dev(torch.ones(ar_n, dtype=torch.bfloat16)),
                                                 dev(torch.empty(ar_n, dtype=torch.bfloat16)),
                                                 False, ar_pad)
            w.seq += 1
            w.sync()
        dp = w.dps[0]

        # (rank 1 issues nothing: nothing may run, and there is no event to wait for)
        dp.gpu.issue_plan = lambda plan, args: (None, None)
        # A Communicator of rank 0 around the data plane, as wiring.py would build it.
        comm = object.__new__(Communicator)
        comm.device, comm.world_size, comm.rank = torch.device("cpu"), 2, 0
        comm._closed, comm._lock, comm._nat = False, threading.Lock(), nat
        comm.max_slice, comm.seq, comm._rs_count, comm._handout = 1 << 16, dp._seq_next, 0, None
        comm._wiring = types.SimpleNamespace(
            dp=dp, ctl_addr=w.ctl[0].addr, rs_ready=True, ensure_rs=lambda: None,
            settings=types.SimpleNamespace(
                allreduce_oneshot_bytes=DEFAULT_ALLREDUCE_ONESHOT_BYTES))
        comm._calls_ready()  # (what the constructor finds once)
        T._emu_current.stream = w.be.streams[0]
        x, out = torch.ones(4096, dtype=torch.int32), torch.empty(8192, dtype=torch.int32)
        xr, outr = torch.ones(8192, dtype=torch.bfloat16), torch.empty(4096, dtype=torch.bfloat16)
        xa, outa = torch.ones(ar_n, dtype=torch.bfloat16), torch.empty(ar_n, dtype=torch.bfloat16)
        calls = {"all_gather": lambda: comm.all_gather(x, out=out),
                 "reduce_scatter": lambda: comm.reduce_scatter(xr, out=outr),
                 "all_reduce": lambda: comm.all_reduce(xa, out=outa),
                 "all_reduce_fresh": lambda: comm.all_reduce(xa)}
        hits, misses = dp.plans.stats["hits"], dp.plans.stats["misses"]
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
        res["planned"] = (dp.plans.stats["hits"] - hits == len(calls) * (iters + 1)
                          and dp.plans.stats["misses"] == misses)
        if profile:
            import cProfile
            import pstats
            for name, fn in calls.items():
                if only is not None and name != only:
                    continue
                print(f"---- {name}")
                prof = cProfile.Profile()
                prof.runcall(lambda: [fn() for _ in range(iters)])
                pstats.Stats(prof).sort_stats("tottime").print_stats(15)
        return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--only", choices=("all_gather", "reduce_scatter", "all_reduce",
                                       "all_reduce_fresh"), help="profile this call only")
    a = ap.parse_args()
    r = measure(a.iters, a.profile, a.only)
    ref = r["reference"]
    print(f"host_python: Python per planned call (native issue not counted), p50 of {a.iters}: "
          f"all_gather {r['all_gather']:.2f} us ({r['all_gather'] / ref:.2f}x reference), "
          f"reduce_scatter {r['reduce_scatter']:.2f} us ({r['reduce_scatter'] / ref:.2f}x), "
          f"all_reduce 8 KiB bf16 out= {r['all_reduce']:.2f} us "
          f"({r['all_reduce'] / ref:.2f}x), without out= {r['all_reduce_fresh']:.2f} us "
          f"({r['all_reduce_fresh'] / ref:.2f}x); reference work {ref:.2f} us"
          f"{'' if r['planned'] else ' (NOT every call replayed its plan)'}")


if __name__ == "__main__":
    main()
