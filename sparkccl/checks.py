"""Argument checks shared by the collectives and the MoE finalize: raised before anything
is sent, saying what to change."""
from __future__ import annotations

import torch

# What the reductions (reduce-scatter, all-reduce, their torch and engine routes) take.
REDUCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALE_COLS = 128  # e4m3 values carry one fp32 scale per row and 128 columns


def usable(x, device: torch.device) -> bool:
    """Would :func:`tensor` pass? Asked first, so that a tensor that passes (every call of a
    collective) has each property read once; the checks one by one only tell what failed."""
    return (isinstance(x, torch.Tensor) and x.layout is torch.strided and x.device == device
            and not x.is_quantized and x.is_contiguous())


def tensor(x, device: torch.device, what: str, name: str = "x") -> None:
    if usable(x, device):
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"{what}: {name} must be a dense (strided) tensor, got {x.layout}")
    if x.device != device:
        raise ValueError(f"{what}: {name} is on {x.device}, but this communicator works on "
                         f"{device}; move it with {name}.to({str(device)!r})")
    if x.is_quantized:
        raise TypeError(f"{what}: quantized tensors are not supported; pass "
                        f"{name}.int_repr() or a plain dtype")
    if not x.is_contiguous():
        raise ValueError(f"{what}: {name} must be contiguous; pass {name}.contiguous()")


def out(t, device: torch.device, what: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """``t`` checked against the result's shape and dtype, or a fresh result tensor."""
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if usable(t, device) and t.dtype == dtype and t.shape == shape:
        return t
    tensor(t, device, what, "out")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{what}: out must have shape {list(shape)} and dtype {dtype}, got "
                         f"{list(t.shape)} {t.dtype}")
    return t


def scales(t, fp8: bool, rows: int, H: int, what: str, name: str, values: str,
           shape: str) -> None:
    """The fp32 scales ``t`` (argument ``name``) of ``rows`` x ``H`` e4m3 ``values`` (the
    MoE finalize's y, the EP dispatch's tokens): one per row and SCALE_COLS columns, shape
    ``[rows, H / 128]`` (named ``[shape / 128]`` in the messages); None where the values
    are bf16 (``fp8`` False)."""
    if not fp8:
        if t is not None:
            raise ValueError(f"{what}: {name} is only for e4m3 {values}; these are bf16, pass "
                             f"{name}=None")
        return
    if t is None:
        raise ValueError(f"{what}: e4m3 {values} need {name} (fp32 [{shape} / {SCALE_COLS}], "
                         f"one scale per row and {SCALE_COLS} columns)")
    if H % SCALE_COLS:
        raise ValueError(f"{what}: with {name} the hidden size H = {H} must be a multiple of "
                         f"{SCALE_COLS}")
    if t.dtype != torch.float32:
        raise TypeError(f"{what}: {name} must be torch.float32, got {t.dtype}")
    if tuple(t.shape) != (rows, H // SCALE_COLS):
        raise ValueError(f"{what}: {name} must be [{shape} / {SCALE_COLS}] = "
                         f"[{rows}, {H // SCALE_COLS}], got {list(t.shape)}")
