"""The tcp transport on loopback: the native frame protocol against hand-made peers
(socket pairs), the Python connection setup (addresses, authentication, clean errors), and
Communicators over tcp: bit-exact results equal to shm on the same inputs, abort
propagation, a killed peer. The multi-host fabrics (switch, ring) are in test_tcp_netns.py.
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time

import numpy as np
import pytest
import torch

import sparkccl
from sparkccl import layout as L
from sparkccl.transport import tcp as T
from sparkccl.errors import CollectiveError, ConfigError
from sparkccl.plan import geometry as G
from sparkccl.plan.build import build_plan
from sparkccl.plan.model import REGION_SLOTS, Region, num_flag_words
from sparkccl.localrun import check, run_ranks
from sparkccl.reference import all_gather_reference, bits, make_input, reduce_scatter_reference

import sparkccl._native as N  # noqa: E402
from helpers import killed_peer_job  # noqa: E402 - tests/ is on sys.path under pytest
from membuf import Buf, wait_abort  # noqa: E402

SLOTS = [REGION_SLOTS[Region.AG], REGION_SLOTS[Region.RS_SEND], REGION_SLOTS[Region.RS_RECV]]
HDR = struct.Struct("<IIQQ")
K_WRITE, K_FLAG, K_ABORT, K_BYE = 0x57524954, 0x47414C46, 0x54524241, 0x20455942
K_LINES = 0x454E494C
LL_AT, LL_BYTES = L.ll_area(num_flag_words(2))  # (in the control segment)


# ---------------------------------------------------------------- native frames

class OneRank:
    """Rank 0 of a world-2 mesh with one root, over socket pairs whose far ends we hold."""

    def __init__(self, stride=4096):
        self.ctl = Buf(L.control_bytes(num_flag_words(2)))
        N.init_control(self.ctl.addr, os.getpid())
        self.flags = self.ctl.a[L.FLAGS_OFFSET:L.FLAGS_OFFSET + 8 * num_flag_words(2)].view(np.uint64)
        self.stride = stride
        self.regions = [Buf(SLOTS[g] * stride) for g in range(3)]
        t = build_plan("mesh", 2, 0, 1).to_tables()
        self.p = N.Proxy(0, 2, self.ctl.addr, self.ctl.addr + L.FLAGS_OFFSET, t["connections"],
                         t["streams"], t["items"], SLOTS, 1000, 50)
        for g in range(3):
            self.p.set_region(g, self.regions[g].addr, stride)
        out_near, self.out_far = socket.socketpair()
        in_near, self.in_far = socket.socketpair()
        self.p.attach(N.TcpTransport([out_near.detach()], [[in_near.detach(), 1, 0, 0]]))
        self.p.start()

    def send(self, kind, region, a, b, payload=b""):
        self.in_far.sendall(HDR.pack(kind, region, a, b) + payload)

    def wait_abort(self, timeout=5.0):
        return wait_abort(self.ctl.addr, timeout)

    def close(self):
        self.p.stop()
        self.in_far.close()
        self.out_far.close()


def test_native_write_then_flag():
    r = OneRank()
    try:
        data = bytes(range(256)) * 4
        r.send(K_WRITE, int(Region.AG), 100, len(data), data)
        r.send(K_FLAG, 0, 3, 77)
        t0 = time.monotonic()
        while r.flags[3] != 77 and time.monotonic() - t0 < 5:
            time.sleep(0.001)
        assert r.flags[3] == 77
        assert bytes(r.regions[0].a[100:100 + len(data)]) == data
        assert N.abort_code(r.ctl.addr) == 0
    finally:
        r.close()
    assert N.abort_code(r.ctl.addr) == 0  # stopping is not a failure


def test_native_sender_frames_in_order():
    """What the proxy posts goes out as write frames then the flag frame, in order."""
    r = OneRank()
    try:
        slice_ = 64
        r.regions[0].a[:slice_] = np.arange(slice_, dtype=np.uint8)
        for c in range(8):
            assert N.publish(r.ctl.addr, 0, 0, c, -1, slice_, 16, 5.0) == 0
        got = bytearray()
        r.out_far.settimeout(5)
        frames = []
        # (until the flag of value 8 on a flag word: the call entry's words come first)
        while not any(f[0] == K_FLAG and f[2] < num_flag_words(2) and f[3] == 8 for f in frames):
            got += r.out_far.recv(65536)
            while len(got) >= HDR.size:
                kind, region, a, b = HDR.unpack_from(got)
                n = HDR.size + (b if kind == K_WRITE else 0)
                if len(got) < n:
                    break
                frames.append((kind, region, a, b, bytes(got[HDR.size:n])))
                del got[:n]
        # first the call entry (its first two words past the flag words: rank 0's, seq 0's
        # slot; a sized all-to-all's lengths go only where relays cut at them,
        # docs/PROTOCOL.md "Call words")
        nfw = num_flag_words(2)
        entry, frames = frames[:2], frames[2:]
        tag = 1  # (seq 0 + 1)
        assert [(f[0], f[2]) for f in entry] == [(K_FLAG, nfw), (K_FLAG, nfw + 1)], entry
        assert entry[0][3] & 0xFF == tag and entry[1][3] == slice_ | tag << 48, entry
        writes = [f for f in frames if f[0] == K_WRITE]
        flags = [f for f in frames if f[0] == K_FLAG]
        assert [f[0] for f in frames[:2]] == [K_WRITE, K_FLAG]
        # seq 0: values up to 8, growing; the pieces published before the proxy read them
        # go out in one go (one flag of the last one's value, docs/PROTOCOL.md "Streams"),
        # and each flag follows the writes of every piece it says
        values = [f[3] for f in flags]
        assert values == sorted(set(values)) and values[-1] == 8, values
        sent = 0
        for f in frames:
            if f[0] == K_WRITE:
                sent += len(f[4])
            else:
                assert sent >= G.piece_bounds(slice_, f[3] - 1)[1], (f, sent)
        assert b"".join(w[4] for w in writes) == bytes(range(slice_))
        assert all(w[1] == int(Region.AG) for w in writes)
    finally:
        r.close()


def read_frames(sock, until, timeout=5.0) -> list:
    """Frames (kind, region, a, b, payload) from ``sock`` until ``until(frames)``."""
    got, frames = bytearray(), []
    sock.settimeout(timeout)
    while not until(frames):
        got += sock.recv(65536)
        while len(got) >= HDR.size:
            kind, region, a, b = HDR.unpack_from(got)
            n = HDR.size + (b if kind in (K_WRITE, K_LINES) else 0)
            if len(got) < n:
                break
            frames.append((kind, region, a, b, bytes(got[HDR.size:n])))
            del got[:n]
    return frames


def ll_lines(data: bytes, seq: int) -> bytes:
    """LL lines of ``data`` (a multiple of 8 bytes) for collective ``seq``: each 4 data bytes
    beside the flag (u32)(seq + 1) (docs/PROTOCOL.md "One shot, LL")."""
    words = np.frombuffer(data, dtype=np.uint32).astype(np.uint64)
    return (words | np.uint64(seq + 1) << np.uint64(32)).tobytes()


def test_native_ll_lines_land_in_the_ll_area():
    """A LINES frame is stored at its offset of the LL area, nothing else touched."""
    r = OneRank()
    try:
        lines = ll_lines(bytes(range(64)), 4)
        at = 3 * 16384 + 32  # (slot 1, block of rank 1, line 2)
        r.send(K_LINES, 0, at, len(lines), lines)
        r.send(K_FLAG, 0, 3, 9)  # (a flag after it: the frames were read in order)
        t0 = time.monotonic()
        while r.flags[3] != 9 and time.monotonic() - t0 < 5:
            time.sleep(0.001)
        area = r.ctl.a[LL_AT:LL_AT + LL_BYTES]
        assert bytes(area[at:at + len(lines)]) == lines
        assert not area[:at].any() and not area[at + len(lines):].any()
        assert N.abort_code(r.ctl.addr) == 0
    finally:
        r.close()


def test_native_ll_lines_sent_once_every_flag_is_there():
    """Entries of chunk CHUNK_LL: the proxy sends nothing until every line of this rank's own
    LL block (seq 0: slot 0, block 0) carries the seq's flag; then the call entry, the lines as
    one LINES frame to the same place, and the piece's flag."""
    r = OneRank()
    try:
        slice_ = 64
        lines = ll_lines(bytes(range(100, 100 + slice_)), 0)
        area = r.ctl.a[LL_AT:LL_AT + LL_BYTES]
        area[:len(lines) - 8] = np.frombuffer(lines[:-8], dtype=np.uint8)  # the last half late
        assert N.publish_range(r.ctl.addr, 0, 0, 0, 7, L.CHUNK_LL, slice_, 16, 5.0) == 0
        r.out_far.settimeout(0.3)
        with pytest.raises(socket.timeout):
            r.out_far.recv(1)
        area[len(lines) - 8:len(lines)] = np.frombuffer(lines[-8:], dtype=np.uint8)
        frames = read_frames(r.out_far, lambda fs: any(f[0] == K_FLAG and f[3] == 8 for f in fs))
        nfw = num_flag_words(2)
        assert [(f[0], f[2]) for f in frames[:2]] == [(K_FLAG, nfw), (K_FLAG, nfw + 1)], frames
        assert [(f[0], f[2], f[3], f[4]) for f in frames[2:3]] == [(K_LINES, 0, 128, lines)]
        assert [(f[0], f[3]) for f in frames[3:]] == [(K_FLAG, 8)], frames
        assert N.abort_code(r.ctl.addr) == 0
    finally:
        r.close()


