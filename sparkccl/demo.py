"""`sparkccl demo`: every collective on N local ranks, every bit checked on every rank.

Part 1 sweeps sizes and dtypes, timing each call (all-reduce at sizes on both sides of the
one-shot crossover, so both regimes run); part 2 issues bursts of mixed
collectives back to back (slot reuse at full speed) and checks them only afterwards;
part 3 runs the fused MoE finalize + reduce-scatter, part 4 expert-parallel dispatch and
combine.
Each rank rebuilds every other rank's input from a seed, so it checks its own results
against an independent rank-order reference (numpy, fp32, rounded once) without
communicating.
"""
from __future__ import annotations

import statistics
import time

# (per-rank elements, dtype name): sizes include ones that are not multiples of 16 bytes.
AG_CASES = [(1, "uint8"), (1000, "uint8"), (2051, "bfloat16"), (16384, "float32"),
            (1 << 19, "bfloat16"), (1 << 22, "bfloat16")]
RS_CASES = [(1, "bfloat16"), (333, "float16"), (4096, "float32"), (1 << 16, "bfloat16"),
            (1 << 19, "float16"), (1 << 22, "bfloat16")]
AR_CASES = [(1, "bfloat16"), (3000, "float16"), (1 << 16, "bfloat16"), (1 << 19, "float32"),
            (1 << 22, "bfloat16")]
# all-to-all: elements per block (one block per destination)
A2A_CASES = [(1, "uint8"), (333, "bfloat16"), (4096, "float32"), (1 << 16, "int32"),
             (1 << 20, "bfloat16")]
QUICK_MAX_ELEMS = 1 << 19
ITERS = 3


def _dtype(name: str):
    import torch
    return getattr(torch, name)


def _on(comm, x):
    """Inputs are made on the CPU (the reference needs them there); the call gets them on
    the communicator's device."""
    return x if comm.device.type == "cpu" else x.to(comm.device)


def _done(comm) -> None:
    """GPU collectives are asynchronous: wait (and surface errors) before reading a clock."""
    if comm.device.type == "cuda":
        comm.synchronize()


def _cases(quick: bool):
    return {kind: [(e, d) for e, d in cases if not (quick and e > QUICK_MAX_ELEMS)]
            for kind, cases in (("all_gather", AG_CASES), ("reduce_scatter", RS_CASES),
                                ("all_reduce", AR_CASES), ("all_to_all", A2A_CASES))}


def _sweep(comm, world: int, rank: int, quick: bool, progress):
    from .reference import (all_gather_reference, all_reduce_reference, all_to_all_reference,
                            bits, make_input, reduce_scatter_reference)

    rows = []
    case = 0
    for kind, cases in _cases(quick).items():
        for done, (elems, dname) in enumerate(cases, 1):
            case += 1
            dtype = _dtype(dname)
            shape = (world * elems,) if kind in ("reduce_scatter", "all_to_all") else (elems,)
            inputs = [make_input(case, r, shape, dtype) for r in range(world)]
            if kind == "all_gather":
                want = all_gather_reference(inputs)
                run = comm.all_gather
                nbytes = world * inputs[rank].nbytes
            elif kind == "reduce_scatter":
                want = reduce_scatter_reference(inputs, rank)
                run = comm.reduce_scatter
                nbytes = inputs[rank].nbytes
            elif kind == "all_to_all":
                want = all_to_all_reference(inputs, rank)
                run = comm.all_to_all
                nbytes = inputs[rank].nbytes
            else:
                want = all_reduce_reference(inputs)
                run = comm.all_reduce
                nbytes = inputs[rank].nbytes
            times, ok = [], True
            x = _on(comm, inputs[rank])
            for _ in range(ITERS):
                _done(comm)
                t0 = time.perf_counter()
                y = run(x)
                _done(comm)
                times.append(time.perf_counter() - t0)
                got = bits(y.cpu())
                ok = ok and got.size == want.size and bool((got == want).all())
            rows.append((kind, dname, nbytes, statistics.median(times), ok))
            progress(kind, done, len(cases))
    return rows


