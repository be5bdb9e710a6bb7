"""Expert-parallel dispatch and combine (sparkccl/expert_parallel.py,
docs/EXPERT_PARALLEL.md), checked bit for bit in W processes:

* dispatch: each local expert's rows, counts and source (rank, token, k) are exactly the
  tokens routed to it from every rank, in (source rank, token) order, bf16 and e4m3 with
  scales, both modes, contiguous / round-robin / explicit placements;
* combine(dispatch(...)) equals the one-box fused finalize reference of each home rank's
  tokens (sparkccl/reference.py), with and without a shared expert, token counts that
  differ per rank (zero included), experts that receive no token, tokens whose top-k all
  live on one rank, rows past the counts that are NaN (never read);
* world 2-4, mesh and ring over shm, tcp and the emulated NIC (verbs); world 5-6 (extended);
  world 1;
* every bad input raising before anything is sent.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkccl.ep_reference import (combine_reference, make_ep_input, partial_combine_reference,
                                  run_experts)
from helpers import assert_no_problems, expect_errors
from sparkccl.localrun import check, run_ranks

HAVE_GPU = torch.cuda.is_available()


def record_sent(comm) -> dict:
    """Wrap ``comm.all_to_all`` so that ``rec["blocks"]`` ([world, block bytes] uint8) holds
    the blocks of its latest call as they went on the wire: ``x``, or (CPU dispatch, which
    writes its blocks group by group into the send slot through ``fill``) every range that
    ``fill`` wrote, read back from the slot. Bytes no range covered are left undefined."""
    import ctypes
    rec = {}
    real = comm.all_to_all

    def all_to_all(x, *, out=None, fill=None, arrived=None, **kw):  # (kw: sized)
        W = comm.world_size
        chunk = (out if fill is not None else x).nbytes // W
        dev = (out if fill is not None else x).device
        blocks = rec["blocks"] = torch.empty((W, chunk), dtype=torch.uint8, device=dev)
        if fill is None:
            blocks.copy_(x.reshape(-1).view(torch.uint8).view(W, chunk))
            return real(x, out=out, arrived=arrived, **kw)

        def kept(base, stride, lo, hi):
            fill(base, stride, lo, hi)
            for j in range(W):
                ctypes.memmove(blocks.data_ptr() + j * chunk + lo, base + j * stride + lo,
                               hi - lo)
        return real(None, out=out, fill=kept, arrived=arrived, **kw)

    comm.all_to_all = all_to_all
    return rec


def ep_cases(W: int):
    """(T, tokens per rank, H, topk, E, fp8, mode, placement, pow2 weights)."""
    per_rank = [5 + 3 * r for r in range(W)]
    some_empty = [0 if r == W - 1 else 9 for r in range(W)]
    rr = "round_robin"
    explicit = [(e * 7 + 3) % W for e in range(4 * W)]  # each rank 4 experts (W coprime to 7)
    T0 = max(16, per_rank[-1])
    return [(T0, per_rank, 64, 4, 4 * W, False, "high_throughput", "contiguous", True),
            (T0, per_rank, 128, 2, 4 * W, True, "low_latency", "contiguous", False),
            (12, some_empty, 256, 8, 8 * W, True, "high_throughput", rr, True),
            (9, [9] * W, 64, 1, W, False, "low_latency", rr, False),
            (10, some_empty, 32, 3, 4 * W, False, "low_latency", explicit, True),
            (8, [8] * W, 128, 16, 16 * W, False, "high_throughput", "contiguous", False)]


def _dispatch_problems(ep, recv, inputs, T):
    """Compare recv with what every rank routed to this rank's experts, in order."""
    bad = []
    counts = recv.counts.cpu().tolist()
    for e, ge in enumerate(recv.experts):
        want = [(s, t, k) for s, inp in enumerate(inputs)
                for t in range(inp["topk_idx"].shape[0]) for k in range(inp["topk_idx"].shape[1])
                if int(inp["topk_idx"][t, k]) == ge]
        if counts[e] != len(want):
            bad.append(f"expert {ge}: count {counts[e]}, want {len(want)}")
            continue
        if recv.mode == "low_latency":
            sel = (e, slice(0, counts[e]))
        else:
            a, b = int(recv.offsets[e]), int(recv.offsets[e + 1])
            if b - a != len(want):
                bad.append(f"expert {ge}: offsets give {b - a} rows, want {len(want)}")
                continue
            sel = (slice(a, b),)
        src = [recv.src_rank[sel].tolist(), recv.src_token[sel].tolist(), recv.src_k[sel].tolist()]
        if list(zip(*src)) != want:
            bad.append(f"expert {ge}: sources {list(zip(*src))[:4]}..., want {want[:4]}...")
            continue
        xs = recv.x[sel].cpu()
        wx = torch.stack([inputs[s]["x"][t] for s, t, _ in want]) if want else xs
        if not torch.equal(xs.view(torch.uint8), wx.view(torch.uint8)):
            bad.append(f"expert {ge}: received rows differ")
        if recv.x_scales is not None and want:
            ws = torch.stack([inputs[s]["x_scales"][t] for s, t, _ in want])
            if not torch.equal(recv.x_scales[sel].cpu().view(torch.int32), ws.view(torch.int32)):
                bad.append(f"expert {ge}: received scales differ")
    return bad


def ep_job(rank, nprocs, store, configs, device):
    """configs: [(world, topology, transport, slot_bytes)]; ranks >= world sit a config out.
    Returns the failures (empty when everything is exact)."""
    import torch.distributed as dist

    import sparkccl
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    bad = []
    for n_cfg, (W, topo, transport, slot) in enumerate(configs):
        if rank >= W:
            continue
        with sparkccl.Communicator(store=dist.PrefixStore(f"ep{n_cfg}", store), rank=rank,
                                   world_size=W, topology=topo, transport=transport,
                                   slot_bytes=slot, timeout_s=60, device=device) as comm:
            for c, (T, ns, H, K, E, fp8, mode, placement, pow2) in enumerate(ep_cases(W)):
                name = f"world {W} {topo}/{transport} case {c} ({mode}, fp8 {fp8}, E {E}, K {K})"
                inputs = [make_ep_input(50 + c, r, tokens=ns[r], hidden=H, topk=K, num_experts=E,
                                        world=W, fp8=fp8, pow2_weights=pow2) for r in range(W)]
                ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T,
                                             dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                                             mode=mode, placement=placement)
                mine = {k: None if v is None else v.to(comm.device) for k, v in inputs[rank].items()}
                recv, handle = ep.dispatch(mine["x"], mine["topk_idx"], mine["topk_weights"],
                                           mine["x_scales"])
                bad += [f"{name}: {b}" for b in _dispatch_problems(ep, recv, inputs, T)]
                out = run_experts(ep, recv)
                for with_shared in (True, False):
                    z = ep.combine(out, handle, shared=mine["shared"] if with_shared else None)
                    want = combine_reference(inputs[rank], shared=with_shared)
                    got = z.cpu().view(torch.int16).numpy().view(np.uint16)
                    if got.shape != want.shape or not np.array_equal(got, want):
                        where = np.argwhere(got != want)[:3] if got.shape == want.shape else \
                            f"shape {got.shape}"
                        bad.append(f"{name} shared {with_shared}: combine differs at {where}")
                # the per-rank partial combine (an opt-in: its own bits)
                z = ep.combine(out, handle, shared=mine["shared"], partial=True)
                want = partial_combine_reference(inputs[rank], ep.owners, W)
                got = z.cpu().view(torch.int16).numpy().view(np.uint16)
                if got.shape != want.shape or not np.array_equal(got, want):
                    where = np.argwhere(got != want)[:3] if got.shape == want.shape else \
                        f"shape {got.shape}"
                    bad.append(f"{name}: partial combine differs at {where}")
    return bad


