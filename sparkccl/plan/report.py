"""Human-readable summary of a verified plan (what `sparkccl plan` prints)."""
from __future__ import annotations

from .build import build_all
from .model import MESH_CHANNEL, NEXT, OnFlag, Op
from .verify import ALL_REDUCE, PlanError, default_sequence, lower_bound, verify_plans

COLLECTIVES = {"all_gather": Op.AG, "reduce_scatter": Op.RS, "all_reduce": ALL_REDUCE}
"""Collective -> the key of its port loads in the verifier's report (an all-reduce: the
fused operation, both ops' streams under one sequence number)."""


def _port_name(topology: str, channel: int) -> str:
    if topology == "mesh":
        return "switch" if channel == MESH_CHANNEL else f"ch{channel}"
    return "next" if channel == NEXT else "prev"


def plan_summary(collective: str, topology: str, world: int, roots: int = 2) -> tuple[str, bool]:
    """The summary text and whether the verifier passed."""
    op = COLLECTIVES[collective]
    plans = build_all(topology, world, roots)
    lines = [f"plan: {collective} on {topology}, world {world}, {roots} root(s) per port"]
    seq = default_sequence()
    try:
        report = verify_plans(plans, seq)
        ok = True
        sizes = sorted({c.slice_bytes for c in seq})
        lines.append(f"verifier: passed ({len(seq)} collectives of all kinds in a row, slices "
                     f"{sizes[0]}..{sizes[-1]} bytes, every slot reused; every byte exactly "
                     f"once from the right origin, one writer per flag word, every wait "
                     f"satisfied, relays only after their flag, slot reuse safe)")
    except PlanError as e:
        lines.append(f"verifier: FAILED: {e}")
        return "\n".join(lines), False

    p0 = plans[0]
    ops = (Op.RS, Op.AG) if op == ALL_REDUCE else (op,)
    streams = [s for o in ops for s in p0.streams_of(o)]
    relays = sum(1 for s in streams if isinstance(s.trigger, OnFlag))
    lines.append(f"rank 0: {len(p0.connections)} connections, {len(streams)} streams "
                 f"for this collective ({relays} relays)"
                 + (f", {p0.rs_recv_blocks - world} extra staging block(s) per RS recv slot"
                    if Op.RS in ops and p0.rs_recv_blocks > world else ""))
    if op == ALL_REDUCE:
        lines.append("one operation, one sequence number: the reduce-scatter's streams (op RS) "
                     "and the all-gather's (op AG), a rank's all-gather piece c published once "
                     "piece c of its chunk came from every source; a slice is one rank's "
                     f"chunk, 1/{world} of the vector")
    lines.append("")
    lines.append(f"{'rank':>4}  {'port':<6}  {'out (slices)':>12}  {'in (slices)':>11}")
    channels = sorted({ch for (o, _, ch) in report.port_out if o == op}
                      | {ch for (o, _, ch) in report.port_in if o == op})
    for r in range(world):
        for ch in channels:
            out = report.port_out.get((op, r, ch), 0.0)
            inn = report.port_in.get((op, r, ch), 0.0)
            lines.append(f"{r:>4}  {_port_name(topology, ch):<6}  {out:>12g}  {inn:>11g}")
    lines.append("")
    bound = lower_bound(op, topology, world)
    lines.append(f"max port load: {report.max_port_load(op):g} slices (lower bound {bound:g})")
    if op == ALL_REDUCE:
        why = (f"each rank sends and receives at least 2 (W-1)/W = {bound / world:g} of the "
               "vector" if topology == "mesh" else
               f"the reduce-scatter's {lower_bound(Op.RS, topology, world):g} (raw chunks "
               "along shortest paths) + the all-gather's "
               f"{lower_bound(Op.AG, topology, world):g} (W-1 link crossings per reduced "
               "chunk), spread over the 2W ports of one direction; no relay can forward a "
               "partial sum instead: rank order, rounded once")
        lines.append(f"lower bound: {why}")
    return "\n".join(lines), ok
