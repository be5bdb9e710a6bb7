"""The torch.distributed backend "sparkccl" (docs/TORCH.md): every routed collective bit-exact
against the rank-order fp32 reference, on both method-name generations, mesh and ring,
world 2 and 4; every fallback path; the same routing decisions on every rank; errors from
the call and from wait(); graph capture declined; functional collectives under
torch.compile reach sparkccl."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions

from sparkccl.localrun import check
from sparkccl.reference import all_gather_reference, bits, make_input, reduce_scatter_reference
from sparkccl.localrun import run_ranks  # the one place this test file imports the rank runner
from sparkccl.integrations import torch_backend as tb

SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---- references ----------------------------------------------------------------------

def _sum_f32(inputs):
    acc = inputs[0].float().clone()
    for x in inputs[1:]:
        acc += x.float()  # fp32, rank order, starting from rank 0's value
    return acc


def _all_reduce_reference(inputs, world):
    """Raw bytes of the all-reduced tensor: chunk i of the rank-order fp32 sum for every i."""
    import numpy as np
    flat = [x.reshape(world, -1) for x in inputs]
    return np.concatenate([reduce_scatter_reference(flat, r) for r in range(world)])


def _avg_reference(inputs, world):
    return bits((_sum_f32(inputs) / world).to(inputs[0].dtype))


# ---- one rank's checks on one group --------------------------------------------------

def _routed_checks(pg, rank, world, seed) -> list[str]:
    """Bit-exact all-gather / reduce-scatter / all-reduce through every name c10d uses."""
    bad = []

    def expect(what, got, want):
        if got.size != want.size or not (got == want).all():
            bad.append(f"{what}: wrong bits")

    for k, dtype in enumerate(DTYPES):
        s = seed * 10 + k
        # all_gather_into_tensor: public API (2.13 name underneath), then the <=2.12 name,
        # then the coalesced forms c10d and the functional collectives call.
        xs = [make_input(s, r, (5, 3), dtype) for r in range(world)]
        want = all_gather_reference(xs)
        out = torch.empty(world * 5, 3, dtype=dtype)
        dist.all_gather_into_tensor(out, xs[rank], group=pg)
        expect(f"all_gather_into_tensor {dtype}", bits(out), want)
        out2 = torch.empty(world, 5, 3, dtype=dtype)  # the stacked output layout
        pg._allgather_base(out2, xs[rank], AllgatherOptions()).wait()
        expect(f"_allgather_base {dtype}", bits(out2), want)
        outs = [torch.empty(world * 5, 3, dtype=dtype) for _ in range(2)]
        pg.allgather_into_tensor_coalesced(outs, [xs[rank], xs[rank]],
                                           AllgatherOptions()).wait()
        pg.all_gather_single_coalesced(outs[:1], [xs[rank]], AllgatherOptions()).wait()
        for o in outs:
            expect(f"all-gather coalesced {dtype}", bits(o), want)

        # reduce_scatter_tensor
        ys = [make_input(s + 5, r, (world * 4, 6), dtype) for r in range(world)]
        want = reduce_scatter_reference(ys, rank)
        o = torch.empty(4, 6, dtype=dtype)
        dist.reduce_scatter_tensor(o, ys[rank], group=pg)
        expect(f"reduce_scatter_tensor {dtype}", bits(o), want)
        opts = ReduceScatterOptions()
        opts.reduceOp = SUM
        o = torch.empty(4, 6, dtype=dtype)
        pg._reduce_scatter_base(o, ys[rank], opts).wait()
        expect(f"_reduce_scatter_base {dtype}", bits(o), want)
        os_ = [torch.empty(4, 6, dtype=dtype) for _ in range(2)]
        pg.reduce_scatter_tensor_coalesced(os_, [ys[rank], ys[rank]], opts).wait()
        pg.reduce_scatter_single_coalesced(os_[:1], [ys[rank]], opts).wait()
        for o in os_:
            expect(f"reduce-scatter coalesced {dtype}", bits(o), want)
        o = torch.empty(4, 6, dtype=dtype)
        dist.reduce_scatter_tensor(o, ys[rank], op=AVG, group=pg)
        m = 4 * 6
        expect(f"reduce_scatter_tensor AVG {dtype}", bits(o),
               _avg_reference(ys, world)[rank * m * o.element_size():(rank + 1) * m * o.element_size()])

        # all_reduce = reduce-scatter + all-gather: the same bits on every rank
        zs = [make_input(s + 7, r, (world * 3, 5), dtype) for r in range(world)]
        z = zs[rank].clone()
        work = dist.all_reduce(z, group=pg, async_op=True)
        work.wait()
        expect(f"all_reduce {dtype}", bits(z), _all_reduce_reference(zs, world))
        z = zs[rank].clone()
        dist.all_reduce(z, op=AVG, group=pg)
        expect(f"all_reduce AVG {dtype}", bits(z), _avg_reference(zs, world))

    # coalescing manager (c10d's own coalesced path)
    xs = [make_input(seed + 99, r, (8,), torch.float32) for r in range(world)]
    outs = [torch.empty(world * 8) for _ in range(2)]
    with dist._coalescing_manager(group=pg):
        for o in outs:
            dist.all_gather_into_tensor(o, xs[rank], group=pg)
    for o in outs:
        expect("coalescing manager all-gather", bits(o), all_gather_reference(xs))
    # an all-gather whose input is this rank's slice of the output (FSDP's in-place form)
    buf = torch.zeros(world * 6)
    buf[rank * 6:(rank + 1) * 6] = xs[rank][:6]
    dist.all_gather_into_tensor(buf, buf[rank * 6:(rank + 1) * 6], group=pg)
    expect("in-place all-gather", bits(buf), all_gather_reference([x[:6] for x in xs]))
    return bad


def _fallback_checks(pg, rank, world, seed) -> list[str]:
    """Every call sparkccl does not take gives the standard result through the fallback."""
    bad = []
    ranks = dist.get_process_group_ranks(pg)

    def expect(what, cond):
        if not cond:
            bad.append(what)

    t = torch.full((4,), float(rank))
    dist.broadcast(t, ranks[-1], group=pg)
    expect("broadcast", t.tolist() == [float(world - 1)] * 4)
    dist.barrier(group=pg)
    lst = [torch.empty(3) for _ in range(world)]
    dist.all_gather(lst, torch.full((3,), float(rank)), group=pg)
    expect("all_gather list", [x[0].item() for x in lst] == [float(r) for r in range(world)])
    g = [torch.empty(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), g, dst=ranks[0], group=pg)
    expect("gather", rank != 0 or [x[0].item() for x in g] == [float(r) for r in range(world)])
    sc = torch.empty(2)
    dist.scatter(sc, [torch.full((2,), float(r)) for r in range(world)] if rank == 0 else None,
                 src=ranks[0], group=pg)
    expect("scatter", sc.tolist() == [float(rank)] * 2)
    a2a = torch.empty(world)
    dist.all_to_all_single(a2a, torch.arange(world, dtype=torch.float32) + 10 * rank, group=pg)
    expect("all_to_all_single", a2a.tolist() == [float(rank + 10 * r) for r in range(world)])
    outs = [torch.empty(1) for _ in range(world)]
    dist.all_to_all(outs, [torch.tensor([float(rank * 10 + r)]) for r in range(world)], group=pg)
    expect("all_to_all", [o.item() for o in outs] == [float(r * 10 + rank) for r in range(world)])
    # send / recv around the ring of ranks
    nxt, prv = ranks[(rank + 1) % world], ranks[(rank - 1) % world]
    recv = torch.empty(2)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), float(rank)), nxt, pg),
                                   dist.P2POp(dist.irecv, recv, prv, pg)])
    for r in reqs:
        r.wait()
    expect("send/recv", recv.tolist() == [float((rank - 1) % world)] * 2)
    if rank == 0:
        dist.send(torch.tensor([7.0]), ranks[1], group=pg)
    elif rank == 1:
        got = torch.empty(1)
        dist.recv(got, ranks[0], group=pg)
        expect("send/recv blocking", got.item() == 7.0)
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank}, group=pg)
    expect("all_gather_object", objs == [{"rank": r} for r in range(world)])
    ol = [f"from {rank}"]
    dist.broadcast_object_list(ol, src=ranks[0], group=pg)
    expect("broadcast_object_list", ol == ["from 0"])
    # declined by op, dtype, size, layout: still the right answer
    m = torch.tensor([float(rank)] * world)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=pg)
    expect("all_reduce MAX", m.tolist() == [float(world - 1)] * world)
    i = torch.full((world * 4,), rank + 1, dtype=torch.int64)
    dist.all_reduce(i, group=pg)
    expect("all_reduce int64", i.tolist() == [world * (world + 1) // 2] * (world * 4))
    u = torch.ones(world * 4 + 1)
    dist.all_reduce(u, group=pg)
    expect("all_reduce uneven", u.tolist() == [float(world)] * (world * 4 + 1))
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2.0 * world) * (rank + 1), op=dist.ReduceOp.MAX,
                               group=pg)
    expect("reduce_scatter MAX", rs.tolist() == [float((2 * rank + j) * world) for j in range(2)])
    nc = (torch.arange(6.0).reshape(3, 2) + 10 * rank).t()  # non-contiguous [2, 3]
    nc_out = torch.empty(world * 2, 3)
    dist.all_gather_into_tensor(nc_out, nc, group=pg)
    expect("all-gather of a non-contiguous input",
           nc_out.tolist() == [row for r in range(world)
                               for row in ((torch.arange(6.0).reshape(3, 2) + 10 * r).t()).tolist()])
    red = torch.full((3,), float(rank))
    dist.reduce(red, ranks[0], group=pg)
    expect("reduce", rank != 0 or red.tolist() == [float(sum(range(world)))] * 3)
    return bad


def _small_checks(pg, rank, world) -> list[str]:
    """Small reductions give the mean: through sparkccl by default, through the fallback
    (AVG on gloo too) on the opt-in SPARKCCL_TORCH_INEXACT_SMALL."""
    bad = []
    x = torch.full((world * 4,), float(rank + 1))
    dist.all_reduce(x, op=AVG, group=pg)
    if x.tolist() != [(world + 1) / 2] * (world * 4):
        bad.append(f"small all_reduce AVG: {x.tolist()}")
    o = torch.empty(4)
    dist.reduce_scatter_tensor(o, torch.full((world * 4,), float(rank + 1)), op=AVG, group=pg)
    if o.tolist() != [(world + 1) / 2] * 4:
        bad.append(f"small reduce_scatter AVG: {o.tolist()}")
    return bad


def backend_job(rank, world, store):
    warnings.filterwarnings("ignore", category=FutureWarning)
    import sparkccl.integrations.torch_backend as tb_
    dist.init_process_group("sparkccl", store=store, rank=rank, world_size=world,
                            pg_options=tb_.Options(min_bytes=0, slot_bytes=1 << 16))
    mesh = dist.group.WORLD
    ring = dist.new_group(backend="sparkccl",
                          pg_options=tb_.Options(topology="ring", min_bytes=0, slot_bytes=1 << 16))
    pair = dist.new_group([0, 2], backend="sparkccl",  # world 2 inside world 4
                          pg_options=tb_.Options(min_bytes=0))
    small = dist.new_group(backend="sparkccl")  # SPARKCCL_TORCH_MIN_BYTES from the env
    inexact = dist.new_group(backend="sparkccl", pg_options=tb_.Options(inexact_small=True))
    out = {"type": type(mesh).__name__, "backend": dist.get_backend(mesh),
           "small_min_bytes": small.min_bytes, "inexact_small": (small.inexact_small,
                                                                 inexact.inexact_small)}
    for name, pg in (("mesh", mesh), ("ring", ring), ("pair", pair)):
        if pg == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        r, w = dist.get_rank(pg), dist.get_world_size(pg)
        out[name] = _routed_checks(pg, r, w, seed=len(name)) + _fallback_checks(pg, r, w, 3)
        out[name + "_comm"] = (pg.communicator("cpu").topology, pg.communicator("cpu").world_size)
    out["small"] = _small_checks(small, rank, world) + _small_checks(inexact, rank, world)
    # the routing decisions, as every rank counted them
    for name, pg in (("mesh", mesh), ("ring", ring), ("pair", pair), ("small", small),
                     ("inexact", inexact)):
        if pg != dist.GroupMember.NON_GROUP_MEMBER:
            out[name + "_routed"] = dict(pg.routed)
            out[name + "_declined"] = dict(pg.declined)
    dist.destroy_process_group()
    return out


@pytest.mark.slow
def test_backend_bit_exact_and_fallbacks_mesh_ring_world_2_and_4():
    world = 4
    values = check(run_ranks(backend_job, world, timeout_s=240,
                             env={"SPARKCCL_TORCH_MIN_BYTES": "64K"}))
    for rank, v in enumerate(values):
        assert v["type"] == "SparkcclProcessGroup" and v["backend"] == "sparkccl"
        assert v["small_min_bytes"] == 64 << 10
        for name in ("mesh", "ring") + (("pair",) if rank in (0, 2) else ()):
            assert v[name] == [], (rank, name, v[name])
        assert v["mesh_comm"] == ("mesh", 4) and v["ring_comm"] == ("ring", 4)
        assert rank not in (0, 2) or v["pair_comm"] == ("mesh", 2)
        assert v["small"] == [], (rank, v["small"])
        assert v["inexact_small"] == (False, True)
        # all-reduce of world * 4 + 1 elements (not a multiple of the world): sparkccl's too
        assert v["mesh_routed"]["all_gather"] >= 15 and v["mesh_routed"]["all_reduce"] == 7
        assert v["mesh_routed"]["reduce_scatter"] == 18
        assert {"reduce op MAX", "dtype torch.int64"} <= set(v["mesh_declined"])
        # small reductions: sparkccl's by default, the fallback's only on the opt-in
        assert v["small_routed"] == {"all_reduce": 1, "reduce_scatter": 1}
        assert v["small_declined"] == {}
        assert v["inexact_routed"] == {} and v["inexact_declined"] == {
            f"below {tb.MIN_BYTES_VARIABLE}": 2}
    for name in ("mesh", "ring", "small", "inexact"):
        for key in ("_routed", "_declined"):
            assert all(v[name + key] == values[0][name + key] for v in values), name + key
    assert values[0]["pair_routed"] == values[2]["pair_routed"]
    assert values[0]["pair_declined"] == values[2]["pair_declined"]


# ---- all_to_all_single ---------------------------------------------------------------

A2A_CASES = (  # (dtype, shape of one rank's input with the world's blocks as dim 0 / world)
    (torch.bfloat16, (3, 5)), (torch.float16, (1,)), (torch.float32, (7, 2, 3)),
    (torch.float64, (2, 9)), (torch.int8, (5,)), (torch.uint8, (4, 33)),
    (torch.int32, (2, 2, 2)), (torch.int64, (3, 1)), (torch.bool, (6, 7)),
    (torch.complex64, (2, 3)),
    (torch.float32, (12_000, 2)),  # 96 KB blocks: above the 64 KiB slots, several pieces
)


def _a2a_reference(xs, rank):
    """Raw bytes rank ``rank`` receives: block ``rank`` of every rank's input, in rank order."""
    import numpy as np
    w = len(xs)
    m = xs[0].shape[0] // w
    return np.concatenate([bits(x[rank * m:(rank + 1) * m]) for x in xs])


