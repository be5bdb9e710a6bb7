"""The CUDA data plane's two-step all-reduce as one operation (``CudaDataPlane.all_reduce``,
allreduce_engine.py TwoStepEngine, kernels/allreduce_fused.cu), the proxy path, in process on
the World of tests/test_cuda_dataplane.py: the kernels on a GPU (``-m cuda``) or compiled as
host C++ (the emulation). Calls are issued as ``Communicator._fused_all_reduce`` issues
them (the input padded with zeros to W chunks of a multiple of 16 bytes; in the zero-copy
send slot, or from the input a slot-sized slice per collective). Every result is checked bit
for bit against the rank-order reference (sparkccl.reference.all_reduce_reference), the
padding's sums are zero and the bytes after the output untouched; and every collective is
shown to be the fused one: one seq, 8 ring entries of op RS then 8 of op AG under it, with
the CPU twin's call words."""
from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest
import torch

from sparkccl import layout as L
from sparkccl.allreduce import padded, zero_bytes
from sparkccl.dataplane.peer_check import (ALL_REDUCE_AVG, ALL_REDUCE_SUM, calls_view,
                                           call_word)
from sparkccl.plan.geometry import PIECES
from sparkccl.plan.model import Op, num_flag_words
from sparkccl.reference import all_reduce_reference
from test_cuda_dataplane import BACKENDS, CXX, EN, C, N, Graphs, World, device_seq, inputs
from test_cuda_allreduce import different_call_reported, last_piece_timed_out

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GUARD = 5


def issue_rank(w: World, r: int, seq0: int, x, res, op: str, one: bool) -> int:
    """Rank r's collectives of one fused all-reduce of its device input ``x`` into ``res``
    (``x`` padded: may be ``x``), issued as comm.py's _fused_all_reduce does: the zero-copy
    send slot when ``one``, else from the input, a slot-sized slice per collective. Returns
    the number of collectives (seqs) it took."""
    dp, W, dtype = w.dps[r], w.world, x.dtype
    n, esize = x.numel(), x.element_size()
    total, chunk = padded(n, W, dtype)
    avg = op == "avg"
    if one:
        base = (seq0 % 2) * dp.rs_send_stride
        slot = dp.rs_send[base:base + total * esize].view(dtype)
        slot[:n].copy_(x)
        slot[n:].zero_()
        dp.all_reduce(seq0, None, 0, chunk, chunk, res, 0, chunk, dtype, avg,
                      zero_bytes(n * esize, chunk, W, 0, chunk))
        return 1
    src = x
    if total > n:
        src = w.keep(torch.zeros(total, dtype=dtype, device=x.device))
        src[:n].copy_(x)
    offs = range(0, chunk, w.max_slice)
    for k, off in enumerate(offs):
        ln = min(w.max_slice, chunk - off)
        dp.all_reduce(seq0 + k, src, off, chunk, ln, res, off, chunk, dtype, avg,
                      zero_bytes(n * esize, chunk, W, off, ln))
    return len(offs)


def output(w: World, x):
    """A result buffer for ``x`` (padded, then GUARD bytes of 0xAB) and its typed view."""
    total = padded(x.numel(), w.world, x.dtype)[0] * x.element_size()
    out = w.keep(w.be.to_dev(torch.full((total + GUARD,), 0xAB, dtype=torch.uint8)))
    return out, out[:total].view(x.dtype)


def fused(w: World, xs, op: str, *, zero_copy: bool = True, in_place: bool = False):
    """One fused all-reduce of every rank (CPU inputs ``xs``); returns (outputs, (first
    seq, collectives))."""
    W, dtype = w.world, xs[0].dtype
    chunk = padded(xs[0].numel(), W, dtype)[1]
    one = zero_copy and chunk <= w.max_slice
    if one and w.be.name == "emu":
        w.be.sync()  # (the emulation writes the slot from the host, outside stream order)
    seq0 = w.seq
    outs = []
    for r in range(W):
        with w.be.on(r):
            x = w.keep(w.be.to_dev(xs[r]).reshape(-1))
            out, res = (x, x) if in_place else output(w, x)
            count = issue_rank(w, r, seq0, x, res, op, one)
        outs.append(out)
    w.seq += count
    return outs, (seq0, count)


