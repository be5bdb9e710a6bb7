"""The CPU data plane: the same steps as the GPU kernels, on CPU tensors.

One collective (one sequence number ``seq``, one slice of ``S`` bytes, S a multiple of 16):

1. for each piece c (``plan.geometry.piece_bounds(S, c)``): copy piece c of the input into
   this rank's send region (all-gather: own block of AG slot ``seq % 3``; reduce-scatter:
   chunk j's piece c into block j of RS send slot ``seq % 2``), then ``publish`` it; for
   all-gather also copy the own piece into the output;
2. for each piece c, for each source rank in rank order: wait until the source's flag
   words (``plan.waits[op][source]``) reach ``seq * 16 + c + 1``, then copy piece c of the
   source's block out (all-gather) or add it into an fp32 accumulator (reduce-scatter:
   sum in rank order 0..world-1 starting from rank 0's value, own chunk read from the own
   send slot), and round the sum once to the output dtype (round-to-nearest-even).

Slices whose size is not a multiple of 16 are padded: the bytes past the real length go
over the wire but are never copied out.

Call plans (the fast path): everything of a collective that does not change between
calls of the same (operation, slice length, slot, dtype) — the piece groups, the views of
this rank's slots, the flag words to wait on, the fp32 accumulator — is built by the first
call into a :class:`CallPlan` and reused; later calls only bring the sequence number and
the caller's tensors (whose bytes move with ``ctypes.memmove`` at computed offsets, no
tensor slicing). A new length or dtype is a new plan; re-attaching the reduce-scatter
buffers drops every plan (their views would point at the old buffers). ``plan_stats``
counts hits, misses and drops; ``cache_plans = False`` plans every call afresh (for A/B
measurements).

Every wait has the communicator's timeout (for the whole collective) and watches the
abort word; a timeout records a message naming rank, peer and connection in the abort
record (so the proxy tells the peers) and raises :class:`CollectiveError`.
"""
from __future__ import annotations

import ctypes
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .. import layout
from ..plan.geometry import (ALIGN, PIECES, flag_value, piece_bounds, round_up, sized_bytes,
                             waited_words)
from ..plan.model import Op, RankPlan
from .base import OP_NAMES, DataPlaneBase
from .peer_check import (ALL_GATHER, ALL_REDUCE_AVG, ALL_REDUCE_SUM, ALL_TO_ALL,
                         ALL_TO_ALL_SIZED, MOE_FINALIZE, REDUCE_SCATTER, call_word)

SMALL_SLICE = 64 << 10
"""Slices up to this size are copied and waited for as a whole (see ``groups``)."""

MAX_PLANS = 64
"""Call plans kept per data plane (least recently used dropped first)."""


@dataclass
class CallPlan:
    """What one (op, L, slot, dtype) collective does, independent of seq and of the
    caller's tensors. Offsets are in bytes."""
    S: int
    groups: list                   # (first piece, last piece, lo, hi) per group
    own: list                      # AG, per group: address of this rank's block + lo
    peers: list                    # AG, per group: [(source, address of its block + lo)]
    send_base: int = 0             # RS: data_ptr of the send slot
    parts: list = field(default_factory=list)  # RS: per group [(source, dtype view)]
    accs: list = field(default_factory=list)   # RS: per group, the fp32 accumulator [:n]
    rounded: object = None         # RS of one group: the sum rounded to dtype, then moved


def _sized_end(block: int, L: int) -> int:
    """A sized all-to-all's block at address ``block`` (L bytes): the bytes that carry data,
    from its first 8 (geometry.sized_bytes)."""
    return sized_bytes(ctypes.c_uint64.from_address(block).value, L) if L >= 8 else L


def _name(op: Op, call: int) -> str:
    """What a failure message calls the collective: its op, but an all-to-all by its name
    (it runs as a reduce-scatter on the wire)."""
    if call >> layout.CALL_KIND_SHIFT & 0xFF in (ALL_TO_ALL, ALL_TO_ALL_SIZED):
        return "all_to_all"
    return OP_NAMES[op]


