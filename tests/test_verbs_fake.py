"""The verbs transport against a fake libibverbs (no RDMA hardware needed).

``verbsfake.install`` routes every verbs call of this process to an in-process fake fabric
(tests/verbsfake/verbs_fake.cpp: a test-only library, built by tests/testlibs.py and loaded
through SPARKCCL_IBVERBS_LIB) that checks what a NIC checks (QP states, PSNs, path MTU,
lkeys / rkeys and their ranges, inline sizes, queue and CQ capacities), executes RDMA writes into the destination's registered memory, and records every call. Every rank
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
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from sparkccl import layout as L
from sparkccl.bootstrap import Rendezvous
from sparkccl.errors import ConfigError, CollectiveError
from sparkccl.fabric import FabricError, RootChoice, Selection
from sparkccl.plan import geometry as G
from sparkccl.plan.build import build_plan
from sparkccl.plan.model import Op, Region, decode_flag_word, num_flag_words
from sparkccl.transport import check as lane_check
from sparkccl.transport import verbs as V
# (tests/ is on sys.path under pytest)
from inproc import SLOTS, ProxyWorld, run_ag, run_ll, run_rs, run_sized  # noqa: E402
from membuf import Buf, wait_abort  # noqa: E402
import verbsfake as FAKE  # noqa: E402

import sparkccl._native as N  # noqa: E402 - the native layer is not optional: no skip

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# A slice of at most this goes out in one go where its pieces are ready together
ONE_HANDOFF = L.protocol_constants()["ONE_HANDOFF_SLICE"]

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
    # gid "": the fake NICs' GIDs differ from the sysfs ones (no cross-check warning)
    return RootChoice(device=dev, port=1, group=group, root=root, gid_index=GID_INDEX,
                      gid="", netdev=None,
                      ipv4=None, mtu=4096, rate="200 Gb/sec (2X NDR)", why="test")


def selection(topology: str, roots: int = 2) -> Selection:
    f0 = (choice("rocep1s0f0", 0, "0000:01:00.0"), choice("roceP2p1s0f0", 1, "0000:01:00.0"))
    f1 = (choice("rocep1s0f1", 0, "0000:01:00.1"), choice("roceP2p1s0f1", 1, "0000:01:00.1"))
    if topology == "mesh":
        return Selection("mesh", "test", mesh=f1[:roots])
    return Selection("ring", "test", prev=f0[:roots], next=f1[:roots])


@pytest.fixture
def fake():
    FAKE.install(fake_devices())
    yield N
    FAKE.uninstall()


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


class VWorld(ProxyWorld):
    """W ranks in this process over the fake verbs fabric: control block, flags, regions,
    one Proxy (its transport attached by VerbsLink) and one VerbsLink each, brought up in threads through a
    store like a communicator does."""

    def __init__(self, topology, world, roots, max_slice, *, settings=None, selections=None,
                 rank_settings=None, lane_check_on=True, spin_us=2000, nap_us=50):
        super().__init__(topology, world, roots, max_slice, spin_us, nap_us, transport="verbs")
        nfw = num_flag_words(world)
        store = DictStore()
        self.links = [None] * world
        self.entry_writes = 1  # WRs per call entry (check_work_requests)

        def up(r):
            rv = Rendezvous(store, "t", r, world, 30.0)
            s = (rank_settings or {}).get(r, settings) or V.VerbsSettings()
            sel = selections[r] if selections else selection(topology, roots)
            memory = {V.KEY_FLAGS: (self.ctl[r].flags_addr, V.flags_key_bytes(nfw))}
            for g in range(3):
                memory[g] = (self.regions[r][g].addr, SLOTS[g] * self.stride[g])
            self.links[r] = V.connect(rv, self.plans, r, topology, roots, self.proxies[r],
                                      memory, timeout_s=30.0, selection=sel, settings=s)
            if lane_check_on:
                lane_check.lane_check(N, self.proxies[r], self.plans, r, topology, "verbs",
                                      self.regions[r][0].a, self.stride[0],
                                      self.ctl[r].flags_addr, rv, 10.0)

        _, errs = in_threads(world, up)
        self.setup_errors = errs

    def check_setup(self):
        for e in self.setup_errors:
            if e is not None:
                raise e

    def stop(self):
        super().stop()
        for link in self.links:
            if link is not None:
                link.close()


# ------------------------------------------------------------------------- WR analysis


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
    relays = any(s.origin != r for r, plan in enumerate(w.plans) for s in plan.streams)
    last_value = {}
    last_piece = {}  # (rank, stream, seq) -> the piece its latest flag said
    for (r, i), wrs in by_conn.items():
        plan = w.plans[r]
        conn = plan.connections[i]
        link = w.links[r]
        paired = link._paired[i]
        group = []
        calls = set()  # (origin, seq slot) of the call entries posted on the connection
        call_area = w.ctl[conn.peer].flags_addr + 8 * nflags
        for e in wrs:
            if e["inline"] and not e["signaled"]:  # a call entry (both orderings): plainly,
                # one write of its first two words (the call and the slice), or of all six
                # (a sized all-to-all on a plan with relays: its lengths' words too), or one
                # per word where the QP inlines only 8 bytes
                n = L.CALL_ENTRY_WORDS
                lengths = ({8} if w.entry_writes > 1 else
                           {8 * L.CALL_SIZED} | ({8 * n} if w.sized and relays else set()))
                assert e["opcode"] == WR_RDMA_WRITE and e["length"] in lengths, e
                word = (e["remote_addr"] - call_area) // 8
                assert e["remote_addr"] % 8 == 0 and 0 <= word < n * w.world * L.CALL_SLOTS, e
                assert e["length"] == 8 or word % n == 0, e
                assert e["rkey"] == paired["mem"][V.KEY_FLAGS][2]
                calls.add(divmod(word // n, L.CALL_SLOTS))
                continue
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
                assert e["remote_addr"] == w.ctl[conn.peer].flags_addr + 8 * word
            else:
                assert e["opcode"] == WR_RDMA_WRITE and e["length"] == 8 and e["num_sge"] == 1
                off = e["remote_addr"] - w.ctl[conn.peer].flags_addr
                assert off % 8 == 0 and 0 <= off < 8 * nflags, e
                word, value = off // 8, e["inline_value"]
            assert e["rkey"] == paired["mem"][V.KEY_FLAGS][2]
            streams = [s for s in plan.streams if s.conn == i and s.dst_flag == word]
            assert len(streams) == 1, (r, i, word)
            s = streams[0]
            seq, piece = divmod(value - 1, 16)
            if seq not in w.slices:  # a strict-mode intermediate step (the piece's data,
                assert strict        # if any, stays pending for the final value)
                continue
            slice_, granule = w.slices[seq]
            # (an idle root 1 sends nothing: no flag, no call entry)
            assert not (conn.root == 1 and G.root1_idle(slice_, granule)), (r, i, seq)
            # the origin's call entry went ahead of its first piece on this connection
            origin = decode_flag_word(w.world, s.dst_flag)[1]
            assert (origin, seq % L.CALL_SLOTS) in calls, (r, i, origin, seq, calls)
            k = plan.streams.index(s)
            # The flag closes every piece since the stream's previous flag of this seq: a
            # one-hand-off slice's ready pieces go out in one go, each item's parts in piece
            # order, contiguous ones as one write (docs/PROTOCOL.md "Streams").
            first = last_piece.get((r, k, seq), -1) + 1
            assert first <= piece and (first == piece or slice_ <= ONE_HANDOFF), \
                (r, k, seq, first, piece)
            last_piece[(r, k, seq)] = piece
            want = []
            for it in s.items:
                run = None
                # a sized all-to-all's parts end at the chunk's length, the origin's own
                # and every relay's alike (docs/PROTOCOL.md "Sized blocks")
                end = (G.sized_bytes(w.sized[seq][s.origin][it.target], slice_)
                       if seq in w.sized else slice_)
                for c in range(first, piece + 1):
                    a, b = G.sub_range(*G.piece_bounds(slice_, c, granule), it.part)
                    b = min(b, max(end, a))
                    if b == a:
                        continue
                    src = (w.regions[r][it.src_region].addr + (seq % SLOTS[it.src_region])
                           * w.stride[it.src_region] + it.src_block * slice_ + a)
                    dst = (w.regions[conn.peer][it.dst_region].addr
                           + (seq % SLOTS[it.dst_region]) * w.stride[it.dst_region]
                           + it.dst_block * slice_ + a)
                    if run is not None and run[0] + run[1] == src and run[2] + run[1] == dst:
                        run[1] += b - a
                        continue
                    if run is not None:
                        want.append(tuple(run))
                    run = [src, b - a, dst, paired["mem"][int(it.dst_region)][2]]
                if run is not None:
                    want.append(tuple(run))
            got = [(g["local_addr"], g["length"], g["remote_addr"], g["rkey"]) for g in group]
            assert got == want, (r, i, s.op, seq, piece, got, want)
            for g in group:  # the lkey is the one of the local region on this QP's device
                assert g["lkey"] in w.lkeys[(r, i)], g
            for c in range(first, piece + 1):
                key = (r, k, seq, c)
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
                idle = plan.connections[s.conn].root == 1 and G.root1_idle(*w.slices[seq])
                for c in range(G.PIECES):
                    assert ((r, k, seq, c) in seen) != idle, ("missing", r, k, seq, c, idle)
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


def _exercise(topology, world, roots, strict=False, entry_writes=1, sized=False):
    """The plan's collectives through the verbs transport on the fake, every work request
    checked (check_work_requests); ``sized``: a sized all-to-all after each slice's four."""
    settings = V.VerbsSettings(ordering="strict" if strict else "inline")
    w = VWorld(topology, world, roots, max(SLICES), settings=settings)
    w.entry_writes = entry_writes  # 2: the QPs inline 8 bytes
    w.check_setup()
    setup_log = FAKE.log(True)
    w.lkeys = collect_lkeys(w, setup_log)
    w.slices_op = {}
    rng = np.random.default_rng([world, roots, entry_writes])
    w.start()
    try:
        for slice_ in SLICES:
            for kind in ("ag", "rs", "rs", "ag"):
                w.slices_op[w.seq] = Op.AG if kind == "ag" else Op.RS
                (run_ag if kind == "ag" else run_rs)(w, slice_)
            if sized:
                w.slices_op[w.seq] = Op.RS
                run_sized(w, slice_, rng)
        w.check_healthy()
        deadline = time.monotonic() + 5
        while any(p.outstanding() for p in w.proxies) and time.monotonic() < deadline:
            time.sleep(0.01)
        n = check_work_requests(w, FAKE.log(True), strict=strict)
        assert n > 0
        assert FAKE.cq_overflows() == 0
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


