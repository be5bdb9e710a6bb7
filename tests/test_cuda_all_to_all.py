"""The CUDA data plane's all-to-all (cuda.py all_to_all, cuda_calls.all_to_all): the
reduce-scatter's wire, each source's chunk copied out where the reduce-scatter sums
(docs/PROTOCOL.md "All-to-all"), on every engine a rank may pick: the proxy path, and
GPU-direct "fused", "split" and "ce". In process on the World of tests/test_cuda_dataplane.py
(the kernels on a GPU, ``-m cuda``, or compiled as host C++: the emulation), and end to end
through Communicators sharing one GPU (``-m cuda``). Every result is checked bit for bit
against an independent reference (rank r's block i is rank i's chunk r), and the bytes
around the output stay untouched."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from sparkccl.errors import CollectiveError
from sparkccl.plan.model import num_flag_words
from sparkccl.reference import all_gather_reference, reduce_scatter_reference
from test_cuda_dataplane import (BACKENDS, CXX, EN, HAVE_GPU, L, N, Graphs, World,
                                 _skip_trapping_ce, check_ag, check_rs, device_seq, inputs)

GUARD = 5
ENGINES = [None, "fused", "split", "ce"]  # None: the proxy path
ONE_HANDOFF = EN.ONE_HANDOFF_SLICE  # above it, a slice is copied out piece by piece


def reference(xs, r: int) -> np.ndarray:
    """Rank r's all-to-all result: chunk r of every rank's input, in rank order."""
    W = len(xs)
    out = []
    for x in xs:
        b = x.contiguous().reshape(-1).view(torch.uint8).numpy()
        n = b.size // W
        out.append(b[r * n:(r + 1) * n])
    return np.concatenate(out)


def all_to_all(w: World, xs, *, out_offset: int = 0, sized: bool = False):
    """One all-to-all of every rank (CPU inputs ``[W * m, ...]``); returns the output
    buffers (``out_offset`` bytes of 0xAB, the W blocks, GUARD bytes of 0xAB)."""
    W = w.world
    n = xs[0].numel() * xs[0].element_size()
    chunk = n // W
    assert chunk <= w.max_slice
    seq = w.seq
    w.seq += 1
    outs = []
    for r in range(W):
        with w.be.on(r):
            src = w.keep(w.be.to_dev(xs[r]).reshape(-1).view(torch.uint8))
            buf = w.keep(w.be.to_dev(torch.full((out_offset + n + GUARD,), 0xAB,
                                                dtype=torch.uint8)))
            w.dps[r].all_to_all(seq, src, 0, chunk, chunk, buf, out_offset, chunk, xs[r].dtype,
                                sized=sized)
        outs.append(buf)
    return outs


def check_a2a(w: World, xs, outs, out_offset: int = 0, what: str = "") -> None:
    n = xs[0].numel() * xs[0].element_size()
    for r, buf in enumerate(outs):
        got = buf.cpu().numpy()
        ref = reference(xs, r)
        body = got[out_offset:out_offset + n]
        assert np.array_equal(body, ref), \
            f"{what} all_to_all rank {r} {xs[0].dtype} {list(xs[0].shape)}: bytes " \
            f"{np.flatnonzero(body != ref)[:10]} differ"
        assert (got[:out_offset] == 0xAB).all() and (got[out_offset + n:] == 0xAB).all(), \
            f"{what} all_to_all rank {r} wrote outside its output"


# (topology, world, roots): mesh and ring at world 2 and 4 (one root: a source's piece in
# one word, two: in two parts); rings of 3 and 4 relay through peers.
CONFIGS = [("mesh", 2, 2), ("ring", 2, 2), ("mesh", 4, 2), ("ring", 4, 2), ("ring", 3, 2),
           ("mesh", 4, 1), ("ring", 4, 1)]
# (rows per chunk, row shape, dtype): a chunk of 1 byte, odd sizes, every width
CASES = [(1, (), torch.uint8), (3, (5,), torch.bfloat16), (2, (3,), torch.int64),
         (7, (129,), torch.float32), (1, (16,), torch.uint8), (100, (41,), torch.bfloat16),
         (37, (), torch.float32)]


def _cases(backend: str) -> list:
    # a chunk above the one-hand-off slice: copied out piece by piece, word by word
    cases = [*CASES, (ONE_HANDOFF // 4 + 12, (), torch.float32)]
    if backend == "cuda":
        cases += [(1 << 10, (512,), torch.bfloat16), (3 << 18, (), torch.float32),
                  ((1 << 20) + 3, (), torch.uint8), (1 << 17, (), torch.int64)]
    return cases


def _max_slice(world: int, cases) -> int:
    return max(4096, max(m * int(np.prod(row)) * d.itemsize for m, row, d in cases))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ENGINES, ids=["proxy", "fused", "split", "ce"])
@pytest.mark.parametrize("topology,world,roots", CONFIGS)
def test_all_to_all_exact(backend, topology, world, roots, mode):
    """Every case twice (the second from the shape's launch plan, with fresh pointers; mode
    split never plans), each followed by a reduce-scatter and an all-gather (the slots'
    parities move under it), one at an odd output offset: every byte exact."""
    cases = _cases(backend)
    with World(backend, topology, world, roots, max_slice=_max_slice(world, cases),
               direct=mode is not None, mode=mode) as w:
        pending = []
        for k, (m, row, dtype) in enumerate(cases):
            for again in range(2):
                xs = inputs(300 + 2 * k + again, world, (world * m, *row), dtype)
                off = 3 if k == 1 and again else 0
                pending.append((check_a2a, xs, all_to_all(w, xs, out_offset=off), off))
                rs = inputs(400 + k, world, (world * 24,), torch.bfloat16)
                pending.append((check_rs, rs, w.reduce_scatter(rs), 0))
                ag = inputs(500 + k, world, (33 + k,), torch.uint8)
                pending.append((check_ag, ag, w.all_gather(ag), 0))
            if backend == "emu" or k % 3 == 2:
                w.sync()
                for check, xs, outs, off in pending:
                    check(w, xs, outs, off)
                pending.clear()
        w.sync()
        for check, xs, outs, off in pending:
            check(w, xs, outs, off)
        if mode in (None, "fused", "ce"):
            for dp in w.dps:
                assert dp.plans.stats["hits"] >= len(cases), dp.plans.stats
        w.healthy()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ENGINES, ids=["proxy", "fused", "split", "ce"])
@pytest.mark.parametrize("topology,world,roots", [("mesh", 2, 2), ("mesh", 4, 1), ("ring", 3, 2),
                                                  ("ring", 4, 2)])
def test_sized_all_to_all(backend, topology, world, roots, mode):
    """A sized all-to-all (each chunk's first 8 bytes say its length; call word
    KIND_ALL_TO_ALL_SIZED): on every engine each source's bytes up to its length arrive
    exact (past it they are undefined), for a one-hand-off chunk and one copied out piece by
    piece, lengths from below 8 to past the chunk; nothing outside the output is written;
    on the proxy path of a mesh the proxies post exactly those bytes (rounded up to 16).
    The same shape unsized right after (its own launch plan) still moves every byte."""
    from sparkccl.plan.geometry import ALIGN, round_up, sized_bytes
    cases = [(ONE_HANDOFF // 2 // 4, torch.float32), (ONE_HANDOFF // 4 + 12, torch.float32)]
    with World(backend, topology, world, roots, max_slice=_max_slice(world, [
            (m, (), d) for m, d in cases]), direct=mode is not None, mode=mode) as w:
        for k, (m, dtype) in enumerate(cases):
            chunk = m * 4
            g = torch.Generator().manual_seed(k)
            heads = torch.randint(0, chunk + 40, (world, world), generator=g)
            heads[0, :] = torch.tensor([3, chunk // 3, chunk + 7, 0][:world] +
                                       [100] * max(0, world - 4))
            xs = inputs(700 + k, world, (world * m,), dtype)
            for i in range(world):
                b = xs[i].view(torch.uint8).view(world, chunk)
                for j in range(world):
                    b[j, :8] = torch.tensor([int(heads[i, j])]).view(torch.uint8)
            before = [p.stats()["bytes"] for p in w.proxies]
            outs = all_to_all(w, xs, out_offset=3 * k, sized=True)
            w.sync()
            for r, buf in enumerate(outs):
                got = buf.cpu().numpy()
                want = reference(xs, r).reshape(world, chunk)
                body = got[3 * k:3 * k + world * chunk].reshape(world, chunk)
                for i in range(world):
                    n = sized_bytes(int(heads[i, r]), chunk)
                    assert np.array_equal(body[i, :n], want[i, :n]), \
                        f"{mode} rank {r} source {i}: first {n} bytes (head {heads[i, r]}) differ"
                assert (got[:3 * k] == 0xAB).all() and (got[3 * k + world * chunk:] == 0xAB).all()
            if mode is None and topology == "mesh":
                deadline = time.monotonic() + 10
                S = round_up(chunk, ALIGN)
                for r, p in enumerate(w.proxies):
                    want_bytes = sum(sized_bytes(int(heads[r, j]), S) for j in range(world)
                                     if j != r)
                    while p.stats()["bytes"] - before[r] < want_bytes and \
                            time.monotonic() < deadline:
                        time.sleep(0.001)
                    time.sleep(0.01)
                    assert p.stats()["bytes"] - before[r] == want_bytes, (r, k)
            xs2 = inputs(800 + k, world, (world * m,), dtype)
            outs = all_to_all(w, xs2)
            w.sync()
            check_a2a(w, xs2, outs)
        w.healthy()


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
@pytest.mark.parametrize("mode", ENGINES, ids=["proxy", "fused", "split", "ce"])
@pytest.mark.parametrize("topology,world,roots", [("mesh", 4, 1), ("ring", 4, 2)])
def test_sized_all_to_all_past_the_lengths_in_shared_memory(monkeypatch, topology, world,
                                                             roots, mode):
    """The kernels keep the first SIZED_CHUNKS chunks' lengths in shared memory (read once
    per block); built with 2 (the emulation), the chunks and sources past them take the
    other way (the publish reads a length where it uses it, the copy-out copies such a
    source whole): test_sized_all_to_all's checks still hold at world 4."""
    import test_cuda_dataplane
    monkeypatch.setattr(test_cuda_dataplane, "EMU_DEFINES", ("-DSIZED_CHUNKS=2",))
    test_sized_all_to_all("emu", topology, world, roots, mode)


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
@pytest.mark.parametrize("mode", ENGINES, ids=["proxy", "fused", "split", "ce"])
def test_all_to_all_launches_the_all_gathers_consumer(mode):
    """No reduce-scatter kernel runs (nothing is summed or staged): the proxy path launches
    sccl_ag_proxy, "fused" and "split" sccl_ag_direct (mode ce: copy rows only); the host
    names the call all_to_all."""
    world = 2
    with World("emu", "mesh", world, max_slice=4096, direct=mode is not None, mode=mode) as w:
        launched = []
        for dp in w.dps:
            orig = dp.gpu.launch_struct

            def spy(stream, name, grid, block, words, early=False, orig=orig):
                launched.append(name)
                return orig(stream, name, grid, block, words, early)
            dp.gpu.launch_struct = spy
        xs = inputs(1, world, (world * 40,), torch.int64)
        outs = all_to_all(w, xs)
        w.sync()
        check_a2a(w, xs, outs)
        names = set(launched) | set(getattr(w.dps[0].gpu, "emu_launched", ()))
        assert not any(n.startswith("sccl_rs_") for n in names), names
        if mode is None:
            assert "sccl_ag_proxy" in names, names
        elif mode in ("fused", "split"):
            assert "sccl_ag_direct" in names, names
        assert w.dps[0].name_of(0) == "all_to_all"
        w.healthy()