class CpuDataPlane(DataPlaneBase):
    def __init__(self, native, *, plan: RankPlan, ctl_addr: int, flags_addr: int,
                 ag: torch.Tensor, ag_stride: int, timeout_s: float,
                 peer_calls: memoryview | None = None):
        super().__init__(native, plan=plan, ctl_addr=ctl_addr, flags_addr=flags_addr, ag=ag,
                         ag_stride=ag_stride, timeout_s=timeout_s, peer_calls=peer_calls)
        self.waits = {op: [list(w) for w in plan.waits[op]] for op in Op}
        self.cache_plans = True
        self.plan_stats = {"hits": 0, "misses": 0, "dropped": 0}
        self._plans: OrderedDict = OrderedDict()
        self._has_publish_range = hasattr(native, "publish_range")

    def attach_rs(self, send: torch.Tensor, send_stride: int, recv: torch.Tensor,
                  recv_stride: int) -> None:
        self.rs_send, self.rs_send_stride = send, send_stride
        self.rs_recv, self.rs_recv_stride = recv, recv_stride
        self.drop_plans()

    # ---- call plans ------------------------------------------------------------------
    def drop_plans(self) -> None:
        """Forget every call plan (the buffers they view changed)."""
        self.plan_stats["dropped"] += len(self._plans)
        self._plans.clear()

    def _call_plan(self, key: tuple, build):
        if not self.cache_plans:
            return build()
        p = self._plans.get(key)
        if p is not None:
            self.plan_stats["hits"] += 1
            self._plans.move_to_end(key)
            return p
        self.plan_stats["misses"] += 1
        p = self._plans[key] = build()
        if len(self._plans) > MAX_PLANS:
            self._plans.popitem(last=False)
            self.plan_stats["dropped"] += 1
        return p

    def _ag_plan(self, L: int, slot_index: int) -> CallPlan:
        S = round_up(L, ALIGN)
        base = slot_index * self.ag_stride
        slot = self.ag[base:base + self.world * S]
        groups = self.groups(S, L)
        me = self.rank
        return CallPlan(
            S=S, groups=groups,
            own=[slot.data_ptr() + me * S + a for _, _, a, b in groups],
            peers=[[(i, slot.data_ptr() + i * S + a) for i in range(self.world) if i != me]
                   for _, _, a, b in groups])

    def _rs_plan(self, L: int, slot_index: int, dtype: torch.dtype | None) -> CallPlan:
        """``dtype=None``: an all-to-all's plan (its blocks are copied, not summed): the
        groups, the send slot and every source's block address (``peers``), no accumulators."""
        S = round_up(L, ALIGN)
        sbase = slot_index * self.rs_send_stride
        rbase = slot_index * self.rs_recv_stride
        send = self.rs_send[sbase:sbase + self.world * S]
        recv = self.rs_recv[rbase:rbase + self.world * S]
        groups = self.groups(S, L)
        if dtype is None:
            me = self.rank
            return CallPlan(S=S, groups=groups, own=[], send_base=send.data_ptr(),
                            peers=[(i, (send if i == me else recv).data_ptr() + i * S)
                                   for i in range(self.world)])
        esize = torch.empty((), dtype=dtype).element_size()
        acc = torch.empty(max(b - a for _, _, a, b in groups) // esize, dtype=torch.float32)
        me = self.rank
        return CallPlan(
            S=S, groups=groups, own=[], peers=[], send_base=send.data_ptr(),
            parts=[[(i, (send if i == me else recv)[i * S + a:i * S + b].view(dtype))
                    for i in range(self.world)] for _, _, a, b in groups],
            accs=[acc[:(b - a) // esize] for _, _, a, b in groups],
            rounded=(torch.empty(L // esize, dtype=dtype) if len(groups) == 1 and L else None))

    def _publish_group(self, op: Op, seq: int, c0: int, c1: int, S: int, deadline: float,
                       call: int) -> None:
        if c1 > c0 and self._has_publish_range:
            self._publish(op, seq, c0, S, deadline, call, last=c1)
            return
        for c in range(c0, c1 + 1):
            self._publish(op, seq, c, S, deadline, call)

    # ---- steps ---------------------------------------------------------------------
    def _publish(self, op: Op, seq: int, piece: int, slice_bytes: int, deadline: float,
                 call: int, chunk: int = -1, granule: int = ALIGN, last: int = -1) -> None:
        """Publish piece ``piece`` (to ``last``); ``call``: the entry's call word
        (peer_check.call_word: the op byte is the native call's)."""
        remaining = max(deadline - time.monotonic(), 1e-3)
        call &= ~0xFF
        if last > piece:  # pieces piece..last, one native call
            code = self.nat.publish_range(self.ctl, int(op), seq, piece, last, chunk,
                                          slice_bytes, granule, remaining, call)
        else:
            code = self.nat.publish(self.ctl, int(op), seq, piece, chunk, slice_bytes,
                                    granule, remaining, call)
        if code == 0:
            return
        if self.nat.abort_code(self.ctl):
            self.raise_recorded(code, f"{_name(op, call)} seq {seq}")
        self.fail(f"rank {self.rank}: timed out after {self.timeout_s:g} s waiting for space in "
                  f"the publish ring for {_name(op, call)} seq {seq} piece {piece} (the proxy is "
                  "not consuming it)", layout.ABORT_TIMEOUT)

    def _wait(self, op: Op, seq: int, piece: int, source: int, deadline: float,
              slice_bytes: int, first: bool = False, call: int = 0) -> None:
        """Wait for piece ``piece`` of ``source``; ``first``: its first, so then compare
        this rank's call (``call``, its call word) with the source's (peer_check.py)
        before anything of it is used."""
        words = waited_words(self.waits[op][source], slice_bytes)
        if not words:
            return
        value = flag_value(seq, piece)
        remaining = max(deadline - time.monotonic(), 1e-3)
        code, idx = self.nat.wait_flags(self.ctl, self.flags, words, value, remaining)
        if code == 0:
            if first and self.peer_check is not None:
                self.peer_check.check(op, seq, source, slice_bytes, call)
            return
        if code != layout.ABORT_TIMEOUT or self.nat.abort_code(self.ctl):
            self.raise_recorded(code, f"{_name(op, call)} seq {seq} piece {piece} from rank {source}")
        if self.peer_check is not None:  # the source made another call (of another op: an
            self.peer_check.check(op, seq, source, slice_bytes, call,  # all-reduce's regimes)
                                  arrived=False)
        self.timed_out(f"{_name(op, call)} seq {seq}", piece,
                        words[idx if 0 <= idx < len(words) else 0])

    # ---- collectives ---------------------------------------------------------------
    @staticmethod
    def groups(S: int, L: int) -> list[tuple[int, int, int, int]]:
        """Pieces handled together: (first piece, last piece, data lo, data hi).

        Large slices go piece by piece (copy-out overlaps the network). Small ones are
        copied in one go and published as 8 entries at once, and each source is waited on
        for its last piece only: a flag word has one writer that writes pieces in order, so
        piece 7's value covers pieces 0-6 (the wire protocol is the same either way).
        """
        if S <= SMALL_SLICE:
            return [(0, PIECES - 1, 0, L)]
        out = []
        for c in range(PIECES):
            lo, hi = piece_bounds(S, c)
            out.append((c, c, min(lo, L), min(hi, L)))
        return out

    typed_io = True
    """The collectives take contiguous tensors of any dtype and count bytes (``src`` of
    all_gather, ``src`` and ``dst`` of reduce_scatter, offsets in bytes): the Communicator
    then passes its tensors as they are (no uint8 views made per call)."""

    def all_gather(self, seq: int, src: torch.Tensor, dst: torch.Tensor, dst_off: int,
                   dst_stride: int, dtype: torch.dtype | None = None,
                   part: tuple[int, int] | None = None) -> None:
        """Gather ``src`` (contiguous, L bytes) of every rank: rank i's bytes land at byte
        ``i * dst_stride + dst_off`` of ``dst`` (contiguous). ``dtype``, ``part``: what the
        peers compare (DataPlaneBase.all_gather)."""
        L = src.numel() * src.element_size()
        deadline = time.monotonic() + self.timeout_s
        slot_index = seq % 3
        lp = self._call_plan((Op.AG, L, slot_index), lambda: self._ag_plan(L, slot_index))
        S, me = lp.S, self.rank
        call = call_word(Op.AG, dtype or src.dtype, *(part or (ALL_GATHER, S - L)))
        move = ctypes.memmove
        sp = src.data_ptr()
        dp = dst.data_ptr() + dst_off
        for (c0, c1, a, b), own in zip(lp.groups, lp.own):
            if b > a:
                move(own, sp + a, b - a)
            self._publish_group(Op.AG, seq, c0, c1, S, deadline, call)
            if b > a:
                move(dp + me * dst_stride + a, sp + a, b - a)
        for g, ((c0, c1, a, b), peers) in enumerate(zip(lp.groups, lp.peers)):
            for i, block in peers:
                self._wait(Op.AG, seq, c1, i, deadline, S, first=g == 0, call=call)
                if b > a:
                    move(dp + i * dst_stride + a, block, b - a)

    def reduce_scatter(self, seq: int, src: torch.Tensor | None, src_off: int, src_stride: int,
                       L: int, dst: torch.Tensor, dst_off: int, dtype: torch.dtype,
                       part: tuple[int, int] | None = None) -> None:
        """Reduce-scatter chunks of L bytes: chunk j of ``src`` (contiguous, any dtype) is
        its bytes ``j * src_stride + src_off ... + L``; this rank's sum lands at bytes
        ``dst_off ... dst_off + L`` of ``dst``. ``src=None``: the chunks are already in the
        send slot (zero-copy input) at ``j * L``, L a multiple of 16."""
        deadline = time.monotonic() + self.timeout_s
        call = call_word(Op.RS, dtype, *(part or (REDUCE_SCATTER, round_up(L, ALIGN) - L)))
        lp = self._rs_send(seq, src, src_off, src_stride, L, dtype, deadline, call)
        self._rs_sum(lp, seq, dst, dst_off, dtype, deadline, call)

    def _rs_send(self, seq: int, src: torch.Tensor | None, src_off: int, src_stride: int,
                 L: int, dtype: torch.dtype | None, deadline: float, call: int,
                 fill=None, sized: bool = False) -> CallPlan:
        """Step 1 of a reduce-scatter: copy each piece of every chunk into RS send slot
        ``seq % 2`` (unless ``src`` is None: already there) and publish it. ``fill(slot, S,
        lo, hi)`` (an all-to-all whose blocks the caller writes, ``src`` None): writes bytes
        [lo, hi) of every chunk j at ``slot + j * S + lo`` instead, just before they go.
        ``sized`` (a sized all-to-all): chunk j's bytes past its length (its first 8 bytes,
        geometry.sized_bytes) are not copied; the proxy does not send them."""
        slot_index = seq % 2
        lp = self._call_plan((Op.RS, L, slot_index, dtype),
                               lambda: self._rs_plan(L, slot_index, dtype))
        S, W = lp.S, self.world
        move = ctypes.memmove
        sp = src.data_ptr() + src_off if src is not None else 0
        ends = ([_sized_end(sp + j * src_stride, L) for j in range(W)]
                if sized and src is not None else [L] * W)
        for c0, c1, a, b in lp.groups:
            if fill is not None and b > a:
                fill(lp.send_base, S, a, b)
            elif src is not None and b > a:
                for j in range(W):
                    if min(b, ends[j]) > a:
                        move(lp.send_base + j * S + a, sp + j * src_stride + a,
                             min(b, ends[j]) - a)
            self._publish_group(Op.RS, seq, c0, c1, S, deadline, call)
        return lp

    has_all_to_all = True
    streams_all_to_all = True

    def all_to_all(self, seq: int, src: torch.Tensor | None, src_off: int, src_stride: int,
                   L: int, dst: torch.Tensor, dst_off: int, dst_stride: int,
                   dtype: torch.dtype, fill=None, arrived=None, sized: bool = False) -> None:
        """(DataPlaneBase.all_to_all) The reduce-scatter's send step (``fill``: each group
        written straight into the send slot by the caller, then published), this rank's own
        block moved whole, then each group of every source's block moved as it arrives;
        ``arrived`` is told after each move. ``sized``: each block's bytes past its length
        (its first 8 bytes, read once they are here) are neither sent nor moved."""
        deadline = time.monotonic() + self.timeout_s
        call = call_word(Op.RS, dtype, ALL_TO_ALL_SIZED if sized else ALL_TO_ALL,
                         round_up(L, ALIGN) - L)
        fill = self._guarded(fill, "fill", seq)
        arrived = self._guarded(arrived, "arrived", seq)
        lp = self._rs_send(seq, src, src_off, src_stride, L, None, deadline, call, fill, sized)
        me, S, move = self.rank, lp.S, ctypes.memmove
        base = dst.data_ptr() + dst_off
        ends = [L] * self.world
        if L:  # the own block is in the send slot already: whole, before any wait
            if sized:
                ends[me] = _sized_end(lp.peers[me][1], L)
            move(base + me * dst_stride, lp.peers[me][1], ends[me])
            if arrived is not None:
                arrived(me, L)
        for g, (_, c1, a, b) in enumerate(lp.groups):
            for i, block in lp.peers:
                if i == me:
                    continue
                self._wait(Op.RS, seq, c1, i, deadline, S, first=g == 0, call=call)
                if sized and g == 0:  # (piece 0 is in: the block's first bytes)
                    ends[i] = _sized_end(block, L)
                if min(b, ends[i]) > a:
                    move(base + i * dst_stride + a, block + a, min(b, ends[i]) - a)
                if b > a and arrived is not None:
                    arrived(i, b)

    def _guarded(self, fn, name: str, seq: int):
        """``fn`` (a caller's fill / arrived, or None) such that an exception from it, half
        way through a collective, first aborts the communicator with its cause: the peers,
        waiting for the rest of this rank's blocks, fail now with it (their proxies see the
        abort) instead of at their timeout. The exception then goes on to the caller."""
        if fn is None:
            return None

        def guarded(*args):
            try:
                fn(*args)
            except BaseException as e:
                self.nat.set_abort(self.ctl, layout.ABORT_USER,
                                   f"rank {self.rank}: all_to_all seq {seq}: the caller's "
                                   f"{name} raised {type(e).__name__}: {e}")
                raise
        return guarded

    def _sum_group(self, lp: CallPlan, g: int, seq: int, deadline: float, call: int):
        """Wait for group ``g`` of this rank's chunk from every source and sum it in rank
        order in fp32: the plan's accumulator, or None for an empty group."""
        me, S = self.rank, lp.S
        c1, a, b = lp.groups[g][1:]
        acc = lp.accs[g]
        for i, part in lp.parts[g]:
            if i != me:
                self._wait(Op.RS, seq, c1, i, deadline, S, first=g == 0, call=call)
            if b == a:
                continue
            if i == 0:
                acc.copy_(part)
            else:
                acc.add_(part)
        return acc if b > a else None

    def _rs_sum(self, lp: CallPlan, seq: int, dst: torch.Tensor, dst_off: int,
                dtype: torch.dtype, deadline: float, call: int) -> None:
        """:meth:`_rs_finish` from a call plan: the same waits and the same fp32 sum in rank
        order, over the plan's views."""
        for g, (_, _, a, b) in enumerate(lp.groups):
            acc = self._sum_group(lp, g, seq, deadline, call)
            if acc is None:
                continue
            if lp.rounded is not None:  # one group: round into the plan's buffer, then move
                lp.rounded.copy_(acc)
                ctypes.memmove(dst.data_ptr() + dst_off, lp.rounded.data_ptr(), b - a)
            else:
                if dst.dtype != torch.uint8:
                    dst = dst.detach().reshape(-1).view(torch.uint8)
                dst[dst_off + a:dst_off + b].view(dtype).copy_(acc)

    fused_all_reduce = True

    def all_reduce(self, seq: int, src: torch.Tensor | None, src_off: int, src_stride: int,
                   L: int, dst: torch.Tensor, dst_off: int, dst_stride: int,
                   dtype: torch.dtype, avg: bool, pad: int = 0) -> None:
        """The reduce-scatter and the all-gather of an all-reduce as one operation under one
        ``seq`` (docs/PROTOCOL.md "All-reduce"; arguments: ``DataPlaneBase.all_reduce``):

        1. this rank's chunks go out as a reduce-scatter's (RS send slot ``seq % 2``, op RS);
        2. as soon as piece c of this rank's chunk came from every source, its rank-order
           fp32 sum (AVG: divided once), rounded once to ``dtype``, is written straight into
           this rank's block of AG slot ``seq % 3`` and published as all-gather piece c (op
           AG: the all-gather's streams, relays included, carry it on);
        3. the other ranks' reduced pieces are waited for and copied out, as an all-gather's.
        """
        if L % ALIGN:
            raise ValueError(f"all_reduce: chunk of {L} bytes is not a multiple of {ALIGN}")
        deadline = time.monotonic() + self.timeout_s
        kind = ALL_REDUCE_AVG if avg else ALL_REDUCE_SUM
        rs_call, ag_call = call_word(Op.RS, dtype, kind, pad), call_word(Op.AG, dtype, kind, pad)
        rs = self._rs_send(seq, src, src_off, src_stride, L, dtype, deadline, rs_call)
        ag_slot = seq % 3
        ag = self._call_plan((Op.AG, L, ag_slot), lambda: self._ag_plan(L, ag_slot))
        S, me = rs.S, self.rank
        own_block = ag_slot * self.ag_stride + me * S
        dp = dst.data_ptr() + dst_off
        move = ctypes.memmove
        divisor = torch.full((1,), float(self.world)) if avg else None
        for g, (c0, c1, a, b) in enumerate(rs.groups):
            acc = self._sum_group(rs, g, seq, deadline, rs_call)
            if acc is not None:
                if divisor is not None:
                    acc.div_(divisor)  # an IEEE fp32 division (allreduce.divide says why)
                self.ag[own_block + a:own_block + b].view(dtype).copy_(acc)  # the one rounding
            self._publish_group(Op.AG, seq, c0, c1, S, deadline, ag_call)
            if b > a:
                move(dp + me * dst_stride + a, ag.own[g], b - a)
        for (c0, c1, a, b), peers in zip(ag.groups, ag.peers):
            for i, block in peers:
                self._wait(Op.AG, seq, c1, i, deadline, S)
                if b > a:
                    move(dp + i * dst_stride + a, block, b - a)

    def _rs_finish(self, seq: int, S: int, L: int, dst: torch.Tensor, dst_off: int,
                   dtype: torch.dtype, deadline: float, call: int) -> None:
        """The reduce-scatter's second step: for each piece, wait for every source, sum this
        rank's chunk over ranks in rank order (own chunk from the own send slot block) in
        fp32 and round once into ``dst[dst_off:dst_off + L]``."""
        rbase = (seq % 2) * self.rs_recv_stride
        sbase = (seq % 2) * self.rs_send_stride
        send = self.rs_send[sbase:sbase + self.world * S]
        recv = self.rs_recv[rbase:rbase + self.world * S]
        me, W = self.rank, self.world
        groups = self.groups(S, L)
        esize = torch.empty((), dtype=dtype).element_size()
        acc = torch.empty(max(b - a for _, _, a, b in groups) // esize, dtype=torch.float32)
        for g, (c0, c1, a, b) in enumerate(groups):
            n = (b - a) // esize
            for i in range(W):
                if i != me:
                    self._wait(Op.RS, seq, c1, i, deadline, S, first=g == 0, call=call)
                if n == 0:
                    continue
                part = (send if i == me else recv)[i * S + a:i * S + b].view(dtype)
                if i == 0:
                    acc[:n].copy_(part)
                else:
                    acc[:n].add_(part)
            if n:
                dst[dst_off + a:dst_off + b].view(dtype).copy_(acc[:n])

    # ---- MoE finalize + reduce-scatter (SPEC §6) --------------------------------------
    fin_order = None
    """Test hook: ``"reverse"`` publishes the (piece, destination) items in reverse order
    (the proxy must still send each destination's pieces in piece order)."""

    def finalize_items(self) -> list[tuple[int, int]]:
        """(row piece, destination) in compute order: piece-major, peers in mesh order
        (rank+1, rank+2, ...); this rank's own chunk is not sent and comes after."""
        W, me = self.world, self.rank
        items = [(c, (me + 1 + k) % W) for c in range(PIECES) for k in range(W - 1)]
        if self.fin_order == "reverse":
            items.reverse()
        return items

    def moe_finalize_reduce_scatter(self, seq: int, f, row_lo: int, rows: int,
                                    dst: torch.Tensor, dst_off: int) -> None:
        """One finalize collective (``f``: :class:`sparkccl.finalize.FinalizeInputs`): rows
        ``[row_lo, row_lo + rows)`` of every destination's chunk of ``f.rows_per_rank`` rows
        are computed into RS send slot ``seq % 2`` (chunk j at ``j * S``, S = ``rows``
        rounded up to a multiple of 8, times 2H: see :func:`fin_slice`) and published per
        (row piece, destination) with granule = one row; then this rank's rows are summed
        over ranks as in :meth:`reduce_scatter` into ``dst[dst_off : dst_off + rows * 2H]``
        (bf16 bytes)."""
        RB = 2 * f.H
        S, L = fin_slice(rows, RB)
        call = call_word(Op.RS, torch.bfloat16, MOE_FINALIZE, S - L)
        deadline = time.monotonic() + self.timeout_s
        sbase = (seq % 2) * self.rs_send_stride
        send = self.rs_send[sbase:sbase + self.world * S]
        base = send.data_ptr()

        def compute(j: int, lo: int, hi: int) -> None:
            e = min(hi, L)  # rows past `rows` are padding: zero
            if e > lo:
                self.nat.finalize_rows(*f.native_args(), j * f.rows_per_rank + row_lo + lo // RB,
                                       (e - lo) // RB, base + j * S + lo)
            if hi > max(lo, L):
                send[j * S + max(lo, L):j * S + hi].zero_()

        for c, j in self.finalize_items():
            lo, hi = piece_bounds(S, c, RB)
            compute(j, lo, hi)
            self._publish(Op.RS, seq, c, S, deadline, call, chunk=j, granule=RB)
        compute(self.rank, 0, L)
        self._rs_finish(seq, S, L, dst, dst_off, torch.bfloat16, deadline, call)


def fin_slice(rows: int, row_bytes: int) -> tuple[int, int]:
    """(S, L) of a finalize collective of ``rows`` rows per destination: the slice S holds
    ``rows`` rounded up to a multiple of 8 (zero rows at the end, never copied out), so that
    its row pieces (granule = one row) are exactly the 16-byte-granule pieces of S that the
    waits and the reduction use; L = rows * row_bytes is what lands in the result."""
    return round_up(rows, PIECES) * row_bytes, rows * row_bytes