def _demo_rank(rank, world, store, topology, transport, device, quick):
    import sparkccl

    if device == "cuda":
        import torch
        # One process per GPU, or several sharing one when world > GPUs.
        torch.cuda.set_device(rank % torch.cuda.device_count())
    from .exact_checks import ep_demo_case, finalize_demo_case, run_bursts
    from .localrun import report_progress

    def progress(label, done, total, unit="sizes"):
        if rank == 0:  # every rank runs the same steps
            report_progress((label, done, total, unit))

    bursts = 2 if quick else 4
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology=topology,
                               transport=transport, device=device) as comm:
        rows = _sweep(comm, world, rank, quick, progress)
        total, bad = run_bursts(comm, world, rank, bursts=bursts, per_burst=100,
                                op_seed=1000, input_seed=10_000, to=lambda x: _on(comm, x),
                                sync=lambda: _done(comm),
                                on_burst=lambda b: progress("bursts", b, bursts, "bursts"))
        t0 = time.perf_counter()
        fin_ok = finalize_demo_case(comm, world, rank, seed=1)
        progress("moe_finalize", 1, 1, "checks")
        ep_ok = ep_demo_case(comm, world, rank, seed=2)
        progress("expert_parallel", 1, 1, "checks")
        return {"rows": rows, "burst_total": total, "burst_bad": bad, "finalize_ok": fin_ok,
                "finalize_s": time.perf_counter() - t0, "ep_ok": ep_ok,
                "pinned_bytes": comm.pinned_bytes}


def run_demo(world: int = 4, topology: str = "mesh", transport: str = "shm",
             device: str = "cpu", quick: bool = False) -> int:
    from .config import format_bytes
    from .localrun import run_ranks
    from .progress import Progress

    print(f"sparkccl demo: world {world}, topology {topology}, transport {transport}, "
          f"device {device}")
    t0 = time.monotonic()
    progress = Progress("demo")
    try:
        results = run_ranks(_demo_rank, world, args=(topology, transport, device, quick),
                            timeout_s=600, progress=progress)
    finally:
        progress.close()
    failed = [r for r in results if not r.ok]
    if failed:
        for r in failed:
            print(f"rank {r.rank} failed: {r.error_type}: {r.message}")
        print("demo: FAILED")
        return 1
    vals = [r.value for r in results]
    print(f"\n{'collective':<15} {'dtype':<9} {'size':>10} {'time (us)':>10} "
          f"{'algbw GB/s':>10} {'busbw GB/s':>10}  check")
    mismatches = 0
    for i, (kind, dname, nbytes, secs, _) in enumerate(vals[0]["rows"]):
        oks = [v["rows"][i][4] for v in vals]
        bad = [r for r, ok in enumerate(oks) if not ok]
        mismatches += bool(bad)
        # Time from the slowest rank: the call is done when every rank has its result.
        t = max(v["rows"][i][3] for v in vals)
        algbw = nbytes / t / 1e9
        # nccl-tests' bus factors: an all-reduce moves its bytes twice (reduce, then gather).
        busbw = algbw * (2 if kind == "all_reduce" else 1) * (world - 1) / world
        check = "ok" if not bad else f"MISMATCH on ranks {bad}"
        print(f"{kind:<15} {dname:<9} {format_bytes(nbytes):>10} {t * 1e6:>10.1f} "
              f"{algbw:>10.3f} {busbw:>10.3f}  {check}")
    total = sum(v["burst_total"] for v in vals) // world
    burst_bad = [(r, b) for r, v in enumerate(vals) for b in v["burst_bad"]]
    print(f"\nbursts: {total} mixed collectives issued back to back, checked afterwards: "
          + ("all bit-exact on every rank" if not burst_bad else
             f"{len(burst_bad)} MISMATCHES, first: rank {burst_bad[0][0]} {burst_bad[0][1]}"))
    fin_bad = [r for r, v in enumerate(vals) if not v["finalize_ok"]]
    print("moe_finalize_reduce_scatter (bf16 and e4m3 experts, T < Tpad): "
          + ("bit-exact on every rank" if not fin_bad else f"MISMATCH on ranks {fin_bad}"))
    ep_bad = [r for r, v in enumerate(vals) if not v["ep_ok"]]
    print("ExpertParallel dispatch + combine (high-throughput bf16, low-latency e4m3): "
          + ("bit for bit the one-box finalize on every rank" if not ep_bad else
             f"MISMATCH on ranks {ep_bad}"))
    print(f"shared memory per rank: {format_bytes(vals[0]['pinned_bytes'])}")
    ok = not mismatches and not burst_bad and not fin_bad and not ep_bad
    print(f"demo: {'passed' if ok else 'FAILED'} in {time.monotonic() - t0:.1f} s")
    return 0 if ok else 1