def test_routings_cover_idle_experts_and_one_rank_tokens():
    from sparkccl.expert_parallel import placement_table
    for W in (2, 3, 4):
        idle = one_rank = 0
        for c, (T, ns, H, K, E, fp8, mode, placement, pow2) in enumerate(ep_cases(W)):
            owners = placement_table(placement, E, W)
            used = set()
            for r in range(W):
                idx = make_ep_input(50 + c, r, tokens=ns[r], hidden=H, topk=K, num_experts=E,
                                    world=W, fp8=fp8)["topk_idx"]
                used |= set(idx.reshape(-1).tolist())
                one_rank += sum(len({owners[e] for e in row}) == 1 for row in idx.tolist())
            idle += E - len(used)
        assert idle > 0 and one_rank > 0, (W, idle, one_rank)


def _run(nprocs, configs, device="cpu", env=None):
    values = check(run_ranks(ep_job, nprocs, args=(configs, device), timeout_s=600, env=env))
    bad = [f"rank {r}: {b}" for r, v in enumerate(values) for b in v]
    assert not bad, "\n".join(bad)


def test_ep_cpu_worlds():
    # One set of processes for every world (starting them is most of the time here). The
    # 24 KiB slot splits the larger dispatch blocks and combine blocks into several
    # collectives.
    MiB = 1 << 20
    _run(4, [(2, "mesh", "shm", MiB), (2, "ring", "shm", MiB), (3, "ring", "shm", MiB),
             (4, "mesh", "shm", MiB), (4, "ring", "tcp", MiB), (1, "mesh", "auto", MiB),
             (3, "mesh", "shm", 24 << 10)])


@pytest.mark.slow
@pytest.mark.extended  # the same cases as test_ep_cpu_worlds (2-4), at larger worlds
def test_ep_cpu_worlds_5_6():
    MiB = 1 << 20
    _run(6, [(5, "ring", "shm", MiB), (6, "ring", "shm", 64 << 10), (6, "mesh", "tcp", MiB)])


def test_ep_verbs_through_emulated_nic(emunic_env):
    MiB = 1 << 20
    _run(4, [(2, "mesh", "verbs", MiB), (4, "ring", "verbs", 64 << 10)], env=emunic_env)


# ---------------------------------------------------------------- bad input

def _bad_cases(comm):
    import sparkccl
    W, H, T, E, K = comm.world_size, 128, 8, 4 * comm.world_size, 2
    ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T)
    ep8 = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T,
                                  dtype=torch.float8_e4m3fn, mode="low_latency")
    good = make_ep_input(3, comm.rank, tokens=6, hidden=H, topk=K, num_experts=E, world=W)
    g8 = make_ep_input(3, comm.rank, tokens=6, hidden=H, topk=K, num_experts=E, world=W, fp8=True)
    idx_hi, idx_neg, idx_dup = (good["topk_idx"].clone() for _ in range(3))
    idx_hi[2, 1] = E
    idx_neg[0, 0] = -1
    idx_dup[4, 1] = idx_dup[4, 0]

    def d(e=ep, over=None, **kw):
        a = dict(good if e is ep else g8, **(over or {}))
        return lambda: e.dispatch(a["x"], a["topk_idx"], a["topk_weights"], a["x_scales"], **kw)

    def make(**kw):
        args = dict(num_experts=E, hidden=H, max_tokens=T)
        args.update(kw)
        return lambda: sparkccl.ExpertParallel(comm, **args)

    big = make_ep_input(3, comm.rank, tokens=T + 1, hidden=H, topk=K, num_experts=E, world=W)
    k17 = make_ep_input(3, comm.rank, tokens=2, hidden=H, topk=17, num_experts=17 * W, world=W)
    return [
        ("E not multiple of world", make(num_experts=E + 1), ValueError, "multiple of the world"),
        ("H not multiple of 8", make(hidden=12), ValueError, "multiple of 8"),
        ("fp8 H not multiple of 128", make(hidden=64, dtype=torch.float8_e4m3fn), ValueError,
         "multiple of 128"),
        ("dtype fp16", make(dtype=torch.float16), TypeError, "torch.bfloat16"),
        ("mode", make(mode="fast"), ValueError, "low_latency"),
        ("max_tokens 0", make(max_tokens=0), ValueError, "positive"),
        ("placement uneven", make(placement=[0] * E), ValueError, "every rank must hold"),
        ("placement name", make(placement="random"), ValueError, "contiguous"),
        ("E float", make(num_experts=8.0), TypeError, "num_experts must be an int"),
        ("idx out of range", d(over={"topk_idx": idx_hi}), ValueError, f"topk_idx[2, 1] = {E}"),
        ("idx negative", d(over={"topk_idx": idx_neg}), ValueError, "topk_idx[0, 0] = -1"),
        ("idx repeated", d(over={"topk_idx": idx_dup}), ValueError, "distinct"),
        ("idx float", d(over={"topk_idx": good["topk_idx"].float()}), TypeError, "int64"),
        ("idx wrong rows", d(over={"topk_idx": good["topk_idx"][:5]}), ValueError, "[n, topk]"),
        ("tokens over max_tokens", d(over=big), ValueError, "exceed max_tokens"),
        ("topk 17", d(over=k17), ValueError, "topk = 17"),
        ("x fp32", d(over={"x": good["x"].float()}), TypeError, "torch.bfloat16"),
        ("x wrong H", d(over={"x": good["x"][:, :64].contiguous()}), ValueError, "[n, hidden]"),
        ("x non-contiguous", d(over={"x": torch.zeros(H, 6, dtype=torch.bfloat16).t()}),
         ValueError, "contiguous"),
        ("x not a tensor", d(over={"x": good["x"].tolist()}), TypeError, "torch.Tensor"),
        ("weights fp16", d(over={"topk_weights": good["topk_weights"].half()}), TypeError,
         "torch.float32"),
        ("weights shape", d(over={"topk_weights": good["topk_weights"][:, :1].contiguous()}),
         ValueError, "topk_weights must be [n, topk]"),
        ("scales with bf16", d(over={"x_scales": g8["x_scales"]}), ValueError, "x_scales=None"),
        ("fp8 without scales", d(ep8, over={"x_scales": None}), ValueError, "need x_scales"),
        ("fp8 scales fp16", d(ep8, over={"x_scales": g8["x_scales"].half()}), TypeError,
         "torch.float32"),
        ("fp8 scales shape", d(ep8, over={"x_scales": g8["x_scales"][:, :0]}), ValueError,
         "[n, hidden / 128]"),
        ("fp8 given bf16", d(ep8, over={"x": good["x"]}), TypeError, "float8_e4m3fn"),
        ("combine no handle", lambda: ep.combine(torch.zeros(1, H, dtype=torch.bfloat16), None),
         TypeError, "Handle"),
        ("combine_rows high-throughput", make(combine_rows=4), ValueError, "mode='low_latency'"),
        ("combine_rows 0", make(mode="low_latency", combine_rows=0), ValueError, "positive"),
        ("combine_rows exceeded", d(sparkccl.ExpertParallel(comm, num_experts=E, hidden=H,
                                                           max_tokens=T, mode="low_latency",
                                                           combine_rows=1), over=good),
         ValueError, "more than combine_rows = 1"),
    ]


