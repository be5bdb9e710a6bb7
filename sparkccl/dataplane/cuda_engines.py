"""The GPU-direct engines of the CUDA data plane: how one collective whose publish streams
run on this GPU is launched (``SPARKCCL_DIRECT_MODE``):

* ``fused``: one kernel, publish blocks and wait blocks side by side;
* ``split``: the publish kernel on a side stream, the wait kernel on the caller's stream;
* ``ce``: copy engines both ways: on a side stream cuMemcpyAsync per item piece, then the
  flag and the ring tag by cuStreamWriteValue64; on a watch stream sccl_wait_piece per
  piece (the waits, relayed to the progress word); on the caller's stream per piece and
  wait word cuStreamWaitValue64 on that word, then copies of that part out of the own
  region (reduce-scatter: into device staging, then sccl_rs_sum_unit_*).

"auto" (the default) takes "ce" from ``SPARKCCL_CE_MIN_BYTES`` (16 MiB) per rank and
"fused" below, where one launch beats 80-130 stream operations and a chain of 16 unit waits
(two H200s, one process each, the first ce form: ce's all-gather ahead from 16 MiB per
rank, its reduce-scatter even there, both behind at 8 MiB;
benchmarks/bench_h200_x2_engines.txt, "where ce starts to pay").

In mode poison (``SPARKCCL_ON_FAILURE=poison``), "ce" runs as "fused" (see _run_direct).
Once a collective of the data plane was captured in a CUDA graph, "ce" runs as "fused":
its stream memory operations carry values the host computed from its own seq (flag and
progress values, ring indices), which a replay would repeat, and the host's seq is stale
after replays (docs/CONTRACT.md "CUDA graphs"). "fused" and "split" are kernels only; they
take seq and the ring index from the device state (docs/PROTOCOL.md "Sequence state").

:class:`DirectEngines` is a part of :class:`~.cuda.CudaDataPlane` (it uses the plane's
launch and stream operations, which the CPU emulation in tests/ replaces); each collective
describes itself to it with one :class:`DirectCall`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import layout
from ..plan.geometry import ALIGN, PIECES, cut, flag_value, piece_bounds
from ..plan.model import Op
from .cuda_runtime import check, kernel_u64 as _n

DIRECT_MODES = ("fused", "split", "ce")
WAIT_THREADS = 256
DIRECT_THREADS = 256  # sccl_*_direct: both roles (__launch_bounds__(256, 2))
PROG_STRIDE = layout.protocol_constants()["PROG_STRIDE"]  # progress word = seq * it + unit
# mode "ce" stream operations (cuda_ops.cpp)
OP_COPY, OP_WRITE64, OP_LAUNCH, OP_RECORD, OP_WAIT_EVENT, OP_WAIT_VALUE = 0, 1, 2, 3, 4, 5
MAX_CE_PLANS = 64  # mode "ce" launch plans kept per data plane (all dropped when full)


@dataclass
class CePlan:
    """Mode "ce": what a collective of (op, S, L) does that does not depend on seq, the
    pointers or the streams: per piece, the sending side's copies and flags and the
    receiving side's units, and the ring entries' fields but seq. Built by the first call
    from ``_dhost[op]`` and ``_ce_words[op]`` (kept as ``host`` and ``words``: a plan built
    from other tables than the current ones is stale, e.g. after _build_direct)."""
    host: list
    words: list
    # pub[c]: (OP_COPY, dst without the slot term, slots, slot stride, chunk, a, bytes) or
    # (OP_WRITE64, flag pointer, value - seq * FLAG_STRIDE)
    pub: list
    # recv[c]: (unit u, [(source i, a, bytes)], sum here)
    recv: list
    ring_rows: np.ndarray  # [PIECES, 6] uint64, column 0 (seq) filled per call


@dataclass(frozen=True)
class DirectCall:
    """One GPU-direct collective, as its engine needs it.

    publish: the direct kernel's publish arguments up to ``own_dst, dst2``; consume: the wait
    role's arguments before ``L, S`` (sccl_*_wait) or the wait parameters (direct kernel).
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
    first: int      # first ring index reserved for the collective
    kernel: str     # the direct kernel (fused / split publish role)
    publish: tuple
    consume: tuple
    wait_kernel: str  # the wait kernel of modes split and ce's fallbacks
    nb: int         # consumer blocks of the wait role
    npub: int       # publish blocks
    ce_src: tuple | None
    own: list
    sum_kernel: str | None = None
    ce_consume: tuple = ()
    output: tuple = ()