@pytest.mark.parametrize("world,roots,strict", [(2, 2, False), (3, 1, False), (2, 1, True)])
def test_ll_lines_through_the_proxy(fake, world, roots, strict):
    """CHUNK_LL entries over verbs: each rank's LL lines reach every peer's LL area as RDMA
    WRITEs within the flag words' registration (flags_key_bytes), then the flags."""
    settings = V.VerbsSettings(ordering="strict" if strict else "inline")
    w = VWorld("mesh", world, roots, 8192, settings=settings)
    w.check_setup()
    w.start()
    try:
        for k, slice_ in enumerate([16, 8192, 1008, 64]):
            run_ll(w, slice_, late=k % 2 == 1)
        run_ag(w, 1000)
        w.check_healthy()
    finally:
        w.stop()


@pytest.mark.parametrize("strict", [False, True], ids=["inline", "strict"])
def test_call_entries_go_word_by_word_where_the_qp_inlines_8_bytes(strict):
    """A device that inlines only a flag's 8 bytes: each call entry is one 8-byte inline
    write per word, still ahead of the origin's first flag on the connection."""
    devices = fake_devices()
    for d in devices:
        d["max_inline"] = 8
    FAKE.install(devices)
    try:
        _exercise("ring", 3, 2, strict=strict, entry_writes=2)
    finally:
        FAKE.uninstall()


@pytest.mark.parametrize("topology,world,entry_writes",
                         [("mesh", 3, 1), ("ring", 3, 1), ("ring", 4, 1), ("ring", 4, 2)],
                         ids=["mesh3", "ring3", "ring4", "ring4-inline8"])
