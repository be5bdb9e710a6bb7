"""Tests of the native layer (sparkccl._native): layout and geometry drift, the publish
ring, flag waits, the abort word, and the proxy + shm transport end to end with every
rank of a world living in this one process."""
from __future__ import annotations

import mmap
import os
import subprocess
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from sparkccl import layout as L
from sparkccl.plan import geometry as G
from sparkccl.plan.build import build_plan
from sparkccl.plan.model import Op, Region, num_flag_words

import sparkccl._native as N  # noqa: E402 - the native layer is not optional: no skip
# (tests/ is on sys.path under pytest)
from inproc import (PID, SLOTS, Ctl, ProxyWorld, pattern, run_ag, run_ll, run_rs,  # noqa: E402
                    shm_proxy)
from membuf import wait_abort  # noqa: E402

# ---------------------------------------------------------------- layout and geometry

def test_layout_matches_python():
    native = N.layout()
    expected = {k: v for k, v in vars(L).items() if k.isupper() and isinstance(v, int)}
    assert native == expected


def test_piece_bounds_match_python():
    for granule in (16, 32, 48, 96, 112, 256, 4096 + 16):
        for size in range(0, 5001, 7):
            for c in range(G.PIECES):
                assert N.piece_bounds(size, c, granule) == G.piece_bounds(size, c, granule), (size, c, granule)
    for size in (2**31 + 5, 2**40 + 12345, 123456789):
        for c in range(G.PIECES):
            assert N.piece_bounds(size, c, 16) == G.piece_bounds(size, c, 16)


def test_sub_range_matches_python():
    parts = [G.Part(r, rs, h, hs) for rs in (1, 2) for r in range(rs) for hs in (1, 2) for h in range(hs)]
    for size in range(0, 5001, 13):
        for granule in (16, 48):
            for c in range(G.PIECES):
                lo, hi = G.piece_bounds(size, c, granule)
                for p in parts:
                    assert N.sub_range(lo, hi, *p) == G.sub_range(lo, hi, p), (size, c, p)


def test_root1_idle_matches_python():
    for granule in (16, 48, 4096 + 16, 14336):
        for size in [*range(0, 40000, 97), 32752, 32768, 32769, 32784, 2**40]:
            assert N.root1_idle(size, granule) == G.root1_idle(size, granule), (size, granule)
    assert G.root1_idle(32768) and not G.root1_idle(32769) and not G.root1_idle(8 * 14336, 14336)
    assert G.waited_words([4, 5, 6, 7], 100) == [4, 6]
    assert G.waited_words([4, 5], 65536) == [4, 5]


def test_sized_bytes_matches_python():
    for L in (0, 5, 8, 16, 17, 100, 4096, 2**40 + 3):
        for h in (0, 1, 7, 8, 9, 15, 16, 17, 31, 99, 100, 101, 4095, L - 1 if L else 0, L,
                  L + 1, 2**63, 2**64 - 1):
            assert N.sized_bytes(h, L) == G.sized_bytes(h, L), (h, L)
            got = G.sized_bytes(h, L)
            assert got == L or (got % G.ALIGN == 0 and got >= min(max(h, 8), L))


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        N.piece_bounds(100, 8, 16)
    with pytest.raises(ValueError):
        N.piece_bounds(100, 0, 0)


# ---------------------------------------------------------------- memory helpers

def test_init_control():
    c = Ctl(2)
    assert c.word(L.CTL_MAGIC) == L.CTL_MAGIC_VALUE
    assert c.word(L.CTL_PID) == PID
    assert N.abort_code(c.addr) == 0 and N.error_text(c.addr) == ""


# ---------------------------------------------------------------- abort word

def test_set_abort_first_writer_wins():
    c = Ctl(2)
    assert N.set_abort(c.addr, L.ABORT_USER, "first failure")
    assert not N.set_abort(c.addr, L.ABORT_PEER, "second failure")
    assert N.abort_code(c.addr) == L.ABORT_USER
    assert N.error_text(c.addr) == "first failure"


def test_set_abort_long_message_truncated():
    c = Ctl(2)
    assert N.set_abort(c.addr, L.ABORT_TRANSPORT, "x" * 5000)
    assert N.error_text(c.addr) == "x" * (L.ERROR_BYTES - 1)


def test_set_abort_race_has_one_winner():
    c = Ctl(2)
    wins = []
    barrier = threading.Barrier(4)

    def go(i):
        barrier.wait()
        if N.set_abort(c.addr, L.ABORT_USER, f"writer {i}"):
            wins.append(i)

    ts = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert len(wins) == 1
    assert N.error_text(c.addr) == f"writer {wins[0]}"


# ---------------------------------------------------------------- publish ring and waits

def ring_entry(c: Ctl, index: int) -> dict:
    off = L.RING_OFFSET + (index % L.RING_ENTRIES) * L.RING_ENTRY_BYTES
    e = c.buf.a[off:off + L.RING_ENTRY_BYTES]
    u64 = lambda o: int(e[o:o + 8].view(np.uint64)[0])  # noqa: E731
    u32 = lambda o: int(e[o:o + 4].view(np.uint32)[0])  # noqa: E731
    u8 = lambda o: int(e[o])  # noqa: E731
    return dict(tag=u64(L.ENT_TAG), seq=u64(L.ENT_SEQ), slice=u64(L.ENT_SLICE), lo=u64(L.ENT_LO),
                hi=u64(L.ENT_HI), op=u8(L.ENT_OP), dtype=u8(L.ENT_DTYPE), kind=u8(L.ENT_KIND),
                piece=u8(L.ENT_PIECE), pad=u32(L.ENT_PAD),
                chunk=int(e[L.ENT_CHUNK:L.ENT_CHUNK + 4].view(np.int32)[0]), granule=u32(L.ENT_GRANULE))


