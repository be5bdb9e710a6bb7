"""The one-shot all-reduce of the CUDA data plane (the decode regime): one launch per call.

On the wire it is an all-gather of each rank's whole vector (op AG: the all-gather's
streams, relays, flag words and ring entries), so nothing in the plans, the proxy or the
peers changes; the kernel (``kernels/allreduce.cu``, ``sccl_allreduce_*``) publishes this
rank's vector (GPU-direct: straight into the peers' AG slots; the proxy path: into its own
block of the slot, its ring entries together behind one fence up to ONE_HANDOFF_SLICE, so the
proxy posts it in one go), waits for every peer's flags and sums the W
vectors where they landed, in rank order 0..W-1 in fp32, AVG divided once, rounded once,
straight into ``out``: no intermediate copy and no torch op, the same sum as the
reduce-scatter's (docs/PROTOCOL.md "All-reduce").

Its arguments are one struct, protocol.h ``AllReduceArgs``, whose field offsets (``AR_*``)
come through :mod:`sparkccl.layout`; the struct is packed here as u64 words and launched
through the device seam's ``launch_struct``. The plane's launch plans record it like any
launch (the call's pointers marked), so a shape's later calls replay it from native code
with no Python planning, and a CUDA graph captures the one launch (seq, slot and ring
index come from the device state).
"""
from __future__ import annotations

import torch

from .. import layout
from ..plan.geometry import PIECES, piece_bounds
from ..plan.model import Op
from .engines import Engine

_P = layout.protocol_constants()
ARGS_WORDS = _P["AR_ARGS_BYTES"] // 8
WAIT_WORDS = _P["AR_WAIT_WORDS"]
ONE_HANDOFF_SLICE = _P["ONE_HANDOFF_SLICE"]
THREADS = 256  # __launch_bounds__(256, 2), as the direct kernels
KERNELS = {torch.bfloat16: "sccl_allreduce_bf16", torch.float16: "sccl_allreduce_f16",
           torch.float32: "sccl_allreduce_f32"}


def _at(name: str) -> int:
    """Word index of field ``name`` (protocol.h AR_*)."""
    return _P[name] // 8


class OneShotEngine(Engine):
    """One launch of ``sccl_allreduce_*`` per all-reduce; GPU-direct when the plane gives a
    direct table for the slice, else the proxy sends (chosen in :mod:`.engine_choice`)."""

    def run(self, ts, stream, *, S: int, L: int, src, dst, dtype: torch.dtype, avg: bool,
            in_place: bool, table) -> None:
        """``src`` / ``dst``: the call's pointers (launch_plan.CallPtr); ``table``: the AG
        direct table (GPU-direct) or None (the proxy path)."""
        p = self.plane
        direct = table is not None
        piece = piece_bounds(S, 0)[1]
        # Consumers: a one-hand-off slice's sum reads every source across PCIe at once after
        # one wait, so one 16-byte unit per thread (each further round of a thread is
        # another read latency), within the plane's cap on spinning blocks (MAX_WAIT_BLOCKS:
        # ranks sharing a GPU need SMs for each other's publish blocks).
        nb = p.slice_wait_blocks(S)
        if S <= ONE_HANDOFF_SLICE:
            nb = max(nb, min(p.max_wait_blocks, -(-S // (16 * THREADS))))
        if direct:
            npub = p.direct_blocks(piece * (p.world - 1))
            nb = min(nb, p.max_direct_wait_blocks)
        else:
            # (at most ONE_HANDOFF_SLICE: the whole slice, then one hand-off; allreduce.cu)
            npub = (p.publish_blocks(S) if S <= ONE_HANDOFF_SLICE
                    else PIECES * p.publish_blocks(piece))
        words = [0] * ARGS_WORDS
        words[_at("AR_SRC")], words[_at("AR_DST")] = src, dst
        words[_at("AR_L")], words[_at("AR_S")], words[_at("AR_AVG")] = L, S, int(avg)
        words[_at("AR_SLOT")], words[_at("AR_SLOT_CODE")] = p.ag_dev, p.ag_code
        words[_at("AR_DTAB")] = table.data_ptr() if direct else 0
        words[_at("AR_RING")] = p.ctl_dev + layout.RING_OFFSET
        words[_at("AR_COUNTERS")] = (p.dcounters if direct else p.counters).data_ptr()
        words[_at("AR_NPUB")] = npub
        words[_at("AR_GATE")] = p.fin_gate.data_ptr() if in_place else 0
        flags = _at("AR_FLAGS")
        words[flags:flags + WAIT_WORDS] = [int(v) for v in p.wait_args(Op.AG)[:WAIT_WORDS]]
        name, grid = KERNELS[dtype], npub + 1 + nb
        p.plans.plannable(direct=direct)  # one launch of constants and call pointers
        p.plans.record(name, grid, THREADS, tuple(words))
        p.gpu.launch_struct(stream, name, grid, THREADS, words)
        if direct:
            p.direct_launches += 1
        p.poison_if_failed(stream, dst, 0, 1, L)
        p.finish(ts, stream, advanced=True)
