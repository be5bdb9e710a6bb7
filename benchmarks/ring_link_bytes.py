"""Bytes on each ring link per collective, read from the links' counters, against the plan.

Builds a ring of W boxes in network namespaces (tests/netns.py: box r's "next" port is a
veth pair per root to box r+1's "prev" port, no routes between non-neighbours), runs
sparkccl over the tcp transport in every box, and around one large all-gather and one
large reduce-scatter reads every veth's tx byte counter (from sysfs inside the box). Each
port's measured bytes (both roots' links together) are compared with the plan's payload
for that port (docs/CONTRACT.md §3, ring W=4: all-gather 1.5 slices per port, reduce-scatter 2), and
the remainder is split into the transport's frame headers (24 bytes per write, per flag
and per call-entry word) and TCP/IP/Ethernet overhead with the ACKs of the other direction.

Retransmissions are counted apart: around each call every box also reads its TCP sockets
on the ring links (``ss -ti``: payload sent, and the part of it sent again) and its
namespace's TCP counters. Retransmitted payload is subtracted from the link's bytes before
the ratio (the headers of those segments stay counted), and what the sockets sent once,
the library's frames, must equal the plan's payload plus frame headers to the byte. A veth
loses nothing, but it reorders a flow unless RPS is on (tests/netns.py Fabric._in_order),
and a busy host delays ACKs past the tail loss probe's few milliseconds; both make TCP send
segments again that the receiver already had (its DSACKs say so).

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
    """{(rank, channel): (payload bytes, frames)} one collective puts out through each port.
    Frames: one per write, one per flag, and the call entries (docs/PROTOCOL.md "Call
    words": a flag frame per word, CALL_SIZED words per (connection, origin) per collective
    that is not a sized all-to-all)."""
    from sparkccl.layout import CALL_SIZED
    from sparkccl.plan.build import build_plan
    from sparkccl.plan.geometry import PIECES, piece_bounds, sub_range
    from sparkccl.plan.model import Op
    op = Op[op_name]
    out = {}
    for r in range(world):
        plan = build_plan(topology, world, r, roots)
        calls = set()
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
            if (s.conn, s.origin) not in calls:
                calls.add((s.conn, s.origin))
                frames += CALL_SIZED
            out[(r, ch)] = (payload, frames)
    return out


def _port_addrs(roots):
    """{local address: ifname} of this box's ring links (tests/netns.py's Fabric.env)."""
    out = {}
    for role, env in (("prev", "SPARKCCL_TCP_PREV_ADDRS"), ("next", "SPARKCCL_TCP_NEXT_ADDRS")):
        for k, addr in enumerate(os.environ[env].split(",")[:roots]):
            out[addr] = netns.ring_link_ifname(role, k)
    return out


def _snapshot(ifs, addrs):
    """Link counters, each ring link's TCP sockets (by interface) and the namespace's TCP
    counters, read together."""
    socks = {}
    for (local, peer), c in netns.local_tcp_sockets().items():
        ifname = addrs.get(local.rpartition(":")[0])
        if ifname is not None:
            socks[(ifname, local, peer)] = c
    drops = {}
    for n in ifs:
        drops[n] = 0
        for k in ("tx_dropped", "rx_dropped"):
            with open(f"/sys/class/net/{n}/statistics/{k}") as f:
                drops[n] += int(f.read())
    return dict(links=netns.local_counters(ifs), socks=socks, drops=drops,
                tcp=netns.local_tcp_counters())


def link_bytes_job(rank, world, store, slice_bytes, roots):
    """Inside box `rank`: around one all-gather and one reduce-scatter (after a warm-up of
    each), the deltas of this box's ring links' tx/rx bytes, of what its TCP sockets on
    those links sent (payload, and the part of it sent again: retransmissions) and of the
    namespace's TCP counters."""
    import torch

    import sparkccl
    ifs = [netns.ring_link_ifname(role, k) for role in ("prev", "next") for k in range(roots)]
    addrs = _port_addrs(roots)
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
            before = _snapshot(ifs, addrs)
            netns.barrier(store, f"{name}-b", world)
            t0 = time.perf_counter()
            call()
            dt = time.perf_counter() - t0
            netns.barrier(store, f"{name}-c", world)  # every rank has every byte
            time.sleep(0.2)
            after = _snapshot(ifs, addrs)
            if set(after["socks"]) != set(before["socks"]):  # deltas need the same sockets
                raise RuntimeError(f"rank {rank}: the ring links' sockets changed during the "
                                   f"{name} call: {sorted(before['socks'])} -> "
                                   f"{sorted(after['socks'])}")
            tcp = {n: dict(sent=0, retrans=0, retrans_segs=0) for n in ifs}
            for key, c in after["socks"].items():
                b, t = before["socks"][key], tcp[key[0]]
                t["sent"] += c["bytes_sent"] - b["bytes_sent"]
                t["retrans"] += c["bytes_retrans"] - b["bytes_retrans"]
                t["retrans_segs"] += c["retrans_segs"] - b["retrans_segs"]
            res[name] = {"seconds": dt,
                         "tx": {n: after["links"][n][0] - before["links"][n][0] for n in ifs},
                         "rx": {n: after["links"][n][1] - before["links"][n][1] for n in ifs},
                         "drops": {n: after["drops"][n] - before["drops"][n] for n in ifs},
                         "tcp": tcp,
                         "counters": {k: after["tcp"][k] - before["tcp"].get(k, 0)
                                      for k in after["tcp"]
                                      if after["tcp"][k] != before["tcp"].get(k, 0)}}
    return res


