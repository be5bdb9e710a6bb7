"""Piece and half arithmetic: the one place where byte bounds are computed.

Every executor (the verifier, the native proxy, the CPU twin and the CUDA kernels) cuts
slices the same way. The constants, and the C++ form of these few functions that the
native proxy and the kernels share, are in ``sparkccl/include/sparkccl/protocol.h``;
tests compare this module with the compiled form over many sizes (tests/test_native.py,
and the kernels' ``sccl_piece_bounds`` in tests/test_cuda_dataplane.py).
"""
from __future__ import annotations

from typing import NamedTuple

from ..layout import protocol_constants

PIECES: int = protocol_constants()["PIECES"]
"""Each collective's slice is cut into this many pieces (docs/PROTOCOL.md)."""

ALIGN: int = protocol_constants()["ALIGN"]
"""Piece boundaries and half splits fall on multiples of this many bytes."""

ROOT_SPLIT_MIN: int = protocol_constants()["ROOT_SPLIT_MIN"]
"""A piece of at most this many bytes is not split between two roots: root 0 carries it."""

FLAG_STRIDE: int = protocol_constants()["FLAG_STRIDE"]
"""Flag value for (seq, piece c) is ``seq * FLAG_STRIDE + c + 1``."""


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def piece_step(slice_bytes: int, granule: int = ALIGN) -> int:
    """Bytes per piece: slice/8 rounded up to the granule (16 bytes, or a row for finalize)."""
    return round_up(-(-slice_bytes // PIECES), granule)


def piece_bounds(slice_bytes: int, piece: int, granule: int = ALIGN) -> tuple[int, int]:
    """Byte range ``[lo, hi)`` of piece ``piece`` within one slice."""
    if not 0 <= piece < PIECES:
        raise ValueError(f"piece {piece} out of range 0..{PIECES - 1}")
    step = piece_step(slice_bytes, granule)
    lo = min(slice_bytes, piece * step)
    hi = slice_bytes if piece == PIECES - 1 else min(slice_bytes, (piece + 1) * step)
    return lo, hi


def sized_bytes(h: int, L: int) -> int:
    """A sized all-to-all's chunk of ``L`` bytes whose first 8 bytes say ``h``: the bytes
    that travel (``h`` rounded up to ALIGN, at least ALIGN, at most ``L``)."""
    return L if h >= L else min(round_up(max(h, 8), ALIGN), L)


def root1_idle(slice_bytes: int, granule: int = ALIGN) -> bool:
    """Whether a collective of this slice leaves root 1 idle: every piece goes whole on
    root 0 (piece 0, the largest, is at most ROOT_SPLIT_MIN bytes), so root 1's streams
    send nothing for it (no call entry, no flag) and no reader waits for its flag words
    (protocol.h ``root1_idle``; docs/PROTOCOL.md "Geometry")."""
    return piece_bounds(slice_bytes, 0, granule)[1] <= ROOT_SPLIT_MIN


def waited_words(words, slice_bytes: int, granule: int = ALIGN) -> list[int]:
    """Of a source's wait words (flag word indices), those a collective of this slice
    waits for: root 1's are left out where :func:`root1_idle` (a flag word's root is its
    index modulo 2: ``sparkccl.plan.model.flag_word``)."""
    if not root1_idle(slice_bytes, granule):
        return list(words)
    return [w for w in words if w % 2 == 0]


def split_point(lo: int, hi: int) -> int:
    """Where ``[lo, hi)`` splits in two: at len/2 rounded up to 16, clamped to the range."""
    n = hi - lo
    return lo + min(n, round_up(-(-n // 2), ALIGN))


class Part(NamedTuple):
    """Which sub-range of a piece an item carries.

    First the piece is split between the roots (``root`` of ``roots``), then that root's
    share is split between travel directions (``half`` of ``halves``). A count of 1
    means no split at that level.
    """

    root: int
    roots: int
    half: int
    halves: int


def sub_range(lo: int, hi: int, part: Part) -> tuple[int, int]:
    """The byte range of ``part`` within piece ``[lo, hi)``: a piece of at most
    ROOT_SPLIT_MIN bytes goes whole on root 0 (root 1's range is empty)."""
    if part.roots == 2:
        h = hi if hi - lo <= ROOT_SPLIT_MIN else split_point(lo, hi)
        lo, hi = (lo, h) if part.root == 0 else (h, hi)
    if part.halves == 2:
        h = split_point(lo, hi)
        lo, hi = (lo, h) if part.half == 0 else (h, hi)
    return lo, hi


def cut(lo: int, hi: int, part: Part, length: int) -> tuple[int, int]:
    """The bytes of ``part`` of piece ``[lo, hi)`` that lie below ``length`` (past it the
    slice is padding, never copied out)."""
    a, e = sub_range(lo, hi, part)
    return min(a, length), min(e, length)


def flag_value(seq: int, piece: int) -> int:
    return seq * FLAG_STRIDE + piece + 1
