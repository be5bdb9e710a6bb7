"""The CUDA kernels' struct arguments (protocol.h namespace ``kargs``), built in one place.

Each ``*_args`` function returns the u64 words of one struct, packed by
:func:`sparkccl.layout.pack_struct` at the field offsets protocol.h declares (and
``static_assert``s against the struct the kernels compile); the plane launches the words as
the kernel's one parameter, by value (``CudaDataPlane.launch_struct``; mode ce's programs
as their kernels' parameter words), and its launch plans record them so, a call's pointers
(:class:`~.launch_plan.CallPtr`, passed through unchanged) patched at their fields' byte
offsets (protocol.h says why by value). Every collective's kernel takes one; the small
utility kernels keep a few positional parameters (protocol.h says which). :class:`WaitBlocks`
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


def wait_params(plane, op: Op) -> tuple:
    """WAIT_PARAMS of the small positional kernels (mode ce's ``sccl_wait_piece``, after its
    piece and slice, and ``sccl_fail_guard``): the op's WaitParams block, then adv_entries,
    adv_gate, 0 (they never move the device state on: sccl_advance does)."""
    return plane.waits.block[op], 0, 0


def ring(plane) -> int:
    """This rank's publish ring (the control segment's, mapped for the device): the ``ring``
    field of every struct whose kernel hands pieces off."""
    return plane.ctl_dev + layout.RING_OFFSET


def publish_args(plane, src, src_stride: int, dst: int, dst_code: int, dst2, nchunks: int,
                 L: int, S: int, call: int, bpp: int) -> list:
    """``PublishArgs``: chunk j < nchunks of the input to block j (S bytes apart) of the
    send region, each piece handed to the proxy (ring entries of call word ``call``)."""
    return layout.pack_struct("PUB", dict(
        SRC=src, SRC_STRIDE=src_stride, DST=dst, DST_CODE=dst_code, DST_STRIDE=S, DST2=dst2,
        NCHUNKS=nchunks, L=L, S=S, RING=ring(plane),
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
        SEND_CODE=plane.send_code, OWN=own, RING=ring(plane),
        STATE=plane.state.data_ptr(), CALL=call, COUNTERS=plane.fin_counters.data_ptr()))


def finalize_direct_args(plane, rows: list, dtab: int, call: int, npub: int, own: int,
                         dst) -> list:
    """``FinalizeDirectArgs`` (GPU-direct): the rows along direct table ``dtab`` by blocks
    [0, npub), the rank-order sum into ``dst`` by the others; the kernel advances the
    device state (its publish blocks bump the finalize gate once per piece: npub)."""
    return layout.pack_struct("FD", dict(
        ROWS=rows, DTAB=dtab, RING=ring(plane), CALL=call,
        COUNTERS=plane.dcounters.data_ptr(), NPUB=npub, GATE=plane.fin_gate.data_ptr(),
        RECV=plane.rs_recv_dev, RECV_CODE=plane.recv_code, OWN=own, DST=dst,
        WP=plane.waits.block[Op.RS], ADV_ENTRIES=PIECES, ADV_GATE=npub))


def all_reduce_args(plane, src, dst, L: int, S: int, avg: bool, call: int, npub: int,
                    dtab: int, gate: int, ll: int = 0, ll_proxy: bool = False) -> list:
    """``AllReduceArgs`` (the one-shot all-reduce, :mod:`.allreduce_engine`): this rank's
    vector to the AG slot (GPU-direct along direct table ``dtab``, else the proxy path:
    ``dtab`` 0), the rank-order sum of the W vectors into ``dst``; ``gate``: the
    finalize's gate words where ``dst`` is ``src`` (0: not in place); ``ll``: the ranks' LL
    areas (the LL way; then ``npub`` and ``gate`` are not read), or 0; ``ll_proxy``: the LL
    lines go through the proxy (``ll`` gives this rank's own area only)."""
    return layout.pack_struct("AR", dict(
        SRC=src, DST=dst, L=L, S=S, AVG=int(avg), SLOT=plane.ag_dev, SLOT_CODE=plane.ag_code,
        DTAB=dtab, RING=ring(plane), CALL=call,
        COUNTERS=(plane.dcounters if dtab else plane.counters).data_ptr(), NPUB=npub,
        GATE=gate, WP=plane.waits.block[Op.AG], LL=ll, LL_PROXY=int(ll_proxy)))


def fused_all_reduce_args(plane, src, src_stride: int, dst, dst_stride: int, L: int, S: int,
                          avg: bool, rs_call: int, ag_call: int, npub: int, ag_counters: int,
                          dtabs: tuple = (0, 0)) -> list:
    """``FusedAllReduceArgs`` (the two-step all-reduce as one operation:
    :mod:`.allreduce_engine`): chunk j of ``src`` (0: already in RS send slot seq % 2) out as
    a reduce-scatter's, this rank's rank-order sum into ``dst`` (and, the proxy path, its AG
    block) and on as an all-gather's, the peers' AG blocks into ``dst`` (chunk i at
    ``i * dst_stride``). ``dtabs``: the RS and AG direct tables (GPU-direct), or (0, 0)."""
    return layout.pack_struct("FAR", dict(
        SRC=src, SRC_STRIDE=src_stride, DST=dst, DST_STRIDE=dst_stride, L=L, S=S,
        AVG=int(avg), SEND=plane.rs_send_dev, SEND_CODE=plane.send_code,
        RECV=plane.rs_recv_dev, RECV_CODE=plane.recv_code, AG=plane.ag_dev,
        AG_CODE=plane.ag_code, RING=ring(plane), RS_CALL=rs_call, AG_CALL=ag_call,
        COUNTERS=(plane.dcounters if dtabs[0] else plane.counters).data_ptr(),
        AG_COUNTERS=ag_counters, NPUB=npub, RS_DTAB=dtabs[0], AG_DTAB=dtabs[1],
        WP_RS=plane.waits.block[Op.RS], WP_AG=plane.waits.block[Op.AG]))


def wait_role_args(plane, op: Op, L: int, S: int, slot, slot_code: int, out, out_stride: int = 0,
                   own=0, own_code: int = 0, own_sys: int = 0, advance: tuple = (0, 0)) -> list:
    """``WaitRoleArgs``: the wait role alone (``sccl_ag_wait``, ``sccl_rs_wait_*``) or the
    GPU-direct kernels' (their ``wait`` field): the peers' data in ``slot`` (slotted by
    ``slot_code``), the result ``out``; reduce-scatter: this rank's own chunk (``own``...).
    ``advance``: (ring entries, gate bumps) where the kernel is the collective's last and
    moves the device state on itself (kernels/common.cuh last_block_advances), else (0, 0)
    and the plane's ``finish`` queues sccl_advance."""
    return layout.pack_struct("WR", dict(
        IN=slot, IN_CODE=slot_code, OWN=own, OWN_CODE=own_code, OWN_SYS=own_sys, OUT=out,
        OUT_STRIDE=out_stride, L=L, S=S, WP=plane.waits.block[op], ADV_ENTRIES=advance[0],
        ADV_GATE=advance[1]))


def direct_args(plane, wait: list, call: int, npub: int, src, src_code: int, src_stride: int,
                src_sys: int, dtab: int, own_dst=0, own_dst_code: int = 0, dst2=0) -> list:
    """``DirectArgs`` (``sccl_ag_direct``, ``sccl_rs_direct_*``): blocks [0, npub) write the
    input along direct table ``dtab`` into the peers' regions (and this rank's own block to
    ``own_dst`` / ``dst2``) and hand each piece off; the others run ``wait``
    (:func:`wait_role_args`)."""
    return layout.pack_struct("DX", dict(
        SRC=src, SRC_CODE=src_code, SRC_STRIDE=src_stride, SRC_SYS=src_sys, DTAB=dtab,
        OWN_DST=own_dst, OWN_DST_CODE=own_dst_code, DST2=dst2, RING=ring(plane), CALL=call,
        COUNTERS=plane.dcounters.data_ptr(), NPUB=npub, WAIT=wait))


def sum_unit_args(plane, unit: int, stage: int, own, own_sys: int, dst, L: int, S: int,
                  parts: int) -> list:
    """``SumUnitArgs`` (mode ce's ``sccl_rs_sum_unit_*``): the part of unit ``unit``'s piece
    that the int32 table ``parts`` gives its wait word, summed in rank order from ``stage``
    and ``own`` into ``dst``."""
    return layout.pack_struct("SU", dict(
        UNIT=unit, STAGE=stage, OWN=own, OWN_SYS=own_sys, DST=dst, L=L, S=S, RANK=plane.rank,
        WORLD=plane.world, PARTS=parts, MAXW=plane.maxw))
