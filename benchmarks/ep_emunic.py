"""Expert-parallel dispatch and combine on the emulated RoCE NIC (tests/emunic, every root
rate-limited), against their plans' line-rate bound, in the same run; high-throughput mode
by default, ``--mode low_latency`` for the decode mode's fixed blocks.

Both move their rows with one all-to-all each (docs/PROTOCOL.md "All-to-all": the
reduce-scatter's wire), of one block per (source, destination) pair sized by the largest
pair (dispatch: the tokens a rank sends another, each once; combine: the expert rows that
go back; in low-latency mode the fixed bounds instead: ``--tokens`` rows, and ``--tokens x
min(topk, experts per rank)`` back). Per (topology, world), every rank has ``--tokens``
tokens of hidden ``--hidden`` (bf16) routed to top-``--topk`` of ``--experts-per-rank`` x
world experts (random, as the tests' routings). Times are the slowest rank's call (median
of ``--iters``, every rank released at one instant, as benchmarks/emunic_efficiency.py):

* ``dispatch``: ``ExpertParallel.dispatch`` (the counts' all-gather, packing, the
  all-to-all, the receiver's selection);
* ``combine``: ``ExpertParallel.combine`` (the all-to-all back and the finalize);
* ``a2a``: ``all_to_all`` alone of blocks of the same sizes, sized as the phases' own
  blocks are (the wire's share);
* ``partial``: ``combine(partial=True)`` (the per-rank partial combine, an opt-in with its
  own bits: one row per (token, rank) returns instead of one per entry), beside the exact
  combine (``partial / combine``: below 1, the opt-in is faster);
* ``ag+rs``: the all-gather + reduce-scatter formulation of the same layer (as
  benchmarks/ep_bench.py: all-gather of the tokens and the routing, then every rank's
  partial outputs finalized into ``moe_finalize_reduce_scatter``), and the ratios
  ``ag+rs / ep`` (dispatch + combine) and ``ag+rs / partial`` (dispatch + partial combine):
  above 1, EP is faster;

and each one's bound: the reduce-scatter plan's max port load (``sparkccl plan``) x its
block bytes x 8 / (rate x roots), and ``sent ms``, the same of the bytes the proxies posted
for one call (the most loaded rank's over its ports: one on a mesh, two on a ring), which
is what the sized blocks send; ``of bound`` is the latter over the phase's time.
``fill``: the mean pair's rows / the block's rows (the bound counts whole blocks of the
largest pair; both phases' blocks are sized, so only each pair's own rows travel, plus
dispatch's ids: a fill below 1 is what equal blocks would cost). The combine is checked bit
for bit against the one-box finalize reference before timing, the partial combine against
its own reference.

    nice -n 19 python benchmarks/ep_emunic.py --rate-gbps 0.2 --worlds 2,3,4,5,6
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from sparkccl.ep_bench import agrs_formulation  # noqa: E402
from emunic_efficiency import (  # noqa: E402  (puts tests/ on the path)
    add_nic_arguments, common_start, load_average, max_port_load, nic_env,
)
from helpers import posted_bytes  # noqa: E402

PHASES = ("dispatch", "combine")


def _job(rank, world, store, topology, T, H, K, E, iters, mode):
    import numpy as np
    import torch

    import sparkccl
    from sparkccl.expert_parallel import BlockLayout
    from sparkccl.ep_reference import (combine_reference, make_ep_input,
                                       partial_combine_reference, run_experts)
    inp = make_ep_input(11, rank, tokens=T, hidden=H, topk=K, num_experts=E, world=world)
    # uniform routing (the tests' routings are skewed on purpose: idle experts, tokens whose
    # top-k all live on one rank)
    g = torch.Generator().manual_seed(1000 + rank)
    inp["topk_idx"] = torch.rand(T, E, generator=g).topk(K).indices
    x, idx, w, shared = inp["x"], inp["topk_idx"], inp["topk_weights"], inp["shared"]
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology=topology,
                               transport="verbs", timeout_s=300) as comm:
        barrier = common_start(store, rank, world)
        ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T, mode=mode)
        recv, handle = ep.dispatch(x, idx, w)
        out = run_experts(ep, recv)
        z = ep.combine(out, handle, shared=shared)
        if not np.array_equal(z.view(torch.int16).numpy().view(np.uint16),
                              combine_reference(inp)):
            raise AssertionError(f"rank {rank}: combine differs from the one-box reference")
        z = ep.combine(out, handle, shared=shared, partial=True)
        if not np.array_equal(z.view(torch.int16).numpy().view(np.uint16),
                              partial_combine_reference(inp, ep.owners, world)):
            raise AssertionError(f"rank {rank}: the partial combine differs from its reference")
        # this rank's rows to each destination: tokens (once each) and entries
        owner = torch.tensor(ep.owners)[idx]
        sent = [int((owner == d).any(1).sum()) for d in range(world)]
        back = [int((owner == d).sum()) for d in range(world)]
        ts = {p: [] for p in PHASES + ("a2a dispatch", "a2a combine", "partial", "ag+rs")}
        agrs = agrs_formulation(comm, x, idx, w, shared, generator=g)
        # the all-to-all alone of blocks of the same sizes, sized as the phases' blocks are
        # (dispatch: a header, the ids, the rows of the tokens that go there; combine: a
        # header row, then the rows that go back)
        lay = BlockLayout(handle.dispatch_rows, H, K + 1, H * 2, 0)
        blocks = {"a2a dispatch": torch.zeros(world, lay.nbytes, dtype=torch.uint8),
                  "a2a combine": torch.zeros(world, (handle.ret_rows + 1) * H * 2,
                                             dtype=torch.uint8)}
        lay.header(blocks["a2a dispatch"])[:] = lay.data_bytes(torch.tensor(sent))
        blocks["a2a combine"][:, :8].view(torch.int64).view(-1)[:] = (
            (1 + handle.ret_counts.cpu()) * H * 2)
        for _ in range(iters):
            for p, b in blocks.items():
                barrier()
                t0 = time.perf_counter()
                comm.all_to_all(b, sized=True)
                ts[p].append(time.perf_counter() - t0)
            barrier()
            t0 = time.perf_counter()
            recv, handle = ep.dispatch(x, idx, w)
            ts["dispatch"].append(time.perf_counter() - t0)
            barrier()
            t0 = time.perf_counter()
            ep.combine(out, handle, shared=shared)
            ts["combine"].append(time.perf_counter() - t0)
            barrier()
            t0 = time.perf_counter()
            ep.combine(out, handle, shared=shared, partial=True)
            ts["partial"].append(time.perf_counter() - t0)
            barrier()
            t0 = time.perf_counter()
            agrs()
            ts["ag+rs"].append(time.perf_counter() - t0)
        # the bytes this rank's proxy posts for one call of each phase (its own blocks, cut
        # at their lengths, and on a ring the parts it relays)
        wire = {}
        for p, fn in (("dispatch", lambda: ep.dispatch(x, idx, w)),
                      ("combine", lambda: ep.combine(out, handle, shared=shared))):
            barrier()
            b0 = posted_bytes(comm)
            fn()
            wire[p] = posted_bytes(comm) - b0
        return {"t": ts, "rows": (handle.dispatch_rows, handle.ret_rows), "sent": sent,
                "back": back, "row_bytes": (H * 2, H * 2), "wire": wire}


def main(argv=None) -> int:
    from sparkccl.localrun import check, run_ranks
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_nic_arguments(ap, rate_gbps=0.2, sizes="-", iters=3)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--experts-per-rank", type=int, default=8)
    ap.add_argument("--mode", choices=("high_throughput", "low_latency"),
                    default="high_throughput")
    a = ap.parse_args(argv)
    env = nic_env(a, "emunic-ep-")
    T, H, K = a.tokens, a.hidden, a.topk
    print(f"# python benchmarks/ep_emunic.py {' '.join(argv or sys.argv[1:])}")
    print(f"# load average at start: {load_average()}")
    print(f"emulated roots at {a.rate_gbps:g} Gb/s each, {a.roots} per port, "
          f"{a.latency_us:g} us latency; {os.cpu_count()} CPUs; {a.mode}; {T} tokens/rank, "
          f"hidden {H} bf16, top-{K} of {a.experts_per_rank} experts/rank; median of "
          f"{a.iters} calls (slowest rank)")
    print(f"{'topology':<8} {'world':>5} {'load':>5} "
          + " ".join(f"{p + ' KiB':>13} {'fill':>5} {'bound ms':>8} {'sent ms':>7} {'a2a ms':>7} "
                     f"{p + ' ms':>11} {'of bound':>8}" for p in PHASES)
          + f" {'partial ms':>10} {'partial / combine':>17} {'ag+rs ms':>9}"
          f" {'ag+rs / ep':>10} {'ag+rs / partial':>15}")
    for topology in a.topologies.split(","):
        for world in (int(w) for w in a.worlds.split(",")):
            E = a.experts_per_rank * world
            res = check(run_ranks(_job, world, args=(topology, T, H, K, E, a.iters, a.mode),
                                  env=env, timeout_s=1800))
            load = max_port_load(topology, world, a.roots, "reduce_scatter")
            cols = []

            def med(name):
                return statistics.median(max(r["t"][name][j] for r in res)
                                         for j in range(a.iters))
            for i, (p, key) in enumerate(zip(PHASES, ("sent", "back"))):
                t, t_a2a = med(p), med("a2a " + p)
                rows = res[0]["rows"][i]
                block = rows * res[0]["row_bytes"][i]
                pairs = [r[key][d] for q, r in enumerate(res) for d in range(world) if d != q]
                fill = statistics.mean(pairs) / rows
                bound = load * block * 8 / (a.rate_gbps * 1e9 * a.roots)
                # (a mesh rank has one port, a ring rank two, which the ring plans load alike)
                port = max(r["wire"][p] for r in res) / (1 if topology == "mesh" else 2)
                sent_bound = port * 8 / (a.rate_gbps * 1e9 * a.roots)
                cols.append(f"{block / 1024:>13.0f} {fill:>5.2f} {bound * 1e3:>8.1f} "
                            f"{sent_bound * 1e3:>7.1f} {t_a2a * 1e3:>7.1f} {t * 1e3:>11.1f} "
                            f"{sent_bound / t:>8.0%}")
            cols.append(f"{med('partial') * 1e3:>10.1f} {med('partial') / med('combine'):>17.2f}")
            ep, ep_partial = med("dispatch") + med("combine"), med("dispatch") + med("partial")
            cols.append(f"{med('ag+rs') * 1e3:>9.1f} {med('ag+rs') / ep:>10.2f} "
                        f"{med('ag+rs') / ep_partial:>15.2f}")
            print(f"{topology:<8} {world:>5} {load:>5g} " + " ".join(cols)
                  + f"  load {load_average().split()[0]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
