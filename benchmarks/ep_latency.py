"""Expert-parallel low-latency mode on CUDA (decode): dispatch and combine each replayed in a
CUDA graph, beside the floor measured in the same run (issue 31).

    python3 benchmarks/ep_latency.py --world 2        # ranks sharing one GPU, under MPS
    python3 benchmarks/ep_latency.py --world 4 --tokens 128 --hidden 7168 --topk 8 --experts 256

Per rank: ``--tokens`` tokens of hidden ``--hidden`` routed uniformly to top-``--topk`` of
``--experts`` experts (``--experts / world`` per rank); dispatch e4m3 with fp32 scales per
128 columns (``--bf16``: bf16), combine bf16. Every rank captures ``--per-graph``
dispatches in one graph and as many combines (of the eager dispatch's handle) in another,
and replays each; a figure is the p50 per call of the slowest rank. ``a2a``: the
all-to-all alone of blocks of the same sizes, replayed the same way (the movement's share;
the rest is the packing, selection and finalize around it). The combine's result
is checked bit for bit against the one-box finalize reference before timing.

The floor is the mechanism's, as benchmarks/decode_latency.py's proxy-path floor: the flag
round trip (GPU -> CPU -> GPU) plus a host thread's copy of the bytes the phase must move
off this rank at the least (each token once to every rank that holds one of its experts,
each expert output row once back to its home rank; the blocks on the wire carry more,
printed as ``wire KiB``: both phases' blocks are sized, dispatch's a header, every row's
ids and scales and the rows that exist, combine's a header row and the rows that exist).
``fresh us``: the same copy with its source just written by the GPU, as the proxy's
copies find it (``/fresh`` against the flag round trip and it). ``sm link`` / ``ce
link``: the one GPU's link to host memory, which every rank here shares, carrying world x
rank 0's least bytes out to pinned memory and as many back in at once, by kernels' stores
and loads (as the GPU-direct kernels move bytes) and by copy engines (the link's best);
``/link`` against the flag round trip and the latter: how far a phase is from what this
rig's link allows (a GB10 box has no such link: its GPU and its NIC share its memory).
``pack`` / ``unpack``: the dispatch's own kernels alone, replayed with its buffers.
``SPARKCCL_GPU_DIRECT=0`` in the environment: every byte through the proxy, the path
between GB10 boxes (default: GPU-direct where the engines choose it). ``--timeline``: the dispatch's all-to-all kernel
step by step on the GPU clock (GPU-direct; kernels built with stamps, so a run of its own).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _profile(graph, per_graph: int, replays: int = 5):
    """Where a replayed phase's time goes on the GPU: per kernel (name shortened), launches
    and device us per call, over ``replays`` replays of ``per_graph`` calls (torch.profiler,
    which traces the kernels of a replayed graph), and the span from the first kernel's start
    to the last one's end per call (the span less the kernels: gaps and waits between them)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    calls = replays * per_graph
    rows: dict = {}
    lo, hi = None, None
    for e in prof.events():
        if getattr(e, "device_type", None) is None or "CUDA" not in str(e.device_type):
            continue
        r = e.time_range
        lo = r.start if lo is None else min(lo, r.start)
        hi = r.end if hi is None else max(hi, r.end)
        name = e.name if len(e.name) <= 48 else e.name[:45] + "..."
        n, t = rows.get(name, (0, 0.0))
        rows[name] = (n + 1, t + (r.end - r.start))
    table = sorted(((name, n / calls, t / calls) for name, (n, t) in rows.items()),
                   key=lambda row: -row[2])
    return table, ((hi - lo) / calls if lo is not None else 0.0)