# ---------------------------------------------------------------- CUDA graphs

def _graph_specs(world: int, big: bool) -> list:
    W = world
    specs = [("a2a", (W * 5,), torch.uint8), ("rs", (W * 48,), torch.float32),
             ("a2a", (W * 33, 7), torch.bfloat16), ("ag", (100,), torch.uint8),
             ("a2a", (W * 3,), torch.int64), ("a2a", (W * 1000,), torch.float32)]
    if big:
        specs += [("a2a", (W * (1 << 18),), torch.float32), ("rs", (W * (1 << 18),), torch.bfloat16)]
    return specs


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape)) * dtype.itemsize


GRAPH_RUNS = [pytest.param(b.values[0], m, marks=b.marks, id=f"{b.values[0]}-{m}")
              for b in BACKENDS for m in (None, "fused", "split", "ce")
              if b.values[0] == "cuda" or m in (None, "fused")]


@pytest.mark.parametrize("backend,mode", GRAPH_RUNS)
@pytest.mark.parametrize("topology,world,roots", [("mesh", 2, 2), ("ring", 4, 2),
                                                  ("ring", 3, 2)])
def test_all_to_all_graph_replay_interleaved_with_eager(backend, topology, world, roots, mode):
    """Captured all-to-alls among reduce-scatters and all-gathers, replayed with fresh
    inputs written into the captured input tensors, eager all-to-alls and reduce-scatters
    between replays: every output exact, the device's seq counted every collective. (The
    emulated capture records launches only: modes split and ce are captured on the GPU.)"""
    specs = _graph_specs(world, backend == "cuda")
    max_slice = max(max(_nbytes(s, d) // (1 if k == "ag" else world) for k, s, d in specs), 4096)
    replays = 10 if backend == "cuda" else 4
    with World(backend, topology, world, roots, max_slice=max_slice, direct=mode is not None,
               mode=mode) as w:
        xs = inputs(1, world, (world * 64,), torch.bfloat16)  # eager first (scratch, streams)
        eo = all_to_all(w, xs)
        w.sync()
        check_a2a(w, xs, eo)
        inp = [[w.be.to_dev(torch.zeros(s, dtype=d)) for _ in range(world)] for _, s, d in specs]
        out = [[w.be.to_dev(torch.full(((_nbytes(s, d) * (world if k == "ag" else 1)
                                         // (world if k == "rs" else 1)) + GUARD,), 0xAB,
                                       dtype=torch.uint8)) for _ in range(world)]
               for k, s, d in specs]

        def issue(r: int) -> None:
            for k, (kind, shape, dtype) in enumerate(specs):
                src = inp[k][r].reshape(-1).view(torch.uint8)
                n = src.numel()
                dp = w.dps[r]
                if kind == "a2a":
                    dp.all_to_all(w.seq + k, src, 0, n // world, n // world, out[k][r], 0,
                                  n // world, dtype)
                elif kind == "rs":
                    dp.reduce_scatter(w.seq + k, src, 0, n // world, n // world, out[k][r], 0,
                                      dtype)
                else:
                    dp.all_gather(w.seq + k, src, out[k][r], 0, n)

        graphs = Graphs(w)
        graphs.capture(issue)
        count = 1
        for it in range(replays):
            xs_g = []
            for k, (_, shape, dtype) in enumerate(specs):
                xs_g.append(inputs(1000 * it + k, world, shape, dtype))
                for r in range(world):
                    with w.be.on(r):
                        inp[k][r].copy_(w.be.to_dev(xs_g[k][r]))
            graphs.replay()
            count += len(specs)
            eager = []
            if it % 2 == 0:  # eager calls queued behind the replay (the World's seq labels)
                ex = inputs(5000 + it, world, (world * 40, 3), torch.float32)
                eager.append((check_a2a, ex, all_to_all(w, ex)))
                ey = inputs(6000 + it, world, (world * 40,), torch.bfloat16)
                eager.append((check_rs, ey, w.reduce_scatter(ey)))
                count += 2
            w.sync()
            for k, (kind, shape, dtype) in enumerate(specs):
                for r in range(world):
                    got = out[k][r].cpu().numpy()
                    ref = (reference(xs_g[k], r) if kind == "a2a" else
                           reduce_scatter_reference(xs_g[k], r) if kind == "rs" else
                           all_gather_reference(xs_g[k]))
                    assert np.array_equal(got[:-GUARD], ref), \
                        f"replay {it}: {kind} {list(shape)} {dtype} rank {r}: " \
                        f"{np.flatnonzero(got[:-GUARD] != ref)[:10]}"
                    assert (got[-GUARD:] == 0xAB).all(), f"replay {it}: {kind} rank {r} wrote past"
            for check, xs_e, outs in eager:
                check(w, xs_e, outs)
        for r in range(world):
            assert device_seq(w, r) == count, (r, device_seq(w, r), count)
        w.healthy()


# ---------------------------------------------------------------- failure

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ENGINES, ids=["proxy", "fused", "split", "ce"])
def test_all_to_all_timeout_names_the_peer_and_poisons(backend, mode):
    """Rank 0 calls alone: its synchronize() raises a timeout naming the all-to-all, the
    piece and rank 1; in mode poison every block of the output (its own too) reads 0xFF."""
    _skip_trapping_ce(backend, mode)
    world = 2
    with World(backend, "mesh", world, max_slice=4096, timeout_s=0.5, direct=mode is not None,
               mode=mode) as w:
        xs = inputs(2, world, (world * 50,), torch.bfloat16)
        with w.be.on(0):
            src = w.keep(w.be.to_dev(xs[0]).view(torch.uint8))
            out = w.keep(w.be.to_dev(torch.zeros(world * 100, dtype=torch.uint8)))
        w.be.sync()
        t0 = time.monotonic()
        with w.be.on(0):
            w.dps[0].all_to_all(0, src, 0, 100, 100, out, 0, 100, torch.bfloat16)
        with pytest.raises(CollectiveError) as ei:
            w.dps[0].synchronize()
        msg = str(ei.value)
        assert "timed out" in msg and "all_to_all seq 0 piece" in msg and "from rank 1" in msg, \
            msg
        assert ei.value.peer == 1
        assert time.monotonic() - t0 < 0.5 + 10.0
        assert N.abort_code(w.ctl[0].addr) == L.ABORT_TIMEOUT
        if w.dps[0].on_failure == "poison":
            w.be.streams[0].synchronize()
            assert bytes(out.cpu().numpy()) == b"\xff" * out.numel()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct", [False, True], ids=["proxy", "fused"])
def test_all_to_all_beside_a_reduce_scatter_is_reported(backend, direct):
    """Rank 0's all-to-all and rank 1's reduce-scatter of the same bytes and dtype are one
    wire, but not one call: every rank raises at synchronize(), naming both."""
    from sparkccl.dataplane.peer_check import calls_view
    world = 2
    with World(backend, "mesh", world, max_slice=4096, timeout_s=20, direct=direct) as w:
        for r in range(world):
            w.dps[r].peer_calls = calls_view(w.ctl[r].t, num_flag_words(world))
        for r in range(world):
            with w.be.on(r):
                src = w.keep(w.be.to_dev(torch.zeros(world * 5, dtype=torch.bfloat16)))
                out = w.keep(w.be.to_dev(torch.zeros(world * 10, dtype=torch.uint8)))
                if r == 0:
                    w.dps[r].all_to_all(0, src.view(torch.uint8), 0, 10, 10, out, 0, 10,
                                        torch.bfloat16)
                else:
                    w.dps[r].reduce_scatter(0, src.view(torch.uint8), 0, 10, 10, out, 0,
                                            torch.bfloat16)
        w.be.sync()
        want = ("rank 1 passed 10 bytes of bfloat16 per rank to reduce_scatter, rank 0 passed "
                "10 bytes of bfloat16 per rank to all_to_all")
        with pytest.raises(CollectiveError, match="rank 0: all_to_all seq 0: rank 1 made a "
                           "different call than rank 0 \\(this rank\\): " + want):
            w.dps[0].synchronize()
        with pytest.raises(CollectiveError, match="made a different call"):
            w.dps[1].synchronize()


# ---------------------------------------------------------------- Communicators on one GPU

def _comm_a2a_job(rank, world, store, topology, slot_bytes, replays):
    """Communicator.all_to_all on CUDA tensors: 1 byte to several MiB per block (a block
    over the slot is several collectives), uint8 / bf16 / fp32 / int64, eager, interleaved
    with reduce_scatter and all_gather, then captured in a torch.cuda.CUDAGraph with them
    and replayed with fresh inputs (eager calls between replays): every result exact."""
    import torch as T
    import torch.distributed as dist

    import sparkccl
    from sparkccl.reference import all_gather_reference as agr
    from sparkccl.reference import bits as B
    from sparkccl.reference import make_input as mk
    from sparkccl.reference import reduce_scatter_reference as rsr
    T.cuda.set_device(rank % T.cuda.device_count())
    W, bad = world, []

    def ref(xs):
        m = xs[0].shape[0] // W
        return np.concatenate([B(x[rank * m:(rank + 1) * m]) for x in xs])

    cases = [(1, (), T.uint8), (3, (5,), T.bfloat16), (2, (3,), T.int64), (7, (129,), T.float32),
             (100, (257,), T.bfloat16), (1 << 10, (512,), T.bfloat16),
             ((1 << 20) + 3, (), T.uint8), (3 << 18, (), T.float32), (1 << 17, (3,), T.int64)]
    kw = dict(rank=rank, world_size=W, topology=topology, slot_bytes=slot_bytes, timeout_s=60)
    with sparkccl.Communicator(store=dist.PrefixStore("a2a", store), device="cuda", **kw) as g:
        seed = 0
        for m, row, dtype in cases:
            seed += 1
            xs = [mk(seed, i, (W * m, *row), dtype) for i in range(W)]
            for out in (None, T.empty((W * m, *row), dtype=dtype, device="cuda")):
                y = g.all_to_all(xs[rank].cuda(), out=out)
                if not (y.is_cuda and y.shape == xs[rank].shape and y.dtype == dtype):
                    bad.append(f"all_to_all {dtype} [{W}*{m}, {row}]: shape/dtype/device")
                if not (B(y.cpu()) == ref(xs)).all():
                    bad.append(f"all_to_all {dtype} [{W}*{m}, {row}] differs")
            rs = [mk(seed + 500, i, (W * 40, 3), T.float32) for i in range(W)]
            if not (B(g.reduce_scatter(rs[rank].cuda()).cpu()) == rsr(rs, rank)).all():
                bad.append(f"reduce_scatter after all_to_all {dtype} differs")
            ag = [mk(seed + 700, i, (77,), T.uint8) for i in range(W)]
            if not (B(g.all_gather(ag[rank].cuda()).cpu()) == agr(ag)).all():
                bad.append(f"all_gather after all_to_all {dtype} differs")
        g.synchronize()
        # CUDA graph: all-to-alls among the other collectives, replayed with new inputs.
        specs = [("a2a", (W * 5,), T.uint8), ("rs", (W * 48,), T.float32),
                 ("a2a", (W * 1024, 64), T.bfloat16), ("ag", (100,), T.uint8),
                 ("a2a", (W * (1 << 18),), T.float32), ("a2a", (W * 3,), T.int64)]
        xin = [T.zeros(s, dtype=d, device="cuda") for _, s, d in specs]

        def step():
            return [g.all_to_all(x) if k == "a2a" else g.reduce_scatter(x) if k == "rs"
                    else g.all_gather(x) for (k, _, _), x in zip(specs, xin)]

        step()
        g.synchronize()
        graph = T.cuda.CUDAGraph()
        with T.cuda.graph(graph):
            outs = step()
        for it in range(replays):
            xs = [[mk(100 * it + k, i, s, d) for i in range(W)]
                  for k, (_, s, d) in enumerate(specs)]
            for x, v in zip(xin, xs):
                x.copy_(v[rank])
            graph.replay()
            if it % 2 == 0:
                ex = [mk(9000 + it, i, (W * 333, 3), T.bfloat16) for i in range(W)]
                eo = g.all_to_all(ex[rank].cuda())
            g.synchronize()
            for k, (kind, shape, dtype) in enumerate(specs):
                want = (ref(xs[k]) if kind == "a2a" else rsr(xs[k], rank) if kind == "rs"
                        else agr(xs[k]))
                if not (B(outs[k].cpu()) == want).all():
                    bad.append(f"replay {it}: {kind} {list(shape)} {dtype} differs")
            if it % 2 == 0 and not (B(eo.cpu()) == ref(ex)).all():
                bad.append(f"eager all_to_all after replay {it} differs")
        g.synchronize()
    return bad


ENVS = {"direct": {}, "proxy": {"SPARKCCL_GPU_DIRECT": "0"},
        "ce": {"SPARKCCL_DIRECT_MODE": "ce"}, "split": {"SPARKCCL_DIRECT_MODE": "split"}}
# (topology, world, slot bytes, engines): every config on GPU-direct and the proxy path,
# modes ce and split on two of them; a small slot splits a block into several collectives.
COMM_RUNS = [pytest.param(t, w, s, e, id=f"{t}-{w}-{s >> 10}k-{e}")
             for t, w, s, engines in [
                 ("mesh", 2, 8 << 20, ("direct", "proxy", "ce", "split")),
                 ("ring", 2, 8 << 20, ("direct", "proxy")),
                 ("mesh", 4, 8 << 20, ("direct", "proxy")),
                 ("ring", 4, 8 << 20, ("direct", "proxy")),
                 ("ring", 4, 256 << 10, ("direct", "proxy", "ce", "split")),
                 ("mesh", 2, 256 << 10, ("direct", "proxy"))]
             for e in engines]


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
@pytest.mark.parametrize("topology,world,slot_bytes,engine", COMM_RUNS)
def test_communicator_cuda_all_to_all(topology, world, slot_bytes, engine):
    from sparkccl.localrun import check, run_ranks
    values = check(run_ranks(_comm_a2a_job, world, args=(topology, slot_bytes, 6),
                             env=ENVS[engine], timeout_s=600))
    bad = [f"rank {r}: {b}" for r, v in enumerate(values) for b in v]
    assert not bad, "\n".join(bad)
