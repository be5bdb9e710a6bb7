"""The CUDA data plane's engines: how one collective is launched once the plane
(:class:`~.cuda.CudaDataPlane`) has checked it, counted it and worked out its pointers.

* :class:`ProxyPathEngine`: the proxy sends (no peer mapped here, or GPU-direct off): one
  kernel per collective with publish blocks and wait blocks (``kernels/proxy_path.cu``);
* :class:`FusedEngine`: GPU-direct, one kernel whose publish role writes straight into the
  peers' mapped regions while its wait role consumes theirs;
* :class:`SplitEngine`: GPU-direct, the two roles on two streams;
* :class:`~.ce_engine.CeEngine`: GPU-direct with the copy engines moving the bytes.

The GPU-direct engines' names (``SPARKCCL_DIRECT_MODE``) are declared once, in
:data:`sparkccl.config.DIRECT_ENGINES`; :class:`~.engine_choice.Engines` builds one object
of each per data plane and is the one place that maps (collective, size, settings, capture
state) to an engine.

The contract with the plane: an engine reads the plane's public state (device pointers of
the regions and tables, the settings, ``phases``; the grid caps ``max_*_blocks``, within
which :class:`Engine` sizes each launch's grid) and calls its public operations
(``launch_struct`` with :mod:`.kernel_args`' structs, ``launch``, ``poison_if_failed``,
``finish``, ``fork`` / ``join``, ``scratch``, ``issued``; for mode "ce"'s stream programs
the device seam ``plane.gpu``, :mod:`.device`); it owns whatever state is its own (mode
"ce": its programs, streams, events and its host view of the publish ring). ``phases`` is
a benchmark option of the plane (benchmarks/kernel_roofline.py times the publish and the
wait roles one at a time); the proxy path reads it in one place
(:meth:`ProxyPathEngine.issue`), the choice of engine in another.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import layout
from ..plan.geometry import PIECES, piece_bounds
from ..plan.model import Op
from .kernel_args import (direct_args, finalize_args, finalize_direct_args, proxy_args,
                          publish_args, wait_role_args)

WAIT_THREADS = 256
DIRECT_THREADS = 256  # sccl_*_direct: both roles (__launch_bounds__(256, 2))
PUBLISH_THREADS = 512
FIN_THREADS = 512
# Grids: bytes of one launch's work per block (the caps are the plane's settings,
# ``max_publish_blocks`` ...: tunable, and launch plans are dropped when they change).
PUBLISH_BYTES_PER_BLOCK = 64 << 10
WAIT_BYTES_PER_BLOCK = 32 << 10
# A GPU-direct all-to-all (kernels sccl_ag_direct): a quarter of those. Its slices are mid-sized
# (expert parallelism's low-latency dispatch: 0.9-2.8 MiB, 2-4 publish blocks by the above),
# and 16 KiB / 8 KiB made that dispatch's all-to-all 20-26% faster on an H200 (world 2 and
# 4 under MPS), the combine's (at the blocks' caps) unchanged (benchmarks/ep_latency_h200.txt).
A2A_DIRECT_PUBLISH_BYTES_PER_BLOCK = 16 << 10
A2A_DIRECT_WAIT_BYTES_PER_BLOCK = 8 << 10
# The wait role's blocks spin until their peers' data lands, and the proxy-path kernels fit
# one 512-thread block per SM (127 registers): a grid of waiters on most SMs leaves another
# rank's kernel on the same GPU no room to publish what they wait for (two ranks on one
# H200 under MPS: the proxy path's reduce-scatter at 16 MiB per rank, 1 + 132 waiters
# each, timed out). 32 keep more than 50 GB/s of pinned reads in flight. (The plane's
# default max_wait_blocks.)
MAX_WAIT_BLOCKS = 32
# Slices up to this many bytes are handed off once, not piece by piece (protocol.h)
ONE_HANDOFF_SLICE = layout.protocol_constants()["ONE_HANDOFF_SLICE"]

RS_WAIT = {torch.bfloat16: "sccl_rs_wait_bf16", torch.float16: "sccl_rs_wait_f16",
           torch.float32: "sccl_rs_wait_f32"}
RS_PROXY = {torch.bfloat16: "sccl_rs_proxy_bf16", torch.float16: "sccl_rs_proxy_f16",
            torch.float32: "sccl_rs_proxy_f32"}


@dataclass(frozen=True)
class DirectCall:
    """One GPU-direct collective, as its engine needs it.

    publish: the direct kernel's publish role, as keywords of
    :func:`.kernel_args.direct_args` (src ... dst2); consume: the wait role's, as keywords of
    :func:`.kernel_args.wait_role_args` (slot ... own_sys); :meth:`wait_args` and
    :meth:`direct_args` pack them (protocol.h ``WaitRoleArgs``, ``DirectArgs``).
    ce_src: (input pointer, chunk stride) for the copy engines, or None (a zero-copy input,
    already pinned: the publish kernel sends it); own: (dst, src, bytes) copies of the own
    slice; sum_kernel: the reduce-scatter's sum per unit (piece, wait word) in mode "ce"
    (sccl_rs_sum_unit_*). The kernels take slots as base + code (kernels/common.cuh
    slot_at); mode "ce" issues host-computed values instead: ce_consume is consume with the
    slots of the host's seq, (slot, dst, dst stride) or (recv, own, own_sys, dst); output:
    (pointer, stride, count, bytes) of the result (sccl_poison)."""

    op: Op
    seq: int
    ts: object      # the caller's torch stream
    stream: object  # the same stream for cuda.core launches
    S: int          # slice bytes (padded to 16)
    L: int          # real bytes per rank
    call: int       # the ring entries' call word (peer_check.call_word)
    first: int      # first ring index reserved for the collective
    kernel: str     # the direct kernel (fused / split publish role)
    publish: dict
    consume: dict
    wait_kernel: str  # the wait kernel of modes split and ce's fallbacks
    nb: int         # consumer blocks of the wait role
    npub: int       # publish blocks
    ce_src: tuple | None
    own: list
    sum_kernel: str | None = None
    ce_consume: tuple = ()
    output: tuple = ()

    def wait_args(self, plane, advance: tuple = (0, 0)) -> list:
        """The wait role's ``WaitRoleArgs`` (the wait kernel's one parameter; ``advance``: see
        :func:`.kernel_args.wait_role_args`)."""
        return wait_role_args(plane, self.op, self.L, self.S, advance=advance, **self.consume)

    def direct_args(self, plane, wait: list) -> list:
        """The direct kernel's ``DirectArgs``, its wait role ``wait`` (:meth:`wait_args`)."""
        return direct_args(plane, wait, self.call, self.npub, **self.publish)


