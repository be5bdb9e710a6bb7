"""The sized combine of ExpertParallel (sparkccl/expert_parallel.py, docs/EXPERT_PARALLEL.md
"The movement"): combine sends blocks of ``ret_rows + 1`` rows, a header row whose first 8
bytes say how many bytes of the block carry data, ``(1 + ret_counts[d]) * 2 * hidden``, then
the rows; on every path (CUDA; CPU gathered at once with ``ep._stream_cpu = False``, or
streamed beside the wire, the CPU default).

* ``handle.ret_counts`` (the rows this rank returns to each home rank) against a count made
  from the routing alone, on the torch path and the native CPU path (not streamed), both
  modes, world 2 and 4, combine_rows unset, set and not exceeded, set and exceeded (refused
  on the device-side checks); the blocks that went on the wire (header and rows) against the
  expert outputs of each home's entries, and the combined rows against the one-box
  reference (refused tokens: the canonical NaN), also with every received block's bytes
  past its header's count overwritten with NaN (what the sized all-to-all leaves
  undefined);
* the wire bytes of a combine (``comm.proxy_stats()["bytes"]``): the headers and the rows
  that exist, rounded up to 16, once ``Communicator.all_to_all`` takes ``sized``, gathered
  at once and streamed; and of ``combine(partial=True)``: the weights' all-to-all, then a
  header and one row per (home token, rank);
* the dispatch's blocks, sized too (``BlockLayout``: a header, the ids and scales whole,
  then the rows of the tokens that go to that rank): the received blocks' bytes past their
  headers' counts overwritten with NaN before the rows are selected (the combine above is
  then exact), and the wire bytes of a dispatch, gathered at once and streamed (the
  headers on every path: tests/test_expert_parallel.py, tests/test_ep_native.py).
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

from sparkccl.ep_reference import combine_reference, make_ep_input, one_box_rows, run_experts
from sparkccl.localrun import check, run_ranks
from helpers import posted_bytes
from test_ep_native import _tokens_to
from test_expert_parallel import check_refusals, record_sent


def _cases(W):
    """(T, tokens per rank, H, topk, E, mode, placement, combine_rows, device checks)."""
    T, K, E = 12, 4, 4 * W
    zero_last = [0 if r == W - 1 else 10 for r in range(W)]
    return [(T, [T - r for r in range(W)], 64, K, E, "high_throughput", "contiguous", None, False),
            (T, zero_last, 32, 2, E, "high_throughput", "round_robin", None, False),
            (T, [T - 1] * W, 64, K, E, "low_latency", "contiguous", None, False),
            (T, zero_last, 128, 3, 2 * E, "low_latency", "round_robin", None, False),
            # combine_rows at what the routing needs (nothing refused), then below it
            # (refused on the device-side checks: those tokens' rows are NaN)
            (T, [T - 1] * W, 64, K, E, "low_latency", "contiguous", "need", False),
            (T, [T - 1] * W, 64, K, E, "low_latency", "contiguous", "need-2", True)]


def _inputs(c, W, T, ns, H, K, E):
    return [make_ep_input(200 + c, r, tokens=ns[r], hidden=H, topk=K, num_experts=E, world=W)
            for r in range(W)]


def _held(inputs, owners, rank):
    """Per home rank d: the entries (t, k) of d's tokens whose expert this rank holds, in
    (t, k) order (the order of combine's rows for d)."""
    return [[(t, k) for t, row in enumerate(inp["topk_idx"].tolist())
             for k, e in enumerate(row) if owners[e] == rank] for inp in inputs]


def _combine_rows(spec, inputs, owners, W):
    if spec is None:
        return None
    need = max(len(h) for r in range(W) for h in _held(inputs, owners, r))
    return need if spec == "need" else need - 2


def _past_counts_poisoned(comm):
    """Make ``comm.all_to_all`` the real call followed, for a sized call, by every received
    block's bytes past its header's count (rounded up to 16, at most the block) overwritten
    with 0xFF (bf16 NaN), as the sized all-to-all leaves them undefined: a combine that read
    one would not be exact. Returns the undo."""
    real = comm.all_to_all

    def all_to_all(x, *, out=None, sized=False, **kw):
        res = real(x, out=out, sized=sized, **kw)
        if sized:
            b = res.reshape(-1).view(torch.uint8).view(comm.world_size, -1)
            for s in range(comm.world_size):
                count = int(b[s, :8].view(torch.int64)[0])
                b[s, min(-(-max(count, 8) // 16) * 16, b.shape[1]):] = 0xFF
        return res

    comm.all_to_all = all_to_all
    return lambda: setattr(comm, "all_to_all", real)


def _combine_problems(name, z, ref, over):
    got = z.view(torch.int16).numpy().view(np.uint16)
    keep = [t for t in range(ref.shape[0]) if t not in over]
    bad = []
    if got.shape != ref.shape or not np.array_equal(got[keep], ref[keep]):
        bad.append(f"{name}: combined rows differ from the one-box reference")
    elif over and not (got[sorted(over)] == 0x7FFF).all():
        bad.append(f"{name}: refused tokens are not the canonical NaN")
    return bad


def sized_job(rank, world, store):
    import torch.distributed as dist

    import sparkccl
    from sparkccl.expert_parallel import placement_table
    W, bad = world, []
    with sparkccl.Communicator(store=dist.PrefixStore("sized", store), rank=rank, world_size=W,
                               timeout_s=60, slot_bytes=1 << 20) as comm:
        sent = record_sent(comm)
        for c, (T, ns, H, K, E, mode, placement, spec, dev_checks) in enumerate(_cases(W)):
            inputs = _inputs(c, W, T, ns, H, K, E)
            owners = placement_table(placement, E, W)
            rows = _combine_rows(spec, inputs, owners, W)
            held = _held(inputs, owners, rank)
            mine = inputs[rank]
            RB = 2 * H
            # the tokens of this rank with an entry past a block (refused)
            seen, over = [0] * W, set()
            for t, row in enumerate(mine["topk_idx"].tolist()):
                for e in row:
                    seen[owners[e]] += 1
                    if rows is not None and seen[owners[e]] > rows:
                        over.add(t)
            for native, stream in ((True, False), (False, False), (False, True)):
                name = (f"world {W} case {c} ({mode}, combine_rows {rows}, native {native}, "
                        f"streamed {stream})")
                ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T,
                                             mode=mode, placement=placement, combine_rows=rows)
                ep._device_checks = dev_checks
                ep._native_cpu, ep._stream_cpu = native, stream
                # (gathered at once: every received dispatch block's bytes past its header's
                # count NaN before they are selected; the combine below then checks the rows)
                undo = None if stream else _past_counts_poisoned(comm)
                try:
                    recv, handle = ep.dispatch(mine["x"], mine["topk_idx"],
                                               mine["topk_weights"])
                finally:
                    if undo is not None:
                        undo()
                Pc = handle.ret_rows
                want = [min(len(h), Pc) for h in held]
                rc = handle.ret_counts
                if rc.dtype != torch.int64 or tuple(rc.shape) != (W,) or rc.tolist() != want:
                    bad.append(f"{name}: ret_counts {rc.dtype} {rc.tolist()}, want {want}")
                if handle.sized is None:
                    bad.append(f"{name}: no sized plan at dispatch")
                out = run_experts(ep, recv)
                ref = combine_reference(mine)
                z = ep.combine(out, handle, shared=mine["shared"])
                bad += _combine_problems(name, z, ref, over)
                if dev_checks:
                    bad += check_refusals(ep, over, name)
                if stream:
                    continue
                # the same with the bytes past each received block's count undefined
                undo = _past_counts_poisoned(comm)
                try:
                    z = ep.combine(out, handle, shared=mine["shared"])
                finally:
                    undo()
                bad += _combine_problems(f"{name}, bytes past the counts NaN", z, ref, over)
                # the blocks as they went: block d = header, then the outputs of home d's
                # entries held here in (t, k) order (the rest undefined)
                blocks = sent["blocks"]
                if tuple(blocks.shape) != (W, (Pc + 1) * RB):
                    bad.append(f"{name}: combine blocks {list(blocks.shape)}, want "
                               f"{[W, (Pc + 1) * RB]}")
                    continue
                head = blocks[:, :8].contiguous().view(torch.int64).view(-1).tolist()
                if head != [(1 + m) * RB for m in want]:
                    bad.append(f"{name}: headers {head}, want {[(1 + m) * RB for m in want]}")
                for d in range(W):
                    m = want[d]
                    if not m:
                        continue
                    K_d = inputs[d]["topk_idx"].shape[1]
                    ob = one_box_rows(inputs[d])
                    rows_d = torch.stack([ob[t * K_d + k] for t, k in held[d][:m]])
                    sent_d = blocks[d, RB:(1 + m) * RB].view(torch.bfloat16).view(m, H)
                    if not torch.equal(sent_d.view(torch.int16), rows_d.view(torch.int16)):
                        bad.append(f"{name}: rows of the block for rank {d} differ")
    return bad


@pytest.mark.parametrize("world", [2, 4])
def test_ret_counts_and_sized_blocks(world):
    bad = [f"rank {r}: {b}" for r, v in enumerate(
        check(run_ranks(sized_job, world, timeout_s=300))) for b in v]
    assert not bad, "\n".join(bad)


def wire_job(rank, world, store, topology):
    import torch.distributed as dist

    import sparkccl
    from sparkccl.expert_parallel import BlockLayout, placement_table
    W, bad = world, []
    with sparkccl.Communicator(store=dist.PrefixStore("wire", store), rank=rank, world_size=W,
                               topology=topology, transport="shm", timeout_s=60,
                               slot_bytes=8 << 20) as comm:
        for c, (T, ns, H, K, E, mode, placement, spec, dev_checks) in enumerate(_cases(W)):
            inputs = _inputs(c, W, T, ns, H, K, E)
            owners = placement_table(placement, E, W)
            rows = _combine_rows(spec, inputs, owners, W)
            mine = inputs[rank]
            for stream in (False, True):
                ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T,
                                             mode=mode, placement=placement, combine_rows=rows)
                ep._device_checks = dev_checks
                ep._stream_cpu = stream
                _, warm = ep.dispatch(mine["x"], mine["topk_idx"], mine["topk_weights"])
                comm.all_gather(torch.zeros(1))
                # dispatch: per peer the header, ids and scales, then the rows of the tokens
                # that go there (high-throughput: after the counts' all-gather, measured alone)
                lay = BlockLayout(warm.dispatch_rows, H, K + 1, ep._row_bytes, ep._scale_cols)
                want = sum(-(-lay.data_bytes(n) // 16) * 16
                           for d, n in enumerate(_tokens_to(ep, mine["topk_idx"])) if d != rank)
                if mode == "high_throughput":
                    start = posted_bytes(comm)
                    comm.all_gather(torch.zeros(2 * W, dtype=torch.int32))
                    want += posted_bytes(comm) - start
                    comm.all_gather(torch.zeros(1))
                start = posted_bytes(comm)
                recv, handle = ep.dispatch(mine["x"], mine["topk_idx"], mine["topk_weights"])
                got = posted_bytes(comm) - start
                if got != want:
                    bad.append(f"world {W} {topology} case {c} ({mode}, streamed {stream}): "
                               f"dispatch posted {got} bytes, want {want} (unsized: "
                               f"{(W - 1) * lay.nbytes})")
                comm.all_gather(torch.zeros(1))
                out = run_experts(ep, recv)
                ep.combine(out, handle)  # (warm: the same wire as the measured one)
                comm.all_gather(torch.zeros(1))
                RB, Pc = 2 * H, handle.ret_rows
                held = _held(inputs, owners, rank)
                want = sum(-(-(1 + min(len(held[d]), Pc)) * RB // 16) * 16
                           for d in range(W) if d != rank)
                start = posted_bytes(comm)  # (the all-gather's bytes counted)
                ep.combine(out, handle)
                got = posted_bytes(comm) - start
                if got != want:
                    bad.append(f"world {W} {topology} case {c} ({mode}, combine_rows {rows}, "
                               f"streamed {stream}): combine posted {got} bytes, want {want} "
                               f"(unsized: {(W - 1) * (Pc + 1) * RB})")
                comm.all_gather(torch.zeros(1))  # (every rank's count read before the next)
                if stream:
                    continue
                # combine(partial=True): the weights' all-to-all (measured alone), then per
                # home a header and one row per token of it held here
                start = posted_bytes(comm)
                comm.all_to_all(torch.zeros(W * Pc))
                weights = posted_bytes(comm) - start
                want = weights + sum(
                    -(-(1 + len({t for t, _ in held[d][:Pc]})) * RB // 16) * 16
                    for d in range(W) if d != rank)
                comm.all_gather(torch.zeros(1))
                start = posted_bytes(comm)
                ep.combine(out, handle, partial=True)
                got = posted_bytes(comm) - start
                if got != want:
                    bad.append(f"world {W} {topology} case {c} ({mode}, combine_rows {rows}): "
                               f"the partial combine posted {got} bytes, want {want}")
                comm.all_gather(torch.zeros(1))
    return bad


@pytest.mark.parametrize("world", [2, 4])
def test_sized_combine_wire_bytes(world):
    """Mesh: each rank posts its own blocks to each peer, nothing relayed."""
    bad = [f"rank {r}: {b}" for r, v in enumerate(
        check(run_ranks(wire_job, world, args=("mesh",), timeout_s=300))) for b in v]
    assert not bad, "\n".join(bad)
