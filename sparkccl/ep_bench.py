"""`sparkccl bench --collective ep`: one MoE layer's expert-parallel dispatch + combine,
beside the all-gather + reduce-scatter formulation of the same layer and torch.distributed
moving the same bytes, all measured in the same run (docs/EXPERT_PARALLEL.md "Benchmarks").

Every rank holds T tokens of hidden H (bf16) routed to top-k of E experts
(:func:`sparkccl.ep_reference.make_ep_input`: random routing with its edge cases):

  ep        ExpertParallel.dispatch + combine (the one-box finalize on the home rank): two
            all-to-alls, bit-exact with one box (checked once per token count)
  partial   the same dispatch, combine(partial=True): one row per (token, expert rank)
            back, the bits of the grouping ag+rs uses (checked too)
  ag+rs     all-gather of the tokens and the routing, then every rank's expert outputs for
            all world * T tokens finalized into moe_finalize_reduce_scatter: vLLM's
            ``allgather_reducescatter`` backend on sparkccl's collectives
  a2a       torch.distributed ``all_to_all_single`` (gloo on CPU, NCCL on CUDA) of the
            same token rows out and expert rows back, uneven splits, nothing packed or
            summed: the movement alone, a floor for ep rather than a formulation of the layer

The experts' compute is not timed (their outputs are made once). A time is the slowest
rank's for one layer (ranks aligned by a small all-gather first, CUDA synchronized),
median over the iterations; ``GB/s``: the token rows the busiest rank sends in dispatch
and the expert rows it returns in combine, over the ep time.
"""
from __future__ import annotations

import statistics
import time


def agrs_formulation(comm, x, idx, w, shared, generator=None):
    """The all-gather + reduce-scatter formulation of one MoE layer (vLLM's
    ``allgather_reducescatter``) on ``comm``, as a callable: the tokens ``x`` [T, H] and the
    routing (one all-gather of [T, K] int32 ids + fp32 weights) gathered, then every rank's
    expert outputs for all W * T tokens finalized into ``moe_finalize_reduce_scatter``
    (the rows made once here, randn * 0.5 from ``generator``; the shared expert counted on
    its own rank only)."""
    import torch
    T, K = idx.shape
    H, rank, world, dev = x.shape[1], comm.rank, comm.world_size, comm.device
    routing = torch.cat([idx.to(torch.int32).view(torch.uint8).view(T, -1),
                         w.view(torch.uint8).view(T, -1)], dim=1).contiguous()
    N = world * T
    y_all = (torch.randn((N * K, H), device=dev, generator=generator) * 0.5).to(
        torch.bfloat16)  # (token, k) rows
    pos = torch.arange(N * K, dtype=torch.int32, device=dev)
    shared_all = torch.zeros((N, H), dtype=torch.bfloat16, device=dev)
    shared_all[rank * T:(rank + 1) * T] = shared

    def layer():
        comm.all_gather(x)
        wts = comm.all_gather(routing)[:, K * 4:].contiguous().view(torch.float32)  # [N, K]
        return comm.moe_finalize_reduce_scatter(y_all, pos, wts, shared_all, num_tokens=N,
                                                padded_tokens=N)
    return layer


def movement(idx, owners: list, rank: int, world: int) -> tuple[list, list]:
    """Rows rank ``rank`` sends to each rank: in dispatch (its tokens, once per rank that
    holds one of their experts) and back in combine (one per top-k entry whose expert
    another rank holds): ``(dispatch_rows, combine_rows)``, ``[world]`` each, 0 to itself."""
    out, back = [0] * world, [0] * world
    for row in idx.tolist():
        ranks = [owners[int(e)] for e in row]
        for r in set(ranks) - {rank}:
            out[r] += 1
        for r in ranks:
            if r != rank:
                back[r] += 1
    return out, back


def timed(layers: list, iters: int, align, sync) -> dict:
    """``{name: [seconds per call]}`` over ``iters`` calls of each of ``layers`` (name, fn),
    interleaved, after two unrecorded rounds; ``align()`` lines the ranks up before each."""
    times = {name: [] for name, _ in layers}
    for it in range(iters + 2):
        for name, fn in layers:
            align()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if it >= 2:
                times[name].append(time.perf_counter() - t0)
    return times


def _routing(T, H, K, E, rank, world):
    from .ep_reference import make_ep_input
    return make_ep_input(7 + T, rank, tokens=T, hidden=H, topk=K, num_experts=E, world=world)


