"""Build plans from routes.

A topology only decides *routes*: for every (origin, target) pair, one or two legs, each a
path of ranks and the half of the data it carries. Everything else (streams, triggers,
flag words, staging blocks for relays, waits) is derived here the same way for every
topology, so mesh and ring differ only in their routes.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .geometry import Part
from .model import (
    MESH_CHANNEL, NEXT, PREV, Connection, Item, OnFlag, OnPublish, Op, RankPlan, Region,
    Stream, arrival, flag_word,
)

TOPOLOGIES = ("mesh", "ring")
MAX_WORLD = 8


@dataclass(frozen=True)
class Leg:
    """Part of origin's data travelling along ``path`` (origin first, target last).

    ``half`` is None for the whole data, else (index, 2): which direction half it is.
    ``channels[h]`` is the port the hop path[h] -> path[h+1] leaves through.
    """

    path: tuple[int, ...]
    channels: tuple[int, ...]
    half: tuple[int, int] | None

    def covers(self, other: "Leg") -> bool:
        """Whether this leg's part contains ``other``'s part."""
        return self.half is None or self.half == other.half


def _mesh_routes(world: int, origin: int, target: int) -> tuple[Leg, ...]:
    return (Leg((origin, target), (MESH_CHANNEL,), None),)


def _ring_path(world: int, origin: int, hops: int, step: int) -> tuple[int, ...]:
    return tuple((origin + step * h) % world for h in range(hops + 1))


def _ring_routes(world: int, origin: int, target: int) -> tuple[Leg, ...]:
    """Shortest way round; a target exactly opposite gets half each way (docs/CONTRACT.md §3)."""
    d = (target - origin) % world
    fwd, back = d, world - d
    if fwd < back:
        return (Leg(_ring_path(world, origin, fwd, +1), (NEXT,) * fwd, None),)
    if back < fwd:
        return (Leg(_ring_path(world, origin, back, -1), (PREV,) * back, None),)
    return (Leg(_ring_path(world, origin, fwd, +1), (NEXT,) * fwd, (0, 2)),
            Leg(_ring_path(world, origin, back, -1), (PREV,) * back, (1, 2)))


ROUTERS = {"mesh": _mesh_routes, "ring": _ring_routes}


def routes(topology: str, world: int, origin: int, target: int) -> tuple[Leg, ...]:
    return ROUTERS[topology](world, origin, target)


def _staging_key(leg: Leg, hop: int) -> tuple:
    """Identifies a relay's staging block at the rank ``hop`` hops down ``leg``.

    Direction halves of the same (hops done, hops left) share a block: they are disjoint.
    Whole-data transits get a block per direction. Keys are rank-independent, so every
    rank uses the same block numbers.
    """
    done, left = hop, len(leg.path) - 1 - hop
    if leg.half is not None:
        return ("half", done, left)
    return ("whole", leg.channels[0], done, left)


@lru_cache(maxsize=None)
def _staging_blocks(topology: str, world: int) -> dict[tuple, int]:
    """Staging key -> block offset: 0 means the rank's own block, k >= 1 means block world+k-1."""
    keys = set()
    for origin in range(world):
        for target in range(world):
            if origin == target:
                continue
            for leg in routes(topology, world, origin, target):
                for hop in range(1, len(leg.path) - 1):
                    keys.add(_staging_key(leg, hop))
    return {k: i for i, k in enumerate(sorted(keys, key=repr))}


def _staging_block(topology: str, world: int, rank: int, key: tuple) -> int:
    k = _staging_blocks(topology, world)[key]
    return rank if k == 0 else world + k - 1


def _leg_part(leg: Leg, root: int, roots: int) -> Part:
    half, halves = leg.half if leg.half is not None else (0, 1)
    return Part(root, roots, half, halves)


def _connections(topology: str, world: int, rank: int, roots: int) -> tuple[Connection, ...]:
    if topology == "mesh":
        # Rank r serves r+1, r+2, ... in turn, which staggers incast (docs/PROTOCOL.md).
        peers = [((rank + k) % world, MESH_CHANNEL) for k in range(1, world)]
    else:
        peers = [((rank + 1) % world, NEXT), ((rank - 1) % world, PREV)]
    return tuple(Connection(p, ch, root) for p, ch in peers for root in range(roots))


