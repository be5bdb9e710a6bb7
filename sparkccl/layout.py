"""Byte layout of the memory a rank shares with its proxy and its peers.

The values are defined once, in ``sparkccl/include/sparkccl/protocol.h``: the native layer
and the CUDA kernels compile that header, and this module reads its ``constexpr`` lines at
import time (the header ships inside the package). Reading the text, rather than asking the
native module, keeps the plan layer and ``sparkccl plan`` free of the native build;
``tests/test_native.py`` checks that what ``_native.layout()`` was compiled with equals
what is read here.

Each rank owns three shared segments:

* control: the control block (abort word, error text, publish-ring indices), then the
  publish ring, then the flag words, the call words and the LL area (the one-shot
  all-reduce's lines between GPU-direct peers);
* ag: the all-gather region (3 slots);
* rs: the reduce-scatter send region (2 slots) then the receive region (2 slots), created
  on first reduce-scatter (or up front when asked) so that pure all-gather users do not
  hold the memory.
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

PROTOCOL_H = Path(__file__).with_name("include") / "sparkccl" / "protocol.h"

_CONSTEXPR = re.compile(r"^\s*constexpr\s+(?:int|pu64)\s+([A-Z][A-Z0-9_]*)\s*=\s*([^;]+);",
                        re.M)
_SUFFIX = re.compile(r"\b(0[xX][0-9A-Fa-f]+|\d+)(?:ull|ULL|ll|LL|u|U)\b")
_OPS = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load, ast.Add,
        ast.Sub, ast.Mult, ast.LShift, ast.USub)


@lru_cache(maxsize=None)
def protocol_constants() -> dict[str, int]:
    """Every ``constexpr`` integer of protocol.h, by name (names are unique across its
    namespaces)."""
    text = PROTOCOL_H.read_text()
    out: dict[str, int] = {}
    for name, expr in _CONSTEXPR.findall(text):
        expr = _SUFFIX.sub(r"\1", expr.strip())
        tree = ast.parse(expr, mode="eval")
        for node in ast.walk(tree):
            if not isinstance(node, _OPS) or (isinstance(node, ast.Name) and node.id not in out):
                raise ValueError(f"{PROTOCOL_H}: cannot read {name} = {expr}")
        if name in out:
            raise ValueError(f"{PROTOCOL_H}: {name} defined twice")
        out[name] = int(eval(compile(tree, str(PROTOCOL_H), "eval"), {"__builtins__": {}}, out))
    return out


_P = protocol_constants()

PAGE = _P["PAGE"]

# Control block (offsets in bytes from the start of the control segment).
CTL_MAGIC = _P["CTL_MAGIC"]
CTL_ABORT = _P["CTL_ABORT"]
CTL_RING_HEAD = _P["CTL_RING_HEAD"]
CTL_RING_TAIL = _P["CTL_RING_TAIL"]
CTL_PID = _P["CTL_PID"]
CTL_GPU_STATUS = _P["CTL_GPU_STATUS"]
CTL_GPU_DETAIL = _P["CTL_GPU_DETAIL"]
CTL_GPU_SEQ = _P["CTL_GPU_SEQ"]
CTL_GPU_ACK = _P["CTL_GPU_ACK"]
CTL_GPU_MODE = _P["CTL_GPU_MODE"]
CTL_LEFT = _P["CTL_LEFT"]
CTL_ERROR = _P["CTL_ERROR"]
ERROR_BYTES = _P["ERROR_BYTES"]
CTL_BYTES = _P["CTL_BYTES"]
CTL_MAGIC_VALUE = _P["CTL_MAGIC_VALUE"]

ABORT_NONE = _P["ABORT_NONE"]
ABORT_TIMEOUT = _P["ABORT_TIMEOUT"]
ABORT_TRANSPORT = _P["ABORT_TRANSPORT"]
ABORT_PEER = _P["ABORT_PEER"]
ABORT_USER = _P["ABORT_USER"]

# Publish ring entries and their fields.
RING_OFFSET = _P["RING_OFFSET"]
RING_ENTRIES = _P["RING_ENTRIES"]
RING_ENTRY_BYTES = _P["RING_ENTRY_BYTES"]
ENT_TAG = _P["ENT_TAG"]
ENT_SEQ = _P["ENT_SEQ"]
ENT_SLICE = _P["ENT_SLICE"]
ENT_LO = _P["ENT_LO"]
ENT_HI = _P["ENT_HI"]
ENT_OP = _P["ENT_OP"]
ENT_DTYPE = _P["ENT_DTYPE"]
ENT_KIND = _P["ENT_KIND"]
ENT_PIECE = _P["ENT_PIECE"]
ENT_PAD = _P["ENT_PAD"]
CALL_DTYPE_SHIFT = _P["CALL_DTYPE_SHIFT"]
CALL_KIND_SHIFT = _P["CALL_KIND_SHIFT"]
CALL_PIECE_SHIFT = _P["CALL_PIECE_SHIFT"]
CALL_PAD_SHIFT = _P["CALL_PAD_SHIFT"]
ENT_CHUNK = _P["ENT_CHUNK"]
ENT_GRANULE = _P["ENT_GRANULE"]
ENT_PUBLISH_NS = _P["ENT_PUBLISH_NS"]
CHUNK_ALL = _P["CHUNK_ALL"]
CHUNK_DIRECT = _P["CHUNK_DIRECT"]
CHUNK_LL = _P["CHUNK_LL"]
CHUNK_WHOLE = _P["CHUNK_WHOLE"]

FLAGS_OFFSET = _P["FLAGS_OFFSET"]
FLAG_BYTES = _P["FLAG_BYTES"]
FLAG_WORDS_PER_RANK = _P["FLAG_WORDS_PER_RANK"]
CALL_SLOTS = _P["CALL_SLOTS"]
CALL_ENTRY_WORDS = _P["CALL_ENTRY_WORDS"]
CALL_TAGGED = _P["CALL_TAGGED"]
CALL_SLICE = _P["CALL_SLICE"]
CALL_SIZED = _P["CALL_SIZED"]  # a sized all-to-all's chunk lengths, for the relays
CALL_SIZED_CHUNKS = _P["CALL_SIZED_CHUNKS"]
CALL_LEN_BITS = _P["CALL_LEN_BITS"]
CALL_LEN_UNKNOWN = _P["CALL_LEN_UNKNOWN"]
CALL_TAG_MASK = _P["CALL_TAG_MASK"]
CALL_SLICE_TAG_SHIFT = _P["CALL_SLICE_TAG_SHIFT"]


def call_word(op: int, dtype: int, kind: int, pad: int) -> int:
    """The call word of a publish entry (the u64 at ENT_OP; protocol.h ``call_word``), piece
    0: op, dtype code, collective kind and padding."""
    return (op | dtype << CALL_DTYPE_SHIFT | kind << CALL_KIND_SHIFT
            | pad << CALL_PAD_SHIFT)


@lru_cache(maxsize=None)
def _struct_fields(prefix: str) -> tuple[dict[str, int], int]:
    """({FIELD: word index}, words) of protocol.h argument struct ``prefix``."""
    names = {k[len(prefix) + 1:]: v // 8 for k, v in _P.items()
             if k.startswith(prefix + "_") and k != prefix + "_BYTES"}
    return names, _P[prefix + "_BYTES"] // 8


def pack_struct(prefix: str, fields: dict[str, int | list]) -> list[int]:
    """The u64 words of a protocol.h argument struct (namespace ``kargs``) whose field
    offsets are the constants ``{prefix}_{FIELD}`` and whose size is ``{prefix}_BYTES``:
    every field given once by name (``fields``: FIELD -> value), none left out. A field that
    is itself a struct takes the list :func:`pack_struct` made of it. Values are kept as
    given (a launch plan's call pointers, ``launch_plan.CallPtr``, keep their mark)."""
    names, n = _struct_fields(prefix)
    if fields.keys() != names.keys():
        raise ValueError(f"{prefix}: fields {sorted(fields)} are not {sorted(names)}")
    words = [0] * n
    for name, value in fields.items():
        at = names[name]
        if type(value) is list:
            if at + len(value) > n or any(at < o < at + len(value) for o in names.values()):
                raise ValueError(f"{prefix}_{name}: {len(value)} words overlap the next field")
            words[at:at + len(value)] = value
        else:
            words[at] = value
    return words


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def flag_section_words(num_flag_words: int) -> int:
    """u64 words after FLAGS_OFFSET: the flag words, then the call words (protocol.h
    ``CALL_SLOTS``: an entry per source rank and seq slot)."""
    world = num_flag_words // FLAG_WORDS_PER_RANK
    return num_flag_words + world * CALL_SLOTS * CALL_ENTRY_WORDS


def call_area(num_flag_words: int) -> tuple[int, int]:
    """(byte offset in the control segment, bytes) of the call words."""
    start = FLAGS_OFFSET + num_flag_words * FLAG_BYTES
    return start, (flag_section_words(num_flag_words) - num_flag_words) * FLAG_BYTES


LL_SLOTS = _P["LL_SLOTS"]
LL_SOURCE_BYTES = _P["LL_SOURCE_BYTES"]
LL_MAX_BYTES = _P["LL_MAX_BYTES"]


def ll_area(num_flag_words: int) -> tuple[int, int]:
    """(byte offset in the control segment, bytes) of the LL area (protocol.h ``LL_SLOTS``):
    page-aligned after the call words, a block per (slot, source rank)."""
    world = num_flag_words // FLAG_WORDS_PER_RANK
    start = _round_up(FLAGS_OFFSET + flag_section_words(num_flag_words) * FLAG_BYTES, PAGE)
    return start, LL_SLOTS * world * LL_SOURCE_BYTES


def control_bytes(num_flag_words: int) -> int:
    start, n = ll_area(num_flag_words)
    return _round_up(start + n, PAGE)


def slot_stride(slot_bytes: int) -> int:
    """Slots start on page boundaries."""
    return _round_up(max(slot_bytes, 1), PAGE)
