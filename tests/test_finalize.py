"""The MoE finalize fused into the reduce-scatter (docs/CONTRACT.md §4), checked bit for bit.

* the numpy reference's fp32 FMA (``sparkccl.reference.fma_f32``) against exact rational
  arithmetic, including cases where a float64 multiply-add rounds twice and gets it wrong;
* the CPU twin's rows (``_native.finalize_rows``, std::fmaf) and e4m3 decoding against the
  reference (torch's own float8 conversion);
* the GPU kernel ``sccl_finalize`` + the reduce-scatter wait kernel, in process, on two
  backends (``emu``: kernels.cu compiled as host C++, no GPU needed; ``cuda``: a GPU), mesh
  and ring (relays included), against the rank-order reference;
* ``Communicator.moe_finalize_reduce_scatter`` in W processes (CPU, and CUDA when there is
  a GPU): several (T, H, topk) including H = 4096 / topk = 8, bf16 and e4m3, T < Tpad,
  powers of two and general weights, splitting over several collectives (small slot),
  deliberately reversed publish order, bursts mixed with all-gather and reduce-scatter,
  and every bad input raising before anything is sent.

Routing weights that are powers of two make FMA and multiply-add agree (the issue's
requirement); the general-weight cases and the FMA witness (a row whose value is 2^33 with
a fused multiply-add and 0 without) check that every implementation really fuses.
"""
from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest
import torch

from sparkccl import finalize as F
from helpers import assert_no_problems, expect_errors
from sparkccl.localrun import check, run_ranks
from sparkccl.reference import (all_gather_reference, bf16_bits_to_f32, bits,
                                finalize_rows_reference, fma_f32, make_finalize_input,
                                make_input, moe_finalize_reference, reduce_scatter_reference)

import sparkccl._native as N  # noqa: E402 - the native layer is not optional: no skip
HAVE_GPU = torch.cuda.is_available()


# ---------------------------------------------------------------- the reference's FMA

def _round_f32_exact(q: Fraction) -> float:
    """Round a rational to fp32, nearest even (no overflow in the tests' ranges)."""
    if q == 0:
        return 0.0
    sign = -1.0 if q < 0 else 1.0
    q = abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    elif Fraction(2) ** (e + 1) <= q:
        e += 1
    quantum = Fraction(2) ** (max(e, -126) - 23)
    n = q / quantum
    fl = n.numerator // n.denominator
    rem = n - fl
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2 == 1):
        fl += 1
    return sign * float(fl * quantum)


def _hard_fma_cases():
    """(a, b, c) where a * b + c lies within a float64 ulp of an fp32 rounding tie, so a
    float64 multiply-add rounds twice: 2^32 + 1 = 641 * 6700417, 2^36 + 1 = 1773961 * 38737,
    2^32 - 1 = 65535 * 65537, scaled and signed."""
    out = []
    for (a, b, m) in ((641, 6700417, 32), (1773961, 38737, 36), (65535, 65537, 32)):
        for i, j in ((0, 0), (-40, 3), (10, -70), (-60, -20)):
            for sa, sc in ((1, 1), (-1, -1), (1, -1)):
                # c = 2^(m + 24): its fp32 ulp is 2^(m + 1), the tie is at c + 2^m.
                out.append((sa * a * 2.0 ** i, b * 2.0 ** j, sc * 2.0 ** (m + 24 + i + j)))
    return out