def _regions(op: Op, topology: str, world: int, leg: Leg, hop: int, target: int
             ) -> tuple[Region, int, Region, int]:
    """Source and destination (region, block) of the hop leaving leg.path[hop]."""
    origin = leg.path[0]
    if op == Op.AG:
        return Region.AG, origin, Region.AG, origin
    here, there = leg.path[hop], leg.path[hop + 1]
    if hop == 0:
        src = (Region.RS_SEND, target)
    else:
        src = (Region.RS_RECV, _staging_block(topology, world, here, _staging_key(leg, hop)))
    if there == target:
        dst = (Region.RS_RECV, origin)
    else:
        dst = (Region.RS_RECV, _staging_block(topology, world, there, _staging_key(leg, hop + 1)))
    return (*src, *dst)


def check_config(topology: str, world: int, roots: int) -> None:
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    if not 2 <= world <= MAX_WORLD:
        raise ValueError(f"world size must be 2..{MAX_WORLD}, got {world}")
    if roots not in (1, 2):
        raise ValueError(f"roots must be 1 or 2, got {roots}")


@lru_cache(maxsize=None)
def build_plan(topology: str, world: int, rank: int, roots: int = 2) -> RankPlan:
    """The plan rank ``rank`` executes for every collective of ``topology`` at ``world``."""
    check_config(topology, world, roots)
    if not 0 <= rank < world:
        raise ValueError(f"rank must be 0..{world - 1}, got {rank}")
    conns = _connections(topology, world, rank, roots)

    # (op, origin, out channel, peer, root) -> items, kept in first-seen order so that
    # stream order follows connection order (mesh: r+1, r+2, ...).
    groups: dict[tuple, list[Item]] = {}
    waits: dict[Op, list[set[int]]] = {op: [set() for _ in range(world)] for op in Op}
    for op in Op:
        for origin in range(world):
            for target in range(world):
                if origin == target:
                    continue
                for leg in routes(topology, world, origin, target):
                    last = len(leg.path) - 2
                    if target == rank:
                        arr = arrival(topology, leg.channels[last])
                        waits[op][origin].update(
                            flag_word(world, op, origin, arr, k) for k in range(roots))
                    for hop in range(len(leg.path) - 1):
                        if leg.path[hop] != rank:
                            continue
                        # AG relays carry the data once for every target further down:
                        # only the leg to the farthest target contributes the item.
                        if op == Op.AG and not _ag_leg_owns_hop(topology, world, leg, hop):
                            continue
                        regions = _regions(op, topology, world, leg, hop, target)
                        for k in range(roots):
                            key = (op, origin, leg.channels[hop], leg.path[hop + 1], k)
                            groups.setdefault(key, []).append(
                                Item(*regions, _leg_part(leg, k, roots), target))

    streams = []
    for conn_id, conn in enumerate(conns):
        for (op, origin, ch, peer, k), items in groups.items():
            if (peer, ch, k) != (conn.peer, conn.channel, conn.root):
                continue
            arr = arrival(topology, ch)
            if origin == rank:
                chunks = frozenset(it.src_block for it in items)
                trigger = OnPublish(chunks)
            else:
                # The relay fires on the flag of the same origin's stream into this rank:
                # the leg arrived here on the port opposite the one it leaves by.
                trigger = OnFlag(flag_word(world, op, origin, arr, k))
            streams.append(Stream(op, origin, conn_id, flag_word(world, op, origin, arr, k),
                                  trigger, tuple(items)))
    assert len({(s.conn, s.dst_flag) for s in streams}) == len(streams)

    n_stage = len(_staging_blocks(topology, world))
    return RankPlan(
        topology=topology, world=world, rank=rank, roots=roots, connections=conns,
        streams=tuple(streams),
        waits={op: tuple(tuple(sorted(w)) for w in waits[op]) for op in Op},
        rs_recv_blocks=world + max(0, n_stage - 1),
    )


def _ag_leg_owns_hop(topology: str, world: int, leg: Leg, hop: int) -> bool:
    """All-gather data is the same for every target, so a hop carries it once.

    Of the legs of one origin that share this hop (same path up to the hop's end), the
    hop is carried by the one whose part contains every other's; among equal parts, by
    the longest (its item serves the nearer targets on the way).
    """
    origin = leg.path[0]
    prefix = leg.path[:hop + 2]
    for other in range(world):
        if other == origin or other == leg.path[-1]:
            continue
        for o in routes(topology, world, origin, other):
            if o.path[:hop + 2] != prefix or not o.covers(leg):
                continue
            if not leg.covers(o) or len(o.path) > len(leg.path):
                return False
    return True


def build_all(topology: str, world: int, roots: int = 2) -> tuple[RankPlan, ...]:
    return tuple(build_plan(topology, world, r, roots) for r in range(world))
