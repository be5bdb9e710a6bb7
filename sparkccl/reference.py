"""Deterministic inputs and independent references, in numpy (not the data plane).

Every rank can rebuild every other rank's input from a seed (:func:`make_input`), so it
checks its own result against the rank-order reference -- fp32 sum in rank order starting
from rank 0's value, rounded once -- without communicating. ``sparkccl demo``,
``sparkccl selftest`` and the tests compare results with these bit for bit.
"""
from __future__ import annotations


def make_input(seed: int, rank: int, shape, dtype, *, zeros: bool = True):
    """The tensor rank ``rank`` contributes to test ``seed``: any rank can rebuild any
    other rank's input. Floats are normal(0, 1) scaled by 2**(rank % 5 - 2) so that sums
    round; with ``zeros`` every 7th element is -0.0 on every rank (checks that the sum
    starts from rank 0's value, not from +0)."""
    import torch
    g = torch.Generator().manual_seed((seed * 1_000_003 + rank * 7919) & 0x7FFFFFFFFFFF)
    shape = tuple(shape)
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g, dtype=torch.float32) * float(2.0 ** (rank % 5 - 2))
        x = x.to(dtype)
        if zeros and x.numel():
            x.view(-1)[::7] = -0.0
        return x
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    info = torch.iinfo(dtype)
    if info.bits <= 8:  # draw the dtype directly (big uint8 buffers stay cheap)
        return torch.randint(info.min, info.max + 1, shape, generator=g, dtype=dtype)
    lo, hi = max(info.min, -(1 << 30)), min(info.max, 1 << 30)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def bits(t):
    """The raw bytes of a tensor as a numpy uint8 array (for bit-exact comparison)."""
    return t.detach().contiguous().reshape(-1).view(__import__("torch").uint8).numpy()


def to_f32(t):
    """fp32 values (numpy, same shape) of a bf16 / fp16 / fp32 tensor, exactly."""
    import numpy as np
    import torch
    if t.dtype == torch.bfloat16:
        u = t.contiguous().view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16
        return u.view(np.float32)
    if t.dtype == torch.float16:
        return t.contiguous().view(torch.int16).numpy().view(np.float16).astype(np.float32)
    return t.contiguous().numpy().astype(np.float32)


def _round_f32(a, dtype):
    """fp32 numpy array -> raw uint8 bytes of ``dtype``, round to nearest even."""
    import numpy as np
    import torch
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == torch.float32:
        return a.view(np.uint8)
    if dtype == torch.float16:
        return a.astype(np.float16).view(np.uint8)
    if dtype == torch.bfloat16:
        u = a.view(np.uint32).astype(np.uint64)
        nan = np.isnan(a)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
        return r.view(np.uint8)
    raise TypeError(dtype)


def reduce_scatter_reference(inputs, rank: int):
    """Raw bytes of chunk ``rank`` of the sum of ``inputs`` (one per rank, in rank order):
    fp32 sum in rank order starting from rank 0's value, rounded once (numpy)."""
    world = len(inputs)
    m = inputs[0].shape[0] // world
    acc = None
    for x in inputs:
        part = to_f32(x[rank * m:(rank + 1) * m].reshape(-1))
        acc = part.copy() if acc is None else acc + part
    return _round_f32(acc, inputs[0].dtype)


def all_reduce_reference(inputs, op: str = "sum"):
    """Raw bytes of the all-reduce of ``inputs`` (one per rank, in rank order, any shape):
    fp32 sum in rank order starting from rank 0's value; ``op="avg"``: divided once by the
    world size in fp32; rounded once (numpy)."""
    import numpy as np
    acc = None
    for x in inputs:
        part = to_f32(x.reshape(-1))
        acc = part.copy() if acc is None else acc + part
    if op == "avg":
        acc = (acc / np.float32(len(inputs))).astype(np.float32)
    return _round_f32(acc, inputs[0].dtype)


