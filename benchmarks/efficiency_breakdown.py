"""Where the time of a collective goes, against the line-rate bound: the verbs transport
through the emulated RoCE NIC (tests/emunic) with its work-request trace on.

For each call, along the critical path of the slowest rank (the rank whose call took longest,
what benchmarks/emunic_efficiency.py reports): the last flag that landed there, and the
rate-limited root that sent it. The call's time is split exactly (the parts add up to it):

- ``skew``: how much later the sending rank started its call than the slowest rank (the
  ranks start together on one clock, benchmarks/emunic_efficiency.py: common_start; what is
  left is a process that did not run in time);
- ``first_post``: from the sender's start to its first work request on that root (the data
  plane's copy of piece 0 into the send slot, publish -> proxy -> ``ibv_post_send``; on a
  relayed stream also the wait for the first piece to arrive: pipeline fill);
- ``pickup``: ``ibv_post_send`` -> the emulated NIC's sender thread takes it onto the link;
- ``busy``: the root's link time of every work request up to that flag, at the rate
  (payload + 64 bytes of headers per work request); ``busy - ideal`` is those headers and
  any imbalance between the roots;
- ``gap_post``: the link idle because the next work request was not posted yet (relay
  waits, a data plane or proxy that is late);
- ``gap_emu``: the link idle although the work request was posted (the emulated NIC's
  thread not running in time: CPU contention, a socket that is full);
- ``land``: the flag's slot end -> its bytes visible at the receiver (sleep overshoot of the
  token bucket, the Unix socket, the receiving thread's wake-up);
- ``tail``: the flag visible -> the call returns (the data plane notices it, copies out or
  reduces the last piece).

``ideal`` is the bound: the plan's max port load x slice x 8 / (rate x roots). Also printed:
the proxy's time per posted work request (``us/WR``: proxy.stats() ``post_ns`` / (writes +
flags), the median over calls) and the part of it spent inside the emulated NIC's
``ibv_post_send`` (``emu``); ``us/WR - emu`` is the verbs transport's own cost.

    python benchmarks/efficiency_breakdown.py --rate-gbps 0.2 --worlds 2,3,4 --sizes 16M
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

import emunic  # noqa: E402
from emunic_efficiency import (add_nic_arguments, common_start, load_average,  # noqa: E402
                               max_port_load, nic_env)

PARTS = ("skew", "first_post", "pickup", "busy", "gap_post", "gap_emu", "land", "tail")
HEADER_BYTES = 64  # what the emulated NIC's token bucket charges per work request on top


def _job(rank, world, store, topology, collective, size, iters):
    import torch

    import sparkccl
    out = []
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology=topology,
                               transport="verbs", timeout_s=300) as comm:
        barrier = common_start(store, rank, world)

        if collective == "all_gather":
            x = torch.full((size,), rank, dtype=torch.uint8)

            def fn():
                return comm.all_gather(x)
        else:
            x = torch.ones((world * size // 4,), dtype=torch.float32)

            def fn():
                return comm.reduce_scatter(x)
        fn()
        for _ in range(iters):
            emunic.take_trace()
            s0 = comm.proxy_stats()
            barrier()
            t0 = time.monotonic_ns()
            fn()
            t1 = time.monotonic_ns()
            barrier()  # every rank is done: the senders' last trace lines are in
            time.sleep(0.005)
            s1 = comm.proxy_stats()
            out.append({"start": t0, "end": t1, "trace": emunic.take_trace(),
                        **{k: s1[k] - s0[k] for k in ("post_ns", "writes", "flags")}})
    return out


def analyse(ranks: list[dict], rate_gbps: float, ideal_ns: float) -> dict:
    """One call: ``ranks[r]`` is rank r's record. Returns the parts (ns) and checks."""
    sends, recvs = {}, []
    for r, rec in enumerate(ranks):
        for f in rec["trace"]:
            if f[0] == "S":
                dev, qpn, seq, op, ln, posted, slot, go, sent = f[1], *map(int, f[2:])
                sends[(qpn, seq)] = dict(rank=r, dev=dev, qpn=qpn, seq=seq, len=ln,
                                         posted=posted, slot=slot, go=go, sent=sent,
                                         dur=(ln + HEADER_BYTES) * 8 / rate_gbps)
            elif f[0] == "R":
                qpn, src, seq, op, ln, sent, arrived, landed = map(int, f[1:])
                recvs.append(dict(rank=r, src=src, seq=seq, landed=landed))
    times = [rec["end"] - rec["start"] for rec in ranks]
    slow = max(range(len(ranks)), key=lambda r: times[r])
    start, end = ranks[slow]["start"], ranks[slow]["end"]
    mine = [x for x in recvs if x["rank"] == slow and (x["src"], x["seq"]) in sends
            and x["landed"] <= end]
    crit_r = max(mine, key=lambda x: x["landed"])
    crit = sends[(crit_r["src"], crit_r["seq"])]
    s, dev = crit["rank"], crit["dev"]
    # (a late trace line of the previous call's last requests is not this call's)
    line = sorted((w for w in sends.values() if w["rank"] == s and w["dev"] == dev
                   and w["slot"] <= crit["slot"] and w["posted"] >= ranks[s]["start"]),
                  key=lambda w: w["slot"])
    p = dict.fromkeys(PARTS, 0.0)
    p["skew"] = ranks[s]["start"] - start  # < 0: the sender started first
    p["first_post"] = line[0]["posted"] - ranks[s]["start"]
    p["pickup"] = line[0]["slot"] - line[0]["posted"]
    prev_end = None
    for w in line:
        if prev_end is not None and w["slot"] > prev_end:
            late = min(max(0.0, w["posted"] - prev_end), w["slot"] - prev_end)
            p["gap_post"] += late
            p["gap_emu"] += w["slot"] - prev_end - late
        p["busy"] += w["dur"]
        prev_end = w["slot"] + w["dur"]
    p["land"] = crit_r["landed"] - prev_end
    p["tail"] = end - crit_r["landed"]
    total = end - start
    late_go = [w["go"] - w["slot"] for w in sends.values()]
    return dict(total=total, ideal=ideal_ns, parts=p, slow=slow, sender=s, dev=dev,
                wrs=len(line), go_late_p50=statistics.median(late_go) if late_go else 0,
                post_ns=sum(rec["post_ns"] for rec in ranks),
                posted=sum(rec["writes"] + rec["flags"] for rec in ranks),
                emu_post=_emu_post(ranks))


