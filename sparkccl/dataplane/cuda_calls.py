"""Each CUDA collective's call: its call word, slots and pointers (call pointers marked for
the launch plan, :class:`~.launch_plan.CallPtr`; the host's slot views for mode "ce",
:class:`~.launch_plan.Slotted`), and the engine the plane's table chooses for it
(:mod:`.engine_choice`), handed its arguments: the proxy path's methods, or a
:class:`~.engines.DirectCall` for the GPU-direct engines.

:class:`~.cuda.CudaDataPlane`'s collective methods check the call, issue it from its launch
plan when there is one, and otherwise record these functions' launches (the planning
path). They use the plane's public state and operations only (``begin`` checks and counts
the collective).
"""
from __future__ import annotations

import torch

from ..plan.geometry import ALIGN, PIECES, piece_bounds, round_up
from ..plan.model import Op
from .cpu import fin_slice
from .engines import (A2A_DIRECT_PUBLISH_BYTES_PER_BLOCK, A2A_DIRECT_WAIT_BYTES_PER_BLOCK,
                      PUBLISH_BYTES_PER_BLOCK, RS_WAIT, WAIT_BYTES_PER_BLOCK, DirectCall)
from .kernel_args import fin_rows_args
from .launch_plan import CallPtr, Slotted
from .peer_check import (ALL_GATHER, ALL_REDUCE_AVG, ALL_REDUCE_SUM, ALL_TO_ALL,
                         ALL_TO_ALL_SIZED, MOE_FINALIZE, REDUCE_SCATTER, call_word)

RS_DIRECT = {torch.bfloat16: "sccl_rs_direct_bf16", torch.float16: "sccl_rs_direct_f16",
             torch.float32: "sccl_rs_direct_f32"}
RS_SUM_UNIT = {torch.bfloat16: "sccl_rs_sum_unit_bf16", torch.float16: "sccl_rs_sum_unit_f16",
               torch.float32: "sccl_rs_sum_unit_f32"}


def _start(plane, op: Op, seq: int, L: int, dtype: torch.dtype, part, kind: int,
           zero_copy: str | None, what: str | None = None) -> tuple:
    """What an all-gather's and a reduce-scatter's call do first: (S, call word, first ring
    index, torch stream, cuda.core stream, direct table or None, engine). The call word says
    ``part`` (kind, zero bytes) where the call is a step of an all-reduce (base.py
    all_gather), else ``kind`` and this call's padding; plane.begin checks and counts the call
    (``zero_copy``: the feature that needs the host's slot, see there; ``what``: the name in
    messages); the engine is the plane's choice for the slice."""
    S = round_up(L, ALIGN)
    call = call_word(op, dtype, *(part or (kind, S - L)))
    first = plane.begin(op, seq, S, call, zero_copy=zero_copy, what=what)
    ts, stream = plane.gpu.current_stream()
    dtab = plane.direct_table(op, S)
    return S, call, first, ts, stream, dtab, plane.engines.choose(op, S, dtab)


def all_gather(plane, seq: int, src: torch.Tensor, dst: torch.Tensor | None, dst_off: int,
                dst_stride: int, L: int, dtype: torch.dtype, part) -> None:
    S, call, first, ts, stream, dtab, engine = _start(
        plane, Op.AG, seq, L, dtype, part, ALL_GATHER,
        "a zero-copy result" if dst is None else None)
    slot0, code = plane.ag_dev, plane.ag_code
    slot = Slotted(slot0, 3, plane.ag_stride, seq)  # (the host's view: zero-copy and mode ce)
    me = plane.rank
    src_p = CallPtr(src.data_ptr(), 0)
    dst_ptr = 0 if dst is None else CallPtr(dst.data_ptr() + dst_off, 1)
    res_me = 0 if dst is None else dst_ptr + me * dst_stride
    out = (slot, S, plane.world, L) if dst is None else (dst_ptr, dst_stride, plane.world, L)
    piece = piece_bounds(S, 0)[1]
    if not engine.direct:
        plane.engines.proxy.all_gather(ts, stream, S, L, call, src_p, dst_ptr, dst_stride,
                                      res_me, out, zero_copy=dst is None)
        return
    # GPU-direct: this rank's publish streams run on the GPU
    nb = 1 if dst is None else min(engine.slice_wait_blocks(S), plane.max_direct_wait_blocks)
    # The own block of the slot is only written when the result stays there (zero-copy):
    # relays forward other origins' blocks, and no proxy reads it.
    own_dst = slot + me * S if dst is None else 0
    engine.run(DirectCall(
        Op.AG, seq, ts, stream, S=S, L=L, call=call, first=first, kernel="sccl_ag_direct",
        publish=dict(src=src_p, src_code=0, src_stride=0, src_sys=0, dtab=dtab.data_ptr(),
                     own_dst=slot0 + me * S if dst is None else 0,
                     own_dst_code=code if dst is None else 0, dst2=res_me),
        consume=dict(slot=slot0, slot_code=code, out=dst_ptr, out_stride=dst_stride),
        wait_kernel="sccl_ag_wait", nb=nb, npub=engine.direct_blocks(piece * (plane.world - 1)),
        ce_src=(src_p, 0), own=[(d, src_p, L) for d in (own_dst, res_me) if d],
        ce_consume=(slot, dst_ptr, dst_stride), output=out))


