"""The verbs transport against a fake libibverbs (no RDMA hardware needed).

``_native._verbs_fake_install`` routes every verbs call of this process to an in-process
fake fabric (native/src/verbs_fake.cpp) that checks what a NIC checks (QP states, PSNs,
path MTU, lkeys / rkeys and their ranges, inline sizes, queue and CQ capacities), executes
RDMA writes into the destination's registered memory, and records every call. Every rank
of a world lives in this process (threads), each with its own fake NIC per device, so the
full setup path runs: sparkccl.transport.verbs (selection -> records through a store ->
pairing checks -> QP bring-up), the generic lane check, then the proxy executing the plan
over the fake. The tests then check that the posted work requests write exactly the plan's
bytes to the right remote addresses and flag words, bit for bit.
"""
from __future__ import annotations

import ctypes.util
import errno
import glob
import ipaddress
import mmap
import os
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest

from sparkccl import layout as L
from sparkccl.bootstrap import Rendezvous
from sparkccl.errors import CollectiveError
from sparkccl.fabric import FabricError, RootChoice, Selection
from sparkccl.plan import geometry as G
from sparkccl.plan.build import build_plan
from sparkccl.plan.model import REGION_SLOTS, Op, Region, decode_flag_word, num_flag_words
from sparkccl.transport import check as lane_check
from sparkccl.transport import verbs as V

N = pytest.importorskip("sparkccl._native")

SLOTS = [REGION_SLOTS[Region.AG], REGION_SLOTS[Region.RS_SEND], REGION_SLOTS[Region.RS_RECV]]
PID = os.getpid()
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# ibv enums used below
QPS_RESET, QPS_INIT, QPS_RTR, QPS_RTS, QPS_ERR = 0, 1, 2, 3, 6
WR_RDMA_WRITE, WR_RDMA_WRITE_WITH_IMM = 0, 1
ATTR = dict(STATE=1, ACCESS_FLAGS=1 << 3, PKEY_INDEX=1 << 4, PORT=1 << 5, AV=1 << 7,
            PATH_MTU=1 << 8, TIMEOUT=1 << 9, RETRY_CNT=1 << 10, RNR_RETRY=1 << 11,
            RQ_PSN=1 << 12, MAX_QP_RD_ATOMIC=1 << 13, MIN_RNR_TIMER=1 << 15, SQ_PSN=1 << 16,
            MAX_DEST_RD_ATOMIC=1 << 17, DEST_QPN=1 << 20)
WC_REM_ACCESS_ERR, WC_RETRY_EXC_ERR = 10, 12
EVENT_QP_FATAL, EVENT_PORT_ERR, EVENT_PORT_ACTIVE = 1, 10, 9

# A GB10: two QSFP ports (f0, f1), each through two PCIe roots; RoCE v2 GID of the IPv4
# address at index 3 (0/1: link-local v1/v2, 2: IPv4 v1).
GB10 = [("rocep1s0f0", "192.168.100.1"), ("roceP2p1s0f0", "192.168.101.1"),
        ("rocep1s0f1", "192.168.102.1"), ("roceP2p1s0f1", "192.168.103.1")]
GID_INDEX = 3


def gid_bytes(addr: str) -> bytes:
    return ipaddress.IPv6Address(addr).packed


def fake_devices(mtu=5, down=(), link_layer=2):
    out = []
    for i, (name, ip) in enumerate(GB10):
        ll = f"fe80::{i + 1:x}:aff:fe00:1"
        out.append(dict(name=name, active_mtu=mtu, state=1 if name in down else 4,
                        link_layer=link_layer, lid=0x10 + i,
                        gids=[gid_bytes(ll), gid_bytes(ll), gid_bytes(f"::ffff:{ip}"),
                              gid_bytes(f"::ffff:{ip}")]))
    return out


def choice(dev: str, root: int, group: str) -> RootChoice:
    ip = dict(GB10)[dev]
    # gid "": the fake NICs' GIDs differ from the sysfs ones (no cross-check warning)
    return RootChoice(device=dev, port=1, group=group, root=root, gid_index=GID_INDEX,
                      gid="", netdev=None,
                      ipv4=f"{ip}/24", mtu=4096, rate="200 Gb/sec (2X NDR)", why="test")


def selection(topology: str, roots: int = 2) -> Selection:
    f0 = (choice("rocep1s0f0", 0, "0000:01:00.0"), choice("roceP2p1s0f0", 1, "0000:01:00.0"))
    f1 = (choice("rocep1s0f1", 0, "0000:01:00.1"), choice("roceP2p1s0f1", 1, "0000:01:00.1"))
    if topology == "mesh":
        return Selection("mesh", "test", mesh=f1[:roots])
    return Selection("ring", "test", prev=f0[:roots], next=f1[:roots])


