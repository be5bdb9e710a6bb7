"""Byte layout of the memory a rank shares with its proxy and its peers.

The native proxy has the same constants in ``native/src/layout.h``; ``_native.layout()``
returns them and a test checks both agree.

Each rank owns three shared segments:

* control: the control block (abort word, error text, publish-ring indices), then the
  publish ring, then the flag words;
* ag: the all-gather region (3 slots);
* rs: the reduce-scatter send region (2 slots) then the receive region (2 slots), created
  on first reduce-scatter (or up front when asked) so that pure all-gather users do not
  hold the memory.
"""
from __future__ import annotations

from .plan.geometry import round_up

PAGE = 4096

# Control block (offsets in bytes from the start of the control segment).
CTL_MAGIC = 0  # u64: CTL_MAGIC_VALUE once initialised
CTL_ABORT = 8  # u64: 0 while healthy; an ABORT_* code once anything failed
CTL_RING_HEAD = 16  # u64: ring entries claimed by producers (next index)
CTL_RING_TAIL = 24  # u64: ring entries consumed by the proxy
CTL_PID = 32  # u64: owning process id (peers check it is alive)
CTL_ERROR = 1024  # char[ERROR_BYTES]: NUL-terminated text of the first failure
ERROR_BYTES = 1024
CTL_BYTES = PAGE
CTL_MAGIC_VALUE = 0x5350524B43434C31  # "SPRKCCL1"

ABORT_NONE = 0
ABORT_TIMEOUT = 1  # a data-plane wait ran past its timeout
ABORT_TRANSPORT = 2  # a write or flag could not be delivered
ABORT_PEER = 3  # a peer died or aborted
ABORT_USER = 4  # close() or an explicit abort

# Publish ring: 256 entries of 64 bytes right after the control block.
RING_OFFSET = CTL_BYTES
RING_ENTRIES = 256
RING_ENTRY_BYTES = 64
# Entry fields (byte offsets inside one entry). tag = index + 1 is written last, after a
# release fence; the proxy consumes entries strictly in index order by polling the tag.
ENT_TAG = 0  # u64
ENT_SEQ = 8  # u64
ENT_SLICE = 16  # u64 slice bytes (per-rank slice / chunk)
ENT_LO = 24  # u64 piece bounds inside the slice
ENT_HI = 32  # u64
ENT_OP = 40  # u32 Op
ENT_PIECE = 44  # u32
ENT_CHUNK = 48  # i32: -1 = every chunk of the piece; j = only chunk j (finalize)
ENT_GRANULE = 52  # u32: piece step granule (16, or row bytes for finalize)

FLAGS_OFFSET = RING_OFFSET + RING_ENTRIES * RING_ENTRY_BYTES
FLAG_BYTES = 8


def control_bytes(num_flag_words: int) -> int:
    return round_up(FLAGS_OFFSET + num_flag_words * FLAG_BYTES, PAGE)


def slot_stride(slot_bytes: int) -> int:
    """Slots start on page boundaries."""
    return round_up(max(slot_bytes, 1), PAGE)