def test_sized_all_to_all_writes_only_the_lengths(topology, world, entry_writes):
    """A sized all-to-all: every data write stops at its chunk's length, the origin's (from
    the chunk's first bytes) and each relay's (from the origin's six-word call entry, one
    inline write, or six where the QP inlines 8 bytes), and the data arrives up to it."""
    devices = fake_devices()
    if entry_writes > 1:
        for d in devices:
            d["max_inline"] = 8
    FAKE.install(devices)
    try:
        _exercise(topology, world, 2, entry_writes=entry_writes, sized=True)
    finally:
        FAKE.uninstall()


# ------------------------------------------------------------------------- QP bring-up

def _qp_tables(w: VWorld, log):
    """qpn -> dict(rank, conn, ctx, device, psn) for every QP of the world."""
    creates = {e["qpn"]: e for e in log if e["kind"] == "create_qp"}
    out = {}
    for r, link in enumerate(w.links):
        for i, c in enumerate(link.endpoint.connections()):
            cr = creates[c["qpn"]]
            out[c["qpn"]] = dict(rank=r, conn=i, ctx=cr["ctx"], device=cr["device"], psn=c["psn"],
                                 create=cr)
    return out


@pytest.mark.parametrize("topology,world", [("mesh", 3), ("ring", 2), ("ring", 4)])
def test_qp_transitions_and_attributes(fake, topology, world):
    s = V.VerbsSettings(timeout=14, retry_cnt=5, rnr_retry=6, traffic_class=106,
                        service_level=3)
    w = VWorld(topology, world, 2, 4096, settings=s)
    try:
        w.check_setup()
        log = FAKE.log(False)
        qps = _qp_tables(w, log)
        mods = {}
        for e in log:
            if e["kind"] == "modify_qp":
                assert e["result"] == 0, e
                mods.setdefault(e["qpn"], []).append(e)
        for qpn, q in qps.items():
            r, i = q["rank"], q["conn"]
            conn = w.plans[r].connections[i]
            lanes = selection(topology).mesh if topology == "mesh" else (
                selection(topology).prev if conn.channel == 0 else selection(topology).next)
            assert q["device"] == lanes[conn.root].device
            cr = q["create"]
            assert cr["max_send_wr"] == 512 and cr["max_inline"] >= 8 and cr["sq_sig_all"] == 0
            assert cr["cqe_send"] >= 512
            # The partner: the peer's connection back to r on the arrival channel, same root.
            arr = 0 if topology == "mesh" else 1 - conn.channel
            j = [k for k, c in enumerate(w.plans[conn.peer].connections)
                 if (c.peer, c.channel, c.root) == (r, arr, conn.root)]
            assert len(j) == 1
            partner_qpn = w.links[conn.peer].endpoint.connections()[j[0]]["qpn"]
            partner = qps[partner_qpn]
            seq = mods[qpn]
            assert [(m["from"], m["to"]) for m in seq] == [(QPS_RESET, QPS_INIT), (QPS_INIT, QPS_RTR),
                                                          (QPS_RTR, QPS_RTS)]
            init, rtr, rts = seq
            assert init["mask"] == ATTR["STATE"] | ATTR["PKEY_INDEX"] | ATTR["PORT"] | ATTR["ACCESS_FLAGS"]
            assert (init["port_num"], init["pkey_index"], init["access"]) == (1, 0, 2)
            assert rtr["mask"] == (ATTR["STATE"] | ATTR["AV"] | ATTR["PATH_MTU"] | ATTR["DEST_QPN"]
                                   | ATTR["RQ_PSN"] | ATTR["MAX_DEST_RD_ATOMIC"]
                                   | ATTR["MIN_RNR_TIMER"])
            assert rtr["path_mtu"] == 5 and rtr["dest_qp_num"] == partner_qpn
            assert rtr["rq_psn"] == partner["psn"]
            assert rtr["is_global"] == 1 and rtr["dgid"] == FAKE.gid(partner["ctx"], GID_INDEX)
            assert (rtr["sgid_index"], rtr["hop_limit"], rtr["traffic_class"], rtr["sl"]) == (GID_INDEX, 255, 106, 3)
            assert (rtr["min_rnr_timer"], rtr["max_dest_rd_atomic"], rtr["ah_port_num"]) == (12, 1, 1)
            assert rts["mask"] == (ATTR["STATE"] | ATTR["TIMEOUT"] | ATTR["RETRY_CNT"]
                                   | ATTR["RNR_RETRY"] | ATTR["SQ_PSN"] | ATTR["MAX_QP_RD_ATOMIC"])
            assert (rts["timeout"], rts["retry_cnt"], rts["rnr_retry"]) == (14, 5, 6)
            assert rts["sq_psn"] == q["psn"] and rts["max_rd_atomic"] == 1
        for link in w.links:
            assert link.endpoint.qp_states() == [QPS_RTS] * len(link.endpoint.connections())
        # Memory: flags, the abort inbox and the three regions, local write + remote write,
        # registered once on every device each rank uses.
        regs = [e for e in log if e["kind"] == "reg_mr"]
        assert all(e["access"] == 3 for e in regs)
        assert len(regs) == 5 * len({(q["rank"], q["device"]) for q in qps.values()}), len(regs)
    finally:
        w.stop()


def test_path_mtu_is_min_of_both_ends(fake):
    devs = fake_devices()
    low = []
    for d in devs[2:]:  # copies of the f1 devices with a 1024-byte active MTU
        x = dict(d)
        x["name"] = d["name"] + "_low"
        x["active_mtu"] = 3
        low.append(x)
    FAKE.install(devs + low)
    sels = []
    for r in range(3):
        sel = selection("mesh")
        if r == 1:
            sel = Selection("mesh", "test", mesh=tuple(
                RootChoice(**{**c.__dict__, "device": c.device + "_low", "mtu": 1024}) for c in sel.mesh))
        sels.append(sel)
    w = VWorld("mesh", 3, 2, 4096, selections=sels)
    try:
        w.check_setup()
        log = FAKE.log(False)
        qps = _qp_tables(w, log)
        rtr = {e["qpn"]: e for e in log if e["kind"] == "modify_qp" and e["to"] == QPS_RTR}
        for qpn, q in qps.items():
            peer = w.plans[q["rank"]].connections[q["conn"]].peer
            want = 3 if 1 in (q["rank"], peer) else 5
            assert rtr[qpn]["path_mtu"] == want, (q, peer)
        notes = V.notes_for(w.links[0].records, "mesh")
        assert any("path MTU 1024" in n for n in notes), notes
        w.start()
        w.slices_op = {}
        run_ag(w, 4000)
        run_rs(w, 4000)
        w.check_healthy()
    finally:
        w.stop()


