"""All-reduce (sparkccl/allreduce.py) across processes: every result bit-exact against the
rank-order reference (sparkccl.reference.all_reduce_reference), each input run through
both regimes (one shot; reduce-scatter + all-gather) and the default choice; mesh and
ring, shm, tcp and the emulated NIC; bad input refused before anything is sent; the
crossover setting agreed at creation; on a GPU, capture and replay in a CUDA graph.
"""
from __future__ import annotations

import os

import pytest
import torch

import sparkccl
from sparkccl import allreduce as A
from sparkccl.localrun import check, run_ranks
from sparkccl.reference import all_reduce_reference, bits, make_input

from helpers import assert_no_problems, expect_errors, killed_peer_job

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# 1 element; 2 bytes (one bf16); 0-dim; not a multiple of 16 bytes; odd 2-D; one that needs
# no padding at world 2-4 (fp32 AVG too); one above the default one-shot crossover (bf16).
SHAPES = {"small": [(1,), (), (3, 5), (17,), (129, 7), (96,), (150, 1000)],
          "few": [(1,), (3, 5), (129, 7), (40_000,)]}


def _check(comm, seed, shape, dtype, op, regime, mode="fresh", fused=None):
    W, r = comm.world_size, comm.rank
    xs = [make_input(seed, q, shape, dtype) for q in range(W)]
    x = xs[r].clone()
    if mode == "inplace":
        y = comm.all_reduce(x, op, out=x, regime=regime)
        ok_out = y is x
    elif mode == "out":
        out = torch.empty(shape, dtype=dtype)
        y = comm.all_reduce(x, op, out=out, regime=regime)
        ok_out = y is out and bool((bits(x) == bits(xs[r])).all())  # x left alone
    else:
        y = comm.all_reduce(x, op) if regime is None else comm.all_reduce(x, op,
                                                                       regime=regime, fused=fused)
        ok_out = bool((bits(x) == bits(xs[r])).all())
    ok = (ok_out and tuple(y.shape) == tuple(shape) and y.dtype == dtype
          and bool((bits(y) == all_reduce_reference(xs, op)).all()))
    return None if ok else (f"world {W} {comm.topology}/{comm.transport} {dtype} {list(shape)} "
                            f"{op} {regime or 'default'} {mode} differs")


def exact_checks(comm, profile, seed):
    bad = []
    for dtype in DTYPES:
        for shape in SHAPES[profile]:
            for op in ("sum", "avg"):
                seed += 1
                for regime in (*A.REGIMES, None):
                    bad.append(_check(comm, seed, shape, dtype, op, regime))
    for i, (mode, regime) in enumerate([("inplace", A.ONE_SHOT), ("inplace", A.TWO_STEP),
                                        ("out", A.TWO_STEP), ("out", A.ONE_SHOT)]):
        bad.append(_check(comm, seed + 100 + i, (33, 3), torch.bfloat16, "avg", regime, mode))
    # Interleaved with the other collectives (sequence numbers and slot parities move).
    xs = [make_input(seed + 200, q, (comm.world_size * 8, 4), torch.float32)
          for q in range(comm.world_size)]
    comm.reduce_scatter(xs[comm.rank])
    bad.append(_check(comm, seed + 201, (64,), torch.bfloat16, "sum", A.TWO_STEP))
    comm.all_gather(torch.ones(5))
    bad.append(_check(comm, seed + 202, (64,), torch.bfloat16, "sum", A.ONE_SHOT))
    # The CPU plane's two-step regime is one fused operation, one sequence number; the two
    # collectives (what the CUDA plane runs) give the same bits.
    seq0 = comm.seq
    bad.append(_check(comm, seed + 203, (129, 7), torch.bfloat16, "avg", A.TWO_STEP))
    if comm.seq != seq0 + 1:
        bad.append(f"fused all-reduce took {comm.seq - seq0} sequence numbers")
    for i, (dtype, op) in enumerate([(torch.bfloat16, "avg"), (torch.float16, "sum")]):
        bad.append(_check(comm, seed + 204 + i, (129, 7), dtype, op, A.TWO_STEP, fused=False))
    return [b for b in bad if b]