def _bad_combine_cases(ep, recv, handle, H):
    n = handle.num_tokens
    out = torch.zeros((*recv.x.shape[:-1], H), dtype=torch.bfloat16)
    return [
        ("combine fp32 out", lambda: ep.combine(out.float(), handle), TypeError, "torch.bfloat16"),
        ("combine wrong shape", lambda: ep.combine(out[:, :64].contiguous(), handle), ValueError,
         "recv.x's shape"),
        ("combine shared rows", lambda: ep.combine(out, handle, torch.zeros(n + 1, H,
                                                                           dtype=torch.bfloat16)),
         ValueError, "shared must be [n, hidden]"),
        ("combine shared fp32", lambda: ep.combine(out, handle, torch.zeros(n, H)), TypeError,
         "shared must be torch.bfloat16"),
        ("combine partial not a bool", lambda: ep.combine(out, handle, partial=1), TypeError,
         "partial must be a bool"),
    ]


def ep_bad_input_job(rank, world, store):
    """Bad input raises before anything is sent; then (a second communicator, the same
    processes) the CUDA path's device-side routing checks, run on CPU tensors."""
    import torch.distributed as dist

    import sparkccl
    comm = sparkccl.Communicator(store=dist.PrefixStore("bad", store), rank=rank,
                                 world_size=world, timeout_s=20, slot_bytes=1 << 20)
    result = expect_errors(comm, _bad_cases(comm))
    # Nothing was sent: a good dispatch and combine line up and are exact.
    W, H, E, K = world, 128, 4 * world, 2
    inputs = [make_ep_input(4, r, tokens=6, hidden=H, topk=K, num_experts=E, world=W)
              for r in range(W)]
    ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=8)
    mine = inputs[rank]
    recv, handle = ep.dispatch(mine["x"], mine["topk_idx"], mine["topk_weights"])
    seq = comm.seq
    more = expect_errors(comm, _bad_combine_cases(ep, recv, handle, H))
    more.pop("seq after bad calls")
    result.update(more)
    result["combine: nothing sent"] = None if comm.seq == seq else f"seq {seq} -> {comm.seq}"
    z = ep.combine(run_experts(ep, recv), handle, shared=mine["shared"])
    ok = np.array_equal(z.view(torch.int16).numpy().view(np.uint16), combine_reference(mine))
    result["exact after bad calls"] = None if ok else "wrong result"
    comm.close()
    with sparkccl.Communicator(store=dist.PrefixStore("dev", store), rank=rank,
                               world_size=world, timeout_s=30) as comm:
        T, H, K, E = 12, 128, 4, 4 * world
        ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T,
                                     mode="low_latency")
        ep._device_checks = True
        inputs = [make_ep_input(8, r, tokens=T - 1, hidden=H, topk=K, num_experts=E, world=world)
                  for r in range(world)]
        problems = _device_refusal(ep, inputs, "cpu")
        problems += _combine_rows_refusal(comm, inputs, T, H, K, E)
    result["device-side routing checks"] = "; ".join(problems) or None
    return result


def _combine_rows_refusal(comm, inputs, T, H, K, E):
    """low_latency with combine_rows below what the routing needs, the device-side checks
    on: a token with an entry past its block's rows has the canonical NaN row, every other
    token is exact, check() raises; with combine_rows at what the routing needs, exact."""
    import sparkccl
    from sparkccl.expert_parallel import placement_table
    W, rank, bad = comm.world_size, comm.rank, []
    owners = placement_table("contiguous", E, W)
    need = max(sum(owners[int(e)] == d for e in inp["topk_idx"].reshape(-1))
               for inp in inputs for d in range(W))
    for rows in (need - 2, need):
        ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T,
                                     mode="low_latency", combine_rows=rows)
        ep._device_checks = True
        mine = inputs[rank]
        recv, handle = ep.dispatch(mine["x"], mine["topk_idx"], mine["topk_weights"])
        experts = torch.tensor(ep.local_experts)
        z = ep.combine(graph_experts(recv, experts), handle, shared=mine["shared"])
        got = z.view(torch.int16).numpy().view(np.uint16)
        want = combine_reference(mine)
        seen, over = [0] * W, set()
        for t, row in enumerate(mine["topk_idx"].tolist()):
            for e in row:
                seen[owners[e]] += 1
                if seen[owners[e]] > rows:
                    over.add(t)
        keep = [t for t in range(got.shape[0]) if t not in over]
        if not np.array_equal(got[keep], want[keep]):
            bad.append(f"combine_rows {rows}: rows of tokens within the blocks differ")
        if over and not (got[sorted(over)] == 0x7FFF).all():
            bad.append(f"combine_rows {rows}: tokens past the blocks are not the canonical NaN")
        bad += check_refusals(ep, over, f"combine_rows {rows}")
    return bad


def check_refusals(ep, over, name: str) -> list[str]:
    """ep.check() raises naming combine_rows exactly when some tokens (``over``) had entries
    past a combine block."""
    try:
        ep.check()
        if over:
            return [f"{name}: check() did not raise"]
    except ValueError as e:
        if not over or "past combine_rows" not in str(e):
            return [f"{name}: check(): {e}"]
    return []


def test_bad_input_raises_before_sending_and_device_checks():
    values = check(run_ranks(ep_bad_input_job, 2, timeout_s=300))
    assert_no_problems(values, at_least=30)


# ---------------------------------------------------------------- CUDA (the lead runs these)

cuda_only = [pytest.mark.cuda,
             pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU: "
                                "torch.cuda.is_available() is False")]


@pytest.mark.parametrize("topology,world", [("mesh", 2), ("ring", 4)])
@cuda_only[0]
@cuda_only[1]
def test_ep_cuda(topology, world):
    _run(world, [(world, topology, "shm", 8 << 20), (world, topology, "shm", 256 << 10)],
         device="cuda")


def graph_experts(recv, experts: torch.Tensor) -> torch.Tensor:
    """expert_fn (sparkccl/ep_reference.py) of every local expert on its whole receive region, with
    device ops only (capturable): the same elementwise fp32 operations, so the same bits."""
    from sparkccl.ep_reference import decode
    ge = experts.to(torch.float32).view(-1, 1, 1)
    return (decode(recv.x, recv.x_scales) * (1.0 + ge / 8.0) - ge / 32.0).to(torch.bfloat16)


