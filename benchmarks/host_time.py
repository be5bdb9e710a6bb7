"""Host time per call of all_gather / reduce_scatter on the CPU data plane, split by phase.

    .venv/bin/python benchmarks/host_time.py                      # shm and tcp, world 2
    .venv/bin/python benchmarks/host_time.py --transports shm --iters 400 --ab
    .venv/bin/python benchmarks/host_time.py --profile 65536      # cProfile of rank 0

Every call is timed on its own (time.perf_counter_ns) and split into:

* ``comm``:    the Communicator's part (input checks, output allocation/checks, slicing,
               sequence number): the call minus the data plane's call;
* ``publish``: the native publish calls (ring entries for the proxy);
* ``wait``:    the native flag waits (the peer's data arriving: on a synchronous CPU plane
               this includes the peer's own host time and the network);
* ``dp other``: the rest of the data plane: Python planning (piece groups, slot views) and
               the byte copies in and out.

``--ab REF`` interleaves calls of this tree's CPU data plane (launch plans: ``new``) with
calls of REF's (``git show REF:sparkccl/dataplane/cpu.py``, e.g. ``main``: ``old``) on the
same communicator — the object's class is swapped between blocks of ``--block`` calls, so
load swings hit both alike — and prints both.
After the table: the proxy's publish -> first post latency (``proxy_stats()``:
``publish_p50_ns`` / ``publish_p99_ns``, stamped by the native publish with CLOCK_MONOTONIC)
and the consume -> post part of it.

The machine's load average is printed with the results: on a shared 2-core host the
waits (and p99s) move with it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

KIB = 1 << 10


class _Timed:
    """Forwards to the native module, adding the time spent in publish and wait_flags."""

    def __init__(self, nat, acc):
        self._nat, self._acc = nat, acc

    def __getattr__(self, name):
        fn = getattr(self._nat, name)
        if name not in ("publish", "publish_range", "wait_flags"):
            return fn
        key = "wait" if name == "wait_flags" else "publish"
        acc = self._acc

        def timed(*a, **k):
            t = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += time.perf_counter_ns() - t
        return timed


def _pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * q))] / 1e3 if v else float("nan")


def _old_class(source: str):
    """The CpuDataPlane class of another revision's cpu.py source, inside this package (its
    relative imports resolve to this tree's base, layout and plan modules)."""
    import types
    mod = types.ModuleType("sparkccl.dataplane._cpu_old")
    mod.__package__ = "sparkccl.dataplane"
    sys.modules[mod.__name__] = mod
    exec(compile(source, "cpu.py@old", "exec"), mod.__dict__)
    return mod.CpuDataPlane


def _rank(rank, world, store, transport, sizes, iters, ab, block, profile):
    import torch

    import sparkccl
    rows = []
    slot = max(sizes)
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, transport=transport,
                               slot_bytes=slot) as comm:
        dp = comm._dp
        acc = {"publish": 0, "wait": 0, "dp": 0}
        dp.nat = _Timed(dp.nat, acc)
        classes = {"new": type(dp)}
        if ab:
            classes["old"] = _old_class(ab)
        for name in ("all_gather", "reduce_scatter"):
            def timed(*a, _name=name, **k):  # the method of the class in use now
                t = time.perf_counter_ns()
                try:
                    return getattr(type(dp), _name)(dp, *a, **k)
                finally:
                    acc["dp"] += time.perf_counter_ns() - t
            setattr(dp, name, timed)
        modes = tuple(classes)
        for size in sizes:
            n = size // 2 // world
            x_ag = torch.ones(n, dtype=torch.bfloat16)
            out_ag = torch.empty(n * world, dtype=torch.bfloat16)
            x_rs = torch.ones(n * world, dtype=torch.bfloat16)
            out_rs = torch.empty(n, dtype=torch.bfloat16)
            calls = {"ag": lambda: comm.all_gather(x_ag, out=out_ag),
                     "rs": lambda: comm.reduce_scatter(x_rs, out=out_rs)}
            for key, call in calls.items():
                samples = {m: {"total": [], "comm": [], "publish": [], "wait": [], "other": []}
                           for m in modes}
                for m in modes:  # warm-up: first use builds plans, faults pages in
                    dp.__class__ = classes[m]
                    call()
                done = 0
                while done < iters:
                    for m in modes:
                        dp.__class__ = classes[m]
                        for _ in range(block):
                            for k in acc:
                                acc[k] = 0
                            t = time.perf_counter_ns()
                            call()
                            total = time.perf_counter_ns() - t
                            s = samples[m]
                            s["total"].append(total)
                            s["comm"].append(total - acc["dp"])
                            s["publish"].append(acc["publish"])
                            s["wait"].append(acc["wait"])
                            s["other"].append(acc["dp"] - acc["publish"] - acc["wait"])
                    done += block
                for m in modes:
                    rows.append((key, size, m, {k: (_pct(v, 0.5), _pct(v, 0.99))
                                                for k, v in samples[m].items()}))
        if profile:
            import cProfile
            import io
            import pstats
            dp.__class__ = classes["new"]
            comm.all_gather(torch.zeros(16, dtype=torch.uint8))  # both ranks in step
            n = profile // 2 // world
            x = torch.ones(n, dtype=torch.bfloat16)
            out = torch.empty(n * world, dtype=torch.bfloat16)
            pr = cProfile.Profile()
            if rank == 0:
                pr.enable()
            for _ in range(iters):
                comm.all_gather(x, out=out)
            if rank == 0:
                pr.disable()
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(18)
                rows.append(("profile", profile, None, buf.getvalue()))
        stats = comm.proxy_stats()
        stats["cache"] = dict(getattr(dp, "plan_stats", {}) or {})
    return {"rows": rows, "proxy": stats}