def exact_job(rank, nprocs, store, configs):
    """configs: [(world, topology, profile, slot_bytes, transport)]; ranks >= world sit one
    out."""
    import torch.distributed as dist
    bad = []
    for i, (world, topo, profile, slot, transport) in enumerate(configs):
        if rank >= world:
            continue
        with sparkccl.Communicator(store=dist.PrefixStore(f"ar{i}", store), rank=rank,
                                   world_size=world, topology=topo, transport=transport,
                                   slot_bytes=slot, timeout_s=60) as comm:
            bad += exact_checks(comm, profile, seed=1000 * i)
    return bad


def _run(nprocs, configs, env=None):
    values = check(run_ranks(exact_job, nprocs, args=(configs,), env=env, timeout_s=300))
    bad = [f"rank {r}: {b}" for r, v in enumerate(values) for b in v]
    assert not bad, "\n".join(bad)


def test_exact_both_regimes_world_2_3_4_mesh_and_ring():
    # A 4 KiB slot at world 4 splits the larger inputs into several collectives.
    _run(4, [(2, "mesh", "small", None, "shm"), (2, "ring", "small", None, "shm"),
             (3, "mesh", "small", None, "shm"), (3, "ring", "small", None, "shm"),
             (4, "mesh", "few", None, "shm"), (4, "ring", "few", 4096, "shm")])


def test_exact_tcp_and_verbs_through_emulated_nic(emunic_env):
    _run(3, [(3, "ring", "few", None, "tcp"), (2, "mesh", "few", None, "tcp"),
             (3, "mesh", "few", None, "verbs"), (3, "ring", "few", None, "verbs")],
         env=emunic_env)


@pytest.mark.slow
@pytest.mark.extended  # the ring of worlds 2-4 above, at world 6
def test_exact_ring_world_6():
    _run(6, [(6, "ring", "few", None, "shm")])


