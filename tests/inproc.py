"""In-process worlds for the native-layer tests: W ranks in this process, each with a control
block, the three regions and a native Proxy executing its plan. test_native.py connects them
over shared memory (every rank maps every other's memory: it is one process), and
test_verbs_fake.py over the fake verbs fabric. Also the collectives driven by hand through
the publish ring, checked byte for byte against seeded patterns."""
from __future__ import annotations

import os

import numpy as np

import sparkccl._native as N
from sparkccl import layout as L
from sparkccl.plan import geometry as G
from sparkccl.plan.build import build_plan
from sparkccl.plan.model import REGION_SLOTS, Op, Region, num_flag_words

from membuf import Buf

SLOTS = [REGION_SLOTS[Region.AG], REGION_SLOTS[Region.RS_SEND], REGION_SLOTS[Region.RS_RECV]]
PID = os.getpid()


def shm_proxy(*args, **kw):
    """A native Proxy with the shm transport attached (peers' memory mapped here)."""
    p = N.Proxy(*args, **kw)
    p.attach(N.ShmTransport())
    return p


class Ctl:
    """A rank's control block, its flag words as a numpy view, and its address."""

    def __init__(self, world: int):
        nfw = num_flag_words(world)
        self.buf = Buf(L.control_bytes(nfw))
        self.addr = self.buf.addr
        self.flags_addr = self.addr + L.FLAGS_OFFSET
        self.flags = self.buf.a[L.FLAGS_OFFSET:L.FLAGS_OFFSET + 8 * nfw].view(np.uint64)
        N.init_control(self.addr, PID)

    def word(self, off: int) -> int:
        return int(self.buf.a[off:off + 8].view(np.uint64)[0])


class ProxyWorld:
    """W ranks: control block, regions (slice-sized blocks, SLOTS slots each) and one Proxy
    per rank (``transport="shm"``: attached here; any other: the subclass attaches it).
    Subclasses connect the ranks."""

    def __init__(self, topology: str, world: int, roots: int, max_slice: int,
                 spin_us: int = 2000, nap_us: int = 50, transport: str = "shm",
                 worker_spin_us: int = 0):
        self.topology, self.world, self.roots = topology, world, roots
        self.plans = [build_plan(topology, world, r, roots) for r in range(world)]
        self.ctl = [Ctl(world) for _ in range(world)]
        blocks = [world, world, self.plans[0].rs_recv_blocks]
        self.stride = [L.slot_stride(b * max_slice) for b in blocks]
        self.regions = [[Buf(SLOTS[g] * self.stride[g]) for g in range(3)] for _ in range(world)]
        self.proxies = []
        for r, plan in enumerate(self.plans):
            t = plan.to_tables()
            p = N.Proxy(r, world, self.ctl[r].addr, self.ctl[r].flags_addr, t["connections"],
                        t["streams"], t["items"], SLOTS, spin_us, nap_us)
            if transport == "shm":
                p.attach(N.ShmTransport(worker_spin_us))
            for g in range(3):
                p.set_region(g, self.regions[r][g].addr, self.stride[g])
            self.proxies.append(p)
        self.seq = 0
        self.slices = {}  # seq -> (slice, granule) of the collectives run so far
        self.sized = {}  # seq -> the lengths of a sized all-to-all (run_sized)

    def start(self):
        for p in self.proxies:
            p.start()

    def stop(self):
        for p in self.proxies:
            p.stop()

    def block(self, r, region, seq, b, slice_):
        off = (seq % SLOTS[region]) * self.stride[region] + b * slice_
        return self.regions[r][region].a[off:off + slice_]

    def wait_all(self, op, seq, timeout=20.0):
        """Every rank's every wait word of ``op`` for collective ``seq`` (its slice as
        recorded in ``slices``: an idle root 1's words are not waited for)."""
        for r, plan in enumerate(self.plans):
            for src in range(self.world):
                words = G.waited_words(plan.waits[op][src], *self.slices[seq])
                for c in range(G.PIECES):
                    got = N.wait_flags(self.ctl[r].addr, self.ctl[r].flags_addr, words,
                                       G.flag_value(seq, c), timeout)
                    assert got == (0, -1), (r, src, c, got, N.error_text(self.ctl[r].addr))

    def check_healthy(self):
        for r in range(self.world):
            assert N.abort_code(self.ctl[r].addr) == 0, N.error_text(self.ctl[r].addr)


def ll_area(ctl: Ctl, world: int) -> np.ndarray:
    """A rank's LL area as u64 words (the lines' halves)."""
    at, n = L.ll_area(num_flag_words(world))
    return ctl.buf.a[at:at + n].view(np.uint64)


def ll_block(world: int, seq: int, source: int) -> int:
    """The first word of source's block of collective seq in an LL area."""
    return ((seq % L.LL_SLOTS) * world + source) * L.LL_SOURCE_BYTES // 8


def run_ll(w: ProxyWorld, slice_: int, seq=None, *, late: bool = False):
    """One collective of LL lines through the proxies (chunk CHUNK_LL, docs/PROTOCOL.md "One
    shot, LL, through the proxy"): each rank's lines of slice_ data bytes (a multiple of 16)
    in its own LL block, every piece published; then every peer's LL area holds them at the
    same place, and every flag of the seq arrived. ``late``: the entries first, the lines
    after (the proxy waits for their flags)."""
    seq = w.seq if seq is None else seq
    W, n = w.world, slice_ // 4
    lines = {}
    for r in range(W):
        data = pattern(seq, r, 0, slice_).view(np.uint32).astype(np.uint64)
        lines[r] = data | np.uint64((seq + 1) & 0xFFFFFFFF) << np.uint64(32)
    w.slices[seq] = (slice_, 16)

    def write_lines():
        for r in range(W):
            at = ll_block(W, seq, r)
            ll_area(w.ctl[r], W)[at:at + n] = lines[r]

    if not late:
        write_lines()
    for r in range(W):
        assert N.publish_range(w.ctl[r].addr, int(Op.AG), seq, 0, G.PIECES - 1, L.CHUNK_LL,
                               slice_, 16, 5.0) == 0
    if late:
        write_lines()
    w.wait_all(Op.AG, seq)
    for r in range(W):
        for b in range(W):
            if b != r:
                at = ll_block(W, seq, b)
                got = ll_area(w.ctl[r], W)[at:at + n]
                assert np.array_equal(got, lines[b]), ("LL", r, b, slice_, seq)
    w.seq = seq + 1


