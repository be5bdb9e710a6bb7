"""Captured vs eager: 10 collectives issued one by one against one replay of a CUDA graph of
the same 10 (issue 17's bar: the replay at least as fast), through the Communicator, one
process per rank.

Each round is 10 collectives per rank (all-gathers and reduce-scatters alternating, bf16,
``--kib`` per rank each); a round is timed from before its first call to the end of a
stream synchronization, median over ``--rounds``; "host" is the time until the calls (or
the replay) returned, before the synchronization. Rank 0 prints; every rank checks the
last round's outputs against the references bit for bit.

    python benchmarks/graph_replay.py [--world 2] [--kib 64 1024 4096] [--rounds 50]
    SPARKCCL_GPU_DIRECT=0 python benchmarks/graph_replay.py   # the proxy path
    python benchmarks/graph_replay.py --inproc                # one process, a stream per rank

Ranks sharing one GPU time-slice unless MPS runs (see issue 17: ``nvidia-cuda-mps-control
-d`` first); on two GPUs each rank takes its own (rank % device count). ``--inproc`` puts
every rank in this process on one GPU, each on its own stream (the tests' in-process world:
data planes and proxies, no Communicator), so the ranks run concurrently without MPS; a
round there is every rank's 10 calls (or every rank's replay), timed together.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _job(rank, world, store, kibs, rounds, topology, profile=0, breakdown=0):
    import torch as T
    import torch.distributed as dist

    import sparkccl
    from sparkccl.reference import all_gather_reference as agr
    from sparkccl.reference import bits as B
    from sparkccl.reference import make_input as mk
    from sparkccl.reference import reduce_scatter_reference as rsr
    T.cuda.set_device(rank % T.cuda.device_count())
    W = world
    rows = []
    bad = []
    with sparkccl.Communicator(store=dist.PrefixStore("graph_replay", store), rank=rank,
                               world_size=W, device="cuda", topology=topology,
                               slot_bytes=max(8 << 20, 2 * W * max(kibs) << 10),
                               timeout_s=60) as g:
        for kib in kibs:
            n = (kib << 10) // 2  # bf16 elements per rank
            xs = [T.zeros((n,), dtype=T.bfloat16, device="cuda") if k % 2 == 0 else
                  T.zeros((W * n,), dtype=T.bfloat16, device="cuda") for k in range(10)]

            def ten():
                return [g.all_gather(x) if k % 2 == 0 else g.reduce_scatter(x)
                        for k, x in enumerate(xs)]

            def timed(fn):
                T.cuda.synchronize()
                t0 = time.perf_counter()
                out = fn()
                t1 = time.perf_counter()
                g.synchronize()
                return out, t1 - t0, time.perf_counter() - t0

            for _ in range(3):  # warm-up: launch plans, buffers, first-use costs
                timed(ten)
            if profile and kib == kibs[0]:  # (every rank runs the rounds; rank 0 reports)
                _profile(lambda: timed(ten), profile, report=rank == 0)
            if breakdown:
                _breakdown(g, lambda: timed(ten), breakdown, kib, report=rank == 0)
            graph = T.cuda.CUDAGraph()
            with T.cuda.graph(graph):
                gouts = ten()
            eager_t, eager_h, rep_t, rep_h = [], [], [], []
            for _ in range(rounds):  # alternate, so drift hits both alike
                _, h, t = timed(ten)
                eager_h.append(h)
                eager_t.append(t)
                _, h, t = timed(graph.replay)
                rep_h.append(h)
                rep_t.append(t)
            # Exactness of the last replay and an eager round on fresh inputs.
            ins = [[mk(kib * 100 + k, r, tuple(x.shape), T.bfloat16) for r in range(W)]
                   for k, x in enumerate(xs)]
            for x, v in zip(xs, ins):
                x.copy_(v[rank])
            graph.replay()
            eouts = ten()
            g.synchronize()
            for k in range(10):
                ref = agr(ins[k]) if k % 2 == 0 else rsr(ins[k], rank)
                for what, o in (("replay", gouts[k]), ("eager", eouts[k])):
                    if not (B(o.cpu()) == ref).all():
                        bad.append(f"{kib} KiB collective {k} ({what}) differs")
            med = statistics.median
            rows.append((kib, med(eager_t), med(rep_t), med(eager_h), med(rep_h)))
            del graph
    return rows, bad


def _profile(fn, rounds: int, report: bool) -> None:
    """Where the host time of eager calls goes: cProfile over ``rounds`` eager rounds, the
    functions with the most time of their own (on stderr, if ``report``)."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(rounds):
        fn()
    prof.disable()
    if not report:
        return
    print(f"graph_replay --profile: {rounds} eager rounds of 10 calls, rank 0", file=sys.stderr)
    pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)