def test_publish_writes_entry():
    c = Ctl(2)
    call = L.call_word(0, 3, 2, 6)  # (bf16, reduce-scatter, 6 bytes of padding)
    assert N.publish(c.addr, 1, 7, 3, -1, 1000, 16, 1.0, call) == 0
    assert N.publish(c.addr, 0, 8, 7, 2, 4800, 48, 1.0) == 0
    e0, e1 = ring_entry(c, 0), ring_entry(c, 1)
    assert e0 == dict(tag=1, seq=7, slice=1000, lo=G.piece_bounds(1000, 3)[0],
                      hi=G.piece_bounds(1000, 3)[1], op=1, dtype=3, kind=2, piece=3, pad=6,
                      chunk=-1, granule=16)
    assert e1["tag"] == 2 and e1["chunk"] == 2 and (e1["lo"], e1["hi"]) == G.piece_bounds(4800, 7, 48)
    assert (e1["dtype"], e1["kind"], e1["pad"], e1["piece"]) == (0, 0, 0, 7)
    assert c.word(L.CTL_RING_HEAD) == 2
    with pytest.raises(ValueError, match="call word with op or piece bits set"):
        N.publish(c.addr, 0, 9, 0, -1, 16, 16, 1.0, L.call_word(1, 0, 0, 0))


def test_ring_never_overrun():
    c = Ctl(2)
    proxy = shm_proxy(0, 2, c.addr, c.flags_addr, [], [], [], spin_us=1000, nap_us=50)
    done = []

    def producer():
        for i in range(1000):
            assert N.publish(c.addr, 0, i, i % 8, -1, 4096, 16, 30.0) == 0
            done.append(i)

    t = threading.Thread(target=producer)
    t.start()
    try:
        time.sleep(0.3)
        assert len(done) == L.RING_ENTRIES  # blocked on the 257th, not overwriting
        assert c.word(L.CTL_RING_TAIL) == 0
        assert [ring_entry(c, i)["tag"] for i in range(L.RING_ENTRIES)] == list(range(1, 257))
        assert [ring_entry(c, i)["seq"] for i in range(L.RING_ENTRIES)] == list(range(256))
        proxy.start()
        t.join(20)
        assert not t.is_alive()
        deadline = time.time() + 5
        while proxy.stats()["entries"] < 1000 and time.time() < deadline:
            time.sleep(0.01)
        assert proxy.stats()["entries"] == 1000
        assert c.word(L.CTL_RING_TAIL) == 1000
        assert N.abort_code(c.addr) == 0
    finally:
        proxy.stop()
        t.join(5)


def test_publish_timeout_sets_abort():
    c = Ctl(2)
    for i in range(L.RING_ENTRIES):
        assert N.publish(c.addr, 0, 0, 0, -1, 16, 16, 1.0) == 0
    t0 = time.monotonic()
    assert N.publish(c.addr, 0, 0, 0, -1, 16, 16, 0.2) == L.ABORT_TIMEOUT
    assert 0.15 < time.monotonic() - t0 < 2
    assert N.abort_code(c.addr) == L.ABORT_TIMEOUT
    assert "ring full" in N.error_text(c.addr)
    # Later publishes return the abort code at once.
    assert N.publish(c.addr, 0, 1, 0, -1, 16, 16, 5.0) == L.ABORT_TIMEOUT


def test_wait_flags():
    c = Ctl(2)
    c.flags[3] = 5
    c.flags[4] = 9
    assert N.wait_flags(c.addr, c.flags_addr, [3, 4], 5, 1.0) == (0, -1)
    assert N.wait_flags(c.addr, c.flags_addr, [], 5, 1.0) == (0, -1)
    t0 = time.monotonic()
    assert N.wait_flags(c.addr, c.flags_addr, [4, 3], 6, 0.1) == (L.ABORT_TIMEOUT, 1)
    assert 0.05 < time.monotonic() - t0 < 2
    assert N.abort_code(c.addr) == 0  # the caller composes the message

    def later():
        time.sleep(0.1)
        c.flags[3] = 6

    t = threading.Thread(target=later)
    t.start()
    assert N.wait_flags(c.addr, c.flags_addr, [4, 3], 6, 10.0) == (0, -1)
    t.join()

    def abort_later():
        time.sleep(0.1)
        N.set_abort(c.addr, L.ABORT_USER, "closed")

    t = threading.Thread(target=abort_later)
    t.start()
    assert N.wait_flags(c.addr, c.flags_addr, [4, 3, 2], 7, 10.0) == (L.ABORT_USER, 1)
    t.join()


# ---------------------------------------------------------------- end to end (shm, in-process)

class World(ProxyWorld):
    """W ranks in this process over shm: every rank's Proxy maps every other's memory."""

    def __init__(self, topology: str, world: int, roots: int, max_slice: int,
                 spin_us: int = 2000, nap_us: int = 50, worker_spin_us: int = 0):
        super().__init__(topology, world, roots, max_slice, spin_us, nap_us,
                         worker_spin_us=worker_spin_us)
        for r, p in enumerate(self.proxies):
            for q in range(world):
                if q == r:
                    continue
                p.set_peer(q, self.ctl[q].addr, self.ctl[q].flags_addr, PID)
                for g in range(3):
                    p.set_peer_region(q, g, self.regions[q][g].addr)


SLICES = [1, 15, 16, 17, 1000, 4096 * 3 + 5]
CONFIGS = ([("mesh", w, roots) for w in (2, 3, 4, 8) for roots in (1, 2)]
           + [("ring", w, roots) for w in (2, 3, 4, 5, 6) for roots in (1, 2)])


def run_every_slot(w) -> None:
    """AG, RS, RS, AG per size of SLICES, each checked: sequence numbers rotate through
    every slot."""
    for slice_ in SLICES:
        run_ag(w, slice_)
        run_rs(w, slice_)
        run_rs(w, slice_)
        run_ag(w, slice_)


@pytest.mark.parametrize("topology,world,roots", CONFIGS)
def test_end_to_end(topology, world, roots):
    w = World(topology, world, roots, max(SLICES))
    w.start()
    try:
        run_every_slot(w)
        w.check_healthy()
        st = w.proxies[0].stats()
        assert st["entries"] == 8 * w.seq and st["flags"] > 0 and st["writes"] > 0
    finally:
        w.stop()