def _emu_post(ranks):
    """(calls, wrs, ns) inside the emulated NIC's ibv_post_send, summed over ranks (the P
    line is cumulative per process; the caller takes differences)."""
    tot = [0, 0, 0]
    for rec in ranks:
        for f in rec["trace"]:
            if f[0] == "P":
                for i in range(3):
                    tot[i] += int(f[i + 1])
    return tot


def main(argv=None) -> int:
    from sparkccl.config import parse_bytes
    from sparkccl.localrun import check, run_ranks
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_nic_arguments(ap, rate_gbps=0.2, sizes="16M", iters=5)
    ap.add_argument("--collectives", default="all_gather,reduce_scatter")
    a = ap.parse_args(argv)
    sizes = [parse_bytes(s, "--sizes") for s in a.sizes.split(",")]
    env = nic_env(a, "emunic-breakdown-", trace=True)
    print(f"# python benchmarks/efficiency_breakdown.py {' '.join(argv or sys.argv[1:])}")
    print(f"# {os.cpu_count()} CPUs, load average {load_average()} at start; emulated roots at "
          f"{a.rate_gbps:g} Gb/s, {a.roots} per port, {a.latency_us:g} us latency"
          + (", pace_on_wake (old limiter)" if a.pace_on_wake else ""))
    print("# ms of the median call (by time) of the slowest rank; parts add up to 'time'")
    print(f"{'topo':<4} {'w':>1} {'coll':<2} {'slice':>5} {'time':>7} {'ideal':>7} {'eff':>4} "
          + " ".join(f"{k:>8}" for k in ("skew", "1st_post", "pickup", "busy-idl", "gap_post",
                                           "gap_emu", "land", "tail"))
          + f" {'us/WR':>6} {'emu':>5} {'load':>5}")
    for topology in a.topologies.split(","):
        for world in (int(w) for w in a.worlds.split(",")):
            for collective in a.collectives.split(","):
                load = max_port_load(topology, world, a.roots, collective)
                for size in sizes:
                    ideal = load * size * 8 / (a.rate_gbps * a.roots)  # ns
                    res = check(run_ranks(_job, world, args=(topology, collective, size, a.iters),
                                          env=env, timeout_s=900))
                    calls = [analyse([res[r][i] for r in range(world)], a.rate_gbps, ideal)
                             for i in range(a.iters)]
                    for i in range(len(calls) - 1, 0, -1):  # P lines are cumulative
                        calls[i]["emu_post"] = [x - y for x, y in zip(calls[i]["emu_post"],
                                                                      calls[i - 1]["emu_post"])]
                    calls[0]["emu_post"] = [0, 0, 0]
                    med = sorted(calls, key=lambda c: c["total"])[len(calls) // 2]
                    p = dict(med["parts"])
                    p["busy"] -= ideal
                    # per work request: the median over calls (a call preempted in the
                    # middle of a post would dominate a mean on this shared host)
                    post = statistics.median(c["post_ns"] / max(1, c["posted"]) for c in calls)
                    emu_us = statistics.median(c["emu_post"][2] / max(1, c["emu_post"][1])
                                               for c in calls[1:]) / 1e3 if len(calls) > 1 else 0
                    print(f"{topology:<4} {world:>1} {'AG' if collective == 'all_gather' else 'RS':<2} "
                          f"{size >> 20:>4}M {med['total'] / 1e6:>7.1f} {ideal / 1e6:>7.1f} "
                          f"{ideal / med['total']:>4.0%} "
                          + " ".join(f"{p[k] / 1e6:>8.2f}" for k in PARTS)
                          + f" {post / 1e3:>6.1f} {emu_us:>5.1f} {load_average().split()[0]:>5}",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
