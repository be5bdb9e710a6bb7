"""The cross-rank check: every rank must make the same call, byte for byte and type for type.

Each collective's publish entries carry its call word (``protocol.h`` ``ENT_OP`` ..
``ENT_PAD``, :func:`sparkccl.layout.call_word`): the op, the caller's dtype, the collective
called with its reduction (all-gather, reduce-scatter, all-reduce of sums or of averages,
the MoE finalize) and the zero bytes the collective carries past the caller's data, so the
caller's exact size crosses ranks, not only its slice padded to 16 bytes. The proxy sends
it, with the slice, as a call entry ahead of the collective's first piece on each stream
(``protocol.h`` ``CALL_SLOTS``; docs/PROTOCOL.md "Call words"), on every transport: a
rank's own entry with its data, a relay forwards the origin's entry ahead of the origin's
data. So every rank holds the own entry of each source whose data it received, and compares
its call with it before it uses that data; any difference fails the communicator with a
:class:`~sparkccl.errors.CollectiveError` naming both calls ("rank 1 passed 12 bytes of
float32 per rank, rank 0 passed 16 bytes of float32"), which the proxy carries to every
other rank as an abort. (Neighbours alone would not do: in a ring a rank two hops from the
one that differs can finish with its data before the abort arrives.)

:class:`PeerCheck` is the comparison both planes use: the CPU plane calls
:meth:`PeerCheck.check` once the first piece of a source arrived (its flag is ordered after
the source's call entry, so the entry is there; nothing is copied out before); the CUDA
plane's GPU waits cannot stop for the host, so it notes the collectives it issues
(:meth:`PeerCheck.note`) and compares them once the sources' entries appear
(:meth:`PeerCheck.run`, before every few calls and at ``synchronize()``;
docs/CONTRACT.md "Failure behaviour").
"""
from __future__ import annotations

import time

import torch

from .. import layout
from ..errors import CollectiveError
from ..plan.model import Op

_P = layout.protocol_constants()

DTYPE_CODES = {
    torch.float32: _P["DTYPE_F32"], torch.float16: _P["DTYPE_F16"],
    torch.bfloat16: _P["DTYPE_BF16"], torch.float64: _P["DTYPE_F64"],
    torch.uint8: _P["DTYPE_U8"], torch.int8: _P["DTYPE_I8"], torch.int16: _P["DTYPE_I16"],
    torch.int32: _P["DTYPE_I32"], torch.int64: _P["DTYPE_I64"], torch.bool: _P["DTYPE_BOOL"],
    torch.complex64: _P["DTYPE_C64"], torch.complex128: _P["DTYPE_C128"],
}
for _name, _code in (("float8_e4m3fn", "DTYPE_F8E4M3"), ("float8_e5m2", "DTYPE_F8E5M2"),
                     ("uint16", "DTYPE_U16"), ("uint32", "DTYPE_U32"), ("uint64", "DTYPE_U64")):
    if hasattr(torch, _name):  # (newer torch versions)
        DTYPE_CODES[getattr(torch, _name)] = _P[_code]
DTYPE_OTHER = _P["DTYPE_OTHER"]
_DTYPE_NAMES = {code: str(dt).replace("torch.", "") for dt, code in DTYPE_CODES.items()}
_DTYPE_NAMES[_P["DTYPE_UNSAID"]] = "bytes"
_DTYPE_NAMES[DTYPE_OTHER] = "another dtype"

ALL_GATHER = _P["KIND_ALL_GATHER"]
REDUCE_SCATTER = _P["KIND_REDUCE_SCATTER_SUM"]
ALL_REDUCE_SUM = _P["KIND_ALL_REDUCE_SUM"]
ALL_REDUCE_AVG = _P["KIND_ALL_REDUCE_AVG"]
MOE_FINALIZE = _P["KIND_MOE_FINALIZE"]
ALL_TO_ALL = _P["KIND_ALL_TO_ALL"]
ALL_TO_ALL_SIZED = _P["KIND_ALL_TO_ALL_SIZED"]
_KIND_NAMES = {_P["KIND_UNSAID"]: "a collective", ALL_GATHER: "all_gather",
               REDUCE_SCATTER: "reduce_scatter", ALL_REDUCE_SUM: "all_reduce(sum)",
               ALL_REDUCE_AVG: "all_reduce(avg)", MOE_FINALIZE: "moe_finalize_reduce_scatter",
               ALL_TO_ALL: "all_to_all", ALL_TO_ALL_SIZED: "all_to_all(sized)"}