def _breakdown(comm, fn, rounds: int, kib: int, report: bool) -> None:
    """Where an eager call's host time goes, layer by layer: each function below is wrapped
    to add its own perf_counter_ns time to its row (a wrapper costs ~0.1-0.3 us, counted in
    the rows around it); per collective call, means over ``rounds`` rounds of 10 calls."""
    import sparkccl.checks as checks
    dp = comm._dp
    spent: dict[str, int] = {}
    undo = []

    def wrap(owner, name: str, row: str) -> None:
        inner = getattr(owner, name)
        spent[row] = 0

        def timed(*a, **k):
            t0 = time.perf_counter_ns()
            try:
                return inner(*a, **k)
            finally:
                spent[row] += time.perf_counter_ns() - t0
        setattr(owner, name, timed)
        undo.append((owner, name, inner))

    # Outer to inner: the Communicator call, its input's checks and its output allocation,
    # the data plane's call, its checks, the native issue of the launch plan.
    wrap(comm, "all_gather", "Communicator.all_gather (AG total)")
    wrap(comm, "reduce_scatter", "Communicator.reduce_scatter (RS total)")
    wrap(checks, "usable", "  checks.usable (the input's checks)")
    wrap(checks, "out", "  checks.out (torch.empty of the result)")
    wrap(dp, "all_gather", "  data plane all_gather")
    wrap(dp, "reduce_scatter", "  data plane reduce_scatter")
    wrap(dp, "_check_call", "    _check_call (GPU record, abort; sizes every 8th call)")
    wrap(dp, "check_sizes", "      check_sizes")
    if dp.peer_check is not None:
        wrap(dp.peer_check, "entry", "        peer_check.entry (a source's call entry)")
    wrap(dp.gpu, "issue_plan", "    gpu.issue_plan (native LaunchPlan.issue)")
    for name, engine in dp.engines.direct.items():
        wrap(engine, "run", f"    engines.{name}.run (GPU-direct engines off the launch plan)")
    wrap(dp.gpu, "run_program", "      gpu.run_program (mode ce: native OpProgram.issue)")
    try:
        for _ in range(rounds):
            fn()
    finally:
        for owner, name, inner in reversed(undo):
            if owner is checks:
                setattr(owner, name, inner)
            else:
                delattr(owner, name)
    if report:
        calls = rounds * 10
        print(f"graph_replay --breakdown: {kib} KiB/rank, rank 0, {rounds} rounds; us per "
              f"collective call (AG and RS rows: per call of their own kind)", file=sys.stderr)
        for row, ns in spent.items():
            per = calls // 2 if ("AG" in row or "RS" in row or "all_gather" in row
                                 or "reduce_scatter" in row) else calls
            print(f"  {row:<52} {ns / per / 1e3:8.2f}", file=sys.stderr)


def _inproc(world: int, kibs: list, rounds: int, topology: str) -> tuple[list, list]:
    """The same rounds with every rank in this process (tests/test_cuda_dataplane.World)."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # a hardware queue per stream
    import torch

    from tests.test_cuda_dataplane import GraphCase, Graphs, World
    direct = os.environ.get("SPARKCCL_GPU_DIRECT") != "0"
    rows, bad = [], []
    for kib in kibs:
        n = (kib << 10) // 2
        specs = [("ag", (n,), torch.bfloat16) if k % 2 == 0 else
                 ("rs", (world * n,), torch.bfloat16) for k in range(10)]
        with World("cuda", topology, world, max_slice=kib << 10, timeout_s=60,
                   direct=direct) as w:
            case = GraphCase(w, specs)

            def eager():
                for r in range(world):
                    with w.be.on(r):
                        case.issue(r)
                w.seq += len(specs)

            def timed(fn):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                return t1 - t0, time.perf_counter() - t0

            for _ in range(3):
                timed(eager)
            graphs = Graphs(w)
            graphs.capture(case.issue)
            et, eh, rt, rh = [], [], [], []
            for _ in range(rounds):
                h, t = timed(eager)
                eh.append(h)
                et.append(t)
                h, t = timed(graphs.replay)
                rh.append(h)
                rt.append(t)
            xs = case.fill(kib)
            graphs.replay()
            w.sync()
            try:
                case.check(xs, f"{kib} KiB replay")
            except AssertionError as e:
                bad.append(str(e))
        med = statistics.median
        # Per rank: the host issued every rank's calls in a round.
        rows.append((kib, med(et), med(rt), med(eh) / world, med(rh) / world))
    return rows, bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--kib", type=int, nargs="+", default=[64, 1024, 4096])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--topology", default="mesh")
    ap.add_argument("--profile", type=int, default=0, metavar="ROUNDS",
                    help="rank 0 profiles ROUNDS eager rounds of the first size (stderr)")
    ap.add_argument("--breakdown", type=int, default=0, metavar="ROUNDS",
                    help="rank 0 times the layers of ROUNDS eager rounds per size (stderr)")
    ap.add_argument("--inproc", action="store_true",
                    help="every rank in this process, a stream each (no MPS needed)")
    args = ap.parse_args()
    if args.inproc:
        rows, bad = _inproc(args.world, args.kib, args.rounds, args.topology)
        values = [(rows, bad)]
        where = "one process, a stream per rank, host time per rank"
    else:
        from sparkccl.localrun import check, run_ranks
        values = check(run_ranks(_job, args.world, args=(args.kib, args.rounds, args.topology,
                                                         args.profile, args.breakdown),
                                         timeout_s=480))
        bad = [f"rank {r}: {x}" for r, (_, xs) in enumerate(values) for x in xs]
        where = (f"a process per rank, rank 0, MPS pipe "
                 f"{os.environ.get('CUDA_MPS_PIPE_DIRECTORY', 'unset')}")
    import torch
    path = "proxy" if os.environ.get("SPARKCCL_GPU_DIRECT") == "0" else "GPU-direct"
    print(f"graph_replay: world {args.world}, {args.topology}, {path}, "
          f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, {where}; "
          f"10 collectives (AG/RS alternating, bf16), median of {args.rounds} rounds")
    print(f"{'KiB/rank':>9} {'eager 10 ms':>12} {'replay ms':>10} {'eager/replay':>13} "
          f"{'eager host us/call':>19} {'replay host us':>15}")
    for kib, et, rt, eh, rh in values[0][0]:
        print(f"{kib:>9} {et * 1e3:>12.3f} {rt * 1e3:>10.3f} {et / rt:>12.2f}x "
              f"{eh / 10 * 1e6:>19.1f} {rh * 1e6:>15.1f}")
    print("exact: all outputs equal the references" if not bad else "\n".join(bad))
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
