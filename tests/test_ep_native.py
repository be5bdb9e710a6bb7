"""The CPU twin of ExpertParallel.dispatch's host work (native/src/ep_cpu.cpp) against the
torch path it replaces on CPU (``ep._native_cpu = False``), field by field, bit for bit: the
send blocks (rows and scales up to each destination's tokens, the whole index section with
its -1 fill), pos, counts, offsets, src_* (-1 past the counts in low-latency mode), the
received rows and scales up to the counts, combine's feed and the combined rows; the
combine_rows refusal (the same ValueError before anything is sent; with the device-side
checks on, the same pos / feed and overflow count). Routings of tests/test_expert_parallel.py
(idle experts, tokens whose top-k all live on one rank, token counts that differ per rank,
zero included), both modes, bf16 and e4m3, topk 1-16, world 1-4; and the native path with
its unpack and finalize beside the wire (the default) against the same after it, for the
exact and the partial combine.
"""
from __future__ import annotations

import torch

from sparkccl.ep_reference import make_ep_input, run_experts
from sparkccl.localrun import check, run_ranks
from test_expert_parallel import ep_cases, record_sent


def _tokens_to(ep, idx):
    """Per destination: this rank's tokens that go there (once each)."""
    own = torch.tensor(ep.owners)[idx.clamp(min=0)].masked_fill(idx < 0, ep.world)
    return [int((own == d).any(1).sum()) for d in range(ep.world)]


def _dispatch_both(ep, mine, sent):
    """(native, torch): (recv, handle, send blocks, overflow count) or the error's message.
    ``sent``: record_sent's record of ep's communicator."""
    from sparkccl.expert_parallel import BlockLayout
    out = []
    for native in (True, False):
        ep._native_cpu = native
        before = int(ep._overflow)
        try:
            recv, handle = ep.dispatch(mine["x"], mine["topk_idx"], mine["topk_weights"],
                                       mine["x_scales"])
        except ValueError as e:
            out.append(str(e))
            continue
        lay = BlockLayout(handle.dispatch_rows, ep.hidden, handle.topk + 1, ep._row_bytes,
                          ep._scale_cols)
        send = sent["blocks"]
        out.append((recv, handle, send, lay, int(ep._overflow) - before))
    ep._native_cpu = True
    return out


