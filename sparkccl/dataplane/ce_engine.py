"""Mode "ce" of the GPU-direct engines: copy engines both ways.

On a side stream cuMemcpyAsync per item piece, then the flag and the ring tag by
cuStreamWriteValue64; on a watch stream sccl_wait_piece per piece (the waits, relayed to the
progress word); on the caller's stream per piece and wait word cuStreamWaitValue64 on that
word, then copies of that part out of the own region (reduce-scatter: into device staging,
then sccl_rs_sum_unit_*). All of it is a native OpProgram per collective shape, issued per
call with that call's terms (T_*); a shape's later calls issue it from the plan cache with
their seq, ring index, stream and pointers, without the planning code (:class:`CePlan`,
cuda.py _planned).

"auto" (the default) takes "ce" from ``SPARKCCL_CE_MIN_BYTES`` (16 MiB) per rank and
"fused" below, where one launch beats 67-92 driver calls and a chain of 16 unit waits
(two H200s, one process each, the first ce form: ce's all-gather ahead from 16 MiB per
rank, its reduce-scatter even there, both behind at 8 MiB;
benchmarks/bench_h200_x2_engines.txt, "where ce starts to pay").

In mode poison (``SPARKCCL_ON_FAILURE=poison``), "ce" runs as "fused"; so it does once a
collective of the data plane was captured in a CUDA graph: its stream memory operations
carry values the host computed from its own seq (flag and progress values, ring indices),
which a replay would repeat, and the host's seq is stale after replays (docs/CONTRACT.md
"CUDA graphs"); see :meth:`.engine_choice.Engines.choose`.

The engine owns its programs (the plan cache of mode "ce": ``programs``, counted in
``stats``), its streams' terms, the sums' stream and its events; it issues everything
through the plane's device seam (:mod:`.device`: ``new_stream``, ``new_events``,
``new_program``, ``run_program``, ``stream_term``, ``caller_stream``), which the CPU
emulation in tests/ implements on the host.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import numpy as np
import torch

from .. import layout
from ..plan.geometry import ALIGN, PIECES, cut, flag_value, piece_bounds, root1_idle
from ..plan.model import Op
from ..plan.waits import PART_NONE, PART_WHOLE, ce_words, wait_parts, wait_table
from .base import OP_NAMES
from .cuda_runtime import u64_at as _u64
from .engines import DIRECT_THREADS, WAIT_THREADS, DirectCall, Engine
from .kernel_args import ring, sum_unit_args, wait_params
from .launch_plan import MAX_ARGS, CallPtr, Slotted

_P = layout.protocol_constants()
PROG_STRIDE = _P["PROG_STRIDE"]  # progress word = seq * it + unit
# The words of the sum's SumUnitArgs that are a call's terms (the staging buffer, own).
SU_STAGE_WORD, SU_OWN_WORD = _P["SU_STAGE"] // 8, _P["SU_OWN"] // 8
# stream operations of a program (native/src/cuda_ops.cpp)
OP_COPY, OP_WRITE64, OP_LAUNCH, OP_RECORD, OP_WAIT_EVENT, OP_WAIT_VALUE = 0, 1, 2, 3, 4, 5
MAX_CE_PLANS = 64  # mode "ce" programs kept per data plane (all dropped when full)


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


def _call_params(call, direct: list) -> tuple:
    """What of a call shapes its mode "ce" program: the direct kernel's DirectArgs
    (``direct``: its wait role's WaitRoleArgs too), the copy engines' source, the consume
    side's values and the own copies' destinations (as the program's rows take them:
    _sym)."""
    return (*direct, *(call.ce_src or ()), *(_sym(v) for v in call.ce_consume),
            *(_sym(d) for d, _, _ in call.own))


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
    program of other tables than the current ones is stale, e.g. after the plane's _build_direct).
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


class CeEngine(Engine):
    """Mode "ce" (see the module docstring)."""

    direct = True

    def __init__(self, plane):
        super().__init__(plane)
        p = plane
        # A reduce-scatter piece is summed once, after its last word: one launch per piece
        # instead of one per word (a launch costs the host ~4 us; the sum of a piece already
        # in device memory is short beside the copies that bring the next one).
        table, parts = wait_table(p.plan, p.maxw), wait_parts(p.plan, p.maxw)
        self.sum_parts = [PART_NONE] * (p.maxw - 1) + [PART_WHOLE]
        self.words = {op: ce_words(table[int(op)], parts[int(op)][:p.world] + [self.sum_parts],
                                   p.rank, op == Op.RS) for op in Op}
        # The all-to-all's receiver: the reduce-scatter's words, each source's part copied
        # into the result as the all-gather's (no sums; docs/PROTOCOL.md "All-to-all").
        self.copy_words = ce_words(table[int(Op.RS)], parts[int(Op.RS)][:p.world], p.rank,
                                   False)
        self.sum_parts_dev = p.gpu.to_device(torch.tensor(self.sum_parts, dtype=torch.int32))
        self.programs: dict = {}  # key -> CeProgram (all dropped when MAX_CE_PLANS are kept)
        self.stats = {"hits": 0, "misses": 0}
        self.sums = None  # (stream, events) of the reduce-scatter sums, made on first use
        self.events: list[int] | None = None  # fork and join events, made on first use
        self.stream_handles: tuple | None = None  # the terms of its streams, once all exist
        # The publish ring's entries as the host writes them (_issue: where the copy
        # engines send, the host writes the fields, the streams only the tags).
        words = layout.RING_ENTRIES * layout.RING_ENTRY_BYTES // 8
        view = (ctypes.c_uint64 * words).from_address(p.ctl + layout.RING_OFFSET)
        self.ring_host = np.frombuffer(view, dtype=np.uint64).reshape(layout.RING_ENTRIES, -1)

    def close(self) -> None:
        """Free the events (the programs name them, so they go too) and the sums' stream."""
        self.programs.clear()
        self.stream_handles = None
        events = list(self.events or ())
        self.events = None
        if self.sums is not None:
            events += self.sums[1]
            self.plane.gpu.close_stream(self.sums[0])
            self.sums = None
        if events:
            self.plane.gpu.destroy_events(events)

    def run(self, call: DirectCall) -> None:
        """The collective's program (:meth:`_program`) with this call's terms, in one native
        call; kept as the shape's plan when the call is being planned."""
        wait = call.wait_args(self.plane)  # (sccl_advance moves the device state on)
        args = (call.direct_args(self.plane, wait), wait)
        params = _call_params(call, args[0])
        p = self._program(call, args, params)
        stage = (self.plane.scratch("ce stage", self.plane.world * call.S).data_ptr()
                 if call.sum_kernel is not None and call.ce_consume else 0)
        self._issue(p, call.seq, call.first, self.plane.gpu.stream_term(call.ts), call.ts,
                       _call_args(call, params), stage)
        self.plane.direct_launches += 1
        if self.plane.plans.recording():
            self.plane.plans.plannable(direct=True, plan=CePlan(p, stage))

    def issue_plan(self, plan: CePlan, seq: int, args: tuple) -> bool:
        """A planned mode "ce" call (cuda.py _planned): the program with this call's terms.
        False, issuing nothing, while the caller's stream is being captured."""
        caller = self.plane.gpu.caller_stream()
        if caller is None:
            return False
        self._issue(plan.program, seq, self.plane.ring_next, *caller, args, plan.stage)
        return True

    def _issue(self, p: CeProgram, seq: int, first: int, stream_term: int, ts, args,
                  stage: int) -> None:
        """Issue program ``p`` for collective ``seq`` at ring index ``first`` on the caller's
        stream. The ring entries' fields are the host's to write where the copy engines send
        (their streams write only the tags), so the host first waits for their room."""
        if p.host_ring:
            self._host_ring_room(p.op, seq, first, PIECES)
            p.ring_rows[:, 0] = seq
            i = first % layout.RING_ENTRIES
            if i + PIECES <= layout.RING_ENTRIES:
                self.ring_host[i:i + PIECES, 1:7] = p.ring_rows
            else:
                self.ring_host[[(first + c) % layout.RING_ENTRIES for c in range(PIECES)],
                               1:7] = p.ring_rows
        terms = self._terms(seq, first, stream_term, args, stage)
        self.plane.issued(self.plane.gpu.run_program(p.program, terms, ts), ts)

    def _host_ring_room(self, op: Op, seq: int, first: int, n: int) -> None:
        """Wait until ring indices first .. first + n - 1 are free: the host writes those
        entries' fields itself (every kernel waits on the GPU: kernels/wait.cu ring_room)."""
        p = self.plane
        tail = _u64(p.ctl + layout.CTL_RING_TAIL)
        last = first + n - 1
        if last - int(tail.value) >= layout.RING_ENTRIES:
            deadline = time.monotonic() + p.timeout_s
            spins = 0
            while last - int(tail.value) >= layout.RING_ENTRIES:
                p.check_abort()
                if time.monotonic() > deadline:
                    what = p.name_of(seq) or OP_NAMES[op]  # (an all-to-all is op RS)
                    p.fail(f"rank {p.rank}: timed out after {p.timeout_s:g} s waiting for "
                           f"space in the publish ring for {what} seq {seq} (the proxy "
                           "is not consuming it, or the GPU is not running this rank's "
                           "earlier collectives)", layout.ABORT_TIMEOUT)
                spins += 1
                time.sleep(0 if spins < 100 else 50e-6)

    def _terms(self, seq: int, first: int, stream_term: int, args, stage: int) -> list:
        """The terms of a call (see T_*): all of them follow from its seq, ring index,
        stream and pointers (``args``, by CallPtr argument)."""
        t = [0] * N_TERMS
        t[T_TS] = stream_term
        t[T_SIDE], t[T_WATCH], t[T_SUMS] = self._stream_terms()
        t[T_FLAG] = (flag_value(seq, 0) - flag_value(0, 0)) & _MASK
        t[T_PROG] = (seq * PROG_STRIDE) & _MASK
        t[T_FIRST] = first
        t[T_STAGE] = stage
        tags = ring(self.plane) + layout.ENT_TAG
        for c in range(PIECES):
            t[T_TAG + c] = tags + ((first + c) % layout.RING_ENTRIES) * layout.RING_ENTRY_BYTES
        t[T_ARG:T_ARG + len(args)] = args
        for i, m in enumerate(CE_MODS):
            t[T_MOD + i] = seq % m
        return t

    def _program(self, call: DirectCall, args: tuple, params: tuple) -> CeProgram:
        """The program of this call's shape, from the cache or built now (``stats``
        counts hits and misses). Its key holds every constant that shapes it: the shape, the
        kernels' constant parameters (``params``: _call_params(call)); what varies per call
        is a term (T_*)."""
        op, S, L = call.op, call.S, call.L
        plans, stats = self.programs, self.stats
        host = self.plane.direct.host.get(op)
        words = self.words[op] if op == Op.AG or call.sum_kernel else self.copy_words
        # (a numpy integer hashes and compares as the int of its value)
        key = (op, S, L, call.call, call.kernel, call.wait_kernel, call.sum_kernel, call.nb, call.npub,
               len(call.own), self.plane.on_failure,
               tuple((v.arg, v.add) if type(v) is CallPtr else v for v in params))
        p = plans.get(key)
        if p is not None and p.host is host and p.words is words:
            stats["hits"] += 1
            return p
        stats["misses"] += 1
        if len(plans) >= MAX_CE_PLANS:
            plans.clear()
        p = plans[key] = self._build(call, args, host, words)
        return p

    def _build(self, call: DirectCall, args: tuple, host, words) -> CeProgram:
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
        sums = self._sum_stream() if call.sum_kernel is not None and ce_wait else None
        fork, side_end, watch_end, sums_end = self._sync_events()
        state = self.plane.state.data_ptr()
        waits = wait_params(self.plane, op)
        # The kernel table: parameter words with CallPtr marks become patches (the first
        # word is each launch's own value); the direct, wait and sum kernels take one struct
        # (args: DirectArgs, WaitRoleArgs), whose words a launch passes as they are.
        table = {K_PIECE: ("sccl_wait_piece", 32, (0, S, *waits)),
                 K_PUBLISH: (call.kernel, DIRECT_THREADS, args[0]),
                 K_WAIT: (call.wait_kernel, WAIT_THREADS, args[1]),
                 K_GUARD: ("sccl_fail_guard", 32, waits),
                 K_ADVANCE: ("sccl_advance", 32, (state, PIECES, 0))}
        if sums is not None:  # unit per launch; stage, own (host view): terms; dst: a CallPtr
            table[K_SUM] = (call.sum_kernel, WAIT_THREADS,
                            sum_unit_args(self.plane, 0, 0, 0, hc[2], hc[3], L, S,
                                          self.sum_parts_dev.data_ptr()))
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
                    patches.extend([(i, SU_STAGE_WORD, T_STAGE, 1, 0),
                                    (i, SU_OWN_WORD, term, mult, add)])
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
        pub, recv, ring_rows = self._pieces(op, S, L, call.call, host, words)
        for c in range(PIECES):
            if ce_pub:
                self._publish_rows(row, pub[c], c, _sym(call.ce_src[0]), call.ce_src[1])
            if ce_wait:
                launch(T_WATCH, K_PIECE, unit=c)
                self._receive_rows(row, launch, recv[c], hc, sums, S, nb)
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
        if ce_wait and self.plane.on_failure == "stop":
            # The value waits end when the progress word says so, also when the host
            # released them (_release_waits: no kernel of theirs ran to fail); the copies
            # then moved whatever was there. Before anything after the collective can read
            # it: trap if this data plane failed. (Mode poison runs ce as fused.)
            launch(T_TS, K_GUARD)
        launch(T_TS, K_ADVANCE)
        row(OP_RECORD, T_TS, (self.plane.gpu.done_handle(), T_ZERO, 0))
        program = self.plane.gpu.new_program(kernels, patches, rows)
        return CeProgram(op=op, host=host, words=words, program=program, ring_rows=ring_rows,
                         host_ring=ce_pub)

    def _pieces(self, op: Op, S: int, L: int, call: int, host, words) -> tuple:
        """Per piece, what the sending side copies and flags and what the receiving side's
        units move, and the ring entries' fields (seq filled per call)."""
        pub, recv, rows = [], [], []
        idle1 = root1_idle(S)
        for c in range(PIECES):
            lo, hi = piece_bounds(S, c)
            sends = []
            for flag, items in host or ():
                if idle1 and items and items[0][5].roots == 2 and items[0][5].root == 1:
                    continue  # (an idle root 1 sends nothing: protocol.h root1_idle)
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
                units.append((c * self.plane.maxw + k, moves, sum_here))
            recv.append(units)
            rows.append([0, S, lo, hi, call | c << layout.CALL_PIECE_SHIFT,
                         (layout.CHUNK_DIRECT & 0xFFFFFFFF) | ALIGN << 32])
        return pub, recv, np.array(rows, dtype=np.uint64)

    def _publish_rows(self, row, sends: list, c: int, src: tuple, stride: int) -> None:
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

    def _receive_rows(self, row, launch, units: list, hc: tuple, sums, S: int,
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
        progress = self.plane.state.data_ptr()
        for u, moves, sum_here in units:
            # unit (c, k, last source) of kernels/wait.cu: the relay's last step for word k
            row(OP_WAIT_VALUE, T_TS, (progress, T_ZERO, 0), ((u + 1) * self.plane.world, T_PROG, 1))
            for i, a, n in moves:
                to = ((dst[0] + i * dst_stride + a, dst[1], dst[2]) if sums is None
                      else (i * S + a, T_STAGE, 1))
                row(OP_COPY, T_TS, to, _sym(hc[0] + i * S + a), n)
            if sums is not None and sum_here:
                events = sums[1]
                row(OP_RECORD, T_TS, (events[u], T_ZERO, 0))
                row(OP_WAIT_EVENT, T_SUMS, (events[u], T_ZERO, 0))
                launch(T_SUMS, K_SUM, unit=u, blocks=nb)

    # ---- its streams and events ------------------------------------------------------
    def _stream_terms(self) -> tuple:
        """Mode "ce": the terms of the sending, watch and (reduce-scatter, once made) sums'
        streams (the streams live as long as the data plane: kept once the sums' is made)."""
        kept = self.stream_handles
        if kept is not None:
            return kept
        handles = (self.plane.gpu.stream_term(self.plane.side_stream("side")),
                   self.plane.gpu.stream_term(self.plane.side_stream("watch")),
                   self.plane.gpu.stream_term(self.sums[0] if self.sums is not None else None))
        if self.sums is not None:
            self.stream_handles = handles
        return handles

    def _sum_stream(self) -> tuple:
        """Mode "ce": the reduce-scatter sums' stream and one event per unit (piece, wait
        word), made on first use. The sums of a collective follow the caller's stream's
        earlier work through the first event, and the caller's stream joins the sums' stream
        at the end of each collective (the staging slot is then free again)."""
        if self.sums is None:
            gpu = self.plane.gpu
            self.sums = (gpu.new_stream(), gpu.new_events(PIECES * self.plane.maxw))
        return self.sums

    def _sync_events(self) -> list[int]:
        """Mode "ce": the events of a program's fork (caller's stream -> sending and watch
        streams) and joins (sending, watch, sums' stream -> caller's), made on first use."""
        ev = self.events
        if ev is None:
            ev = self.events = self.plane.gpu.new_events(4)
        return ev