def ep_graph_job(rank, world, store, fp8):
    """Low-latency dispatch + experts + combine captured in one CUDA graph, replayed on
    fresh inputs copied into the captured ones; every replay exact."""
    import sparkccl
    torch.cuda.set_device(rank % torch.cuda.device_count())
    T, H, K, E = 32, 256, 4, 8 * world
    bad = []
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, device="cuda",
                               slot_bytes=8 << 20, timeout_s=60) as comm:
        ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T,
                                     dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                                     mode="low_latency")
        experts = torch.tensor(ep.local_experts, device="cuda")

        def inputs(seed):
            return [make_ep_input(seed, r, tokens=T - 3, hidden=H, topk=K, num_experts=E,
                                  world=world, fp8=fp8, pow2_weights=False) for r in range(world)]

        def layer(a):
            recv, handle = ep.dispatch(a["x"], a["topk_idx"], a["topk_weights"], a["x_scales"])
            return ep.combine(graph_experts(recv, experts), handle, shared=a["shared"])

        first = inputs(1)
        static = {k: None if v is None else v.cuda() for k, v in first[rank].items()}
        z = layer(static)  # eager: sets up the reduce-scatter buffers, compiles, loads
        torch.cuda.synchronize()
        if not np.array_equal(z.cpu().view(torch.int16).numpy().view(np.uint16),
                              combine_reference(first[rank])):
            bad.append("eager call differs")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            z = layer(static)
        for seed in (2, 3, 4):
            new = inputs(seed)
            for k, v in new[rank].items():
                if v is not None:
                    static[k].copy_(v)
            g.replay()
            torch.cuda.synchronize()
            comm.check()
            ep.check()
            if not np.array_equal(z.cpu().view(torch.int16).numpy().view(np.uint16),
                                  combine_reference(new[rank])):
                bad.append(f"replay {seed} differs")
        bad += _device_refusal(ep, inputs(5), "cuda")
    return bad


def _device_refusal(ep, inputs, device):
    """CUDA checks the routing on the device: on rank 0 token 2 names expert E (out of
    range) and token 3 repeats its k=0 expert; those tokens' rows are NaN, every other row is
    exact, ep.check() raises once."""
    bad = []
    rank = ep.rank
    a = {k: None if v is None else v.clone() for k, v in inputs[rank].items()}
    if rank == 0:
        a["topk_idx"][2, 1] = ep.num_experts
        a["topk_idx"][3, 2] = a["topk_idx"][3, 0]
    dev = {k: None if v is None else v.to(device) for k, v in a.items()}
    recv, handle = ep.dispatch(dev["x"], dev["topk_idx"], dev["topk_weights"], dev["x_scales"])
    experts = torch.tensor(ep.local_experts, device=device)
    z = ep.combine(graph_experts(recv, experts), handle, shared=dev["shared"])
    got = z.cpu().view(torch.int16).numpy().view(np.uint16)
    want = combine_reference(inputs[rank])
    keep = [t for t in range(got.shape[0]) if rank != 0 or t not in (2, 3)]
    if not np.array_equal(got[keep], want[keep]):
        bad.append("rows of good tokens differ after a refused entry")
    try:
        ep.check()
        if rank == 0:
            bad.append("ep.check() did not raise for refused entries")
    except ValueError as e:
        if rank != 0 or "2 top-k entries" not in str(e):
            bad.append(f"ep.check(): {e}")
    if rank == 0 and not (got[[2, 3]] == 0x7FFF).all():
        bad.append("refused tokens' rows are not the canonical NaN 0x7FFF")
    ep.check()  # reported once
    return bad


@pytest.mark.parametrize("world,fp8", [(2, True), (2, False), (4, True), (4, False)])
@cuda_only[0]
@cuda_only[1]
def test_ep_low_latency_graph_replay(world, fp8):
    values = check(run_ranks(ep_graph_job, world, args=(fp8,), timeout_s=600))
    bad = [f"rank {r}: {b}" for r, v in enumerate(values) for b in v]
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- the CUDA finalize kernel, emulated

# What every emulation build starts with: the kernels' integer types and the data plane's
# emulation header (sccl_emu.h: the CUDA built-ins as host C++).
_EMU_HEADER = r"""
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
#define SCCL_EMU 1
#include "sccl_emu.h"
thread_local EmuDim3 threadIdx, blockIdx, blockDim, gridDim;
"""

_EMU_MAIN = _EMU_HEADER + r"""
#include EP_KERNELS_CU
extern "C" void run(unsigned grid, const u64* a) {
  for (unsigned b = 0; b < grid; ++b) {  // one thread per block, blocks one after another
    blockIdx.x = b; gridDim.x = grid; blockDim.x = 1; threadIdx.x = 0;
    sccl_ep_finalize((const u8*)a[0], (const float*)a[1], (const int*)a[2], (const float*)a[3],
                     (const u8*)a[4], (u32*)a[5], a[6], a[7], a[8], a[9], a[10], (u8*)a[11]);
  }
}
"""


def _emu_build(tmp_path, main: str = _EMU_MAIN, name: str = "ep_emu"):
    import shutil
    import subprocess
    from pathlib import Path

    from sparkccl import ep_cuda
    from sparkccl.dataplane import nvrtc
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs g++ to build the CPU emulation of the kernel")
    emu_dir = Path(__file__).parent / "cuda_emu"
    src = tmp_path / f"{name}.cpp"
    src.write_text(main)
    lib = tmp_path / f"{name}.so"
    cmd = [cxx, "-std=c++17", "-O1", "-fPIC", "-shared", "-pthread", "-Wno-unknown-pragmas",
           f"-I{emu_dir}", *(f"-I{d}" for d in nvrtc.INCLUDE_DIRS),
           f'-DEP_KERNELS_CU="{ep_cuda.SOURCE.resolve()}"', str(src), "-o", str(lib)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return str(lib)


def _emu_ep_finalize(tmp_path):
    import ctypes
    so = ctypes.CDLL(_emu_build(tmp_path))
    so.run.argtypes = [ctypes.c_uint, ctypes.POINTER(ctypes.c_uint64)]
    return so


def test_ep_finalize_kernel_emulated(tmp_path):
    """sccl_ep_finalize (the CUDA combine's finalize) compiled as host C++ with the data
    plane's emulation header: the same bits as the numpy reference, bf16 and e4m3, general
    weights, several grid sizes (a grid-stride loop)."""
    import ctypes

    from sparkccl.reference import finalize_rows_reference, make_finalize_input
    so = _emu_ep_finalize(tmp_path)
    for case, (T, H, K, fp8, pow2, grid) in enumerate([(13, 64, 3, False, False, 1),
                                                       (9, 256, 8, True, False, 3),
                                                       (5, 128, 16, False, True, 7),
                                                       (0, 32, 2, False, True, 1)]):
        inp = make_finalize_input(70 + case, 0, tokens=T, hidden=H, topk=K, experts_rows=T + 4,
                                  fp8=fp8, pow2_weights=pow2)
        y = inp["y"].view(torch.uint8) if fp8 else inp["y"]
        out = torch.full((T, H), -1.0, dtype=torch.bfloat16)
        bad = torch.zeros(4, dtype=torch.int32)
        scales = inp["y_scales"]
        args = [y.data_ptr(), 0 if scales is None else scales.data_ptr(), inp["pos"].data_ptr(),
                inp["weights"].data_ptr(), inp["shared"].data_ptr(), bad.data_ptr(), T, K, H,
                y.shape[0], int(fp8), out.data_ptr()]
        so.run(grid, (ctypes.c_uint64 * len(args))(*args))
        want = finalize_rows_reference(inp, T, T)
        got = out.float().numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), case
        assert bad.tolist() == [0, 0, 0, 0]