@pytest.mark.parametrize("world,roots", [(2, 1), (2, 2), (3, 2), (8, 1)])
def test_ll_lines_through_the_proxy(world, roots):
    """Entries of chunk CHUNK_LL on a mesh: each proxy posts its rank's LL lines into every
    peer's LL area (Transport::put_lines, each root's part of them where there are two),
    once every line carries the seq's flag (also when the entries come first), then the
    flags; every LL slot in turn, between all-gathers of the same op."""
    w = World("mesh", world, roots, 8192)
    w.start()
    try:
        for k, slice_ in enumerate([16, 1008, 8192, 64, 4096, 32]):
            run_ll(w, slice_, late=k % 2 == 1)
            if k == 2:
                run_ag(w, 1000)
        w.check_healthy()
        st = w.proxies[0].stats()
        assert st["flags"] > 0 and st["writes"] >= 6 * (world - 1)
    finally:
        w.stop()


@pytest.mark.parametrize("topology,world,roots", [("mesh", 2, 2), ("mesh", 3, 1), ("ring", 4, 2),
                                                   ("ring", 5, 1)])
def test_whole_entry_stands_for_eight_pieces(topology, world, roots):
    """One ring entry of chunk CHUNK_WHOLE (the one-shot all-reduce's proxy path) publishes
    all eight pieces: the proxy sends them as eight CHUNK_ALL entries would be sent (relays
    too), and its tail moves past the eight ring indices, so entries published after it are
    read in turn; slices below and above ONE_HANDOFF_SLICE, between collectives of eight
    entries, over the whole ring (more indices than it has)."""
    w = World(topology, world, roots, 65536)
    w.start()
    try:
        n = 0
        while n * G.PIECES < 3 * L.RING_ENTRIES:
            for slice_, whole in [(1024, True), (4096, False), (65536, True), (16, True)]:
                run_ag(w, slice_, whole=whole)
                n += 1
            run_rs(w, 2048)
            n += 1
        w.check_healthy()
        for r in range(world):
            assert w.ctl[r].word(L.CTL_RING_TAIL) == w.ctl[r].word(L.CTL_RING_HEAD) == n * G.PIECES
    finally:
        w.stop()


def test_whole_entry_publish_checks():
    """The host publish of a CHUNK_WHOLE entry stands for pieces 0..last: another first piece
    is refused before anything is published."""
    c = Ctl(2)
    with pytest.raises(ValueError, match="CHUNK_WHOLE"):
        N.publish_range(c.addr, int(Op.AG), 0, 1, G.PIECES - 1, L.CHUNK_WHOLE, 64, 16, 1.0)
    assert c.word(L.CTL_RING_HEAD) == 0


def test_ll_lines_refused_where_a_stream_relays():
    """A ring of 4 relays: CHUNK_LL entries there are a protocol error, named."""
    w = World("ring", 4, 1, 4096)
    w.start()
    try:
        assert N.publish_range(w.ctl[0].addr, int(Op.AG), 0, 0, G.PIECES - 1, L.CHUNK_LL, 64,
                               16, 5.0) == 0
        code, text = wait_abort(w.ctl[0].addr, 5.0)
        assert code == L.ABORT_TRANSPORT and "bad publish entry 0" in text, text
        assert "LL lines through the proxy need every stream of the op publish-triggered" in text
    finally:
        w.stop()


@pytest.mark.parametrize("topology,world", [("mesh", 2), ("ring", 4)])
def test_spinning_copy_workers(topology, world):
    """shm copy workers that spin after their last operation (where the host has the cores)
    before they sleep: the same results, and stop() ends them while they spin."""
    w = World(topology, world, 2, max(SLICES), worker_spin_us=500_000)
    w.start()
    try:
        run_every_slot(w)
        w.check_healthy()
    finally:
        t0 = time.monotonic()
        w.stop()
        assert time.monotonic() - t0 < 0.4, "stop() waited for the workers' spin to end"


@pytest.mark.parametrize("worker_spin_us", [0, 500_000])
def test_shm_flag_latency_stats(worker_spin_us):
    """The shm transport samples every data flag's way through its copy worker (pushed ->
    taken -> stored) and the proxy every post's first write -> flag pushed; stats() reports
    their counts and percentiles. Call-entry words are not sampled: one sample per flag the
    proxy posted. Per sample taken <= stored, so total (pushed -> stored) is >= take at every
    quantile."""
    w = World("mesh", 2, 2, max(SLICES), worker_spin_us=worker_spin_us)
    w.start()
    try:
        run_every_slot(w)
        w.check_healthy()
        for p in w.proxies:
            st = p.stats()
            # (a worker samples a flag just after storing it: the peer may have seen it first)
            deadline = time.monotonic() + 10
            while st["shm_flag_samples"] < st["flags"] and time.monotonic() < deadline:
                time.sleep(0.01)
                st = p.stats()
            assert st["flags"] > 0 and st["shm_flag_samples"] == st["flags"], st
            assert st["call_entries"] > 0  # (their words went through the workers unsampled)
            # a post has writes unless every item's part is empty (a 1-byte slice's pieces)
            assert 0 < st["write_flag_samples"] <= st["flags"], st
            assert 0 < st["write_flag_p50_ns"] <= st["write_flag_p99_ns"] < 10**10, st
            for k in ("take", "store", "total"):
                assert 0 <= st[f"shm_flag_{k}_p50_ns"] <= st[f"shm_flag_{k}_p99_ns"] < 10**10, st
            assert 0 < st["shm_flag_total_p50_ns"], st
            assert st["shm_flag_take_p50_ns"] <= st["shm_flag_total_p50_ns"], st
            assert st["shm_flag_take_p99_ns"] <= st["shm_flag_total_p99_ns"], st
            assert st["shm_flag_store_p50_ns"] <= st["shm_flag_total_p50_ns"], st
            assert st["shm_flag_store_p99_ns"] <= st["shm_flag_total_p99_ns"], st
    finally:
        w.stop()


@pytest.mark.parametrize("topology,world", [("mesh", 4), ("mesh", 8), ("ring", 4), ("ring", 5), ("ring", 6)])
def test_finalize_style_publishes(topology, world):
    row = 48
    rng = np.random.default_rng(1)
    w = World(topology, world, 2, 64 * row)
    w.start()
    try:
        for rows in (8, 13, 37, 64):
            run_rs(w, rows * row, finalize=True, granule=row, rng=rng)
            run_ag(w, rows * row)
        run_rs(w, 5 * row, finalize=True, granule=row, rng=rng)
        w.check_healthy()
    finally:
        w.stop()