def _link(nbytes: int, rounds: int, engine: str) -> float:
    """p50 seconds this GPU's link to host memory takes to carry ``nbytes`` out to pinned
    memory and ``nbytes`` in from it at once (two streams started by one event): ``sm``
    by kernels' 16-byte stores and loads (torch's vectorized elementwise kernel, as the
    GPU-direct kernels move bytes and the only way inside a replayed graph), ``ce`` by copy
    engines (the link's best; benchmarks/pcie_duplex.py has both at other sizes). The
    pinned memory is torch's (cudaHostAlloc), not the communicator's /dev/shm regions."""
    import torch

    from sparkccl.dataplane.cuda_runtime import device_view
    dev = torch.device("cuda", torch.cuda.current_device())
    n = -(-nbytes // 16) * 4  # int32 words, whole 16-byte units
    pinned = [torch.empty(n, dtype=torch.int32).pin_memory() for _ in range(2)]
    out_, in_ = (device_view(t.data_ptr(), 4 * n, dev).view(torch.int32) for t in pinned)
    src = torch.arange(n, dtype=torch.int32, device=dev)
    dst = torch.empty_like(src)
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    main = torch.cuda.current_stream(dev)
    each = []
    for i in range(rounds + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # the GPU idles ~0.5 ms first, so that the start is not the host's queueing of the rest
        torch.cuda._sleep(1 << 20)
        start.record(main)
        for st, to, fro in ((s1, out_, src), (s2, dst, in_)):
            st.wait_event(start)
            with torch.cuda.stream(st):
                if engine == "sm":
                    torch.bitwise_not(fro, out=to)
                else:
                    to.copy_(fro, non_blocking=True)
            main.wait_stream(st)
        end.record(main)
        end.synchronize()
        if i:  # (the first round warms both kernels up)
            each.append(start.elapsed_time(end) / 1e3)
    return statistics.median(each)


# Phases timed only where --phases names them.
EXTRA_PHASES = ("a2a dispatch unsized", "a2a dispatch empty")
TIMELINE_PHASES = ("dispatch", "a2a dispatch") + EXTRA_PHASES


def _job(rank, world, store, T, H, K, E, fp8, iters, per_graph, combine_rows, fused,
         bytes_per_block=None, prof=False, phases=None, with_timeline=False,
         a2a_bytes_per_block=None):
    import numpy as np
    import torch
    import torch.distributed as dist

    import sparkccl
    if bytes_per_block:  # (an experiment: the engines' bytes per publish / wait block)
        from sparkccl.dataplane import engines
        engines.PUBLISH_BYTES_PER_BLOCK, engines.WAIT_BYTES_PER_BLOCK = bytes_per_block
    if a2a_bytes_per_block:  # (the same, of the GPU-direct all-to-all's kernel)
        from sparkccl.dataplane import cuda_calls
        (cuda_calls.A2A_DIRECT_PUBLISH_BYTES_PER_BLOCK,
         cuda_calls.A2A_DIRECT_WAIT_BYTES_PER_BLOCK) = a2a_bytes_per_block
    from decode_latency import PROXY_KEYS, _barrier, _flag_rtt, _host_write
    from sparkccl.ep_reference import combine_reference, make_ep_input, run_experts
    from sparkccl.expert_parallel import BlockLayout
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    from sparkccl.plan.geometry import ALIGN, round_up

    def routing(r):  # uniform routing, the same on every rank for rank r's tokens
        g = torch.Generator().manual_seed(100 + r)
        return torch.rand(T, E, generator=g).topk(K).indices

    inp = make_ep_input(5, rank, tokens=T, hidden=H, topk=K, num_experts=E, world=world,
                        fp8=fp8)
    inp["topk_idx"] = routing(rank)
    a = {k: None if v is None else v.to(dev) for k, v in inp.items()}
    row = H * (1 if fp8 else 2) + (H // 128 * 4 if fp8 else 0)
    # a slot that holds a combine's blocks (and their header rows): one collective per call
    slot = max(8 << 20, world * (T * min(K, E // world) + 1) * H * 2)
    with sparkccl.Communicator(store=dist.PrefixStore("ep", store), rank=rank, world_size=world,
                               device=dev, timeout_s=120, slot_bytes=slot) as comm:
        ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T,
                                     dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                                     mode="low_latency", combine_rows=combine_rows,
                                     _fused=fused)
        from sparkccl import ep_cuda
        launched = {}  # the dispatch's own kernels' last launches, to replay them alone
        plain_launch = ep_cuda.launch

        def recording_launch(dev_, name, grid, args):
            launched[name] = (dev_, name, grid, args)
            plain_launch(dev_, name, grid, args)
        ep_cuda.launch = recording_launch
        try:
            recv, handle = ep.dispatch(a["x"], a["topk_idx"], a["topk_weights"], a["x_scales"])
        finally:
            ep_cuda.launch = plain_launch
        out = run_experts(ep, recv)
        z = ep.combine(out, handle, shared=a["shared"])
        torch.cuda.synchronize()
        if not np.array_equal(z.cpu().view(torch.int16).numpy().view(np.uint16),
                              combine_reference(inp)):
            raise AssertionError(f"rank {rank}: combine differs from the one-box reference")
        owner = torch.tensor(ep.owners)[inp["topk_idx"]]
        least = {"dispatch": sum(int((owner == d).any(1).sum()) for d in range(world)
                                 if d != rank) * row,
                 "combine": sum(int((owner == d).sum()) for d in range(world)
                                if d != rank) * H * 2}
        # combine's blocks are sized (docs/EXPERT_PARALLEL.md): a header row, then the rows
        # this rank returns to home d (the entries of d's tokens held here, at most a block)
        owners = torch.tensor(ep.owners)
        ret = [min(int((owners[routing(d)] == rank).sum()), handle.ret_rows)
               for d in range(world)]
        # dispatch's blocks are sized too: a header, every row's ids and scales, then the
        # rows of the tokens that go to that rank
        lay = BlockLayout(handle.dispatch_rows, H, K + 1, ep._row_bytes, ep._scale_cols)
        tok = [int((owner == d).any(1).sum()) for d in range(world)]
        wire = {"dispatch": sum(round_up(lay.data_bytes(tok[d]), ALIGN) for d in range(world)
                                if d != rank),
                "combine": sum(round_up((1 + ret[d]) * H * 2, ALIGN) for d in range(world)
                               if d != rank)}
        res = {"flag rtt": _flag_rtt(comm, max(50, iters))}
        for phase in ("dispatch", "combine"):
            res[phase + " write"] = _host_write(max(least[phase], 16), max(50, iters))
            res[phase + " fresh"] = _host_write(max(least[phase], 16), max(50, iters), True)
        # the one GPU's link, shared by every rank here: measured by rank 0 alone (the others
        # wait at the barrier) for what all ranks move, W x the least bytes each way
        _barrier(store, "host probes", rank, world)
        for phase in ("dispatch", "combine"):
            nbytes, rounds = world * max(least[phase], 16), max(20, iters // 5)
            res[phase + " link"] = ({e: _link(nbytes, rounds, e) for e in ("sm", "ce")}
                                    if rank == 0 else None)
        _barrier(store, "probes", rank, world)  # (no rank's collective beside another's probe)
        blocks = {"dispatch": torch.zeros((world, lay.nbytes), dtype=torch.uint8, device=dev),
                  "combine": torch.zeros((world, (handle.ret_rows + 1) * H * 2),
                                         dtype=torch.uint8, device=dev)}
        blocks["combine"][:, :8] = torch.tensor([(1 + n) * H * 2 for n in ret]).view(
            torch.uint8).view(world, 8).to(dev)
        lay.header(blocks["dispatch"])[:] = lay.data_bytes(torch.tensor(tok)).to(dev)
        fns = {"dispatch": lambda: ep.dispatch(a["x"], a["topk_idx"], a["topk_weights"],
                                               a["x_scales"]),
               "combine": lambda: ep.combine(out, handle, shared=a["shared"]),
               # the all-to-all alone, of the same blocks: the movement's share
               "a2a dispatch": lambda: comm.all_to_all(blocks["dispatch"], sized=True),
               "a2a combine": lambda: comm.all_to_all(blocks["combine"], sized=True),
               # (asked for by --phases only) the same blocks unsized, and sized but empty:
               # what cutting at the lengths costs or saves on this path
               "a2a dispatch unsized": lambda: comm.all_to_all(blocks["dispatch"]),
               "a2a dispatch empty": lambda: comm.all_to_all(blocks["dispatch empty"],
                                                             sized=True)}
        if phases and "a2a dispatch empty" in phases:  # (its own copy only where timed)
            blocks["dispatch empty"] = blocks["dispatch"].clone()
            lay.header(blocks["dispatch empty"])[:] = lay.x_off
        for name in ("sccl_ep_pack", "sccl_ep_unpack"):  # (the dispatch's buffers, kept)
            if name in launched:
                fns[name[8:]] = lambda call=launched[name]: plain_launch(*call)
        for phase, fn in fns.items():
            if (phases and phase not in phases) or (not phases and phase in EXTRA_PHASES):
                continue
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(per_graph):
                    fn()
            graph.replay()
            torch.cuda.synchronize()
            each = []
            for _ in range(max(5, iters // per_graph)):
                t0 = time.perf_counter()
                graph.replay()
                torch.cuda.synchronize()
                each.append((time.perf_counter() - t0) / per_graph)
            res[phase] = statistics.median(each)
            if with_timeline and phase in TIMELINE_PHASES:
                from sparkccl.dataplane import timeline
                graph.replay()
                torch.cuda.synchronize()
                res["timeline " + phase] = timeline.last_rows(comm.data_plane, per_graph)
            if prof:
                res["profile " + phase] = _profile(graph, per_graph)
            del graph
        comm.check()
        ep.check()
        stats = comm.proxy_stats()
        res["proxy"] = {k: stats.get(k) for k in PROXY_KEYS}
        res.update({"least " + k: v for k, v in least.items()})
        res.update({"wire " + k: v for k, v in wire.items()})
        return res


def main() -> None:
    from sparkccl.localrun import check, run_ranks
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--bf16", action="store_true", help="dispatch bf16 (default e4m3)")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--per-graph", type=int, default=10)
    ap.add_argument("--combine-rows", type=int, default=None,
                    help="ExpertParallel combine_rows (default: the bound no routing exceeds)")
    ap.add_argument("--torch-dispatch", action="store_true",
                    help="dispatch with the torch ops (ExpertParallel(_fused=False)), not the "
                         "fused kernels")
    ap.add_argument("--phases", default=None,
                    help="a comma list of the phases to time (dispatch, combine, a2a dispatch, "
                         "a2a combine, pack, unpack: the dispatch's kernels alone; only when "
                         "named: a2a dispatch unsized / empty, the same blocks unsized and sized "
                         "but empty; default: all): the proxy's figures printed after the "
                         "table are then of those alone")
    ap.add_argument("--profile", action="store_true",
                    help="also rank 0's kernels per replayed call (torch.profiler)")
    ap.add_argument("--timeline", action="store_true",
                    help="also the GPU step timeline of the dispatch's all-to-all "
                         "(SPARKCCL_GPU_TIMELINE: kernels with step stamps, so not the timed "
                         "figures' build)")
    ap.add_argument("--bytes-per-block", default=None,
                    help="an experiment: PUBLISH,WAIT bytes per block of the engines' kernels "
                         "(default 65536,32768: sparkccl/dataplane/engines.py)")
    ap.add_argument("--a2a-bytes-per-block", default=None,
                    help="an experiment: PUBLISH,WAIT bytes per block of the GPU-direct "
                         "all-to-all's kernel (default 16384,8192: "
                         "engines.A2A_DIRECT_*_BYTES_PER_BLOCK)")
    a = ap.parse_args()
    bpb = tuple(int(v) for v in a.bytes_per_block.split(",")) if a.bytes_per_block else None
    a2a_bpb = (tuple(int(v) for v in a.a2a_bytes_per_block.split(","))
               if a.a2a_bytes_per_block else None)
    phases = a.phases.split(",") if a.phases else None
    res = check(run_ranks(_job, a.world, args=(a.tokens, a.hidden, a.topk, a.experts,
                                               not a.bf16, a.iters, a.per_graph,
                                               a.combine_rows, not a.torch_dispatch, bpb,
                                               a.profile, phases, a.timeline, a2a_bpb),
                          env={"SPARKCCL_GPU_TIMELINE": "1"} if a.timeline else None,
                          timeout_s=1200))
    rtt = max(r["flag rtt"] for r in res)
    print(f"# EP low latency, cuda world {a.world} mesh, {a.tokens} tokens x {a.hidden}, top-"
          f"{a.topk} of {a.experts} experts, dispatch {'bf16' if a.bf16 else 'e4m3'}, combine "
          f"bf16, combine_rows {a.combine_rows or 'default'}, dispatch "
          f"{'torch ops' if a.torch_dispatch else 'fused kernels'}"
          f"{f', bytes per block {a.bytes_per_block}' if bpb else ''}"
          f"{f', all-to-all bytes per block {a.a2a_bytes_per_block}' if a2a_bpb else ''}"
          f"; replays of {a.per_graph} "
          "calls, "
          "p50 per call (us, slowest rank)")
    print(f"# floor = flag rtt {rtt * 1e6:.1f} us + the host's copy of the least bytes a rank "
          f"must move; SPARKCCL_GPU_DIRECT={os.environ.get('SPARKCCL_GPU_DIRECT', '(default)')} "
          "(0: every byte through the proxy, as between boxes); wire KiB: the most a rank sends "
          "(combine: sized blocks)")
    print("# fresh us: that copy with its source just written by the GPU (as the proxy finds "
          "it), /fresh: against flag rtt + it")
    print("# link: this one GPU's link to host memory carrying every rank's least bytes out "
          "and in at once (world x least KiB each way, measured by rank 0 alone): sm by "
          "kernels' stores and loads, ce by copy engines; /link: against flag rtt + ce link")
    print(f"{'phase':<9} {'us':>9} {'a2a us':>7} {'least KiB':>10} {'wire KiB':>9} "
          f"{'write us':>9} {'floor us':>9} {'/floor':>7} {'fresh us':>9} {'/fresh':>7} "
          f"{'sm link':>8} {'ce link':>8} {'/link':>6}")
    for phase in ("dispatch", "combine"):
        if phase not in res[0] or "a2a " + phase not in res[0]:
            for k in (phase, "a2a " + phase):
                if k in res[0]:
                    print(f"{k:<12} {max(r[k] for r in res) * 1e6:>9.1f} us")
            continue
        t = max(r[phase] for r in res)
        least = max(r["least " + phase] for r in res)
        wire = max(r["wire " + phase] for r in res)
        write = max(r[phase + " write"] for r in res)
        floor = rtt + write
        fresh = max(r[phase + " fresh"] for r in res)
        t_a2a = max(r["a2a " + phase] for r in res)
        link = res[0][phase + " link"]
        print(f"{phase:<9} {t * 1e6:>9.1f} {t_a2a * 1e6:>7.1f} {least / 1024:>10.0f} "
              f"{wire / 1024:>9.0f} "
              f"{write * 1e6:>9.1f} {floor * 1e6:>9.1f} {t / floor:>7.2f} "
              f"{fresh * 1e6:>9.1f} {t / (rtt + fresh):>7.2f} "
              f"{link['sm'] * 1e6:>8.1f} {link['ce'] * 1e6:>8.1f} {t / (rtt + link['ce']):>6.2f}")
    for k in ("pack", "unpack"):
        if k in res[0]:
            print(f"{k:<9} {max(r[k] for r in res) * 1e6:>9.1f} us (the dispatch's kernel alone, "
                  "every rank's at once)")
    from decode_latency import print_proxy_stats
    print_proxy_stats(res[0]["proxy"])
    for k in EXTRA_PHASES:
        if k in res[0]:
            print(f"{k:<12} {max(r[k] for r in res) * 1e6:>9.1f} us")
    for phase in TIMELINE_PHASES:
        if "timeline " + phase in res[0]:
            from sparkccl.dataplane import timeline
            print(f"# {phase}, replayed: the all-to-all kernel's steps on the GPU clock (every "
                  "rank; publish = block 0's entry to the last block's last piece stored; "
                  "flag to poller = the last peer's hand-off to the poller seeing every "
                  "piece): step, p50 us, p90 us, samples")
            for name, p50, p90, n in timeline.summary([r["timeline " + phase] for r in res]):
                print(f"#   {name:<20} {p50:8.1f} {p90:8.1f} {n:5d}")
    if a.profile:
        for phase in ("dispatch", "a2a dispatch", "combine", "a2a combine"):
            if "profile " + phase not in res[0]:
                continue
            table, span = res[0]["profile " + phase]
            print(f"# rank 0, {phase}, replayed: kernel span {span:.1f} us per call; per call: "
                  "launches, device us")
            for name, n, t in table:
                print(f"#   {n:5.2f}  {t:8.1f}  {name}")


if __name__ == "__main__":
    main()
