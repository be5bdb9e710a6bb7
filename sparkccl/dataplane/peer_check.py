"""The cross-rank check: every rank must make the same call, byte for byte and type for type.

Each collective's publish entries carry its call word (``protocol.h`` ``ENT_OP`` ..
``ENT_PAD``, :func:`sparkccl.layout.call_word`): the op, the caller's dtype, the collective
called with its reduction (all-gather, reduce-scatter, all-reduce of sums or of averages,
the MoE finalize) and the zero bytes the collective carries past the caller's data, so the
caller's exact size crosses ranks, not only its slice padded to 16 bytes. A rank compares
its own call with a peer's entry of the same seq (the peer's publish ring, mapped here);
any difference fails the communicator with a :class:`~sparkccl.errors.CollectiveError`
naming both calls ("rank 1 passed 12 bytes of float32 per rank, rank 0 passed 16 bytes of
float32"), which the proxy carries to every other rank.

:class:`PeerCheck` is the comparison both planes use: the CPU plane calls
:meth:`PeerCheck.check` once the first piece of a source arrived (before anything is copied
out); the CUDA plane's GPU waits cannot stop for the host, so it notes the collectives it
issues (:meth:`PeerCheck.note`) and compares them once the peers' entries appear
(:meth:`PeerCheck.run`, before every few calls and at ``synchronize()``;
docs/CONTRACT.md "Failure behaviour").
"""
from __future__ import annotations

import torch

from .. import layout
from ..errors import CollectiveError
from ..plan.geometry import PIECES
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
_KIND_NAMES = {_P["KIND_UNSAID"]: "a collective", ALL_GATHER: "all_gather",
               REDUCE_SCATTER: "reduce_scatter", ALL_REDUCE_SUM: "all_reduce(sum)",
               ALL_REDUCE_AVG: "all_reduce(avg)", MOE_FINALIZE: "moe_finalize_reduce_scatter"}

# The bits of a call word every rank's entries of one seq must agree on: all but the op
# (an all-reduce publishes RS and AG entries under one seq) and the piece.
SAME_CALL = ~(0xFF | 0xFF << layout.CALL_PIECE_SHIFT) & ((1 << 64) - 1)
ROW_WORDS = layout.RING_ENTRY_BYTES // 8
_SEQ, _SLICE, _CALL = layout.ENT_SEQ // 8, layout.ENT_SLICE // 8, layout.ENT_OP // 8


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


class PeerCheck:
    """Compare this rank's call with the peers' publish entries (``peer_rings[p]``: uint64
    ``[RING_ENTRIES, 8]`` view of peer p's ring, None for this rank). ``fail(message,
    peer)`` records the mismatch as the communicator's failure and raises."""

    def __init__(self, rank: int, world: int, peer_rings: list, fail):
        self.rank, self.world = rank, world
        self.rings = peer_rings
        self.fail = fail
        self._hint = [0] * world  # where each peer's last matching entry was
        self.others = frozenset(range(world)) - {rank}
        # (op, seq, S, call word, first ring index, peers not seen) of recent calls, oldest
        # first (the deferred check)
        self.pending: list[tuple] = []
        # flat uint64 views (indexing a memoryview costs a third of numpy's item())
        self._words = [None if r is None else memoryview(r).cast("B").cast("Q")
                       for r in peer_rings]

    def check(self, op: Op, seq: int, source: int, S: int, word: int) -> bool:
        """Every rank must make the same call: compare ours (slice ``S``, call ``word``)
        with the source's own entry of ``seq``, probing first the entries right after the
        source's last match (a source publishes its collectives in order). False while
        that entry has not appeared yet (nothing compared)."""
        ring = self._words[source]
        if ring is None:
            return True
        n = layout.RING_ENTRIES
        hint = self._hint[source]
        for k in range(2 * PIECES):
            row = (hint + k) % n * ROW_WORDS
            if ring[row + _SEQ] == seq and ring[row]:
                self._hint[source] = (hint + k + 1) % n
                self.compare(op, seq, source, S, word, ring[row + _SLICE], ring[row + _CALL])
                return True
        rows = self.rings[source]
        found = ((rows[:, _SEQ] == seq) & (rows[:, 0] != 0)).nonzero()[0]
        if len(found) == 0:
            return False
        row = int(found[0]) * ROW_WORDS
        self.compare(op, seq, source, S, word, ring[row + _SLICE], ring[row + _CALL])
        return True

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
    # The calls issued are compared once the peers' entries appear (:meth:`run`), oldest
    # first, one ring row per peer (:meth:`_probe`); a peer whose entry is not there yet is
    # not asked about later calls (a rank publishes its collectives in order).
    #
    # Only while the entry cannot be overwritten: a peer's GPU publishes collective s + 1
    # only after its s ended, which needed this rank's pieces, so its ring index is at most
    # about two collectives past this host's; an entry further back than RING_ENTRIES less
    # that margin may be being rewritten by the peer's next lap (a torn read would report a
    # mismatch that is not there) and is dropped unverified.
    KEEP = 64  # calls kept unverified at most (older ones are dropped)

    def note(self, op: Op, seq: int, S: int, word: int, first: int) -> None:
        pending = self.pending
        pending.append((op, seq, S, word, first, self.others))
        if len(pending) > self.KEEP:
            del pending[:-self.KEEP]

    def forget(self) -> None:
        self.pending = []

    def run(self, ring_next: int) -> None:
        """Compare what can be compared; raise (through the PeerCheck's ``fail``) on a
        difference. ``ring_next``: the host's next ring index."""
        pending = self.pending
        if not pending:
            return
        world = self.world
        oldest = ring_next - layout.RING_ENTRIES + 2 * PIECES * world
        keep, waiting, others = [], set(), world - 1
        try:
            for k, item in enumerate(pending):
                if len(waiting) == others:
                    keep.extend(pending[k:])
                    break
                op, seq, S, word, first, peers = item
                if first < oldest:
                    continue
                left = [p for p in sorted(peers)
                        if p in waiting or not self._probe(op, seq, S, word, first, p)]
                waiting.update(left)
                if len(left) == len(peers):
                    keep.append(item)
                elif left:
                    keep.append((op, seq, S, word, first, frozenset(left)))
        except CollectiveError:
            self.pending = []
            raise
        self.pending = keep

    def _probe(self, op: Op, seq: int, S: int, word: int, first: int, peer: int) -> bool:
        """:meth:`PeerCheck.check` reading one row: every rank takes the same ring entries
        per collective, so the peer's entry of seq sits at this rank's index ``first`` (tag
        first + 1). An older tag there: not published yet. A newer one: the rings went
        apart (e.g. ranks of a finalize on different engines), so scan the whole ring; a tag
        a lap or more newer: the entry is gone (nothing to compare)."""
        ring = self._words[peer]
        if ring is None:
            return True
        i = (first % layout.RING_ENTRIES) * ROW_WORDS
        tag, theirs = ring[i], ring[i + _SEQ]
        if tag == first + 1 and theirs == seq:
            self.compare(op, seq, peer, S, word, ring[i + _SLICE], ring[i + _CALL])
            return True
        if tag < first + 1 or (tag == first + 1 and theirs < seq):
            return False
        if tag > first + layout.RING_ENTRIES:
            return True
        return self.check(op, seq, peer, S, word)