# The bits of a call word every rank's entries of one seq must agree on: all but the op
# (an all-reduce publishes RS and AG entries under one seq) and the piece.
SAME_CALL = ~(0xFF | 0xFF << layout.CALL_PIECE_SHIFT) & ((1 << 64) - 1)
_ENTRY = layout.CALL_ENTRY_WORDS
_TAGGED, _SLICE = layout.CALL_TAGGED, layout.CALL_SLICE
_TAG_MASK = layout.CALL_TAG_MASK
_SLICE_MASK = (1 << layout.CALL_SLICE_TAG_SHIFT) - 1
_TAG_SHIFT = layout.CALL_SLICE_TAG_SHIFT
_PIECE_SHIFT = layout.CALL_PIECE_SHIFT
# what a call entry of a seq is, seen from a reader of that seq (see PeerCheck.entry)
THERE, NOT_YET, GONE = 0, 1, 2


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPE_CODES.get(dtype, DTYPE_OTHER)


def call_word(op: Op, dtype: torch.dtype, kind: int, pad: int) -> int:
    """A collective's call word (piece 0): ``pad`` zero bytes past the caller's data."""
    return layout.call_word(int(op), dtype_code(dtype), kind, pad)


def describe(S: int, word: int, world: int) -> str:
    """What a rank called, from its slice and call word: "12 bytes of float32 per rank"."""
    dtype = _DTYPE_NAMES.get(word >> layout.CALL_DTYPE_SHIFT & 0xFF, "an unknown dtype")
    kind = word >> layout.CALL_KIND_SHIFT & 0xFF
    pad = word >> layout.CALL_PAD_SHIFT
    if kind in (ALL_REDUCE_SUM, ALL_REDUCE_AVG):  # pad: over the W chunks
        return f"{world * S - pad} bytes of {dtype} to {_KIND_NAMES[kind]}"
    return f"{S - pad} bytes of {dtype} per rank to {_KIND_NAMES.get(kind, 'a collective')}"


def call_tag(seq: int) -> int:
    """protocol.h ``call_tag``: the tag of seq's call entry."""
    return (seq + 1) & _TAG_MASK


def calls_view(ctl: torch.Tensor, num_flag_words: int) -> memoryview:
    """The call words of a control segment tensor (uint8), as a flat u64 memoryview."""
    start, n = layout.call_area(num_flag_words)
    return memoryview(ctl[start:start + n].numpy()).cast("B").cast("Q")