def pattern(seq, origin, chunk, n):
    return np.random.default_rng([seq, origin, chunk, n]).integers(0, 256, n, dtype=np.uint8)


def run_ag(w: ProxyWorld, slice_: int, seq=None, whole: bool = False):
    """One all-gather of slice_ bytes per rank (sequence ``seq``, default the next), checked.
    ``whole``: each rank publishes one entry for the eight pieces (CHUNK_WHOLE)."""
    seq = w.seq if seq is None else seq
    W = w.world
    for r in range(W):
        for b in range(W):
            w.block(r, Region.AG, seq, b, slice_)[:] = pattern(seq, r, 0, slice_) if b == r else 0xEE
    w.slices[seq] = (slice_, 16)
    if whole:
        for r in range(W):
            assert N.publish_range(w.ctl[r].addr, int(Op.AG), seq, 0, G.PIECES - 1,
                                   L.CHUNK_WHOLE, slice_, 16, 5.0) == 0
    for c in range(0 if whole else G.PIECES):
        for r in range(W):
            assert N.publish(w.ctl[r].addr, int(Op.AG), seq, c, -1, slice_, 16, 5.0) == 0
    w.wait_all(Op.AG, seq)
    for r in range(W):
        for b in range(W):
            got = w.block(r, Region.AG, seq, b, slice_)
            assert np.array_equal(got, pattern(seq, b, 0, slice_)), ("AG", r, b, slice_, seq)
    w.seq = seq + 1


def run_sized(w: ProxyWorld, slice_: int, rng, seq=None) -> None:
    """One sized all-to-all's transfers (call kind KIND_ALL_TO_ALL_SIZED, docs/PROTOCOL.md
    "Sized blocks"): chunk j of rank r starts with a length from ``rng`` (below 8 to past
    the chunk); each destination's block is checked up to geometry.sized_bytes of it (the
    bytes past it are not sent: rings' relays cut at the origin's call entry).
    ``w.sized[seq]`` keeps the lengths, [origin][chunk], for the work-request checks."""
    seq = w.seq if seq is None else seq
    W = w.world
    heads = [[int(rng.integers(0, slice_ + 40)) for _ in range(W)] for _ in range(W)]
    sent = {}
    for r in range(W):
        for j in range(W):
            data = pattern(seq, r, j, slice_).copy()
            data[:8] = np.array([heads[r][j]], dtype=np.uint64).view(np.uint8)
            sent[r, j] = data
            w.block(r, Region.RS_SEND, seq, j, slice_)[:] = data
        for b in range(w.plans[r].rs_recv_blocks):
            w.block(r, Region.RS_RECV, seq, b, slice_)[:] = 0xEE
    w.slices[seq] = (slice_, 16)
    w.sized[seq] = heads
    P = L.protocol_constants()
    call = L.call_word(0, P["DTYPE_U8"], P["KIND_ALL_TO_ALL_SIZED"], 0)
    for c in range(G.PIECES):
        for r in range(W):
            assert N.publish(w.ctl[r].addr, int(Op.RS), seq, c, -1, slice_, 16, 5.0,
                             call) == 0
    w.wait_all(Op.RS, seq)
    for r in range(W):
        for i in range(W):
            if i != r:
                n = G.sized_bytes(heads[i][r], slice_)
                got = w.block(r, Region.RS_RECV, seq, i, slice_)[:n]
                assert np.array_equal(got, sent[i, r][:n]), ("sized", r, i, slice_, seq, n)
    w.seq = seq + 1


def run_rs(w: ProxyWorld, slice_: int, seq=None, finalize: bool = False, granule: int = 16,
           rng=None):
    """One reduce-scatter's transfers (every chunk to its rank), checked. ``finalize``: one
    entry per (piece, destination chunk), in an order shuffled by ``rng``, as the fused
    finalize publishes."""
    seq = w.seq if seq is None else seq
    W = w.world
    for r in range(W):
        for j in range(W):
            w.block(r, Region.RS_SEND, seq, j, slice_)[:] = pattern(seq, r, j, slice_)
        for b in range(w.plans[r].rs_recv_blocks):
            w.block(r, Region.RS_RECV, seq, b, slice_)[:] = 0xEE
    w.slices[seq] = (slice_, granule)
    if not finalize:
        for c in range(G.PIECES):
            for r in range(W):
                assert N.publish(w.ctl[r].addr, int(Op.RS), seq, c, -1, slice_, granule, 5.0) == 0
    else:
        for r in range(W):
            order = [(c, j) for c in range(G.PIECES) for j in range(W)]
            rng.shuffle(order)
            for c, j in order:
                assert N.publish(w.ctl[r].addr, int(Op.RS), seq, c, j, slice_, granule, 5.0) == 0
    w.wait_all(Op.RS, seq)
    for r in range(W):
        for i in range(W):
            if i == r:
                continue
            got = w.block(r, Region.RS_RECV, seq, i, slice_)
            assert np.array_equal(got, pattern(seq, i, r, slice_)), ("RS", r, i, slice_, seq)
    w.seq = seq + 1