def test_world_one_finalize_keeps_the_canonical_nan():
    """finalize.single_rank (world 1, and every EP combine on CPU) writes a NaN row element as
    0x7FFF like the data planes and the reference; through fp32, torch made it 0xFFFF."""
    import torch.distributed as dist

    import sparkccl
    from sparkccl.reference import bits, make_finalize_input, moe_finalize_reference
    with sparkccl.Communicator(store=dist.HashStore(), rank=0, world_size=1) as comm:
        inp = make_finalize_input(1, 0, tokens=8, hidden=64, topk=2, experts_rows=4)
        inp["y"][1, 3] = float("nan")
        z = comm.moe_finalize_reduce_scatter(inp["y"], inp["pos"], inp["weights"],
                                             inp["shared"], num_tokens=8, padded_tokens=8)
        assert (z.view(torch.int16) == 0x7FFF).any()
        assert (bits(z) == moe_finalize_reference([inp], 0, 8, 8)).all()



# ---------------------------------------------------------------- fused dispatch kernels, emulated

_EMU_DISPATCH = _EMU_HEADER + r"""
// Whole blocks: blockDim.x threads (std::thread each) meet at a barrier for __syncthreads and
// share one copy of each __shared__ array (blocks run one after another).
struct EmuBarrier {
  std::mutex m;
  std::condition_variable cv;
  unsigned n = 0, waiting = 0;
  u64 gen = 0;
  void wait() {
    std::unique_lock<std::mutex> l(m);
    const u64 g = gen;
    if (++waiting == n) {
      waiting = 0;
      ++gen;
      cv.notify_all();
      return;
    }
    cv.wait(l, [&] { return gen != g; });
  }
};
static EmuBarrier emu_bar;
static void emu_syncthreads() { emu_bar.wait(); }
#undef __shared__
#define __shared__ static
#define __syncthreads emu_syncthreads
#include EP_KERNELS_CU
#define P(i, T) ((T)(uintptr_t)a[i])
extern "C" int run(const char* name, unsigned gx, unsigned gy, unsigned nt, const u64* a) {
  const std::string k(name);
  if (k != "sccl_ep_pack" && k != "sccl_ep_unpack" && k != "sccl_ep_sized_plan") return -1;
  for (unsigned by = 0; by < gy; ++by)
    for (unsigned bx = 0; bx < gx; ++bx) {
      emu_bar.n = nt;
      std::vector<std::thread> ts;
      for (unsigned t = 0; t < nt; ++t)
        ts.emplace_back([=] {
          blockIdx.x = bx; blockIdx.y = by; gridDim.x = gx; gridDim.y = gy;
          blockDim.x = nt; threadIdx.x = t;
          if (k == "sccl_ep_pack")
            sccl_ep_pack(P(0, const void*), a[1], P(2, const int*), a[3], a[4], a[5], a[6],
                         a[7], a[8], a[9], P(10, const u8*), P(11, const u8*), a[12], a[13],
                         P(14, u8*), a[15], a[16], a[17], a[18], P(19, int*), P(20, u8*),
                         P(21, u64*), P(22, u64*), P(23, int*));
          else if (k == "sccl_ep_sized_plan")
            sccl_ep_sized_plan(P(0, const long long*), P(1, const long long*),
                               P(2, const int*), a[3], a[4], a[5], a[6], P(7, long long*),
                               P(8, long long*), P(9, int*));
          else
            sccl_ep_unpack(P(0, const u8*), a[1], a[2], a[3], a[4], P(5, const int*),
                           P(6, const int*), a[7], a[8], a[9], a[10], a[11], a[12], a[13],
                           a[14], a[15], a[16], P(17, u8*), P(18, u8*), P(19, int*),
                           P(20, int*), P(21, int*), P(22, int*), P(23, long long*),
                           P(24, const long long*), a[25], P(26, long long*));
        });
      for (auto& t : ts) t.join();
    }
  return 0;
}
"""


def _emu_cases(W: int):
    """(T, tokens per rank, H, topk, E, fp8, mode, placement, combine_rows, int32 ids,
    threads per emulated block)."""
    explicit = [(e * 7 + 3) % W for e in range(4 * W)]
    return [(16, [16 if r else 5 for r in range(W - 1)] + [0], 64, 4, 4 * W, False,
             "low_latency", "contiguous", None, False, 7),
            (12, [12] * W, 256, 8, 8 * W, True, "low_latency", "round_robin", 9, False, 32),
            (10, [10, 7] + [3] * (W - 2), 32, 2, 4 * W, False, "high_throughput", explicit,
             None, True, 256),
            (9, [9] * W, 128, 1, W, True, "low_latency", "round_robin", None, True, 5),
            (20, [20] * W, 64, 16, 16 * W, False, "low_latency", "contiguous", None, True, 7),
            (11, [11] * W, 128, 4, 4 * W, True, "high_throughput", "contiguous", None, False,
             64),
            (16, [16 if r else 5 for r in range(W - 1)] + [0], 128, 3, 4 * W, True,
             "high_throughput", "round_robin", None, False, 5),
            (9, [9] * W, 64, 1, 2 * W, False, "high_throughput", "contiguous", None, True, 3),
            # more experts than the kernels' owner table in shared memory holds (EP_OWN_MAX):
            # they read owner[] itself
            (8, [8] * W, 32, 4, 4100 * W, False, "low_latency", "round_robin", None, False, 32)]


def _emu_routing(inp, rank, E, int32):
    """Bad entries on rank 0 (out of range, negative, repeated; an int64 id past 2^32 that
    int32 wraps onto a good one), the ids as int32 where asked."""
    idx = inp["topk_idx"].clone()
    n, K = idx.shape
    if rank == 0 and n >= 5:
        idx[2, K - 1] = E
        idx[1, 0] = -7
        if K > 1:
            idx[3, K - 1] = idx[3, 0]
        if not int32:
            idx[4, 0] += 1 << 32
    return idx.to(torch.int32) if int32 else idx


