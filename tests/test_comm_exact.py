"""Bit-exact all-gather and reduce-scatter across processes (CPU data plane; shm, and verbs
through the emulated RoCE NIC of tests/emunic).

Each rank rebuilds every rank's input (deterministic) and checks its result against an
independent numpy reference: concatenation for all-gather, fp32 sum in rank order rounded
once (round-to-nearest-even) for reduce-scatter. Mesh and ring run in the same processes.
"""
from __future__ import annotations

import pytest
import torch

import sparkccl
from sparkccl.exact_checks import reduce_scatter_via_input
from sparkccl.localrun import check, run_ranks
from sparkccl.reference import all_gather_reference, bits, make_input, reduce_scatter_reference

# Multi-process, minutes on 2 cores: left out of the default run (README "Tests").
pytestmark = pytest.mark.slow

MiB = 1 << 20

AG_BYTES_SMALL = [1, 2, 15, 16, 17, 31, 100, 1000, 4095, 4097, 65536 + 3]
AG_BYTES_LARGE = [MiB + 5, 5 * MiB - 3, 32 * MiB]
RS_SHAPES_SMALL = [(1, 1), (1, 3), (1, 8), (3, 5), (2, 64), (7, 129), (100, 257)]
RS_SHAPES_LARGE = [(1024, 1025), (2048, 2048)]  # chunk up to 8 MiB (fp32 16 MiB: split)


def _check_ag(comm, seed, x_shape, dtype, world, rank, out=None):
    xs = [make_input(seed, r, x_shape, dtype) for r in range(world)]
    y = comm.all_gather(xs[rank], out=out)
    shape = tuple(x_shape) if len(x_shape) else (1,)
    assert tuple(y.shape) == (world * shape[0], *shape[1:]), (y.shape, x_shape)
    assert y.dtype == dtype
    if out is not None:
        assert y is out
    ok = (bits(y) == all_gather_reference(xs)).all()
    return None if ok else f"all_gather {comm.topology} {dtype} {list(x_shape)} differs"


def _check_rs(comm, seed, m, h, dtype, world, rank, zero_copy=False):
    xs = [make_input(seed, r, (world * m, h), dtype) for r in range(world)]
    y = (reduce_scatter_via_input(comm, xs[rank]) if zero_copy
         else comm.reduce_scatter(xs[rank]))
    assert tuple(y.shape) == (m, h) and y.dtype == dtype
    ok = (bits(y) == reduce_scatter_reference(xs, rank)).all()
    return None if ok else (f"reduce_scatter {comm.topology} {dtype} chunk [{m}, {h}] "
                            f"zero_copy={zero_copy} differs")


PROFILES = {
    # name: (all-gather uint8 byte sizes, float all-gather shapes, reduce-scatter chunk shapes)
    "large": (AG_BYTES_SMALL + AG_BYTES_LARGE, [[1], [3, 5], [17, 3], [1000, 33], [], [512, 4099]],
              RS_SHAPES_SMALL + RS_SHAPES_LARGE),
    "medium": (AG_BYTES_SMALL + [32 * MiB], [[1], [3, 5], [17, 3], [1000, 33], []],
               RS_SHAPES_SMALL + [(1024, 1025)]),
    "small": (AG_BYTES_SMALL, [[1], [3, 5], [1000, 33], []], RS_SHAPES_SMALL),
    "few": ([1, 17, 4096, 100_003], [[3, 5], []], [(1, 3), (7, 129), (64, 1000)]),
}


