"""Efficiency of the verbs transport against the plan's line-rate bound, through the emulated
RoCE NIC (tests/emunic) with every root rate-limited (token bucket) to a rate this machine
sustains.

Per (topology, world, collective, slice per rank): the time of the slowest rank (median of
``--iters`` calls after a warm-up), the Gb/s each rank receives ((world-1) x slice x 8 /
time) and the bound: per-root rate x roots / the plan's max port load (slices per call
through the busiest port, from the plan verifier) x (world-1). Ranks are processes on this
host; every byte crosses a Unix socket and the receiving process's emulated-NIC thread.

    python benchmarks/emunic_efficiency.py --rate-gbps 0.5 --worlds 2,3,4 --sizes 1M,4M,16M
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import emunic  # noqa: E402


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages, printed beside every figure (this host is
    shared, and contention moves the results)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def add_nic_arguments(ap: argparse.ArgumentParser, *, rate_gbps: float, sizes: str,
                      iters: int) -> None:
    """The emulated NIC and the sweep, as every benchmark over it takes them."""
    ap.add_argument("--rate-gbps", type=float, default=rate_gbps, help="per root (device)")
    ap.add_argument("--latency-us", type=float, default=0, help="one way, per write")
    ap.add_argument("--roots", type=int, default=2)
    ap.add_argument("--worlds", default="2,3,4")
    ap.add_argument("--topologies", default="mesh,ring")
    ap.add_argument("--sizes", default=sizes, help="slice per rank")
    ap.add_argument("--iters", type=int, default=iters)
    ap.add_argument("--pace-on-wake", action="store_true",
                    help="the emulated NIC's old limiter (a late sender thread loses link time)")


def nic_env(a: argparse.Namespace, prefix: str, **extra) -> dict:
    """The environment of ranks that run over one emulated GB10 host set up from ``a``."""
    root = tempfile.mkdtemp(prefix=prefix)
    return {**emunic.host_env(root, rate_gbps=a.rate_gbps, latency_us=a.latency_us,
                              pace_on_wake=a.pace_on_wake, **extra),
            "SPARKCCL_ROOTS": str(a.roots)}


def max_port_load(topology: str, world: int, roots: int, collective: str) -> float:
    from sparkccl.plan.report import COLLECTIVES, build_all, default_sequence, verify_plans
    report = verify_plans(build_all(topology, world, roots), default_sequence())
    return report.max_port_load(COLLECTIVES[collective])


def common_start(store, rank: int, world: int):
    """A barrier that releases every rank at one instant of CLOCK_MONOTONIC (one clock for
    every process on this host): after the store barrier, rank 0 names a start 20 ms ahead
    and every rank sleeps until then. The store barrier alone lets ranks go up to several
    ms apart on a loaded host, and the earliest rank's call then waits for the latest's
    data: that skew is the harness's, not the collective's."""
    n = [0]

    def barrier():
        n[0] += 1
        store.add(f"b{n[0]}", 1)
        while store.add(f"b{n[0]}", 0) < world:
            time.sleep(0.001)
        if rank == 0:
            store.set(f"go{n[0]}", str(time.monotonic_ns() + 20_000_000))
        go = int(store.get(f"go{n[0]}"))
        while time.monotonic_ns() < go - 1_000_000:
            time.sleep(0.0005)
        while time.monotonic_ns() < go:
            pass
    return barrier


def _job(rank, world, store, topology, sizes, iters):
    import torch
    import torch.distributed as dist

    import sparkccl
    out = {}
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology=topology,
                               transport="verbs", timeout_s=300) as comm:
        barrier = common_start(store, rank, world)

        for size in sizes:
            ag_in = torch.full((size,), rank, dtype=torch.uint8)
            rs_in = torch.ones((world * size // 4,), dtype=torch.float32)
            for name, fn in (("all_gather", lambda: comm.all_gather(ag_in)),
                             ("reduce_scatter", lambda: comm.reduce_scatter(rs_in))):
                fn()
                ts = []
                for _ in range(iters):
                    barrier()
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                out[(name, size)] = ts
    del dist
    return out


def main(argv=None) -> int:
    from sparkccl.config import parse_bytes
    from sparkccl.localrun import check, run_ranks
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_nic_arguments(ap, rate_gbps=0.5, sizes="1M,4M,16M", iters=3)
    a = ap.parse_args(argv)
    sizes = [parse_bytes(s, "--sizes") for s in a.sizes.split(",")]
    env = nic_env(a, "emunic-bench-")
    load = load_average()
    print(f"# python benchmarks/emunic_efficiency.py {' '.join(argv or sys.argv[1:])}")
    print(f"# load average at start: {load}" + ("; old limiter (pace_on_wake)"
                                                 if a.pace_on_wake else ""))
    print(f"emulated roots at {a.rate_gbps:g} Gb/s each, {a.roots} per port, "
          f"{a.latency_us:g} us latency; "
          f"{os.cpu_count()} CPUs; median of {a.iters} calls")
    print(f"{'topology':<8} {'world':>5} {'collective':<14} {'slice':>6} {'time ms':>9} "
          f"{'Gb/s/rank':>9} {'bound':>7} {'of bound':>8}")
    for topology in a.topologies.split(","):
        for world in (int(w) for w in a.worlds.split(",")):
            if topology == "ring" and world < 2:
                continue
            res = check(run_ranks(_job, world, args=(topology, sizes, a.iters), env=env,
                                  timeout_s=1800))
            for name in ("all_gather", "reduce_scatter"):
                load = max_port_load(topology, world, a.roots, name)
                bound = (world - 1) * a.rate_gbps * a.roots / load
                for size in sizes:
                    per_call = [max(r[(name, size)][i] for r in res) for i in range(a.iters)]
                    t = statistics.median(per_call)
                    got = (world - 1) * size * 8 / t / 1e9
                    now = load_average().split()[0]
                    print(f"{topology:<8} {world:>5} {name:<14} {size >> 20:>5}M {t * 1e3:>9.1f} "
                          f"{got:>9.3f} {bound:>7.3f} {got / bound:>7.0%}  load {now}",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