def _differences(ep, mine, a, b):
    if isinstance(a, str) or isinstance(b, str):
        return [] if a == b else [f"errors differ: {a!r} vs {b!r}"]
    (ra, ha, sa, lay, oa), (rb, hb, sb, _, ob) = a, b
    bad = []

    def same(name, x, y):
        if x is None or y is None:
            if (x is None) != (y is None):
                bad.append(f"{name}: {x} vs {y}")
        elif x.shape != y.shape or x.dtype != y.dtype or not torch.equal(
                x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            bad.append(f"{name} differs")

    for f in ("mode", "dispatch_rows", "ret_rows", "num_tokens", "topk", "recv_shape"):
        if getattr(ha, f) != getattr(hb, f):
            bad.append(f"handle.{f}: {getattr(ha, f)} vs {getattr(hb, f)}")
    if bad:
        return bad
    if oa != ob:
        bad.append(f"overflow count {oa} vs {ob}")
    same("pos", ha.pos, hb.pos)
    same("feed", ha.feed, hb.feed)
    idx = mine["topk_idx"] if ha.bad_entries is None else \
        mine["topk_idx"].masked_fill(ha.bad_entries, -1)
    for d, m in enumerate(_tokens_to(ep, idx)):
        same(f"send {d} rows", lay.x(sa)[d, :m], lay.x(sb)[d, :m])
        same(f"send {d} scales", lay.scales(sa)[d, :m], lay.scales(sb)[d, :m])
        same(f"send {d} ids", lay.idx(sa)[d], lay.idx(sb)[d])
        for which, blocks in (("native", sa), ("torch", sb)):
            if int(lay.header(blocks)[d]) != lay.data_bytes(m):
                bad.append(f"send {d} header ({which}) {int(lay.header(blocks)[d])}, want "
                           f"{lay.data_bytes(m)} ({m} rows)")
    same("counts", ra.counts, rb.counts)
    same("offsets", ra.offsets, rb.offsets)
    for f in ("src_rank", "src_token", "src_k"):
        same(f, getattr(ra, f), getattr(rb, f))
    if ra.experts != rb.experts:
        bad.append("experts differ")
    counts = ra.counts.tolist()
    for e, c in enumerate(counts):  # rows up to the counts (low-latency: the rest undefined)
        if ra.mode == "low_latency":
            sel = (e, slice(0, c))
        else:
            sel = (slice(int(ra.offsets[e]), int(ra.offsets[e + 1])),)
        same(f"x of expert {e}", ra.x[sel], rb.x[sel])
        if ra.x_scales is not None or rb.x_scales is not None:
            same(f"x_scales of expert {e}", ra.x_scales[sel], rb.x_scales[sel])
    return bad


def native_job(rank, world, store, cases):
    import torch.distributed as dist

    import sparkccl
    bad = []
    with sparkccl.Communicator(store=dist.PrefixStore("native", store), rank=rank,
                               world_size=world, timeout_s=60) as comm:
        sent = record_sent(comm)
        for c, (T, ns, H, K, E, fp8, mode, placement, combine_rows, dev_checks) in \
                enumerate(cases):
            name = f"world {world} case {c} ({mode}, fp8 {fp8}, E {E}, K {K})"
            inputs = [make_ep_input(70 + c, r, tokens=ns[r], hidden=H, topk=K, num_experts=E,
                                    world=world, fp8=fp8) for r in range(world)]
            mine = inputs[rank]
            ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T,
                                         dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                                         mode=mode, placement=placement,
                                         combine_rows=combine_rows)
            ep._device_checks = dev_checks
            a, b = _dispatch_both(ep, mine, sent)
            bad += [f"{name}: {m}" for m in _differences(ep, mine, a, b)]
            if combine_rows == 3:  # (the routing needs more: the refusal was met)
                met = ("more than combine_rows" in a if isinstance(a, str) else a[4] > 0)
                if not met and rank == 0:
                    bad.append(f"{name}: combine_rows = 3 was not exceeded")
            if isinstance(a, str) or isinstance(b, str):
                continue
            # combine over each handle (the expert outputs from each one's rows, which match
            # up to the counts: run_experts writes NaN past them)
            za = ep.combine(run_experts(ep, a[0]), a[1], shared=mine["shared"])
            zb = ep.combine(run_experts(ep, b[0]), b[1], shared=mine["shared"])
            if not torch.equal(za.view(torch.int16), zb.view(torch.int16)):
                bad.append(f"{name}: combined rows differ")
            # the CPU twin's unpack and finalize beside the wire (ep._stream_cpu) against the
            # same after it: the same dispatch and combine
            ep._stream_cpu = False
            c = _dispatch_both(ep, mine, sent)[0]
            zc = ep.combine(run_experts(ep, c[0]), c[1], shared=mine["shared"])
            ep._stream_cpu = True
            bad += [f"{name}: not streamed: {m}" for m in _differences(ep, mine, a, c)]
            if not torch.equal(za.view(torch.int16), zc.view(torch.int16)):
                bad.append(f"{name}: combined rows differ, streamed or not")
            # the partial combine beside the wire against the same after it
            pa = ep.combine(run_experts(ep, a[0]), a[1], shared=mine["shared"], partial=True)
            ep._stream_cpu = False
            pc = ep.combine(run_experts(ep, c[0]), c[1], shared=mine["shared"], partial=True)
            ep._stream_cpu = True
            if not torch.equal(pa.view(torch.int16), pc.view(torch.int16)):
                bad.append(f"{name}: partial combine differs, streamed or not")
    return bad


def _cases(W):
    out = [c[:8] + (None, False) for c in ep_cases(W)]  # (without pow2 weights)
    T, ns, H, K, E = 12, [11] * W, 128, 4, 4 * W
    if W > 1:
        # combine_rows below what the routing needs: refused before sending (the same
        # message), or, with the device-side checks on, pos past the block and counted
        for dev_checks in (False, True):
            out.append((T, ns, H, K, E, True, "low_latency", "contiguous", 3, dev_checks))
        out.append((T, ns, H, K, E, False, "low_latency", "round_robin", T * K, False))
    return out


def test_native_dispatch_equals_torch_path():
    for W in (1, 2, 3, 4):
        bad = [f"rank {r}: {m}" for r, v in enumerate(
            check(run_ranks(native_job, W, args=(_cases(W),), timeout_s=300))) for m in v]
        assert not bad, "\n".join(bad)
