"""The CUDA data plane's one-shot all-reduce (sparkccl/dataplane/allreduce_engine.py,
kernels/allreduce.cu), in process on the in-process World of tests/test_cuda_dataplane.py:
the kernels on a GPU (``-m cuda``) or compiled as host C++ (the emulation). Every result is
checked bit for bit against the rank-order reference (sparkccl.reference
.all_reduce_reference), and the bytes after the output stay untouched."""
from __future__ import annotations

import concurrent.futures
import re

import numpy as np
import pytest
import torch

from sparkccl.reference import all_reduce_reference
from test_cuda_dataplane import (BACKENDS, EN, C, Graphs, World, check_ring_tickets,
                                 device_seq, inputs)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GUARD = 5


def all_reduce(w: World, xs, op: str, *, in_place: bool = False):
    """One all-reduce of every rank (CPU inputs); returns (outputs, guard buffers)."""
    seq = w.seq
    w.seq += 1
    outs = []
    for r in range(w.world):
        with w.be.on(r):
            x = w.keep(w.be.to_dev(xs[r]).reshape(-1))
            if in_place:
                w.dps[r].all_reduce_one_shot(seq, x, x, op == "avg")
                outs.append(x)
            else:
                buf = w.keep(w.be.to_dev(torch.full((x.nbytes + GUARD,), 0xAB, dtype=torch.uint8)))
                w.dps[r].all_reduce_one_shot(seq, x, buf[:x.nbytes].view(x.dtype), op == "avg")
                outs.append(buf)
    return outs


def last_piece_timed_out(w: World) -> str:
    """Rank 0 called alone: its synchronize() raises a timeout at the last piece of seq 0
    (a one-hand-off slice is waited for there) from rank 1, naming the connection; the
    message."""
    with pytest.raises(C.CollectiveError) as ei:
        w.dps[0].synchronize()
    msg = str(ei.value)
    assert "timed out" in msg and f"all_reduce seq 0 piece {C.PIECES - 1} from rank 1" in msg, \
        msg
    assert ei.value.peer == 1 and "channel 0 root" in ei.value.connection
    return msg


def different_call_reported(w: World, calls, said) -> None:
    """Ranks 0 and 1 made the different all-reduces ``calls`` (n, dtype, op), said as
    ``said``: each rank's synchronize() names both calls, rank 0's seq 0 first."""
    with pytest.raises(C.CollectiveError, match=re.escape(
            f"rank 0: all_reduce({calls[0][2]}) seq 0: rank 1 made a different call than "
            f"rank 0 (this rank): rank 1 passed {said[1]}, rank 0 passed {said[0]}")):
        w.dps[0].synchronize()
    with pytest.raises(C.CollectiveError, match=re.escape(f"rank 1 passed {said[1]}")):
        w.dps[1].synchronize()


def check(w: World, xs, op: str, outs, what: str = "") -> None:
    ref = all_reduce_reference(xs, op)
    for r, out in enumerate(outs):
        got = out.cpu().reshape(-1).view(torch.uint8).numpy()
        n = ref.size
        assert np.array_equal(got[:n], ref), \
            f"{what} rank {r} {xs[0].dtype} {list(xs[0].shape)} {op}: bytes " \
            f"{np.flatnonzero(got[:n] != ref)[:10]} differ"
        assert (got[n:] == 0xAB).all(), f"{what} rank {r} wrote past its output"


# (topology, world, roots, way): mesh and ring at world 2 and 3, every way: the proxy path
# (False), GPU-direct with flag words (True), GPU-direct with LL lines ("ll": a mesh), LL
# lines through the proxy ("llp": a mesh).
CASES = [("mesh", 2, 2, False), ("mesh", 2, 2, True), ("mesh", 3, 1, True),
         ("ring", 3, 2, False), ("ring", 3, 2, True), ("mesh", 2, 2, "ll"), ("mesh", 3, 1, "ll"),
         ("mesh", 2, 2, "llp"), ("mesh", 3, 2, "llp")]
WAYS = [False, True, "ll", "llp"]
WAY_IDS = ["proxy", "direct", "ll", "llp"]


