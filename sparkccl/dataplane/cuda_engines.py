"""The GPU-direct engines of the CUDA data plane: how one collective whose publish streams
run on this GPU is launched (``SPARKCCL_DIRECT_MODE``):

* ``fused``: one kernel, publish blocks and wait blocks side by side;
* ``split``: the publish kernel on a side stream, the wait kernel on the caller's stream;
* ``ce``: copy engines both ways: on a side stream cuMemcpyAsync per item piece, then the
  flag and the ring tag by cuStreamWriteValue64; on a watch stream sccl_wait_piece per
  piece (the waits, relayed to the progress word); on the caller's stream per piece and
  wait word cuStreamWaitValue64 on that word, then copies of that part out of the own
  region (reduce-scatter: into device staging, then sccl_rs_sum_unit_*). All of it is a
  native OpProgram per collective shape, issued per call with that call's terms (T_*); a
  shape's later calls issue it from the plan cache with their seq, ring index, stream and
  pointers, without the planning code (:class:`CePlan`, cuda.py _planned).

"auto" (the default) takes "ce" from ``SPARKCCL_CE_MIN_BYTES`` (16 MiB) per rank and
"fused" below, where one launch beats 67-92 driver calls and a chain of 16 unit waits
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
from .launch_plan import MAX_ARGS, CallPtr, Slotted

DIRECT_MODES = ("fused", "split", "ce")
WAIT_THREADS = 256
DIRECT_THREADS = 256  # sccl_*_direct: both roles (__launch_bounds__(256, 2))
PROG_STRIDE = layout.protocol_constants()["PROG_STRIDE"]  # progress word = seq * it + unit
# mode "ce" stream operations (cuda_ops.cpp)
OP_COPY, OP_WRITE64, OP_LAUNCH, OP_RECORD, OP_WAIT_EVENT, OP_WAIT_VALUE = 0, 1, 2, 3, 4, 5
MAX_CE_PLANS = 64  # mode "ce" launch plans kept per data plane (all dropped when full)


# Terms of a mode "ce" program: what a call fills in, from its seq, ring index, stream and
# pointers alone. A program row's values and a kernel's patched parameters are add + mult *
# term (native OpProgram).
T_ZERO, T_TS, T_SIDE, T_WATCH, T_SUMS, T_FLAG, T_PROG, T_FIRST, T_STAGE = range(9)
T_TAG = T_STAGE + 1      # + c: the tag word of ring entry first + c
T_ARG = T_TAG + PIECES   # + k: the call's pointer k (launch_plan.CallPtr arg k)
CE_MODS = (2, 3)         # slot counts of the regions: term T_MOD + i is seq % CE_MODS[i]
T_MOD = T_ARG + MAX_ARGS
N_TERMS = T_MOD + len(CE_MODS)
# the kernels of a program's table, by index (only those the program uses are launched)
K_PIECE, K_SUM, K_PUBLISH, K_WAIT, K_GUARD, K_ADVANCE = range(6)
_MASK = (1 << 64) - 1


def _sym(v) -> tuple:
    """A row value (add, term, mult): a CallPtr is its call pointer's term plus its offset,
    a Slotted address its region's base plus seq % slots times the slot stride (term
    T_MOD), anything else a constant."""
    t = type(v)
    if t is CallPtr:
        return v.add & _MASK, T_ARG + v.arg, 1
    if t is Slotted:
        return (v.base + v.add) & _MASK, T_MOD + CE_MODS.index(v.mod), v.stride
    return int(v) & _MASK, T_ZERO, 0


def _call_params(call) -> tuple:
    """What of a call shapes its mode "ce" program: the kernels' parameters, the copy
    engines' source, the consume side's values and the own copies' destinations (as the
    program's rows take them: _sym)."""
    return (*call.publish, *call.consume, *(call.ce_src or ()),
            *(_sym(v) for v in call.ce_consume), *(_sym(d) for d, _, _ in call.own))


def _call_args(call, params: tuple) -> list:
    """The call's pointers by argument (launch_plan.CallPtr arg k; what _planned's args
    are for a planned call)."""
    args = [0] * MAX_ARGS
    for v in (*params, *call.ce_consume, *(x for own in call.own for x in own)):
        if type(v) is CallPtr:
            args[v.arg] = int(v) - v.add
    return args