def reduce_scatter(plane, seq: int, src, src_p: int, src_stride: int, L: int, dst_p: int,
                    dtype: torch.dtype, part, dst_stride: int | None = None,
                    sized: bool = False) -> None:
    """``dst_stride`` not None: an all-to-all (:func:`all_to_all`; ``sized``: its call word
    says KIND_ALL_TO_ALL_SIZED, by which the kernels and the proxy cut each chunk)."""
    a2a = dst_stride is not None
    kind = (ALL_TO_ALL_SIZED if sized else ALL_TO_ALL) if a2a else REDUCE_SCATTER
    S, call, first, ts, stream, dtab, engine = _start(
        plane, Op.RS, seq, L, dtype, part, kind,
        "a zero-copy input" if src is None else None, "all_to_all" if a2a else None)
    W, me = plane.world, plane.rank
    send0, recv0 = plane.rs_send_dev, plane.rs_recv_dev
    scode, rcode = plane.send_code, plane.recv_code
    send = Slotted(send0, 2, plane.rs_send_stride, seq)  # (the host's view: mode ce)
    recv = Slotted(recv0, 2, plane.rs_recv_stride, seq)
    dst_ptr = CallPtr(dst_p, 1)
    piece = piece_bounds(S, 0)[1]
    if src is not None:
        base = CallPtr(src_p, 0)
        own, own_code, own_sys, own_host = base + me * src_stride, 0, 0, base + me * src_stride
    else:
        base = None
        own, own_code, own_sys, own_host = send0 + me * S, scode, 1, send + me * S
    if not engine.direct:
        plane.engines.proxy.reduce_scatter(ts, stream, S, L, call, base, src_stride, own,
                                          own_code, own_sys, dst_ptr, None if a2a else dtype,
                                          dst_stride or 0)
        return
    # GPU-direct: chunks straight to the peers
    sbase, scode_d, sstride, ssys = ((base, 0, src_stride, 0) if src is not None
                                     else (send0, scode, S, 1))
    pub_bytes, wait_bytes = PUBLISH_BYTES_PER_BLOCK, WAIT_BYTES_PER_BLOCK
    if a2a:  # the all-gather's copy-out and its kernels (kernels/wait.cu ag_wait), no sums
        kernel, wait_kernel, sum_kernel = "sccl_ag_direct", "sccl_ag_wait", None
        pub_bytes, wait_bytes = A2A_DIRECT_PUBLISH_BYTES_PER_BLOCK, A2A_DIRECT_WAIT_BYTES_PER_BLOCK
        own_copies = [(dst_ptr + me * dst_stride, own_host, L)]  # (mode ce's)
        ce_consume, output = (recv, dst_ptr, dst_stride), (dst_ptr, dst_stride, W, L)
    else:
        kernel, wait_kernel, sum_kernel = RS_DIRECT[dtype], RS_WAIT[dtype], RS_SUM_UNIT[dtype]
        own_copies, ce_consume = [], (recv, own_host, own_sys, dst_ptr)
        output = (dst_ptr, 0, 1, L)
    engine.run(DirectCall(
        Op.RS, seq, ts, stream, S=S, L=L, call=call, first=first, kernel=kernel,
        publish=dict(src=sbase, src_code=scode_d, src_stride=sstride, src_sys=ssys,
                     dtab=dtab.data_ptr()),
        consume=dict(slot=recv0, slot_code=rcode, out=dst_ptr, out_stride=dst_stride or 0,
                     own=own, own_code=own_code, own_sys=own_sys),
        wait_kernel=wait_kernel, nb=min(engine.slice_wait_blocks(S, wait_bytes),
                                        plane.max_direct_wait_blocks),
        npub=engine.direct_blocks(piece * (W - 1), pub_bytes),
        # A zero-copy input already lies in pinned memory: no copy engine for it.
        ce_src=(base, src_stride) if src is not None else None, own=own_copies,
        sum_kernel=sum_kernel, ce_consume=ce_consume, output=output))


def all_to_all(plane, seq: int, src: torch.Tensor, src_p: int, src_stride: int, L: int,
               dst_p: int, dst_stride: int, dtype: torch.dtype, sized: bool = False) -> None:
    """The all-to-all (docs/PROTOCOL.md "All-to-all"): a reduce-scatter on the wire (its
    call word's kind ALL_TO_ALL), on whichever engine the plane picks for the slice, like
    the reduce-scatter's (the peers cannot tell them apart); the receiver copies source
    i's chunk to ``dst_p + i * dst_stride`` (this rank's from its input chunk) where the
    reduce-scatter sums: the all-gather's copy-out on the reduce-scatter's tables."""
    reduce_scatter(plane, seq, src, src_p, src_stride, L, dst_p, dtype, None, dst_stride, sized)