@pytest.fixture
def fake():
    N._verbs_fake_install(fake_devices())
    yield N
    N._verbs_fake_uninstall()


class DictStore:
    """The subset of a torch Store that Rendezvous uses, for threads of one process."""

    def __init__(self):
        self.d, self.cv = {}, threading.Condition()

    def set(self, k, v):
        with self.cv:
            self.d[k] = v.encode() if isinstance(v, str) else v
            self.cv.notify_all()

    def get(self, k):
        with self.cv:
            return self.d[k]

    def check(self, keys):
        with self.cv:
            return all(k in self.d for k in keys)


def in_threads(world, fn, timeout=60):
    """Run fn(rank) on `world` threads; returns results, re-raises the first exception."""
    out, errs = [None] * world, [None] * world

    def go(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001
            errs[r] = e

    ts = [threading.Thread(target=go, args=(r,)) for r in range(world)]
    [t.start() for t in ts]
    [t.join(timeout) for t in ts]
    assert not any(t.is_alive() for t in ts), "a rank hung"
    return out, errs


class Buf:
    def __init__(self, nbytes: int):
        self.mm = mmap.mmap(-1, max(nbytes, 1))
        self.a = np.frombuffer(self.mm, dtype=np.uint8)
        self.addr = self.a.ctypes.data


class VWorld:
    """W ranks in this process over the fake verbs fabric: control block, flags, regions,
    one Proxy(transport='verbs') and one VerbsLink each, brought up in threads through a
    store like a communicator does."""

    def __init__(self, topology, world, roots, max_slice, *, settings=None, selections=None,
                 rank_settings=None, lane_check_on=True, spin_us=2000, nap_us=50):
        self.topology, self.world, self.roots = topology, world, roots
        self.plans = [build_plan(topology, world, r, roots) for r in range(world)]
        nfw = num_flag_words(world)
        self.ctl = [Buf(L.control_bytes(nfw)) for _ in range(world)]
        for c in self.ctl:
            N.init_control(c.addr, PID)
        self.flags_addr = [c.addr + L.FLAGS_OFFSET for c in self.ctl]
        blocks = [world, world, self.plans[0].rs_recv_blocks]
        self.stride = [L.slot_stride(b * max_slice) for b in blocks]
        self.regions = [[Buf(SLOTS[g] * self.stride[g]) for g in range(3)] for _ in range(world)]
        self.proxies = []
        for r, plan in enumerate(self.plans):
            t = plan.to_tables()
            p = N.Proxy(r, world, self.ctl[r].addr, self.flags_addr[r], t["connections"],
                        t["streams"], t["items"], SLOTS, spin_us, nap_us, transport="verbs")
            for g in range(3):
                p.set_region(g, self.regions[r][g].addr, self.stride[g])
            self.proxies.append(p)
        store = DictStore()
        self.links = [None] * world

        def up(r):
            rv = Rendezvous(store, "t", r, world, 30.0)
            s = (rank_settings or {}).get(r, settings) or V.VerbsSettings()
            sel = selections[r] if selections else selection(topology, roots)
            memory = {V.KEY_FLAGS: (self.flags_addr[r], nfw * 8)}
            for g in range(3):
                memory[g] = (self.regions[r][g].addr, SLOTS[g] * self.stride[g])
            self.links[r] = V.connect(rv, self.plans, r, topology, roots, self.proxies[r],
                                      memory, timeout_s=30.0, selection=sel, settings=s)
            if lane_check_on:
                lane_check.lane_check(N, self.proxies[r], self.plans, r, topology, "verbs",
                                      self.regions[r][0].a, self.stride[0], self.flags_addr[r],
                                      rv, 10.0)

        _, errs = in_threads(world, up)
        self.setup_errors = errs
        self.seq = 0
        self.slices = {}  # seq -> (slice, granule)

    def check_setup(self):
        for e in self.setup_errors:
            if e is not None:
                raise e

    def start(self):
        for p in self.proxies:
            p.start()

    def stop(self):
        for p in self.proxies:
            p.stop()
        for link in self.links:
            if link is not None:
                link.close()

    def block(self, r, region, seq, b, slice_):
        off = (seq % SLOTS[region]) * self.stride[region] + b * slice_
        return self.regions[r][region].a[off:off + slice_]

    def flags(self, r):
        return np.frombuffer(self.ctl[r].mm, dtype=np.uint64,
                             count=num_flag_words(self.world), offset=L.FLAGS_OFFSET)

    def wait_all(self, op, seq, timeout=20.0):
        for r, plan in enumerate(self.plans):
            for src in range(self.world):
                for c in range(G.PIECES):
                    got = N.wait_flags(self.ctl[r].addr, self.flags_addr[r],
                                       list(plan.waits[op][src]), G.flag_value(seq, c), timeout)
                    assert got == (0, -1), (r, src, c, got, N.error_text(self.ctl[r].addr))

    def check_healthy(self):
        for r in range(self.world):
            assert N.abort_code(self.ctl[r].addr) == 0, N.error_text(self.ctl[r].addr)


def pattern(seq, origin, chunk, n):
    return np.random.default_rng([seq, origin, chunk, n]).integers(0, 256, n, dtype=np.uint8)


def run_ag(w: VWorld, slice_: int, seq=None):
    seq = w.seq if seq is None else seq
    W = w.world
    for r in range(W):
        for b in range(W):
            w.block(r, Region.AG, seq, b, slice_)[:] = pattern(seq, r, 0, slice_) if b == r else 0xEE
    w.slices[seq] = (slice_, 16)
    for c in range(G.PIECES):
        for r in range(W):
            assert N.publish(w.ctl[r].addr, int(Op.AG), seq, c, -1, slice_, 16, 5.0) == 0
    w.wait_all(Op.AG, seq)
    for r in range(W):
        for b in range(W):
            got = w.block(r, Region.AG, seq, b, slice_)
            assert np.array_equal(got, pattern(seq, b, 0, slice_)), ("AG", r, b, slice_, seq)
    w.seq = seq + 1


def run_rs(w: VWorld, slice_: int, seq=None):
    seq = w.seq if seq is None else seq
    W = w.world
    for r in range(W):
        for j in range(W):
            w.block(r, Region.RS_SEND, seq, j, slice_)[:] = pattern(seq, r, j, slice_)
        for b in range(w.plans[r].rs_recv_blocks):
            w.block(r, Region.RS_RECV, seq, b, slice_)[:] = 0xEE
    w.slices[seq] = (slice_, 16)
    for c in range(G.PIECES):
        for r in range(W):
            assert N.publish(w.ctl[r].addr, int(Op.RS), seq, c, -1, slice_, 16, 5.0) == 0
    w.wait_all(Op.RS, seq)
    for r in range(W):
        for i in range(W):
            if i == r:
                continue
            got = w.block(r, Region.RS_RECV, seq, i, slice_)
            assert np.array_equal(got, pattern(seq, i, r, slice_)), ("RS", r, i, slice_, seq)
    w.seq = seq + 1


# ------------------------------------------------------------------------- WR analysis

def lane_of_conn(topology, conn):
    return (conn.channel, conn.root)


def check_work_requests(w: VWorld, log, strict=False):
    """Every post_send of the run against the plan: per connection, groups of data writes
    each closed by one flag; each group is exactly (stream, seq, piece)'s writes, with the
    right local addresses / lkeys, remote addresses / rkeys, lengths, signaling and inline
    flags; and every (stream, collective, piece) appears exactly once."""
    posts = [e for e in log if e["kind"] == "post_send"]
    assert all(e["result"] == 0 for e in posts), [e for e in posts if e["result"]][:3]
    # qpn -> (rank, conn index)
    where = {}
    for r, link in enumerate(w.links):
        for i, c in enumerate(link.endpoint.connections()):
            where[c["qpn"]] = (r, i)
    by_conn = {}
    for e in posts:
        by_conn.setdefault(where[e["qpn"]], []).append(e)
    seen = set()
    nflags = num_flag_words(w.world)
    value_bits = 32 - max(1, (nflags - 1).bit_length())
    last_value = {}
    for (r, i), wrs in by_conn.items():
        plan = w.plans[r]
        conn = plan.connections[i]
        link, peer_link = w.links[r], w.links[conn.peer]
        paired = link._paired[i]
        group = []
        for e in wrs:
            is_flag = (e["opcode"] == WR_RDMA_WRITE_WITH_IMM) if strict else e["inline"]
            if not is_flag:
                assert e["opcode"] == WR_RDMA_WRITE and not e["inline"] and not e["signaled"], e
                group.append(e)
                continue
            assert e["signaled"], e
            if strict:
                word = e["imm"] >> value_bits
                low = e["imm"] & ((1 << value_bits) - 1)
                prev = last_value.get((r, i, word), 0)
                value = prev + ((low - prev) % (1 << value_bits))
                last_value[(r, i, word)] = value
                assert e["num_sge"] == 0 and not e["inline"]
                assert e["remote_addr"] == w.flags_addr[conn.peer] + 8 * word
            else:
                assert e["opcode"] == WR_RDMA_WRITE and e["length"] == 8 and e["num_sge"] == 1
                off = e["remote_addr"] - w.flags_addr[conn.peer]
                assert off % 8 == 0 and 0 <= off < 8 * nflags, e
                word, value = off // 8, e["inline_value"]
            assert e["rkey"] == paired["mem"][V.KEY_FLAGS][2]
            streams = [s for s in plan.streams if s.conn == i and s.dst_flag == word]
            assert len(streams) == 1, (r, i, word)
            s = streams[0]
            seq, piece = divmod(value - 1, 16)
            if seq not in w.slices:  # a strict-mode intermediate step: no data with it
                assert not group, (r, i, word, value)
                continue
            slice_, granule = w.slices[seq]
            lo, hi = G.piece_bounds(slice_, piece, granule)
            want = []
            for it in s.items:
                a, b = G.sub_range(lo, hi, it.part)
                if b == a:
                    continue
                src = (w.regions[r][it.src_region].addr + (seq % SLOTS[it.src_region])
                       * w.stride[it.src_region] + it.src_block * slice_ + a)
                dst = (w.regions[conn.peer][it.dst_region].addr + (seq % SLOTS[it.dst_region])
                       * w.stride[it.dst_region] + it.dst_block * slice_ + a)
                want.append((src, b - a, dst, paired["mem"][int(it.dst_region)][2]))
            got = [(g["local_addr"], g["length"], g["remote_addr"], g["rkey"]) for g in group]
            assert got == want, (r, i, s.op, seq, piece, got, want)
            for g in group:  # the lkey is the one of the local region on this QP's device
                assert g["lkey"] in w.lkeys[(r, i)], g
            key = (r, plan.streams.index(s), seq, piece)
            assert key not in seen, key
            seen.add(key)
            group = []
        assert not group, f"rank {r} conn {i}: writes without a closing flag"
    for r, plan in enumerate(w.plans):
        for k, s in enumerate(plan.streams):
            for seq in w.slices:
                op = Op.AG if w.slices_op[seq] == Op.AG else Op.RS
                if s.op != op:
                    continue
                for c in range(G.PIECES):
                    assert (r, k, seq, c) in seen, ("missing", r, k, seq, c)
    return len(posts)


def collect_lkeys(w: VWorld, log):
    """(rank, conn) -> the lkeys registered on that connection's device."""
    regs = [e for e in log if e["kind"] == "reg_mr"]
    by_ctx = {}
    for e in regs:
        by_ctx.setdefault(e["ctx"], set()).add(e["lkey"])
    opens = [e for e in log if e["kind"] == "open_device"]
    creates = {e["qpn"]: e["ctx"] for e in log if e["kind"] == "create_qp"}
    out = {}
    for r, link in enumerate(w.links):
        for i, c in enumerate(link.endpoint.connections()):
            out[(r, i)] = by_ctx[creates[c["qpn"]]]
    assert opens
    return out


MESH_WORLDS = [2, 3, 4, 5, 6, 7, 8]
RING_WORLDS = [2, 3, 4, 5, 6]
SLICES = [16, 1000, 4096 * 3 + 5]


def _exercise(topology, world, roots, strict=False):
    settings = V.VerbsSettings(ordering="strict" if strict else "inline")
    w = VWorld(topology, world, roots, max(SLICES), settings=settings)
    w.check_setup()
    setup_log = N._verbs_fake_log(True)
    w.lkeys = collect_lkeys(w, setup_log)
    w.slices_op = {}
    w.start()
    try:
        for slice_ in SLICES:
            for kind in ("ag", "rs", "rs", "ag"):
                w.slices_op[w.seq] = Op.AG if kind == "ag" else Op.RS
                (run_ag if kind == "ag" else run_rs)(w, slice_)
        w.check_healthy()
        deadline = time.monotonic() + 5
        while any(p.outstanding() for p in w.proxies) and time.monotonic() < deadline:
            time.sleep(0.01)
        n = check_work_requests(w, N._verbs_fake_log(True), strict=strict)
        assert n > 0
        assert N._verbs_fake_cq_overflows() == 0
    finally:
        w.stop()
    return w


@pytest.mark.parametrize("world", MESH_WORLDS)
def test_mesh_writes_exactly_the_plan(fake, world):
    _exercise("mesh", world, 2)


@pytest.mark.parametrize("world", RING_WORLDS)
def test_ring_writes_exactly_the_plan(fake, world):
    _exercise("ring", world, 2)


@pytest.mark.parametrize("topology,world,roots", [("mesh", 3, 1), ("ring", 4, 1)])
def test_one_root(fake, topology, world, roots):
    _exercise(topology, world, roots)


@pytest.mark.parametrize("topology,world", [("mesh", 2), ("mesh", 4), ("ring", 3), ("ring", 4)])
def test_strict_ordering_writes_exactly_the_plan(fake, topology, world):
    _exercise(topology, world, 2, strict=True)