def all_gather_reference(inputs):
    """Raw bytes of the gathered tensor."""
    import numpy as np
    return np.concatenate([bits(x) for x in inputs]) if inputs else np.zeros(0, np.uint8)


def all_to_all_reference(inputs, rank: int):
    """Raw bytes of rank ``rank``'s all-to-all result: block ``rank`` of every rank's input
    (each ``[world * m, ...]``), in rank order."""
    import numpy as np
    W = len(inputs)
    m = inputs[0].shape[0] // W
    return np.concatenate([bits(x[rank * m:(rank + 1) * m]) for x in inputs])


# ---- MoE finalize (docs/CONTRACT.md "MoE finalize"): inputs and a numpy reference ------

def fma_f32(a, b, c):
    """fp32 fused multiply-add ``round_f32(a * b + c)`` (one rounding, nearest even) in numpy,
    elementwise with broadcasting: the product of two fp32 values is exact in float64; the
    float64 sum is made round-to-odd (TwoSum error term, then one ulp toward it when the
    rounded sum is inexact and even), and rounding a round-to-odd value with 53 >= 24 + 2 bits
    to fp32 gives the correctly rounded result (Boldo & Melquiond), so this equals C's
    ``fmaf`` / CUDA's ``__fmaf_rn`` bit for bit (NaN payloads aside)."""
    import numpy as np
    a = np.asarray(a, np.float32).astype(np.float64)
    b = np.asarray(b, np.float32).astype(np.float64)
    c = np.asarray(c, np.float32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        p = a * b  # exact: 24 + 24 significant bits
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)  # s + err == p + c exactly
        fix = np.isfinite(s) & (err != 0) & ((s.view(np.int64) & 1) == 0)
        s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def make_rows(g, n: int, H: int, fp8: bool, scale: float):
    """``n`` rows of ``H`` drawn from ``g``: bf16 times ``scale`` (scales None), or e4m3 with
    fp32 scales per 128 columns (times ``scale``): what the finalize's expert rows and the
    expert-parallel tokens share."""
    import torch
    if fp8:
        # Clamped: torch versions differ on out-of-range e4m3 conversion (NaN or saturate).
        x = (torch.randn((n, H), generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        e = torch.randint(-8, 3, (n, H // 128), generator=g).to(torch.float32)
        return x, torch.exp2(e) * (1 + torch.rand((n, H // 128), generator=g)) * scale
    return (torch.randn((n, H), generator=g) * scale).to(torch.bfloat16), None


def make_finalize_input(seed: int, rank: int, *, tokens: int, hidden: int, topk: int,
                        experts_rows: int, fp8: bool = False, pow2_weights: bool = True):
    """One rank's finalize inputs for test ``seed`` (any rank can rebuild any other's):
    dict(y, pos, weights, shared, y_scales). ``y`` is bf16 ``[R, H]`` or float8_e4m3fn with
    fp32 ``y_scales`` ``[R, H / 128]``; ``pos`` int32 ``[T * topk]`` in ``[0, R)``; weights fp32
    ``[T, topk]``: powers of two (then FMA equals multiply-add) or general values, with some
    zeros; shared bf16 ``[T, H]`` with some -0.0."""
    import torch
    g = torch.Generator().manual_seed((seed * 1_000_003 + rank * 7919 + 17) & 0x7FFFFFFFFFFF)
    T, H, R = tokens, hidden, experts_rows
    scale = float(2.0 ** (rank % 3 - 1))
    y, y_scales = make_rows(g, R, H, fp8, scale)
    pos = torch.randint(0, max(R, 1), (T * topk,), generator=g, dtype=torch.int32)
    weights, shared = make_weights_and_shared(g, T, topk, H, scale, pow2_weights)
    return dict(y=y, pos=pos, weights=weights, shared=shared, y_scales=y_scales)


def make_weights_and_shared(g, T: int, topk: int, H: int, scale: float, pow2_weights: bool):
    """Routing weights fp32 ``[T, topk]`` (powers of two, where FMA equals multiply-add, or
    general values; every 11th zero) and a shared-expert output bf16 ``[T, H]`` (every 7th
    -0.0), drawn from ``g``: what the finalize and expert-parallel inputs share."""
    import torch
    if pow2_weights:
        ex = torch.randint(-6, 2, (T, topk), generator=g).to(torch.float32)
        sign = torch.where(torch.rand((T, topk), generator=g) < 0.25, -1.0, 1.0)
        weights = sign * torch.exp2(ex)
    else:
        weights = torch.rand((T, topk), generator=g, dtype=torch.float32) * 2 - 0.5
    if weights.numel():
        weights.view(-1)[::11] = 0.0
    shared = (torch.randn((T, H), generator=g) * scale).to(torch.bfloat16)
    if shared.numel():
        shared.view(-1)[::7] = -0.0
    return weights, shared


def finalize_rows_reference(inp: dict, num_tokens: int, padded_tokens: int):
    """One rank's finalize rows, ``[Tpad, H]`` fp32 values of the bf16-rounded rows (numpy):
    the fp32 FMA chain in k order by :func:`fma_f32`, e4m3 decoded by torch's own
    float8_e4m3fn conversion, times the scale in fp32."""
    import numpy as np
    import torch
    y, pos, w, shared, scales = (inp["y"], inp["pos"], inp["weights"], inp["shared"],
                                 inp.get("y_scales"))
    T, Tpad = num_tokens, padded_tokens
    H = shared.shape[1]
    topk = w.shape[1]
    if scales is not None:
        yv = y.view(torch.float8_e4m3fn) if y.dtype == torch.uint8 else y
        yf = yv.to(torch.float32).numpy()
        yf = (yf * np.repeat(scales.numpy().astype(np.float32), 128, axis=1)).astype(np.float32)
    else:
        yf = to_f32(y.reshape(-1)).reshape(y.shape[0], H) if y.numel() else \
            np.zeros((y.shape[0], H), np.float32)
    acc = to_f32(shared[:T].reshape(-1)).reshape(T, H)
    p = pos.reshape(-1)[:T * topk].numpy().reshape(T, topk).astype(np.int64)
    wn = w[:T].numpy().astype(np.float32)
    for k in range(topk):
        acc = fma_f32(wn[:, k:k + 1], yf[p[:, k]], acc)
    rows = np.zeros((Tpad, H), np.float32)
    rows[:T] = acc
    return bf16_bits_to_f32(finalize_bf16_bits(rows))


def finalize_bf16_bits(a):
    """uint16 bf16 bits of an fp32 numpy array as the finalize rounds (nearest even; a NaN
    element is the canonical NaN 0x7FFF)."""
    import numpy as np
    import torch
    a = np.ascontiguousarray(a, dtype=np.float32)
    raw = _round_f32(a.reshape(-1), torch.bfloat16).view(np.uint16).reshape(a.shape)
    raw[np.isnan(a)] = 0x7FFF
    return raw


def bf16_bits_to_f32(raw):
    """fp32 values of bfloat16 bits (a uint8 or uint16 numpy array, same shape in 16-bit
    units), exactly."""
    import numpy as np
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def moe_finalize_reference(inputs: list, rank: int, num_tokens: int, padded_tokens: int,
                           rows: list | None = None):
    """Raw bytes of rank ``rank``'s result of ``moe_finalize_reduce_scatter`` given every
    rank's inputs (in rank order): each rank's rows rounded to bf16, this rank's chunk
    summed over ranks in rank order in fp32 (starting from rank 0's value), rounded once.
    ``rows``: every rank's :func:`finalize_rows_reference`, if already computed."""
    import torch
    world = len(inputs)
    m = padded_tokens // world
    if rows is None:
        rows = [finalize_rows_reference(inp, num_tokens, padded_tokens) for inp in inputs]
    acc = None
    for full in rows:
        part = full[rank * m:(rank + 1) * m]
        acc = part.copy() if acc is None else acc + part
    return _round_f32(acc.reshape(-1), torch.bfloat16)
