"""The CUDA kernels' struct arguments (protocol.h namespace ``kargs``), built in one place.

Each ``*_args`` function returns the u64 words of one struct, packed by
:func:`sparkccl.layout.pack_struct` at the field offsets protocol.h declares (and
``static_assert``s against the struct the kernels compile); the plane launches the words as
the kernel's one parameter, by value (``CudaDataPlane.launch_struct``), and its launch plans
record them so, a call's pointers (:class:`~.launch_plan.CallPtr`, passed through unchanged)
patched at their fields' byte offsets (protocol.h says why by value). :class:`WaitBlocks`
holds the other kind: the wait role's constants, one ``WaitParams`` block per op in device
memory, written once, which every kernel with a wait role takes a pointer to.
"""
from __future__ import annotations

import torch

from .. import layout
from ..plan.geometry import PIECES
from ..plan.model import Op
from ..plan.waits import max_wait_words, wait_parts, wait_table


class WaitBlocks:
    """The wait kernels' tables (flag words per (op, source, k), and the part of a piece each
    word carries: :mod:`sparkccl.plan.waits`) and a ``WaitParams`` block per op pointing at
    them, in device memory; ``block[op]`` is its device address. Needs the plane's
    ``plan``, ``gpu``, ``flags_dev``, ``ctl_dev``, ``state``, ``rank``, ``world`` and
    ``timeout_ns``."""

    def __init__(self, plane):
        plan, to_device = plane.plan, plane.gpu.to_device
        self.maxw = max_wait_words(plan)
        self.table = to_device(torch.tensor(wait_table(plan, self.maxw), dtype=torch.int32))
        self.parts = to_device(torch.tensor(wait_parts(plan, self.maxw), dtype=torch.int32))
        blocks = [layout.pack_struct("WP", dict(
            FLAGS=plane.flags_dev, ABORT_W=plane.ctl_dev + layout.CTL_ABORT,
            STATUS=plane.ctl_dev + layout.CTL_GPU_STATUS, WAITS=self.table[int(op)].data_ptr(),
            PARTS=self.parts[int(op)].data_ptr(), MAXW=self.maxw, STATE=plane.state.data_ptr(),
            RANK=plane.rank, WORLD=plane.world, TIMEOUT_NS=plane.timeout_ns)) for op in Op]
        self.blocks = to_device(torch.tensor(blocks, dtype=torch.int64))
        self.block = {op: self.blocks[int(op)].data_ptr() for op in Op}


def publish_args(plane, src, src_stride: int, dst: int, dst_code: int, dst2, nchunks: int,
                 L: int, S: int, call: int, bpp: int) -> list:
    """``PublishArgs``: chunk j < nchunks of the input to block j (S bytes apart) of the
    send region, each piece handed to the proxy (ring entries of call word ``call``)."""
    return layout.pack_struct("PUB", dict(
        SRC=src, SRC_STRIDE=src_stride, DST=dst, DST_CODE=dst_code, DST_STRIDE=S, DST2=dst2,
        NCHUNKS=nchunks, L=L, S=S, RING=plane.ctl_dev + layout.RING_OFFSET,
        STATE=plane.state.data_ptr(), CALL=call, COUNTERS=plane.counters.data_ptr(), BPP=bpp))


def proxy_args(plane, op: Op, pub: list, src: int, src_code: int, out, out_stride: int = 0,
               own=0, own_code: int = 0, own_sys: int = 0) -> list:
    """``ProxyArgs``: the publish role's (``pub``), the consume side's, the wait role's;
    the kernel is the collective's last and advances the device state itself."""
    return layout.pack_struct("PX", dict(
        PUB=pub, IN=src, IN_CODE=src_code, OWN=own, OWN_CODE=own_code, OWN_SYS=own_sys,
        OUT=out, OUT_STRIDE=out_stride, WP=plane.waits.block[op], ADV_ENTRIES=PIECES, ADV_GATE=0))


def fin_rows_args(plane, f, row_lo: int, rows: int, S: int, ptrs: tuple) -> list:
    """``FinRowsArgs`` of a finalize (both engines' kernels take it first): ``f`` a
    :class:`sparkccl.finalize.FinalizeInputs`, ``ptrs`` the call's (y, scales or 0, pos,
    weights, shared, ...)."""
    y, scales, pos, weights, shared = ptrs[:5]
    return layout.pack_struct("FR", dict(
        Y=y, SCALES=scales, POS=pos, WTS=weights, SHARED=shared, BAD=plane.fin_bad.data_ptr(),
        T=f.num_tokens, TOPK=f.topk, H=f.H, R=f.R, FP8=int(bool(f.fp8)), RR=f.rows_per_rank,
        ROW_LO=row_lo, ROWS=rows, ROWS_PAD=S // (2 * f.H)))


def finalize_args(plane, rows: list, own: int, call: int) -> list:
    """``FinalizeArgs`` (the proxy path): the rows into the send slot, the own chunk to
    ``own``, each (row piece, destination) handed to the proxy."""
    return layout.pack_struct("FN", dict(
        ROWS=rows, WORLD=plane.world, RANK=plane.rank, SEND=plane.rs_send_dev,
        SEND_CODE=plane.send_code, OWN=own, RING=plane.ctl_dev + layout.RING_OFFSET,
        STATE=plane.state.data_ptr(), CALL=call, COUNTERS=plane.fin_counters.data_ptr()))


def finalize_direct_args(plane, rows: list, dtab: int, call: int, npub: int, own: int,
                         dst) -> list:
    """``FinalizeDirectArgs`` (GPU-direct): the rows along direct table ``dtab`` by blocks
    [0, npub), the rank-order sum into ``dst`` by the others; the kernel advances the
    device state (its publish blocks bump the finalize gate once per piece: npub)."""
    return layout.pack_struct("FD", dict(
        ROWS=rows, DTAB=dtab, RING=plane.ctl_dev + layout.RING_OFFSET, CALL=call,
        COUNTERS=plane.dcounters.data_ptr(), NPUB=npub, GATE=plane.fin_gate.data_ptr(),
        RECV=plane.rs_recv_dev, RECV_CODE=plane.recv_code, OWN=own, DST=dst,
        WP=plane.waits.block[Op.RS], ADV_ENTRIES=PIECES, ADV_GATE=npub))


def all_reduce_args(plane, src, dst, L: int, S: int, avg: bool, call: int, npub: int,
                    dtab: int, gate: int) -> list:
    """``AllReduceArgs`` (the one-shot all-reduce, :mod:`.allreduce_engine`): this rank's
    vector to the AG slot (GPU-direct along direct table ``dtab``, else the proxy path:
    ``dtab`` 0), the rank-order sum of the W vectors into ``dst``; ``gate``: the
    finalize's gate words where ``dst`` is ``src`` (0: not in place)."""
    return layout.pack_struct("AR", dict(
        SRC=src, DST=dst, L=L, S=S, AVG=int(avg), SLOT=plane.ag_dev, SLOT_CODE=plane.ag_code,
        DTAB=dtab, RING=plane.ctl_dev + layout.RING_OFFSET, CALL=call,
        COUNTERS=(plane.dcounters if dtab else plane.counters).data_ptr(), NPUB=npub,
        GATE=gate, WP=plane.waits.block[Op.AG]))