def _sizes(lo, hi):
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--min-bytes", type=int, default=4 * KIB)
    ap.add_argument("--max-bytes", type=int, default=16 << 20)
    ap.add_argument("--iters", type=int, default=200, help="timed calls per size and mode")
    ap.add_argument("--block", type=int, default=20, help="calls per A/B block")
    ap.add_argument("--ab", metavar="REF", default="",
                    help="interleave calls with REF's CPU data plane (e.g. main)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="a setting for the ranks (repeatable), e.g. SPARKCCL_PROXY_SPIN_US=200000")
    ap.add_argument("--profile", type=int, default=0, metavar="BYTES",
                    help="also run rank 0's all_gather of BYTES under cProfile")
    a = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from sparkccl.localrun import check, run_ranks

    sizes = _sizes(a.min_bytes, a.max_bytes)
    old = ""
    if a.ab:
        import subprocess
        old = subprocess.run(["git", "show", f"{a.ab}:sparkccl/dataplane/cpu.py"], check=True,
                             capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    env = dict(e.split("=", 1) for e in a.env)
    block = min(a.block, a.iters)
    print(f"host_time: world {a.world}, CPU data plane, bf16, {a.iters} timed calls per size "
          f"(after 1 warm-up)"
          f"{f', new/old ({a.ab}) data plane interleaved in blocks of {block}' if a.ab else ''}"
          f"{'; settings ' + ' '.join(a.env) if a.env else ''}; "
          f"size = whole buffer (gathered output / reduce-scatter input); µs, p50 / p99; "
          f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"{os.cpu_count()} CPUs")
    for transport in a.transports.split(","):
        t0 = time.time()
        vals = check(run_ranks(_rank, a.world, args=(transport, sizes, a.iters, old, block,
                                                     a.profile), timeout_s=1800, env=env))
        print(f"\n== transport {transport} (rank 0; {time.time() - t0:.0f} s, load average "
              f"after: {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
        print(f"{'op':>3} {'size':>9} {'plane':>5} | {'total':>15} | {'comm':>13} | "
              f"{'publish':>13} | {'wait':>15} | {'dp other':>15}")
        profile = None
        for key, size, mode, r in vals[0]["rows"]:
            if key == "profile":
                profile = (size, r)
                continue
            cell = lambda k, w: f"{r[k][0]:>{w // 2}.1f}/{r[k][1]:<{w - w // 2 - 1}.1f}"  # noqa: E731
            print(f"{key:>3} {size:>9} {mode:>5} | {cell('total', 15)} | "
                  f"{cell('comm', 13)} | {cell('publish', 13)} | {cell('wait', 15)} | "
                  f"{cell('other', 15)}")
        for rank, v in enumerate(vals):
            st = v["proxy"]
            if st.get("publish_samples"):
                print(f"proxy rank {rank}: publish -> first post p50 "
                      f"{st['publish_p50_ns'] / 1e3:.1f} µs, p99 {st['publish_p99_ns'] / 1e3:.1f} µs "
                      f"({st['publish_samples']} pieces; of it ring entry consumed -> first post: "
                      f"p50 {st['delay_p50_ns'] / 1e3:.1f} µs, p99 {st['delay_p99_ns'] / 1e3:.1f} µs)")
            elif st.get("delay_samples"):
                print(f"proxy rank {rank}: ring entry consumed -> first post p50 "
                      f"{st['delay_p50_ns'] / 1e3:.1f} µs, p99 {st['delay_p99_ns'] / 1e3:.1f} µs "
                      "(this build has no publish stamp)")
            if st.get("cache"):
                print(f"launch-plan cache rank {rank}: {st['cache']}")
        if profile:
            print(f"\ncProfile, rank 0, {a.iters} all_gathers of {profile[0]} bytes "
                  "(this tree's data plane), by own time:")
            print("\n".join(profile[1].splitlines()[:32]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