@pytest.mark.parametrize("frame,expect", [
    (HDR.pack(0xDEAD, 0, 0, 0), "bad frame header"),
    (HDR.pack(K_LINES, 0, 4, 16), "not whole 8-byte halves inside the LL area"),
    (HDR.pack(K_LINES, 0, LL_BYTES - 8, 16), "not whole 8-byte halves inside the LL area"),
    (HDR.pack(K_WRITE, 7, 0, 1), "region 7, which does not exist"),
    (HDR.pack(K_WRITE, 0, 3 * 4096 - 8, 16), "past the end of region AG"),
    (HDR.pack(K_WRITE, 0, 2 ** 64 - 1, 16), "past the end of region AG"),
    (HDR.pack(K_FLAG, 0, 10 ** 6, 1), "flag word 1000000 out of range"),
    (b"", "connection closed by the peer without a goodbye"),
    (HDR.pack(K_WRITE, 0, 0, 100) + b"x" * 10, "in the middle of a write"),
])
def test_native_bad_input_aborts(frame, expect):
    r = OneRank()
    try:
        if frame:
            r.in_far.sendall(frame)
        if not frame or expect.endswith("write"):
            r.in_far.shutdown(socket.SHUT_WR)
        code, text = r.wait_abort()
        assert code == L.ABORT_TRANSPORT, text
        assert text.startswith("rank 0: tcp transport: incoming connection from peer 1 "
                               "(our channel 0, root 0): "), text
        assert expect in text, text
    finally:
        r.close()