# ------------------------------------------------------------------------- failures

def _conn_index(w, rank, peer, root, channel=0):
    for i, c in enumerate(w.plans[rank].connections):
        if (c.peer, c.root, c.channel) == (peer, root, channel):
            return i
    raise KeyError((rank, peer, root, channel))


def _publish_ag(w, seq, slice_=4096, ranks=None):
    for c in range(G.PIECES):
        for r in (ranks if ranks is not None else range(w.world)):
            N.publish(w.ctl[r].addr, int(Op.AG), seq, c, -1, slice_, 16, 5.0)


def _wait_abort(w, r, timeout=10.0):
    return wait_abort(w.ctl[r].addr, timeout)


def test_completion_error_names_peer_device_qp_and_status(fake):
    slice_ = 2 * G.PIECES * G.ROOT_SPLIT_MIN  # (pieces split between the roots)
    w = VWorld("mesh", 3, 2, slice_)
    try:
        w.check_setup()
        i = _conn_index(w, 0, 2, 1)
        qpn = w.links[0].endpoint.connections()[i]["qpn"]
        peer_qpn = w.links[0]._paired[i]["qpn"]
        # Every entry is there before the proxy runs: the collective goes out in one go,
        # root 1's halves of the eight pieces (eight writes), then one flag of piece 7's
        # value (docs/PROTOCOL.md "Streams"): the ninth work request fails.
        _publish_ag(w, 0, slice_)
        assert FAKE.inject(qpn, WC_RETRY_EXC_ERR, 0x81, G.PIECES)
        w.start()
        code, text = _wait_abort(w, 0)
        assert code == L.ABORT_TRANSPORT, text
        assert text.startswith(f"rank 0: verbs transport: connection {i} (peer 2, channel 0, root 1): ")
        assert f"device roceP2p1s0f1 port 1 QP {qpn:#x} (to peer 2 QP {peer_qpn:#x})" in text
        assert "transport retry counter exceeded (status 12, vendor_err 0x81)" in text
        # and the work request (the first one of the QP's failing completion: the call
        # entry, a data write or the flag, as the fake fails it)
        assert re.search(r"\) on (call entry write \(inline RDMA WRITE\) of value \d+ to word "
                         r"|RDMA WRITE of \d+ bytes from AG|flag write \(inline RDMA WRITE\) of "
                         r"value \d+ to (flag )?word )", text), text
        assert QPS_ERR in [q["state"] for q in FAKE.qps() if q["qpn"] == qpn]
        # Rank 0 tells its peers through their abort inboxes: they fail at once, not at
        # their timeout, naming rank 0's cause.
        code, peer_text = _wait_abort(w, 1, timeout=2.0)
        assert code == L.ABORT_PEER, peer_text
        assert peer_text == f"rank 1: peer 0 aborted: {text}", peer_text
        # Rank 2's root-1 QP pairs with the broken one: the fake fails its next write at once
        # (hardware would take timeout x retries), so either cause may come first there.
        code, peer_text = _wait_abort(w, 2, timeout=2.0)
        assert (code == L.ABORT_PEER and "peer 0 aborted: rank 0" in peer_text) or (
            code == L.ABORT_TRANSPORT and "(peer 0, channel 0, root 1)" in peer_text), peer_text
    finally:
        w.stop()


def test_bad_rkey_is_remote_access_error(fake):
    bad_rkey_case("remote access error (status 10, vendor_err 0x88)")


def bad_rkey_case(status: str) -> None:
    """A write with a wrong rkey fails the sender's connection with a remote access error
    (``status``: how the libibverbs in use words it), naming the write, key and device.
    Shared with the emulated NIC's tests."""
    w = VWorld("mesh", 2, 1, 4096)
    try:
        w.check_setup()
        w.links[1].endpoint.set_remote_key(0, int(Region.AG), 0xDEAD)
        w.start()
        _publish_ag(w, 0)
        code, text = _wait_abort(w, 1)
        assert code == L.ABORT_TRANSPORT, text
        assert status in text, text
        # (the pieces the proxy found published go in one write: docs/PROTOCOL.md "Streams")
        m = re.search(r"RDMA WRITE of (\d+) bytes from AG\+0x1000 to the peer's AG\+0x1000", text)
        assert m and int(m.group(1)) in range(512, 4096 + 1, 512), text
        assert "rkey 0xdead" in text and "peer 0" in text and "rocep1s0f1" in text
    finally:
        w.stop()


def test_async_events(fake):
    w = VWorld("mesh", 2, 2, 4096)
    try:
        w.check_setup()
        log = FAKE.log(False)
        qps = _qp_tables(w, log)
        q0 = next(q for q in qps.values() if q["rank"] == 0 and q["device"] == "roceP2p1s0f1")
        w.start()
        # Not fatal, or a port sparkccl does not use: nothing happens.
        assert FAKE.async_event(ctx=q0["ctx"], type=EVENT_PORT_ACTIVE, port=1)
        assert FAKE.async_event(ctx=q0["ctx"], type=EVENT_PORT_ERR, port=2)
        time.sleep(0.2)
        w.check_healthy()
        run_ag(w, 4096)
        # A fatal QP event names the QP.
        qpn = next(k for k, q in qps.items() if q is q0)
        assert FAKE.async_event(qpn=qpn, type=EVENT_QP_FATAL)
        code, text = _wait_abort(w, 0)
        assert code == L.ABORT_TRANSPORT
        assert f"device roceP2p1s0f1 port 1 QP {qpn:#x}" in text
        assert "async event local work queue catastrophic error (event 1)" in text
        # A port going down on another rank: named by device and port.
        q1 = next(q for q in qps.values() if q["rank"] == 1 and q["device"] == "rocep1s0f1")
        assert FAKE.async_event(ctx=q1["ctx"], type=EVENT_PORT_ERR, port=1)
        code, text = _wait_abort(w, 1)
        assert code in (L.ABORT_TRANSPORT, L.ABORT_PEER)
    finally:
        w.stop()


