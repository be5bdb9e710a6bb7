"""The shared memory one rank holds: sizes, segments, and the regions in them.

Three segments per rank (docs/PROTOCOL.md "Regions and offsets"): ``ctl`` (control
block, publish ring, flag words), ``ag`` (the all-gather slots) and ``rs`` (reduce-scatter:
the send slots, then the receive slots). ``rs`` is created on the first reduce-scatter unless
``SPARKCCL_RS_UP_FRONT=1``. Every rank computes the same sizes from the agreed settings, so
peers can map each other's segments by size alone.

Every segment's memory is reserved when it is created (:mod:`sparkccl.shm`), so a /dev/shm
too small for it fails here with :class:`~sparkccl.errors.ShmSpaceError`, not later with SIGBUS.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import layout, shm
from .plan.build import build_plan
from .plan.geometry import ALIGN
from .plan.model import REGION_SLOTS, Region

KINDS = ("ctl", "ag", "rs")
LABELS = {"ctl": "control", "ag": "all-gather", "rs": "reduce-scatter"}


@dataclass(frozen=True)
class Sizes:
    """Byte sizes of one rank's regions (the same on every rank)."""

    max_slice: int  # the largest per-rank slice one collective carries
    ag_stride: int
    rs_send_stride: int
    rs_recv_stride: int
    ctl_bytes: int
    ag_bytes: int
    rs_send_bytes: int
    rs_recv_bytes: int

    @classmethod
    def of(cls, slot_bytes: int, world: int, plan) -> "Sizes":
        max_slice = (slot_bytes // world) // ALIGN * ALIGN
        if max_slice < ALIGN:
            raise ValueError(f"slot_bytes={slot_bytes} is too small for world {world}")
        ag_stride = layout.slot_stride(slot_bytes)
        rs_recv_stride = layout.slot_stride(plan.rs_recv_blocks * max_slice)
        return cls(max_slice=max_slice, ag_stride=ag_stride, rs_send_stride=ag_stride,
                   rs_recv_stride=rs_recv_stride,
                   ctl_bytes=layout.control_bytes(plan.num_flag_words),
                   ag_bytes=REGION_SLOTS[Region.AG] * ag_stride,
                   rs_send_bytes=REGION_SLOTS[Region.RS_SEND] * ag_stride,
                   rs_recv_bytes=REGION_SLOTS[Region.RS_RECV] * rs_recv_stride)

    @property
    def rs_bytes(self) -> int:
        return self.rs_send_bytes + self.rs_recv_bytes

    def segment_bytes(self, kind: str) -> int:
        return {"ctl": self.ctl_bytes, "ag": self.ag_bytes, "rs": self.rs_bytes}[kind]

    def regions(self, kind: str) -> list[tuple[Region, int, int, int]]:
        """The plan regions in segment ``kind``: (region, offset, stride, size)."""
        if kind == "ag":
            return [(Region.AG, 0, self.ag_stride, self.ag_bytes)]
        if kind == "rs":
            return [(Region.RS_SEND, 0, self.rs_send_stride, self.rs_send_bytes),
                    (Region.RS_RECV, self.rs_send_bytes, self.rs_recv_stride, self.rs_recv_bytes)]
        return []


def bytes_per_rank(world_size: int, topology: str, slot_bytes: int, roots: int = 2) -> int:
    """Shared memory one rank holds once its reduce-scatter buffers exist (for ``sparkccl
    doctor`` and the /dev/shm check)."""
    if world_size < 2:
        return 0  # a single rank moves nothing through shared memory
    return max(sum(Sizes.of(slot_bytes, world_size, build_plan(topology, world_size, r, roots))
                   .segment_bytes(k) for k in KINDS)
               for r in range(world_size))


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def shortage_message(failed: list[tuple[int, str]], per_rank: int, ranks_here: int,
                     slot_bytes: int, world: int) -> str:
    """What to tell every rank when some could not reserve their segments."""
    suggest = -(-(ranks_here * per_rank * 5 // 4) // (64 << 20)) * 64  # +25%, 64 MiB steps
    return ("sparkccl.Communicator: /dev/shm is too small for this communicator:\n  "
            + "\n  ".join(f"rank {i}: {e}" for i, e in failed)
            + f"\nEach rank needs {mib(per_rank)} of /dev/shm (slot {mib(slot_bytes)}, "
            f"world {world}, reduce-scatter buffers included); the {ranks_here} rank(s) on this "
            f"host need {mib(ranks_here * per_rank)}. Fix: give the container more shared "
            f"memory (docker run --shm-size={suggest}m, or remount /dev/shm larger), or lower "
            "SPARKCCL_SLOT_BYTES / slot_bytes= (memory per rank is about 8 x the slot).")


class Buffers:
    """This rank's segments. ``pinned_bytes`` counts what it holds."""

    def __init__(self, token: str, rank: int, sizes: Sizes):
        self.token, self.rank, self.sizes = token, rank, sizes
        self.segments: dict[str, shm.Segment] = {}
        self.pinned_bytes = 0

    def name(self, rank: int, kind: str) -> str:
        return shm.segment_name(self.token, rank, kind)

    def create(self, kind: str) -> shm.Segment:
        """Create, reserve and map segment ``kind`` (ShmSpaceError if /dev/shm is short)."""
        size = self.sizes.segment_bytes(kind)
        seg = shm.Segment.create(self.name(self.rank, kind), size)
        self.segments[kind] = seg
        self.pinned_bytes += size
        return seg

    def has(self, kind: str) -> bool:
        return kind in self.segments

    def __getitem__(self, kind: str) -> shm.Segment:
        return self.segments[kind]

    def memory(self, kind: str) -> dict[Region, tuple[int, int]]:
        """Region -> (address, size) of this rank's segment ``kind``."""
        base = self.segments[kind].addr
        return {reg: (base + off, size) for reg, off, _, size in self.sizes.regions(kind)}

    def wire(self, proxy, kind: str) -> None:
        """Tell the proxy where this rank's regions of segment ``kind`` are."""
        base = self.segments[kind].addr
        for reg, off, stride, size in self.sizes.regions(kind):
            proxy.set_region(int(reg), base + off, stride, size)

    def unlink(self) -> None:
        """Remove this rank's names from /dev/shm (the mappings stay)."""
        for seg in self.segments.values():
            seg.unlink()

    def drop(self, kind: str) -> None:
        """Forget segment ``kind`` (unlinked and unmapped), e.g. when its setup failed."""
        seg = self.segments.pop(kind, None)
        if seg is not None:
            seg.unlink()
            seg.close()
            self.pinned_bytes -= seg.size

    def unlink_every_rank(self, world: int) -> None:
        """Every rank's names (a rank killed before its peers mapped its segments leaves
        them to the survivors; unlinking a name that is not there is harmless)."""
        for p in range(world):
            for kind in KINDS:
                shm.unlink_name(self.name(p, kind))

    def close(self) -> None:
        for seg in self.segments.values():
            seg.unlink()
            seg.close()
        self.segments.clear()