def ep_emu_job(rank, world, store, so_path):
    """The torch path (the specification) dispatches on CPU ranks with the device checks
    on; on each rank the emulated sccl_ep_pack (and, low-latency, sccl_ep_unpack on the
    received blocks) must give the same bytes wherever the torch path defines them."""
    import sparkccl
    from sparkccl import ep_cuda
    from sparkccl.expert_parallel import BlockLayout, placement_table
    launch = _emu_launcher(so_path, 0)

    def run(name, grid, nt, args):
        launch(None, name, grid, args, threads=nt)

    bad = []
    W = world
    met = {"bad": 0, "overflow": 0}
    with sparkccl.Communicator(store=store, rank=rank, world_size=W, timeout_s=60,
                               slot_bytes=1 << 20) as comm:
        sent = record_sent(comm)
        for c, (T, ns, H, K, E, fp8, mode, placement, rows, int32, nt) in \
                enumerate(_emu_cases(W)):
            name = f"case {c} ({mode}, fp8 {fp8}, K {K}, threads {nt})"
            inp = make_ep_input(90 + c, rank, tokens=ns[rank], hidden=H, topk=K, num_experts=E,
                                world=W, fp8=fp8)
            idx = _emu_routing(inp, rank, E, int32)
            ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T,
                                         dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                                         mode=mode, placement=placement, combine_rows=rows)
            ep._device_checks = True
            recv, handle = ep.dispatch(inp["x"], idx, inp["topk_weights"], inp["x_scales"])
            n, Pd, Pc = ns[rank], handle.dispatch_rows, handle.ret_rows
            lay = BlockLayout(Pd, H, K + 1, ep._row_bytes, ep._scale_cols)
            want = sent["blocks"]
            got = ep._scratch["dispatch recv"][:W * lay.nbytes].view(W, lay.nbytes).clone()
            want_bad, want_over = int(ep._bad_entries), int(ep._overflow)
            met["bad"] += want_bad
            met["overflow"] += want_over

            # pack: count-only, then the blocks
            owners = placement_table(placement, E, W)
            clean = idx.long().to(torch.int32).long()
            if handle.bad_entries is not None:
                clean = clean.masked_fill(handle.bad_entries, -1)
            own = torch.tensor([[owners[e] if e >= 0 else W for e in row]
                                for row in clean.tolist()], dtype=torch.long).view(n, K)
            want_counts = [int((own == d).any(1).sum()) for d in range(W)] + \
                          [int((own == d).sum()) for d in range(W)]
            common = dict(idx=idx, owner=ep._owner_dev, E=E, W=W, limit=rows is not None,
                          x=inp["x"].view(torch.uint8), x_scales=inp["x_scales"],
                          row_bytes=ep._row_bytes, scale_bytes=ep._scale_cols * 4)
            cnt = torch.full((2 * W,), -5, dtype=torch.int32)
            zero = torch.zeros((), dtype=torch.int64)
            run("sccl_ep_pack", ep_cuda.pack_grid(W, 1, True), nt, ep_cuda.pack_args(
                **common, Pd=1, Pc=1, send=None, lay=BlockLayout(1, H, K + 1, 1, 0), pos=None,
                bad=None, bad_count=zero, overflow=zero, counts=cnt))
            if cnt.tolist() != want_counts:
                bad.append(f"{name}: pack counts {cnt.tolist()}, want {want_counts}")
            send = torch.full((W, lay.nbytes), 0xA5, dtype=torch.uint8)
            pos = torch.full((n * K,), 12345, dtype=torch.int32)
            refused = torch.ones((n, K), dtype=torch.bool)
            nbad = torch.full((), 100, dtype=torch.int64)
            nover = torch.full((), 200, dtype=torch.int64)
            run("sccl_ep_pack", ep_cuda.pack_grid(W, Pd, False), nt, ep_cuda.pack_args(
                **common, Pd=Pd, Pc=Pc, send=send, lay=lay, pos=pos, bad=refused,
                bad_count=nbad, overflow=nover))
            if not torch.equal(lay.idx(send), lay.idx(want[:W])):
                bad.append(f"{name}: send ids differ")
            heads = [lay.data_bytes(m) for m in want_counts[:W]]
            if lay.header(send).tolist() != heads or lay.header(want[:W]).tolist() != heads:
                bad.append(f"{name}: send headers {lay.header(send).tolist()}, torch path "
                           f"{lay.header(want[:W]).tolist()}, want {heads}")
            for d in range(W):
                m = want_counts[d]
                if not torch.equal(lay.x(send)[d, :m], lay.x(want)[d, :m]):
                    bad.append(f"{name}: send rows of block {d} differ")
                if fp8 and not torch.equal(lay.scales(send)[d, :m], lay.scales(want)[d, :m]):
                    bad.append(f"{name}: send scales of block {d} differ")
            if not torch.equal(pos, handle.pos):
                bad.append(f"{name}: pos {pos.tolist()[:12]}, want {handle.pos.tolist()[:12]}")
            if n and not torch.equal(refused, handle.bad_entries):
                bad.append(f"{name}: refused entries differ")
            if (int(nbad) - 100, int(nover) - 200) != (want_bad, want_over):
                bad.append(f"{name}: counted bad {int(nbad) - 100}, overflow {int(nover) - 200}; "
                           f"want {want_bad}, {want_over}")
            El = ep.num_local_experts
            unpack = dict(got=got, lay=lay, owner=ep._owner_dev, experts=ep._experts_dev,
                          rank=rank, E=E, W=W, Pd=Pd, K=K, Pc=Pc, limit=rows is not None,
                          row_bytes=ep._row_bytes, scale_bytes=ep._scale_cols * 4)
            if mode == "high_throughput":
                bad += _emu_unpack_packed(name, run, nt, unpack, recv, handle, El, fp8, ep)
                continue

            # unpack of the received blocks
            cap = W * T
            rx = torch.full((El, cap, ep._row_bytes), 0x5A, dtype=torch.uint8)
            xs = torch.full((El, cap, ep._scale_cols), 7.0) if fp8 else None
            counts = torch.full((El,), -9, dtype=torch.int32)
            src = [torch.full((El, cap), -9, dtype=torch.int32) for _ in range(3)]
            feed = torch.full((W * Pc,), -9, dtype=torch.int64)
            ret = torch.full((W,), -9, dtype=torch.int64)
            run("sccl_ep_unpack", ep_cuda.unpack_grid(El, cap), nt, ep_cuda.unpack_args(
                **unpack, cap=cap, rx=rx, xs=xs, counts=counts, src_rank=src[0],
                src_token=src[1], src_k=src[2], feed=feed, ret_counts=ret))
            if not torch.equal(counts, recv.counts):
                bad.append(f"{name}: counts {counts.tolist()}, want {recv.counts.tolist()}")
                continue
            for f, a, b in zip(("src_rank", "src_token", "src_k"), src,
                               (recv.src_rank, recv.src_token, recv.src_k)):
                if not torch.equal(a, b):
                    bad.append(f"{name}: {f} differs")
            if not torch.equal(feed, handle.feed):
                bad.append(f"{name}: feed differs")
            if not torch.equal(ret, handle.ret_counts):
                bad.append(f"{name}: ret_counts {ret.tolist()}, want "
                           f"{handle.ret_counts.tolist()}")
            for e, m in enumerate(counts.tolist()):
                if not torch.equal(rx[e, :m], recv.x[e, :m].view(torch.uint8)):
                    bad.append(f"{name}: rows of local expert {e} differ")
                if fp8 and not torch.equal(xs[e, :m].view(torch.int32),
                                           recv.x_scales[e, :m].view(torch.int32)):
                    bad.append(f"{name}: scales of local expert {e} differ")
    if rank == 0 and not (met["bad"] and met["overflow"]):
        bad.append(f"the cases met no bad entry or no overflow: {met}")
    return bad