def check(xs, op: str, outs, what: str = "", in_place: bool = False) -> None:
    ref = all_reduce_reference(xs, op)
    n = ref.size
    W = len(xs)
    total = padded(xs[0].numel(), W, xs[0].dtype)[0] * xs[0].element_size()
    for r, out in enumerate(outs):
        got = out.cpu().reshape(-1).view(torch.uint8).numpy()
        assert np.array_equal(got[:n], ref), \
            f"{what} rank {r} {xs[0].dtype} {list(xs[0].shape)} {op}: bytes " \
            f"{np.flatnonzero(got[:n] != ref)[:10]} differ"
        if not in_place:
            assert (got[n:total] == 0).all(), f"{what} rank {r}: the padding's sums are not 0"
            assert (got[total:] == 0xAB).all(), f"{what} rank {r} wrote past its output"


def ring_entries(w: World, r: int, seq: int) -> list:
    """(op, piece, chunk, slice, call word) of every entry of rank r's publish ring with
    this seq (the ring keeps the last 256 entries)."""
    words = np.frombuffer((ctypes.c_uint64 * (L.RING_ENTRIES * L.RING_ENTRY_BYTES // 8))
                          .from_address(w.ctl[r].addr + L.RING_OFFSET), dtype=np.uint64)
    found = []
    for e in words.reshape(L.RING_ENTRIES, -1):
        if int(e[L.ENT_TAG // 8]) and int(e[L.ENT_SEQ // 8]) == seq:
            call = int(e[L.ENT_OP // 8])
            chunk = int(e[L.ENT_CHUNK // 8]) & 0xFFFFFFFF
            found.append((call & 0xFF, call >> L.CALL_PIECE_SHIFT & 0xFF,
                          chunk - (1 << 32) if chunk >> 31 else chunk,
                          int(e[L.ENT_SLICE // 8]), call))
    return sorted(found)


def check_fused_entries(w: World, xs, op: str, seqs, direct: bool = False) -> None:
    """Each collective of the call took one seq and published 8 RS then 8 AG entries (chunk
    -1: the proxy sends; -2: GPU-direct, the kernel sent them), with the call words the CPU
    twin writes."""
    W, dtype = w.world, xs[0].dtype
    n, esize = xs[0].numel(), xs[0].element_size()
    chunk = padded(n, W, dtype)[1]
    kind = ALL_REDUCE_AVG if op == "avg" else ALL_REDUCE_SUM
    first, count = seqs
    for k in range(count):
        off = k * w.max_slice if count > 1 else 0
        ln = min(w.max_slice, chunk - off) if count > 1 else chunk
        pad = zero_bytes(n * esize, chunk, W, off, ln)
        want = sorted((int(o), c, -2 if direct else -1, ln, call_word(o, dtype, kind, pad)
                       | c << L.CALL_PIECE_SHIFT) for o in (Op.AG, Op.RS) for c in range(PIECES))
        for r in range(W):
            assert ring_entries(w, r, first + k) == want, (r, first + k)


# (topology, world, roots)
CONFIGS = [("mesh", 2, 2), ("mesh", 3, 1), ("mesh", 4, 2), ("ring", 3, 2), ("ring", 4, 2),
           ("ring", 5, 2)]
SHAPES = [(1,), (37,), (129, 7), (1000,)]  # every one padded at every world of CONFIGS


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct", [False, True], ids=["proxy", "direct"])
@pytest.mark.parametrize("topology,world,roots", CONFIGS)
def test_fused_exact(backend, topology, world, roots, direct):
    """bf16 / fp16 / fp32, SUM and AVG, sizes that pad (one element, odd counts), queued back
    to back with one sync: zero-copy, then from the input, then in place (out is x), then
    chunks of several slots (several fused collectives per call); a shape's second call runs
    from its launch plan. Every result the reference's bits, every collective the fused one
    (GPU-direct: the kernel wrote the peers' slots and flags, the entries say so)."""
    max_slice = 4096
    with World(backend, topology, world, roots, max_slice=max_slice, direct=direct) as w:
        pending = []
        seed = 0
        for dtype in DTYPES:
            for shape in SHAPES:
                for op in ("sum", "avg"):
                    for zero_copy in (True, False):
                        seed += 1
                        xs = inputs(seed, world, shape, dtype)
                        outs, seqs = fused(w, xs, op, zero_copy=zero_copy)
                        pending.append((xs, op, outs, seqs))
                        if len(pending) == 8:
                            # (the ring keeps 16 fused collectives' entries)
                            w.sync()
                            for xs_, op_, outs_, seqs_ in pending:
                                check(xs_, op_, outs_, f"zero_copy={zero_copy}")
                                if seqs_ is pending[-1][3]:
                                    check_fused_entries(w, xs_, op_, seqs_, direct)
                            pending = []
        w.sync()
        for xs, op, outs, seqs in pending:
            check(xs, op, outs)
        launches = [dp.engines.two_step.launches for dp in w.dps]
        hits = [dp.plans.stats["hits"] for dp in w.dps]
        xs = inputs(999, world, (129, 7), torch.bfloat16)  # (a shape planned above)
        outs, seqs = fused(w, xs, "avg")
        w.sync()
        check(xs, "avg", outs, "planned")
        check_fused_entries(w, xs, "avg", seqs, direct)
        assert [dp.plans.stats["hits"] for dp in w.dps] == [h + 1 for h in hits]
        assert [dp.engines.two_step.launches for dp in w.dps] == launches
        for k, dtype in enumerate(DTYPES):  # in place: n a multiple of W * 16 bytes
            n = world * 16 // torch.empty((), dtype=dtype).element_size() * 7
            xs = inputs(200 + k, world, (n,), dtype)
            outs, seqs = fused(w, xs, "avg", zero_copy=False, in_place=True)
            w.sync()
            check(xs, "avg", outs, "in place", in_place=True)
            check_fused_entries(w, xs, "avg", seqs, direct)
        for k, dtype in enumerate(DTYPES):  # chunks above a slot: several collectives
            esize = torch.empty((), dtype=dtype).element_size()
            xs = inputs(300 + k, world, (world * (2 * max_slice + 48) // esize + 3,), dtype)
            for zero_copy in (True, False):
                outs, seqs = fused(w, xs, "sum" if k % 2 else "avg", zero_copy=zero_copy)
                assert seqs[1] == 3
                w.sync()
                check(xs, "sum" if k % 2 else "avg", outs, "several slots")
                check_fused_entries(w, xs, "sum" if k % 2 else "avg", seqs, direct)
        assert all(device_seq(w, r) == w.seq for r in range(world))
        assert all(dp.direct_launches > 0 for dp in w.dps) == direct
        w.healthy()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct", [False, True], ids=["proxy", "direct"])
@pytest.mark.parametrize("topology,world,roots", [("mesh", 2, 2), ("ring", 3, 2), ("ring", 4, 1)])
def test_fused_above_one_handoff_slice(backend, topology, world, roots, direct):
    """A chunk above ONE_HANDOFF_SLICE goes piece by piece (an RS entry per piece as its
    copy is done, an AG entry per piece as its sum is done): exact, zero-copy and not."""
    oh = EN.ONE_HANDOFF_SLICE
    with World(backend, topology, world, roots, max_slice=oh + 4096, direct=direct) as w:
        for k, (dtype, op) in enumerate(((torch.bfloat16, "avg"), (torch.float32, "sum"))):
            esize = torch.empty((), dtype=dtype).element_size()
            xs = inputs(40 + k, world, (world * (oh + 32) // esize - 5,), dtype)
            assert padded(xs[0].numel(), world, dtype)[1] > oh
            for zero_copy in (True, False):
                outs, seqs = fused(w, xs, op, zero_copy=zero_copy)
                w.sync()
                check(xs, op, outs, f"above one hand-off, zero_copy={zero_copy}")
                check_fused_entries(w, xs, op, seqs, direct)
        assert all(dp.direct_launches > 0 for dp in w.dps) == direct
        w.healthy()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topology,world,roots,direct", [
    ("mesh", 2, 2, False), ("ring", 3, 2, False), ("mesh", 2, 2, True), ("ring", 3, 2, True)])
def test_fused_capture_and_replay(backend, topology, world, roots, direct):
    """Fused all-reduces captured once per rank (bf16 sum, fp16 avg in place, fp32 avg over
    two slots; padded sizes on the GPU) and replayed with fresh inputs written into the captured tensors,
    an eager fused all-reduce between replays: every output exact, and the device's seq
    counts every collective."""
    replays = 6 if backend == "cuda" else 3
    ms = 4096
    # Padded inputs go through a torch copy into a padded temporary, which a CUDA graph
    # captures and the emulation's capture (launches only) cannot: padded on the GPU alone.
    pad = int(backend == "cuda")
    specs = [((world * 512 + 3 * pad,), torch.bfloat16, "sum", False),
             ((world * 64,), torch.float16, "avg", True),
             ((world * (ms + 16) // 4 + pad,), torch.float32, "avg", False)]
    with World(backend, topology, world, roots, max_slice=ms, direct=direct) as w:
        xs = inputs(1, world, (333,), torch.bfloat16)  # eager first (sets up nothing here)
        outs, _ = fused(w, xs, "sum")
        w.sync()
        check(xs, "sum", outs)
        xin = [[w.be.to_dev(torch.zeros(s, dtype=d)).reshape(-1) for _ in range(world)]
               for s, d, _, _ in specs]
        outs = [[(x, x) if in_place else output(w, x) for x in row]
                for row, (_, _, _, in_place) in zip(xin, specs)]
        taken = []

        def issue(r):
            seq = w.seq
            for k, (_, _, op, _) in enumerate(specs):
                seq += issue_rank(w, r, seq, xin[k][r], outs[k][r][1], op, one=False)
            taken.append(seq - w.seq)

        graphs = Graphs(w)
        graphs.capture(issue)
        per_replay = taken[0]
        assert per_replay == 4 and set(taken) == {per_replay}
        count = w.seq
        for it in range(replays):
            vals = [inputs(10 * it + k, world, s, d) for k, (s, d, _, _) in enumerate(specs)]
            for k in range(len(specs)):
                for r in range(world):
                    with w.be.on(r):
                        xin[k][r].copy_(w.be.to_dev(vals[k][r]).reshape(-1))
            graphs.replay()
            w.seq += per_replay
            ex = inputs(500 + it, world, (77,), torch.float16)
            eo, _ = fused(w, ex, "avg", zero_copy=False)  # (after a capture: never zero-copy)
            w.sync()
            for k, (_, _, op, in_place) in enumerate(specs):
                check(vals[k], op, [outs[k][r][0] for r in range(world)], f"replay {it}",
                      in_place=in_place)
            check(ex, "avg", eo, f"eager after replay {it}")
        count += replays * (per_replay + 1)
        for r in range(world):
            assert device_seq(w, r) == count, (r, device_seq(w, r), count)
        w.healthy()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct", [False, True], ids=["proxy", "direct"])
def test_fused_timeout_names_the_peer_and_poisons(backend, direct):
    """Only rank 0 calls (rank 1 never sends): its RS wait times out on the GPU clock,
    synchronize() raises CollectiveError naming rank 1 and the connection, the output is
    poisoned (mode poison, the World's default), and the next call raises at once."""
    world = 2
    with World(backend, "mesh", world, roots=2, max_slice=4096, timeout_s=0.5,
               direct=direct) as w:
        xs = inputs(1, world, (100,), torch.bfloat16)
        with w.be.on(0):
            x = w.keep(w.be.to_dev(xs[0]))
            out, res = output(w, x)
            issue_rank(w, 0, 0, x, res, "sum", one=False)
        msg = last_piece_timed_out(w)
        assert "GPU wait of its reduce_scatter part" in msg, msg  # (the RS part comes first)
        w.be.sync()
        assert (out.cpu()[:res.nbytes] == 0xFF).all()
        with pytest.raises(C.CollectiveError):
            with w.be.on(0):
                issue_rank(w, 0, 1, x, res, "sum", one=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("calls,said", [
    (((100, torch.bfloat16, "sum"), (100, torch.bfloat16, "avg")),
     ("200 bytes of bfloat16 to all_reduce(sum)", "200 bytes of bfloat16 to all_reduce(avg)")),
    (((5, torch.bfloat16, "sum"), (6, torch.bfloat16, "sum")),
     ("10 bytes of bfloat16 to all_reduce(sum)", "12 bytes of bfloat16 to all_reduce(sum)")),
], ids=["sum-avg", "5v6-bf16"])
def test_fused_different_calls_are_reported(backend, calls, said):
    """The fused collective's entries carry the all-reduce's call word: a sum beside an
    average of the same bytes, and sizes the padding to W chunks of 16 bytes hides, fail
    every rank at synchronize() naming both calls."""
    world = 2
    with World(backend, "mesh", world, max_slice=4096, timeout_s=20) as w:
        for r in range(world):
            w.dps[r].peer_calls = calls_view(w.ctl[r].t, num_flag_words(world))
        for r, (n, dtype, op) in enumerate(calls):
            with w.be.on(r):
                x = w.keep(w.be.to_dev(torch.zeros(n, dtype=dtype)))
                issue_rank(w, r, 0, x, output(w, x)[1], op, one=False)
        w.be.sync()
        different_call_reported(w, calls, said)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topology,world", [("ring", 3), ("mesh", 4)])
def test_fused_direct_and_proxy_ranks_mix(backend, topology, world):
    """GPU-direct is each rank's own choice for the fused all-reduce too: rank 1 sends
    through its proxy (entries chunk -1), the others write the peers' slots and flags
    themselves (chunk -2); the same flag words and bytes, so every result is exact."""
    with World(backend, topology, world, max_slice=1 << 14, direct=True) as w:
        w.dps[1].direct.tables.clear()
        w.dps[1].plans.invalidate()
        for k, (dtype, op, shape) in enumerate(((torch.bfloat16, "avg", (world * 3000 + 1,)),
                                                (torch.float32, "sum", (77, 5)))):
            xs = inputs(60 + k, world, shape, dtype)
            outs, seqs = fused(w, xs, op, zero_copy=bool(k))
            w.sync()
            check(xs, op, outs, "mixed")
            for r in range(world):
                got = {e[2] for e in ring_entries(w, r, seqs[0])}
                assert got == ({-1} if r == 1 else {-2}), (r, got)
        assert w.dps[1].direct_launches == 0 and w.proxies[1].stats()["gpu_pieces"] == 0
        assert all(w.dps[r].direct_launches == 2 for r in range(world) if r != 1)
        w.healthy()


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
@pytest.mark.parametrize("topology,world,roots", [("mesh", 2, 2), ("ring", 3, 2), ("mesh", 4, 2)])
def test_fused_beside_the_cpu_twin(topology, world, roots):
    """The last rank runs the CPU twin (CpuDataPlane.all_reduce), the others the emulated CUDA
    kernel, on one World (its proxies), the cross-rank check on: every call passes it (the
    call words are equal: a sum beside an average still fails, last), the CPU rank waits on
    the CUDA ranks' RS and AG flags and they on its, and every rank gets the reference's
    bits: proxies and peers cannot tell the two planes apart."""
    from sparkccl.dataplane.cpu import CpuDataPlane
    with World("emu", topology, world, roots, max_slice=4096, timeout_s=20) as w:
        me = world - 1
        w.dps[me].close()
        rs = w.rs[me].t
        cpu = CpuDataPlane(N, plan=w.plans[me], ctl_addr=w.ctl[me].addr,
                           flags_addr=w.ctl[me].addr + L.FLAGS_OFFSET, ag=w.ag[me].t,
                           ag_stride=w.ag_stride, timeout_s=20)
        cpu.attach_rs(rs[:w.send_bytes], w.send_stride, rs[w.send_bytes:], w.recv_stride)
        w.dps[me] = cpu
        for r in range(world):
            w.dps[r].peer_calls = calls_view(w.ctl[r].t, num_flag_words(world))
        seed = 0
        for dtype in DTYPES:
            for shape, zero_copy in (((37,), True), ((129, 7), False),
                                     ((world * 2100 + 1,), False), ((world * 2100,), True)):
                for op in ("sum", "avg"):
                    seed += 1
                    xs = inputs(seed, world, shape, dtype)
                    outs, seqs = fused(w, xs, op, zero_copy=zero_copy)  # (the CPU rank last)
                    w.sync()
                    check(xs, op, outs, f"beside the CPU twin, zero_copy={zero_copy}")
                    check_fused_entries(w, xs, op, seqs)  # (the CPU twin's entries too)
        w.healthy()
        xs = inputs(1, world, (100,), torch.bfloat16)
        with pytest.raises(C.CollectiveError, match=re.escape(
                f"rank {me} passed 200 bytes of bfloat16 to all_reduce(avg)")):
            for r in range(world):
                with w.be.on(r):
                    x = w.keep(w.be.to_dev(xs[r]))
                    issue_rank(w, r, w.seq, x, output(w, x)[1], "avg" if r == me else "sum",
                               one=False)
            w.sync()


# ---------------------------------------------------------------- through the Communicator

def _comm_fused_job(rank, world, store, topology, slot_bytes, transport):
    """A CUDA and a CPU communicator over ``transport``: the CUDA one takes the fused kernel
    (over tcp the proxy carries every byte, as between boxes; over shm GPU-direct, unless
    this rank's SPARKCCL_GPU_DIRECT=0: each rank's own choice); its all-reduces (every dtype
    and op, padded sizes, several slots, in place, the two collectives forced with
    fused=False, a CUDA graph replay) equal the reference and the CPU twin's bits."""
    import os

    import torch as T
    import torch.distributed as dist

    import sparkccl
    from sparkccl.reference import all_reduce_reference as arr
    from sparkccl.reference import bits as B
    from sparkccl.reference import make_input as mk
    T.cuda.set_device(rank % T.cuda.device_count())
    W, bad = world, []
    direct = transport == "shm" and os.environ.get("SPARKCCL_GPU_DIRECT", "1") != "0"
    kw = dict(rank=rank, world_size=W, topology=topology, slot_bytes=slot_bytes, timeout_s=60,
              transport=transport)
    cases = [((W * 1000 + 3,), T.bfloat16, "sum"), ((777, 5), T.float16, "avg"),
             ((W * 4096,), T.float32, "avg"), ((3 << 20,), T.bfloat16, "avg"),
             ((1 << 20,), T.float32, "sum")]
    with sparkccl.Communicator(store=dist.PrefixStore("gpu", store), device="cuda", **kw) as g, \
            sparkccl.Communicator(store=dist.PrefixStore("cpu", store), device="cpu", **kw) as c:
        dp = g.data_plane
        if not dp.fused_all_reduce:
            return [f"the CUDA plane over {transport} does not take the fused all-reduce"]
        seed = 0
        for shape, dtype, op in cases:
            seed += 1
            xs = [mk(seed, r, shape, dtype) for r in range(W)]
            want = arr(xs, op)
            before = dp.engines.two_step.launches + dp.plans.stats["hits"]
            launched = dp.direct_launches
            y = g.all_reduce(xs[rank].cuda(), op, regime="two_step")
            what = f"all_reduce {list(shape)} {dtype} {op}"
            if dp.engines.two_step.launches + dp.plans.stats["hits"] == before:
                bad.append(f"{what}: the fused kernel did not run")
            if (dp.direct_launches > launched) != direct:
                bad.append(f"{what}: GPU-direct {dp.direct_launches > launched}, not {direct}")
            y2 = g.all_reduce(xs[rank].cuda(), op, regime="two_step", fused=False)
            x = xs[rank].cuda()
            g.all_reduce(x, op, out=x, regime="two_step")  # in place
            yc = c.all_reduce(xs[rank], op, regime="two_step")
            g.synchronize()
            for name, got in (("fused", y), ("two collectives", y2), ("in place", x),
                              ("CPU twin", yc)):
                if not (B(got.cpu()) == want).all():
                    bad.append(f"{what}: {name} differs from the reference")
        # A CUDA graph of two fused all-reduces, replayed with fresh inputs.
        xin = T.zeros(W * 2048 + 5, dtype=T.bfloat16, device="cuda")
        out = T.empty_like(xin)
        s = T.cuda.Stream()
        s.wait_stream(T.cuda.current_stream())
        graph = T.cuda.CUDAGraph()
        with T.cuda.stream(s):
            with T.cuda.graph(graph, stream=s):
                g.all_reduce(xin, "avg", out=out, regime="two_step")
                g.all_reduce(out, "sum", out=out, regime="two_step")
        for it in range(5):
            xs = [mk(100 + it, r, tuple(xin.shape), T.bfloat16) for r in range(W)]
            xin.copy_(xs[rank].cuda())
            graph.replay()
            T.cuda.synchronize()
            avg = [T.from_numpy(arr(xs, "avg").copy()).view(T.bfloat16)] * W
            if not (B(out.cpu()) == arr(avg, "sum")).all():
                bad.append(f"graph replay {it}: differs from the reference")
        g.synchronize()
    return bad


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("topology,world,slot_bytes,transport,rank_env", [
    ("mesh", 2, 8 << 20, "tcp", None), ("ring", 3, 8 << 20, "tcp", None),
    ("mesh", 4, 8 << 20, "tcp", None),
    ("ring", 4, 256 << 10, "tcp", None),  # (a small slot: chunks of several collectives)
    ("mesh", 2, 8 << 20, "shm", None), ("ring", 3, 8 << 20, "shm", None),
    ("ring", 4, 256 << 10, "shm", None),
    # rank 0 takes the proxy path, the others GPU-direct: peers cannot tell
    ("mesh", 3, 8 << 20, "shm", {0: {"SPARKCCL_GPU_DIRECT": "0"}}),
    ("ring", 3, 8 << 20, "shm", {1: {"SPARKCCL_GPU_DIRECT": "0"}})])
def test_communicator_cuda_fused(topology, world, slot_bytes, transport, rank_env):
    from sparkccl.localrun import check, run_ranks
    values = check(run_ranks(_comm_fused_job, world, args=(topology, slot_bytes, transport),
                             rank_env=rank_env, timeout_s=600))
    bad = [f"rank {r}: {b}" for r, v in enumerate(values) for b in v]
    assert not bad, "\n".join(bad)
