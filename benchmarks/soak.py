"""Soak: many mixed collectives per topology x transport, every result bit-exact.

For each topology (mesh, ring) and transport (shm, tcp, verbs through the emulated RoCE
NIC of tests/emunic; on CUDA shm only), ``--world`` ranks issue ``--count`` collectives in
bursts of ``--per-burst`` back to back, checked only after the whole burst (so a result
overwritten by a later collective shows): all-gathers of every dtype, reduce-scatters
(bf16 / fp16 / fp32) with and without the zero-copy input buffer, and the fused MoE
finalize (bf16 and e4m3). Per-rank sizes are log-uniform from 1 byte to the slot (and a
few beyond it, split into several collectives). Every result is compared bit for bit with
the rank-order reference of :mod:`sparkccl.reference`.

::

    python benchmarks/soak.py --count 10000                        # CPU, writes a table
    python benchmarks/soak.py --device cuda --count 1000 --transports shm

Prints one row per topology x transport (collectives, failures, seconds) and writes the
table to ``--out`` when given.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

AG_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "bool", "float16", "bfloat16",
             "float32", "float64", "complex64", "float8_e4m3fn")
RS_DTYPES = ("bfloat16", "float16", "float32")
# (tokens, padded tokens per rank, hidden, topk, fp8) of the finalize calls
FINALIZE_SHAPES = ((13, 8, 256, 4, False), (37, 16, 128, 2, True), (5, 8, 384, 8, False))


def soak_ops(seed: int, count: int, world: int, slot_bytes: int) -> list[tuple]:
    """The same random mix on every rank: (kind, seed, elems or finalize shape, dtype)."""
    rnd = random.Random(seed)
    top = math.log2(slot_bytes // world)
    ops = []
    for i in range(count):
        s = seed * 100_003 + i
        u = rnd.random()
        if u < 0.04:
            ops.append(("fin", s, rnd.choice(FINALIZE_SHAPES), "bfloat16"))
            continue
        kind = "ag" if u < 0.5 else ("rs" if u < 0.8 else "rsz")
        dname = rnd.choice(AG_DTYPES if kind == "ag" else RS_DTYPES)
        itemsize = _itemsize(dname)
        # bytes per rank: 1 B to the slot's share; 2 % beyond it (split collectives)
        per_rank = int(2 ** rnd.uniform(0, top + (1 if rnd.random() < 0.02 else 0)))
        elems = max(1, per_rank // itemsize)
        ops.append((kind, s, elems, dname))
    return ops


def _itemsize(dname: str) -> int:
    import torch
    return getattr(torch, dname).itemsize


def _input(kind, s, shape, dname, rank, world):
    import torch
    from sparkccl.reference import make_input
    dtype = getattr(torch, dname)
    if kind == "ag":
        return make_input(s, rank, (shape,), dtype)
    return make_input(s, rank, (world * shape,), dtype)


def _fin_inputs(s, shape, rank, world):
    from sparkccl.reference import make_finalize_input
    T, per_rank, H, topk, fp8 = shape
    Tpad = per_rank * world
    T = min(T, Tpad - 1)
    return make_finalize_input(s, rank, tokens=T, hidden=H, topk=topk, experts_rows=2 * T + 3,
                               fp8=fp8, pow2_weights=False), T, Tpad


def _ep_input(s, shape, rank, world):
    from sparkccl.ep_reference import make_ep_input
    T, H, topk, fp8 = shape
    return make_ep_input(s, rank, tokens=T, hidden=H, topk=topk, num_experts=4 * world,
                         world=world, fp8=fp8)


def _expert_parallel(comm, shape, state: dict):
    """The ExpertParallel of ``shape`` on ``comm`` kept in ``state`` (the caller's, one per
    communicator), made on first use: every rank issues the same ops, so every rank makes
    it at the same point."""
    import torch
    import sparkccl
    if ("ep", shape) not in state:
        T, H, _, fp8 = shape
        state["ep", shape] = sparkccl.ExpertParallel(
            comm, num_experts=4 * comm.world_size, hidden=H, max_tokens=T,
            dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    return state["ep", shape]


def issue(comm, op, rank, world, to, state: dict | None = None):
    """Issue one op on ``comm``; returns its output (unchecked). Kinds: "ag" all-gather,
    "rs" reduce-scatter, "rsz" reduce-scatter through the zero-copy input, "ar" all-reduce,
    "fin" fused MoE finalize, "ep" expert-parallel dispatch, the stand-in experts
    (sparkccl/ep_reference.py) and combine (``state``: a dict kept with ``comm``, for its
    ExpertParallel)."""
    from sparkccl.exact_checks import reduce_scatter_via_input
    kind, s, shape, dname = op
    if kind == "ep":
        from sparkccl.ep_reference import run_experts
        inp = _ep_input(s, shape, rank, world)
        if state is None:
            raise ValueError("an 'ep' op needs the communicator's state dict")
        ep = _expert_parallel(comm, shape, state)
        recv, handle = ep.dispatch(to(inp["x"]), to(inp["topk_idx"]), to(inp["topk_weights"]),
                                   x_scales=None if inp["x_scales"] is None else
                                   to(inp["x_scales"]))
        return ep.combine(run_experts(ep, recv), handle, shared=to(inp["shared"]))
    if kind == "fin":
        inp, T, Tpad = _fin_inputs(s, shape, rank, world)
        return comm.moe_finalize_reduce_scatter(
            to(inp["y"]), to(inp["pos"]), to(inp["weights"]), to(inp["shared"]), num_tokens=T,
            padded_tokens=Tpad, y_scales=None if inp["y_scales"] is None else to(inp["y_scales"]))
    x = to(_input(kind, s, shape, dname, rank, world))
    if kind == "ag":
        return comm.all_gather(x)
    if kind == "rs":
        return comm.reduce_scatter(x)
    if kind == "ar":
        return comm.all_reduce(x)
    return reduce_scatter_via_input(comm, x)


def reference(op, rank, world):
    """Raw bytes rank ``rank`` must get for ``op`` (rank-order reference)."""
    from sparkccl.reference import (all_gather_reference, all_reduce_reference,
                                    moe_finalize_reference, reduce_scatter_reference)
    kind, s, shape, dname = op
    if kind == "ep":
        from sparkccl.ep_reference import combine_reference
        return combine_reference(_ep_input(s, shape, rank, world)).reshape(-1).view("uint8")
    if kind == "fin":
        inputs = [_fin_inputs(s, shape, q, world)[0] for q in range(world)]
        _, T, Tpad = _fin_inputs(s, shape, rank, world)
        return moe_finalize_reference(inputs, rank, T, Tpad)
    xs = [_input(kind, s, shape, dname, q, world) for q in range(world)]
    if kind == "ar":
        return all_reduce_reference(xs)
    return all_gather_reference(xs) if kind == "ag" else reduce_scatter_reference(xs, rank)


def soak_job(rank, world, store, topology, transport, device, count, seed, slot_bytes,
             per_burst):
    import torch
    import sparkccl
    from sparkccl.reference import bits
    dev = torch.device(device)

    def to(t):
        return t.to(dev)

    bad, done, kinds = [], 0, {}
    t0 = time.perf_counter()
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology=topology,
                               transport=transport, device=device, slot_bytes=slot_bytes,
                               timeout_s=120) as comm:
        b = 0
        while done < count:
            ops = soak_ops(seed * 7919 + b, min(per_burst, count - done), world, slot_bytes)
            outs = [issue(comm, op, rank, world, to) for op in ops]
            comm.synchronize()
            for i, (op, y) in enumerate(zip(ops, outs)):
                want = reference(op, rank, world)
                got = bits(y.cpu())
                kinds[op[0]] = kinds.get(op[0], 0) + 1
                if got.size != want.size or not (got == want).all():
                    bad.append(f"burst {b} call {i}: {op}")
            done += len(ops)
            b += 1
        used = comm.transport
    return dict(done=done, bad=bad, kinds=kinds, seconds=time.perf_counter() - t0,
                transport=used)


def run_one(topology, transport, *, world, count, seed, slot_bytes, per_burst, device,
            emunic_root=None, timeout_s=3600):
    """One topology x transport: {done, failures, seconds, problems}."""
    from sparkccl.localrun import run_ranks
    env = {}
    if transport == "verbs":
        import emunic
        env = emunic.host_env(emunic_root)
    res = run_ranks(soak_job, world, args=(topology, transport, device, count, seed, slot_bytes,
                                           per_burst), env=env, timeout_s=timeout_s)
    problems = []
    for r in res:
        if not r.ok:
            problems.append(f"rank {r.rank}: {r.error_type}: {r.message}")
        elif r.value["bad"]:
            problems += [f"rank {r.rank}: {x}" for x in r.value["bad"]]
        elif r.value["transport"] != transport:
            problems.append(f"rank {r.rank}: ran over {r.value['transport']}")
    vals = [r.value for r in res if r.ok]
    done = min((v["done"] for v in vals), default=0) if len(vals) == world else 0
    kinds = vals[0]["kinds"] if vals else {}
    secs = max((v["seconds"] for v in vals), default=0.0)
    return dict(topology=topology, transport=transport, done=done,
                failures=sum(len(v["bad"]) for v in vals) + (world - len(vals)),
                seconds=secs, kinds=kinds, problems=problems)


def table(rows, world, device, slot_bytes) -> str:
    lines = [f"soak: world {world}, device {device}, slot {slot_bytes} B; every result "
             "bit-exact against the rank-order reference",
             f"{'topology':8} {'transport':9} {'collectives':>11} {'failures':>8} {'seconds':>8}"
             "  mix (ag / rs / rs zero-copy / finalize)"]
    for r in rows:
        k = r["kinds"]
        lines.append(f"{r['topology']:8} {r['transport']:9} {r['done']:>11} {r['failures']:>8} "
                     f"{r['seconds']:>8.1f}  {k.get('ag', 0)} / {k.get('rs', 0)} / "
                     f"{k.get('rsz', 0)} / {k.get('fin', 0)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=1000, help="collectives per topology x transport")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--slot-bytes", type=int, default=256 << 10)
    ap.add_argument("--per-burst", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--topologies", default="mesh,ring")
    ap.add_argument("--transports", default=None,
                    help="comma-separated (default shm,tcp,verbs on CPU, shm on CUDA)")
    ap.add_argument("--out", default=None, help="also write the table here")
    a = ap.parse_args(argv)
    transports = (a.transports or ("shm" if a.device.startswith("cuda") else "shm,tcp,verbs"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="soak-emunic-") as root:
        for topology in a.topologies.split(","):
            for transport in transports.split(","):
                row = run_one(topology, transport, world=a.world, count=a.count, seed=a.seed,
                              slot_bytes=a.slot_bytes, per_burst=a.per_burst, device=a.device,
                              emunic_root=root)
                rows.append(row)
                print(f"{topology}/{transport}: {row['done']} collectives, {row['failures']} "
                      f"failures, {row['seconds']:.1f} s", flush=True)
                for p in row["problems"][:10]:
                    print("   ", p, flush=True)
    text = table(rows, a.world, a.device, a.slot_bytes)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    ok = all(r["failures"] == 0 and r["done"] >= a.count and not r["problems"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
