"""Plans as data: what a rank sends, when, and what it waits for.

A plan is a list of *streams*. A stream is the ordered sequence of (data writes, then one
flag write) that one connection carries for one origin's data of one operation kind. It
is keyed by (op, origin rank, out channel, root), so every flag word at the receiver has
exactly one writer stream, and its flag for piece c is written after all of the stream's
data for piece c:

* a *publish-triggered* stream carries this rank's own data; piece c goes out once the
  local data plane has published piece c of every chunk the stream reads;
* a *flag-triggered* stream relays another origin's data as raw bytes; piece c goes out
  once the local flag word that carried it here shows piece c.

Executors (the verifier, the native proxy) walk each stream piece by piece, collective by
collective, in order.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Union

from .geometry import Part


class Op(IntEnum):
    """Operation kinds; each has its own flag words. The MoE finalize uses RS."""

    AG = 0
    RS = 1


class Region(IntEnum):
    """Registered regions of a rank (docs/PROTOCOL.md). Offsets are ``slot * stride + block * slice``."""

    AG = 0  # 3 slots, block i = rank i's slice
    RS_SEND = 1  # 2 slots, block j = chunk for rank j
    RS_RECV = 2  # 2 slots, block i = data from rank i; own block and blocks >= world stage relays


REGION_SLOTS = {Region.AG: 3, Region.RS_SEND: 2, Region.RS_RECV: 2}

MESH_CHANNEL = 0
PREV, NEXT = 0, 1
"""Ring channels: 0 is the port facing prev, 1 the port facing next (docs/CONTRACT.md §3)."""


def arrival(topology: str, channel: int) -> int:
    """The channel at the peer on which a connection leaving by ``channel`` arrives: the
    mesh has one, a ring cable joins one rank's next-facing port to the other's prev."""
    return MESH_CHANNEL if topology == "mesh" else 1 - channel


CHANNELS = 2
MAX_ROOTS = 2


def flag_word(world: int, op: Op, origin: int, channel: int, root: int) -> int:
    """Index of the flag word for (op, origin, arrival channel, root) in a rank's flag array."""
    return ((int(op) * world + origin) * CHANNELS + channel) * MAX_ROOTS + root


def num_flag_words(world: int) -> int:
    return len(Op) * world * CHANNELS * MAX_ROOTS


def decode_flag_word(world: int, word: int) -> tuple[Op, int, int, int]:
    root = word % MAX_ROOTS
    word //= MAX_ROOTS
    channel = word % CHANNELS
    word //= CHANNELS
    return Op(word // world), word % world, channel, root


@dataclass(frozen=True)
class Connection:
    """A transport connection from this rank: to ``peer`` through port ``channel``, root ``root``."""

    peer: int
    channel: int
    root: int


@dataclass(frozen=True)
class Item:
    """One data write per piece: ``part`` of piece c of a local block to a peer's block.
    ``target``: the rank the bytes are for (a reduce-scatter's chunk index at the origin;
    a relay of a sized all-to-all cuts its parts at that chunk's length); an all-gather's
    item: the leg's farthest target."""

    src_region: Region
    src_block: int
    dst_region: Region
    dst_block: int
    part: Part
    target: int


@dataclass(frozen=True)
class OnPublish:
    """Piece c may go once the local data plane published piece c of each of ``chunks``."""

    chunks: frozenset[int]


@dataclass(frozen=True)
class OnFlag:
    """Piece c may go once local flag word ``word`` reached the value of piece c."""

    word: int


Trigger = Union[OnPublish, OnFlag]


@dataclass(frozen=True)
class Stream:
    op: Op
    origin: int
    conn: int  # index into RankPlan.connections
    dst_flag: int  # flag word index at the peer
    trigger: Trigger
    items: tuple[Item, ...]


@dataclass
class RankPlan:
    """Everything one rank executes for one topology."""

    topology: str
    world: int
    rank: int
    roots: int
    connections: tuple[Connection, ...]
    streams: tuple[Stream, ...]
    waits: dict[Op, tuple[tuple[int, ...], ...]]
    """waits[op][source]: local flag words the data plane waits on for source's data."""
    rs_recv_blocks: int
    """Slice-sized blocks per RS recv slot: world, plus staging blocks of multi-hop relays."""

    @property
    def num_flag_words(self) -> int:
        return num_flag_words(self.world)

    def streams_of(self, op: Op) -> tuple[Stream, ...]:
        return tuple(s for s in self.streams if s.op == op)

    def publish_streams(self) -> list[int]:
        """Indices (into ``streams`` / the proxy's table) of the publish-triggered streams:
        the ones a GPU-direct data plane may execute itself (``Proxy.set_gpu_streams``)."""
        return [k for k, s in enumerate(self.streams) if isinstance(s.trigger, OnPublish)]

    def to_tables(self) -> dict[str, list[list[int]]]:
        """Flat integer tables for the native proxy (layout documented in docs/PROTOCOL.md)."""
        streams, items = [], []
        for s in self.streams:
            if isinstance(s.trigger, OnPublish):
                kind, arg = 0, sum(1 << c for c in s.trigger.chunks)
            else:
                kind, arg = 1, s.trigger.word
            streams.append([int(s.op), s.conn, s.dst_flag, kind, arg, len(items), len(s.items)])
            for it in s.items:
                items.append([int(it.src_region), it.src_block, int(it.dst_region), it.dst_block,
                              it.part.root, it.part.roots, it.part.half, it.part.halves,
                              it.target])
        conns = [[c.peer, c.channel, c.root] for c in self.connections]
        return {"connections": conns, "streams": streams, "items": items}