def test_native_abort_frame_and_goodbye():
    r = OneRank()
    try:
        r.send(K_BYE, 0, 0, 0)
        r.in_far.shutdown(socket.SHUT_WR)
        time.sleep(0.2)
        assert N.abort_code(r.ctl.addr) == 0  # goodbye, then EOF: a clean close
    finally:
        r.close()
    r = OneRank()
    try:
        text = b"rank 1: something broke"
        r.send(K_ABORT, 0, 0, len(text), text)
        code, msg = r.wait_abort()
        assert code == L.ABORT_PEER and msg == "rank 0: peer 1 aborted: rank 1: something broke"
        # ... and the proxy tells its own peers (abort frame on the outgoing connection).
        r.out_far.settimeout(5)
        hdr = r.out_far.recv(HDR.size, socket.MSG_WAITALL)
        kind, _, _, n = HDR.unpack(hdr)
        assert kind == K_ABORT
        assert r.out_far.recv(n, socket.MSG_WAITALL).decode() == msg
    finally:
        r.close()


def test_native_send_failure_names_connection():
    r = OneRank()
    try:
        r.out_far.close()  # the peer is gone
        for c in range(8):
            N.publish(r.ctl.addr, 0, 0, c, -1, 4096, 16, 5.0)
        code, text = r.wait_abort()
        assert code == L.ABORT_TRANSPORT
        assert text.startswith("rank 0: tcp transport: connection 0 (peer 1, channel 0, root 0)")
        assert "send failed" in text
    finally:
        r.in_far.close()
        r.p.stop()