def _a2a_checks(pg, rank, world, seed) -> list[str]:
    """Equal blocks (no split sizes) through both method names, bit for bit; split sizes
    (uneven, and equal lists too) through the fallback, still right. (A non-contiguous
    tensor is declined too, test_decline_rule; gloo then refuses it, as without sparkccl.)"""
    from torch._C._distributed_c10d import AllToAllOptions
    bad = []

    def expect(what, got, want):
        if got.size != want.size or not (got == want).all():
            bad.append(f"{what}: wrong bits")

    for k, (dtype, block) in enumerate(A2A_CASES):
        shape = (world * block[0],) + block[1:]
        xs = [make_input(seed * 100 + k, r, shape, dtype) for r in range(world)]
        want = _a2a_reference(xs, rank)
        out = torch.empty(shape, dtype=dtype)
        dist.all_to_all_single(out, xs[rank], group=pg)
        expect(f"all_to_all_single {dtype} {shape}", bits(out), want)
        if k % 3 == 0:
            # the ProcessGroup's methods by both names; the output in another shape
            flat = torch.empty(out.numel(), dtype=dtype)
            pg.alltoall_base(flat, xs[rank], [], [], AllToAllOptions()).wait()
            expect(f"alltoall_base {dtype}", bits(flat), want)
            if hasattr(dist.ProcessGroup, "all_to_all_single"):
                out2 = torch.full(shape, 0, dtype=dtype)
                pg.all_to_all_single(out2, xs[rank], [], [], AllToAllOptions()).wait()
                expect(f"pg.all_to_all_single {dtype}", bits(out2), want)
    # in place (output is the input): through a temporary
    xs = [make_input(seed * 100 + 50, r, (world * 4, 3), torch.float32) for r in range(world)]
    x = xs[rank].clone()
    work = dist.all_to_all_single(x, x, group=pg, async_op=True)
    work.wait()
    expect("in-place all_to_all_single", bits(x), _a2a_reference(xs, rank))

    # uneven splits: rank r sends f(r, j) rows to rank j -> the fallback
    def f(r, j):
        return (r + 2 * j) % 3 + 1
    rows = [[f(r, j) for j in range(world)] for r in range(world)]
    xs = [make_input(seed * 100 + 60, r, (sum(rows[r]), 5), torch.bfloat16) for r in range(world)]
    out = torch.empty(sum(rows[i][rank] for i in range(world)), 5, dtype=torch.bfloat16)
    dist.all_to_all_single(out, xs[rank], output_split_sizes=[rows[i][rank] for i in range(world)],
                           input_split_sizes=rows[rank], group=pg)
    import numpy as np
    want = np.concatenate([bits(xs[i][sum(rows[i][:rank]):sum(rows[i][:rank + 1])])
                           for i in range(world)])
    expect("all_to_all_single uneven splits", bits(out), want)
    # equal split lists: per-rank data, so the fallback too (decline_reason says why)
    xs = [make_input(seed * 100 + 70, r, (world * 2, 3), torch.float32) for r in range(world)]
    out = torch.empty(world * 2, 3)
    dist.all_to_all_single(out, xs[rank], output_split_sizes=[2] * world,
                           input_split_sizes=[2] * world, group=pg)
    expect("all_to_all_single equal split lists", bits(out), _a2a_reference(xs, rank))
    return bad


