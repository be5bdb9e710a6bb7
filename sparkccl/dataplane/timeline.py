"""SPARKCCL_GPU_TIMELINE: where a collective's time goes on the GPU, step by step.

A measurement aid for the latency-bound collectives (the one-shot all-reduce of decode,
docs/PROTOCOL.md "One shot on CUDA"). With the setting on, the kernels are compiled with
``SCCL_TIMELINE`` (so without it they carry no stamp at all) and the plane hands them a
buffer in device memory (device state ``STATE_TIMELINE``); one thread per step writes
``%globaltimer`` at protocol.h's ``TL_*`` points into row ``seq % TL_CALLS``. Ranks sharing
one GPU share its clock, so one rank's step can be set against a peer's: how long a flag
took from the publisher's store to the waiting poller, which host time cannot show.
"""
from __future__ import annotations

import statistics

from .. import config, layout

_P = layout.protocol_constants()
TL_CALLS, TL_POINTS = _P["TL_CALLS"], _P["TL_POINTS"]
STATE_TIMELINE = _P["STATE_TIMELINE"]
POINTS = ("enter", "written", "handed", "seen", "released", "summed", "exit", "stored")
assert [_P["TL_" + p.upper()] for p in POINTS] == list(range(len(POINTS)))
DEFINE = "#define SCCL_TIMELINE 1\n"


def enabled() -> bool:
    return bool(config.get("SPARKCCL_GPU_TIMELINE"))


def attach(gpu, state_init):
    """Where SPARKCCL_GPU_TIMELINE is on: the stamps' buffer in device memory (through the
    plane's device seam), its address put in the device state's first values
    ``state_init``; else None."""
    if not enabled():
        return None
    import torch
    buf = gpu.to_device(torch.zeros(TL_CALLS * TL_POINTS, dtype=torch.int64))
    state_init[STATE_TIMELINE] = buf.data_ptr()
    return buf


def kernel_source(src: str) -> str:
    """The kernels' source as this process compiles it: with the stamps where enabled (a
    different text, so a different cache entry)."""
    return DEFINE + src if enabled() else src


def rows(stamps, first_seq: int, last_seq: int) -> dict[int, dict[str, int]]:
    """{seq: {point: ns}} of the collectives first_seq..last_seq (at most TL_CALLS back
    from the last) from a copy of the plane's buffer (TL_CALLS * TL_POINTS int64)."""
    flat = [int(v) for v in stamps]
    out = {}
    for s in range(max(first_seq, last_seq - TL_CALLS + 1), last_seq + 1):
        row = flat[(s % TL_CALLS) * TL_POINTS:(s % TL_CALLS + 1) * TL_POINTS]
        out[s] = {p: row[k] for k, p in enumerate(POINTS) if row[k]}
    return out


def last_rows(plane, n: int) -> dict[int, dict[str, int]]:
    """:func:`rows` of the plane's last ``n`` collectives (host-synchronized before)."""
    last = int(plane.state[_P["STATE_SEQ"]]) - 1
    return rows(plane.timeline.cpu().tolist(), last - n + 1, last)


# The steps of one call as (name, (rank's or peers' point), (rank's point)): "peers'"
# means the latest of the other ranks' stamps of the same seq.
STEPS = (
    ("launch gap", ("prev", "exit"), "enter"),
    ("publish", ("own", "enter"), "stored"),
    ("fence", ("own", "stored"), "written"),
    ("hand-off", ("own", "written"), "handed"),
    ("flag to poller", ("peers", "handed"), "seen"),
    ("poller to consumer", ("own", "seen"), "released"),
    ("sum", ("own", "released"), "summed"),
    ("to exit", ("own", "summed"), "exit"),
)
# The one shot's LL way (no poller, so no "seen"): block 0 stamps "stored" after its stores
# and "released" once every source's first line says seq; the extra block hands off the ring
# entries and flag words beside it ("written" as it starts, "handed"), and the kernel ends
# after both.
STEPS_LL = (
    ("launch gap", ("prev", "exit"), "enter"),
    ("stores", ("own", "enter"), "stored"),
    ("lines to reader", ("peers", "stored"), "released"),
    ("sum", ("own", "released"), "summed"),
    ("to exit", ("own", "summed"), "exit"),
    ("hand-off block", ("own", "enter"), "handed"),
    ("of it, its start", ("own", "enter"), "written"),
)

# A GPU-direct all-gather / all-to-all (sccl_ag_direct: no sum, so no "released" or
# "summed"): "stored" and "handed" are its last piece's (the last publish block's), "seen"
# the poller's once every piece of every peer is in; then the consumers' last copies.
STEPS_GATHER = STEPS[:5] + (("poller to exit", ("own", "seen"), "exit"),)


def steps(per_rank: list[dict[int, dict[str, int]]]) -> dict[str, list[float]]:
    """Every call's steps (ns) over every rank, by step name, from :func:`rows` of each
    rank (ranks sharing one GPU: one clock), plus "period" (enter to the next enter)."""
    out: dict[str, list[float]] = {}
    for r, mine in enumerate(per_rank):
        for s, row in mine.items():
            table = (STEPS_LL if "seen" not in row and "released" in row else
                     STEPS_GATHER if "seen" in row and "released" not in row else STEPS)
            for name, (whose, a), b in table:
                out.setdefault(name, [])
                if b not in row:
                    continue
                if whose == "own":
                    t0 = row.get(a)
                elif whose == "prev":
                    t0 = mine.get(s - 1, {}).get(a)
                else:
                    peers = [p[s][a] for q, p in enumerate(per_rank)
                             if q != r and s in p and a in p[s]]
                    t0 = max(peers) if len(peers) == len(per_rank) - 1 else None
                if t0:
                    out[name].append(row[b] - t0)
            nxt = mine.get(s + 1, {}).get("enter")
            if nxt and "enter" in row:
                out.setdefault("period", []).append(nxt - row["enter"])
    return out


def summary(per_rank: list[dict[int, dict[str, int]]]) -> list[tuple[str, float, float, int]]:
    """(step, p50 us, p90 us, samples) per step of :func:`steps`."""
    out = []
    for name, vals in steps(per_rank).items():
        if vals:
            v = sorted(vals)
            out.append((name, statistics.median(v) / 1e3, v[int(0.9 * (len(v) - 1))] / 1e3,
                        len(v)))
    return out
