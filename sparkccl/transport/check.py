"""The lane check: before the first collective, every connection is proved with one small
write and one flag, for any transport (shm, tcp, verbs).

For each connection of its plan that carries a stream, a rank writes 16 bytes that name
(sender, receiver, flag word) from its AG slot 1 into the receiver's AG slot 2 at
``16 * word``, then writes value 1 into ``word`` -- the flag word of the connection's first
stream, which only that connection ever writes (docs/PROTOCOL.md), and which nothing waits on yet.
It then waits, with a timeout, until its own writes completed and every connection
arriving here delivered its flag, and checks the 16 bytes that came with each (a flag
visible before its data would show here as a mismatch). It resets what the check wrote
(the flag words to 0: the first real flag value is 1) and only then reports through the
store; every rank raises the same :class:`~sparkccl.errors.CollectiveError` naming each
failed connection (peer, port, root, cause) if any rank failed. No rank sends a real flag
before every rank has reported, so the reset never races a collective.

| variable | default | meaning |
| --- | --- | --- |
| ``SPARKCCL_LANE_CHECK`` | 1 | 0 skips the check |
| ``SPARKCCL_LANE_CHECK_TIMEOUT_S`` | min(timeout, 30) | how long a rank waits for its lanes |
"""
from __future__ import annotations

import ctypes
import struct
import time

import numpy as np

from .. import config
from ..errors import CollectiveError
from ..plan.model import Region

ENV_ENABLE = "SPARKCCL_LANE_CHECK"
ENV_TIMEOUT = "SPARKCCL_LANE_CHECK_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 30.0
CHECK_VALUE = 1
CHECK_BYTES = 16
MAGIC = b"SCHK"


def enabled(env=None) -> bool:
    return config.get(ENV_ENABLE, env)


def timeout_for(timeout_s: float, env=None) -> float:
    t = config.get(ENV_TIMEOUT, env)
    return t if t is not None else min(timeout_s, DEFAULT_TIMEOUT_S)


def pattern(sender: int, receiver: int, word: int) -> bytes:
    return struct.pack("<4sIII", MAGIC, sender, receiver, word)


def _first_words(plan) -> dict[int, int]:
    """connection index -> flag word at the peer of the first stream it carries."""
    out: dict[int, int] = {}
    for s in plan.streams:
        out.setdefault(s.conn, s.dst_flag)
    return out


def _port(topology: str, channel: int) -> str:
    return "mesh" if topology == "mesh" else ("prev", "next")[channel] + "-facing"


def lane_check(nat, proxy, plans, rank: int, topology: str, transport: str, ag, ag_stride: int,
               flags_addr: int, rv, timeout_s: float, abort_check=None) -> float:
    """Run the check (all ranks together, proxy not started). ``ag``: this rank's AG region
    as a uint8 tensor / array. Returns the seconds it took; raises CollectiveError."""
    t0 = time.monotonic()
    world = len(plans)
    plan = plans[rank]
    if world < 2:
        return 0.0
    a = ag.numpy() if hasattr(ag, "numpy") else ag
    mine = _first_words(plan)
    rows = []
    for i, c in enumerate(plan.connections):
        if i not in mine:
            continue
        w = mine[i]
        src = ag_stride + i * CHECK_BYTES
        dst = 2 * ag_stride + w * CHECK_BYTES
        if dst + CHECK_BYTES > 3 * ag_stride or src + CHECK_BYTES > 2 * ag_stride:
            raise ValueError(f"slot too small for the lane check ({ag_stride} bytes)")
        a[src:src + CHECK_BYTES] = np.frombuffer(pattern(rank, c.peer, w), np.uint8)
        rows.append([i, int(Region.AG), src, int(Region.AG), dst, CHECK_BYTES, w])
    expect: dict[int, tuple[int, object]] = {}
    for p in range(world):
        if p == rank:
            continue
        theirs = _first_words(plans[p])
        for j, c in enumerate(plans[p].connections):
            if c.peer == rank and j in theirs:
                expect[theirs[j]] = (p, c)

    # Everyone ready first: timeout_s is for the lanes, not for a peer still building its
    # data plane (on a GPU machine a rank's kernel loading once outlasted a 2 s timeout).
    rv.barrier("lane-check-ready", "get ready for the lane check", abort_check=abort_check)
    res = nat.check_lanes(proxy, rows, sorted(expect), CHECK_VALUE, flags_addr, timeout_s)
    errors = []
    if res["error"] and res["conn"] >= 0:
        c = plan.connections[res["conn"]]
        errors.append(f"connection to peer {c.peer} ({_port(topology, c.channel)} port, root "
                      f"{c.root}): {res['error']}")
    elif res["error"] and res["error"] != "timed out":
        errors.append(res["error"])
    if res["unsent"]:
        errors.append(f"{res['unsent']} of its lane-check writes did not complete within "
                      f"{timeout_s:g} s")
    # Its own post or completion failed: it stopped waiting for the others' checks.
    quit_early = bool(res["error"]) and res["error"] != "timed out"
    for w, (p, c) in sorted(expect.items()):
        if ctypes.c_uint64.from_address(flags_addr + 8 * w).value < CHECK_VALUE:
            if not quit_early:
                errors.append(f"nothing arrived from peer {p} ({_port(topology, c.channel)} port "
                              f"of rank {p}, root {c.root}, flag word {w})"
                              + (f" within {timeout_s:g} s" if res["error"] == "timed out" else ""))
            continue
        got = bytes(a[2 * ag_stride + w * CHECK_BYTES:2 * ag_stride + (w + 1) * CHECK_BYTES])
        if got != pattern(p, rank, w):
            errors.append(f"peer {p} ({_port(topology, c.channel)} port of rank {p}, root "
                          f"{c.root}): its flag arrived but the 16 bytes written before it "
                          f"did not ({got.hex()}): the transport does not keep the ordering "
                          "contract (for verbs try SPARKCCL_IB_ORDERING=strict)")
    # Undo everything the check wrote here, before telling anyone we are done.
    for r in rows:
        a[r[2]:r[2] + CHECK_BYTES] = 0
    for w in expect:
        a[2 * ag_stride + w * CHECK_BYTES:2 * ag_stride + (w + 1) * CHECK_BYTES] = 0
        ctypes.c_uint64.from_address(flags_addr + 8 * w).value = 0
    report = {"error": (f"rank {rank}: " + "; ".join(errors)) if errors else None}
    outcomes = rv.exchange("lane-check", report, "check its lanes", abort_check=abort_check)
    failed = [o["error"] for o in outcomes if o.get("error")]
    if failed:
        text = (f"sparkccl {transport} transport: lane check failed (one write and flag per "
                "connection before the first collective):\n  " + "\n  ".join(failed))
        raise CollectiveError(f"rank {rank}: {text}", rank=rank, cause=text)
    return time.monotonic() - t0