def a2a_job(rank, world, store):
    warnings.filterwarnings("ignore", category=FutureWarning)
    import sparkccl.integrations.torch_backend as tb_
    dist.init_process_group("sparkccl", store=store, rank=rank, world_size=world,
                            pg_options=tb_.Options(min_bytes=0, slot_bytes=1 << 16))
    ring = dist.new_group(backend="sparkccl",
                          pg_options=tb_.Options(topology="ring", min_bytes=0, slot_bytes=1 << 16))
    small = dist.new_group(backend="sparkccl")  # SPARKCCL_TORCH_MIN_BYTES from the env (1K)
    out = {}
    for name, pg in (("mesh", dist.group.WORLD), ("ring", ring)):
        out[name] = _a2a_checks(pg, rank, world, seed=len(name))
        out[name + "_comm"] = pg.communicator("cpu").topology
        out[name + "_counts"] = (dict(pg.routed), dict(pg.declined))
    # the threshold (1 KiB): 3 * 85 fp32 (1020 bytes) to the fallback, 3 * 86 (1032) to
    # sparkccl, both exact
    bad = []
    for n in (world * 85, world * 86):
        xs = [make_input(500 + n, r, (n,), torch.float32) for r in range(world)]
        o = torch.empty(n)
        dist.all_to_all_single(o, xs[rank], group=small)
        if not (bits(o) == _a2a_reference(xs, rank)).all():
            bad.append(f"small group: {n} elements")
    out["small"] = bad
    out["small_counts"] = (dict(small.routed), dict(small.declined))
    dist.destroy_process_group()
    return out