def fill_own_ag(w, seq: int, slice_: int) -> None:
    """Every rank's own block of all-gather slot ``seq`` holds its pattern (and the world
    notes the slice, for its waits)."""
    w.slices[seq] = (slice_, 16)
    for r in range(w.world):
        w.block(r, Region.AG, seq, r, slice_)[:] = pattern(seq, r, 0, slice_)


def publish_ag(w, r: int, seq: int, slice_: int) -> None:
    """Rank ``r`` publishes every piece of all-gather ``seq``."""
    for c in range(G.PIECES):
        assert N.publish(w.ctl[r].addr, 0, seq, c, -1, slice_, 16, 5.0) == 0


def check_ag(w, seq: int, slice_: int) -> None:
    """Every rank holds every origin's pattern in all-gather slot ``seq``."""
    for r in range(w.world):
        for b in range(w.world):
            assert np.array_equal(w.block(r, Region.AG, seq, b, slice_), pattern(seq, b, 0, slice_))


def test_many_collectives_in_flight():
    """Publishes of several collectives before any wait (the proxy keeps a history)."""
    w = World("ring", 4, 2, 4096)
    w.start()
    try:
        slice_ = 4096
        base = w.seq
        for k in range(3):  # three all-gathers published back to back: slots 0,1,2
            seq = base + k
            fill_own_ag(w, seq, slice_)
            for c in range(G.PIECES):
                for r in range(4):
                    assert N.publish(w.ctl[r].addr, 0, seq, c, -1, slice_, 16, 5.0) == 0
        for k in range(3):
            seq = base + k
            w.wait_all(Op.AG, seq)
            check_ag(w, seq, slice_)
        w.check_healthy()
    finally:
        w.stop()


def test_proxy_stop_idempotent_and_restart_refused():
    w = World("mesh", 2, 2, 64)
    w.start()
    w.start()
    run_ag(w, 64)
    w.stop()
    w.stop()
    with pytest.raises(RuntimeError):
        w.proxies[0].start()
    del w  # destructors after stop are fine


def test_proxy_destructor_stops_running_proxy():
    w = World("ring", 3, 2, 64)
    w.start()
    run_ag(w, 64)
    w.proxies.clear()  # destructors join the threads


# ---------------------------------------------------------------- failures

@contextmanager
def watching_a_dead_peer(peer_abort: str | None = None):
    """Rank 0's proxy with peer 1's process gone (its abort set to ``peer_abort`` first):
    yields (the dead pid, rank 0's control block) once rank 0 aborted."""
    proc = subprocess.Popen(["sleep", "0"])
    proc.wait()
    c0, c1 = Ctl(2), Ctl(2)
    if peer_abort is not None:
        N.set_abort(c1.addr, L.ABORT_PEER, peer_abort)
    t = build_plan("mesh", 2, 0, 2).to_tables()
    p = shm_proxy(0, 2, c0.addr, c0.flags_addr, t["connections"], t["streams"], t["items"],
                  spin_us=0, nap_us=200)
    p.set_peer(1, c1.addr, c1.flags_addr, proc.pid)
    p.start()
    try:
        wait_abort(c0.addr, 2)
        yield proc.pid, c0
    finally:
        p.stop()


def test_dead_peer_sets_abort_peer():
    with watching_a_dead_peer() as (dead, c0):
        assert N.abort_code(c0.addr) == L.ABORT_PEER
        assert N.error_text(c0.addr) == f"rank 0: peer 1 (pid {dead}) exited"
        # A blocked data-plane wait sees it.
        assert N.wait_flags(c0.addr, c0.flags_addr, [4], 1, 5.0) == (L.ABORT_PEER, 0)


def test_dead_peer_that_aborted_is_reported_with_its_cause():
    """A peer that failed (on a third rank's death, say) and then exited: its cause, left in
    its control segment, is what this rank reports, not only that it exited."""
    with watching_a_dead_peer("rank 1: peer 2 (pid 7) exited") as (dead, c0):
        assert N.abort_code(c0.addr) == L.ABORT_PEER
        assert N.error_text(c0.addr) == (f"rank 0: peer 1 (pid {dead}) exited after it aborted: "
                                         "rank 1: peer 2 (pid 7) exited")


def test_peer_abort_propagates():
    c0, c1 = Ctl(2), Ctl(2)
    t = build_plan("mesh", 2, 0, 2).to_tables()
    p = shm_proxy(0, 2, c0.addr, c0.flags_addr, t["connections"], t["streams"], t["items"],
                  spin_us=0, nap_us=200)
    p.set_peer(1, c1.addr, c1.flags_addr, PID)
    p.start()
    try:
        time.sleep(0.15)
        assert N.abort_code(c0.addr) == 0
        N.set_abort(c1.addr, L.ABORT_TIMEOUT, "rank 1: wait for rank 0 timed out")
        wait_abort(c0.addr, 2)
        assert N.abort_code(c0.addr) == L.ABORT_PEER
        assert N.error_text(c0.addr) == "rank 0: peer 1 aborted: rank 1: wait for rank 0 timed out"
    finally:
        p.stop()


def test_out_of_bounds_write_is_transport_error():
    w = World("mesh", 3, 2, 4096)
    # Rank 0 believes rank 2's RS recv region is one page only: writes there must fail cleanly.
    w.proxies[0].set_peer_region(2, int(Region.RS_RECV), w.regions[2][2].addr, size=4096)
    w.start()
    try:
        slice_ = 4096
        for r in range(3):
            for c in range(G.PIECES):
                # Rank 0 may have failed already, and ranks 1 and 2 seen it: publish returns the code.
                assert N.publish(w.ctl[r].addr, int(Op.RS), 1, c, -1, slice_, 16, 5.0) in (0, L.ABORT_TRANSPORT, L.ABORT_PEER)
        wait_abort(w.ctl[0].addr, 5)
        assert N.abort_code(w.ctl[0].addr) == L.ABORT_TRANSPORT
        text = N.error_text(w.ctl[0].addr)
        assert text.startswith("rank 0: shm transport: connection") and "peer 2" in text
        assert "RS_RECV" in text and "root" in text
    finally:
        w.stop()