class PeerCheck:
    """Compare this rank's call with the sources' call entries (``calls``: this rank's call
    words, :func:`calls_view`). ``fail(message, peer)`` records the mismatch as the
    communicator's failure and raises."""

    def __init__(self, rank: int, world: int, calls: memoryview, fail):
        self.rank, self.world = rank, world
        self.calls = calls
        self.fail = fail
        self.others = frozenset(range(world)) - {rank}
        # (op, seq, S, call word, sources not seen) of recent calls, oldest first (the
        # deferred check)
        self.pending: list[tuple] = []

    def entry(self, seq: int, peer: int) -> tuple[int, int, int]:
        """(THERE / NOT_YET / GONE, slice, call word) of peer's call entry for seq: GONE when
        a later seq of the same slot replaced it (CALL_SLOTS collectives on)."""
        base = (peer * layout.CALL_SLOTS + seq % layout.CALL_SLOTS) * _ENTRY
        calls = self.calls
        word, sl = calls[base + _TAGGED], calls[base + _SLICE]
        want = call_tag(seq)
        tags = ((word & 0xFF) | (word >> _PIECE_SHIFT & 0xFF) << 8, sl >> _TAG_SHIFT)
        if tags[0] == want and tags[1] == want:
            return THERE, sl & _SLICE_MASK, word
        # a tag ahead of seq's by less than half the tag space is a later collective's
        if any(0 < (t - want) & _TAG_MASK < _TAG_MASK // 2 for t in tags):
            return GONE, 0, 0
        return NOT_YET, 0, 0

    def check(self, op: Op, seq: int, source: int, S: int, word: int,
              arrived: bool = True) -> None:
        """Every rank must make the same call: compare ours (slice ``S``, call ``word``)
        with the source's own call entry of seq, which arrived before the source's first
        piece (sent by the source, or forwarded ahead of the piece by each relay).
        ``arrived=False``: asked when a wait for the source gave up, where no entry only
        means the source never got this far (a stalled or slower peer: the timeout says
        so), not a broken protocol."""
        state, theirs_S, theirs_word = self.entry(seq, source)
        if state == THERE:
            self.compare(op, seq, source, S, word, theirs_S, theirs_word)
        elif state == NOT_YET and arrived:
            what = _KIND_NAMES.get(word >> layout.CALL_KIND_SHIFT & 0xFF, "a collective")
            self.fail(f"rank {self.rank}: {what} seq {seq}: rank {source}'s data arrived "
                      "without its call entry (the cross-rank check's protocol was broken: "
                      "docs/PROTOCOL.md \"Call words\")", source)

    def compare(self, op: Op, seq: int, source: int, S: int, word: int, theirs_S: int,
                theirs_word: int) -> None:
        if theirs_S == S and not (theirs_word ^ word) & SAME_CALL:
            return
        me, W = self.rank, self.world
        what = _KIND_NAMES.get(word >> layout.CALL_KIND_SHIFT & 0xFF, "a collective")
        theirs = describe(theirs_S, theirs_word, W)
        self.fail(f"rank {me}: {what} seq {seq}: rank {source} made a different call than "
                  f"rank {me} (this rank): rank {source} passed {theirs}, rank {me} passed "
                  f"{describe(S, word, W)}; every rank must pass the same shape, dtype and "
                  "operation", source)

    # ---- deferred (the CUDA plane) ---------------------------------------------------
    # The calls issued are compared once the sources' entries appear (:meth:`run`), oldest
    # first; a source whose entry is not there yet is not asked about later calls (entries
    # arrive in seq order). An entry a later collective of the same slot replaced (the host
    # checked more than CALL_SLOTS collectives late) is dropped unverified.
    KEEP = 64  # calls kept unverified at most (older ones are dropped)

    def note(self, op: Op, seq: int, S: int, word: int) -> None:
        pending = self.pending
        pending.append((op, seq, S, word, self.others))
        if len(pending) > self.KEEP:
            del pending[:-self.KEEP]

    def forget(self) -> None:
        self.pending = []

    def run(self, wait_s: float = 0.0, stop=None) -> None:
        """Compare what can be compared; raise (through the PeerCheck's ``fail``) on a
        difference. ``wait_s`` > 0 (at ``synchronize()``: every collective noted has
        completed here, so each source's entry was sent): wait up to that long for the
        entries still missing, until ``stop()`` says the communicator failed. (Where the
        proxies send the data, the entries came before it; with GPU-direct a source's proxy
        sends its entry just after its GPU wrote the data and flags.)"""
        self._run_once()
        if not self.pending or wait_s <= 0:
            return
        deadline = time.monotonic() + wait_s
        while self.pending and time.monotonic() < deadline and not (stop and stop()):
            time.sleep(20e-6)
            self._run_once()

    def _run_once(self) -> None:
        pending = self.pending
        if not pending:
            return
        keep, waiting = [], set()
        try:
            for item in pending:
                op, seq, S, word, peers = item
                left = []
                for n in sorted(peers):
                    if n in waiting:
                        left.append(n)
                        continue
                    state, theirs_S, theirs_word = self.entry(seq, n)
                    if state == THERE:
                        self.compare(op, seq, n, S, word, theirs_S, theirs_word)
                    elif state == NOT_YET:
                        waiting.add(n)
                        left.append(n)
                if left:
                    keep.append((op, seq, S, word, frozenset(left)))
        except CollectiveError:
            self.pending = []
            raise
        self.pending = keep