def test_all_to_all_single_equal_blocks_routed_others_fallback_mesh_ring():
    world = 3
    values = check(run_ranks(a2a_job, world, timeout_s=240,
                             env={"SPARKCCL_TORCH_MIN_BYTES": "1K"}))
    named = sum(1 + hasattr(dist.ProcessGroup, "all_to_all_single")
                for k in range(len(A2A_CASES)) if k % 3 == 0)
    for v in values:
        for name in ("mesh", "ring"):
            assert v[name] == [], (name, v[name])
            assert v[name + "_comm"] == name
            routed, declined = v[name + "_counts"]
            # every equal-block call (the in-place one too) ran in sparkccl
            assert routed == {"all_to_all": len(A2A_CASES) + named + 1}, (name, routed)
            assert declined == {"split sizes given": 2}, (name, declined)
        assert v["small"] == []
        assert v["small_counts"] == ({"all_to_all": 1},
                                     {f"below {tb.MIN_BYTES_VARIABLE}": 1}), v["small_counts"]
    for key in ("mesh_counts", "ring_counts", "small_counts"):
        assert all(v[key] == values[0][key] for v in values), key


# ---- default settings: reductions exact at every size --------------------------------

# 2 bytes (one bf16) up to 3 MiB, not multiples of 16 bytes or of the world size among them
DEFAULT_SIZES_ELEMS = (1, 3, 50, 1000, 4097, 65_536 + 5, (1 << 20) - 3, 3 << 19)