class DirectEngines:
    """The engines' part of the CUDA data plane (mixed into CudaDataPlane)."""

    def _run_direct(self, call: DirectCall) -> None:
        """Launch a GPU-direct collective in ``self.direct_mode`` (see DIRECT_MODES)."""
        op, seq, ts, stream, S, L = call.op, call.seq, call.ts, call.stream, call.S, call.L
        first, kernel, publish, consume = call.first, call.kernel, call.publish, call.consume
        nb, npub, ce_src, own = call.nb, call.npub, call.ce_src, call.own
        ring = (self.ctl_dev + layout.RING_OFFSET, _n(int(op)), self.dcounters.data_ptr())
        waits = self._wait_args(op)
        mode = self.direct_mode
        if mode == "auto":
            mode = "ce" if S >= self.ce_min_slice else "fused"
        if mode == "ce" and not self._can_write_values():
            mode = "split"
        if mode == "ce" and (self._graph or self.on_failure == "poison"):
            # Stream memory operations carry host-computed values (seq, ring indices), which
            # a replay would repeat: a captured communicator's collectives run "fused". And
            # in mode poison, where collectives queued after a failure still run, a failed
            # data plane must send nothing more (kernels/common.cuh plane_failed), which its
            # copy engines cannot be told.
            mode = "fused"
        if mode == "fused" or "wait" not in self.phases:
            if not (op == Op.AG and call.consume[2] == 0):  # (not a zero-copy result)
                self.plans.plannable(direct=True)  # one kernel of constants and call pointers
            grid = npub + (1 + nb if "wait" in self.phases else 0)
            # The one kernel of the collective: it advances the device state itself.
            self._launch(stream, kernel, grid, DIRECT_THREADS, *publish, *ring, _n(npub),
                         *consume, *self._wait_args(op, (PIECES, 0)))
            self.direct_launches += 1
            self._poison_if_failed(stream, *call.output)
            self._finish(ts, stream, advanced=True)
            return
        # The two roles on two streams: the publish side starts after everything queued
        # before on the caller's stream, and the caller's stream joins it at the end, so
        # collectives stay in order and every region is reused as with one launch. (Mode ce
        # with two sending and two receiving streams, words alternating between them, was
        # slower on two H200s: ~0.9 ms per collective at any size, against ~0.45 ms.)
        side_ts, side = self._fork(ts)
        ce_pub = mode == "ce" and ce_src is not None  # (a zero-copy input is already pinned)
        hc = call.ce_consume
        ce_wait = mode == "ce" and (op == Op.RS or int(hc[1]) != 0)  # (zero-copy AG: waits)
        if not ce_pub:
            self._launch(side, kernel, npub, DIRECT_THREADS, *publish, *ring, _n(npub),
                         *consume, *waits)
        if ce_pub or ce_wait:
            # Kernels of the operation list: 0 waits for piece c (the first parameter), 1 sums
            # a reduce-scatter unit (the first parameter, unit = c * maxw + k).
            kernels = [("sccl_wait_piece", 32, (0, *waits))]
            watch = self._fork(ts, "watch")[0] if ce_wait else None
            stage, sums = 0, None
            if op == Op.RS and ce_wait:
                sums = self._sum_stream()
                stage = self._scratch("ce stage", self.world * S).data_ptr()
                reduce_parts = self.parts_table[int(op)][self.world].data_ptr()
                kernels.append((call.sum_kernel, WAIT_THREADS, (0, stage, *hc[1:], L, S,
                                                           self.rank, self.world, reduce_parts,
                                                           self.maxw)))
            # The own slice first, on the receiving stream (idle until the first piece lands).
            ops = [(OP_COPY, ts, d, src, n) for d, src, n in own] if ce_pub else []
            if ce_pub:
                self._host_ring_room(op, seq, first, PIECES)
                self._ring_fields(first, seq, S, op, L)
            # Both sides piece by piece, so each stream starts at once; and a piece's wait is
            # queued after that piece's sends (a stream sharing a hardware queue with another
            # of this rank then waits behind nothing a peer's wait needs: no cycle).
            for c in range(PIECES):
                if ce_pub:
                    self._ce_publish(ops, op, seq, side_ts, c, S=S, L=L, first=first, src=ce_src)
                if ce_wait:
                    ops.append((OP_LAUNCH, watch, 0, c, 1))
                    self._ce_receive(ops, op, seq, ts, c, S=S, L=L, consume=hc,
                                     stage=stage, nb=nb, sums=sums)
            self._issue(ops, kernels)
            if sums is not None:
                self._join(ts, sums[0])
            if watch is not None:
                self._join(ts, watch)
        if not ce_wait:
            self._launch(stream, call.wait_kernel, 1 + nb, WAIT_THREADS, *consume, _n(L), _n(S),
                         *waits)
        self._join(ts, side_ts)
        if ce_wait and self.on_failure == "stop":
            # The value waits above end when the progress word says so, also when the host
            # released them (_release_waits: no kernel of theirs ran to fail); the copies
            # then moved whatever was there. Before anything after the collective can read
            # it: trap if this data plane failed (mode poison: sccl_poison overwrites it).
            self._launch(stream, "sccl_fail_guard", 1, 32, *waits)
        self.direct_launches += 1
        self._poison_if_failed(stream, *call.output)
        self._finish(ts, stream)

    def _ce_plan(self, op: Op, S: int, L: int) -> CePlan:
        """The launch plan of mode "ce" for (op, S, L): the same operations, in the same
        order, as planning each call afresh (``ce_plan_stats`` counts hits and misses)."""
        plans = self.__dict__.setdefault("_ce_plans", {})
        stats = self.__dict__.setdefault("ce_plan_stats", {"hits": 0, "misses": 0})
        host, words = self._dhost.get(op), self._ce_words[op]
        p = plans.get((op, S, L))
        if p is not None and p.host is host and p.words is words:
            stats["hits"] += 1
            return p
        stats["misses"] += 1
        if len(plans) >= MAX_CE_PLANS:
            plans.clear()
        pub, recv, rows = [], [], []
        for c in range(PIECES):
            lo, hi = piece_bounds(S, c)
            sends = []
            for flag, items in host or ():
                for chunk, dbase, dstride, slots, block, part in items:
                    a, e = cut(lo, hi, part, L)
                    if e > a:
                        sends.append((OP_COPY, dbase + block * S + a, slots, dstride, chunk, a,
                                      e - a))
                sends.append((OP_WRITE64, flag, flag_value(0, c)))
            pub.append(sends)
            units = []
            for k, copies, sum_here in words:
                moves = []
                for i, part in copies:
                    a, e = cut(lo, hi, part, L)
                    if e > a:
                        moves.append((i, a, e - a))
                units.append((c * self.maxw + k, moves, sum_here))
            recv.append(units)
            rows.append([0, S, lo, hi, int(op) | c << 32,
                         (layout.CHUNK_DIRECT & 0xFFFFFFFF) | ALIGN << 32])
        p = plans[(op, S, L)] = CePlan(host=host, words=words, pub=pub, recv=recv,
                                       ring_rows=np.array(rows, dtype=np.uint64))
        return p

    def _ce_publish(self, ops: list, op: Op, seq: int, side_ts, c: int, *, S: int, L: int,
                    first: int, src: tuple) -> None:
        """Mode "ce", piece c of the sending side: the same writes as direct_publish in
        kernels/direct.cu, as copy-engine operations: each item's bytes straight into the peer's
        mapped region, then the stream's flag word; then the tag of ring entry first + c
        (its other fields are written by :meth:`_ring_fields` before anything is issued).
        A written value carries a system-wide fence (cuStreamWriteValue64 without
        NO_MEMORY_BARRIER), so each flag follows its data as the kernel's release store."""
        base, stride = src
        seq_value = flag_value(seq, 0) - flag_value(0, 0)
        for t in self._ce_plan(op, S, L).pub[c]:
            if t[0] == OP_COPY:
                _, dst, slots, dstride, chunk, a, n = t
                ops.append((OP_COPY, side_ts, dst + (seq % slots) * dstride,
                            base + chunk * stride + a, n))
            else:
                ops.append((OP_WRITE64, side_ts, t[1], t[2] + seq_value, 0))
        index = first + c
        ops.append((OP_WRITE64, side_ts, self.ctl_dev + layout.RING_OFFSET + layout.ENT_TAG
                    + (index % layout.RING_ENTRIES) * layout.RING_ENTRY_BYTES, index + 1, 0))

    def _ce_receive(self, ops: list, op: Op, seq: int, ts, c: int, *, S: int, L: int,
                    consume: tuple, stage: int, nb: int, sums: tuple | None) -> None:
        """Mode "ce", piece c of the receiving side, one unit (wait word k) at a time: the
        caller's stream waits (``cuStreamWaitValue64``) until the progress word says word k
        of the piece came from every source (``sccl_wait_piece`` on the watch stream relays
        it there, watching the abort word and the GPU-clock timeout; a failure sets the word
        past every unit of the collective), then the copy engines move the part of the piece
        that word carries off the link: into the all-gather result, or into the device
        staging slot of the reduce-scatter. There nb blocks of
        ``sccl_rs_sum_unit_*`` sum it in rank order on the sums' stream (``sums`` = (stream,
        events)), which waits for an event recorded after the unit's copies, so the receiving
        stream moves on to the next unit at once.

        Why so: waiting per word rather than per piece halves the pipeline's fill and drain
        where each source sends a piece in two parts (two roots per port); SMs reading
        pinned memory lose a quarter to half of their rate while the link also carries the
        publish writes, where copy engines keep 48 of 55 GB/s each way
        (benchmarks/pcie_duplex_h200.txt). No kernel of this rank waits for anything its own
        later stream operations write: the only spinning kernel waits for peers' flags (an
        earlier version summed in a kernel that waited for device flags written by this
        rank's own copying stream; it hung on two H200s). Why a value wait rather than a
        wait kernel on the copying stream (as before): the copies then never queue behind a
        kernel; moving a world-2 collective's bytes in 16 units this way took 0.91-0.92 ms
        for 32 MiB each way per GPU, against 0.95-1.09 ms with a spinning kernel per unit
        (two H200s, benchmarks/pcie_duplex.py --wait)."""
        if op == Op.AG:
            src, dst, dst_stride = int(consume[0]), int(consume[1]), int(consume[2])
        else:
            src, dst, dst_stride = int(consume[0]), stage, S
        progress = self.state.data_ptr()
        for u, moves, sum_here in self._ce_plan(op, S, L).recv[c]:
            # unit (c, k, last source) of kernels/wait.cu: the relay's last step for word k
            ops.append((OP_WAIT_VALUE, ts, progress, seq * PROG_STRIDE + (u + 1) * self.world, 0))
            for i, a, n in moves:
                ops.append((OP_COPY, ts, dst + i * dst_stride + a, src + i * S + a, n))
            if op == Op.RS:
                # The sums' stream follows every unit's copies, also those without a sum of
                # their own (a whole-piece sum after the last word, where sources split
                # pieces differently, reads the parts of every word).
                sum_ts, events = sums
                ops.append((OP_RECORD, ts, events[u], 0, 0))
                ops.append((OP_WAIT_EVENT, sum_ts, events[u], 0, 0))
                if sum_here:
                    ops.append((OP_LAUNCH, sum_ts, 1, u, nb))

    def _ring_fields(self, first: int, seq: int, S: int, op: Op, L: int) -> None:
        """Every field but the tag of the collective's ring entries first .. first + 7 (the
        GPU stream writes each tag once its piece is sent; the host wrote these before it
        issued that write, so the proxy, which reads the fields after the tag, finds them)."""
        idx = [(first + c) % layout.RING_ENTRIES for c in range(PIECES)]
        rows = self._ce_plan(op, S, L).ring_rows
        rows[:, 0] = seq
        self._ring_host[idx, 1:7] = rows

    # ---- streams and stream operations (overridden by the CPU emulation) -----------------
    def _fork(self, ts, name: str = "side"):
        """(torch stream, cuda.core stream) of this data plane's stream ``name`` ("side":
        the sending side of modes split and ce; "watch": mode ce's piece waits), made on
        first use, ordered after everything queued on ``ts`` so far."""
        st = self._side_streams.get(name)
        if st is None:
            st = self._side_streams[name] = torch.cuda.Stream(self.device)
        st.wait_stream(ts)
        return st, self._cc_stream(st)

    def _join(self, ts, side_ts) -> None:
        ts.wait_stream(side_ts)

    def _sum_stream(self) -> tuple:
        """Mode "ce": the reduce-scatter sums' stream and one event per unit (piece, wait
        word), made on first use. The sums of a collective follow the caller's stream's
        earlier work through the first event, and the caller's stream joins the sums' stream
        at the end of each collective (the staging slot is then free again)."""
        if self._sums is None:
            self._sums = (torch.cuda.Stream(self.device), self._new_events(PIECES * self.maxw))
        return self._sums

    def _new_events(self, n: int) -> list[int]:
        from cuda.bindings import driver as drv
        flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        with torch.cuda.device(self.device):
            return [int(check("cuEventCreate", drv.cuEventCreate(flags))[0]) for _ in range(n)]

    def _free_events(self) -> None:
        if self._sums is None:
            return
        from cuda.bindings import driver as drv
        for e in self._sums[1]:
            drv.cuEventDestroy(drv.CUevent(e))
        self._sums = None

    def _issue(self, ops: list, kernels: list) -> None:
        """Issue mode "ce" operations (kind, torch stream, a, b, c) in order, in one native
        call (native/src/cuda_ops.cpp). kernels: (name, threads per block, parameters) of
        the OP_LAUNCH operations (a: index in this list, b: first parameter, c: blocks)."""
        flat = [int(v) for kind, st, a, b, c in ops for v in (kind, st.cuda_stream, a, b, c)]
        with torch.cuda.device(self.device):  # (the function handles are per context too)
            table = [(self._function(name), block, [int(v) for v in params])
                     for name, block, params in kernels]
            self.nat.cuda_issue(table, flat)

    def _function(self, name: str) -> int:
        """CUfunction handle of kernel ``name`` in this device's context."""
        f = self._functions.get(name)
        if f is None:
            from cuda.bindings import driver as drv
            h = self.kernels[name].handle
            if isinstance(h, drv.CUkernel):
                h = check("cuKernelGetFunction", drv.cuKernelGetFunction(h))[0]
            f = self._functions[name] = int(h)
        return f

    def _can_write_values(self) -> bool:
        """Can this GPU's streams write and wait for 64-bit values (mode "ce")?"""
        if self._write_values is None:
            try:
                from cuda.bindings import driver as drv
                attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
                err, v = drv.cuDeviceGetAttribute(attr, self.device.index)
                self._write_values = int(err) == 0 and bool(v)
            except Exception:
                self._write_values = False
        return self._write_values
