"""Host time per eager all-gather of each rank, beside what sets it: the CPU's speed.

    python3 benchmarks/host_time_per_rank.py [--bytes 1048576] [--iters 2000] [--world 2]

On the H200 machine (a VM) one process ran at 12-15 us per call and the next at 20-26 us,
for either rank and either path (benchmarks/host_time_cuda_h200.txt). This prints, per
rank, next to the p50 host time of ``comm.all_gather(x, out=out)`` (a synchronization every
20 calls; the bench's size convention: ``--bytes`` for the whole collective, bf16):

* the p50 of a fixed pure-Python workload (benchmarks/host_python.py's reference work),
  timed before the communicator exists, once it is idle, and between the calls: when
  sparkccl is not involved yet, it already takes ~9 us in one process and ~17 us in the
  next;
* the main thread's run-queue wait over the timed loop (``/proc/thread-self/schedstat``)
  and its involuntary context switches: whether other threads took its CPU;
* the threads that used CPU meanwhile (name@cpu: clock ticks).

Runs on CUDA when there is a GPU (ranks share GPU 0; start MPS first for concurrency),
else on the CPU data plane.
"""
from __future__ import annotations

import argparse
import os
import resource
import time

from host_python import reference_work


def time_reference(n: int = 300) -> float:
    each = []
    for _ in range(n):
        t = time.perf_counter_ns()
        reference_work()
        each.append(time.perf_counter_ns() - t)
    each.sort()
    return each[len(each) // 2] / 1e3


def _thread_ticks() -> dict:
    """tid -> (name, utime + stime ticks, last CPU) of this process's threads."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
            fields = rest.split()
            out[tid] = (head.split("(", 1)[1], int(fields[11]) + int(fields[12]), int(fields[36]))
        except OSError:  # (a thread that ended meanwhile)
            pass
    return out


def _schedstat() -> tuple[int, int]:
    with open("/proc/thread-self/schedstat") as f:
        ran, waited, _ = (int(v) for v in f.read().split())
    return ran, waited


def rank_main(rank, world, store, nbytes, iters):
    import torch

    import sparkccl
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    res = {"ref_before": time_reference()}
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, device=dev,
                               slot_bytes=nbytes) as comm:
        n = nbytes // 2 // world
        x = torch.ones(n, dtype=torch.bfloat16, device=dev)
        out = torch.empty(n * world, dtype=torch.bfloat16, device=dev)
        for _ in range(5):
            comm.all_gather(x, out=out)
        comm.synchronize()
        res["ref_idle"] = time_reference()
        host, ref = [], []
        ticks0, (ran0, waited0) = _thread_ticks(), _schedstat()
        use0 = resource.getrusage(resource.RUSAGE_THREAD)
        clock = time.perf_counter_ns
        for k in range(iters):
            t = clock()
            comm.all_gather(x, out=out)
            t1 = clock()
            reference_work()
            ref.append(clock() - t1)
            host.append(t1 - t)
            if k % 20 == 19:
                comm.synchronize()
        comm.synchronize()
        ran1, waited1 = _schedstat()
        use1 = resource.getrusage(resource.RUSAGE_THREAD)
        ticks1 = _thread_ticks()
    host.sort()
    ref.sort()
    busy = [f"{name}@{cpu}:{t - ticks0.get(tid, (name, t, cpu))[1]}"
            for tid, (name, t, cpu) in ticks1.items() if t != ticks0.get(tid, (name, t, cpu))[1]]
    res.update(host=host[len(host) // 2] / 1e3, ref_loop=ref[len(ref) // 2] / 1e3,
               ran_ms=(ran1 - ran0) / 1e6, waited_ms=(waited1 - waited0) / 1e6,
               nivcsw=use1.ru_nivcsw - use0.ru_nivcsw, busy=" ".join(busy), device=str(dev))
    return res


def main() -> None:
    from sparkccl.localrun import run_ranks
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=1 << 20)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args()
    results = run_ranks(rank_main, a.world, args=(a.bytes, a.iters), timeout_s=300)
    for r in results:
        if not r.ok:
            raise SystemExit(f"rank {r.rank} failed: {r.error_type}: {r.message}")
        v = r.value
        print(f"rank {r.rank} ({v['device']}): host {v['host']:.1f} us/call | reference work: "
              f"before {v['ref_before']:.1f}, idle {v['ref_idle']:.1f}, between calls "
              f"{v['ref_loop']:.1f} us | main thread: ran {v['ran_ms']:.1f} ms, waited "
              f"{v['waited_ms']:.2f} ms for a CPU, {v['nivcsw']} involuntary switches | "
              f"threads busy (ticks): {v['busy']}")


if __name__ == "__main__":
    main()