def test_native_stop_unblocks_a_full_socket():
    r = OneRank(stride=4 << 20)
    try:
        for c in range(8):  # 4 MiB nobody reads: the sender blocks in send()
            N.publish(r.ctl.addr, 0, 0, c, -1, 4 << 20, 16, 5.0)
        time.sleep(0.3)
        assert r.p.outstanding() > 0
    finally:
        t0 = time.monotonic()
        r.close()
        assert time.monotonic() - t0 < 5


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_native_tcp_transport_checks():
    ctl = Buf(L.control_bytes(num_flag_words(2)))
    N.init_control(ctl.addr, os.getpid())
    t = build_plan("mesh", 2, 0, 2).to_tables()
    p = N.Proxy(0, 2, ctl.addr, ctl.addr + L.FLAGS_OFFSET, t["connections"], t["streams"],
                t["items"], SLOTS, 1000, 50)
    with pytest.raises(RuntimeError, match=r"no transport attached before start\(\) \(Proxy.attach\)"):
        p.start()
    pairs = [socket.socketpair() for _ in range(3)]
    fds = [a.detach() for a, _ in pairs]
    with pytest.raises(ValueError, match="negative send fd"):
        N.TcpTransport([fds[0], -1], [])
    assert _closed(fds[0])  # refused at construction: closed there
    tcp = N.TcpTransport([fds[1]], [[fds[2], 1, 0, 0]])
    assert tcp.kind == "tcp"
    with pytest.raises(ValueError, match="1 send fds for 2 connections"):
        p.attach(tcp)
    assert _closed(fds[1]) and _closed(fds[2])  # refused by the proxy: closed too
    more = [socket.socketpair() for _ in range(3)]
    fds = [a.detach() for a, _ in more]
    with pytest.raises(ValueError, match="peer, channel, root in range"):
        p.attach(N.TcpTransport(fds[:2], [[fds[2], 0, 0, 0]]))  # "from" rank 0 itself
    assert all(_closed(fd) for fd in fds)
    for _, b in pairs + more:
        b.close()


# ---------------------------------------------------------------- Python setup

def test_local_endpoints():
    e = T.local_endpoints("mesh", 2, {})
    assert {k: v.addr for k, v in e.items()} == {(0, 0): "127.0.0.1", (0, 1): "127.0.0.1"}
    e = T.local_endpoints("mesh", 2, {"SPARKCCL_TCP_ADDRS": "10.0.0.1, 10.0.1.1"})
    assert [e[(0, k)].addr for k in (0, 1)] == ["10.0.0.1", "10.0.1.1"]
    e = T.local_endpoints("ring", 2, {"SPARKCCL_TCP_PREV_ADDRS": "a,b", "SPARKCCL_TCP_NEXT_ADDRS": "c"})
    assert [e[(ch, k)].addr for ch in (0, 1) for k in (0, 1)] == ["a", "b", "c", "c"]
    assert e[(0, 0)].source == "SPARKCCL_TCP_PREV_ADDRS"
    e = T.local_endpoints("ring", 1, {"SPARKCCL_TCP_ADDRS": "h"})
    assert e[(0, 0)].addr == e[(1, 0)].addr == "h"
    with pytest.raises(ValueError, match="3 addresses for 2 root"):
        T.local_endpoints("mesh", 2, {"SPARKCCL_TCP_ADDRS": "a,b,c"})
    with pytest.raises(ValueError, match="SPARKCCL_TCP_NEXT_ADDRS=.a,.: an empty item"):
        T.local_endpoints("ring", 2, {"SPARKCCL_TCP_NEXT_ADDRS": "a,"})


class _Rv:
    def __init__(self, store, rank, world):
        from sparkccl.bootstrap import Rendezvous
        self.rv = Rendezvous(store, "t", rank, world, 20)

    def exchange(self, *a, **k):
        return self.rv.exchange(*a, **k)