def test_unregistered_region_is_transport_error():
    c0, c1 = Ctl(2), Ctl(2)
    t = build_plan("mesh", 2, 0, 1).to_tables()
    p = shm_proxy(0, 2, c0.addr, c0.flags_addr, t["connections"], t["streams"], t["items"],
                  spin_us=1000, nap_us=50)
    p.set_peer(1, c1.addr, c1.flags_addr, PID)
    p.start()
    try:
        assert N.publish(c0.addr, 0, 0, 0, -1, 64, 16, 5.0) == 0
        wait_abort(c0.addr, 5)
        assert N.abort_code(c0.addr) == L.ABORT_TRANSPORT
        assert "not registered" in N.error_text(c0.addr)
    finally:
        p.stop()


def test_bad_tables_raise():
    c = Ctl(2)
    with pytest.raises(ValueError):
        N.Proxy(0, 2, c.addr, c.flags_addr, [[0, 0, 0]], [], [])  # connection to self
    with pytest.raises(ValueError):
        N.Proxy(0, 2, c.addr, c.flags_addr, [[1, 0, 0]], [[0, 5, 0, 0, 1, 0, 0]], [])
    with pytest.raises(ValueError):
        N.Proxy(0, 2, c.addr, c.flags_addr, [[1, 0, 0]], [[0, 0, 0, 0, 1, 0, 1]], [])
    with pytest.raises(ValueError):
        N.Proxy(2, 2, c.addr, c.flags_addr, [], [], [])


def test_attach_once_before_start():
    c = Ctl(2)
    p = N.Proxy(0, 2, c.addr, c.flags_addr, [[1, 0, 0]], [], [])
    with pytest.raises(RuntimeError, match="no transport attached"):
        p.start()
    shm = N.ShmTransport()
    assert shm.kind == "shm" and isinstance(shm, N.TransportFactory)
    p.attach(shm)
    with pytest.raises(ValueError, match=r"attach\(shm\): a transport is attached already"):
        p.attach(N.ShmTransport())
    p.start()
    p.stop()
    q = N.Proxy(0, 2, c.addr, c.flags_addr, [[1, 0, 0]], [], [])
    q.stop()
    with pytest.raises(ValueError, match="started or stopped"):
        q.attach(N.ShmTransport())


# ---------------------------------------------------------------- separate processes

def _segment_paths(tag, world):
    return [[f"/dev/shm/sparkccl-test-{tag}-{r}-{name}" for name in ("ctl", "ag", "rss", "rsr")]
            for r in range(world)]


def _map(path):
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
    a = np.frombuffer(mm, dtype=np.uint8)
    return mm, a


def _rank_main(tag, topology, world, rank, slice_, stride, barrier, results, leave_early):
    """One rank in its own process: maps every rank's segments from /dev/shm."""
    try:
        paths = _segment_paths(tag, world)
        maps = [[_map(p) for p in row] for row in paths]
        addr = [[m[1].ctypes.data for m in row] for row in maps]
        ctl = addr[rank][0]
        flags = ctl + L.FLAGS_OFFSET
        N.init_control(ctl, os.getpid())
        barrier.wait(30)
        if leave_early:
            results.put((rank, "left"))
            return
        plan = build_plan(topology, world, rank, 2)
        t = plan.to_tables()
        p = shm_proxy(rank, world, ctl, flags, t["connections"], t["streams"], t["items"],
                      SLOTS, spin_us=1000, nap_us=50)
        for g in range(3):
            p.set_region(g, addr[rank][g + 1], stride[g])
        for q in range(world):
            if q != rank:
                pid = int(maps[q][0][1][L.CTL_PID:L.CTL_PID + 8].view(np.uint64)[0])
                p.set_peer(q, addr[q][0], addr[q][0] + L.FLAGS_OFFSET, pid)
                for g in range(3):
                    p.set_peer_region(q, g, addr[q][g + 1])
        p.start()
        try:
            outcome = "ok"
            for seq in range(6):
                op = Op.AG if seq % 2 == 0 else Op.RS
                reg = Region.AG if op == Op.AG else Region.RS_SEND
                a = maps[rank][reg + 1][1]
                for b in range(world):
                    if op == Op.AG and b != rank:
                        continue
                    off = (seq % SLOTS[reg]) * stride[reg] + b * slice_
                    a[off:off + slice_] = pattern(seq, rank, 0 if op == Op.AG else b, slice_)
                for c in range(G.PIECES):
                    code = N.publish(ctl, int(op), seq, c, -1, slice_, 16, 10.0)
                    if code:
                        break
                for src in range(world):
                    code, _ = N.wait_flags(ctl, flags, G.waited_words(plan.waits[op][src], slice_),
                                           G.flag_value(seq, 7), 10.0)
                    if code:
                        break
                if code:
                    outcome = (code, N.error_text(ctl))
                    break
                dst = Region.AG if op == Op.AG else Region.RS_RECV
                a = maps[rank][dst + 1][1]
                for b in range(world):
                    if b == rank:
                        continue
                    off = (seq % SLOTS[dst]) * stride[dst] + b * slice_
                    want = pattern(seq, b, 0 if op == Op.AG else rank, slice_)
                    if not np.array_equal(a[off:off + slice_], want):
                        outcome = ("mismatch", seq, b)
                        break
                if outcome != "ok":
                    break
            # Like a communicator's close: every rank is done (so every relay is done)
            # before any proxy stops or process exits; otherwise slower ranks see a peer
            # exit while they still wait for data it relays.
            if outcome == "ok":
                barrier.wait(30)
        finally:
            p.stop()
        results.put((rank, outcome))
    except Exception as e:  # noqa: BLE001
        results.put((rank, repr(e)))


def _run_processes(topology, world, leave_early=()):
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    slice_ = 4096 * 5 + 48
    plan = build_plan(topology, world, 0, 2)
    blocks = [world, world, plan.rs_recv_blocks]
    stride = [L.slot_stride(b * slice_) for b in blocks]
    sizes = [L.control_bytes(num_flag_words(world))] + [SLOTS[g] * stride[g] for g in range(3)]
    paths = _segment_paths(tag, world)
    for row in paths:
        for p, n in zip(row, sizes):
            with open(p, "wb") as f:
                f.truncate(n)
    try:
        barrier = ctx.Barrier(world)
        results = ctx.Queue()
        procs = [ctx.Process(target=_rank_main,
                             args=(tag, topology, world, r, slice_, stride, barrier, results,
                                   r in leave_early))
                 for r in range(world)]
        [p.start() for p in procs]
        out = dict(results.get(timeout=60) for _ in range(world))
        [p.join(30) for p in procs]
        return out
    finally:
        for row in paths:
            for p in row:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass


@pytest.mark.slow
@pytest.mark.parametrize("topology,world", [("mesh", 3), ("ring", 4)])
def test_separate_processes(topology, world):
    out = _run_processes(topology, world)
    assert out == {r: "ok" for r in range(world)}


@pytest.mark.slow
def test_separate_processes_peer_exits():
    """Rank 2 exits without taking part (a zombie until joined): the others fail fast."""
    t0 = time.monotonic()
    out = _run_processes("mesh", 3, leave_early=(2,))
    assert time.monotonic() - t0 < 9  # well before the 10 s wait timeout
    assert out[2] == "left"
    for r in (0, 1):
        code, text = out[r]
        assert code == L.ABORT_PEER, out
        assert "peer 2" in text and ("exited" in text or "aborted" in text), text


@pytest.mark.parametrize("world,lead", [(4, 0), (5, 2), (6, 1), (6, 7)])
def test_end_to_end_relay_lead(world, lead):
    """Proxy.set_relay_lead: own pieces wait for the relays on their connection; every
    collective is still exact, and none hangs."""
    w = World("ring", world, 2, max(SLICES))
    for p in w.proxies:
        p.set_relay_lead(lead)
    w.start()
    try:
        run_every_slot(w)
        w.check_healthy()
    finally:
        w.stop()


def test_relay_lead_holds_own_pieces_back():
    """Ring 4, lead 1: rank 0 alone publishes; its pieces beyond the lead wait for the
    pieces it relays on the same connection (rank 3's, not published yet), so rank 1 sees
    only pieces 0 and 1 of rank 0; once every rank published, all of it arrives."""
    from sparkccl.plan.model import PREV, flag_word
    W, slice_, lead = 4, 65536, 1  # (pieces both roots carry: G.root1_idle)
    w = World("ring", W, 2, slice_)
    for p in w.proxies:
        p.set_relay_lead(lead)
    w.start()
    try:
        seq = 0
        fill_own_ag(w, seq, slice_)
        publish_ag(w, 0, seq, slice_)
        words1 = [flag_word(W, Op.AG, 0, PREV, k) for k in range(2)]
        assert N.wait_flags(w.ctl[1].addr, w.ctl[1].flags_addr, words1,
                            G.flag_value(seq, lead), 5.0) == (0, -1)
        time.sleep(0.1)
        assert [int(w.ctl[1].flags[x]) for x in words1] == [G.flag_value(seq, lead)] * 2
        for r in (1, 2, 3):
            publish_ag(w, r, seq, slice_)
        w.wait_all(Op.AG, seq)
        check_ag(w, seq, slice_)
        w.check_healthy()
    finally:
        w.stop()
    with pytest.raises(ValueError, match="set_relay_lead"):
        w.proxies[0].set_relay_lead(8)


def test_relay_waits_for_own_entry():
    """Ring 4: rank 1 relays rank 0's data to rank 2, but only once rank 1 itself has seen
    the collective in its own ring (it takes the piece bounds from there)."""
    from sparkccl.plan.model import PREV, flag_word
    W, slice_ = 4, 65536  # (pieces both roots carry: G.root1_idle)
    w = World("ring", W, 2, slice_)
    w.start()
    try:
        seq = 0
        fill_own_ag(w, seq, slice_)
        publish_ag(w, 0, seq, slice_)
        # Rank 1 gets rank 0's data (arriving on its port facing prev)...
        words1 = [flag_word(W, Op.AG, 0, PREV, k) for k in range(2)]
        assert N.wait_flags(w.ctl[1].addr, w.ctl[1].flags_addr, words1, G.flag_value(seq, 7), 5.0) == (0, -1)
        # ... but must not relay it to rank 2 before its own first entry of seq.
        words2 = [flag_word(W, Op.AG, 0, PREV, k) for k in range(2)]
        time.sleep(0.1)
        assert [int(w.ctl[2].flags[x]) for x in words2] == [0, 0]
        for r in (1, 2, 3):
            publish_ag(w, r, seq, slice_)
        w.wait_all(Op.AG, seq)
        assert [int(w.ctl[2].flags[x]) for x in words2] == [G.flag_value(seq, 7)] * 2
        check_ag(w, seq, slice_)
        w.check_healthy()
        st = w.proxies[1].stats()
        assert st["delay_samples"] > 0 and st["delay_p99_ns"] >= st["delay_p50_ns"] > 0
    finally:
        w.stop()


# ---------------------------------------------------------------- GPU-direct streams

def _put_entry(c: Ctl, op: int, seq: int, piece: int, chunk: int, slice_: int) -> None:
    """Append a ring entry as the GPU-direct kernel does (fields, then the tag)."""
    head = c.word(L.CTL_RING_HEAD)
    off = L.RING_OFFSET + (head % L.RING_ENTRIES) * L.RING_ENTRY_BYTES
    e = c.buf.a[off:off + L.RING_ENTRY_BYTES]
    lo, hi = G.piece_bounds(slice_, piece)
    for o, v in ((L.ENT_SEQ, seq), (L.ENT_SLICE, slice_), (L.ENT_LO, lo), (L.ENT_HI, hi)):
        e[o:o + 8].view(np.uint64)[0] = v
    e[L.ENT_OP:L.ENT_OP + 8].view(np.uint64)[0] = op | piece << L.CALL_PIECE_SHIFT
    e[L.ENT_CHUNK:L.ENT_CHUNK + 4].view(np.int32)[0] = chunk
    e[L.ENT_GRANULE:L.ENT_GRANULE + 4].view(np.uint32)[0] = 16
    e[L.ENT_TAG:L.ENT_TAG + 8].view(np.uint64)[0] = head + 1
    c.buf.a[L.CTL_RING_HEAD:L.CTL_RING_HEAD + 8].view(np.uint64)[0] = head + 1