def test_port_error_names_device_and_port(fake):
    w = VWorld("mesh", 2, 2, 4096)
    try:
        w.check_setup()
        qps = _qp_tables(w, FAKE.log(False))
        q1 = next(q for q in qps.values() if q["rank"] == 1 and q["device"] == "rocep1s0f1")
        w.start()
        assert FAKE.async_event(ctx=q1["ctx"], type=EVENT_PORT_ERR, port=1)
        code, text = _wait_abort(w, 1)
        assert code == L.ABORT_TRANSPORT
        assert "device rocep1s0f1: async event port error (event 10) on port 1" in text
    finally:
        w.stop()


def test_full_send_queue_without_completions_fails(fake):
    s = V.VerbsSettings(stall_s=0.5)
    # (a slice above ONE_HANDOFF goes piece by piece: a write and a flag each)
    w = VWorld("mesh", 2, 1, ONE_HANDOFF + 4096, settings=s)
    try:
        w.check_setup()
        FAKE.pause(True)  # the "NIC" stops: nothing completes
        w.start()
        for seq in range(40):  # 8 pieces x (write + flag) x 40 > 512 send queue entries
            _publish_ag(w, seq, ONE_HANDOFF + 4096, ranks=[0])
        code, text = _wait_abort(w, 0, timeout=20)
        assert code == L.ABORT_TRANSPORT, text
        assert "send queue full (512 work requests) and no completion for 0.5" in text
    finally:
        FAKE.pause(False)
        w.stop()


def test_small_send_queue_drains_and_never_overflows(fake, monkeypatch):
    # 8 entries: every piece (write + flag) must wait for completions of earlier ones.
    orig = V.VerbsSettings.native
    monkeypatch.setattr(V.VerbsSettings, "native", lambda self: {**orig(self), "send_depth": 8})
    w = VWorld("ring", 4, 2, 8192, settings=V.VerbsSettings())
    try:
        w.check_setup()
        creates = [e for e in FAKE.log(True) if e["kind"] == "create_qp"]
        assert creates and all(e["max_send_wr"] == 8 for e in creates)
        w.start()
        w.slices_op = {}
        for _ in range(4):
            run_ag(w, 8192)
            run_rs(w, 8192)
        w.check_healthy()
        posts = [e for e in FAKE.log(True) if e["kind"] == "post_send"]
        assert posts and all(e["result"] == 0 for e in posts)
        assert FAKE.cq_overflows() == 0
    finally:
        w.stop()


def test_strict_flag_values_far_apart(fake):
    """Flag words that jump by more than the immediate can carry go in steps."""
    # (slices whose pieces both roots carry: every flag word of the plan jumps)
    w = VWorld("mesh", 2, 2, 40000, settings=V.VerbsSettings(ordering="strict"))
    try:
        w.check_setup()
        w.lkeys = collect_lkeys(w, FAKE.log(True))
        w.slices_op = {}
        w.start()
        for seq, kind in ((0, "ag"), (1, "rs"), ((1 << 31) + 2, "ag"), ((1 << 33) + 3, "rs"),
                          ((1 << 33) + 4, "ag")):
            w.slices_op[seq] = Op.AG if kind == "ag" else Op.RS
            (run_ag if kind == "ag" else run_rs)(w, 40000, seq=seq)
        w.check_healthy()
        log = FAKE.log(True)
        check_work_requests(w, log, strict=True)
        imms = [e for e in log if e["kind"] == "post_send" and e["opcode"] == WR_RDMA_WRITE_WITH_IMM]
        assert len(imms) > 5 * 8 * 2 * 2  # intermediate steps were needed
    finally:
        w.stop()


def test_reordering_host_inline_fails_lane_check_strict_is_exact(fake):
    """A host whose PCIe bridge lets data writes land after the inline flag: the lane check
    catches it in inline mode; strict mode (flag stored after the receive completion) is
    bit-exact there."""
    FAKE.reorder(2.0)
    try:
        w = VWorld("mesh", 3, 2, 4096)
        errs = w.setup_errors
        assert all(isinstance(e, CollectiveError) for e in errs), errs
        for e in errs:
            assert "does not keep the ordering contract" in str(e), e
            assert "SPARKCCL_IB_ORDERING=strict" in str(e)
        FAKE.reorder(0)
        w.stop()
        FAKE.reorder(0.05)
        w = VWorld("ring", 4, 2, 8192, settings=V.VerbsSettings(ordering="strict"))
        w.check_setup()
        w.start()
        w.slices_op = {}
        for slice_ in (4096, 8192, 1000):
            run_ag(w, slice_)
            run_rs(w, slice_)
        w.check_healthy()
    finally:
        FAKE.reorder(0)
        w.stop()


def test_lane_check_failure_reaches_every_rank(fake):
    w = VWorld("mesh", 3, 2, 4096, lane_check_on=False)
    try:
        w.check_setup()
        i = _conn_index(w, 0, 1, 0)
        qpn = w.links[0].endpoint.connections()[i]["qpn"]
        FAKE.inject(qpn, WC_RETRY_EXC_ERR, 0x81, 0)
        store = DictStore()

        def check(r):
            rv = Rendezvous(store, "lc", r, 3, 30.0)
            lane_check.lane_check(N, w.proxies[r], w.plans, r, "mesh", "verbs", w.regions[r][0].a,
                                  w.stride[0], w.ctl[r].flags_addr, rv, 2.0)

        _, errs = in_threads(3, check)
        assert all(isinstance(e, CollectiveError) for e in errs), errs
        text = str(errs[2])
        assert "lane check failed" in text
        assert (f"rank 0: connection to peer 1 (mesh port, root 0): device rocep1s0f1 port 1 "
                f"QP {qpn:#x}") in text and "transport retry counter exceeded" in text
        # Rank 1 either misses rank 0's check, or (when its own write reaches rank 0's QP
        # after that broke) fails that write.
        assert ("rank 1: nothing arrived from peer 0 (mesh port of rank 0, root 0, flag word" in text
                or "rank 1: connection to peer 0 (mesh port, root 0)" in text), text
        assert "rank 2:" not in text.split("\n", 1)[1]
        # Nothing the check wrote is left behind on the ranks that passed it.
        assert not w.ctl[2].flags.any()
    finally:
        w.stop()