def _connect_threads(world, topology, roots=2, env=None, rogue=None, hold=None):
    """Every rank's T.connect in a thread of this process; ``hold``: an event the
    ranks > 0 wait for before they start."""
    import torch.distributed as dist
    store = dist.HashStore()
    plans = [build_plan(topology, world, r, roots) for r in range(world)]
    out = [None] * world

    def go(r):
        if hold is not None and r > 0:
            hold.wait(20)
        try:
            out[r] = T.connect(_Rv(store, r, world), plans, r, topology, roots, 20, 20,
                               env=(env or {}).get(r, {}))
        except BaseException as e:  # noqa: BLE001
            out[r] = e

    ts = [threading.Thread(target=go, args=(r,)) for r in range(world)]
    if rogue is not None:
        ts.append(threading.Thread(target=rogue, args=(store,)))
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    return out, plans


def test_connect_authenticates_and_rejects_strangers():
    rejected = []
    ready = threading.Event()

    def rogue(store):
        # Wait for rank 0's listeners, then connect with a wrong secret and a right one
        # claiming a rank that is not expected there.
        import json
        key = "t/tcp-listen/0"
        t0 = time.monotonic()
        while not store.check([key]) and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        info = json.loads(store.get(key))
        host, port = info["listen"]["0/0"]
        s = socket.create_connection((host, port))  # queued before rank 1's connections
        s.sendall(T.HELLO.pack(T.MAGIC, b"\0" * 32, 1, 2, 0, 0))
        ready.set()
        rejected.append(s.recv(16))  # closed without an acknowledgement
        s.close()

    links, plans = _connect_threads(2, "mesh", rogue=rogue, hold=ready)
    assert all(isinstance(x, T.Links) for x in links), links
    assert rejected == [b""]
    for r, lk in enumerate(links):
        assert len(lk.send) == len(plans[r].connections) == 2
        assert sorted((p, ch, k) for _, p, ch, k in lk.recv) == [(1 - r, 0, 0), (1 - r, 0, 1)]
        # peer's send socket i pairs with our recv socket of the same root
        lk.close()


def test_connect_ring_only_neighbours():
    links, plans = _connect_threads(5, "ring")
    for r, lk in enumerate(links):
        assert isinstance(lk, T.Links), lk
        peers = {p for _, p, _, _ in lk.recv}
        assert peers == {(r - 1) % 5, (r + 1) % 5}
        lk.close()


def test_connect_cannot_listen_fails_on_every_rank():
    links, _ = _connect_threads(3, "mesh", env={1: {"SPARKCCL_TCP_ADDRS": "192.0.2.77"}})
    for r, e in enumerate(links):
        assert isinstance(e, CollectiveError), e
        assert "rank 1: tcp: cannot listen on 192.0.2.77 (SPARKCCL_TCP_ADDRS" in str(e), str(e)


def test_connect_bad_setting_on_one_rank_fails_every_rank():
    links, _ = _connect_threads(3, "mesh", env={2: {"SPARKCCL_TCP_ADDRS": "a,b,c"}})
    for e in links:
        assert isinstance(e, ConfigError), e
        assert "rank 2: SPARKCCL_TCP_ADDRS='a,b,c': 3 addresses for 2 root(s)" in str(e), str(e)


# ---------------------------------------------------------------- Communicators over tcp

AG_BYTES = [1, 15, 16, 17, 1000, 65536 + 3]
RS_SHAPES = [(1, 3), (3, 5), (7, 129), (100, 257)]
AG_BYTES_BIG = AG_BYTES + [(1 << 20) + 5]
RS_SHAPES_BIG = RS_SHAPES + [(512, 1025)]