def test_one_shot_padding_closed_form():
    """Communicator._one_shot's padding, W * S - n (S: n rounded up to 16 bytes), is what
    zero_bytes says for the one-shot all-gather (allreduce._one_shot through _part): one
    call word whichever way a rank takes (peer_check.py compares it)."""
    for W in range(1, 9):
        for n in [*range(1, 70), 1000, 4095, 4096, 8192, 65521]:
            S = -(-n // 16) * 16
            assert A.zero_bytes(n, S, W, 0, S) == W * S - n, (W, n)


def test_fused_all_reduce_is_a_declared_capability():
    """The CPU and the CUDA plane have the fused operation; the base says it has not, and
    its all_reduce raises NotImplementedError naming the plane."""
    from sparkccl.dataplane.base import DataPlaneBase
    from sparkccl.dataplane.cpu import CpuDataPlane
    from sparkccl.dataplane.cuda import CudaDataPlane
    assert CpuDataPlane.fused_all_reduce and CudaDataPlane.fused_all_reduce
    assert not DataPlaneBase.fused_all_reduce
    with pytest.raises(NotImplementedError, match="DataPlaneBase has no fused all-reduce"):
        object.__new__(DataPlaneBase).all_reduce(0, None, 0, 16, 16, None, 0, 16,
                                                 torch.float32, False)


def _single(rank):
    """A world of one: the sum of one term, a fresh tensor."""
    bad = []
    if rank != 0:
        return bad
    with sparkccl.Communicator(store=torch.distributed.HashStore(), rank=0, world_size=1) as comm:
        for dtype in DTYPES:
            for op in ("sum", "avg"):
                x = make_input(3, 0, (5, 7), dtype)
                y = comm.all_reduce(x, op)
                if not (bits(y) == all_reduce_reference([x], op)).all() or y is x:
                    bad.append(f"{dtype} {op}")
    return bad


def _disagree(rank, world, store) -> str | None:
    """The ranks disagree on the crossover: every rank raises the same ValueError."""
    import os
    if rank == 1:
        os.environ["SPARKCCL_ALLREDUCE_ONESHOT_BYTES"] = "1M"
    try:
        sparkccl.Communicator(store=store, rank=rank, world_size=world).close()
    except ValueError as e:
        return None if "allreduce_oneshot_bytes" in str(e) else str(e)
    finally:
        os.environ.pop("SPARKCCL_ALLREDUCE_ONESHOT_BYTES", None)
    return "created"


def _bad_input_job(rank, world, store):
    import torch.distributed as dist
    with sparkccl.Communicator(store=dist.PrefixStore("bad", store), rank=rank,
                               world_size=world) as comm:
        x = torch.ones(8, dtype=torch.bfloat16)
        ar = comm.all_reduce
        cases = [
            ("not a tensor", lambda: ar([1.0, 2.0]), TypeError, "must be a torch.Tensor"),
            ("int dtype", lambda: ar(torch.ones(8, dtype=torch.int32)), TypeError,
             "is not supported"),
            ("fp64", lambda: ar(torch.ones(8, dtype=torch.float64)), TypeError,
             "is not supported"),
            ("op max", lambda: ar(x, "max"), ValueError, "must be 'sum' or 'avg'"),
            ("op not a str", lambda: ar(x, 3), TypeError, "op must be a str"),
            ("non-contiguous", lambda: ar(torch.ones(4, 4, dtype=torch.bfloat16).t()),
             ValueError, "contiguous"),
            ("out shape", lambda: ar(x, out=torch.empty(9, dtype=torch.bfloat16)), ValueError,
             "out must have shape"),
            ("out dtype", lambda: ar(x, out=torch.empty(8)), ValueError, "out must have shape"),
            ("regime", lambda: comm.all_reduce(x, regime="fast"), ValueError,
             "must be one of"),
        ]
        problems = expect_errors(comm, cases)
        y = comm.all_reduce(torch.empty(0, 3))  # empty: nothing sent, no sequence number
        problems["empty"] = None if y.shape == (0, 3) and comm.seq == 0 else "sent"
    comm.close()
    try:
        comm.all_reduce(x)
        problems["closed"] = "no exception"
    except ValueError as e:
        problems["closed"] = None if "closed" in str(e) else str(e)
    problems["world of one"] = "; ".join(_single(rank)) or None
    problems["disagreeing crossover"] = _disagree(rank, world, dist.PrefixStore("agree", store))
    return problems


@pytest.mark.parametrize("able,taken", [((True, True), True), ((True, False), False),
                                         ((False, True), False), ((False, False), False)])
@pytest.mark.parametrize("direct", [(True, True), (False, False), (True, False)],
                         ids=["direct", "proxy", "mixed"])
def test_ll_way_is_taken_by_every_rank_or_none(able, taken, direct):
    """The LL all-reduce (wiring.py _agree_ll): each rank of a CUDA mesh says whether it can
    take it (SPARKCCL_ALLREDUCE_LL, world <= 8; not GPU-direct: SPARKCCL_ALLREDUCE_LL_PROXY
    as well) through the store, and every rank enables it only if all can, so no rank waits
    for lines a peer never writes; each rank writes its lines GPU-direct where it is, else
    through its proxy (readers cannot tell them apart). (A ring is not asked at all; a CPU
    plane says no; a rank neither GPU-direct nor set to send through its proxy says no.)"""
    import types

    from sparkccl import wiring

    said, enabled = [], []
    for rank in range(2):
        w = object.__new__(wiring.Wiring)
        w.rank, w.world, w.topology, w.gpu_direct = rank, 2, "mesh", direct[rank]
        w.device = torch.device("cuda")
        w.settings = types.SimpleNamespace(allreduce_ll=able[rank], allreduce_ll_proxy=True)
        w.dp = types.SimpleNamespace(
            check_abort=None,
            enable_ll=lambda through_proxy, rank=rank: enabled.append((rank, through_proxy)))
        w.rv = types.SimpleNamespace(exchange=lambda name, value, *a: said.append(value)
                                     or list(able))
        w._agree_ll()
    assert said == list(able)
    assert enabled == ([(0, not direct[0]), (1, not direct[1])] if taken else [])
    w.device, said[:] = torch.device("cpu"), []
    w._agree_ll()
    assert said == [False]
    w.device, w.gpu_direct, said[:] = torch.device("cuda"), False, []
    w.settings = types.SimpleNamespace(allreduce_ll=True, allreduce_ll_proxy=False)
    w._agree_ll()
    assert said == [False]
    w.topology, said[:] = "ring", []
    w._agree_ll()
    assert said == []


# ---- CUDA: capture and replay (several ranks sharing one GPU; the lead runs -m cuda) ----

def _graph_job(rank, world, store, topology, replays, transport="auto"):
    """All-reduces of both regimes, several dtypes and both ops captured in one CUDA graph
    (after one eager reduce-scatter, which sets its buffers up), replayed with new inputs
    copied into the captured ones, eager all-reduces between replays: every output exact.
    (The two-step ones are the CUDA plane's fused kernel: GPU-direct over shm by default,
    the proxy path with SPARKCCL_GPU_DIRECT=0 and over tcp.)"""
    import torch.distributed as dist
    torch.cuda.set_device(0)
    W = world
    bf, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    specs = [((4096,), bf, "sum", A.ONE_SHOT), ((4096,), bf, "sum", A.TWO_STEP),
             ((3, 333), fp16, "avg", A.ONE_SHOT), ((3, 333), fp16, "avg", A.TWO_STEP),
             ((1,), fp32, "avg", None), ((1 << 18,), bf, "sum", None),
             ((1 << 17,), fp32, "avg", None)]
    bad = []
    with sparkccl.Communicator(store=dist.PrefixStore("argraph", store), rank=rank,
                               world_size=W, topology=topology, device="cuda",
                               transport=transport, timeout_s=60) as comm:
        if not comm.data_plane.fused_all_reduce:
            bad.append(f"over {transport} the CUDA plane has no fused all-reduce")
        xin = [torch.zeros(s, dtype=d, device="cuda") for s, d, _, _ in specs]

        def step():
            return [comm.all_reduce(x, op, regime=reg) for x, (_, _, op, reg) in zip(xin, specs)]

        step()  # eager first: the reduce-scatter buffers, and torch's capture warm-up
        comm.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        for it in range(replays):
            xs = [[make_input(100 * it + k, q, s, d) for q in range(W)]
                  for k, (s, d, _, _) in enumerate(specs)]
            for x, v in zip(xin, xs):
                x.copy_(v[rank])
            graph.replay()
            ex = [make_input(9000 + it, q, (777,), torch.bfloat16) for q in range(W)]
            ey = comm.all_reduce(ex[rank].cuda(), "avg")
            comm.synchronize()
            for k, (s, d, op, reg) in enumerate(specs):
                if not (bits(outs[k].cpu()) == all_reduce_reference(xs[k], op)).all():
                    bad.append(f"replay {it}: {list(s)} {d} {op} {reg} differs")
            if not (bits(ey.cpu()) == all_reduce_reference(ex, "avg")).all():
                bad.append(f"eager after replay {it} differs")
        # a mesh: the one shots up to 8 KiB / (W - 1) went the LL way, GPU-direct on shm,
        # else through the proxy where SPARKCCL_ALLREDUCE_LL_PROXY says so
        proxy = transport == "tcp" or os.environ.get("SPARKCCL_GPU_DIRECT", "1") == "0"
        ll = topology == "mesh" and (
            not proxy or os.environ.get("SPARKCCL_ALLREDUCE_LL_PROXY", "0") == "1")
        dp = comm.data_plane
        if (dp.ll_launches > 0) != ll:
            bad.append(f"LL launches {dp.ll_launches}, expected {'some' if ll else 'none'}")
        if ll and dp.ll_proxy != proxy:
            bad.append(f"LL lines through the proxy: {dp.ll_proxy}, expected {proxy}")
    return bad


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: "
                    "torch.cuda.is_available() is False")
@pytest.mark.parametrize("env,transport", [
    ({}, "auto"), ({"SPARKCCL_GPU_DIRECT": "0"}, "auto"), ({}, "tcp"),
    ({"SPARKCCL_ALLREDUCE_LL_PROXY": "1"}, "tcp")], ids=["direct", "proxy", "tcp-fused", "tcp-ll"])
@pytest.mark.parametrize("topology,world", [("mesh", 2), ("ring", 3), ("mesh", 4)])
def test_cuda_graph_capture_and_replay(topology, world, env, transport):
    values = check(run_ranks(_graph_job, world, args=(topology, 10, transport), env=env,
                             timeout_s=300))
    bad = [f"rank {r}: {b}" for r, v in enumerate(values) for b in v]
    assert not bad, "\n".join(bad)
