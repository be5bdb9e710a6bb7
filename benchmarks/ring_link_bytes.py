"""Bytes on each ring link per collective, read from the links' counters, against the plan.

Builds a ring of W boxes in network namespaces (tests/netns.py: box r's "next" port is a
veth pair per root to box r+1's "prev" port, no routes between non-neighbours), runs
sparkccl over the tcp transport in every box, and around one large all-gather and one
large reduce-scatter reads every veth's tx byte counter (from sysfs inside the box). Each
port's measured bytes (both roots' links together) are compared with the plan's payload
for that port (docs/CONTRACT.md §3, ring W=4: all-gather 1.5 slices per port, reduce-scatter 2), and
the remainder is split into the transport's frame headers (24 bytes per write and per
flag) and TCP/IP/Ethernet overhead.

Needs root and iproute2. Run from the repository root::

    python benchmarks/ring_link_bytes.py                 # W=4, 8 MiB slices
    python benchmarks/ring_link_bytes.py --world 4 --slice 16M --rate 2gbit
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import netns  # noqa: E402

FRAME_HEADER = 24  # native/src/tcp_transport.cpp


def plan_port_bytes(topology: str, world: int, roots: int, op_name: str, slice_bytes: int):
    """{(rank, channel): (payload bytes, frames)} one collective puts out through each port."""
    from sparkccl.plan.build import build_plan
    from sparkccl.plan.geometry import PIECES, piece_bounds, sub_range
    from sparkccl.plan.model import Op
    op = Op[op_name]
    out = {}
    for r in range(world):
        plan = build_plan(topology, world, r, roots)
        for s in plan.streams_of(op):
            ch = plan.connections[s.conn].channel
            payload, frames = out.get((r, ch), (0, 0))
            for c in range(PIECES):
                lo, hi = piece_bounds(slice_bytes, c)
                for it in s.items:
                    a, b = sub_range(lo, hi, it.part)
                    payload += b - a
                    frames += b > a
                frames += 1  # the flag
            out[(r, ch)] = (payload, frames)
    return out


def link_bytes_job(rank, world, store, slice_bytes, roots):
    """Inside box `rank`: tx/rx deltas of this box's ring links around one all-gather and
    one reduce-scatter (after a warm-up of each)."""
    import torch

    import sparkccl
    ifs = [netns.ring_link_ifname(role, k) for role in ("prev", "next") for k in range(roots)]
    res = {}
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology="ring",
                               transport="tcp", slot_bytes=world * slice_bytes,
                               timeout_s=120) as comm:
        x_ag = torch.full((slice_bytes,), rank, dtype=torch.uint8)
        x_rs = torch.ones((world * slice_bytes // 2,), dtype=torch.bfloat16)
        calls = {"AG": lambda: comm.all_gather(x_ag), "RS": lambda: comm.reduce_scatter(x_rs)}
        for name, call in calls.items():
            call()  # warm-up (reduce-scatter buffers are created on first use)
            netns.barrier(store, f"{name}-a", world)
            time.sleep(0.2)  # trailing ACKs of the warm-up
            before = netns.local_counters(ifs)
            netns.barrier(store, f"{name}-b", world)
            t0 = time.perf_counter()
            call()
            dt = time.perf_counter() - t0
            netns.barrier(store, f"{name}-c", world)  # every rank has every byte
            time.sleep(0.2)
            after = netns.local_counters(ifs)
            res[name] = {"seconds": dt,
                         "tx": {n: after[n][0] - before[n][0] for n in ifs},
                         "rx": {n: after[n][1] - before[n][1] for n in ifs}}
    return res


def measure(world: int = 4, slice_bytes: int = 8 << 20, roots: int = 2, rate: str | None = None,
            timeout_s: float = 600):
    """-> rows: dict(op, rank, port, measured, plan, frames, ratio, seconds)."""
    with netns.Fabric("ring", world, roots, rate=rate) as fab:
        results = fab.run(link_bytes_job, (slice_bytes, roots), timeout_s=timeout_s)
        bad = [r for r in results if not r.ok]
        if bad:
            raise RuntimeError("\n".join(f"rank {r.rank}: {r.error_type}: {r.message}\n"
                                         f"{r.traceback or ''}" for r in bad))
    rows = []
    for op in ("AG", "RS"):
        plan = plan_port_bytes("ring", world, roots, op, slice_bytes)
        for r, res in enumerate(results):
            m = res.value[op]
            for ch, role in ((0, "prev"), (1, "next")):
                measured = sum(m["tx"][netns.ring_link_ifname(role, k)] for k in range(roots))
                payload, frames = plan.get((r, ch), (0, 0))
                rows.append(dict(op=op, rank=r, port=role, measured=measured, plan=payload,
                                 frames=frames, seconds=m["seconds"],
                                 ratio=measured / payload if payload else float("nan")))
    return rows


def report(rows, slice_bytes: int) -> str:
    lines = [f"{'op':<3} {'rank':>4} {'port':<5} {'measured B':>12} {'slices':>7} "
             f"{'plan B':>12} {'slices':>7} {'meas/plan':>9} {'frames B':>9} {'tcp/ip B':>9}"]
    for w in rows:
        hdr = w["frames"] * FRAME_HEADER
        lines.append(f"{w['op']:<3} {w['rank']:>4} {w['port']:<5} {w['measured']:>12} "
                     f"{w['measured'] / slice_bytes:>7.3f} {w['plan']:>12} "
                     f"{w['plan'] / slice_bytes:>7.3f} {w['ratio']:>9.4f} {hdr:>9} "
                     f"{w['measured'] - w['plan'] - hdr:>9}")
    for op in ("AG", "RS"):
        sel = [w for w in rows if w["op"] == op]
        mean = sum(w["measured"] for w in sel) / len(sel) / slice_bytes
        worst = max(w["ratio"] for w in sel)
        secs = max(w["seconds"] for w in sel)
        lines.append(f"{op}: mean {mean:.4f} slices per port per call (plan "
                     f"{sum(w['plan'] for w in sel) / len(sel) / slice_bytes:g}), worst "
                     f"measured/plan {worst:.4f}, call {secs * 1e3:.1f} ms")
    return "\n".join(lines)


def main(argv=None) -> int:
    from sparkccl.config import parse_bytes
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--slice", default="8M", help="bytes per rank per collective")
    ap.add_argument("--roots", type=int, default=2, choices=[1, 2])
    ap.add_argument("--rate", default=None, help="tc rate per link, e.g. 2gbit")
    a = ap.parse_args(argv)
    why = netns.unavailable_reason()
    if why:
        print(f"ring_link_bytes: {why}")
        return 2
    slice_bytes = parse_bytes(a.slice, "--slice")
    slice_bytes -= slice_bytes % 16
    rows = measure(a.world, slice_bytes, a.roots, a.rate)
    print(f"ring W={a.world}, {a.roots} root(s) per port, slice {slice_bytes} bytes, tcp over "
          "veth (MTU 9000); tx bytes per port = sum over the port's root links")
    print(report(rows, slice_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