def _collectives(comm, seed, big=True):
    """Results (raw bytes) of a fixed sequence of collectives, and mismatches vs numpy."""
    world, rank = comm.world_size, comm.rank
    res, bad = [], []
    for i, n in enumerate(AG_BYTES_BIG if big else AG_BYTES):
        xs = [make_input(seed + i, r, (n,), torch.uint8) for r in range(world)]
        y = bits(comm.all_gather(xs[rank]))
        res.append(y)
        if not (y == all_gather_reference(xs)).all():
            bad.append(f"all_gather {n} bytes")
    for i, (m, h) in enumerate(RS_SHAPES_BIG if big else RS_SHAPES):
        for dtype in (torch.bfloat16, torch.float32):
            xs = [make_input(seed + 100 + i, r, (world * m, h), dtype) for r in range(world)]
            y = bits(comm.reduce_scatter(xs[rank]))
            res.append(y)
            if not (y == reduce_scatter_reference(xs, rank)).all():
                bad.append(f"reduce_scatter {dtype} [{m}, {h}]")
    buf = comm.reduce_scatter_input((world * 16, 64), torch.bfloat16)
    xs = [make_input(seed + 200, r, (world * 16, 64), torch.bfloat16) for r in range(world)]
    buf.copy_(xs[rank])
    y = bits(comm.reduce_scatter(buf))
    res.append(y)
    if not (y == reduce_scatter_reference(xs, rank)).all():
        bad.append("zero-copy reduce_scatter")
    return res, bad


def same_as_shm_job(rank, world, store, topology, slot_bytes):
    import torch.distributed as dist
    out = {}
    for transport in ("tcp", "shm"):
        st = dist.PrefixStore(transport, store)
        with sparkccl.Communicator(store=st, rank=rank, world_size=world, topology=topology,
                                   transport=transport, slot_bytes=slot_bytes,
                                   timeout_s=60) as comm:
            assert comm.transport == transport
            out[transport] = _collectives(comm, seed=7, big=slot_bytes is None)
    bad = out["tcp"][1] + [f"shm: {b}" for b in out["shm"][1]]
    same = all((a == b).all() for a, b in zip(out["tcp"][0], out["shm"][0]))
    return bad, same


# (Every world and fabric again, between namespaces: test_tcp_netns.py.)
@pytest.mark.parametrize("topology,world,slot", [
    ("mesh", 2, None), ("ring", 3, 64 << 10),
    pytest.param("mesh", 4, None, marks=pytest.mark.extended),  # (mesh W3-4: netns, EP, a2a)
    ("ring", 4, None)])
@pytest.mark.slow
def test_loopback_exact_and_same_as_shm(topology, world, slot):
    values = check(run_ranks(same_as_shm_job, world, args=(topology, slot), timeout_s=300))
    for r, (bad, same) in enumerate(values):
        assert not bad, f"rank {r}: {bad}"
        assert same, f"rank {r}: tcp and shm results differ"


def abort_job(rank, world, store):
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology="ring",
                               transport="tcp", timeout_s=60) as comm:
        comm.all_gather(torch.ones(1000))
        store.add("first-done", 1)  # every rank has its first result (relays included)
        while store.add("first-done", 0) < world:
            time.sleep(0.01)
        if rank == 0:
            comm._nat.set_abort(comm._ctl_addr, L.ABORT_USER, "rank 0: test abort")
            time.sleep(0.5)
        t0 = time.monotonic()
        try:
            comm.all_gather(torch.ones(1000))
        except CollectiveError as e:
            return str(e), time.monotonic() - t0
        return None, time.monotonic() - t0


@pytest.mark.slow
def test_loopback_abort_reaches_every_rank():
    """An abort on rank 0 reaches rank 2 of a ring of 4 through the abort frames (relayed
    by rank 1 or 3), long before the 60 s timeout."""
    values = check(run_ranks(abort_job, 4, timeout_s=120))
    for r, (msg, dt) in enumerate(values):
        assert msg is not None, f"rank {r} did not fail"
        assert "test abort" in msg, msg
        assert dt < 20, (r, dt)
    assert "peer" in values[2][0] and "aborted" in values[2][0]


@pytest.mark.slow
def test_loopback_killed_peer_fails_fast():
    res = run_ranks(killed_peer_job, 3, args=("tcp", 1 << 16), timeout_s=120)
    assert res[1].killed
    for r in (0, 2):
        assert res[r].ok, res[r].message
        msg, dt = res[r].value
        assert msg is not None and dt < 20, (r, msg, dt)
        assert "peer 1" in msg, msg


def test_transport_validation():
    import torch.distributed as dist
    with pytest.raises(ValueError, match="must be one of auto, shm, tcp"):
        sparkccl.Communicator(store=dist.HashStore(), rank=0, world_size=1, transport="verbz")