def test_set_gpu_streams_arguments():
    plan = build_plan("ring", 4, 0, 2)
    t = plan.to_tables()
    c = Ctl(4)
    p = shm_proxy(0, 4, c.addr, c.flags_addr, t["connections"], t["streams"], t["items"], SLOTS)
    relay = next(k for k, row in enumerate(t["streams"]) if row[3] == 1)
    with pytest.raises(ValueError, match="relay-triggered"):
        p.set_gpu_streams([relay])
    with pytest.raises(ValueError, match="out of range"):
        p.set_gpu_streams([len(t["streams"])])
    p.set_gpu_streams(plan.publish_streams())
    p.start()
    with pytest.raises(ValueError, match="before start"):
        p.set_gpu_streams([])
    p.stop()


@pytest.mark.parametrize("topology,world", [("mesh", 2), ("ring", 4)])
def test_gpu_streams_skipped_for_direct_collectives_only(topology, world):
    """Collectives published with chunk -2 (the data plane wrote its publish streams' data
    and flags itself) are skipped on those streams; relays and chunk -1 collectives still go
    out. Here the test plays the GPU: it writes every rank's publish-stream data straight
    into the peers and the flags after it."""
    w = World(topology, world, 2, max_slice=40000)
    for r, p in enumerate(w.proxies):
        p.set_gpu_streams(w.plans[r].publish_streams())
    w.start()
    try:
        run_ag(w, 1000)  # chunk -1: the proxies send
        writes = [p.stats()["writes"] for p in w.proxies]
        seq, S = w.seq, 40000  # (pieces both roots carry: root 1's streams are not idle)
        w.slices[seq] = (S, 16)
        for r in range(world):
            w.block(r, Region.AG, seq, r, S)[:] = pattern(seq, r, 0, S)
        for c in range(G.PIECES):
            for r, plan in enumerate(w.plans):
                for k in plan.publish_streams():
                    st = plan.streams[k]
                    if st.op != Op.AG:
                        continue
                    peer = plan.connections[st.conn].peer
                    lo, hi = G.piece_bounds(S, c)
                    for it in st.items:
                        a, b = G.sub_range(lo, hi, it.part)
                        w.block(peer, Region.AG, seq, it.dst_block, S)[a:b] = \
                            w.block(r, Region.AG, seq, it.src_block, S)[a:b]
                    w.ctl[peer].flags[st.dst_flag] = G.flag_value(seq, c)
                _put_entry(w.ctl[r], int(Op.AG), seq, c, -2, S)
        w.wait_all(Op.AG, seq)
        for r in range(world):
            for b in range(world):
                assert np.array_equal(w.block(r, Region.AG, seq, b, S), pattern(seq, b, 0, S))
        w.seq += 1
        w.check_healthy()
        for r, p in enumerate(w.proxies):
            n_pub = len([k for k in w.plans[r].publish_streams()
                         if w.plans[r].streams[k].op == Op.AG])
            deadline = time.monotonic() + 5
            while p.stats()["gpu_pieces"] < 8 * n_pub and time.monotonic() < deadline:
                time.sleep(0.01)
            st = p.stats()
            assert st["gpu_pieces"] == 8 * n_pub
            relays = len(w.plans[r].streams) - len(w.plans[r].publish_streams())
            assert (st["writes"] > writes[r]) == (relays > 0 and topology == "ring"), st
        run_ag(w, 48)  # and chunk -1 again: the proxies send again
        w.check_healthy()
    finally:
        w.stop()


def test_direct_entry_needs_set_gpu_streams():
    plan = build_plan("mesh", 2, 0, 2)
    t = plan.to_tables()
    c0, c1 = Ctl(2), Ctl(2)
    p = shm_proxy(0, 2, c0.addr, c0.flags_addr, t["connections"], t["streams"], t["items"], SLOTS,
                  2000, 50)
    p.set_peer(1, c1.addr, c1.flags_addr, PID)
    p.start()
    try:
        _put_entry(c0, int(Op.AG), 0, 0, -2, 64)
        wait_abort(c0.addr, 5)
        assert N.abort_code(c0.addr) == L.ABORT_TRANSPORT
        assert "GPU-direct" in N.error_text(c0.addr) and "set_gpu_streams" in N.error_text(c0.addr)
    finally:
        p.stop()


def test_op_program_batches_a_streams_consecutive_copies_and_value_operations():
    """OpProgram.issue() makes one driver call of each run of consecutive operations of one
    stream that one call can take (native/src/cuda_ops.cpp group()): copies as
    cuMemcpyBatchAsync, but never on the legacy NULL stream (0 or 1), which refuses it;
    value writes and waits, mixed, as cuStreamBatchMemOp, at most 255 per call; anything
    else, or a run of one, as its own call. Another stream's operation ends a run."""
    ONE, COPIES, MEMOPS = 0, 1, 2

    def row(kind, st, c=64):  # stream term st; a value wait needs an aligned word
        return [kind, st, 0x1000, 0, 0, 0, 0, 0, c]
    copy, write, wait, record = (lambda st: row(0, st)), (lambda st: row(1, st)), \
        (lambda st: row(5, st)), (lambda st: row(3, st))
    terms = [0, 1, 7, 9]  # stream terms: 0 and 1 the legacy stream, 7 and 9 two others
    ops = (copy(2) + copy(2) + copy(2) + write(2) + wait(2) + write(2)  # one stream
           + copy(3) + copy(2)                                         # another between
           + copy(0) + copy(0) + copy(1) + copy(1)                     # the legacy stream
           + write(0) + write(0) + record(2) + write(2))
    p = N.OpProgram(1, 4, [], [], ops)
    assert p.calls(terms) == [(0, 3, COPIES), (3, 3, MEMOPS), (6, 1, ONE), (7, 1, ONE),
                              (8, 1, ONE), (9, 1, ONE), (10, 1, ONE), (11, 1, ONE),
                              (12, 2, MEMOPS), (14, 1, ONE), (15, 1, ONE)]
    long = N.OpProgram(1, 4, [], [], write(2) * 300 + wait(3) * 2)
    assert long.calls(terms) == [(0, 255, MEMOPS), (255, 45, MEMOPS), (300, 2, MEMOPS)]


