"""Symbolic execution of plans: proves them before any byte moves.

The verifier runs every rank's data plane and proxy over a sequence of collectives
(all-gathers, reduce-scatters, finalizes and fused all-reduces of assorted sizes, which
makes every slot be reused), tracking for every byte range *what* it holds (origin rank,
origin block, offset) and *how* it got there (connection, position in that connection's ordered
stream). The model is monotone (triggers only become true), so reaching the end in one
order means every order reaches it; every property below is checked with the ordering
guarantees alone (the transport's per-connection order, flags, stream order), never
with the order the simulation happened to pick.

Checked:

* every output byte of every rank arrives exactly once, from the right origin, at the
  right offset; staging bytes are written at most once per collective;
* every flag word has one writer stream, and its values only grow;
* every wait is satisfied (no deadlock), and what a wait releases (a data-plane read or
  a relay) is covered: each byte it reads was written on a connection before the flag
  write that satisfied the wait;
* slot reuse (docs/PROTOCOL.md): a write into a slot for collective s2 starts only after every
  read of that slot for an earlier collective s1 provably finished, expressed through
  happens-before vectors over the data planes' "done" events.

It also reports the bytes each port sends and receives per collective, in slices.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .build import build_all, routes
from .geometry import PIECES, flag_value, piece_bounds, root1_idle, sub_range, waited_words
from .model import (
    REGION_SLOTS, OnFlag, OnPublish, Op, RankPlan, Region,
)


class PlanError(AssertionError):
    """A plan violates a property the protocol relies on."""


ALL_REDUCE = "AR"
"""The fused all-reduce: one sequence number, both ops (docs/PROTOCOL.md "All-reduce"). Also
the key of its port loads in :class:`Report` (the other collectives' are their op)."""


@dataclass(frozen=True)
class Collective:
    """One call in the simulated sequence. ``kind`` is 'AG', 'RS', 'FIN' (finalize) or 'AR'
    (the fused all-reduce: a reduce-scatter whose rank publishes all-gather piece c of its
    reduced chunk once piece c of its chunk came from every source, all under one seq)."""

    kind: str
    slice_bytes: int
    granule: int = 16

    @property
    def op(self) -> Op:
        """The op of its first publish (an all-reduce's reduce-scatter part)."""
        return Op.AG if self.kind == "AG" else Op.RS

    @property
    def ops(self) -> tuple[Op, ...]:
        """Every op it publishes and waits under, in the order it does."""
        return (Op.RS, Op.AG) if self.kind == ALL_REDUCE else (self.op,)

    @property
    def load_key(self):
        return ALL_REDUCE if self.kind == ALL_REDUCE else self.op


DEFAULT_SIZES = (1, 15, 16, 17, 127, 128, 129, 1000, 4112, 65537)
# Finalize slices are whole rows: (rows per destination, bytes per row).
DEFAULT_FIN_ROWS = ((8, 16), (13, 48), (100, 8192))


def default_sequence(sizes: Sequence[int] = DEFAULT_SIZES) -> list[Collective]:
    """A mix in which every kind sees several sizes and every slot is reused."""
    kinds = ["AG", "RS", "AG", "FIN", "AR", "AG", "AG", "RS", "FIN", "AR", "AG", "AG", "RS"]
    seq, fins = [], 0
    for i, k in enumerate(kinds * 2):
        if k == "FIN":
            rows, rb = DEFAULT_FIN_ROWS[fins % len(DEFAULT_FIN_ROWS)]
            fins += 1
            seq.append(Collective("FIN", rows * rb, rb))
        else:
            seq.append(Collective(k, sizes[i % len(sizes)]))
    return seq


Vec = tuple[int, ...]


def _join(*vs: Vec) -> Vec:
    return tuple(max(x) for x in zip(*vs))


@dataclass
class _Record:
    """Bytes [lo, hi) of a block hold origin's block ``content_block`` at the same offsets."""

    lo: int
    hi: int
    origin: int
    content_block: int
    conn: tuple | None  # (sender rank, conn index) or None for the local data plane
    index: int  # position in that connection's ordered stream


@dataclass
class _FlagWrite:
    value: int
    conn: tuple
    index: int
    vec: Vec
    stream: tuple  # (sender rank, stream index)


@dataclass
class Report:
    topology: str
    world: int
    roots: int
    collectives: int
    # (op, rank, channel) -> slices sent / received per collective through that port
    port_out: dict = field(default_factory=dict)
    port_in: dict = field(default_factory=dict)

    def max_port_load(self, op) -> float:
        """``op``: an Op, or ALL_REDUCE for the fused all-reduce (both ops of one seq)."""
        vals = [v for (o, _, _), v in self.port_out.items() if o == op]
        vals += [v for (o, _, _), v in self.port_in.items() if o == op]
        return max(vals)


def lower_bound(op, topology: str, world: int) -> float:
    """Least slices some port must carry per call (one direction), moving raw bytes.

    Every rank must receive (world-1) slices. A mesh rank has one port: world-1. A ring
    rank has two ports, and each byte crosses one link per hop; with R ranks each sending
    or receiving through 2 ports, the busiest port carries at least the average
    (total slice-hops) / (2 * world). All-gather data can be shared by every target along
    a path (a slice needs world-1 link crossings at least); reduce-scatter data differs
    per target, so chunk t of every origin must cross every link on its shortest path.

    ALL_REDUCE (slice = one rank's chunk, 1/world of the vector): no rank can reduce
    another's chunk (rank order, rounded once, only where the whole sum is), so every
    origin's raw chunk t reaches rank t and rank t's reduced chunk reaches every rank: the
    reduce-scatter's bound plus the all-gather's. On a mesh 2 (world-1) slices, i.e. each
    rank sends and receives 2 (world-1)/world of the vector, the bound of any all-reduce.
    """
    if op == ALL_REDUCE:
        return lower_bound(Op.RS, topology, world) + lower_bound(Op.AG, topology, world)
    if topology == "mesh":
        return float(world - 1)
    if op == Op.AG:
        return (world - 1) / 2
    hops = sum(min(d, world - d) for d in range(1, world))
    return hops / 2


class _Sim:
    def __init__(self, plans: Sequence[RankPlan], colls: Sequence[Collective],
                 slots: dict[Region, int]):
        self.plans = plans
        self.colls = list(colls)
        self.slots = slots
        self.world = w = plans[0].world
        self.topology = plans[0].topology
        zero = tuple([-1] * w)
        # data plane state per rank
        self.dp_seq = [0] * w  # next collective to run
        self.dp_vec: list[Vec] = [zero] * w  # happens-before at the end of the last done
        self.published: list[dict] = [dict() for _ in range(w)]  # (seq, op, piece, chunk|-1) -> vec
        # (seq, op) -> vec of the rank's first entry of that op and seq
        self.first_pub: list[dict] = [dict() for _ in range(w)]
        # fused all-reduce in progress: rank -> (seq, next AG piece to publish, vec so far)
        self.ar_state: dict[int, tuple[int, int, Vec]] = {}
        # proxy state: per (rank, stream) cursor = (index into colls of its op, piece)
        self.cursor = {(r, k): (0, 0) for r, p in enumerate(plans) for k in range(len(p.streams))}
        self.stream_vec = {key: zero for key in self.cursor}
        self.op_colls = {op: [i for i, c in enumerate(self.colls) if op in c.ops] for op in Op}
        # connection order: (rank, conn) -> next index; and the vec of the last post
        self.conn_next: dict[tuple, int] = {}
        self.conn_vec: dict[tuple, Vec] = {}
        # contents[(rank, region, seq, block)] -> records
        self.contents: dict[tuple, list[_Record]] = {}
        # flags[(rank, word)] -> ordered writes
        self.flags: dict[tuple, list[_FlagWrite]] = {}
        self.flag_writer: dict[tuple, tuple] = {}
        # slot accesses: (rank, region, slot) -> {seq: [reads], writes-min-vec}
        self.reads: dict[tuple, dict[int, set]] = {}
        self.write_vec: dict[tuple, dict[int, Vec]] = {}
        # relay witnesses: flag write (rank, word, seq, piece) -> rank whose done follows it
        self.port_bytes_out: dict[tuple, int] = {}
        self.port_bytes_in: dict[tuple, int] = {}

    # -- helpers -------------------------------------------------------------------
    def _fail(self, msg: str) -> None:
        raise PlanError(f"{self.topology} world {self.world} roots {self.plans[0].roots}: {msg}")

    def _slot(self, region: Region, seq: int) -> int:
        return seq % self.slots[region]

    def _note_write(self, rank: int, region: Region, seq: int, vec: Vec) -> None:
        key = (rank, region, self._slot(region, seq))
        d = self.write_vec.setdefault(key, {})
        d[seq] = tuple(min(a, b) for a, b in zip(d[seq], vec)) if seq in d else vec

    def _note_read(self, rank: int, region: Region, seq: int, witness: tuple) -> None:
        """``witness`` = ('done', x) or ('flag', rank, word, piece): proves the read ended."""
        key = (rank, region, self._slot(region, seq))
        self.reads.setdefault(key, {}).setdefault(seq, set()).add(witness)

    def _land(self, rank: int, region: Region, seq: int, block: int, rec: _Record,
              what: str) -> None:
        recs = self.contents.setdefault((rank, region, seq, block), [])
        for other in recs:
            if other.lo < rec.hi and rec.lo < other.hi:
                self._fail(f"{what}: bytes [{max(other.lo, rec.lo)}, {min(other.hi, rec.hi)}) of "
                           f"{region.name} block {block} at rank {rank} (seq {seq}) delivered twice")
        recs.append(rec)

    def _covering(self, rank: int, region: Region, seq: int, block: int, lo: int, hi: int,
                  what: str) -> list[_Record]:
        """Records exactly covering [lo, hi) (clipped), or fail."""
        recs = sorted((r for r in self.contents.get((rank, region, seq, block), ())
                       if r.lo < hi and lo < r.hi), key=lambda r: r.lo)
        pos = lo
        out = []
        for r in recs:
            if r.lo > pos:
                break
            out.append(_Record(max(r.lo, lo), min(r.hi, hi), r.origin, r.content_block,
                               r.conn, r.index))
            pos = max(pos, min(r.hi, hi))
        if pos < hi:
            self._fail(f"{what}: bytes [{pos}, {hi}) of {region.name} block {block} at rank "
                       f"{rank} (seq {seq}) read before anything wrote them")
        return out

    def _flag_satisfier(self, rank: int, word: int, value: int) -> _FlagWrite | None:
        for fw in self.flags.get((rank, word), ()):
            if fw.value >= value:
                return fw
        return None

    def _check_proven(self, recs: Iterable[_Record], proofs: Sequence[_FlagWrite], what: str
                      ) -> None:
        """Each record must be ordered before one of the flag writes that released the read."""
        for r in recs:
            if r.conn is None:
                continue
            if not any(p.conn == r.conn and p.index > r.index for p in proofs):
                self._fail(f"{what}: bytes [{r.lo}, {r.hi}) from rank {r.origin} are read "
                           f"before a flag that proves they arrived (written on connection "
                           f"{r.conn})")

    # -- data plane ------------------------------------------------------------------
    def _dp_step(self, r: int) -> bool:
        s = self.dp_seq[r]
        if s >= len(self.colls):
            return False
        coll = self.colls[s]
        start = self.dp_vec[r]
        if (s, coll.op) not in self.first_pub[r]:
            self.first_pub[r][(s, coll.op)] = start
            self._dp_publish(r, s, coll, start)
            return True
        vec, progress = start, False
        if coll.kind == ALL_REDUCE:
            # Piece c of this rank's chunk from every source -> its sum lands in the own AG
            # block and goes out as all-gather piece c (everything that read happens before).
            held = self.ar_state.get(r)
            c0, vec = (held[1], held[2]) if held is not None and held[0] == s else (0, start)
            for c in range(c0, PIECES):
                got = self._receive_piece(r, s, coll, Op.RS, c)
                if got is None:
                    self.ar_state[r] = (s, c, vec)
                    return progress
                vec = _join(vec, got)
                if c == 0:
                    self.first_pub[r][(s, Op.AG)] = vec
                    self._note_write(r, Region.AG, s, vec)
                lo, hi = piece_bounds(coll.slice_bytes, c, coll.granule)
                self._land(r, Region.AG, s, r, _Record(lo, hi, r, r, None, 0),
                           f"rank {r} all-reduce sum of piece {c}")
                self.published[r][(s, Op.AG, c, -1)] = vec
                progress = True
            self.ar_state[r] = (s, PIECES, vec)
        # Wait for every piece from every source, then read and finish.
        for c in range(PIECES):
            got = self._receive_piece(r, s, coll, coll.ops[-1], c)
            if got is None:
                return progress
            vec = _join(vec, got)
        # Everything received: check the output is complete (nothing missing, no extras).
        for op in coll.ops:
            region = Region.AG if op == Op.AG else Region.RS_RECV
            for src in range(self.world):
                if src == r:
                    continue
                recs = self.contents.get((r, region, s, src), [])
                got = sum(x.hi - x.lo for x in recs)
                if got != coll.slice_bytes:
                    self._fail(f"rank {r} {coll.kind} seq {s}: {op.name} block {src} received "
                               f"{got} bytes, expected {coll.slice_bytes}")
                self._note_read(r, region, s, ("done", r))
            if op == Op.RS:
                self._note_read(r, Region.RS_SEND, s, ("done", r))
        vec = list(vec)
        vec[r] = s
        self.dp_vec[r] = tuple(vec)
        self.dp_seq[r] = s + 1
        return True

    def _receive_piece(self, r: int, s: int, coll: Collective, op: Op, c: int) -> Vec | None:
        """Piece c of ``op``'s data from every source at rank r, checked (right origin and
        block, proven arrived by the flags that released it): the join of those flags'
        vectors, or None while a wait is unsatisfied."""
        plan = self.plans[r]
        lo, hi = piece_bounds(coll.slice_bytes, c, coll.granule)
        region = Region.AG if op == Op.AG else Region.RS_RECV
        vecs = []
        for src in range(self.world):
            if src == r:
                continue
            words = waited_words(plan.waits[op][src], coll.slice_bytes, coll.granule)
            if not words:
                self._fail(f"rank {r} has no flag to wait on for {op.name} data from rank {src}")
            proofs = []
            for w in words:
                fw = self._flag_satisfier(r, w, flag_value(s, c))
                if fw is None:
                    return None
                proofs.append(fw)
                vecs.append(fw.vec)
            recs = self._covering(r, region, s, src, lo, hi,
                                  f"rank {r} data plane, {coll.kind} seq {s} {op.name} piece {c}")
            want_block = src if op == Op.AG else r
            for rec in recs:
                if rec.origin != src or rec.content_block != want_block:
                    self._fail(f"rank {r} {coll.kind} seq {s}: {op.name} block {src} bytes "
                               f"[{rec.lo},{rec.hi}) hold rank {rec.origin}'s block "
                               f"{rec.content_block}, expected rank {src}'s block {want_block}")
            self._check_proven(recs, proofs, f"rank {r} {coll.kind} seq {s} {op.name} piece {c}")
        return _join(*vecs)

    def _dp_publish(self, r: int, s: int, coll: Collective, vec: Vec) -> None:
        if coll.op == Op.AG:
            self._note_write(r, Region.AG, s, vec)
            for c in range(PIECES):
                lo, hi = piece_bounds(coll.slice_bytes, c, coll.granule)
                self._land(r, Region.AG, s, r, _Record(lo, hi, r, r, None, 0), f"rank {r} copy-in")
                self.published[r][(s, Op.AG, c, -1)] = vec
            return
        self._note_write(r, Region.RS_SEND, s, vec)
        for j in range(self.world):
            self.contents[(r, Region.RS_SEND, s, j)] = [
                _Record(0, coll.slice_bytes, r, j, None, 0)]
        if coll.kind in ("RS", ALL_REDUCE):
            for c in range(PIECES):
                self.published[r][(s, Op.RS, c, -1)] = vec
        else:
            # Finalize publishes (piece, destination) as blocks finish: deliberately out
            # of order here, so streams must hold early pieces back.
            for c in reversed(range(PIECES)):
                for j in reversed(range(self.world)):
                    self.published[r][(s, Op.RS, c, j)] = vec

    # -- proxy -----------------------------------------------------------------------
    def _stream_step(self, r: int, k: int) -> bool:
        plan = self.plans[r]
        st = plan.streams[k]
        ci, c = self.cursor[(r, k)]
        order = self.op_colls[st.op]
        if ci >= len(order):
            return False
        s = order[ci]
        coll = self.colls[s]
        # The proxy learns a collective's sizes from this rank's own first entry of the op
        # (per op: an all-reduce's all-gather relays wait for the rank's own first sum).
        info = self.first_pub[r].get((s, st.op))
        if info is None:
            return False
        conn = plan.connections[st.conn]
        if conn.root == 1 and root1_idle(coll.slice_bytes, coll.granule):
            self.cursor[(r, k)] = (ci + 1, 0)  # (an idle root 1 sends nothing for it)
            return True
        vec = _join(self.stream_vec[(r, k)], info)
        proofs: list[_FlagWrite] = []
        if isinstance(st.trigger, OnPublish):
            for j in st.trigger.chunks:
                pv = (self.published[r].get((s, st.op, c, -1))
                      or self.published[r].get((s, st.op, c, j)))
                if pv is None:
                    return False
                vec = _join(vec, pv)
        else:
            fw = self._flag_satisfier(r, st.trigger.word, flag_value(s, c))
            if fw is None:
                return False
            proofs.append(fw)
            vec = _join(vec, fw.vec)
        ckey = (r, st.conn)
        vec = _join(vec, self.conn_vec.get(ckey, vec))
        lo, hi = piece_bounds(coll.slice_bytes, c, coll.granule)
        what = f"rank {r} stream {k} ({st.op.name} origin {st.origin} to rank {conn.peer}) seq {s} piece {c}"
        for it in st.items:
            a, b = sub_range(lo, hi, it.part)
            if b <= a:
                continue
            recs = self._covering(r, it.src_region, s, it.src_block, a, b, what)
            # A publish proves only local bytes; remote ones need the flag that carried them.
            self._check_proven(recs, proofs, what)
            for rec in recs:
                if rec.origin != st.origin:
                    self._fail(f"{what}: forwards rank {rec.origin}'s bytes on origin "
                               f"{st.origin}'s stream")
                # A relay of a sized all-to-all cuts its parts at chunk `target`'s length.
                if st.op == Op.RS and it.src_region == Region.RS_RECV and \
                        rec.content_block != it.target:
                    self._fail(f"{what}: relays rank {rec.origin}'s chunk {rec.content_block} "
                               f"as chunk {it.target}")
            self._note_read(r, it.src_region, s, ("flag", conn.peer, st.dst_flag, s, c))
            self._note_write(conn.peer, it.dst_region, s, vec)
            idx = self.conn_next.get(ckey, 0)
            self.conn_next[ckey] = idx + 1
            for rec in recs:
                self._land(conn.peer, it.dst_region, s, it.dst_block,
                           _Record(rec.lo, rec.hi, rec.origin, rec.content_block, ckey, idx), what)
            n = b - a
            self.port_bytes_out[(s, r, conn.channel)] = self.port_bytes_out.get(
                (s, r, conn.channel), 0) + n
            arr = conn.channel if self.topology == "mesh" else 1 - conn.channel
            self.port_bytes_in[(s, conn.peer, arr)] = self.port_bytes_in.get(
                (s, conn.peer, arr), 0) + n
        idx = self.conn_next.get(ckey, 0)
        self.conn_next[ckey] = idx + 1
        self.conn_vec[ckey] = vec
        fkey = (conn.peer, st.dst_flag)
        writer = self.flag_writer.setdefault(fkey, (r, k))
        if writer != (r, k):
            self._fail(f"flag word {st.dst_flag} at rank {conn.peer} has two writers: "
                       f"rank {writer[0]} stream {writer[1]} and rank {r} stream {k}")
        writes = self.flags.setdefault(fkey, [])
        value = flag_value(s, c)
        if writes and writes[-1].value >= value:
            self._fail(f"flag word {st.dst_flag} at rank {conn.peer}: value {value} after "
                       f"{writes[-1].value} (flags must only grow)")
        writes.append(_FlagWrite(value, ckey, idx, vec, (r, k)))
        self.stream_vec[(r, k)] = vec
        self.cursor[(r, k)] = (ci + 1, 0) if c == PIECES - 1 else (ci, c + 1)
        return True

    # -- driver ----------------------------------------------------------------------
    def run(self) -> None:
        progress = True
        while progress:
            progress = False
            for r in range(self.world):
                while self._dp_step(r):
                    progress = True
                for k in range(len(self.plans[r].streams)):
                    while self._stream_step(r, k):
                        progress = True
        stuck = [r for r in range(self.world) if self.dp_seq[r] < len(self.colls)]
        if stuck:
            r = stuck[0]
            s = self.dp_seq[r]
            coll = self.colls[s]
            missing = []
            for src, op in ((src, op) for op in coll.ops for src in range(self.world)):
                for w in (waited_words(self.plans[r].waits[op][src], coll.slice_bytes,
                                       coll.granule) if src != r else ()):
                    for c in range(PIECES):
                        if self._flag_satisfier(r, w, flag_value(s, c)) is None:
                            missing.append(f"word {w} (from rank {src}) piece {c}")
                            break
            self._fail(f"deadlock: rank {r} never finishes {coll.kind} seq {s}; "
                       f"unsatisfied waits: {', '.join(missing[:4])}")
        self._check_reuse()

    def _witness_done(self, witness: tuple, seen=None) -> set[int]:
        """Ranks x such that the read proven by ``witness`` ended before done(x, seq)."""
        if witness[0] == "done":
            return {witness[1]}
        _, rank, word, s, c = witness
        coll = self.colls[s]
        out: set[int] = set()
        if any(word in ws for op in coll.ops for ws in self.plans[rank].waits[op]):
            out.add(rank)
        # Relays triggered by this word at ``rank`` carry the proof further.
        for k, st in enumerate(self.plans[rank].streams):
            if isinstance(st.trigger, OnFlag) and st.trigger.word == word:
                peer = self.plans[rank].connections[st.conn].peer
                out |= self._witness_done(("flag", peer, st.dst_flag, s, c))
        return out

    def _check_reuse(self) -> None:
        for key, by_seq in self.write_vec.items():
            rank, region, slot = key
            reads = self.reads.get(key, {})
            for s2, vec in by_seq.items():
                for s1, witnesses in reads.items():
                    if s1 >= s2:
                        continue
                    for wit in witnesses:
                        done = self._witness_done(wit)
                        if not any(vec[x] >= s1 for x in done):
                            self._fail(
                                f"slot reuse: rank {rank} {region.name} slot {slot} is written "
                                f"for seq {s2} while a read for seq {s1} ({wit}) may still run")

    def port_loads(self) -> tuple[dict, dict]:
        out: dict = {}
        inn: dict = {}
        for src, dst in ((self.port_bytes_out, out), (self.port_bytes_in, inn)):
            for (s, r, ch), n in src.items():
                coll = self.colls[s]
                key = (coll.load_key, r, ch)
                dst[key] = max(dst.get(key, 0.0), n / coll.slice_bytes)
        return out, inn


def check_structure(plans: Sequence[RankPlan]) -> None:
    """Static checks: connections pair up, routes are sane, flag words have one writer."""
    world = plans[0].world
    topo = plans[0].topology
    if [p.rank for p in plans] != list(range(world)):
        raise PlanError("plans must be given for ranks 0..world-1 in order")
    writers: dict = {}
    for p in plans:
        for k, st in enumerate(p.streams):
            conn = p.connections[st.conn]
            if conn.peer == p.rank:
                raise PlanError(f"rank {p.rank} stream {k} sends to itself")
            key = (conn.peer, st.dst_flag)
            if key in writers:
                raise PlanError(f"{topo} world {world}: flag word {st.dst_flag} at rank "
                                f"{conn.peer} has two writers: rank {writers[key][0]} stream "
                                f"{writers[key][1]} and rank {p.rank} stream {k}")
            writers[key] = (p.rank, k)
            if topo == "ring" and conn.peer not in ((p.rank + 1) % world, (p.rank - 1) % world):
                raise PlanError(f"ring rank {p.rank} has a connection to non-neighbour {conn.peer}")
    for p in plans:
        for op in Op:
            for src, words in enumerate(p.waits[op]):
                for w in words:
                    if (p.rank, w) not in writers:
                        raise PlanError(f"rank {p.rank} waits on flag word {w} that nobody writes")
    for o in range(world):
        for t in range(world):
            if o != t and not routes(topo, world, o, t):
                raise PlanError(f"no route from {o} to {t}")


def verify_plans(plans: Sequence[RankPlan], sequence: Sequence[Collective] | None = None,
                 slots: dict[Region, int] | None = None) -> Report:
    """Raise PlanError on any violation; otherwise return the port-load report."""
    check_structure(plans)
    seq = list(sequence) if sequence is not None else default_sequence()
    sim = _Sim(plans, seq, dict(slots or REGION_SLOTS))
    sim.run()
    p0 = plans[0]
    report = Report(p0.topology, p0.world, p0.roots, len(seq))
    # Loads on a size that splits evenly, so the figures are the plan's, not rounding's.
    even = [Collective("AG", 1 << 20), Collective("RS", 1 << 20),
            Collective(ALL_REDUCE, 1 << 20)]
    sim2 = _Sim(plans, even, dict(slots or REGION_SLOTS))
    sim2.run()
    report.port_out, report.port_in = sim2.port_loads()
    return report


def verify(topology: str, world: int, roots: int = 2,
           sequence: Sequence[Collective] | None = None) -> Report:
    return verify_plans(build_all(topology, world, roots), sequence)
