"""Expert-parallel inputs any rank can rebuild for any other, the stand-in experts, and the
one-box reference of dispatch + combine (``sparkccl demo``, tests/test_expert_parallel.py,
the engine hooks' tests, benchmarks/ep_*.py)."""
from __future__ import annotations

import numpy as np
import torch

from .reference import (bf16_bits_to_f32, finalize_bf16_bits, finalize_rows_reference, fma_f32,
                        make_rows, make_weights_and_shared, to_f32)


def make_ep_input(seed: int, rank: int, *, tokens: int, hidden: int, topk: int,
                  num_experts: int, world: int, fp8: bool = False, pow2_weights: bool = True):
    """Rank ``rank``'s dispatch inputs for test ``seed``: dict(x, x_scales, topk_idx (int64,
    distinct per token), topk_weights, shared). Routing: experts ``e % 5 == 3`` never receive
    a token (when enough others remain), every 4th token has its whole top-k on one rank (when
    a rank holds enough experts, contiguous placement), the rest are random."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + rank * 7919 + 29) & 0x7FFFFFFFFFFF)
    n, H, E, K = tokens, hidden, num_experts, topk
    scale = float(2.0 ** (rank % 3 - 1))
    x, x_scales = make_rows(g, n, H, fp8, scale)
    if not fp8 and x.numel():
        x.view(-1)[::7] = -0.0
    allowed = [e for e in range(E) if e % 5 != 3]
    if len(allowed) < K:
        allowed = list(range(E))
    per = E // world
    idx = torch.empty((n, K), dtype=torch.int64)
    for t in range(n):
        home = [e for e in range((t % world) * per, (t % world + 1) * per) if e in allowed]
        pool = home if t % 4 == 0 and len(home) >= K else allowed
        pick = torch.randperm(len(pool), generator=g)[:K]
        idx[t] = torch.tensor([pool[i] for i in pick.tolist()], dtype=torch.int64)
    w, shared = make_weights_and_shared(g, n, K, H, scale, pow2_weights)
    return dict(x=x, x_scales=x_scales, topk_idx=idx, topk_weights=w, shared=shared)


def decode(x: torch.Tensor, x_scales: torch.Tensor | None) -> torch.Tensor:
    """fp32 values of token rows (e4m3 times its scale per 128 columns)."""
    if x_scales is None:
        return x.float()
    return x.view(torch.float8_e4m3fn).float() * x_scales.repeat_interleave(128, dim=-1)


def expert_fn(expert: int, x: torch.Tensor, x_scales: torch.Tensor | None) -> torch.Tensor:
    """The stand-in for expert ``expert``: elementwise, so its bits do not depend on which
    rows it is given with (the same on the owner and in the one-box reference)."""
    c = 1.0 + expert / 8.0
    return (decode(x, x_scales) * c - expert / 32.0).to(torch.bfloat16)


def one_box_rows(inp: dict) -> torch.Tensor:
    """[n * topk, H]: row t * topk + k = expert topk_idx[t, k] applied to token t."""
    x, s, idx = inp["x"], inp["x_scales"], inp["topk_idx"]
    n, K = idx.shape
    out = torch.empty((n * K, x.shape[1]), dtype=torch.bfloat16)
    for t in range(n):
        for k in range(K):
            out[t * K + k] = expert_fn(int(idx[t, k]), x[t:t + 1],
                                       None if s is None else s[t:t + 1])[0]
    return out


def combine_reference(inp: dict, shared: bool = True, rows: torch.Tensor | None = None
                      ) -> np.ndarray:
    """uint16 bf16 bits ``[n, H]`` of the one-box fused finalize of this rank's tokens (the
    numpy reference of sparkccl/reference.py); ``rows``: the experts' outputs ``[n * topk,
    H]`` bf16 when not the stand-ins' (:func:`one_box_rows`)."""
    n, K = inp["topk_idx"].shape
    H = inp["x"].shape[1]
    sh = inp["shared"] if shared else torch.zeros((n, H), dtype=torch.bfloat16)
    f = dict(y=one_box_rows(inp) if rows is None else rows, pos=torch.arange(n * K, dtype=torch.int32),
             weights=inp["topk_weights"], shared=sh, y_scales=None)
    rows = finalize_rows_reference(f, n, n)
    return (rows.view(np.uint32) >> 16).astype(np.uint16)


def partial_combine_reference(inp: dict, owners: list, world: int,
                              shared: bool = True, rows: torch.Tensor | None = None
                              ) -> np.ndarray:
    """uint16 bf16 bits ``[n, H]`` of ``combine(partial=True)`` for this rank's tokens:
    per rank s (in rank order) the fp32 FMA chain from +0.0 over the k whose expert s owns
    (``owners[e]``), rounded to bf16; those added in fp32 to ``shared`` (or +0.0), rounded
    once. ``rows`` as for :func:`combine_reference`."""
    idx, w = inp["topk_idx"], inp["topk_weights"].numpy().astype(np.float32)
    n, K = idx.shape
    H = inp["x"].shape[1]
    y = to_f32(one_box_rows(inp) if rows is None else rows).reshape(n * K, H)
    acc = to_f32(inp["shared"] if shared else torch.zeros((n, H), dtype=torch.bfloat16))
    own = np.array([[owners[int(e)] for e in row] for row in idx.tolist()],
                   dtype=np.int64).reshape(n, K)
    for s in range(world):
        p = np.zeros((n, H), np.float32)
        for k in range(K):
            m = own[:, k] == s
            p[m] = fma_f32(w[m, k:k + 1], y[np.arange(n)[m] * K + k], p[m])
        p = bf16_bits_to_f32(finalize_bf16_bits(p))
        with np.errstate(invalid="ignore", over="ignore"):
            acc = (acc + p).astype(np.float32)
    return finalize_bf16_bits(acc)


def run_experts(ep, recv) -> torch.Tensor:
    """Every local expert on its received rows, in ``recv.x``'s layout; rows past the counts
    (low-latency mode) are NaN, which combine must never read."""
    H = recv.x.shape[-1]
    out = torch.full((*recv.x.shape[:-1], H), float("nan"), dtype=torch.bfloat16,
                     device=recv.x.device)
    counts = recv.counts.cpu().tolist()
    for e, ge in enumerate(recv.experts):
        if recv.mode == "low_latency":
            rows = slice(0, counts[e])
            xe, se = recv.x[e, rows], None if recv.x_scales is None else recv.x_scales[e, rows]
            out[e, rows] = expert_fn(ge, xe.cpu(), None if se is None else se.cpu()).to(out.device)
        else:
            a, b = int(recv.offsets[e]), int(recv.offsets[e + 1])
            se = None if recv.x_scales is None else recv.x_scales[a:b].cpu()
            out[a:b] = expert_fn(ge, recv.x[a:b].cpu(), se).to(out.device)
    return out
