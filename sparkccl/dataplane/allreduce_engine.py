"""The one-shot all-reduce of the CUDA data plane (the decode regime): one launch per call.

On the wire it is an all-gather of each rank's whole vector (op AG: the all-gather's
streams, relays, flag words and ring entries; only the entries' call word says all-reduce),
so nothing in the plans or the proxy changes; the kernel (``kernels/allreduce.cu``, ``sccl_allreduce_*``) publishes this
rank's vector (GPU-direct: straight into the peers' AG slots; the proxy path: into its own
block of the slot, its ring entries together behind one fence up to ONE_HANDOFF_SLICE, so the
proxy posts it in one go), waits for every peer's flags and sums the W
vectors where they landed, in rank order 0..W-1 in fp32, AVG divided once, rounded once,
straight into ``out``: no intermediate copy and no torch op, the same sum as the
reduce-scatter's (docs/PROTOCOL.md "All-reduce").

Its arguments are one struct, protocol.h ``kargs::AllReduceArgs`` (the wait role's constants
in it by pointer: the plane's AG ``WaitParams`` block, as every kernel with a wait role),
packed with the other kernels' structs by :func:`.kernel_args.all_reduce_args` (the header's
``AR_*`` offsets) and launched through the device seam's ``launch_struct``. Its ring entries carry
the call word of an all-reduce (op AG, the caller's dtype, ``KIND_ALL_REDUCE_SUM`` /
``_AVG``, the padding), so the peers' check (:mod:`.peer_check`) tells it from an
all-gather and a sum from an average. The plane's launch plans record it like any
launch (the call's pointers marked), so a shape's later calls replay it from native code
with no Python planning, and a CUDA graph captures the one launch (seq, slot and ring
index come from the device state).
"""
from __future__ import annotations

import torch

from .. import layout
from ..plan.geometry import PIECES, piece_bounds
from .engines import ONE_HANDOFF_SLICE, PUBLISH_THREADS, Engine
from .kernel_args import all_reduce_args, fused_all_reduce_args

THREADS = 256  # __launch_bounds__(256, 2), as the direct kernels
KERNELS = {torch.bfloat16: "sccl_allreduce_bf16", torch.float16: "sccl_allreduce_f16",
           torch.float32: "sccl_allreduce_f32"}
FUSED_KERNELS = {torch.bfloat16: "sccl_ar_fused_bf16", torch.float16: "sccl_ar_fused_f16",
                 torch.float32: "sccl_ar_fused_f32"}
COUNTER_SETS = layout.protocol_constants()["COUNTER_SETS"]