def world_of(backend, topology, world, roots=2, *, direct, **kw) -> World:
    """The in-process World for a way of CASES / WAYS."""
    return World(backend, topology, world, roots, direct=direct in (True, "ll"),
                 ll=direct in ("ll", "llp"), **kw)


SHAPES = [(1,), (17,), (129, 7), (1000,)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topology,world,roots,direct", CASES)
def test_one_shot_exact(backend, topology, world, roots, direct):
    """bf16 / fp16 / fp32, SUM and AVG, odd sizes (tails, one element), queued back to back
    with one sync: every rank's result is the reference's bits; then in place (out is x);
    then a slice above ONE_HANDOFF_SLICE (summed piece by piece); a shape's second call runs
    from its launch plan."""
    oh = EN.ONE_HANDOFF_SLICE
    big = (oh // 2 + 9,)  # bf16: S = oh + 32 > ONE_HANDOFF_SLICE
    with world_of(backend, topology, world, roots, max_slice=oh + 64, direct=direct) as w:
        pending = []
        seed = 0
        for dtype in DTYPES:
            for shape in SHAPES:
                for op in ("sum", "avg"):
                    seed += 1
                    xs = inputs(seed, world, shape, dtype)
                    pending.append((xs, op, all_reduce(w, xs, op)))
        w.sync()
        for xs, op, outs in pending:
            check(w, xs, op, outs)
        hits = [dp.plans.stats["hits"] for dp in w.dps]
        xs = inputs(99, world, (129, 7), torch.bfloat16)  # (the shape planned above)
        outs = all_reduce(w, xs, "avg")
        w.sync()
        check(w, xs, "avg", outs, "planned")
        assert all(dp.plans.stats["hits"] == h + 1 for dp, h in zip(w.dps, hits))
        for k, dtype in enumerate(DTYPES):
            xs = inputs(200 + k, world, (33, 3), dtype)
            outs = all_reduce(w, xs, "avg", in_place=True)
            w.sync()
            check(w, xs, "avg", [o.view(torch.uint8) for o in outs], "in place")
        xs = inputs(300, world, big, torch.bfloat16)
        outs = all_reduce(w, xs, "sum")
        w.sync()
        check(w, xs, "sum", outs, "above one hand-off")
        assert all(dp.direct_launches > 0 for dp in w.dps) == (direct in (True, "ll"))
        assert all(dp.ll_launches > 0 for dp in w.dps) == (direct in ("ll", "llp"))
        w.healthy()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topology,world,roots,direct", [("mesh", 2, 2, True),
                                                         ("ring", 3, 2, False),
                                                         ("mesh", 3, 2, "ll"),
                                                         ("mesh", 2, 2, "llp")])
def test_one_shot_capture_and_replay(backend, topology, world, roots, direct):
    """One-shot all-reduces (every dtype, both ops, one in place) captured once per rank
    and replayed with fresh inputs written into the captured tensors, an eager all-reduce
    between replays: every output exact, and the device's seq counted every collective."""
    specs = [((4096,), torch.bfloat16, "sum"), ((3, 333), torch.float16, "avg"),
             ((17,), torch.float32, "avg"), ((1000,), torch.bfloat16, "avg")]
    replays = 10 if backend == "cuda" else 4
    with world_of(backend, topology, world, roots, max_slice=1 << 14, direct=direct) as w:
        xs = inputs(1, world, (64,), torch.bfloat16)  # eager first
        outs = all_reduce(w, xs, "sum")
        w.sync()
        check(w, xs, "sum", outs)
        xin = [[w.be.to_dev(torch.zeros(s, dtype=d)) for _ in range(world)] for s, d, _ in specs]
        yout = [[w.be.to_dev(torch.full((x.nbytes + GUARD,), 0xAB, dtype=torch.uint8))
                 for x in row] for row in xin]
        last = len(specs) - 1  # in place

        def issue(r):
            for k, (_, _, op) in enumerate(specs):
                x = xin[k][r].reshape(-1)
                dst = x if k == last else yout[k][r][:x.nbytes].view(x.dtype)
                w.dps[r].all_reduce_one_shot(w.seq + k, x, dst, op == "avg")

        graphs = Graphs(w)
        graphs.capture(issue)
        count = 1
        for it in range(replays):
            vals = [inputs(10 * it + k, world, s, d) for k, (s, d, _) in enumerate(specs)]
            for k in range(len(specs)):
                for r in range(world):
                    with w.be.on(r):
                        xin[k][r].copy_(w.be.to_dev(vals[k][r]))
            graphs.replay()
            count += len(specs)
            ex = inputs(500 + it, world, (77,), torch.float16)
            eo = all_reduce(w, ex, "avg")
            count += 1
            w.sync()
            for k, (_, _, op) in enumerate(specs):
                got = [xin[k][r].view(-1).view(torch.uint8) if k == last else yout[k][r]
                       for r in range(world)]
                check(w, vals[k], op, got, f"replay {it}")
            check(w, ex, "avg", eo, f"eager after replay {it}")
        for r in range(world):
            assert device_seq(w, r) == count, (r, device_seq(w, r), count)
            check_ring_tickets(w, r, count)
        w.healthy()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct", WAYS, ids=WAY_IDS)