def exact_checks(comm, profile, seed):
    world, rank = comm.world_size, comm.rank
    ag_bytes, ag_shapes, rs_shapes = PROFILES[profile]
    bad = []
    for n in ag_bytes:
        seed += 1
        bad.append(_check_ag(comm, seed, (n,), torch.uint8, world, rank))
    for dtype in (torch.bfloat16, torch.float32):
        for shape in ag_shapes:
            seed += 1
            bad.append(_check_ag(comm, seed, shape, dtype, world, rank))
    seed += 1
    out = torch.empty((world * 9, 7), dtype=torch.float16)
    bad.append(_check_ag(comm, seed, (9, 7), torch.float16, world, rank, out=out))
    for dtype in (torch.bool, torch.int64, torch.complex64, torch.int8):
        seed += 1
        bad.append(_check_ag(comm, seed, (5, 3), dtype, world, rank))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for m, h in rs_shapes:
            seed += 1
            bad.append(_check_rs(comm, seed, m, h, dtype, world, rank))
    # zero-copy input: same parity, then parity moved by an all-gather in between
    for dtype in (torch.bfloat16, torch.float32):
        seed += 1
        bad.append(_check_rs(comm, seed, 16, 64, dtype, world, rank, zero_copy=True))
        buf = comm.reduce_scatter_input((world * 4, 8), dtype)
        seed += 1
        bad.append(_check_ag(comm, seed, (10,), torch.uint8, world, rank))
        xs = [make_input(seed, r, (world * 4, 8), dtype) for r in range(world)]
        buf.copy_(xs[rank])
        y = comm.reduce_scatter(buf)
        if not (bits(y) == reduce_scatter_reference(xs, rank)).all():
            bad.append(f"zero-copy reduce_scatter after a parity change differs ({dtype})")
    seed += 1  # not 16-byte chunks: a plain tensor, copied as usual
    bad.append(_check_rs(comm, seed, 3, 5, torch.bfloat16, world, rank, zero_copy=True))
    return [f"world {world} {comm.topology}: {b}" for b in bad if b]


def exact_job(rank, nprocs, store, configs, transport="auto"):
    """configs: [(world, topology, profile, slot_bytes)]; ranks >= world sit a config out."""
    import torch.distributed as dist
    bad = []
    for i, (world, topo, profile, slot) in enumerate(configs):
        if rank >= world:
            continue
        st = dist.PrefixStore(f"cfg{i}", store)
        with sparkccl.Communicator(store=st, rank=rank, world_size=world, topology=topo,
                                   slot_bytes=slot, timeout_s=60, transport=transport) as comm:
            bad += exact_checks(comm, profile, seed=1000 * i)
    return bad


def _run(nprocs, configs, transport="auto", env=None):
    values = check(run_ranks(exact_job, nprocs, args=(configs, transport), timeout_s=600,
                             env=env))
    bad = [f"rank {r}: {b}" for r, v in enumerate(values) for b in v]
    assert not bad, "\n".join(bad)


def test_exact_world_2_3_4_mesh_and_ring():
    _run(4, [(2, "mesh", "large", None), (2, "ring", "large", None),
             (3, "mesh", "small", None), (3, "ring", "small", None),
             (4, "mesh", "medium", None), (4, "ring", "medium", None),
             # a small slot: inputs are split into several collectives
             (3, "mesh", "few", 64 << 10), (4, "ring", "few", 64 << 10)])


@pytest.mark.extended  # the "few" profile at worlds 5-8 (CI: worlds 2-4, and 5 in the bursts)
def test_exact_ring_world_5_to_8():
    _run(8, [(w, "ring", "few", 256 << 10) for w in (5, 6, 7, 8)] + [(8, "mesh", "few", None)])


def test_exact_verbs_through_emulated_nic(emunic_env):
    """The verbs transport (RC QPs, inline flags) across processes, mesh and ring."""
    _run(4, [(2, "mesh", "small", None), (2, "ring", "few", None), (3, "ring", "few", 64 << 10),
             (4, "mesh", "few", None), (4, "ring", "few", None)],
         transport="verbs", env=emunic_env)


def test_exact_verbs_strict_ordering_through_emulated_nic(emunic_env):
    """Strict ordering: flags as WRITE_WITH_IMM, stored after the receive completion."""
    _run(3, [(3, "mesh", "few", None), (3, "ring", "few", 64 << 10)], transport="verbs",
         env={**emunic_env, "SPARKCCL_IB_ORDERING": "strict"})