def test_op_program_evaluates_terms_and_refuses_bad_operations():
    """The copy-engine data plane's native program: each row's values are add + mult *
    term, kernel parameters are patched alike (the first is each launch's own), and a bad
    program is refused when built, or before anything is issued when a term makes it bad
    (a copy before a bad entry is not issued either); where there is no driver, issuing
    names what is missing."""
    import ctypes

    def row(kind, st=0, a=(0, 0, 0), b=(0, 0, 0), c=0):
        return [kind, st, *a, *b, c]
    kernel = (0x1234, 32, [0, 7, 0])
    copy = row(0, 1, (0x100, 2, 8), (0x40, 3, 1), 64)  # dst 0x100 + 8 * t2, src 0x40 + t3
    wait = row(5, 1, (0x1000, 0, 0), (3, 4, 1))         # word 0x1000 reaches 3 + t4
    launch = row(2, 1, (0, 0, 0), (5, 0, 0), 2)         # kernel 0, first parameter 5, 2 blocks
    p = N.OpProgram(1, 5, [kernel], [(0, 2, 3, 2, 1)], copy + wait + launch)
    assert p.operations == 3
    terms = [0, 0xAB, 3, 0x7000, 10 << 20]
    assert p.evaluate(terms) == [0, 0xAB, 0x100 + 24, 0x7040, 64,
                                 5, 0xAB, 0x1000, 3 + (10 << 20), 0,
                                 2, 0xAB, 0, 5, 2]
    assert p.parameters(terms) == [[0, 7, 1 + 2 * 0x7000]]
    with pytest.raises(ValueError, match="4 terms, not 5"):
        p.evaluate(terms[:4])
    with pytest.raises(ValueError, match="no aligned 64-bit word"):
        N.OpProgram(1, 5, [], [], row(5, 0, (0x1000, 2, 1))).evaluate([0, 0, 4, 0, 0])
    with pytest.raises(ValueError, match="9-word operations"):
        N.OpProgram(1, 5, [], [], [0, 0, 0])
    with pytest.raises(ValueError, match="unknown kind 9"):
        N.OpProgram(1, 5, [], [], copy + row(9))
    with pytest.raises(ValueError, match="names no term"):
        N.OpProgram(1, 5, [], [], row(0, 5))
    with pytest.raises(ValueError, match="launches no kernel of the program"):
        N.OpProgram(1, 5, [], [], copy + launch)  # no kernel table
    with pytest.raises(ValueError, match="or no blocks"):
        N.OpProgram(1, 5, [kernel], [], copy + row(2, 1, c=0))
    with pytest.raises(ValueError, match="needs a function"):
        N.OpProgram(1, 5, [(0, 32, [0])], [], copy)
    with pytest.raises(ValueError, match="after the first"):
        N.OpProgram(1, 5, [kernel], [(0, 0, 1, 1, 0)], copy)  # the first is the launch's
    with pytest.raises(ValueError, match="names no event"):
        N.OpProgram(1, 5, [kernel], [], copy + row(4, 1))  # a stream waits for event 0
    with pytest.raises(ValueError, match="needs a context"):
        N.OpProgram(0, 5, [kernel], [], copy)
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:  # no driver here (CI): refused with the reason
        with pytest.raises(RuntimeError, match="libcuda.so.1"):
            p.issue(terms)


@pytest.mark.parametrize("topology,world,roots", [("mesh", 2, 1), ("ring", 3, 2)])
def test_one_handoff_collective_is_posted_in_one_go(topology, world, roots):
    """A collective of at most ONE_HANDOFF_SLICE whose ring entries are all there when the
    proxy reads them goes out with one flag per stream (the last piece's value: every wait
    is flag >= value), relays included, each item's contiguous parts as one write (one root,
    one direction); a larger one piece by piece. The bytes are the same either way."""
    from sparkccl import layout as Lay
    oh = Lay.protocol_constants()["ONE_HANDOFF_SLICE"]
    for slice_, batched in ((oh - 16 * 7 - 3, True), (oh + 16, False)):
        w = World(topology, world, roots, slice_)
        try:
            seq = 0
            for r in range(world):
                for b in range(world):
                    w.block(r, Region.AG, seq, b, slice_)[:] = (pattern(seq, r, 0, slice_)
                                                                 if b == r else 0xEE)
                for c in range(G.PIECES):
                    assert N.publish(w.ctl[r].addr, int(Op.AG), seq, c, -1, slice_, 16, 5.0) == 0
            w.slices[seq] = (slice_, 16)
            w.start()  # (every entry is there before any proxy runs)
            w.wait_all(Op.AG, seq)
            for r in range(world):
                for b in range(world):
                    assert np.array_equal(w.block(r, Region.AG, seq, b, slice_),
                                          pattern(seq, b, 0, slice_)), (r, b, slice_)
            w.check_healthy()
            for r in range(world):
                st = w.proxies[r].stats()
                streams = sum(1 for s in w.plans[r].to_tables()["streams"] if s[0] == int(Op.AG))
                assert st["flags"] == streams * (1 if batched else G.PIECES), (r, slice_, st)
                if topology == "mesh" and roots == 1:
                    assert st["writes"] == streams * (1 if batched else G.PIECES), (r, st)
        finally:
            w.stop()


@pytest.mark.parametrize("topology,world", [("mesh", 2), ("ring", 4)])
def test_idle_root_1_sends_nothing(topology, world):
    """A collective whose pieces all go whole on root 0 (G.root1_idle: a slice of at most
    32 KiB) leaves root 1 idle: its streams, relays too, write no flag (and no byte), and the
    waits leave its words out; a larger one uses both roots again. Exact either way."""
    w = World(topology, world, 2, 65536)
    w.start()
    try:
        for slice_, idle in ((4096, True), (8 * G.ROOT_SPLIT_MIN, True),
                             (8 * G.ROOT_SPLIT_MIN + 16, False), (16, True)):
            assert G.root1_idle(slice_) == idle
            seq = w.seq
            run_ag(w, slice_)
            run_rs(w, slice_)
            for r, plan in enumerate(w.plans):
                for op, s in ((Op.AG, seq), (Op.RS, seq + 1)):
                    words = {x for ws in plan.waits[op] for x in ws}
                    root1 = [int(w.ctl[r].flags[x]) for x in sorted(words) if x % 2 == 1]
                    assert root1, (r, op)
                    if idle:
                        assert all(v < G.flag_value(s, 0) for v in root1), (r, op, slice_, root1)
                    else:
                        assert all(v == G.flag_value(s, G.PIECES - 1) for v in root1), (r, op)
        w.check_healthy()
    finally:
        w.stop()