def all_reduce_one_shot(plane, seq: int, src_p: int, dst_p: int, L: int, dtype: torch.dtype,
                        avg: bool, pad: int, in_place: bool) -> None:
    """The one-shot all-reduce's one launch (:mod:`.allreduce_engine`): an AG on the wire,
    whose entries' call word says all-reduce (sum or avg) and the caller's padding."""
    S = round_up(L, ALIGN)
    call = call_word(Op.AG, dtype, ALL_REDUCE_AVG if avg else ALL_REDUCE_SUM, pad)
    plane.begin(Op.AG, seq, S, call, what="all_reduce")
    ts, stream = plane.gpu.current_stream()
    table = plane.engines.one_shot_table(plane.direct_table(Op.AG, S))
    plane.engines.one_shot.run(ts, stream, S=S, L=L, call=call, src=CallPtr(src_p, 0),
                               dst=CallPtr(dst_p, 1), dtype=dtype, avg=avg, in_place=in_place,
                               table=table, ll=plane.ll_table if plane.ll_for(L) else None)


def all_reduce_fused(plane, seq: int, src_p: int | None, src_stride: int, L: int, dst_p: int,
                     dst_stride: int, dtype: torch.dtype, avg: bool, pad: int) -> None:
    """The two-step all-reduce's one launch (:mod:`.allreduce_engine` TwoStepEngine;
    GPU-direct where the plane has both ops' direct tables for the slice): ``src_p`` None for
    a zero-copy input. Its RS and AG entries carry the CPU twin's call
    words (op RS / AG, the caller's dtype, the all-reduce's kind and ``pad``)."""
    if dtype not in RS_WAIT or L % ALIGN or plane.rs_send is None:
        raise ValueError(f"all_reduce: {dtype} chunks of {L} bytes: needs bf16 / fp16 / fp32 "
                         "chunks of a multiple of 16 bytes, and attach_rs() called")
    kind = ALL_REDUCE_AVG if avg else ALL_REDUCE_SUM
    rs_call, ag_call = call_word(Op.RS, dtype, kind, pad), call_word(Op.AG, dtype, kind, pad)
    plane.begin(Op.RS, seq, L, rs_call, entries=2 * PIECES, what="all_reduce",
                zero_copy="a zero-copy input" if src_p is None else None)
    ts, stream = plane.gpu.current_stream()
    tables = plane.direct_table(Op.RS, L), plane.direct_table(Op.AG, L)
    plane.engines.two_step.run(
        ts, stream, S=L, L=L, src=None if src_p is None else CallPtr(src_p, 0),
        src_stride=src_stride, dst=CallPtr(dst_p, 1), dst_stride=dst_stride, dtype=dtype,
        avg=avg, rs_call=rs_call, ag_call=ag_call,
        tables=None if any(t is None for t in tables) else tables)


def finalize(plane, seq: int, f, row_lo: int, rows: int, ptrs: tuple) -> None:
    """ptrs: (y, scales or 0, pos, weights, shared, this rank's result)."""
    S, L = fin_slice(rows, 2 * f.H)
    dtab = plane.direct_table(Op.RS, S)
    engine = plane.engines.choose(Op.RS, S, dtab, finalize=True)
    # The proxy path publishes per (row piece, destination); GPU-direct per piece.
    entries = PIECES if engine.direct else PIECES * (plane.world - 1)
    call = call_word(Op.RS, torch.bfloat16, MOE_FINALIZE, S - L)
    plane.begin(Op.RS, seq, S, call, entries=entries)
    ts, stream = plane.gpu.current_stream()
    own = plane.scratch("finalize own", L).data_ptr()
    rows_args = fin_rows_args(plane, f, row_lo, rows, S, ptrs)
    if engine.direct:
        engine.finalize(ts, stream, rows_args, 2 * f.H, S, L, call, ptrs[5], own, dtab)
    else:
        engine.finalize(ts, stream, rows_args, 2 * f.H, S, L, call, ptrs[5], own, entries)


def check_finalize_inputs(plane) -> None:
    """Raise ``ValueError`` if a finalize kernel met a ``pos`` outside ``[0, R)`` (its term
    was NaN; nothing was read out of bounds): the plane's ``fin_bad`` record, cleared."""
    bad = plane.fin_bad.cpu().tolist()
    if bad[0]:
        plane.fin_bad.zero_()
        t, k, p = bad[1], bad[2], bad[3]
        raise ValueError(f"rank {plane.rank}: moe_finalize_reduce_scatter: pos for token {t}, "
                         f"k {k} was {p}, not a row of y (0 <= pos < R); {bad[0]} such terms "
                         "were NaN in the result")