class OneShotEngine(Engine):
    """One launch of ``sccl_allreduce_*`` per all-reduce; GPU-direct when the plane gives a
    direct table for the slice, else the proxy sends (chosen in :mod:`.engine_choice`)."""

    def run(self, ts, stream, *, S: int, L: int, call: int, src, dst, dtype: torch.dtype,
            avg: bool, in_place: bool, table, ll=None) -> None:
        """``src`` / ``dst``: the call's pointers (launch_plan.CallPtr); ``call``: the ring
        entries' call word (peer_check.py); ``table``: the AG direct table (GPU-direct) or
        None (the proxy path); ``ll``: the ranks' LL areas (the LL way) or None."""
        p = self.plane
        if ll is not None:
            self._run_ll(stream, S=S, L=L, call=call, src=src, dst=dst, dtype=dtype, avg=avg,
                         table=table, ll=ll)
            p.poison_if_failed(stream, dst, 0, 1, L)
            p.finish(ts, stream, advanced=True)
            return
        direct = table is not None
        piece = piece_bounds(S, 0)[1]
        nb = self.sum_wait_blocks(S, THREADS, direct)
        if direct:
            npub = self.direct_blocks(piece * (p.world - 1))
        else:
            # (at most ONE_HANDOFF_SLICE: the whole slice, then one hand-off; allreduce.cu)
            npub = (self.publish_blocks(S) if S <= ONE_HANDOFF_SLICE
                    else PIECES * self.publish_blocks(piece))
        words = all_reduce_args(p, src, dst, L, S, avg, call, npub,
                                table.data_ptr() if direct else 0,
                                p.fin_gate.data_ptr() if in_place else 0)
        name, grid = KERNELS[dtype], npub + 1 + nb
        p.plans.plannable(direct=direct)  # one launch of constants and call pointers
        p.launch_struct(stream, name, grid, THREADS, words, early=True)
        if direct:
            p.direct_launches += 1
        p.poison_if_failed(stream, dst, 0, 1, L)
        p.finish(ts, stream, advanced=True)

    def _run_ll(self, stream, *, S, L, call, src, dst, dtype, avg, table, ll) -> None:
        """The LL way (kernels/allreduce.cu allreduce_ll): an 8-byte line per thread, each
        block's lines stored and then summed by its own threads, and one block more that
        hands the ring entries off (with ``table``'s flag words, where it is given) and
        advances the device state. GPU-direct, or through the proxy where the plane says so
        (``ll_proxy``: the lines into this rank's own LL block, the entries CHUNK_LL)."""
        p = self.plane
        direct = not p.ll_proxy
        nb = max(1, min(p.max_direct_wait_blocks, -(-S // (8 * THREADS))))  # (8 bytes a thread)
        words = all_reduce_args(p, src, dst, L, S, avg, call, 0,
                                0 if table is None or not direct else table.data_ptr(), 0,
                                ll.data_ptr(), ll_proxy=not direct)
        p.plans.plannable(direct=direct)
        p.launch_struct(stream, KERNELS[dtype], nb + 1, THREADS, words, early=True)
        p.direct_launches += direct
        p.ll_launches += 1


class TwoStepEngine(Engine):
    """The two-step all-reduce as one operation (``DataPlaneBase.all_reduce``): one launch of
    ``sccl_ar_fused_*`` per collective (``kernels/allreduce_fused.cu``). Its ring entries are
    the CPU twin's: 8 of op RS (the chunks), then 8 of op AG (the rank's rounded sum, piece
    by piece as each is summed), each with the all-reduce's call word, so peers and proxies
    cannot tell it from ``CpuDataPlane.all_reduce``. GPU-direct where the plane has both
    ops' direct tables for the slice (the kernel writes the peers' slots and flags itself,
    entries chunk -2, whatever ``SPARKCCL_DIRECT_MODE`` says: one launch, as "fused"); else
    the proxy sends (chunk -1), which peers cannot tell apart either."""

    def __init__(self, plane):
        super().__init__(plane)
        # The AG hand-offs' piece counters (its consumers'; the RS publish uses the plane's):
        # the last consumer block to finish a piece resets its counter for the next use.
        self.ag_counters = plane.gpu.to_device(torch.zeros(COUNTER_SETS * PIECES,
                                                           dtype=torch.int32))
        self.launches = 0  # planned here (a launch plan's replays are the plans' hits)

    def run(self, ts, stream, *, S: int, L: int, src, src_stride: int, dst, dst_stride: int,
            dtype: torch.dtype, avg: bool, rs_call: int, ag_call: int, tables) -> None:
        """``src`` / ``dst``: the call's pointers at the collective's offset (launch_plan
        .CallPtr; ``src`` None: a zero-copy input, already in the RS send slot); ``tables``:
        the RS and AG direct tables (GPU-direct), or None (the proxy path)."""
        p = self.plane
        others = (p.world - 1) * piece_bounds(S, 0)[1]  # the bytes one piece copies
        direct = tables is not None
        if direct:
            npub = self.direct_blocks(others)
        elif src is None:
            npub = 1  # (nothing to copy: one block hands the eight entries off at once)
        elif S <= ONE_HANDOFF_SLICE:
            npub = self.publish_blocks((p.world - 1) * S)
        else:
            npub = PIECES * self.publish_blocks(others)
        nb = self.sum_wait_blocks(S, PUBLISH_THREADS, direct)
        words = fused_all_reduce_args(p, 0 if src is None else src, src_stride, dst, dst_stride,
                                      L, S, avg, rs_call, ag_call, npub,
                                      self.ag_counters.data_ptr(),
                                      tuple(t.data_ptr() for t in tables) if direct else (0, 0))
        p.plans.plannable(2 * PIECES, direct=direct)  # one launch of constants and call pointers
        p.launch_struct(stream, FUSED_KERNELS[dtype], npub + 1 + nb, PUBLISH_THREADS, words)
        self.launches += 1
        p.direct_launches += direct
        p.poison_if_failed(stream, dst, dst_stride, p.world, L)
        p.finish(ts, stream, advanced=True)