# ------------------------------------------------------------------------- setup failures

def _setup_errors(w):
    errs = w.setup_errors
    w.stop()
    assert all(e is not None for e in errs), errs
    return errs


def test_missing_libibverbs_fails_on_every_rank(monkeypatch):
    FAKE.uninstall()
    monkeypatch.setenv("SPARKCCL_IBVERBS_LIB", "/nonexistent/libibverbs.so.1")
    errs = _setup_errors(VWorld("mesh", 2, 2, 4096))
    for e in errs:
        assert isinstance(e, FabricError), e
        assert "some ranks could not open their RDMA devices" in str(e)
        for r in (0, 1):
            assert f"rank {r}: verbs transport: cannot load /nonexistent/libibverbs.so.1" in str(e)
    ok, why = N.verbs_library()
    assert not ok and "install rdma-core" in why


def test_missing_device_names_the_rank(fake):
    sels = [selection("mesh") for _ in range(3)]
    c = sels[1].mesh[1]
    sels[1] = Selection("mesh", "t", mesh=(sels[1].mesh[0], RootChoice(**{**c.__dict__, "device": "mlx5_9"})))
    errs = _setup_errors(VWorld("mesh", 3, 2, 4096, selections=sels))
    for e in errs:
        assert isinstance(e, FabricError)
        assert ("rank 1: verbs transport: rank 1: RDMA device mlx5_9 not found (libibverbs lists: "
                "rocep1s0f0, roceP2p1s0f0, rocep1s0f1, roceP2p1s0f1)") in str(e)
        assert "rank 0:" not in str(e).split("\n", 1)[1]


def test_port_down(fake):
    FAKE.install(fake_devices(down=("roceP2p1s0f1",)))
    errs = _setup_errors(VWorld("mesh", 2, 2, 4096))
    assert all("roceP2p1s0f1 port 1 is not ACTIVE" in str(e) for e in errs)


def test_reg_mr_failure_hints_memlock(fake):
    FAKE.fail_next("reg_mr", errno.ENOMEM)
    errs = _setup_errors(VWorld("mesh", 2, 2, 4096))
    assert all("ibv_reg_mr(" in str(e) and "ulimit -l" in str(e) for e in errs), errs


def test_create_qp_failure(fake):
    FAKE.fail_next("create_qp", errno.EINVAL)
    FAKE.fail_next("create_qp", errno.EINVAL)  # also the retry with less inline
    errs = _setup_errors(VWorld("mesh", 2, 2, 4096))
    assert all("ibv_create_qp(" in str(e) and "Invalid argument" in str(e) for e in errs), errs


def test_ordering_mismatch_fails_on_every_rank(fake):
    errs = _setup_errors(VWorld("mesh", 3, 2, 4096,
                                rank_settings={1: V.VerbsSettings(ordering="strict")}))
    for e in errs:
        assert isinstance(e, FabricError)
        assert ("ordering mode (SPARKCCL_IB_ORDERING): 'inline' on ranks 0, 2; 'strict' on "
                "rank 1") in str(e)


def _records(world=2, topology="mesh", roots=2):
    recs = []
    for r in range(world):
        plan = build_plan(topology, world, r, roots)
        lanes = {f"{ch}/{k}": dict(device=f"d{ch}{k}", port=1, gid_index=3, gid="00" * 10 + "ffff" + "0a000001",
                                   lid=0, mtu=5, link_layer=2, state=4, ipv4=f"10.{ch}.{k}.{r + 1}/24",
                                   netdev=None)
                 for ch, k in sorted({(c.channel, c.root) for c in plan.connections})}
        conns = [dict(peer=c.peer, channel=c.channel, root=c.root, qpn=0x100 + i, psn=7)
                 for i, c in enumerate(plan.connections)]
        recs.append(dict(version=1, world=world, topology=topology, roots=roots, ordering="inline",
                         lanes=lanes, conns=conns, mem={}, error=None))
    return recs


def test_check_records_pairing_problems():
    assert V.check_records(_records(3), "mesh") == []
    recs = _records(3)
    recs[2]["world"] = 4
    assert V.check_records(recs, "mesh") == ["world: 3 on ranks 0, 1; 4 on rank 2"]
    recs = _records(3)
    del recs[1]["lanes"]["0/1"]
    assert V.check_records(recs, "mesh") == ["devices per rank: 2 on ranks 0, 2; 1 on rank 1"]
    recs = _records(2, "ring")
    recs[1]["lanes"]["0/0"]["link_layer"] = 1
    probs = V.check_records(recs, "ring")
    assert probs == ["rank 0 next root 0 (d10) is Ethernet but rank 1 prev root 0 (d00) is InfiniBand"], probs
    recs = _records(2)
    recs[1]["conns"] = recs[1]["conns"][:1]
    probs = V.check_records(recs, "mesh")
    assert probs == ["rank 0's mesh root 1 connection to rank 1 has no partner there (rank 1 has "
                     "no mesh root 1 connection to rank 0)"], probs
    recs = _records(2)
    recs[0]["lanes"]["0/1"]["mtu"] = 0
    assert V.check_records(recs, "mesh") == ["rank 0 mesh root 1 (d01): no usable active MTU (enum 0)"]
    recs = _records(2, "ring")
    recs[1]["lanes"]["0/0"]["ipv4"] = "10.9.9.9/24"
    assert any("different subnets" in n for n in V.notes_for(recs, "ring"))


