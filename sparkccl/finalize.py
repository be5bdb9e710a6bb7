"""The MoE finalize fused into the reduce-scatter (docs/CONTRACT.md §4): input checks and the validated
inputs the data planes work from.

Under sequence parallelism every rank holds partial MoE outputs for all T tokens; token row

    row[t] = shared[t] + sum_k w[t, k] * y[pos[t * topk + k]]

(an fp32 FMA chain in k order: ``acc = float(shared[t]); acc = fma(w, yv, acc)`` for
k = 0..topk-1, rounded once to bf16; ``yv = float(e4m3) * scale[p, col // 128]`` for e4m3 y)
is computed straight into the reduce-scatter's send slot, rows ``T <= t < Tpad`` are zero,
and this rank's ``Tpad / world`` rows are then summed over ranks in rank order (fp32,
rounded once). See :meth:`sparkccl.Communicator.moe_finalize_reduce_scatter`.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from . import checks

MAX_TOPK = 16
MIN_ROWS_PER_RANK = 8  # one row per piece at least
SCALE_COLS = checks.SCALE_COLS  # one e4m3 scale per (row, 128 columns)

_FP8 = getattr(torch, "float8_e4m3fn", None)
Y_DTYPES = tuple(d for d in (torch.bfloat16, _FP8, torch.uint8) if d is not None)


@dataclass
class FinalizeInputs:
    """Checked inputs (contiguous, on the communicator's device). ``y`` is the bf16 tensor or
    the e4m3 bytes as uint8."""

    y: torch.Tensor
    scales: torch.Tensor | None
    pos: torch.Tensor
    weights: torch.Tensor
    shared: torch.Tensor
    num_tokens: int
    padded_tokens: int
    world: int
    topk: int
    H: int
    R: int

    @property
    def fp8(self) -> bool:
        return self.scales is not None

    @property
    def rows_per_rank(self) -> int:
        return self.padded_tokens // self.world

    @property
    def row_bytes(self) -> int:
        return 2 * self.H

    def native_args(self) -> tuple:
        """Leading arguments of ``_native.finalize_rows`` (CPU tensors)."""
        return (self.y.data_ptr(), self.fp8,
                self.scales.data_ptr() if self.scales is not None else 0,
                self.pos.data_ptr(), self.weights.data_ptr(), self.shared.data_ptr(),
                self.num_tokens, self.topk, self.H, self.R)


def _int(v, name: str, what: str) -> int:
    if isinstance(v, bool):
        raise TypeError(f"{what}: {name} must be an int, got bool")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{what}: {name} must be an int, got {type(v).__name__}") from None


def check_inputs(comm, what: str, y, pos, weights, shared, num_tokens, padded_tokens,
                 y_scales) -> FinalizeInputs:
    """Every check that can be made before anything is sent; raises ``TypeError`` /
    ``ValueError`` saying what to change. ``comm`` provides ``world_size``, ``device``,
    ``slot_bytes`` and ``max_slice``."""
    W = comm.world_size
    T = _int(num_tokens, "num_tokens", what)
    Tpad = _int(padded_tokens, "padded_tokens", what)
    names = (("y", y), ("pos", pos), ("weights", weights), ("shared", shared))
    for name, t in names + ((("y_scales", y_scales),) if y_scales is not None else ()):
        checks.tensor(t, comm.device, what, name)

    if y.dtype not in Y_DTYPES:
        raise TypeError(f"{what}: y must be torch.bfloat16, or e4m3 values (torch.float8_e4m3fn, "
                        f"or their bytes as torch.uint8) with y_scales; got {y.dtype}")
    fp8 = y.dtype != torch.bfloat16
    if y.dim() != 2:
        raise ValueError(f"{what}: y must be [R, H], got shape {list(y.shape)}")
    R, H = int(y.shape[0]), int(y.shape[1])
    if H <= 0 or H % 8:
        raise ValueError(f"{what}: the hidden size H = {H} (y.shape[1]) must be a positive "
                         "multiple of 8")
    checks.scales(y_scales, fp8, R, H, what, "y_scales", f"y ({y.dtype}) values", "R, H")

    if shared.dtype != torch.bfloat16:
        raise TypeError(f"{what}: shared must be torch.bfloat16, got {shared.dtype}")
    if shared.dim() != 2 or shared.shape[1] != H:
        raise ValueError(f"{what}: shared must be [T, H] = [{T}, {H}], got {list(shared.shape)}")
    if weights.dtype != torch.float32:
        raise TypeError(f"{what}: weights must be torch.float32 (routing weights [T, topk]), got "
                        f"{weights.dtype}")
    if weights.dim() != 2:
        raise ValueError(f"{what}: weights must be [T, topk], got shape {list(weights.shape)}")
    topk = int(weights.shape[1])
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"{what}: topk = {topk} (weights.shape[1]) must be 1..{MAX_TOPK}")
    if pos.dtype != torch.int32:
        raise TypeError(f"{what}: pos must be torch.int32 (row of y for each (token, k)), got "
                        f"{pos.dtype}; pass pos.to(torch.int32)")
    if pos.dim() == 1:
        pos_rows = int(pos.shape[0]) // topk if int(pos.shape[0]) % topk == 0 else -1
    elif pos.dim() == 2 and pos.shape[1] == topk:
        pos_rows = int(pos.shape[0])
    else:
        pos_rows = -1
    if pos_rows < 0:
        raise ValueError(f"{what}: pos must be [T * topk] (or [T, topk]) with topk = {topk}, got "
                         f"shape {list(pos.shape)}")

    if T < 0 or Tpad <= 0:
        raise ValueError(f"{what}: num_tokens = {T} must be >= 0 and padded_tokens = {Tpad} > 0")
    if T > Tpad:
        raise ValueError(f"{what}: num_tokens = {T} must be <= padded_tokens = {Tpad}")
    if Tpad % W:
        raise ValueError(f"{what}: padded_tokens = {Tpad} must be a multiple of the world size "
                         f"{W}; pad it to {-(-Tpad // W) * W}")
    if Tpad // W < MIN_ROWS_PER_RANK:
        raise ValueError(f"{what}: padded_tokens / world = {Tpad // W} rows per rank must be at "
                         f"least {MIN_ROWS_PER_RANK}; pad to padded_tokens >= "
                         f"{MIN_ROWS_PER_RANK * W}")
    for name, rows in (("shared", int(shared.shape[0])), ("weights", int(weights.shape[0])),
                       ("pos", pos_rows)):
        if rows < T:
            shape = f"[{T} * {topk}]" if name == "pos" and pos.dim() == 1 else \
                f"[{T}, {H if name == 'shared' else topk}]"
            raise ValueError(f"{what}: {name} has rows for {rows} tokens, fewer than num_tokens = "
                             f"{T}; it must be {shape} (rows past num_tokens are ignored)")
    row_bytes = 2 * H
    if MIN_ROWS_PER_RANK * row_bytes > comm.max_slice:
        # A collective carries a multiple of 8 rows per rank (one per row piece at least).
        need = W * MIN_ROWS_PER_RANK * row_bytes
        full = W * row_bytes * -(-(Tpad // W) // MIN_ROWS_PER_RANK) * MIN_ROWS_PER_RANK
        raise ValueError(f"{what}: {MIN_ROWS_PER_RANK} rows per rank ({W} x "
                         f"{MIN_ROWS_PER_RANK} x {row_bytes} bytes, H = {H}) do not fit a "
                         f"reduce-scatter slot of {comm.slot_bytes} bytes; raise slot_bytes "
                         f"(or SPARKCCL_SLOT_BYTES) to at least {need} ({full} for one "
                         "collective per call)")

    yb = y.view(torch.uint8) if fp8 else y
    pos_flat = pos.reshape(-1)
    if T > 0 and pos.device.type == "cpu":
        # On CUDA this would synchronize the stream: the kernel checks instead (an
        # out-of-range term is NaN, never read out of bounds) and synchronize() raises.
        p = pos_flat[:T * topk]
        bad = ((p < 0) | (p >= R)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"{what}: pos[{i}] = {int(p[i])} (token {i // topk}, k {i % topk}) is "
                             f"not a row of y (0 <= pos < R = {R}); {bad.numel()} such entries")
    return FinalizeInputs(y=yb, scales=y_scales, pos=pos_flat, weights=weights, shared=shared,
                          num_tokens=T, padded_tokens=Tpad, world=W, topk=topk, H=H, R=R)


def single_rank(nat, f: FinalizeInputs, out: torch.Tensor) -> None:
    """World 1: this rank's rows are the whole result. The same native FMA chain as the CPU
    data plane (inputs moved to the host first if they are on a GPU); the sum of one term
    rounded once is the row itself, so the rows are copied as they are (not through fp32:
    torch's fp32 -> bf16 conversion turns the canonical NaN 0x7FFF into 0xFFFF)."""
    if f.y.device.type != "cpu":
        f = FinalizeInputs(**{**f.__dict__, **{k: getattr(f, k).cpu() for k in
                                               ("y", "pos", "weights", "shared")},
                              "scales": None if f.scales is None else f.scales.cpu()})
        p = f.pos[:f.num_tokens * f.topk]
        bad = ((p < 0) | (p >= f.R)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"moe_finalize_reduce_scatter: pos[{i}] = {int(p[i])} is not a row "
                             f"of y (0 <= pos < R = {f.R}); {bad.numel()} such entries")
    direct = (out.device.type == "cpu" and out.dtype == torch.bfloat16 and out.is_contiguous()
              and tuple(out.shape) == (f.padded_tokens, f.H))
    rows = out if direct else torch.empty((f.padded_tokens, f.H), dtype=torch.bfloat16)
    if rows.numel():
        nat.finalize_rows(*f.native_args(), 0, f.padded_tokens, rows.data_ptr())
    if not direct:
        out.copy_(rows)
