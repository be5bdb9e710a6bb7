"""Bursts of mixed collectives issued back to back, checked only afterwards.

Slots are reused at full speed (3 all-gather slots, 2 reduce-scatter parities), with
splitting (small slot), zero-copy inputs and empty collectives mixed in. Every rank checks
every result bit for bit against the independent reference afterwards.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

import sparkccl
from helpers import issue_ops
from sparkccl.localrun import check, run_ranks
from sparkccl.reference import all_gather_reference, bits, make_input, reduce_scatter_reference

# Multi-process, minutes on 2 cores: left out of the default run (README "Tests").
pytestmark = pytest.mark.slow

N_PER_TOPOLOGY = 1200
DTYPES_AG = (torch.uint8, torch.bfloat16, torch.float32, torch.int16)
DTYPES_RS = (torch.bfloat16, torch.float16, torch.float32)


def make_ops(seed: int, world: int, n: int):
    """The same op list on every rank: (kind, seed, shape, dtype)."""
    rng = random.Random(seed)
    ops = []
    for i in range(n):
        u = rng.random()
        rows = max(0, int(2 ** rng.uniform(0, 9)) - (1 if rng.random() < 0.02 else 0))
        cols = rng.choice([1, 3, 8, 16, 33, 64, 100])
        if u < 0.5:
            ops.append(("ag", seed * 100_000 + i, (rows, cols), rng.choice(DTYPES_AG)))
        elif u < 0.9:
            ops.append(("rs", seed * 100_000 + i, (world * rows, cols), rng.choice(DTYPES_RS)))
        else:  # zero-copy input: chunk a multiple of 16 bytes
            ops.append(("rsz", seed * 100_000 + i, (world * 8 * max(rows, 1), 16),
                        rng.choice(DTYPES_RS)))
    return ops


def burst_job(rank, nprocs, store, configs, n, transport="auto"):
    """configs: [(world, topology, slot_bytes)]; ranks >= world sit a config out."""
    import torch.distributed as dist
    report = {}
    for k, (world, topo, slot_bytes) in enumerate(configs):
        if rank >= world:
            continue
        ops = make_ops(17 + k, world, n)
        inputs = [make_input(s, rank, shape, dt) for _, s, shape, dt in ops]
        with sparkccl.Communicator(store=dist.PrefixStore(f"burst{k}", store), rank=rank,
                                   world_size=world, topology=topo, slot_bytes=slot_bytes,
                                   timeout_s=60, transport=transport) as comm:
            t0 = time.perf_counter()
            results = issue_ops(comm, ops, inputs)
            elapsed = time.perf_counter() - t0
            seqs = comm.seq
        bad = []
        for i, ((kind, s, shape, dt), y) in enumerate(zip(ops, results)):
            xs = [make_input(s, r, shape, dt) for r in range(world)]
            ref = all_gather_reference(xs) if kind == "ag" else reduce_scatter_reference(xs, rank)
            got = bits(y)
            if got.shape != ref.shape or not (got == ref).all():
                bad.append(f"op {i} ({kind} {list(shape)} {dt}) differs")
        report[f"world {world} {topo}"] = dict(bad=bad, elapsed=elapsed, collectives=seqs)
    return report


def _run(nprocs, configs, n=N_PER_TOPOLOGY, min_collectives=1000, transport="auto", env=None):
    values = check(run_ranks(burst_job, nprocs, args=(configs, n, transport), timeout_s=600,
                             env=env))
    for r, rep in enumerate(values):
        for name, d in rep.items():
            assert not d["bad"], f"rank {r} {name}: {d['bad'][:10]}"
            assert d["collectives"] >= min_collectives, d
    print({name: round(d["elapsed"], 2) for name, d in values[0].items()})


def test_burst_world4_mesh_and_ring():
    # 128 KiB slot: the larger ops are split into several collectives.
    _run(4, [(4, "mesh", 128 << 10), (4, "ring", 128 << 10)])


def test_burst_worlds_2_3_5():
    # Shorter bursts: the >= 1000 per topology are above; these add worlds 2, 3, 5.
    _run(5, [(3, "ring", 1 << 20), (5, "ring", 256 << 10), (2, "mesh", 64 << 10)], n=400,
         min_collectives=300)


def test_burst_verbs_through_emulated_nic(emunic_env):
    """The same bursts over the verbs transport (emulated RoCE NIC, tests/emunic): send
    queues, signaled flags and completions under back-to-back collectives."""
    _run(3, [(3, "mesh", 128 << 10), (3, "ring", 128 << 10)], n=300, min_collectives=250,
         transport="verbs", env=emunic_env)