def test_settings_precedence_and_errors():
    env = {"NCCL_IB_TIMEOUT": "20", "SPARKCCL_IB_RETRY_CNT": "3", "NCCL_IB_RETRY_CNT": "6",
           "SPARKCCL_IB_ORDERING": "strict", "NCCL_IB_TC": "106"}
    s = V.resolve_settings(env)
    assert (s.timeout, s.retry_cnt, s.rnr_retry, s.ordering, s.traffic_class, s.service_level) == \
        (20, 3, 7, "strict", 106, 0)
    assert V.resolve_settings(env, timeout=12).timeout == 12
    assert V.resolve_settings({}).native() == dict(timeout=18, retry_cnt=7, rnr_retry=7,
                                                   strict=False, traffic_class=0,
                                                   service_level=0, stall_s=120.0)
    with pytest.raises(ConfigError, match="SPARKCCL_IB_ORDERING='sometimes'"):
        V.resolve_settings({"SPARKCCL_IB_ORDERING": "sometimes"})
    with pytest.raises(ConfigError, match="SPARKCCL_IB_TIMEOUT='40': must be in \\[1, 31\\]"):
        V.resolve_settings({"SPARKCCL_IB_TIMEOUT": "40"})
    with pytest.raises(ConfigError, match="SPARKCCL_IB_RNR_RETRY='x'"):
        V.resolve_settings({"SPARKCCL_IB_RNR_RETRY": "x"})
    with pytest.raises(ConfigError, match="timeout='99'"):
        V.resolve_settings({}, timeout=99)


def test_endpoint_argument_checks(fake):
    with pytest.raises(ValueError, match="unknown setting 'timeoutt'"):
        N.VerbsEndpoint(0, 2, [("rocep1s0f1", 1, 3)], [[1, 0, 0]], [0], {"timeoutt": 3})
    with pytest.raises(ValueError, match="retry_cnt must be 0..7"):
        N.VerbsEndpoint(0, 2, [("rocep1s0f1", 1, 3)], [[1, 0, 0]], [0], {"retry_cnt": 9})
    with pytest.raises(ValueError, match="lane out of range"):
        N.VerbsEndpoint(0, 2, [("rocep1s0f1", 1, 3)], [[1, 0, 0]], [1])
    ep = N.VerbsEndpoint(0, 2, [("rocep1s0f1", 1, 3)], [[1, 0, 0]], [0])
    with pytest.raises(RuntimeError, match="is registered already"):
        buf = Buf(4096)
        ep.register_memory(0, buf.addr, 4096)
        ep.register_memory(0, buf.addr, 4096)
    with pytest.raises(ValueError, match="path_mtu"):
        ep.connect(0, 0x100, 1, 0, b"\0" * 16, 7, True)
    ep.close()
    ep.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        ep.register_memory(1, buf.addr, 4096)
    p = N.Proxy(0, 2, Buf(L.control_bytes(16)).addr, 1 << 20, [[1, 0, 0]], [], [])
    with pytest.raises(RuntimeError, match="no transport attached"):
        p.start()
    other = N.VerbsEndpoint(0, 2, [("rocep1s0f1", 1, 3)], [[1, 1, 0]], [0])
    assert other.kind == "verbs" and isinstance(other, N.TransportFactory)
    with pytest.raises(ValueError, match="connections differ from the proxy's plan"):
        p.attach(other)
    # The transport the proxy makes borrows the endpoint: attach keeps it alive with the proxy.
    ep = N.VerbsEndpoint(0, 2, [("rocep1s0f1", 1, 3)], [[1, 0, 0]], [0])
    refs = sys.getrefcount(ep)
    p.attach(ep)
    assert sys.getrefcount(ep) == refs + 1
    with pytest.raises(ValueError, match=r"attach\(shm\): a transport is attached already"):
        p.attach(N.ShmTransport())


# ------------------------------------------------------------------------- real library, ABI

def _real_libibverbs():
    for cand in (os.environ.get("SPARKCCL_TEST_IBVERBS_LIB"), ctypes.util.find_library("ibverbs")):
        if cand:
            return cand
    return None


def test_real_libibverbs_loads_every_symbol(monkeypatch):
    lib = _real_libibverbs()
    if lib is None:
        pytest.skip("no libibverbs here (apt install libibverbs1, or set SPARKCCL_TEST_IBVERBS_LIB)")
    FAKE.uninstall()
    monkeypatch.setenv("SPARKCCL_IBVERBS_LIB", lib)
    ok, what = N.verbs_library()
    assert ok, what
    if glob.glob("/sys/class/infiniband/*"):
        pytest.skip("this host has RDMA devices: see `sparkccl selftest`")
    # Without an RDMA subsystem libibverbs fails the device list (ENOSYS); with one but no
    # devices, it lists none.
    with pytest.raises(RuntimeError, match="RDMA device.{0,3} rocep1s0f1.*(no RDMA subsystem|libibverbs "
                                           "lists no RDMA devices)"):
        N.VerbsEndpoint(0, 2, [("rocep1s0f1", 1, 3)], [[1, 0, 0]], [0])


def _verbs_include():
    for d in (os.environ.get("SPARKCCL_VERBS_INCLUDE"), "/usr/include", "/usr/local/include"):
        if d and os.path.exists(os.path.join(d, "infiniband", "verbs.h")):
            return d
    return None


def test_abi_matches_verbs_h(tmp_path):
    inc = _verbs_include()
    cxx = shutil.which("c++") or shutil.which("g++")
    if inc is None or cxx is None:
        pytest.skip("needs <infiniband/verbs.h> (apt install libibverbs-dev, or set "
                    "SPARKCCL_VERBS_INCLUDE) and a C++ compiler")
    res = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", f"-I{inc}",
                          f"-I{os.path.join(ROOT, 'native', 'src')}",
                          os.path.join(HERE, "verbs_abi_check.cpp")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]


# ------------------------------------------------------------------------- Communicator

def _comm_world(monkeypatch, topology, world, job, timeout_s=30.0, **kw):
    """Communicators over the fake fabric, one per thread (ranks share this process)."""
    import torch.distributed as dist
    import sparkccl
    monkeypatch.setattr(V, "select_lanes", lambda topology, roots, **_: selection(topology, roots))
    store = dist.HashStore()

    def rank_main(r):
        with sparkccl.Communicator(store=store, rank=r, world_size=world, topology=topology,
                                   transport="verbs", slot_bytes=1 << 20, timeout_s=timeout_s,
                                   **kw) as comm:
            assert comm.transport == "verbs"
            return job(comm, r)

    return in_threads(world, rank_main, timeout=120)