def test_fma_f32_is_a_true_fma():
    rng = np.random.default_rng(5)
    n = 4000
    a = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    b = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    c = (rng.standard_normal(n) * np.exp2(rng.integers(-60, 60, n))).astype(np.float32)
    hard = np.array(_hard_fma_cases(), dtype=np.float64).astype(np.float32)
    a, b, c = (np.concatenate([x, hard[:, k]]) for k, x in enumerate((a, b, c)))
    got = fma_f32(a, b, c)
    want = np.array([_round_f32_exact(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                     for x, y, z in zip(a, b, c)], dtype=np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # The witness: a float64 multiply-add (and an fp32 one) lose the 1 and land on the tie.
    w = fma_f32(np.float32(641), np.float32(6700417), np.float32(2.0 ** 56))
    assert float(w) == 2.0 ** 56 + 2.0 ** 33
    assert float(np.float32(641.0 * 6700417.0 + 2.0 ** 56)) == 2.0 ** 56
    naive = sum(float(np.float32(x * y + z)) != float(f) for x, y, z, f in zip(*hard.T, fma_f32(*hard.T)))
    assert naive > 0, "the hard cases should defeat a float64 multiply-add"


# ---------------------------------------------------------------- the CPU twin's rows

def _native_rows(inp, T, Tpad, t0=0, n=None):
    n = Tpad - t0 if n is None else n
    H = inp["shared"].shape[1]
    f = F.FinalizeInputs(y=inp["y"].view(torch.uint8) if inp["y_scales"] is not None else inp["y"],
                         scales=inp["y_scales"], pos=inp["pos"].reshape(-1), weights=inp["weights"],
                         shared=inp["shared"], num_tokens=T, padded_tokens=Tpad, world=1,
                         topk=inp["weights"].shape[1], H=H, R=inp["y"].shape[0])
    out = torch.full((n, H), -1.0, dtype=torch.bfloat16)
    bad = N.finalize_rows(*f.native_args(), t0, n, out.data_ptr())
    return out, bad


def fma_witness(tokens: int = 3, padded: int = 8):
    """Inputs whose every real row is 2^33 with a fused multiply-add and 0 without:
    shared = 2^56, k=0: 641 * (e4m3 1.0 * 6700417), k=1: -1 * (e4m3 1.0 * 2^56)."""
    H, R = 128, 2
    y = torch.full((R, H), 1.0).to(torch.float8_e4m3fn)
    scales = torch.tensor([[6700417.0], [2.0 ** 56]], dtype=torch.float32)
    pos = torch.tensor([0, 1] * tokens, dtype=torch.int32)
    weights = torch.tensor([[641.0, -1.0]] * tokens, dtype=torch.float32)
    shared = torch.full((tokens, H), 2.0 ** 56).to(torch.bfloat16)
    return dict(y=y, pos=pos, weights=weights, shared=shared, y_scales=scales), tokens, padded


@pytest.mark.parametrize("T,Tpad,H,topk,fp8,pow2", [
    (5, 8, 8, 1, False, True), (13, 16, 64, 3, False, False), (9, 24, 256, 16, True, True),
    (30, 32, 4096, 8, False, True), (30, 32, 4096, 8, True, False), (0, 8, 128, 2, True, True),
    (16, 16, 24, 5, False, False)])
def test_native_rows_match_reference(T, Tpad, H, topk, fp8, pow2):
    inp = make_finalize_input(3, 1, tokens=T, hidden=H, topk=topk, experts_rows=2 * T + 1,
                              fp8=fp8, pow2_weights=pow2)
    want = finalize_rows_reference(inp, T, Tpad)
    out, bad = _native_rows(inp, T, Tpad)
    assert bad == 0
    assert np.array_equal(bf16_bits_to_f32(bits(out)).view(np.uint32), want.reshape(-1).view(np.uint32))
    assert not bits(out[T:]).any(), "rows T <= t < Tpad must be +0"
    # A window of rows (how the data planes call it: one row piece of one destination).
    if Tpad > 4:
        part, _ = _native_rows(inp, T, Tpad, t0=3, n=Tpad - 4)
        assert np.array_equal(bits(part), bits(out[3:Tpad - 1]))


def test_native_rows_fma_witness():
    inp, T, Tpad = fma_witness()
    out, _ = _native_rows(inp, T, Tpad)
    assert (out[:T].float() == 2.0 ** 33).all() and (out[T:].float() == 0).all()
    assert np.array_equal(bf16_bits_to_f32(bits(out)), finalize_rows_reference(inp, T, Tpad).reshape(-1))


def test_e4m3_decoding_matches_torch():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    H = 256
    y = codes.reshape(1, H)
    inp = dict(y=y.view(torch.float8_e4m3fn), pos=torch.zeros(1, dtype=torch.int32),
               weights=torch.ones(1, 1), shared=torch.full((1, H), -0.0, dtype=torch.bfloat16),
               y_scales=torch.ones(1, 2))  # -0 + v == v for every v, -0 included
    out, _ = _native_rows(inp, 1, 1)
    want = y.view(torch.float8_e4m3fn).float().to(torch.bfloat16)  # e4m3 values fit bf16 exactly
    got, ref = out.float().reshape(-1), want.float().reshape(-1)
    nan = torch.isnan(ref)
    assert nan.sum() == 2 and torch.isnan(got[nan]).all()
    keep = ~np.repeat(nan.numpy(), 2)
    assert np.array_equal(bits(out)[keep], bits(want)[keep])


def test_native_rows_bad_index_is_nan_not_a_read():
    inp = make_finalize_input(1, 0, tokens=4, hidden=16, topk=2, experts_rows=3)
    inp["pos"][5] = 1 << 30
    out, bad = _native_rows(inp, 4, 8)
    assert bad == 1 and torch.isnan(out[2].float()).all() and not torch.isnan(out[:2].float()).any()


# ---------------------------------------------------------------- kernels in process

try:
    from test_cuda_dataplane import BACKENDS, Graphs, World, device_seq  # noqa: E402  (tests/ is on sys.path)
except Exception as e:  # pragma: no cover - e.g. another import mode
    BACKENDS = [pytest.param("emu", marks=pytest.mark.skip(reason=f"no World: {e}"))]
    World = Graphs = device_seq = None


def run_finalize(w, inputs, T, Tpad, rows_per_call=None):
    """Every rank's finalize through its data plane (rows split into calls of
    rows_per_call rows of every chunk); returns the per-rank output buffers."""
    W = w.world
    H = inputs[0]["shared"].shape[1]
    Rr, RB = Tpad // W, 2 * H
    per = rows_per_call or Rr
    seq0 = w.seq
    outs = []
    for r in range(W):
        inp = inputs[r]
        with w.be.on(r):
            dev = {k: None if v is None else w.keep(w.be.to_dev(v)) for k, v in inp.items()}
            fp8 = dev["y_scales"] is not None
            f = F.FinalizeInputs(y=dev["y"].view(torch.uint8) if fp8 else dev["y"],
                                 scales=dev["y_scales"], pos=dev["pos"].reshape(-1),
                                 weights=dev["weights"], shared=dev["shared"], num_tokens=T,
                                 padded_tokens=Tpad, world=W, topk=inp["weights"].shape[1], H=H,
                                 R=inp["y"].shape[0])
            buf = w.keep(w.be.to_dev(torch.full((Rr * RB + 5,), 0xAB, dtype=torch.uint8)))
            for k, a in enumerate(range(0, Rr, per)):
                w.dps[r].moe_finalize_reduce_scatter(seq0 + k, f, a, min(per, Rr - a), buf, a * RB)
            outs.append(buf)
    w.seq = seq0 + -(-Rr // per)
    return outs


def check_finalize(w, inputs, T, Tpad, outs):
    n = (Tpad // w.world) * 2 * inputs[0]["shared"].shape[1]
    rows = [finalize_rows_reference(inp, T, Tpad) for inp in inputs]
    for r, buf in enumerate(outs):
        got = buf.cpu().numpy()
        want = moe_finalize_reference(inputs, r, T, Tpad, rows)
        assert np.array_equal(got[:n], want), \
            f"finalize rank {r}: bytes {np.flatnonzero(got[:n] != want)[:10]} differ"
        assert (got[n:] == 0xAB).all(), f"finalize rank {r} wrote past its output"


KERNEL_CONFIGS = [("mesh", 2, 2), ("mesh", 3, 1), ("mesh", 4, 2), ("ring", 2, 2), ("ring", 3, 2),
                  ("ring", 4, 2), ("ring", 5, 2)]


@pytest.mark.parametrize("direct", [False, True], ids=["proxy", "direct"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topology,world,roots", KERNEL_CONFIGS)
def test_finalize_kernel_exact(backend, topology, world, roots, direct):
    """proxy: sccl_finalize publishes (piece, destination) entries and the proxies send;
    direct: sccl_finalize_direct writes the rows into the peers' regions and the flags
    itself (the proxies only relay), reducing in the same launch."""
    W = world
    cases = [  # (T, Tpad, H, topk, fp8, pow2, rows per call)
        (8 * W - 3, 8 * W, 64, 3, False, True, None),
        (13 * W, 16 * W, 256, 8, True, True, None),
        (16 * W - 1, 16 * W, 128, 16, True, False, 5),  # split: 4 collectives, uneven
        (8 * W - 2, 8 * W, 4096, 8, False, True, None),
        (2, 8 * W, 8, 1, False, False, None),
    ]
    if backend == "cuda":
        cases.append((100 * W - 7, 100 * W, 4096, 8, True, True, 16))
    with World(backend, topology, W, roots, max_slice=1 << 17, direct=direct) as w:
        for k, (T, Tpad, H, topk, fp8, pow2, per) in enumerate(cases):
            inputs = [make_finalize_input(k, r, tokens=T, hidden=H, topk=topk,
                                          experts_rows=T + 5, fp8=fp8, pow2_weights=pow2)
                      for r in range(W)]
            outs = run_finalize(w, inputs, T, Tpad, per)
            w.sync()
            check_finalize(w, inputs, T, Tpad, outs)
        # The FMA witness on every rank: each rank's rows are 2^33.
        wit, T, Tpad = fma_witness(tokens=5, padded=8 * W)
        outs = run_finalize(w, [wit] * W, T, Tpad)
        w.sync()
        check_finalize(w, [wit] * W, T, Tpad, outs)
        # Mixed with plain reduce-scatters and all-gathers, back to back, checked afterwards.
        xs = [make_input(7, r, (W * 64, 8), torch.bfloat16) for r in range(W)]
        fin = [make_finalize_input(8, r, tokens=8 * W - 1, hidden=128, topk=4, experts_rows=9)
               for r in range(W)]
        o1 = w.reduce_scatter(xs)
        o2 = run_finalize(w, fin, 8 * W - 1, 8 * W)
        o3 = w.all_gather(xs)
        o4 = run_finalize(w, fin, 8 * W - 1, 8 * W, rows_per_call=3)
        o5 = w.reduce_scatter(xs)
        w.sync()
        chunk = xs[0].numel() * 2 // W
        for r in range(W):
            for o in (o1[r], o5[r]):
                assert np.array_equal(o.cpu().numpy()[:chunk], reduce_scatter_reference(xs, r))
            assert np.array_equal(o3[r].cpu().numpy()[:W * xs[0].numel() * 2],
                                  all_gather_reference(xs))
        check_finalize(w, fin, 8 * W - 1, 8 * W, o2)
        check_finalize(w, fin, 8 * W - 1, 8 * W, o4)
        w.healthy()
        n_fin = sum(-(-(c[1] // W) // (c[6] or c[1] // W)) for c in cases) + 1 + 1 + 3
        for r in range(W):
            assert w.dps[r].direct_launches == (n_fin + 3 if direct else 0)
            if direct:  # every data write went from the GPUs: the proxies only relay
                relays = len(w.plans[r].streams) - len(w.plans[r].publish_streams())
                assert (w.proxies[r].stats()["writes"] > 0) == (relays > 0)


@pytest.mark.parametrize("direct", [False, True], ids=["proxy", "direct"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topology,world,roots", [("mesh", 2, 2), ("ring", 3, 2)])
def test_finalize_graph_replay(backend, topology, world, roots, direct):
    """Finalizes (one split into two collectives) and a reduce-scatter captured in a CUDA
    graph, replayed with fresh inputs written into the captured tensors, an eager finalize
    between replays: bit-exact every time (the finalize gate's target and the counter sets
    come from the device state, docs/CONTRACT.md "CUDA graphs")."""
    W = world
    T, Tpad, H, topk = 8 * W - 3, 16 * W, 128, 4
    Rr, RB = Tpad // W, 2 * H
    replays = 20 if backend == "cuda" else 4
    with World(backend, topology, W, roots, max_slice=1 << 16, direct=direct) as w:
        def make(seed):
            return [make_finalize_input(seed, r, tokens=T, hidden=H, topk=topk,
                                        experts_rows=T + 5, fp8=False) for r in range(W)]
        first = make(0)
        dev, fins, outs = [], [], []
        for r in range(W):
            with w.be.on(r):
                d = {k: w.be.to_dev(v) for k, v in first[r].items() if v is not None}
                dev.append(d)
                fins.append(F.FinalizeInputs(y=d["y"], scales=None, pos=d["pos"].reshape(-1),
                                             weights=d["weights"], shared=d["shared"],
                                             num_tokens=T, padded_tokens=Tpad, world=W,
                                             topk=topk, H=H, R=first[r]["y"].shape[0]))
                outs.append([w.be.to_dev(torch.full((Rr * RB + 5,), 0xAB, dtype=torch.uint8))
                             for _ in range(2)])
        xs0 = [make_input(1, r, (W * 64, 8), torch.bfloat16) for r in range(W)]
        rs_in = [w.be.to_dev(x) for x in xs0]
        rs_out = [w.be.to_dev(torch.full((64 * 8 * 2 + 5,), 0xAB, dtype=torch.uint8))
                  for _ in range(W)]

        def issue(r):
            dp, f, o = w.dps[r], fins[r], outs[r]
            dp.moe_finalize_reduce_scatter(0, f, 0, Rr, o[0], 0)
            src = rs_in[r].reshape(-1).view(torch.uint8)
            dp.reduce_scatter(0, src, 0, src.numel() // W, src.numel() // W, rs_out[r], 0,
                              torch.bfloat16)
            half = Rr // 2
            dp.moe_finalize_reduce_scatter(0, f, 0, half, o[1], 0)
            dp.moe_finalize_reduce_scatter(0, f, half, Rr - half, o[1], half * RB)

        eager = run_finalize(w, first, T, Tpad)  # eager first: scratch and streams exist
        w.sync()
        check_finalize(w, first, T, Tpad, eager)
        graphs = Graphs(w)
        graphs.capture(issue)
        count = 1
        for it in range(replays):
            new = make(10 + it)
            xs = [make_input(20 + it, r, (W * 64, 8), torch.bfloat16) for r in range(W)]
            for r in range(W):
                with w.be.on(r):
                    for k in ("y", "pos", "weights", "shared"):
                        dev[r][k].copy_(w.be.to_dev(new[r][k]))
                    rs_in[r].copy_(w.be.to_dev(xs[r]))
            graphs.replay()
            count += 4
            if it % 2 == 0:
                mid = run_finalize(w, new, T, Tpad, rows_per_call=5)
                count += -(-Rr // 5)
            w.sync()
            for k in range(2):
                check_finalize(w, new, T, Tpad, [o[k] for o in outs])
            for r in range(W):
                got = rs_out[r].cpu().numpy()
                assert np.array_equal(got[:-5], reduce_scatter_reference(xs, r)), (it, r)
            if it % 2 == 0:
                check_finalize(w, new, T, Tpad, mid)
        assert [device_seq(w, r) for r in range(W)] == [count] * W
        w.healthy()


@pytest.mark.parametrize("direct", [False, True], ids=["proxy", "direct"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_finalize_launch_plans(backend, direct):
    """Later finalizes of a shape run from its launch plan with their own six pointers
    (fresh y, pos, weights, shared, scales and result every call), through every slot; a
    call of other rows is another plan. Bit-exact every time."""
    W = 2
    T, Tpad, H, topk = 8 * W - 3, 16 * W, 256, 4
    with World(backend, "mesh", W, 2, max_slice=1 << 16, direct=direct) as w:
        pending = []
        for it in range(6):
            fp8 = it % 2 == 1  # (fp8 and bf16 alternate: two shapes, each planned once)
            inputs = [make_finalize_input(30 + it, r, tokens=T, hidden=H, topk=topk,
                                          experts_rows=T + 5, fp8=fp8) for r in range(W)]
            pending.append((inputs, run_finalize(w, inputs, T, Tpad)))
        w.sync()
        for inputs, outs in pending:
            check_finalize(w, inputs, T, Tpad, outs)
        for dp in w.dps:
            assert (dp.plans.stats["misses"], dp.plans.stats["hits"]) == (2, 4), dp.plans.stats
            assert dp.direct_launches == (6 if direct else 0)
        # Wider rows outgrow the own-rows scratch buffer the plans point into: they are
        # dropped, and the first shape is planned again (against the new buffer).
        for it, hidden in enumerate((2 * H, H)):
            inputs = [make_finalize_input(40 + it, r, tokens=T, hidden=hidden, topk=topk,
                                          experts_rows=T + 5) for r in range(W)]
            outs = run_finalize(w, inputs, T, Tpad)
            w.sync()
            check_finalize(w, inputs, T, Tpad, outs)
        for dp in w.dps:
            assert dp.plans.stats["invalidations"] == 1 and dp.plans.stats["misses"] == 4
        w.healthy()


@pytest.mark.parametrize("backend", BACKENDS)
def test_finalize_direct_and_proxy_ranks_mix(backend):
    """A rank whose finalize goes through its proxy and ranks whose GPUs write directly
    interoperate (same flag words, same bytes), mixed with plain reduce-scatters."""
    W = 3
    with World(backend, "ring", W, max_slice=1 << 16, direct=True) as w:
        w.dps[1].direct.tables.clear()  # rank 1: back to the proxy
        fin = [make_finalize_input(4, r, tokens=12 * W - 1, hidden=256, topk=8, experts_rows=7,
                                   fp8=True) for r in range(W)]
        xs = [make_input(5, r, (W * 100, 3), torch.float32) for r in range(W)]
        o1 = run_finalize(w, fin, 12 * W - 1, 12 * W)
        o2 = w.reduce_scatter(xs)
        o3 = run_finalize(w, fin, 12 * W - 1, 12 * W, rows_per_call=8)
        w.sync()
        check_finalize(w, fin, 12 * W - 1, 12 * W, o1)
        check_finalize(w, fin, 12 * W - 1, 12 * W, o3)
        for r in range(W):
            assert np.array_equal(o2[r].cpu().numpy()[:xs[0].numel() * 4 // W],
                                  reduce_scatter_reference(xs, r))
        w.healthy()
        assert w.dps[1].direct_launches == 0 and w.dps[0].direct_launches == 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_finalize_kernel_bad_pos_is_reported(backend):
    W = 2
    with World(backend, "mesh", W, 2, max_slice=1 << 16) as w:
        inputs = [make_finalize_input(1, r, tokens=10, hidden=64, topk=2, experts_rows=4)
                  for r in range(W)]
        inputs[1]["pos"][7] = 4  # == R: out of range (token 3, k 1)
        outs = run_finalize(w, inputs, 10, 16)
        w.be.sync()
        w.dps[0].synchronize()
        with pytest.raises(ValueError, match="token 3, k 1 was 4"):
            w.dps[1].synchronize()
        w.dps[1].synchronize()  # reported once
        w.healthy()  # a bad input does not break the communicator
        # Rank 0 holds token rows 0..7: token 3 has rank 1's NaN term summed in, no other.
        rows = bf16_bits_to_f32(outs[0].cpu().numpy()[:8 * 128].view(np.uint16).reshape(8, 64))
        assert np.isnan(rows[3]).all() and not np.isnan(np.delete(rows, 3, axis=0)).any()


# ---------------------------------------------------------------- through the Communicator

def comm_cases(W: int):
    """(T, Tpad, H, topk, fp8, pow2): T < Tpad, H = 4096 / topk = 8, bf16 and e4m3."""
    return [(8 * W - 3, 8 * W, 64, 3, False, True),
            (12 * W - 5, 12 * W, 256, 8, True, True),    # 12 rows per rank: padded to 16
            (8 * W - 1, 8 * W, 4096, 8, False, True),
            (8 * W - 2, 8 * W, 4096, 8, True, True),
            (16 * W - 9, 16 * W, 128, 16, True, False),
            (3, 8 * W, 24, 1, False, False),
            (0, 8 * W, 32, 2, False, True)]


def _on(dev, inp):
    return {k: None if v is None else v.to(dev) for k, v in inp.items()}


def _call(comm, inp, T, Tpad):
    return comm.moe_finalize_reduce_scatter(inp["y"], inp["pos"], inp["weights"], inp["shared"],
                                            num_tokens=T, padded_tokens=Tpad,
                                            y_scales=inp["y_scales"])


def finalize_comm_job(rank, nprocs, store, configs, device):
    """configs: [(world, topology, slot_bytes, reverse)]; ranks >= world sit a config out.
    Returns the failures (empty when everything is bit-exact)."""
    import torch.distributed as dist

    import sparkccl
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    bad = []
    for n, (W, topo, slot, reverse) in enumerate(configs):
        if rank >= W:
            continue
        with sparkccl.Communicator(store=dist.PrefixStore(f"fin{n}", store), rank=rank,
                                   world_size=W, topology=topo, slot_bytes=slot, timeout_s=60,
                                   device=device) as comm:
            if reverse and rank % 2:
                comm._dp.fin_order = "reverse"
            name = f"world {W} {topo} slot {slot}"
            for k, (T, Tpad, H, topk, fp8, pow2) in enumerate(comm_cases(W)):
                if 8 * 2 * H > comm.max_slice:  # 8 rows per rank must fit (bad-input test)
                    continue
                inputs = [make_finalize_input(100 + k, r, tokens=T, hidden=H, topk=topk,
                                              experts_rows=T + 3, fp8=fp8, pow2_weights=pow2)
                          for r in range(W)]
                z = _call(comm, _on(comm.device, inputs[rank]), T, Tpad)
                if device == "cuda":
                    comm.synchronize()
                got, want = bits(z.cpu()), moe_finalize_reference(inputs, rank, T, Tpad)
                if tuple(z.shape) != (Tpad // W, H) or not np.array_equal(got, want):
                    bad.append(f"{name} case {k} {(T, Tpad, H, topk, fp8, pow2)}: differs at "
                               f"{np.flatnonzero(got != want)[:5]}")
            wit, T, Tpad = fma_witness(tokens=4 * W + 1, padded=8 * W)
            z = _call(comm, _on(comm.device, wit), T, Tpad)
            if device == "cuda":
                comm.synchronize()
            if not np.array_equal(bits(z.cpu()), moe_finalize_reference([wit] * W, rank, T, Tpad)):
                bad.append(f"{name}: the FMA witness differs: {z.float()[:, 0].tolist()}")
    return bad


def _run_comm(nprocs, configs, device="cpu"):
    values = check(run_ranks(finalize_comm_job, nprocs, args=(configs, device), timeout_s=900))
    bad = [f"rank {r}: {b}" for r, v in enumerate(values) for b in v]
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_communicator_finalize_mesh():
    # 24 KiB slots (6 KiB per rank): rows of up to H = 256 go 8 per rank per collective,
    # so the 12- and 16-row cases split into several collectives (H = 4096 is skipped there).
    _run_comm(4, [(2, "mesh", 1 << 20, False), (3, "mesh", 18 << 10, True),
                  (4, "mesh", 1 << 20, True), (4, "mesh", 24 << 10, False)])


@pytest.mark.slow
def test_communicator_finalize_ring():
    _run_comm(5, [(2, "ring", 1 << 20, True), (3, "ring", 1 << 20, False),
                  (4, "ring", 1 << 20, True), (4, "ring", 24 << 10, True),
                  (5, "ring", 1 << 20, True)])


@pytest.mark.parametrize("topology,world", [("mesh", 2), ("ring", 4), ("mesh", 3)])
@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
def test_communicator_finalize_cuda(topology, world):
    _run_comm(world, [(world, topology, 8 << 20, False), (world, topology, 512 << 10, False)],
              device="cuda")


# ---------------------------------------------------------------- bursts

def burst_ops(seed: int, W: int, n: int):
    rng = random.Random(seed)
    ops = []
    for i in range(n):
        u = rng.random()
        if u < 0.3:
            ops.append(("ag", seed * 1000 + i, (rng.choice([1, 8, 100]), 16), torch.bfloat16))
        elif u < 0.6:
            ops.append(("rs", seed * 1000 + i, (W * rng.choice([1, 8, 64]), 24),
                        rng.choice([torch.bfloat16, torch.float32])))
        else:
            per = rng.choice([8, 9, 16, 24])
            H = rng.choice([8, 128, 256, 1024])  # 1024 with a 64 KiB slot: 8 rows per call
            ops.append(("fin", seed * 1000 + i, (rng.randrange(0, per * W), per * W, H,
                                                  rng.randint(1, 8), H % 128 == 0 and rng.random() < 0.5,
                                                  rng.random() < 0.5), None))
    return ops


def finalize_burst_job(rank, nprocs, store, configs, n, device):
    import torch.distributed as dist

    import sparkccl
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    bad = []
    for cfg, (W, topo, slot) in enumerate(configs):
        if rank >= W:
            continue
        ops = burst_ops(31 + cfg, W, n)
        results = []
        with sparkccl.Communicator(store=dist.PrefixStore(f"finburst{cfg}", store), rank=rank,
                                   world_size=W, topology=topo, slot_bytes=slot, timeout_s=60,
                                   device=device) as comm:
            dev = comm.device
            for kind, s, shape, dt in ops:  # back to back, checked afterwards
                if kind == "ag":
                    results.append(comm.all_gather(make_input(s, rank, shape, dt).to(dev)))
                elif kind == "rs":
                    results.append(comm.reduce_scatter(make_input(s, rank, shape, dt).to(dev)))
                else:
                    T, Tpad, H, topk, fp8, pow2 = shape
                    inp = make_finalize_input(s, rank, tokens=T, hidden=H, topk=topk,
                                              experts_rows=T + 2, fp8=fp8, pow2_weights=pow2)
                    results.append(_call(comm, _on(dev, inp), T, Tpad))
            comm.synchronize()
            results = [r.cpu() for r in results]
        for i, ((kind, s, shape, dt), z) in enumerate(zip(ops, results)):
            if kind == "fin":
                T, Tpad, H, topk, fp8, pow2 = shape
                inputs = [make_finalize_input(s, r, tokens=T, hidden=H, topk=topk,
                                              experts_rows=T + 2, fp8=fp8, pow2_weights=pow2)
                          for r in range(W)]
                want = moe_finalize_reference(inputs, rank, T, Tpad)
            else:
                xs = [make_input(s, r, shape, dt) for r in range(W)]
                want = all_gather_reference(xs) if kind == "ag" else reduce_scatter_reference(xs, rank)
            if not np.array_equal(bits(z), want):
                bad.append(f"world {W} {topo}: op {i} {kind} {shape} differs")
    return bad


@pytest.mark.slow
def test_burst_finalize_mixed_cpu():
    # 64 KiB slot: the larger finalizes and reduce-scatters split into several collectives.
    bad = check(run_ranks(finalize_burst_job, 4, timeout_s=900,
                          args=([(4, "ring", 64 << 10), (3, "mesh", 1 << 20), (2, "ring", 1 << 20)],
                                60, "cpu")))
    assert not any(bad), bad


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
def test_burst_finalize_mixed_cuda():
    bad = check(run_ranks(finalize_burst_job, 4, timeout_s=900,
                          args=([(4, "ring", 64 << 10), (2, "mesh", 1 << 20)], 120, "cuda")))
    assert not any(bad), bad


# ---------------------------------------------------------------- bad input

def _bad_finalize_cases(comm):
    W = comm.world_size
    Tpad, T, H, topk = 8 * W, 8 * W - 1, 128, 2
    good = make_finalize_input(1, comm.rank, tokens=T, hidden=H, topk=topk, experts_rows=5)
    fp8 = make_finalize_input(1, comm.rank, tokens=T, hidden=H, topk=topk, experts_rows=5,
                              fp8=True)

    def call(over=None, **kw):
        a = dict(good, **(over or {}))
        args = dict(num_tokens=T, padded_tokens=Tpad, y_scales=a["y_scales"])
        args.update(kw)
        return lambda: comm.moe_finalize_reduce_scatter(a["y"], a["pos"], a["weights"],
                                                        a["shared"], **args)

    bad_pos = good["pos"].clone()
    bad_pos[3] = 5
    neg_pos = good["pos"].clone()
    neg_pos[-1] = -1
    y16 = make_finalize_input(1, 0, tokens=T, hidden=16, topk=topk, experts_rows=5)
    big = make_finalize_input(1, 0, tokens=T, hidden=40960, topk=1, experts_rows=1)
    return [
        ("y float32", call({"y": good["y"].float()}), TypeError, "torch.bfloat16"),
        ("y 1-D", call({"y": good["y"].reshape(-1)}), ValueError, "[R, H]"),
        ("y not a tensor", call({"y": good["y"].tolist()}), TypeError, "torch.Tensor"),
        ("y non-contiguous", call({"y": good["y"].t()}), ValueError, "contiguous"),
        ("y wrong device", call({"y": torch.zeros(5, H, dtype=torch.bfloat16, device="meta")}),
         ValueError, "to('cpu')"),
        ("H not multiple of 8", call({"y": torch.zeros(5, 12, dtype=torch.bfloat16),
                                      "shared": torch.zeros(T, 12, dtype=torch.bfloat16)}),
         ValueError, "multiple of 8"),
        ("fp8 without scales", call({"y": fp8["y"]}, y_scales=None), ValueError, "need y_scales"),
        ("uint8 without scales", call({"y": fp8["y"].view(torch.uint8)}, y_scales=None),
         ValueError, "need y_scales"),
        ("scales with bf16 y", call(y_scales=fp8["y_scales"]), ValueError, "y_scales=None"),
        ("scales wrong shape", call({"y": fp8["y"]}, y_scales=fp8["y_scales"][:, :0]),
         ValueError, "[R, H / 128]"),
        ("scales fp16", call({"y": fp8["y"]}, y_scales=fp8["y_scales"].half()), TypeError,
         "torch.float32"),
        ("fp8 H not multiple of 128", call({"y": y16["y"].to(torch.float8_e4m3fn),
                                            "shared": y16["shared"]},
                                           y_scales=torch.ones(5, 0)), ValueError,
         "multiple of 128"),
        ("shared fp32", call({"shared": good["shared"].float()}), TypeError, "shared must be"),
        ("shared wrong H", call({"shared": good["shared"][:, :64].contiguous()}), ValueError,
         "shared must be [T, H]"),
        ("shared too few rows", call({"shared": good["shared"][:T - 1]}), ValueError,
         "fewer than num_tokens"),
        ("weights fp16", call({"weights": good["weights"].half()}), TypeError, "torch.float32"),
        ("weights 1-D", call({"weights": good["weights"].reshape(-1)}), ValueError,
         "[T, topk]"),
        ("topk 17", call({"weights": torch.ones(T, 17), "pos": torch.zeros(T * 17,
                                                                         dtype=torch.int32)}),
         ValueError, "topk = 17"),
        ("pos int64", call({"pos": good["pos"].long()}), TypeError, "torch.int32"),
        ("pos wrong length", call({"pos": good["pos"][:-1]}), ValueError, "[T * topk]"),
        ("pos out of range", call({"pos": bad_pos}), ValueError, "pos[3] = 5"),
        ("pos negative", call({"pos": neg_pos}), ValueError, "= -1"),
        ("Tpad not multiple of world", call(padded_tokens=Tpad + 1), ValueError,
         "multiple of the world size"),
        ("Tpad / world < 8", call(num_tokens=3, padded_tokens=4 * W), ValueError, "at least 8"),
        ("T > Tpad", call(num_tokens=Tpad + 1), ValueError, "<= padded_tokens"),
        ("T negative", call(num_tokens=-1), ValueError, ">= 0"),
        ("T not an int", call(num_tokens=3.0), TypeError, "num_tokens must be an int"),
        ("Tpad bool", call(padded_tokens=True), TypeError, "padded_tokens must be an int"),
        ("rows above the slot", call({"y": big["y"], "shared": big["shared"],
                                      "weights": big["weights"], "pos": big["pos"]}),
         ValueError, "SPARKCCL_SLOT_BYTES"),
        ("out wrong shape", call(out=torch.empty(Tpad, H, dtype=torch.bfloat16)), ValueError,
         f"shape [{Tpad // W}, {H}]"),
    ]


def finalize_bad_input_job(rank, world, store):
    import sparkccl
    comm = sparkccl.Communicator(store=store, rank=rank, world_size=world, timeout_s=20,
                                 slot_bytes=1 << 20)
    out = expect_errors(comm, _bad_finalize_cases(comm))
    # Nothing was sent: the next collectives line up and are exact.
    T, Tpad = 8 * world - 1, 8 * world
    inputs = [make_finalize_input(1, r, tokens=T, hidden=128, topk=2, experts_rows=5)
              for r in range(world)]
    z = _call(comm, inputs[rank], T, Tpad)
    out["finalize after bad calls"] = None if np.array_equal(
        bits(z), moe_finalize_reference(inputs, rank, T, Tpad)) else "wrong result"
    xs = [make_input(9, r, (world * 5, 3), torch.float16) for r in range(world)]
    ok = np.array_equal(bits(comm.reduce_scatter(xs[rank])), reduce_scatter_reference(xs, rank))
    out["rs after"] = None if ok else "wrong result"
    comm.close()
    return out


@pytest.mark.slow
def test_bad_finalize_inputs_raise_before_sending():
    values = check(run_ranks(finalize_bad_input_job, 2, timeout_s=300))
    assert_no_problems(values, at_least=30)
