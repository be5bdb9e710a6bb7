"""Expert-parallel dispatch + combine against the all-gather + reduce-scatter formulation of
the same MoE layer, measured in the same run (CPU ranks over shm by default).

One MoE layer, every rank with T tokens of hidden H routed to topk of E experts:

  ep            ExpertParallel.dispatch (bf16 tokens) + combine (bf16 expert outputs, the
                finalize on the home rank): two all-to-alls (docs/EXPERT_PARALLEL.md "The
                movement"), bit-exact with one box
  ep partial    the same dispatch, combine(partial=True): each expert rank sums its own
                experts' weighted rows of a token first and returns one row per (token,
                rank); the home adds them in rank order (an opt-in with its own bits, those
                of the grouping ag+rs uses; docs/EXPERT_PARALLEL.md "Per-rank partial
                combine")
  ag+rs         all_gather of the tokens and of the routing (ids + weights), then every
                rank's partial outputs finalized into the reduce-scatter
                (moe_finalize_reduce_scatter over world * T rows): vLLM's
                ``allgather_reducescatter`` backend on sparkccl's collectives (not bit-exact
                with one box: each rank's partial sum is rounded before the rank-order sum)

``sparkccl bench --collective ep`` runs the same layer (sparkccl/ep_bench.py, which this
script's formulation and timing come from) over several token counts of one world; this
script runs several worlds. The experts' own compute is not timed in either (the expert
outputs are made once). Each time is the slowest rank's wall time of one layer (ranks
aligned by a small all-gather first, and on CUDA the stream synchronized), median over
--iters; ``ratio`` is ag+rs / ep (above 1: EP is faster), ``ratio partial`` ag+rs / ep
partial; ``dispatch`` the dispatch alone (the rest of ep, ep partial is their combine). The
combine results are checked against their references (one box; the per-rank partial sums)
once per world.

    python3 benchmarks/ep_bench.py --worlds 2 3 4 --out benchmarks/ep_bench_cpu.txt
    # one GPU, ranks sharing it (the issue's sizes: decode, then prefill)
    python3 benchmarks/ep_bench.py --device cuda --worlds 2 4 --tokens 128 --hidden 7168 \
        --topk 8 --experts-per-rank 64 --mode low_latency --slot-mib 256
    python3 benchmarks/ep_bench.py --device cuda --worlds 4 --tokens 4096 --hidden 7168 \
        --topk 8 --experts-per-rank 64 --slot-mib 256 --iters 5 [--torch-dispatch]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from sparkccl.ep_bench import agrs_formulation, timed  # noqa: E402


def bench_job(rank, world, store, T, H, K, E, iters, mode, device, slot_mib,
              torch_dispatch=False):
    import numpy as np
    import torch

    import sparkccl
    from sparkccl.ep_reference import (combine_reference, make_ep_input,
                                       partial_combine_reference, run_experts)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    cpu_inp = make_ep_input(7, rank, tokens=T, hidden=H, topk=K, num_experts=E, world=world)
    inp = {k: None if v is None else v.to(device) for k, v in cpu_inp.items()}
    # The combine in one collective, unless --slot-mib caps it.
    slot = max(1 << 20, world * (T * K + 1) * H * 2)  # (+ the sized combine's header row)
    if slot_mib:
        slot = min(slot, slot_mib << 20)
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, slot_bytes=slot,
                               timeout_s=300, device=device) as comm:
        ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T, mode=mode)
        x, idx, w, shared = inp["x"], inp["topk_idx"], inp["topk_weights"], inp["shared"]
        recv, handle = ep.dispatch(x, idx, w)
        out = run_experts(ep, recv)
        z = ep.combine(out, handle, shared=shared)
        exact = bool(np.array_equal(z.cpu().view(torch.int16).numpy().view(np.uint16),
                                    combine_reference(cpu_inp)))
        z = ep.combine(out, handle, shared=shared, partial=True)
        exact &= bool(np.array_equal(z.cpu().view(torch.int16).numpy().view(np.uint16),
                                     partial_combine_reference(cpu_inp, ep.owners, world)))

        agrs_layer = agrs_formulation(comm, x, idx, w, shared)
        dev = comm.device
        tick = torch.zeros(16, dtype=torch.uint8, device=dev)

        def sync():
            if device == "cuda":
                torch.cuda.synchronize()

        def ep_layer(e=ep, partial=False):
            r, h = e.dispatch(x, idx, w)
            return e.combine(out, h, shared=shared, partial=partial)

        layers = [("ep", ep_layer), ("ep partial", lambda: ep_layer(partial=True)),
                  ("ag+rs", agrs_layer), ("dispatch", lambda: ep.dispatch(x, idx, w))]
        if torch_dispatch:  # the same layer with dispatch's torch ops (the fused kernels' spec)
            ep_t = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T,
                                           mode=mode, _fused=False)
            layers.append(("ep torch", lambda: ep_layer(ep_t)))
        times = timed(layers, iters, lambda: comm.all_gather(tick), sync)
        return {"times": times, "exact": exact}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts-per-rank", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--mode", default="high_throughput")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (ranks share the GPUs)")
    ap.add_argument("--slot-mib", type=int, default=0,
                    help="cap the slot (default: the whole combine block)")
    ap.add_argument("--torch-dispatch", action="store_true",
                    help="CUDA: also time ep with dispatch's torch ops (_fused=False)")
    ap.add_argument("--out", help="also write the table to this file")
    a = ap.parse_args()
    from sparkccl.localrun import check, run_ranks
    lines = [f"# benchmarks/ep_bench.py {' '.join(sys.argv[1:])}",
             f"# host {platform.node()} cpus {os.cpu_count()} python {platform.python_version()}",
             f"# T {a.tokens} tokens/rank, H {a.hidden}, top-{a.topk} of "
             f"{a.experts_per_rank} experts/rank, bf16, mode {a.mode}, {a.device} ranks over "
             "shm; median of the slowest rank, ms",
             f"{'world':>5} {'ep ms':>9} {'ag+rs ms':>9} {'ratio ag+rs/ep':>15} {'exact':>6}"
             f" {'ep partial ms':>14} {'ratio partial':>14} {'dispatch ms':>12}"
             + (f" {'ep torch ms':>12}" if a.torch_dispatch else "")]
    print("\n".join(lines), flush=True)
    for W in a.worlds:
        E = a.experts_per_rank * W
        vals = check(run_ranks(bench_job, W, args=(a.tokens, a.hidden, a.topk, E, a.iters,
                                                   a.mode, a.device, a.slot_mib,
                                                   a.torch_dispatch),
                              timeout_s=1800))
        med = {}
        for name in vals[0]["times"]:
            per_iter = zip(*(v["times"][name] for v in vals))
            med[name] = statistics.median(max(t) for t in per_iter) * 1e3
        line = (f"{W:>5} {med['ep']:>9.2f} {med['ag+rs']:>9.2f} "
                f"{med['ag+rs'] / med['ep']:>15.2f} {str(all(v['exact'] for v in vals)):>6}"
                f" {med['ep partial']:>14.2f} {med['ag+rs'] / med['ep partial']:>14.2f}"
                f" {med['dispatch']:>12.2f}"
                + (f" {med['ep torch']:>12.2f}" if a.torch_dispatch else ""))
        print(line, flush=True)
        lines.append(line)
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