class Engine:
    """What every engine has: its plane, and nothing to release unless it says so."""

    direct = False  # writes into the peers' mapped memory itself (GPU-direct)

    def __init__(self, plane):
        self.plane = plane

    def close(self) -> None:
        """Release what the engine holds (the plane is closing)."""

    # ---- grids: blocks for ``work`` bytes, within the plane's caps ------------------------
    def publish_blocks(self, work: int) -> int:
        """Blocks per piece of a proxy-path publish role (PIECES of them per launch)."""
        cap = max(1, self.plane.max_publish_blocks // PIECES)
        return max(1, min(cap, -(-work // PUBLISH_BYTES_PER_BLOCK)))

    def direct_blocks(self, work: int, per_block: int = PUBLISH_BYTES_PER_BLOCK) -> int:
        """Publish blocks of a GPU-direct launch."""
        return max(1, min(self.plane.max_direct_blocks, -(-work // per_block)))

    def wait_blocks(self, work: int, per_block: int = WAIT_BYTES_PER_BLOCK) -> int:
        """Consumer blocks of a wait role (one poller block comes on top)."""
        return max(1, min(self.plane.max_wait_blocks, -(-work // per_block)))

    def slice_wait_blocks(self, S: int, per_block: int = WAIT_BYTES_PER_BLOCK) -> int:
        """Consumer blocks of a collective of slice S: for what they move after one wait, a
        piece, or the whole slice where it goes in one hand-off (the kernels then wait once,
        for its last unit, and need the blocks for all of it in flight at once)."""
        return self.wait_blocks(S if S <= ONE_HANDOFF_SLICE else piece_bounds(S, 0)[1],
                                per_block)

    def sum_wait_blocks(self, S: int, threads: int, direct: bool) -> int:
        """Consumer blocks of an all-reduce kernel (the one shot's, the fused two steps'): a
        one-hand-off slice's sum reads every source across PCIe at once after one wait, so
        one 16-byte unit per thread of ``threads`` a block (each further round of a thread
        is another read latency), within the plane's cap on spinning blocks (MAX_WAIT_BLOCKS:
        ranks sharing a GPU need SMs for each other's publish blocks; GPU-direct, the
        direct kernels' cap)."""
        nb = self.slice_wait_blocks(S)
        if S <= ONE_HANDOFF_SLICE:
            nb = max(nb, min(self.plane.max_wait_blocks, -(-S // (16 * threads))))
        return min(nb, self.plane.max_direct_wait_blocks) if direct else nb


class ProxyPathEngine(Engine):
    """The proxy sends: the kernels publish each piece in the publish ring and wait for the
    peers' flags (``kernels/publish.cu``, ``wait.cu``, ``proxy_path.cu``). Each kernel takes
    one struct (protocol.h ``PublishArgs``, ``ProxyArgs``, ``FinalizeArgs``,
    ``WaitRoleArgs``: :mod:`.kernel_args`)."""

    def issue(self, ts, stream, output: tuple, combined, publish, wait,
              entries: int = PIECES) -> None:
        """Launch a proxy-path collective: both roles in one kernel (``combined``), or, as a
        benchmark asks through the plane's ``phases``, the publish and the wait kernels
        alone. Each of the three is a callable that makes its launch (so only the launches
        made are built); ``combined`` may be None (the finalize has no combined kernel)."""
        p = self.plane
        phases = p.phases
        pub, waited = "publish" in phases, "wait" in phases
        if pub and waited and combined is not None:
            combined()
            p.poison_if_failed(stream, *output)
            p.finish(ts, stream, advanced=True)
            return
        if pub:
            publish()
        if waited:
            wait()
        p.poison_if_failed(stream, *output)
        p.finish(ts, stream, entries, advanced=waited)

    def all_gather(self, ts, stream, S: int, L: int, call: int, src_p, dst_ptr,
                   dst_stride: int, res_me, output: tuple, zero_copy: bool) -> None:
        p = self.plane
        if not zero_copy:
            p.plans.plannable()  # (kernels of constants and call pointers)
        slot0, code, me = p.ag_dev, p.ag_code, p.rank
        bpp = self.publish_blocks(piece_bounds(S, 0)[1])
        nb = 1 if zero_copy else self.slice_wait_blocks(S)
        pub = publish_args(p, src_p, 0, slot0 + me * S, code, res_me, 1, L, S, call, bpp)
        self.issue(
            ts, stream, output,
            lambda: p.launch_struct(stream, "sccl_ag_proxy", PIECES * bpp + 1 + nb,
                                    PUBLISH_THREADS,
                                    proxy_args(p, Op.AG, pub, slot0, code, dst_ptr, dst_stride)),
            lambda: p.launch_struct(stream, "sccl_publish", PIECES * bpp, PUBLISH_THREADS, pub),
            lambda: p.launch_struct(stream, "sccl_ag_wait", 1 + nb, WAIT_THREADS,
                                    wait_role_args(p, Op.AG, L, S, slot0, code, dst_ptr,
                                                   dst_stride, advance=(PIECES, 0))))

    def reduce_scatter(self, ts, stream, S: int, L: int, call: int, base, src_stride: int,
                       own, own_code: int, own_sys: int, dst_ptr, dtype: torch.dtype | None,
                       dst_stride: int = 0) -> None:
        """``base``: the input's chunk 0, or None for a zero-copy input (the chunks lie in
        the send slot already: only the ring entries are written). ``dtype`` None: an
        all-to-all (the same publish; the receiver is the all-gather's copy-out on the
        reduce-scatter's tables, source i's chunk to ``dst_ptr + i * dst_stride``, this
        rank's from ``own``: kernels/wait.cu ag_wait)."""
        p = self.plane
        p.plans.plannable()  # (kernels of constants and call pointers)
        W, send0, recv0 = p.world, p.rs_send_dev, p.rs_recv_dev
        if base is not None:
            bpp = self.publish_blocks(W * piece_bounds(S, 0)[1])
            pub = publish_args(p, base, src_stride, send0, p.send_code, 0, W, L, S, call, bpp)
        else:  # (nothing to copy: nchunks 0)
            bpp = 1
            pub = publish_args(p, 0, 0, send0, p.send_code, 0, 0, L, S, call, bpp)
        nb = self.slice_wait_blocks(S)
        a2a = dtype is None
        self.issue(
            ts, stream, (dst_ptr, dst_stride, W, L) if a2a else (dst_ptr, 0, 1, L),
            lambda: p.launch_struct(stream, "sccl_ag_proxy" if a2a else RS_PROXY[dtype],
                                    PIECES * bpp + 1 + nb, PUBLISH_THREADS,
                                    proxy_args(p, Op.RS, pub, recv0, p.recv_code, dst_ptr,
                                               dst_stride, own, own_code, own_sys)),
            lambda: p.launch_struct(stream, "sccl_publish", PIECES * bpp,
                                    PUBLISH_THREADS if base is not None else 32, pub),
            lambda: p.launch_struct(stream, "sccl_ag_wait" if a2a else RS_WAIT[dtype], 1 + nb,
                                    WAIT_THREADS,
                                    wait_role_args(p, Op.RS, L, S, recv0, p.recv_code, dst_ptr,
                                                   dst_stride, own, own_code, own_sys,
                                                   advance=(PIECES, 0))))

    def finalize(self, ts, stream, rows_args: list, RB: int, S: int, L: int, call: int,
                 dst, own: int, entries: int) -> None:
        """``sccl_finalize`` computes the rows into the send slot and publishes each (row
        piece, destination), in ``entries`` ring entries; the bf16 wait kernel sums.
        ``rows_args``: protocol.h FinRowsArgs (:func:`.kernel_args.fin_rows_args`); RB:
        bytes per row."""
        p = self.plane
        p.plans.plannable(entries)

        def publish():
            units = -(-piece_bounds(S, 0, RB)[1] // 16)  # 16-byte units of one item
            nb = max(1, min(p.sms, p.max_publish_blocks, -(-units // FIN_THREADS)))
            p.launch_struct(stream, "sccl_finalize", nb, FIN_THREADS,
                            finalize_args(p, rows_args, own, call))

        def wait():
            nb = self.wait_blocks(piece_bounds(S, 0, RB)[1])
            p.launch_struct(stream, RS_WAIT[torch.bfloat16], 1 + nb, WAIT_THREADS,
                            wait_role_args(p, Op.RS, L, S, p.rs_recv_dev, p.recv_code, dst, 0,
                                           own, advance=(entries, 0)))

        self.issue(ts, stream, (dst, 0, 1, L), None, publish, wait, entries)


class FusedEngine(Engine):
    """GPU-direct, one kernel per collective: publish blocks and wait blocks side by side.
    It advances the device state itself."""

    direct = True

    def run(self, call: DirectCall) -> None:
        p, op = self.plane, call.op
        if not (op == Op.AG and call.consume["out"] == 0):  # (not a zero-copy result)
            p.plans.plannable(direct=True)  # one kernel of constants and call pointers
        waited = "wait" in p.phases  # (a benchmark may time the publish role alone)
        grid = call.npub + (1 + call.nb if waited else 0)
        p.launch_struct(call.stream, call.kernel, grid, DIRECT_THREADS,
                        call.direct_args(p, call.wait_args(p, (PIECES, 0))))
        p.direct_launches += 1
        p.poison_if_failed(call.stream, *call.output)
        p.finish(call.ts, call.stream, advanced=True)

    def finalize(self, ts, stream, rows_args: list, RB: int, S: int, L: int, call: int,
                 dst, own: int, dtab) -> None:
        """One launch of ``sccl_finalize_direct`` computes the rows straight into the peers'
        mapped receive regions, writes the streams' flags and one ring entry per piece
        (chunk -2), and its other blocks sum this rank's rows over ranks as they arrive.
        Every collective of the op then has the same writer (the GPU) for each flag word."""
        p = self.plane
        p.plans.plannable(direct=True)
        piece = piece_bounds(S, 0)[1]
        units = -(-piece * p.world // 16)  # 16-byte row units of one piece, every destination
        npub = max(1, min(p.max_direct_blocks, -(-units // DIRECT_THREADS)))
        nb = min(self.wait_blocks(piece), max(1, 2 * p.sms - 1 - npub))
        p.launch_struct(stream, "sccl_finalize_direct", npub + 1 + nb, DIRECT_THREADS,
                        finalize_direct_args(p, rows_args, dtab.data_ptr(), call, npub, own,
                                             dst))
        p.direct_launches += 1
        p.poison_if_failed(stream, dst, 0, 1, L)
        p.finish(ts, stream, advanced=True)


class SplitEngine(Engine):
    """GPU-direct, the two roles on two streams: the publish side starts after everything
    queued before on the caller's stream, and the caller's stream joins it at the end, so
    collectives stay in order and every region is reused as with one launch."""

    direct = True

    def run(self, call: DirectCall) -> None:
        p, stream = self.plane, call.stream
        wait = call.wait_args(p)  # (sccl_advance moves the device state on: finish)
        side_ts, side = p.fork(call.ts)
        p.launch_struct(side, call.kernel, call.npub, DIRECT_THREADS, call.direct_args(p, wait))
        p.launch_struct(stream, call.wait_kernel, 1 + call.nb, WAIT_THREADS, wait)
        p.join(call.ts, side_ts)
        p.direct_launches += 1
        p.poison_if_failed(stream, *call.output)
        p.finish(call.ts, stream)
