"""What plain TCP sockets reach on the network-namespace fabrics shaped with ``tc``, with
sparkccl out of the picture: the part of netns_bench.py's gap to the line-rate bound that is
the rate limiter's and TCP's (tbf counts Ethernet, IP and TCP headers and ACKs; TCP's
window dynamics through the tbf queue), not the tcp transport's.

Every box sends what an all-gather of ``--slice`` bytes per rank puts on each root link (a
ring: the slice to both neighbours; a switch: the slice to every peer), split over the
roots, on one TCP socket per link and direction, all at once (one thread per socket), from
one start on the host's clock; the time is until the box has received everything. Ideal:
the bytes of one link x 8 / rate.

    python benchmarks/netns_raw_tcp.py --fabric ring --world 3 --rate 200mbit --slice 16M
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import netns  # noqa: E402

PORT = 29400


def _links(rank, world, kind, roots):
    """[(my address, peer, peer's address key)] per outgoing link."""
    if kind == "ring":
        nxt = os.environ["SPARKCCL_TCP_NEXT_ADDRS"].split(",")
        prv = os.environ["SPARKCCL_TCP_PREV_ADDRS"].split(",")
        mine = {("next", k): nxt[k] for k in range(roots)}
        mine.update({("prev", k): prv[k] for k in range(roots)})
        out = [((rank + 1) % world, ("prev", k)) for k in range(roots)]
        out += [((rank - 1) % world, ("next", k)) for k in range(roots)]
    else:
        addrs = os.environ["SPARKCCL_TCP_ADDRS"].split(",")
        mine = {("root", k): addrs[k] for k in range(roots)}
        out = [(p, ("root", k)) for p in range(world) if p != rank for k in range(roots)]
    return mine, out


def _job(rank, world, store, kind, roots, per_link, iters):
    mine, out = _links(rank, world, kind, roots)
    for key, addr in mine.items():
        store.set(f"addr/{rank}/{key[0]}/{key[1]}", addr)
    listeners = []
    for addr in set(mine.values()):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, PORT))
        s.listen(64)
        listeners.append(s)
    netns.barrier(store, "listen", world)
    sends = []
    for peer, key in out:
        addr = store.get(f"addr/{peer}/{key[0]}/{key[1]}").decode()
        c = socket.create_connection((addr, PORT))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sends.append(c)
    n_in = len(out)  # symmetric: as many incoming links as outgoing
    recvs = []
    lk = threading.Lock()

    def accept(s):
        s.settimeout(60)
        while True:
            with lk:
                if len(recvs) >= n_in:
                    return
            try:
                c, _ = s.accept()
            except socket.timeout:
                return
            with lk:
                recvs.append(c)
    ts = [threading.Thread(target=accept, args=(s,)) for s in listeners]
    for t in ts:
        t.start()
    deadline = time.monotonic() + 60
    while len(recvs) < n_in and time.monotonic() < deadline:
        time.sleep(0.01)
    for s in listeners:
        s.close()
    assert len(recvs) == n_in, f"rank {rank}: {len(recvs)} of {n_in} links connected"
    payload = bytearray(per_link)
    sink = [bytearray(per_link) for _ in recvs]
    times = []
    for it in range(iters + 1):  # the first: warm-up (windows, ARP)
        netns.barrier(store, f"it{it}", world)
        if rank == 0:
            store.set(f"go{it}", str(time.monotonic_ns() + 50_000_000))
        go = int(store.get(f"go{it}"))
        while time.monotonic_ns() < go:
            time.sleep(0.0002)
        t0 = time.monotonic_ns()

        def send(c):
            c.sendall(payload)

        def recv(c, buf):
            view, got = memoryview(buf), 0
            while got < per_link:
                n = c.recv_into(view[got:])
                if not n:
                    raise ConnectionError("peer closed")
                got += n
        th = [threading.Thread(target=send, args=(c,)) for c in sends]
        th += [threading.Thread(target=recv, args=(c, b)) for c, b in zip(recvs, sink)]
        for t in th:
            t.start()
        for t in th:
            t.join()
        if it:
            times.append((time.monotonic_ns() - t0) / 1e9)
    for c in sends + recvs:
        c.close()
    return times


def main(argv=None) -> int:
    from sparkccl.config import parse_bytes
    from sparkccl.localrun import check
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fabric", choices=["switch", "ring"], default="ring")
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--roots", type=int, choices=[1, 2], default=2)
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--slice", default="16M", help="all-gather slice per rank")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--congestion", default=None, help="TCP congestion control in the boxes")
    a = ap.parse_args(argv)
    why = netns.unavailable_reason()
    if why:
        print(f"netns_raw_tcp: {why}")
        return 2
    from netns_bench import _rate_gbps
    sl = parse_bytes(a.slice, "--slice")
    peers_per_link = 1 if a.fabric == "ring" else a.world - 1
    per_link = sl // a.roots  # per peer; a switch link carries it to every peer
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with netns.Fabric(a.fabric, a.world, a.roots, rate=a.rate, congestion=a.congestion) as fab:
        res = check(fab.run(_job, (a.fabric, a.roots, per_link, a.iters), timeout_s=600))
    ideal = peers_per_link * per_link * 8 / (_rate_gbps(a.rate) * 1e9)
    per_call = [max(r[i] for r in res) for i in range(a.iters)]
    t = statistics.median(per_call)
    print(f"raw TCP ({a.congestion or 'host default congestion control'}), "
          f"{a.fabric} world {a.world}, {a.roots} roots, tc tbf {a.rate} per link, "
          f"slice {sl >> 20} MiB (load average {load}): {t * 1e3:.1f} ms (median of "
          f"{a.iters}, slowest box), ideal {ideal * 1e3:.1f} ms: {ideal / t:.1%} of the rate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