@dataclass
class CeProgram:
    """Mode "ce": a collective shape's stream operations as a native OpProgram, built by its
    first call (``_ce_program``), issued by every call with that call's terms. ``host``
    and ``words``: the tables it was built from (``_dhost[op]``, ``_ce_words[op]``; a
    program of other tables than the current ones is stale, e.g. after _build_direct).
    ``ring_rows``: the ring entries' fields but seq, which the host writes per call where
    the copy engines send (``host_ring``; a zero-copy input's kernel writes its own)."""
    op: Op
    host: list
    words: list
    program: object
    ring_rows: np.ndarray  # [PIECES, 6] uint64, column 0 (seq) filled per call
    host_ring: bool


@dataclass(frozen=True)
class CePlan:
    """A mode "ce" collective shape in the plan cache (launch_plan.PlanCache, cuda.py
    _planned): its program and the address of the reduce-scatter staging buffer it was
    planned with (an outgrown buffer drops every plan)."""
    program: CeProgram
    stage: int


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
        op, ts, stream, S, L = call.op, call.ts, call.stream, call.S, call.L
        kernel, publish, consume = call.kernel, call.publish, call.consume
        nb, npub = call.nb, call.npub
        ring = (self.ctl_dev + layout.RING_OFFSET, _n(int(op)), self.dcounters.data_ptr())
        waits = self.wait_args(op)
        mode = self.direct_mode
        if mode == "auto":
            mode = "ce" if S >= self.ce_min_slice else "fused"
        if mode == "ce" and not self.can_write_values():
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
            self.launch(stream, kernel, grid, DIRECT_THREADS, *publish, *ring, _n(npub),
                         *consume, *self.wait_args(op, (PIECES, 0)))
            self.direct_launches += 1
            self.poison_if_failed(stream, *call.output)
            self.finish(ts, stream, advanced=True)
            return
        if mode == "ce":
            self._run_ce(call, ring, waits)
            return
        # Mode split, the two roles on two streams: the publish side starts after everything
        # queued before on the caller's stream, and the caller's stream joins it at the end,
        # so collectives stay in order and every region is reused as with one launch.
        side_ts, side = self.fork(ts)
        self.launch(side, kernel, npub, DIRECT_THREADS, *publish, *ring, _n(npub), *consume,
                     *waits)
        self.launch(stream, call.wait_kernel, 1 + nb, WAIT_THREADS, *consume, _n(L), _n(S),
                     *waits)
        self.join(ts, side_ts)
        self.direct_launches += 1
        self.poison_if_failed(stream, *call.output)
        self.finish(ts, stream)

    def _run_ce(self, call: DirectCall, ring: tuple, waits: tuple) -> None:
        """Mode "ce": the collective's program (:meth:`_ce_program`) with this call's terms,
        in one native call; kept as the shape's plan when the call is being planned."""
        params = _call_params(call)
        p = self._ce_program(call, ring, waits, params)
        stage = (self.scratch("ce stage", self.world * call.S).data_ptr()
                 if call.op == Op.RS and call.ce_consume else 0)
        self._issue_ce(p, call.seq, call.first, self.stream_term(call.ts), call.ts,
                       _call_args(call, params), stage)
        self.direct_launches += 1
        if self.plans.recording():
            self.plans.plannable(direct=True, plan=CePlan(p, stage))

    def _issue_ce_plan(self, plan: CePlan, seq: int, args: tuple) -> bool:
        """A planned mode "ce" call (cuda.py _planned): the program with this call's terms.
        False, issuing nothing, while the caller's stream is being captured."""
        caller = self.caller_stream()
        if caller is None:
            return False
        self._issue_ce(plan.program, seq, self._ring_next, *caller, args, plan.stage)
        return True

    def _issue_ce(self, p: CeProgram, seq: int, first: int, stream_term: int, ts, args,
                  stage: int) -> None:
        """Issue program ``p`` for collective ``seq`` at ring index ``first`` on the caller's
        stream. The ring entries' fields are the host's to write where the copy engines send
        (their streams write only the tags), so the host first waits for their room."""
        if p.host_ring:
            self.host_ring_room(p.op, seq, first, PIECES)
            p.ring_rows[:, 0] = seq
            i = first % layout.RING_ENTRIES
            if i + PIECES <= layout.RING_ENTRIES:
                self._ring_host[i:i + PIECES, 1:7] = p.ring_rows
            else:
                self._ring_host[[(first + c) % layout.RING_ENTRIES for c in range(PIECES)],
                                1:7] = p.ring_rows
        self.run_program(p.program, self._ce_terms(seq, first, stream_term, args, stage), ts)

    def _ce_terms(self, seq: int, first: int, stream_term: int, args, stage: int) -> list:
        """The terms of a call (see T_*): all of them follow from its seq, ring index,
        stream and pointers (``args``, by CallPtr argument)."""
        t = [0] * N_TERMS
        t[T_TS] = stream_term
        t[T_SIDE], t[T_WATCH], t[T_SUMS] = self._ce_stream_terms()
        t[T_FLAG] = (flag_value(seq, 0) - flag_value(0, 0)) & _MASK
        t[T_PROG] = (seq * PROG_STRIDE) & _MASK
        t[T_FIRST] = first
        t[T_STAGE] = stage
        tags = self.ctl_dev + layout.RING_OFFSET + layout.ENT_TAG
        for c in range(PIECES):
            t[T_TAG + c] = tags + ((first + c) % layout.RING_ENTRIES) * layout.RING_ENTRY_BYTES
        t[T_ARG:T_ARG + len(args)] = args
        for i, m in enumerate(CE_MODS):
            t[T_MOD + i] = seq % m
        return t

    def _ce_program(self, call: DirectCall, ring: tuple, waits: tuple,
                    params: tuple) -> CeProgram:
        """The program of this call's shape, from the cache or built now (``ce_plan_stats``
        counts hits and misses). Its key holds every constant that shapes it: the shape, the
        kernels' constant parameters (``params``: _call_params(call)); what varies per call
        is a term (T_*)."""
        op, S, L = call.op, call.S, call.L
        plans = self.__dict__.setdefault("_ce_plans", {})
        stats = self.__dict__.setdefault("ce_plan_stats", {"hits": 0, "misses": 0})
        host, words = self._dhost.get(op), self._ce_words[op]
        # (a numpy integer hashes and compares as the int of its value)
        key = (op, S, L, call.kernel, call.wait_kernel, call.sum_kernel, call.nb, call.npub,
               len(call.own), self.on_failure,
               tuple((v.arg, v.add) if type(v) is CallPtr else v for v in params))
        p = plans.get(key)
        if p is not None and p.host is host and p.words is words:
            stats["hits"] += 1
            return p
        stats["misses"] += 1
        if len(plans) >= MAX_CE_PLANS:
            plans.clear()
        p = plans[key] = self._build_ce_program(call, ring, waits, host, words, params)
        return p

    def _build_ce_program(self, call: DirectCall, ring: tuple, waits: tuple, host, words,
                          params: tuple) -> CeProgram:
        """Mode "ce" for the shape of ``call``, as program rows (what each stream does is
        described in the module docstring and in :meth:`_ce_publish_rows` /
        :meth:`_ce_receive_rows`):

        * the caller's stream records the fork event; the sending stream and the watch stream
          wait for it (each starts after everything queued before the collective);
        * the own slice on the receiving stream (idle until the first piece lands);
        * piece by piece, both sides, so each stream starts at once; a piece's wait is
          queued after that piece's sends (a stream sharing a hardware queue with another of
          this rank then waits behind nothing a peer's wait needs: no cycle);
        * the caller's stream joins the sums', watch and sending streams (events), then
          sccl_fail_guard, sccl_advance and the data plane's done event.

        A zero-copy input (``ce_src`` None: already pinned) is sent by the direct kernel's
        publish role on the sending stream; a zero-copy result (AG ``hc[1]`` 0) is waited
        for by the wait kernel on the caller's stream. (Two sending and two receiving
        streams, words alternating between them, were slower on two H200s: ~0.9 ms per
        collective at any size, against ~0.45 ms.)"""
        op, S, L, nb, npub = call.op, call.S, call.L, call.nb, call.npub
        hc = call.ce_consume
        ce_pub = call.ce_src is not None
        ce_wait = op == Op.RS or int(hc[1]) != 0
        sums = self.sum_stream() if op == Op.RS and ce_wait else None
        fork, side_end, watch_end, sums_end = self._ce_sync_events()
        state = self.state.data_ptr()
        # The kernel table: parameters with CallPtr marks become patches (the first
        # parameter is each launch's own value).
        table = {K_PIECE: ("sccl_wait_piece", 32, (0, *waits)),
                 K_PUBLISH: (call.kernel, DIRECT_THREADS, (*call.publish, *ring, npub,
                                                           *call.consume, *waits)),
                 K_WAIT: (call.wait_kernel, WAIT_THREADS, (*call.consume, L, S, *waits)),
                 K_GUARD: ("sccl_fail_guard", 32, waits),
                 K_ADVANCE: ("sccl_advance", 32, (state, PIECES, 0))}
        if sums is not None:  # stage, own (host view): terms (dst: a call pointer)
            table[K_SUM] = (call.sum_kernel, WAIT_THREADS,
                            (0, 0, 0, hc[2], hc[3], L, S, self.rank, self.world,
                             self.ce_sum_parts.data_ptr(), self.maxw))
        kernels, patches, slot, firsts = [], [], {}, {}

        def kernel(k: int) -> int:
            """Index of kernel K_* in the program's table (added on first use)."""
            if k not in slot:
                name, block, ps = table[k]
                i = slot[k] = len(kernels)
                for j, v in enumerate(ps[1:], 1):
                    if type(v) is CallPtr:
                        patches.append((i, j, T_ARG + v.arg, 1, v.add & _MASK))
                if k == K_SUM:
                    add, term, mult = _sym(hc[1])
                    patches.extend([(i, 1, T_STAGE, 1, 0), (i, 2, term, mult, add)])
                kernels.append((name, block, [int(v) & _MASK for v in ps]))
                firsts[k] = _sym(ps[0])
            return slot[k]

        rows = []

        def row(kind, st, a=(0, T_ZERO, 0), b=(0, T_ZERO, 0), c=0):
            rows.extend((kind, st, *a, *b, c))

        def launch(st, k, unit=None, blocks=1):
            i = kernel(k)
            row(OP_LAUNCH, st, (i, T_ZERO, 0), firsts[k] if unit is None else (unit, T_ZERO, 0),
                blocks)

        row(OP_RECORD, T_TS, (fork, T_ZERO, 0))
        row(OP_WAIT_EVENT, T_SIDE, (fork, T_ZERO, 0))
        if ce_wait:
            row(OP_WAIT_EVENT, T_WATCH, (fork, T_ZERO, 0))
        if not ce_pub:
            launch(T_SIDE, K_PUBLISH, blocks=npub)
        if ce_pub:
            for dst, src, n in call.own:
                row(OP_COPY, T_TS, _sym(dst), _sym(src), n)
        pub, recv, ring_rows = self._ce_pieces(op, S, L, host, words)
        for c in range(PIECES):
            if ce_pub:
                self._ce_publish_rows(row, pub[c], c, _sym(call.ce_src[0]), call.ce_src[1])
            if ce_wait:
                launch(T_WATCH, K_PIECE, unit=c)
                self._ce_receive_rows(row, launch, recv[c], hc, sums, S, nb)
        if sums is not None:
            row(OP_RECORD, T_SUMS, (sums_end, T_ZERO, 0))
            row(OP_WAIT_EVENT, T_TS, (sums_end, T_ZERO, 0))
        if ce_wait:
            row(OP_RECORD, T_WATCH, (watch_end, T_ZERO, 0))
            row(OP_WAIT_EVENT, T_TS, (watch_end, T_ZERO, 0))
        else:
            launch(T_TS, K_WAIT, blocks=1 + nb)
        row(OP_RECORD, T_SIDE, (side_end, T_ZERO, 0))
        row(OP_WAIT_EVENT, T_TS, (side_end, T_ZERO, 0))
        if ce_wait and self.on_failure == "stop":
            # The value waits end when the progress word says so, also when the host
            # released them (_release_waits: no kernel of theirs ran to fail); the copies
            # then moved whatever was there. Before anything after the collective can read
            # it: trap if this data plane failed. (Mode poison runs ce as fused.)
            launch(T_TS, K_GUARD)
        launch(T_TS, K_ADVANCE)
        row(OP_RECORD, T_TS, (self.done_handle(), T_ZERO, 0))
        program = self.new_program(kernels, patches, rows)
        return CeProgram(op=op, host=host, words=words, program=program, ring_rows=ring_rows,
                         host_ring=ce_pub)

    def _ce_pieces(self, op: Op, S: int, L: int, host, words) -> tuple:
        """Per piece, what the sending side copies and flags and what the receiving side's
        units move, and the ring entries' fields (seq filled per call)."""
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
        return pub, recv, np.array(rows, dtype=np.uint64)

    def _ce_publish_rows(self, row, sends: list, c: int, src: tuple, stride: int) -> None:
        """Piece c of the sending side: the same writes as direct_publish in
        kernels/direct.cu, as copy-engine operations: every item's bytes straight into the
        peers' mapped regions, then the streams' flag words and the tag of ring entry
        first + c (its other fields are written by the host before the program is issued).
        A written value carries a system-wide fence (cuStreamWriteValue64 without
        NO_MEMORY_BARRIER), so each flag follows its data as the kernel's release store.
        The copies come first and the values after them, so that the native issue makes
        one cuMemcpyBatchAsync and one cuStreamBatchMemOp of the piece (cuda_ops.cpp
        group()); a stream's flag then waits for the piece's other streams' copies too,
        which are as long as its own."""
        for t in sends:
            if t[0] == OP_COPY:
                _, dst, slots, dstride, chunk, a, n = t
                row(OP_COPY, T_SIDE, (dst, T_MOD + CE_MODS.index(slots), dstride),
                    (src[0] + chunk * stride + a, src[1], src[2]), n)
        for t in sends:
            if t[0] == OP_WRITE64:
                row(OP_WRITE64, T_SIDE, (t[1], T_ZERO, 0), (t[2], T_FLAG, 1))
        row(OP_WRITE64, T_SIDE, (0, T_TAG + c, 1), (c + 1, T_FIRST, 1))

    def _ce_receive_rows(self, row, launch, units: list, hc: tuple, sums, S: int,
                         nb: int) -> None:
        """A piece of the receiving side, one unit (wait word k) at a time: the caller's
        stream waits (``cuStreamWaitValue64``) until the progress word says word k of the
        piece came from every source (``sccl_wait_piece`` on the watch stream relays it
        there, watching the abort word and the GPU-clock timeout; a failure sets the word
        past every unit of the collective), then the copy engines move the part of the piece
        that word carries off the link: into the all-gather result, or into the device
        staging slot of the reduce-scatter. Once a piece's last word is staged, nb blocks of
        ``sccl_rs_sum_unit_*`` sum the whole piece in rank order on the sums' stream (``sums``
        = (stream, events)), which waits for an event recorded after that unit's copies (and
        so after the piece's earlier words' copies, queued before them on the receiving
        stream), so the receiving stream moves on to the next unit at once.

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
        if sums is None:  # all-gather: into the result
            dst, dst_stride = _sym(hc[1]), int(hc[2])
        progress = self.state.data_ptr()
        for u, moves, sum_here in units:
            # unit (c, k, last source) of kernels/wait.cu: the relay's last step for word k
            row(OP_WAIT_VALUE, T_TS, (progress, T_ZERO, 0), ((u + 1) * self.world, T_PROG, 1))
            for i, a, n in moves:
                to = ((dst[0] + i * dst_stride + a, dst[1], dst[2]) if sums is None
                      else (i * S + a, T_STAGE, 1))
                row(OP_COPY, T_TS, to, _sym(hc[0] + i * S + a), n)
            if sums is not None and sum_here:
                events = sums[1]
                row(OP_RECORD, T_TS, (events[u], T_ZERO, 0))
                row(OP_WAIT_EVENT, T_SUMS, (events[u], T_ZERO, 0))
                launch(T_SUMS, K_SUM, unit=u, blocks=nb)

    # ---- streams and stream operations (overridden by the CPU emulation) -----------------
    def side_stream(self, name: str):
        """This data plane's torch stream ``name`` ("side": the sending side of modes split
        and ce; "watch": mode ce's piece waits), made on first use."""
        st = self._side_streams.get(name)
        if st is None:
            st = self._side_streams[name] = torch.cuda.Stream(self.device)
        return st

    def fork(self, ts, name: str = "side"):
        """(torch stream, cuda.core stream) of stream ``name``, ordered after everything
        queued on ``ts`` so far."""
        st = self.side_stream(name)
        st.wait_stream(ts)
        return st, self._cc_stream(st)

    def join(self, ts, side_ts) -> None:
        ts.wait_stream(side_ts)

    def _ce_stream_terms(self) -> tuple:
        """Mode "ce": the terms of the sending, watch and (reduce-scatter, once made) sums'
        streams (the streams live as long as the data plane: kept once the sums' is made)."""
        kept = self.__dict__.get("_ce_stream_handles")
        if kept is not None:
            return kept
        handles = (self.stream_term(self.side_stream("side")),
                   self.stream_term(self.side_stream("watch")),
                   self.stream_term(self._sums[0] if self._sums is not None else None))
        if self._sums is not None:
            self._ce_stream_handles = handles
        return handles

    def stream_term(self, st) -> int:
        return st.cuda_stream if st is not None else 0

    def sum_stream(self) -> tuple:
        """Mode "ce": the reduce-scatter sums' stream and one event per unit (piece, wait
        word), made on first use. The sums of a collective follow the caller's stream's
        earlier work through the first event, and the caller's stream joins the sums' stream
        at the end of each collective (the staging slot is then free again)."""
        if self._sums is None:
            self._sums = (torch.cuda.Stream(self.device), self.new_events(PIECES * self.maxw))
        return self._sums

    def _ce_sync_events(self) -> list[int]:
        """Mode "ce": the events of a program's fork (caller's stream -> sending and watch
        streams) and joins (sending, watch, sums' stream -> caller's), made on first use."""
        ev = self.__dict__.get("_ce_events")
        if ev is None:
            ev = self._ce_events = self.new_events(4)
        return ev

    def new_events(self, n: int) -> list[int]:
        from cuda.bindings import driver as drv
        flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        with torch.cuda.device(self.device):
            return [int(check("cuEventCreate", drv.cuEventCreate(flags))[0]) for _ in range(n)]

    def free_events(self) -> None:
        self.__dict__.pop("_ce_plans", None)  # (their programs name these events)
        self.__dict__.pop("_ce_stream_handles", None)
        events = list(self.__dict__.pop("_ce_events", None) or ())
        if self._sums is not None:
            events += self._sums[1]
            self._sums = None
        if events:
            from cuda.bindings import driver as drv
            for e in events:
                drv.cuEventDestroy(drv.CUevent(e))

    def new_program(self, kernels: list, patches: list, rows: list):
        """The native OpProgram (native/src/cuda_ops.cpp); kernels: (name, threads per
        block, parameters)."""
        with torch.cuda.device(self.device):  # (the function handles are per context)
            table = [(self.function(name), block, ps) for name, block, ps in kernels]
        return self.nat.OpProgram(self._context, N_TERMS, table, patches, rows)

    def done_handle(self) -> int:
        """The event a program records last: the data plane's done event (as a launch
        plan's), which _wait_last and the watchdog ask about."""
        return self._done_event.handle

    def run_program(self, program, terms: list, ts) -> None:
        """Issue a program in one native call; its last operation records the done event."""
        program.issue(terms)
        self._last_event, self._last_ts = self._done_event, ts

    def function(self, name: str) -> int:
        """CUfunction handle of kernel ``name`` in this device's context."""
        f = self._functions.get(name)
        if f is None:
            from cuda.bindings import driver as drv
            h = self.kernels[name].handle
            if isinstance(h, drv.CUkernel):
                h = check("cuKernelGetFunction", drv.cuKernelGetFunction(h))[0]
            f = self._functions[name] = int(h)
        return f

    def can_write_values(self) -> bool:
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