def _emu_unpack_packed(name, run, nt, unpack, recv, handle, El, fp8, ep):
    """High-throughput unpack, as _dispatch_fused runs it: the count launch, the offsets,
    then the packed rows (every one of them defined), against the torch path's recv."""
    from sparkccl import ep_cuda
    bad = []
    counts = torch.full((El,), -9, dtype=torch.int32)
    run("sccl_ep_unpack", (El, 1), nt, ep_cuda.unpack_args(
        **unpack, cap=0, rx=None, xs=None, counts=counts, src_rank=None, src_token=None,
        src_k=None, feed=None, count_only=True))
    if not torch.equal(counts, recv.counts):
        return [f"{name}: count launch {counts.tolist()}, want {recv.counts.tolist()}"]
    offsets = torch.zeros(El + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(counts, 0)
    if not torch.equal(offsets, recv.offsets):
        return [f"{name}: offsets {offsets.tolist()}, want {recv.offsets.tolist()}"]
    R = int(offsets[El])
    rx = torch.full((R, ep._row_bytes), 0x5A, dtype=torch.uint8)
    xs = torch.full((R, ep._scale_cols), 7.0) if fp8 else None
    src = [torch.full((R,), -9, dtype=torch.int32) for _ in range(3)]
    feed = torch.full(handle.feed.shape, -9, dtype=torch.int64)
    ret = torch.full(handle.ret_counts.shape, -9, dtype=torch.int64)
    counts.fill_(-9)
    # shares from the rows (more than one block per expert where there are rows to share)
    grid = ep_cuda.unpack_grid(El, -(-R // El), ep_cuda.HT_SPREAD)
    run("sccl_ep_unpack", grid, nt, ep_cuda.unpack_args(
        **unpack, cap=0, rx=rx, xs=xs, counts=counts, src_rank=src[0], src_token=src[1],
        src_k=src[2], feed=feed, offsets=offsets, ret_counts=ret))
    if not torch.equal(counts, recv.counts):
        bad.append(f"{name}: counts {counts.tolist()}, want {recv.counts.tolist()}")
    for f, a, b in zip(("src_rank", "src_token", "src_k"), src,
                       (recv.src_rank, recv.src_token, recv.src_k)):
        if not torch.equal(a, b):
            bad.append(f"{name}: {f} {a.tolist()[:8]}, want {b.tolist()[:8]}")
    if not torch.equal(feed, handle.feed):
        bad.append(f"{name}: feed differs")
    if not torch.equal(ret, handle.ret_counts):
        bad.append(f"{name}: ret_counts {ret.tolist()}, want {handle.ret_counts.tolist()}")
    if not torch.equal(rx, recv.x.view(torch.uint8).reshape(R, ep._row_bytes)):
        bad.append(f"{name}: packed rows differ")
    if fp8 and not torch.equal(xs.view(torch.int32), recv.x_scales.view(torch.int32)):
        bad.append(f"{name}: packed scales differ")
    return bad


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.extended)])
def test_ep_dispatch_kernels_emulated(world, tmp_path):
    """sccl_ep_pack / sccl_ep_unpack compiled as host C++ (whole blocks of threads with a
    barrier for __syncthreads; blocks of 5 to 256 threads, so the scans cover several tiles)
    against the torch path on CPU ranks: bad entries, combine_rows overflow, an empty rank,
    experts with no tokens, one-rank tokens, int32 and int64 ids, both modes, more experts
    than the owner table in shared memory holds."""
    so = _emu_build(tmp_path, _EMU_DISPATCH, "ep_dispatch_emu")
    values = check(run_ranks(ep_emu_job, world, args=(so,), timeout_s=600))
    bad = [f"rank {r}: {b}" for r, v in enumerate(values) for b in v]
    assert not bad, "\n".join(bad)



def _fused_cases(W: int):
    """_emu_cases plus, in both modes, more than one 256-token tile of tokens and of
    received rows per source, DeepSeek-like rows (hidden 7168; e4m3, and bf16 in
    high-throughput mode), and a skewed routing (every token on rank 0's experts: the other
    ranks receive no row)."""
    return [c[:10] for c in _emu_cases(W)] + [
        (300, [300] * W, 512, 8, 8 * W, True, "low_latency", "contiguous", None, False),
        (64, [64] * W, 7168, 8, 32 * W, True, "low_latency", "contiguous", 40, False),
        (40, [40] * W, 256, 4, 4 * W, False, "low_latency", "skewed", None, True),
        (300, [300, 280] + [260] * (W - 2), 512, 8, 8 * W, True, "high_throughput",
         "round_robin", None, False),
        (64, [64] * W, 7168, 8, 32 * W, False, "high_throughput", "contiguous", None, True),
        (48, [48] * W, 7168, 8, 32 * W, True, "high_throughput", "contiguous", None, False),
        (40, [40] * W, 256, 4, 4 * W, True, "high_throughput", "skewed", None, False)]


def _emu_launcher(so_path: str, threads: int):
    """ep_cuda.launch's twin that runs the kernels in the CPU emulation (_EMU_DISPATCH)."""
    import ctypes
    so = ctypes.CDLL(so_path)
    so.run.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                       ctypes.POINTER(ctypes.c_uint64)]
    so.run.restype = ctypes.c_int

    def launch(dev, name, grid, args, threads=threads):
        a = (ctypes.c_uint64 * len(args))(*(int(v) for v in args))
        gy = grid[1] if len(grid) > 1 else 1
        assert so.run(name.encode(), grid[0], gy, threads, a) == 0, name
    return launch


def _large_fused_case(c) -> bool:
    """More than one 256-token tile (300 tokens) or DeepSeek-like rows (hidden 7168): the
    kernels' tiling and row sizes. Minutes under the CPU emulation (std::thread per lane),
    where the tiles are covered by test_ep_dispatch_kernels_emulated's small blocks."""
    return c[0] >= 256 or c[2] >= 7168