def default_settings_job(rank, world, store):
    """Groups with default settings (SPARKCCL_TORCH_MIN_BYTES 1 MiB): every all_reduce and
    reduce_scatter_tensor, SUM and AVG, from 2 bytes to 3 MiB, equals the rank-order
    reference; counted as routed to sparkccl, none declined."""
    from sparkccl.reference import all_reduce_reference
    warnings.filterwarnings("ignore", category=FutureWarning)
    import sparkccl.integrations.torch_backend as tb_
    dist.init_process_group("sparkccl", store=store, rank=rank, world_size=world)
    groups = {f"{world} mesh": dist.group.WORLD,
              f"{world} ring": dist.new_group(backend="sparkccl",
                                              pg_options=tb_.Options(topology="ring")),
              "2 mesh": dist.new_group([0, 1], backend="sparkccl")}
    bad, counts = [], {}
    for name, pg in groups.items():
        if pg == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        r, w = dist.get_rank(pg), dist.get_world_size(pg)
        for i, n in enumerate(DEFAULT_SIZES_ELEMS):
            dtype = DTYPES[i % 3]
            for op, opname in ((SUM, "sum"), (AVG, "avg")):
                s = 100 * i + (op == AVG)
                zs = [make_input(s, q, (n,), dtype) for q in range(w)]
                z = zs[r].clone()
                dist.all_reduce(z, op=op, group=pg)
                if not (bits(z) == all_reduce_reference(zs, opname)).all():
                    bad.append(f"{name}: all_reduce {n} x {dtype} {opname}")
                m = max(1, n // w)
                ys = [make_input(s + 50, q, (w * m,), dtype) for q in range(w)]
                o = torch.empty(m, dtype=dtype)
                dist.reduce_scatter_tensor(o, ys[r], op=op, group=pg)
                want = all_reduce_reference(ys, opname)
                nb = m * o.element_size()
                if not (bits(o) == want[r * nb:(r + 1) * nb]).all():
                    bad.append(f"{name}: reduce_scatter_tensor {w * m} x {dtype} {opname}")
        counts[name] = (dict(pg.routed), dict(pg.declined))
    dist.destroy_process_group()
    return bad, counts


def test_default_settings_reductions_exact_from_2_bytes_to_mib():
    values = check(run_ranks(default_settings_job, 3, timeout_s=300))
    calls = 2 * len(DEFAULT_SIZES_ELEMS)
    for rank, (bad, counts) in enumerate(values):
        assert not bad, (rank, bad)
        assert set(counts) == ({"3 mesh", "3 ring"} | ({"2 mesh"} if rank < 2 else set()))
        for name, (routed, declined) in counts.items():
            assert routed == {"all_reduce": calls, "reduce_scatter": calls}, (rank, name, routed)
            assert declined == {}, (rank, name, declined)


# ---- errors, torch.compile -----------------------------------------------------------

def compile_and_errors_job(rank, world, store):
    warnings.filterwarnings("ignore", category=FutureWarning)
    import sparkccl.integrations.torch_backend as tb_
    # The default timeout (120 s): on a busy host one rank may compile much longer than the
    # other while its peer already waits in the first collective.
    dist.init_process_group("sparkccl", store=store, rank=rank, world_size=world,
                            pg_options=tb_.Options(min_bytes=0))
    pg = dist.group.WORLD
    name = pg.group_name

    def f(x, y):
        c = torch.ops._c10d_functional
        a = c.wait_tensor(c.all_gather_into_tensor(x * 2, world, name))
        b = c.wait_tensor(c.reduce_scatter_tensor(y + 1, "sum", world, name))
        return a, b

    # Inductor compiles C++ for minutes on a small CPU host; aot_eager traces the same
    # functional collectives into the graph and runs them.
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    xs = [make_input(5, r, (4, 3), torch.float32) for r in range(world)]
    ys = [make_input(6, r, (world * 2, 3), torch.bfloat16) for r in range(world)]
    a, b = compiled(xs[rank], ys[rank])
    out = {"compiled_ag": bool((bits(a) == all_gather_reference([x * 2 for x in xs])).all()),
           "compiled_rs": bool((bits(b) == reduce_scatter_reference([y + 1 for y in ys],
                                                                   rank)).all())}
    # DDP: its gradient bucket is all-reduced through sparkccl (C++ Reducer -> allreduce)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(make_input(7, rank, (8, 16), torch.float32)).sum().backward()
    out["ddp_grads"] = bits(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    out["routed"] = dict(pg.routed)
    # Rank 1 leaves only once rank 0 is done too (through gloo): otherwise rank 0's
    # all-reduce may still be finishing and fail, rightly, with rank 1's error.
    dist.barrier()
    comm = pg.communicator("cpu")
    if rank == 1:
        # This rank leaves the communicator as a failing `with` block would.
        comm.__exit__(KeyError, KeyError("rank 1 gave up"), None)
        store.set("left", "1")
        try:  # its own next call: refused at the call
            dist.all_gather_into_tensor(torch.empty(world * 4), torch.ones(4))
        except ValueError as e:
            out["call_error"] = str(e)
    else:
        store.wait(["left"])
        work = dist.all_gather_into_tensor(torch.empty(world * 4), torch.ones(4), async_op=True)
        try:
            work.wait()
        except dist_error() as e:
            out["wait_error"] = (type(e).__name__, str(e))
        try:
            dist.reduce_scatter_tensor(torch.empty(4), torch.ones(world * 4))
        except dist_error() as e:
            out["sync_error"] = (type(e).__name__, str(e))
        try:
            compiled(xs[rank], ys[rank])
        except dist_error() as e:
            out["compiled_error"] = (type(e).__name__, str(e))
    # the fallback still works after sparkccl failed
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["fallback_after"] = t.item()
    # ranks whose thresholds differ would route differently: refused at creation, everywhere
    import os
    os.environ["SPARKCCL_TORCH_MIN_BYTES"] = str(1000 + rank)
    try:
        dist.new_group(backend="sparkccl")
    except ValueError as e:
        out["disagree"] = str(e)
    os.environ["SPARKCCL_TORCH_MIN_BYTES"] = "1M" if rank == 0 else "lots"
    try:
        dist.new_group(backend="sparkccl")
    except ValueError as e:
        out["unparsable"] = str(e)
    dist.destroy_process_group()
    return out


def dist_error():
    from sparkccl import CollectiveError
    return CollectiveError


@pytest.mark.slow
def test_compiled_functional_collectives_ddp_and_errors():
    values = check(run_ranks(compile_and_errors_job, 2, timeout_s=240))
    for v in values:
        assert v["compiled_ag"] and v["compiled_rs"], v
        # counted by the group: the compiled graph's collectives ran in sparkccl
        assert v["routed"] == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}, v["routed"]
        assert (v["ddp_grads"] == values[0]["ddp_grads"]).all()
        assert v["fallback_after"] == 1.0
    assert "closed" in values[1]["call_error"]
    for v in values:
        assert "rank 1: ConfigError: SPARKCCL_TORCH_MIN_BYTES='lots'" in v["unparsable"], v
        assert "must agree" in v["disagree"] and "rank 0: 1000, rank 1: 1001" in v["disagree"]
    for key in ("wait_error", "sync_error", "compiled_error"):
        kind, text = values[0][key]
        assert kind == "CollectiveError", (key, kind, text)
        assert "rank 1 gave up" in text and "rank 0" in text, (key, text)


# ---- the decision rule (pure function: same inputs, same answer on every rank) ------

def test_decline_rule():
    x, out = torch.empty(4, 8), torch.empty(16, 8)
    assert tb.decline_reason("all_gather", x, out, world=4, min_bytes=0) is None
    assert tb.decline_reason("all_gather", x, out, world=4, min_bytes=512) is None
    assert tb.decline_reason("all_gather", x, out, world=4, min_bytes=513) == \
        "below SPARKCCL_TORCH_MIN_BYTES"
    assert tb.decline_reason("all_gather", x, out, world=1, min_bytes=0) == "world size 1"
    assert tb.decline_reason("all_gather", x, torch.empty(15, 8), world=4, min_bytes=0) == \
        "uneven sizes"
    assert tb.decline_reason("all_gather", torch.empty(8, 4).t(), out, world=4,
                             min_bytes=0) == "non-contiguous"
    assert tb.decline_reason("all_gather", x.int(), out.int(), world=4, min_bytes=0) is None
    assert tb.decline_reason("reduce_scatter", out.int(), x.int(), world=4, min_bytes=0,
                             op=SUM) == "dtype torch.int32"
    assert tb.decline_reason("reduce_scatter", out, x, world=4, min_bytes=0, op=SUM) is None
    assert tb.decline_reason("reduce_scatter", out, x, world=4, min_bytes=0, op=AVG) is None
    assert tb.decline_reason("reduce_scatter", out, x, world=4, min_bytes=0,
                             op=dist.ReduceOp.MIN) == "reduce op MIN"
    # all-reduce pads internally: any size; reductions ignore min_bytes unless inexact_small
    assert tb.decline_reason("all_reduce", out, out, world=3, min_bytes=0, op=SUM) is None
    assert tb.decline_reason("all_reduce", out, out, world=4, min_bytes=0, op=SUM) is None
    for kind, a, b in (("all_reduce", out, out), ("reduce_scatter", out, x)):
        assert tb.decline_reason(kind, a, b, world=4, min_bytes=1 << 20, op=AVG) is None
        assert tb.decline_reason(kind, a, b, world=4, min_bytes=1 << 20, op=AVG,
                                 inexact_small=True) == "below SPARKCCL_TORCH_MIN_BYTES"
        assert tb.decline_reason(kind, a, b, world=4, min_bytes=512, op=AVG,
                                 inexact_small=True) is None
    # all-to-all: any dtype, equal blocks only, no split lists, min_bytes on the input
    a = torch.empty(12, 5, dtype=torch.int16)
    assert tb.decline_reason("all_to_all", a, torch.empty(60, dtype=torch.int16), world=4,
                             min_bytes=120) is None
    assert tb.decline_reason("all_to_all", a, a, world=4, min_bytes=121) == \
        "below SPARKCCL_TORCH_MIN_BYTES"
    assert tb.decline_reason("all_to_all", a, a, world=4, min_bytes=0,
                             split_sizes=([], [])) is None
    assert tb.decline_reason("all_to_all", a, a, world=4, min_bytes=0,
                             split_sizes=([3] * 4, [3] * 4)) == "split sizes given"
    assert tb.decline_reason("all_to_all", a, a, world=5, min_bytes=0) == "uneven sizes"
    assert tb.decline_reason("all_to_all", a, torch.empty(4, 15, dtype=torch.int16), world=4,
                             min_bytes=0) is None
    assert tb.decline_reason("all_to_all", a, torch.empty(8, 5, dtype=torch.int16), world=4,
                             min_bytes=0) == "uneven sizes"
    assert tb.decline_reason("all_to_all", a, torch.empty(12, 5), world=4,
                             min_bytes=0) == "mixed dtypes"
    assert tb.decline_reason("all_to_all", torch.empty(5, 12).t(), a.float(), world=4,
                             min_bytes=0) == "non-contiguous"
    assert tb.decline_reason("all_to_all", torch.tensor(1.0), torch.tensor(1.0), world=1,
                             min_bytes=0) == "world size 1"
    assert tb.decline_reason("all_to_all", torch.tensor(1.0), torch.tensor(1.0), world=2,
                             min_bytes=0) == "0-dim tensor"


def test_graph_capture_declined(monkeypatch):
    x, out = torch.empty(4, 8), torch.empty(16, 8)
    assert not tb.capturing()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tb.capturing()
    for kind, a, b in (("all_gather", x, out), ("reduce_scatter", out, x),
                       ("all_reduce", out, out), ("all_to_all", out, out)):
        assert tb.decline_reason(kind, a, b, world=4, min_bytes=0, op=SUM) == \
            "CUDA graph capture"


# ---- both generations of the public names --------------------------------------------

# (new name, older name): torch 2.13 added the first and flags the second with a
# FutureWarning on every call; earlier releases have only the second. README, "Use it from
# torch.distributed".
PUBLIC_NAMES = (("all_gather_single", "all_gather_into_tensor"),
                ("reduce_scatter_single", "reduce_scatter_tensor"))


def names_job(rank, world, store):
    dist.init_process_group("sparkccl", store=store, rank=rank, world_size=world,
                            pg_options=tb.Options(min_bytes=0))
    pg = dist.group.WORLD
    xs = [make_input(1, r, (6, 5), torch.bfloat16) for r in range(world)]
    ys = [make_input(2, r, (world * 4, 3), torch.float32) for r in range(world)]
    out = {}
    for (new, old), kind in zip(PUBLIC_NAMES, ("all_gather", "reduce_scatter")):
        for name in (new, old):
            call = getattr(dist, name, None)
            if call is None:
                out[name] = None  # this torch does not have it
                continue
            before = pg.routed[kind]
            if kind == "all_gather":
                res = torch.empty(world * 6, 5, dtype=torch.bfloat16)
                want = all_gather_reference(xs)
                args = (res, xs[rank])
            else:
                res = torch.empty(4, 3)
                want = reduce_scatter_reference(ys, rank)
                args = (res, ys[rank])
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                call(*args)
            out[name] = {"routed": pg.routed[kind] - before,
                         "exact": bool((bits(res) == want).all()),
                         "future_warning": any(issubclass(w.category, FutureWarning)
                                               for w in seen)}
    dist.destroy_process_group()
    return out


def test_both_public_names_reach_sparkccl():
    values = check(run_ranks(names_job, 2, timeout_s=120))
    torch_2_13 = hasattr(dist, "all_gather_single")
    for v in values:
        for new, old in PUBLIC_NAMES:
            assert v[old] == {"routed": 1, "exact": True, "future_warning": torch_2_13}, v
            if torch_2_13:
                assert v[new] == {"routed": 1, "exact": True, "future_warning": False}, v
            else:
                assert v[new] is None


def test_registered_by_import():
    assert "sparkccl" in dist.Backend.backend_list
    assert dist.Backend.SPARKCCL == "sparkccl"
    tb.register()  # idempotent
    assert dist.Backend._plugins["SPARKCCL"].extended_api
    with pytest.raises(TypeError, match="Options"):
        tb.SparkcclProcessGroup(dist.HashStore(), 0, 2, options={"topology": "ring"})


def test_world_one_goes_to_the_fallback():
    # The Communicator needs two ranks; a one-rank group still answers every call.
    warnings.filterwarnings("ignore", category=FutureWarning)
    pg = tb.SparkcclProcessGroup(dist.HashStore(), 0, 1, options=tb.Options(min_bytes=0))
    x = torch.arange(6.0)
    out = torch.empty(6)
    pg.all_gather_single(out, x, AllgatherOptions()).wait()
    pg._allgather_base(out, x, AllgatherOptions()).wait()
    y = x.clone()
    pg.allreduce([y]).wait()
    assert out.tolist() == x.tolist() and y.tolist() == x.tolist()
    assert dict(pg.declined) == {"world size 1": 3} and not pg.routed
    pg.shutdown()


def test_torch_autoload_entry_point(monkeypatch):
    from importlib.metadata import entry_points
    eps = [e for e in entry_points(group="torch.backends") if e.name == "sparkccl"]
    assert [e.value for e in eps] == ["sparkccl.integrations.torch_autoload:autoload"]
    eps[0].load()()
    assert "SPARKCCL" in dist.Backend._plugins
    # A broken install warns instead of breaking `import torch`.
    import sys

    import sparkccl.integrations
    monkeypatch.delattr(sparkccl.integrations, "torch_backend")
    monkeypatch.setitem(sys.modules, "sparkccl.integrations.torch_backend", None)
    with pytest.warns(RuntimeWarning, match="not registered"):
        eps[0].load()()


# ---- CUDA (the GPU machine: one GPU per rank, NCCL as the fallback) ------------------

def cuda_job(rank, world, store):
    warnings.filterwarnings("ignore", category=FutureWarning)
    import sparkccl.integrations.torch_backend as tb_
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("sparkccl", store=store, rank=rank, world_size=world,
                            pg_options=tb_.Options(min_bytes=0), device_id=dev)
    pg = dist.group.WORLD
    bad = []
    # With a bound device, c10d splits the default group's NCCL for new groups (the ranks
    # outside take part too): the group's own NCCL fallback must come from that split.
    sub = dist.new_group([0, 1], backend="sparkccl", pg_options=tb_.Options(min_bytes=0))
    if rank < 2:
        s = torch.full((8,), float(rank), device=dev)
        dist.broadcast(s, 1, group=sub)
        if s.sum().item() != 8.0:
            bad.append("broadcast in a split subgroup")
    dist.barrier()

    def expect(what, got, want):
        if got.size != want.size or not (got == want).all():
            bad.append(what)

    # the fallback first: NCCL connects outside any graph capture
    b = torch.full((4,), float(rank), device=dev)
    dist.broadcast(b, 1)
    expect("broadcast (NCCL)", bits(b.cpu()), bits(torch.full((4,), 1.0)))
    for k, dtype in enumerate(DTYPES):
        xs = [make_input(40 + k, r, (64, 33), dtype) for r in range(world)]
        out = torch.empty(world * 64, 33, dtype=dtype, device=dev)
        side = torch.cuda.Stream(dev)
        with torch.cuda.stream(side):  # enqueued on a side stream, waited for on the default
            x = xs[rank].to(dev)
            work = dist.all_gather_into_tensor(out, x, async_op=True)
        work.wait()
        expect(f"all_gather {dtype}", bits(out.cpu()), all_gather_reference(xs))
        ys = [make_input(50 + k, r, (world * 16, 40), dtype) for r in range(world)]
        o = torch.empty(16, 40, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(o, ys[rank].to(dev))
        expect(f"reduce_scatter {dtype}", bits(o.cpu()), reduce_scatter_reference(ys, rank))
        zs = [make_input(60 + k, r, (world * 8, 24), dtype) for r in range(world)]
        z = zs[rank].to(dev)
        dist.all_reduce(z)
        expect(f"all_reduce {dtype}", bits(z.cpu()), _all_reduce_reference(zs, world))
        # all_to_all_single of equal blocks, enqueued on a side stream
        adt = (dtype, torch.int8, torch.int64)[k]
        As = [make_input(65 + k, r, (world * 40, 17), adt) for r in range(world)]
        a = torch.empty(world * 40, 17, dtype=adt, device=dev)
        with torch.cuda.stream(side):
            ai = As[rank].to(dev)
            work = dist.all_to_all_single(a, ai, async_op=True)
        work.wait()
        expect(f"all_to_all_single {adt}", bits(a.cpu()), _a2a_reference(As, rank))
    # graph capture: declined, so NCCL is captured and replays correctly
    x = torch.full((256,), float(rank), device=dev)
    out = torch.empty(world * 256, device=dev)
    graph = torch.cuda.CUDAGraph()
    before = dict(pg.declined)
    with torch.cuda.graph(graph):
        dist.all_gather_into_tensor(out, x)
    x.fill_(float(rank + 10))
    graph.replay()
    torch.cuda.synchronize()
    expect("captured all_gather", bits(out.cpu()),
           bits(torch.arange(world, dtype=torch.float32).repeat_interleave(256) + 10))
    captured = pg.declined["CUDA graph capture"] - before.get("CUDA graph capture", 0)
    routed = dict(pg.routed)
    dist.destroy_process_group()
    return dict(bad=bad, captured=captured, routed=routed)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs (one per rank; NCCL is the fallback)")
def test_cuda_backend_bit_exact_async_and_graph_capture():
    world = min(torch.cuda.device_count(), 4)
    values = check(run_ranks(cuda_job, world, timeout_s=300))
    for v in values:
        assert v["bad"] == [], v["bad"]
        assert v["captured"] == 1
        assert v["routed"] == {"all_gather": 3, "reduce_scatter": 3, "all_reduce": 3,
                               "all_to_all": 3}, v["routed"]


def shared_gpu_job(rank, world, store):
    """Every rank on GPU 0 (correctness only): the calls sparkccl takes, on a side stream and
    the default one. Nothing here reaches the NCCL fallback, which refuses two ranks on one
    GPU."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    import sparkccl.integrations.torch_backend as tb_
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("sparkccl", store=store, rank=rank, world_size=world,
                            pg_options=tb_.Options(min_bytes=0))
    pg = dist.group.WORLD
    bad = []
    for k, dtype in enumerate(DTYPES):
        xs = [make_input(70 + k, r, (64, 33), dtype) for r in range(world)]
        out = torch.empty(world * 64, 33, dtype=dtype, device=dev)
        side = torch.cuda.Stream(dev)
        with torch.cuda.stream(side):  # enqueued on a side stream, waited for on the default
            work = dist.all_gather_into_tensor(out, xs[rank].to(dev), async_op=True)
        work.wait()
        if bits(out.cpu()).tolist() != all_gather_reference(xs).tolist():
            bad.append(f"all_gather {dtype}")
        ys = [make_input(80 + k, r, (world * 16, 40), dtype) for r in range(world)]
        o = torch.empty(16, 40, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(o, ys[rank].to(dev))
        if bits(o.cpu()).tolist() != reduce_scatter_reference(ys, rank).tolist():
            bad.append(f"reduce_scatter {dtype}")
        zs = [make_input(90 + k, r, (world * 8, 24), dtype) for r in range(world)]
        z = zs[rank].to(dev)
        dist.all_reduce(z)
        if bits(z.cpu()).tolist() != _all_reduce_reference(zs, world).tolist():
            bad.append(f"all_reduce {dtype}")
        As = [make_input(95 + k, r, (world * 40, 17), dtype) for r in range(world)]
        a = torch.empty(world * 40, 17, dtype=dtype, device=dev)
        dist.all_to_all_single(a, As[rank].to(dev))
        if bits(a.cpu()).tolist() != _a2a_reference(As, rank).tolist():
            bad.append(f"all_to_all_single {dtype}")
    routed = dict(pg.routed)
    dist.destroy_process_group()
    return dict(bad=bad, routed=routed)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_backend_ranks_sharing_one_gpu():
    values = check(run_ranks(shared_gpu_job, 2, timeout_s=300))
    for v in values:
        assert v["bad"] == [], v["bad"]
        assert v["routed"] == {"all_gather": 3, "reduce_scatter": 3, "all_reduce": 3,
                               "all_to_all": 3}, v["routed"]
