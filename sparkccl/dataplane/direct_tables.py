"""GPU-direct for the CUDA data plane: the peers' segments mapped into this process (pinned
for the device) and, per op, the stream table the direct kernels and mode "ce" execute:
this rank's publish-triggered streams of the plan, each item with the device address of
its destination region (layout in kernels/direct.cu)."""
from __future__ import annotations

import torch

from .. import layout
from ..plan.model import REGION_SLOTS, Op, RankPlan, Region
from ..plan.waits import part_code
from .base import OP_NAMES

_P = layout.protocol_constants()
MAX_DIRECT = _P["MAX_DIRECT"]  # GPU-executed streams per op
DT_STREAM, DT_ITEM = _P["DT_STREAM"], _P["DT_ITEM"]  # u64 per stream row, per item row


def _row(width: int, **fields: int) -> list[int]:
    """A direct-table row: each field (a protocol.h DT_* name) at its index."""
    row = [0] * width
    for name, value in fields.items():
        row[_P[name]] = value
    return row


class DirectTables:
    """``register_peer(addr, bytes)``: pins a peer's mapped segment (device address);
    ``to_device``: copies a host tensor to the device. ``host[op]``: the table as host
    tuples for mode "ce", ``[(flag pointer, [(chunk, base, stride, slots, dst block,
    Part)])]``; ``tables[op]``: (device table, (slots-1)*stride, blocks, room)."""

    def __init__(self, plan: RankPlan, rank: int, register_peer, to_device):
        self.plan, self.rank = plan, rank
        self._register_peer, self._to_device = register_peer, to_device
        self.peers: dict[tuple[int, str], tuple[int, int]] = {}  # (peer, kind) -> (dev, bytes)
        self.tables: dict[Op, tuple] = {}
        self.host: dict[Op, list] = {}

    def map(self, kind: str, peers: dict[int, tuple[int, int]]) -> None:
        """Pin the peers' segments of ``kind`` ("ctl", "ag"), ``{peer: (address, bytes)}``."""
        for p, (addr, n) in peers.items():
            if (p, kind) not in self.peers:
                self.peers[(p, kind)] = (self._register_peer(addr, n), n)

    def map_rs(self, rs: dict[int, tuple[int, int]], send_bytes: int) -> None:
        """The peers' reduce-scatter segments: send slots, then from ``send_bytes`` on the
        receive slots."""
        for p, (addr, n) in rs.items():
            if (p, "rs") not in self.peers:
                dev = self._register_peer(addr, n)
                self.peers[(p, "rs")] = (dev, n)
                self.peers[(p, "rs_recv")] = (dev + send_bytes, n - send_bytes)

    def build(self, op: Op, stride: int) -> bool:
        """The stream table of sccl_*_direct for ``op`` (destination slot stride ``stride``);
        False, building nothing, if a peer it writes to is not mapped."""
        plan, me = self.plan, self.rank
        kind = "ag" if op == Op.AG else "rs_recv"
        slots = REGION_SLOTS[Region.AG] if op == Op.AG else REGION_SLOTS[Region.RS_RECV]
        rows, items, blocks, room, host = [], [], 1, None, []
        for k in plan.publish_streams():
            st = plan.streams[k]
            if st.op != op:
                continue
            peer = plan.connections[st.conn].peer
            if (peer, "ctl") not in self.peers or (peer, kind) not in self.peers:
                return False
            flags = self.peers[(peer, "ctl")][0] + layout.FLAGS_OFFSET
            base, nbytes = self.peers[(peer, kind)]
            room = nbytes if room is None else min(room, nbytes)
            rows.append(_row(DT_STREAM, DT_FLAG=flags + layout.FLAG_BYTES * st.dst_flag,
                             DT_FIRST=len(items), DT_ITEMS=len(st.items)))
            host.append((rows[-1][0], []))
            for it in st.items:
                if op == Op.AG:
                    ok = (it.src_region == Region.AG and it.src_block == me
                          and it.dst_region == Region.AG)
                    chunk = 0
                else:
                    ok = it.src_region == Region.RS_SEND and it.dst_region == Region.RS_RECV
                    chunk = it.src_block
                if not ok:
                    raise ValueError(f"GPU-direct: unexpected item {it} in {OP_NAMES[op]} "
                                     f"stream {k}")
                items.append(_row(DT_ITEM, DT_CHUNK=chunk, DT_BASE=base, DT_STRIDE=stride,
                                  DT_SLOTS=slots, DT_BLOCK=it.dst_block,
                                  DT_PART=part_code(it.part)))
                host[-1][1].append((chunk, base, stride, slots, it.dst_block, it.part))
                blocks = max(blocks, it.dst_block + 1)
        if len(rows) > MAX_DIRECT:
            raise ValueError(f"GPU-direct: {len(rows)} streams, at most {MAX_DIRECT}")
        flat = [len(rows)] + [v for r in rows for v in r] + [v for r in items for v in r]
        # A collective of slice S may go direct while (slots - 1) * stride + blocks * S fits
        # every destination region (the proxy's transport checks the same per write).
        self.tables[op] = (self._to_device(torch.tensor(flat, dtype=torch.int64)),
                           (slots - 1) * stride, blocks, room or 0)
        self.host[op] = host
        return True

    def table(self, op: Op, S: int):
        """The device table for a collective of slice S, or None (then the proxy sends)."""
        t = self.tables.get(op)
        if t is None:
            return None
        table, reach, blocks, room = t
        return table if reach + blocks * S <= room else None