def measure(world: int = 4, slice_bytes: int = 8 << 20, roots: int = 2, rate: str | None = None,
            timeout_s: float = 600):
    """-> rows: dict(op, rank, port, seconds, measured (tx bytes of the port's links), plan
    (payload), frames, tcp_sent (TCP payload sent once: the library's frames), retrans and
    retrans_segs (TCP payload sent again, and its segments), drops (the links' dropped
    packets), counters (the rank's namespace's TCP counters that moved, TCP_COUNTERS),
    in_order (RPS on the links, tests/netns.py Fabric._in_order), raw_ratio (measured /
    plan) and ratio ((measured - retrans) / plan))."""
    with netns.Fabric("ring", world, roots, rate=rate) as fab:
        results = fab.run(link_bytes_job, (slice_bytes, roots), timeout_s=timeout_s)
        in_order = fab.in_order
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
                names = [netns.ring_link_ifname(role, k) for k in range(roots)]
                measured = sum(m["tx"][n] for n in names)
                retrans = sum(m["tcp"][n]["retrans"] for n in names)
                payload, frames = plan.get((r, ch), (0, 0))
                rows.append(dict(
                    op=op, rank=r, port=role, measured=measured, plan=payload, frames=frames,
                    seconds=m["seconds"],
                    # TCP payload put out once (the library's frames) and sent again.
                    tcp_sent=sum(m["tcp"][n]["sent"] for n in names) - retrans,
                    retrans=retrans,
                    retrans_segs=sum(m["tcp"][n]["retrans_segs"] for n in names),
                    drops=sum(m["drops"][n] for n in names), counters=m["counters"],
                    in_order=in_order,
                    raw_ratio=measured / payload if payload else float("nan"),
                    ratio=(measured - retrans) / payload if payload else float("nan")))
    return rows


def report(rows, slice_bytes: int) -> str:
    lines = [f"{'op':<3} {'rank':>4} {'port':<5} {'measured B':>11} {'retrans B':>9} "
             f"{'segs':>4} {'plan B':>9} {'slices':>6} {'(m-rt)/plan':>11} {'frames B':>8} "
             f"{'tcp payload':>11} {'tcp/ip B':>8}"]
    for w in rows:
        hdr = w["frames"] * FRAME_HEADER
        lines.append(f"{w['op']:<3} {w['rank']:>4} {w['port']:<5} {w['measured']:>11} "
                     f"{w['retrans']:>9} {w['retrans_segs']:>4} {w['plan']:>9} "
                     f"{w['plan'] / slice_bytes:>6.3f} {w['ratio']:>11.4f} {hdr:>8} "
                     f"{w['tcp_sent']:>11} {w['measured'] - w['retrans'] - w['tcp_sent']:>8}")
    for op in ("AG", "RS"):
        sel = [w for w in rows if w["op"] == op]
        mean = sum(w["measured"] - w["retrans"] for w in sel) / len(sel) / slice_bytes
        secs = max(w["seconds"] for w in sel)
        counters: dict[str, int] = {}
        for w in sel:
            if w["port"] == "prev":  # one row per namespace
                for k, v in w["counters"].items():
                    counters[k] = counters.get(k, 0) + v
        lines.append(
            f"{op}: mean {mean:.4f} slices per port per call without retransmissions (plan "
            f"{sum(w['plan'] for w in sel) / len(sel) / slice_bytes:g}), worst "
            f"(measured - retrans)/plan {max(w['ratio'] for w in sel):.4f}, with them "
            f"{max(w['raw_ratio'] for w in sel):.4f}, call {secs * 1e3:.1f} ms")
        lines.append(
            f"{op}: retransmitted {sum(w['retrans'] for w in sel)} B in "
            f"{sum(w['retrans_segs'] for w in sel)} segments, {sum(w['drops'] for w in sel)} "
            "packets dropped on the links; TCP counters (all namespaces): "
            + (", ".join(f"{k} {v}" for k, v in sorted(counters.items())) or "none moved"))
    lines.append("links deliver each flow in order (RPS): "
                 + ("yes" if all(w["in_order"] for w in rows) else "no (this kernel lacks RPS)"))
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
          "veth (MTU 9000); tx bytes per port = sum over the port's root links; retrans = "
          "TCP payload sent again on them (ss bytes_retrans); tcp payload = the frames sent "
          "once (ss bytes_sent - bytes_retrans); tcp/ip = measured - retrans - tcp payload")
    print(report(rows, slice_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
