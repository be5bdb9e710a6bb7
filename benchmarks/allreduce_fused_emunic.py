"""The fused all-reduce (one operation: the reduce-scatter's and the all-gather's streams
under one sequence number, docs/PROTOCOL.md "All-reduce") on the emulated RoCE NIC
(tests/emunic, every root rate-limited), against its plan's line-rate bound and against
the same bytes as two collectives, all in the same run.

Per (topology, world), a bf16 vector of ``--size`` bytes per rank (rounded down to whole
16-byte chunks), timed as the slowest rank's call (median of ``--iters`` after a warm-up,
every rank released at one instant, as benchmarks/emunic_efficiency.py):

* ``fused``: ``all_reduce`` in the two-step regime on the CPU data plane's fused operation;
* ``2 calls``: the same regime as reduce-scatter (zero-copy input) + all-gather
  (``fused=False``: the path of a data plane without the fused operation);
* ``rs+ag``: plain ``reduce_scatter`` then ``all_gather`` of the reduced chunk;

and the bound: the union plan's max port load (slices of n / world bytes, from the plan
verifier: ``sparkccl plan --collective all_reduce``) x slice x 8 / (rate x roots). Results
are checked against the rank-order reference once per configuration before timing.

    nice -n 19 python benchmarks/allreduce_fused_emunic.py --rate-gbps 0.2 --worlds 2,3,4
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from emunic_efficiency import (  # noqa: E402
    add_nic_arguments, common_start, load_average, max_port_load, nic_env,
)

WAYS = ("fused", "2 calls", "rs+ag")


def _job(rank, world, store, topology, n_elems, iters):
    import torch

    import sparkccl
    from sparkccl import allreduce as A
    from sparkccl.reference import all_reduce_reference, bits, make_input
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology=topology,
                               transport="verbs", timeout_s=300) as comm:
        barrier = common_start(store, rank, world)
        xs = [make_input(7, q, (n_elems,), torch.bfloat16) for q in range(world)]
        x = xs[rank]
        for fused in (True, False):
            y = comm.all_reduce(x, regime=A.TWO_STEP, fused=fused)
            if not (bits(y) == all_reduce_reference(xs, "sum")).all():
                raise AssertionError(f"rank {rank}: fused={fused} differs from the reference")
        fns = {"fused": lambda: comm.all_reduce(x, regime=A.TWO_STEP, fused=True),
               "2 calls": lambda: comm.all_reduce(x, regime=A.TWO_STEP, fused=False),
               "rs+ag": lambda: comm.all_gather(comm.reduce_scatter(x))}
        out = {}
        for name in WAYS:
            fns[name]()
            ts = []
            for _ in range(iters):
                barrier()
                t0 = time.perf_counter()
                fns[name]()
                ts.append(time.perf_counter() - t0)
            out[name] = ts
    return out


def main(argv=None) -> int:
    from sparkccl.config import parse_bytes
    from sparkccl.localrun import check, run_ranks
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_nic_arguments(ap, rate_gbps=0.2, sizes="8M", iters=3)
    a = ap.parse_args(argv)
    size = parse_bytes(a.sizes.split(",")[0], "--sizes")
    env = nic_env(a, "emunic-allreduce-")
    print(f"# python benchmarks/allreduce_fused_emunic.py {' '.join(argv or sys.argv[1:])}")
    print(f"# load average at start: {load_average()}")
    print(f"emulated roots at {a.rate_gbps:g} Gb/s each, {a.roots} per port, "
          f"{a.latency_us:g} us latency; {os.cpu_count()} CPUs; bf16 vector of ~{size >> 20} MiB "
          f"per rank; median of {a.iters} calls (slowest rank)")
    print(f"{'topology':<8} {'world':>5} {'slices':>6} {'bound ms':>8} "
          + " ".join(f"{w + ' ms':>10}" for w in WAYS)
          + f" {'of bound':>8} {'/2 calls':>8} {'/rs+ag':>7}")
    for topology in a.topologies.split(","):
        for world in (int(w) for w in a.worlds.split(",")):
            n_elems = size // 2 // (world * 8) * (world * 8)
            res = check(run_ranks(_job, world, args=(topology, n_elems, a.iters), env=env,
                                  timeout_s=1800))
            t = {w: statistics.median(max(r[w][i] for r in res) for i in range(a.iters))
                 for w in WAYS}
            load = max_port_load(topology, world, a.roots, "all_reduce")
            chunk = n_elems * 2 // world
            bound = load * chunk * 8 / (a.rate_gbps * 1e9 * a.roots)
            print(f"{topology:<8} {world:>5} {load:>6g} {bound * 1e3:>8.1f} "
                  + " ".join(f"{t[w] * 1e3:>10.1f}" for w in WAYS)
                  + f" {bound / t['fused']:>8.0%} {t['fused'] / t['2 calls']:>8.2f} "
                  f"{t['fused'] / t['rs+ag']:>7.2f}  load {load_average().split()[0]}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