def sparkccl_rank(rank, world, store, topology, transport, device, tokens, H, K, E, iters,
                  mode):
    """One rank's ep / partial / ag+rs times for each token count in ``tokens``."""
    import numpy as np
    import torch

    import sparkccl
    from .bench_timing import setup_device
    from .ep_reference import combine_reference, partial_combine_reference, run_experts
    dev = setup_device(device, rank)
    # a combine in one slot, up to 256 MiB (above, its blocks go in several collectives)
    slot = min(max(1 << 20, world * (max(tokens) * K + 1) * H * 2), 256 << 20)
    rows = []
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology=topology,
                               transport=transport, device=dev, slot_bytes=slot,
                               timeout_s=300) as comm:
        tick = torch.zeros(16, dtype=torch.uint8, device=dev)

        def sync():
            if dev.type == "cuda":
                torch.cuda.synchronize()
        for T in tokens:
            cpu_inp = _routing(T, H, K, E, rank, world)
            x, idx, w, shared = (cpu_inp[k].to(dev) for k in
                                 ("x", "topk_idx", "topk_weights", "shared"))
            ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T,
                                         mode=mode)
            recv, handle = ep.dispatch(x, idx, w)
            out = run_experts(ep, recv)
            bits = {}
            for partial, want in ((False, combine_reference(cpu_inp)),
                                  (True, partial_combine_reference(cpu_inp, ep.owners, world))):
                z = ep.combine(out, handle, shared=shared, partial=partial)
                bits[partial] = bool(np.array_equal(
                    z.cpu().view(torch.int16).numpy().view(np.uint16), want))

            def ep_layer(partial=False):
                _, h = ep.dispatch(x, idx, w)
                return ep.combine(out, h, shared=shared, partial=partial)
            layers = [("ep", ep_layer), ("partial", lambda: ep_layer(True)),
                      ("ag+rs", agrs_formulation(comm, x, idx, w, shared)),
                      ("dispatch", lambda: ep.dispatch(x, idx, w))]
            times = timed(layers, iters, lambda: comm.all_gather(tick), sync)
            sent, back = movement(cpu_inp["topk_idx"], ep.owners, rank, world)
            rows.append(dict(T=T, times=times, exact=bits[False], partial_exact=bits[True],
                             sent=sent, back=back))
    return rows


def baseline_rank(rank, world, store, backend, device, tokens, H, K, E, iters):
    """One rank's torch.distributed all_to_all_single of the same rows (``movement``: each
    token row out once per rank holding one of its experts, one expert row back per
    top-k entry held elsewhere), uneven splits, for each token count."""
    import warnings

    import torch
    import torch.distributed as dist

    from .bench_timing import setup_device
    from .expert_parallel import placement_table
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    dev = setup_device(device, rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            device_id=dev if dev.type == "cuda" else None)
    owners = placement_table("contiguous", E, world)
    rows = []
    try:
        def sync():
            if dev.type == "cuda":
                torch.cuda.synchronize()
        for T in tokens:
            idx = _routing(T, H, K, E, rank, world)["topk_idx"]
            # what every rank sends to every rank: the receive splits are the peers' sends
            mine = torch.tensor(movement(idx, owners, rank, world), dtype=torch.int64,
                                device=dev)
            every = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            out_split, back_split = mine[0].tolist(), mine[1].tolist()
            in_split = [int(m[0][rank]) for m in every]
            in_back = [int(m[1][rank]) for m in every]
            bufs = [torch.ones((sum(s), H), dtype=torch.bfloat16, device=dev)
                    for s in (out_split, in_split, back_split, in_back)]

            def layer():
                dist.all_to_all_single(bufs[1], bufs[0], in_split, out_split)
                dist.all_to_all_single(bufs[3], bufs[2], in_back, back_split)
            times = timed([("a2a", layer)], iters, dist.barrier, sync)
            rows.append(dict(T=T, times=times))
    finally:
        dist.destroy_process_group()
    return rows


def _median_slowest(per_rank: list, i: int, name: str) -> float:
    """Median over the iterations of the slowest rank's time, seconds."""
    return statistics.median(max(t) for t in zip(*(v[i]["times"][name] for v in per_rank)))


def print_table(ours: list, base: dict, H: int) -> None:
    """``ours``: every rank's :func:`sparkccl_rank` rows; ``base``: name -> every rank's
    :func:`baseline_rank` rows."""
    head = (f"{'tokens':>7} {'ep ms':>8} {'dispatch ms':>12} {'GB/s':>7} {'exact':>6} "
            f"{'partial ms':>11} {'ag+rs ms':>9} {'ag+rs/ep':>9} {'ag+rs/partial':>14}")
    for name in base:
        head += f" | {name + ' a2a ms':>16} {'a2a/ep':>7}"
    print(head)
    for i, row in enumerate(ours[0]):
        t = {n: _median_slowest(ours, i, n) for n in ("ep", "partial", "ag+rs", "dispatch")}
        busiest = max(sum(r[i]["sent"]) + sum(r[i]["back"]) for r in ours) * H * 2
        exact = all(r[i]["exact"] and r[i]["partial_exact"] for r in ours)
        line = (f"{row['T']:>7} {t['ep'] * 1e3:>8.2f} {t['dispatch'] * 1e3:>12.2f} "
                f"{busiest / t['ep'] / 1e9:>7.3f} {str(exact):>6} {t['partial'] * 1e3:>11.2f} "
                f"{t['ag+rs'] * 1e3:>9.2f} {t['ag+rs'] / t['ep']:>9.2f} "
                f"{t['ag+rs'] / t['partial']:>14.2f}")
        for per_rank in base.values():
            b = _median_slowest(per_rank, i, "a2a")
            line += f" | {b * 1e3:>16.2f} {b / t['ep']:>7.2f}"
        print(line)
    print("\nep: dispatch + combine (one-box bits), partial: with combine(partial=True); "
          "exact: both checked bit for bit against their references; GB/s: the busiest "
          "rank's token rows out and expert rows back over the ep time; ratios above 1: ep "
          "(or partial) is faster; a2a: torch.distributed moving the same rows, nothing "
          "packed or summed (a floor, not the layer)")