def test_one_shot_timeout_names_the_peer_and_poisons(backend, direct):
    """Only rank 0 calls (rank 1 never sends): its wait times out on the GPU clock,
    synchronize() raises CollectiveError naming rank 1 and the connection, the output is
    poisoned (every byte 0xFF: mode poison, the World's default), and the next call raises
    at once."""
    world = 2
    with world_of(backend, "mesh", world, 2, max_slice=4096, timeout_s=0.5,
                  direct=direct) as w:
        xs = inputs(1, world, (100,), torch.bfloat16)
        with w.be.on(0):
            x = w.keep(w.be.to_dev(xs[0]))
            out = w.keep(w.be.to_dev(torch.zeros(100, dtype=torch.bfloat16)))
            w.dps[0].all_reduce_one_shot(0, x, out, False)
        last_piece_timed_out(w)
        w.be.sync()
        assert (out.cpu().view(torch.uint8) == 0xFF).all()
        with pytest.raises(C.CollectiveError):
            with w.be.on(0):
                w.dps[0].all_reduce_one_shot(1, x, out, False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct", WAYS, ids=WAY_IDS)
@pytest.mark.parametrize("calls,said", [
    (((100, torch.bfloat16, "sum"), (100, torch.bfloat16, "avg")),
     ("200 bytes of bfloat16 to all_reduce(sum)", "200 bytes of bfloat16 to all_reduce(avg)")),
    (((5, torch.bfloat16, "sum"), (6, torch.bfloat16, "sum")),
     ("10 bytes of bfloat16 to all_reduce(sum)", "12 bytes of bfloat16 to all_reduce(sum)")),
], ids=["sum-avg", "5v6-bf16"])
def test_one_shot_different_calls_are_reported(backend, direct, calls, said):
    """The one shot's ring entries carry an all-reduce's call word (peer_check.py): a sum
    beside an average of the same bytes, and sizes the 16-byte padding hides, fail every
    rank at synchronize() naming both calls (the padding as comm.py passes it)."""
    from sparkccl.allreduce import zero_bytes
    from sparkccl.dataplane.peer_check import calls_view
    from sparkccl.plan.model import num_flag_words
    world = 2
    with world_of(backend, "mesh", world, max_slice=4096, timeout_s=20, direct=direct) as w:
        for r in range(world):
            w.dps[r].peer_calls = calls_view(w.ctl[r].t, num_flag_words(world))
        for r, (n, dtype, op) in enumerate(calls):
            with w.be.on(r):
                x = w.keep(w.be.to_dev(torch.zeros(n, dtype=dtype)))
                out = w.keep(w.be.to_dev(torch.zeros(n, dtype=dtype)))
                S = -(-x.nbytes // 16) * 16
                w.dps[r].all_reduce_one_shot(0, x, out, op == "avg",
                                             zero_bytes(x.nbytes, S, world, 0, S))
        w.be.sync()
        different_call_reported(w, calls, said)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct", [False, True], ids=["proxy", "direct"])
def test_one_shot_kernel_beside_the_all_gather_way_is_one_call(backend, direct):
    """One rank takes the kernel, the other allreduce.py's all-gather (as where its out
    overlaps x shifted): the same wire and the same call word (comm.py's padding, 5 bf16
    elements: 10 bytes in a 16-byte slice), so no mismatch, and the kernel's sum is exact."""
    from sparkccl.allreduce import zero_bytes
    from sparkccl.dataplane.peer_check import calls_view
    from sparkccl.plan.model import num_flag_words
    from sparkccl.dataplane.peer_check import ALL_REDUCE_SUM
    world, n = 2, 5
    xs = inputs(7, world, (n,), torch.bfloat16)
    L, S = 2 * n, 16
    pad = zero_bytes(L, S, world, 0, S)
    with World(backend, "mesh", world, max_slice=4096, timeout_s=20, direct=direct) as w:
        for r in range(world):
            w.dps[r].peer_calls = calls_view(w.ctl[r].t, num_flag_words(world))
        with w.be.on(0):
            x = w.keep(w.be.to_dev(xs[0]))
            buf = w.keep(w.be.to_dev(torch.full((L + GUARD,), 0xAB, dtype=torch.uint8)))
            w.dps[0].all_reduce_one_shot(0, x, buf[:L].view(torch.bfloat16), False, pad)
        with w.be.on(1):
            x1 = w.keep(w.be.to_dev(xs[1]))
            gathered = w.keep(w.be.to_dev(torch.zeros(world * L, dtype=torch.uint8)))
            w.dps[1].all_gather(0, x1, gathered, 0, L, torch.bfloat16, (ALL_REDUCE_SUM, pad))
        w.sync()
        for dp in w.dps:
            dp.synchronize()  # (compares the calls: equal)
        check(w, xs, "sum", [buf])
        want = torch.cat([x.view(torch.uint8) for x in xs])
        assert torch.equal(gathered.cpu(), want)
        w.healthy()


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_shot_beside_a_two_step_reduce_scatter_is_reported(backend):
    """Ranks on either side of the one-shot threshold: rank 0's one shot of 64 bytes (an AG
    on the wire) meets rank 1's first step of an all-reduce of 80 bytes (an RS of 48-byte
    chunks). Both call words say all_reduce(sum); the sizes differ, and the error names
    both calls (found when the waits for the other op give up, if not before)."""
    from sparkccl.dataplane.peer_check import calls_view
    from sparkccl.plan.model import num_flag_words
    from sparkccl.dataplane.peer_check import ALL_REDUCE_SUM
    world = 2
    with World(backend, "mesh", world, max_slice=4096, timeout_s=1) as w:
        for r in range(world):
            w.dps[r].peer_calls = calls_view(w.ctl[r].t, num_flag_words(world))
        with w.be.on(0):
            x = w.keep(w.be.to_dev(torch.zeros(16, dtype=torch.float32)))
            w.dps[0].all_reduce_one_shot(0, x, w.keep(w.be.to_dev(torch.zeros_like(x))), False,
                                         64)
        with w.be.on(1):
            src = w.keep(w.be.to_dev(torch.zeros(24, dtype=torch.float32)))
            out = w.keep(w.be.to_dev(torch.zeros(12, dtype=torch.float32)))
            w.dps[1].reduce_scatter(0, src, 0, 48, 48, out, 0, torch.float32,
                                    (ALL_REDUCE_SUM, 16))
        for r in range(world):
            with pytest.raises(C.CollectiveError) as ei:
                w.dps[r].synchronize()
            msg = str(ei.value)
            assert "rank 0 passed 64 bytes of float32 to all_reduce(sum)" in msg, msg
            assert "rank 1 passed 80 bytes of float32 to all_reduce(sum)" in msg, msg


@pytest.mark.parametrize("direct", WAYS, ids=WAY_IDS)
def test_one_shot_timeline_stamps_every_step_in_order(direct, monkeypatch):
    """SPARKCCL_GPU_TIMELINE (emulation: the kernels built with SCCL_TIMELINE): every
    one-shot all-reduce stamps each step once, in the order the protocol takes them, and
    a peer's flag is seen only after that peer handed it off; the result stays exact. The
    LL way has no poller (no "seen"): its data blocks and its hand-off block each keep
    their own order, and timeline.steps reads it with its own table."""
    from sparkccl.dataplane import timeline as T
    monkeypatch.setenv("SPARKCCL_GPU_TIMELINE", "1")
    calls = 6
    ll = direct in ("ll", "llp")
    points = [p for p in T.POINTS if not (ll and p == "seen")]
    chains = ((("enter", "stored", "released", "summed", "exit"),
               ("written", "handed", "exit")) if ll else
              (("enter", "stored", "written", "handed", "exit"),
               ("seen", "released", "summed", "exit")))
    table = T.STEPS_LL if ll else T.STEPS
    with world_of("emu", "mesh", 2, 2, max_slice=1 << 14, direct=direct) as w:
        first = w.seq
        pending = []
        for k in range(calls):
            xs = inputs(700 + k, 2, (1000,), torch.bfloat16)
            pending.append((xs, all_reduce(w, xs, "sum")))
        w.sync()
        for xs, outs in pending:
            check(w, xs, "sum", outs)
        per_rank = [T.rows(dp.timeline.cpu().numpy(), first, w.seq - 1) for dp in w.dps]
        for r, mine in enumerate(per_rank):
            assert sorted(mine) == list(range(first, w.seq))
            for s, row in mine.items():
                assert list(row) == points, (r, s, row)
                # (the publish blocks and the wait role's run side by side: own hand-off
                # and the peer's flag come in either order, and block 0, which notes the
                # enter, need not start first)
                for chain in chains:
                    assert [row[p] for p in chain] == sorted(row[p] for p in chain), (r, s, row)
                if not ll:
                    peer = per_rank[1 - r][s]
                    assert row["seen"] >= peer["handed"], (r, s, row, peer)
        steps = T.steps(per_rank)
        assert all(len(v) >= 2 * (calls - 1) for v in steps.values()), steps
        assert [name for name, *_ in T.summary(per_rank)] == [*(n for n, _, _ in table),
                                                              "period"]
        w.healthy()


# ---------------------------------------------------------------- through the Communicator

def _communicators(w: World, oneshot_bytes: int | None = None) -> list:
    """One ``Communicator`` per rank around the World's data planes, as wiring.py would
    build it (what benchmarks/host_python.py does for rank 0)."""
    import threading
    import types

    import sparkccl._native as nat
    from sparkccl.comm import Communicator
    from sparkccl.config import DEFAULT_ALLREDUCE_ONESHOT_BYTES

    comms = []
    for r, dp in enumerate(w.dps):
        c = object.__new__(Communicator)
        c.device, c.world_size, c.rank = w.be.device, w.world, r
        c._closed, c._lock, c._nat = False, threading.Lock(), nat
        c.max_slice, c.seq, c._rs_count, c._handout = w.max_slice, w.seq, 0, None
        c._wiring = types.SimpleNamespace(
            dp=dp, ctl_addr=w.ctl[r].addr, rs_ready=True, ensure_rs=lambda: None,
            settings=types.SimpleNamespace(allreduce_oneshot_bytes=(
                DEFAULT_ALLREDUCE_ONESHOT_BYTES if oneshot_bytes is None else oneshot_bytes)))
        c._calls_ready()
        comms.append(c)
    return comms


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct", [False, True], ids=["proxy", "direct"])
def test_communicator_all_reduce_eager_fast_path(backend, direct, monkeypatch):
    """``Communicator.all_reduce``'s eager fast path (a one-slot all-reduce straight to the
    plane's one-shot operation) gives the reference's bits for every dtype, both ops, a
    0-dim tensor, ``out=`` given, ``out`` = x and no ``out`` (a fresh contiguous tensor of x's
    shape), the one-shot regime forced at any size that fits a slot; a shape's later calls
    replay its launch plan; what the fast path does not take (out partly over x, shifted; an
    op the layers accept in another spelling; the two-step regime, forced or above the
    crossover on every rank) goes through allreduce.all_reduce with the same bits; and bad
    input raises there before anything is sent (no sequence number used)."""
    from sparkccl import allreduce as AR
    from sparkccl import comm as CM

    layered = []
    real = AR.all_reduce

    def counted(*a, **k):
        layered.append(getattr(a[1], "shape", None))
        return real(*a, **k)

    monkeypatch.setattr(CM._allreduce, "all_reduce", counted)
    with World(backend, "mesh", 2, 2, max_slice=1 << 12, direct=direct) as w:
        comms = _communicators(w, oneshot_bytes=1024)
        dev = w.be.to_dev

        def run(xs, op, mode, regime=None, threads=False):
            """Every rank's all-reduce of xs[r]; returns the results (mode: "out", "fresh",
            "in_place", "shifted": out one element further into the same buffer as x; op: one
            for every rank, or each rank's). ``threads``: each rank's call from a thread of
            its own, as ranks of their own processes make them: a call through allreduce.py's
            layers can hold its thread in a torch operation until its collective is done (on
            the H200, CUDA's first launch of a kernel waited for the kernels running in the
            process: rank 0's collective, which waits for rank 1's call)."""
            def one(r, c):
                kw = {"regime": regime} if regime else {}
                with w.be.on(r):
                    op_r = op if isinstance(op, str) else op[r]
                    x = w.keep(dev(xs[r]))
                    if mode == "fresh":
                        y = c.all_reduce(x, op_r, **kw)
                        assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
                    elif mode == "in_place":
                        y = c.all_reduce(x, op_r, out=x, **kw)
                        assert y is x
                    elif mode == "shifted":
                        n = x.numel()
                        buf = w.keep(dev(torch.zeros(n + 1, dtype=x.dtype)))
                        buf[:n].copy_(x)
                        x, out = buf[:n].view(x.shape), buf[1:].view(x.shape)
                        y = c.all_reduce(x, op_r, out=out, **kw)
                        assert y is out
                    else:
                        out = w.keep(dev(torch.full(x.shape, 7, dtype=x.dtype)))
                        y = c.all_reduce(x, op_r, out=out, **kw)
                        assert y is out
                    return w.keep(y)

            if not threads:
                return [one(r, c) for r, c in enumerate(comms)]
            with concurrent.futures.ThreadPoolExecutor(len(comms)) as pool:
                futures = [pool.submit(one, r, c) for r, c in enumerate(comms)]
                return [f.result() for f in futures]

        def expect(xs, op, res, what):
            ref = all_reduce_reference(xs, op)
            for r, y in enumerate(res):
                got = y.cpu().reshape(-1).view(torch.uint8).numpy()
                assert np.array_equal(got, ref), f"{what}: rank {r} {xs[0].dtype} {op}"

        seed = 0
        pending = []
        for dtype in DTYPES:
            for shape in [(), (17,), (3, 33)]:
                for op, mode in [("sum", "out"), ("avg", "fresh"), ("avg", "in_place"),
                                 ("sum", "out")]:  # (the last: the shape's launch plan)
                    seed += 1
                    xs = inputs(seed, 2, shape, dtype)
                    pending.append((xs, op, run(xs, op, mode), f"{list(shape)} {mode}"))
        assert not layered, layered  # all of them on the fast path
        w.sync()
        for xs, op, res, what in pending:
            expect(xs, op, res, what)
        assert all(dp.plans.stats["hits"] > 0 for dp in w.dps)

        # The rest: (shape, mode, each rank's op, regime, calls that took allreduce.py's
        # layers), every result with the reference's bits.
        for k, (shape, mode, ops, regime, layers) in enumerate([
                ((40,), "shifted", ("avg", "avg"), None, 2),
                ((40,), "out", ("avg", "avg"), "one_shot", 0),  # forced one shot: fast too
                ((2000,), "out", ("avg", "avg"), "one_shot", 0),  # ... above the crossover
                # (one call word either way: an op in capitals is for the layers)
                ((24,), "out", ("sum", "SUM"), None, 1),
                ((300,), "out", ("avg", "avg"), None, 0),  # 600 bytes: one shot
                # 1216 bytes: the two-step regime (W chunks of 16-byte multiples: no padding,
                # whose temporaries the emulation would free under the kernel)
                ((608,), "out", ("avg", "avg"), None, 2),
                ((608,), "fresh", ("sum", "sum"), None, 2),
                ((48,), "out", ("sum", "sum"), "two_step", 2)]):  # (48: no padding either)
            if mode == "shifted" and backend != "cuda":
                # (it takes allreduce.py's all-gather into a fresh tensor and torch adds,
                # which the emulation runs on the host at once, not after the emulated
                # stream's kernels: the tensor would be freed under the kernel)
                continue
            xs = inputs(100 + k, 2, shape, torch.bfloat16)
            before = len(layered)
            res = run(xs, ops, mode, regime, threads=backend == "cuda")
            w.sync()
            expect(xs, ops[0].lower(), res, f"{list(shape)} {mode} {ops} {regime}")
            assert len(layered) - before == layers, (shape, mode, ops, regime, layered)

        # Bad input: refused on the calling rank before anything is sent.
        c = comms[0]
        x = dev(torch.ones(8, dtype=torch.bfloat16))
        seqs = (c.seq, w.dps[0].plans.stats["hits"])
        with w.be.on(0):
            for kw, err, said in [
                    ({"out": dev(torch.ones(8, dtype=torch.float16))}, ValueError, "out must"),
                    ({"out": dev(torch.ones(9, dtype=torch.bfloat16))}, ValueError, "out must"),
                    ({"out": dev(torch.ones(16, dtype=torch.bfloat16))[::2]}, ValueError,
                     "contiguous"),
                    ({"op": "max"}, ValueError, "'sum' or 'avg'"),
                    ({"op": 3}, TypeError, "op must be a str"),
                    ({"regime": "bogus"}, ValueError, "regime="),
                    ({"x": dev(torch.ones(16, dtype=torch.bfloat16))[::2]}, ValueError,
                     "contiguous"),
                    ({"x": dev(torch.ones(8, dtype=torch.int32))}, TypeError, "not supported"),
                    ({"x": [1.0]}, TypeError, "torch.Tensor")]:
                kw = dict(kw)
                with pytest.raises(err, match=re.escape(said)):
                    c.all_reduce(kw.pop("x", x), kw.pop("op", "sum"), **kw)
        assert (c.seq, w.dps[0].plans.stats["hits"]) == seqs
        w.healthy()


@pytest.mark.parametrize("direct", WAYS, ids=WAY_IDS)
def test_one_shot_kernel_asks_for_the_early_launch(direct, monkeypatch):
    """The one shot's kernel, and no other, is launched with launch_struct(early=True) (the
    device seam then uses programmatic dependent launch where it can: sm_90+ and
    SPARKCCL_LAUNCH_EARLY; the kernel waits for the grid before it first thing, common.cuh
    wait_previous_grid); the result stays exact."""
    from test_cuda_dataplane import check_ag

    from sparkccl.dataplane.device import Device
    asked = []
    plain = Device.launch_struct

    def spy(self, stream, name, grid, block, words, early=False):
        asked.append((name, early))
        plain(self, stream, name, grid, block, words, early)

    monkeypatch.setattr(Device, "launch_struct", spy)
    with world_of("emu", "mesh", 2, 2, max_slice=1 << 14, direct=direct) as w:
        xs = inputs(901, 2, (1000,), torch.bfloat16)
        outs = all_reduce(w, xs, "sum")
        ys = inputs(902, 2, (1000,), torch.bfloat16)
        gathered = w.all_gather(ys)  # (another collective: launched plainly)
        w.sync()
        check(w, xs, "sum", outs)
        check_ag(w, ys, gathered)
        w.healthy()
    ar = {e for n, e in asked if n.startswith("sccl_allreduce_")}
    others = {e for n, e in asked if not n.startswith("sccl_allreduce_")}
    assert ar == {True}, asked
    assert others == {False}, asked