def ep_fused_job(rank, world, store, device="cuda", so_path=None, which="all"):
    """The fused dispatch (sccl_ep_pack / sccl_ep_unpack) against the torch path
    (ExpertParallel(_fused=False)) on the same inputs: send blocks, pos, refused entries
    and their counts, recv (counts, src_*, rows and scales up to the counts), feed; then
    combine of the fused dispatch against the one-box reference (refused tokens: the
    canonical NaN, check() raises). On CUDA ranks; on CPU ranks (device "cpu") with the
    kernels run by the CPU emulation, which checks the Python side of the fused path.
    ``which``: "all" the cases, or only the "small" / "large" ones (_large_fused_case)."""
    import sparkccl
    from sparkccl import ep_cuda
    from sparkccl.expert_parallel import BlockLayout
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        ep_cuda.launch = _emu_launcher(so_path, 32)
    W, bad = world, []
    with sparkccl.Communicator(store=store, rank=rank, world_size=W, device=device,
                               slot_bytes=8 << 20, timeout_s=60) as comm:
        dev = comm.device
        sent = record_sent(comm)
        for c, (T, ns, H, K, E, fp8, mode, placement, rows, int32) in \
                enumerate(_fused_cases(W)):
            if which != "all" and _large_fused_case(_fused_cases(W)[c]) != (which == "large"):
                continue
            name = f"case {c} ({mode}, fp8 {fp8}, T {T}, H {H}, K {K})"
            inp = make_ep_input(120 + c, rank, tokens=ns[rank], hidden=H, topk=K,
                                num_experts=E, world=W, fp8=fp8)
            if placement == "skewed":  # every token's top-k on rank 0's experts
                placement = "contiguous"
                g = torch.Generator().manual_seed(c * 31 + rank)
                inp["topk_idx"] = torch.stack([torch.randperm(E // W, generator=g)[:K]
                                               for _ in range(ns[rank])])
            idx = _emu_routing(inp, rank, E, int32).to(dev)
            a = {k: None if v is None else v.to(dev) for k, v in inp.items()}
            got = []
            eps = [sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T,
                                           dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                                           mode=mode, placement=placement, combine_rows=rows,
                                           _fused=fused and device == "cuda")
                   for fused in (True, False)]
            if device == "cpu":
                eps[0]._fused = True
                for ep in eps:
                    ep._device_checks = True
            for ep in eps:
                recv, handle = ep.dispatch(a["x"], idx, a["topk_weights"], a["x_scales"])
                lay = BlockLayout(handle.dispatch_rows, H, K + 1, ep._row_bytes, ep._scale_cols)
                send = sent["blocks"]
                got.append((recv, handle, lay, send))
            if device == "cuda":
                torch.cuda.synchronize()
            (rf, hf, lay, sf), (rt, ht, lay_t, st) = got
            if lay != lay_t:
                bad.append(f"{name}: layouts {lay} / {lay_t}")
                continue
            if not torch.equal(lay.idx(sf), lay.idx(st)):
                bad.append(f"{name}: send ids differ")
            filled = (lay.idx(st).view(torch.int32).view(W, lay.T, K + 1)[:, :, 0] >= 0).sum(1)
            if not torch.equal(lay.header(sf).cpu(), lay.data_bytes(filled).cpu()) or \
                    not torch.equal(lay.header(st), lay.data_bytes(filled)):
                bad.append(f"{name}: send headers {lay.header(sf).tolist()}, torch path "
                           f"{lay.header(st).tolist()}, rows {filled.tolist()}")
            for d, m in enumerate(filled.tolist()):
                if not torch.equal(lay.x(sf)[d, :m], lay.x(st)[d, :m]):
                    bad.append(f"{name}: send rows of block {d} differ")
                if fp8 and not torch.equal(lay.scales(sf)[d, :m], lay.scales(st)[d, :m]):
                    bad.append(f"{name}: send scales of block {d} differ")
            for f in ("pos", "feed", "dispatch_rows", "ret_rows", "recv_shape", "ret_counts"):
                x, y = getattr(hf, f), getattr(ht, f)
                if not (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y):
                    bad.append(f"{name}: handle.{f} differs")
            for f in ("feed", "header", "pos"):  # (sccl_ep_sized_plan against its torch ops)
                if not torch.equal(getattr(hf.sized, f), getattr(ht.sized, f)):
                    bad.append(f"{name}: handle.sized.{f} differs")
            if (hf.bad_entries is None) != (ht.bad_entries is None) or (
                    hf.bad_entries is not None and not torch.equal(hf.bad_entries,
                                                                   ht.bad_entries)):
                bad.append(f"{name}: handle.bad_entries differ")
            for f in ("_bad_entries", "_overflow"):
                if int(getattr(eps[0], f)) != int(getattr(eps[1], f)):
                    bad.append(f"{name}: {f} {int(getattr(eps[0], f))}, torch path "
                               f"{int(getattr(eps[1], f))}")
            for f in ("counts", "src_rank", "src_token", "src_k"):
                if not torch.equal(getattr(rf, f), getattr(rt, f)):
                    bad.append(f"{name}: recv.{f} differs")
            if mode == "low_latency":
                for e, m in enumerate(rt.counts.tolist()):
                    if not torch.equal(rf.x[e, :m].view(torch.uint8),
                                       rt.x[e, :m].view(torch.uint8)):
                        bad.append(f"{name}: recv.x of local expert {e} differs")
                    if fp8 and not torch.equal(rf.x_scales[e, :m].view(torch.int32),
                                               rt.x_scales[e, :m].view(torch.int32)):
                        bad.append(f"{name}: recv.x_scales of local expert {e} differ")
            else:
                same = torch.equal(rf.offsets, rt.offsets) and torch.equal(
                    rf.x.view(torch.uint8), rt.x.view(torch.uint8))
                if fp8:
                    same = same and torch.equal(rf.x_scales.view(torch.int32),
                                                rt.x_scales.view(torch.int32))
                if not same:
                    bad.append(f"{name}: high-throughput recv rows differ")
            # combine of the fused dispatch: the one-box bits, refused tokens NaN
            z = eps[0].combine(run_experts(eps[0], rf), hf, shared=a["shared"])
            z = z.cpu().view(torch.int16).numpy().view(np.uint16)
            want = combine_reference(inp)
            n = ns[rank]
            refused = (ht.pos.view(n, K) == W * ht.ret_rows).any(1).cpu().numpy() if n else \
                np.zeros(0, dtype=bool)
            if not np.array_equal(z[~refused], want[~refused]):
                bad.append(f"{name}: combine of the fused dispatch differs from the one-box "
                           "reference")
            if refused.any() and not (z[refused] == 0x7FFF).all():
                bad.append(f"{name}: refused tokens are not the canonical NaN")
            for ep in eps:
                try:
                    ep.check()
                    if refused.any():
                        bad.append(f"{name}: check() did not raise (fused {ep._fused})")
                except ValueError as e:
                    if not refused.any():
                        bad.append(f"{name}: check(): {e}")
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("which", ["small", pytest.param("large", marks=pytest.mark.extended)])
def test_ep_fused_dispatch_path_emulated(which, tmp_path):
    """ep_fused_job on CPU ranks, the kernels emulated: the fused path's Python side (the
    arguments, buffers, shapes, the high-throughput count launch) end to end. The large
    cases (300 tokens, hidden 7168: about 3 minutes emulated) are in the extended tier."""
    so = _emu_build(tmp_path, _EMU_DISPATCH, "ep_dispatch_emu")
    values = check(run_ranks(ep_fused_job, 2, args=("cpu", so, which), timeout_s=900))
    bad = [f"rank {r}: {b}" for r, v in enumerate(values) for b in v]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("world", [2, 4])
@cuda_only[0]
@cuda_only[1]
def test_ep_fused_dispatch_equals_torch_path(world):
    values = check(run_ranks(ep_fused_job, world, timeout_s=600))
    bad = [f"rank {r}: {b}" for r, v in enumerate(values) for b in v]
    assert not bad, "\n".join(bad)