def _exact_job(comm, r):
    import torch
    from sparkccl.reference import all_gather_reference, bits, make_input, reduce_scatter_reference
    W = comm.world_size
    bad = []
    for case, (elems, dtype) in enumerate([(1, torch.uint8), (1000, torch.bfloat16),
                                           (70000, torch.float32), (300000, torch.bfloat16)]):
        xs = [make_input(case, q, (elems,), dtype) for q in range(W)]
        if (bits(comm.all_gather(xs[r])) != all_gather_reference(xs)).any():
            bad.append(("ag", elems))
        ys = [make_input(100 + case, q, (W * elems,), dtype if dtype != torch.uint8 else torch.float16)
              for q in range(W)]
        if (bits(comm.reduce_scatter(ys[r])) != reduce_scatter_reference(ys, r)).any():
            bad.append(("rs", elems))
    return bad


@pytest.mark.parametrize("topology,world", [("mesh", 3), ("ring", 4)])
def test_communicator_over_fake_verbs_is_exact(fake, monkeypatch, topology, world):
    out, errs = _comm_world(monkeypatch, topology, world, _exact_job)
    assert errs == [None] * world, errs
    assert out == [[]] * world
    assert FAKE.cq_overflows() == 0


def test_communicator_strict_ordering(fake, monkeypatch):
    monkeypatch.setenv("SPARKCCL_IB_ORDERING", "strict")
    out, errs = _comm_world(monkeypatch, "mesh", 2, _exact_job)
    assert errs == [None, None], errs


_both_done = threading.Barrier(2)


def _failing_job(comm, r):
    import torch
    comm.all_gather(torch.ones(4096))
    _both_done.wait(10)  # every write of that collective has landed on both ranks
    if r == 0:
        link = comm._wiring.link.link
        qpn = link.endpoint.connections()[0]["qpn"]
        FAKE.inject(qpn, WC_RETRY_EXC_ERR, 0x81, 0)
    try:
        for _ in range(3):
            comm.all_gather(torch.ones(4096))
    except CollectiveError as e:
        return str(e)
    return None


def test_communicator_completion_error_is_collective_error(fake, monkeypatch):
    out, errs = _comm_world(monkeypatch, "mesh", 2, _failing_job, timeout_s=5.0)
    assert errs == [None, None], errs
    assert out[0] is not None and "transport retry counter exceeded" in out[0], out
    assert "verbs transport: connection 0 (peer 1" in out[0] and "QP 0x" in out[0]
    # Rank 1 learns it from rank 0's abort notice, or (the fake fails a write to a broken
    # partner QP at once, hardware after timeout x retries) from its own QP's error.
    assert out[1] is not None and ("peer 0 aborted: rank 0: verbs transport" in out[1] or (
        "(peer 0, channel 0, root 0)" in out[1] and "retry counter exceeded" in out[1])), out[1]


def test_communicator_verbs_unavailable_is_clear(monkeypatch):
    import torch.distributed as dist
    import sparkccl
    FAKE.uninstall()
    monkeypatch.setenv("SPARKCCL_IBVERBS_LIB", "/nonexistent/libibverbs.so.1")
    store = dist.HashStore()

    def rank_main(r):
        sparkccl.Communicator(store=store, rank=r, world_size=2, transport="verbs",
                              slot_bytes=1 << 20, timeout_s=10)

    _, errs = in_threads(2, rank_main)
    for e in errs:
        assert isinstance(e, FabricError), e
        assert "cannot load /nonexistent/libibverbs.so.1" in str(e) and "rank 1:" in str(e)


def test_abort_reaches_every_rank_of_a_ring(fake):
    """An abort on rank 0 reaches its neighbours through their abort inboxes, and rank 2
    (not a neighbour) through them, long before any timeout."""
    w = VWorld("ring", 4, 2, 4096)
    try:
        w.check_setup()
        w.start()
        run_ag(w, 4096)
        t0 = time.monotonic()
        N.set_abort(w.ctl[0].addr, L.ABORT_USER, "rank 0: test abort")
        for r in (1, 3, 2):
            code, text = _wait_abort(w, r, timeout=3.0)
            assert code == L.ABORT_PEER, (r, text)
            assert text.endswith("aborted: rank 0: test abort"), text
        assert "peer 1 aborted: rank 1: peer 0 aborted" in N.error_text(w.ctl[2].addr) or \
            "peer 3 aborted: rank 3: peer 0 aborted" in N.error_text(w.ctl[2].addr)
        assert time.monotonic() - t0 < 3
    finally:
        w.stop()


def test_infiniband_lanes_use_lids_not_grh(fake):
    FAKE.install(fake_devices(link_layer=1))
    w = VWorld("mesh", 3, 2, 4096)
    try:
        w.check_setup()
        log = FAKE.log(False)
        qps = _qp_tables(w, log)
        lids = {e["ctx"]: None for e in log if e["kind"] == "open_device"}
        for e in log:
            if e["kind"] == "modify_qp" and e["to"] == QPS_RTR:
                q = qps[e["qpn"]]
                partner = w.links[q["rank"]]._paired[q["conn"]]
                assert e["is_global"] == 0 and e["dlid"] == partner["lid"] != 0, e
        assert lids
        w.start()
        w.slices_op = {}
        run_ag(w, 4096)
        run_rs(w, 1000)
        w.check_healthy()
    finally:
        w.stop()


def test_doctor_shows_verbs_settings(tmp_path):
    import io
    from fakesysfs import gb10
    from sparkccl import doctor
    fs = gb10(tmp_path)
    out = io.StringIO()
    doctor.doctor(sysfs_root=str(tmp_path), ipv4_of=fs.ipv4_of, out=out,
                  env={"SPARKCCL_IB_ORDERING": "strict", "NCCL_IB_TIMEOUT": "20"})
    assert ("verbs: ordering strict (SPARKCCL_IB_ORDERING), QP timeout 20 (4.29 s per attempt, "
            "8 attempts), RNR retry 7, traffic class 0, SL 0") in out.getvalue()
    out = io.StringIO()
    assert doctor.doctor(sysfs_root=str(tmp_path), ipv4_of=fs.ipv4_of, out=out,
                         env={"SPARKCCL_IB_ORDERING": "loose"}) == 1
    assert "SPARKCCL_IB_ORDERING='loose': expected one of inline, strict" in out.getvalue()
