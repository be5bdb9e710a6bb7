"""Bit-exact checks run on a live communicator by ``sparkccl demo`` and ``sparkccl selftest``:
bursts of mixed collectives issued back to back and checked only afterwards, and the fused
MoE finalize, each against the numpy references of :mod:`sparkccl.reference`.
"""
from __future__ import annotations

from typing import Callable

from .reference import (all_gather_reference, bits, make_finalize_input, make_input,
                        moe_finalize_reference, reduce_scatter_reference)

def reduce_scatter_via_input(comm, x):
    """A reduce-scatter of ``x`` through the communicator's zero-copy input buffer."""
    buf = comm.reduce_scatter_input(x.shape, x.dtype)
    buf.copy_(x)
    return comm.reduce_scatter(buf)


BURST_SIZES = (1, 7, 64, 1000, 4099, 1 << 14, 1 << 16)


def burst_ops(seed: int, count: int, sizes=BURST_SIZES) -> list[tuple[str, int, str]]:
    """The same random mix of collectives on every rank: (kind, elements, dtype name);
    kind "reduce_scatter_input" goes through the zero-copy input buffer."""
    import random
    rnd = random.Random(seed)
    ops = []
    for _ in range(count):
        kind = rnd.choice(["all_gather", "reduce_scatter", "reduce_scatter_input"])
        elems = rnd.choice(sizes)
        if kind == "all_gather":
            dname = rnd.choice(["uint8", "bfloat16", "float32", "int32"])
        else:
            dname = rnd.choice(["bfloat16", "float16", "float32"])
        ops.append((kind, elems, dname))
    return ops


def run_bursts(comm, world: int, rank: int, *, bursts: int, per_burst: int, op_seed: int,
               input_seed: int, to: Callable, sync: Callable,
               sizes=BURST_SIZES,
               on_burst: Callable[[int], None] | None = None) -> tuple[int, list[str]]:
    """Issue bursts of ``per_burst`` mixed collectives back to back (burst b: ops from seed
    ``op_seed + b``, call i's inputs from seed ``input_seed * (b + 1) + i``), check every
    result bit for bit only after the whole burst; ``to`` puts an input on the
    communicator's device, ``sync`` waits for its work; ``on_burst(b + 1)`` after burst b is
    checked. Returns (calls, failures)."""
    import torch
    bad, total = [], 0
    for b in range(bursts):
        ops = burst_ops(op_seed + b, per_burst, sizes)
        outs = []
        for i, (kind, elems, dname) in enumerate(ops):
            dtype, seed = getattr(torch, dname), input_seed * (b + 1) + i
            if kind == "all_gather":
                outs.append(comm.all_gather(to(make_input(seed, rank, (elems,), dtype))))
            else:
                x = to(make_input(seed, rank, (world * elems,), dtype))
                outs.append(reduce_scatter_via_input(comm, x) if kind == "reduce_scatter_input"
                            else comm.reduce_scatter(x))
        sync()
        for i, ((kind, elems, dname), y) in enumerate(zip(ops, outs)):
            dtype, seed = getattr(torch, dname), input_seed * (b + 1) + i
            if kind == "all_gather":
                want = all_gather_reference([make_input(seed, q, (elems,), dtype)
                                             for q in range(world)])
            else:
                want = reduce_scatter_reference(
                    [make_input(seed, q, (world * elems,), dtype) for q in range(world)], rank)
            got = bits(y.cpu())
            total += 1
            if got.size != want.size or not (got == want).all():
                bad.append(f"burst {b} call {i} ({kind} {elems} x {dname})")
        if on_burst is not None:
            on_burst(b + 1)
    return total, bad


FINALIZE_DEMO_CASES = (
    # (num_tokens, padded tokens per rank, hidden, topk, fp8, pow2 weights)
    (37, 8, 256, 8, False, True),
    (100, 16, 512, 4, True, True),
    (61, 16, 384, 2, True, False),
)


def finalize_demo_case(comm, world: int, rank: int, seed: int) -> bool:
    """The fused MoE finalize on ``comm`` (CPU or CUDA), every result bit checked against
    :func:`moe_finalize_reference`: bf16 and e4m3 inputs, T < Tpad, powers of two and general
    routing weights. Every rank must call it with the same ``seed``; True when all agree."""
    import torch
    ok = True
    for k, (T, per_rank, H, topk, fp8, pow2) in enumerate(FINALIZE_DEMO_CASES):
        Tpad = per_rank * world
        T = min(T, Tpad - 1)
        s = seed * 100 + k
        inputs = [make_finalize_input(s, r, tokens=T, hidden=H, topk=topk, experts_rows=2 * T + 3,
                                      fp8=fp8, pow2_weights=pow2) for r in range(world)]
        mine = inputs[rank]
        dev = comm.device

        def on(t):
            return None if t is None else t.to(dev)

        z = comm.moe_finalize_reduce_scatter(on(mine["y"]), on(mine["pos"]), on(mine["weights"]),
                                             on(mine["shared"]), num_tokens=T,
                                             padded_tokens=Tpad, y_scales=on(mine["y_scales"]))
        if dev.type == "cuda":
            comm.synchronize()
        want = moe_finalize_reference(inputs, rank, T, Tpad)
        got = bits(z.cpu())
        ok = ok and tuple(z.shape) == (Tpad // world, H) and z.dtype == torch.bfloat16 \
            and got.size == want.size and bool((got == want).all())
    return ok


def ep_demo_case(comm, world: int, rank: int, seed: int) -> bool:
    """Expert-parallel dispatch + the stand-in experts + combine on ``comm`` (CPU or CUDA),
    high-throughput with bf16 tokens and low-latency with e4m3 ones, the combine checked bit
    for bit against the one-box finalize reference (:mod:`sparkccl.ep_reference`). Every
    rank must call it with the same ``seed``; True when all agree."""
    import numpy as np
    import torch

    import sparkccl

    from .ep_reference import combine_reference, make_ep_input, run_experts
    ok = True
    T, H, K, E = 24, 256, 4, 4 * world
    for k, (mode, fp8) in enumerate((("high_throughput", False), ("low_latency", True))):
        inputs = [make_ep_input(seed * 10 + k, r, tokens=T - r % 3, hidden=H, topk=K,
                                num_experts=E, world=world, fp8=fp8) for r in range(world)]
        mine = {n: None if v is None else v.to(comm.device) for n, v in inputs[rank].items()}
        ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T, mode=mode,
                                     dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
        recv, handle = ep.dispatch(mine["x"], mine["topk_idx"], mine["topk_weights"],
                                   mine["x_scales"])
        z = ep.combine(run_experts(ep, recv), handle, shared=mine["shared"])
        ep.check()
        got = z.cpu().view(torch.int16).numpy().view(np.uint16)
        ok = ok and bool(np.array_equal(got, combine_reference(inputs[rank])))
    return ok
