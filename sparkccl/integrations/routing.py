"""Which engine collectives go to sparkccl and which stay on the engine's own path.

One rule for the vLLM plugin and the SGLang hook. It looks only at the call's shape,
dtype, dim, the group's size and the settings, which every rank of a tensor-parallel
group has alike, so every rank takes the same side. A rank that went to sparkccl while a
peer went to NCCL would wait for that peer until a timeout: anything that could differ
between ranks (contiguity, the tensor's address) is therefore never part of the rule;
the adapters cope with it (a copy) instead.

Graph capture is the one runtime condition, passed in by the caller (every rank captures
the same graphs). Captured calls decline unless ``SPARKCCL_ENGINE_CAPTURED=1``: the
Communicator can be captured (docs/CONTRACT.md "CUDA graphs"), but from its first capture
on the host no longer knows which slot a call uses, so every later eager reduce-scatter
copies its input (``reduce_scatter_input`` hands out plain tensors) and mode "ce" runs as
"fused" — a cost to eager prefill, against graphs that replay sparkccl collectives. Which
is better depends on the engine's graphs; it has not been measured with an engine, so it
is a setting, off by default. A captured reduce-scatter also declines while the
communicator's reduce-scatter buffers do not exist yet (their setup cannot be captured):
the caller says so (``rs_ready``), alike on every rank, since every rank made the same
calls before; for an all-reduce, whether its regime needs them
(:func:`sparkccl.allreduce.capturable`).

All-reduce (the tensor-parallel default: two per layer) routes at every size when
``SPARKCCL_ENGINE_ALL_REDUCE`` is on (the default): it is the rank-order sum at every size
only if every size takes it, and sparkccl picks its own small-tensor path (one shot).
``SPARKCCL_ENGINE_MIN_BYTES`` applies to all-gather and reduce-scatter only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from .. import config
from ..checks import REDUCE_DTYPES
from ..errors import ConfigError

OPS = ("all_gather", "reduce_scatter", "all_reduce")
# reduce-scatter sums in fp32 and rounds once; other dtypes have no exact sparkccl path.
RS_DTYPES = REDUCE_DTYPES


@dataclass(frozen=True)
class RouteSettings:
    min_bytes: int    # whole collective (all ranks' bytes), as sparkccl bench's "size"
    topology: str
    transport: str
    captured: bool = False  # calls under CUDA graph capture route too
    all_reduce: bool = True  # the group's all-reduce routes (at every size)
    ep_partial: bool = False  # the EP hooks' combine: partial=True

    @classmethod
    def from_env(cls, env=None) -> "RouteSettings":
        """From ``SPARKCCL_ENGINE_MIN_BYTES`` / ``_TOPOLOGY`` / ``_TRANSPORT`` /
        ``_CAPTURED`` / ``_ALL_REDUCE`` / ``_EP_PARTIAL`` (raises ``ConfigError`` naming a
        bad value)."""
        return cls(min_bytes=config.get("SPARKCCL_ENGINE_MIN_BYTES", env),
                   topology=config.get("SPARKCCL_ENGINE_TOPOLOGY", env),
                   transport=config.get("SPARKCCL_ENGINE_TRANSPORT", env),
                   captured=config.get("SPARKCCL_ENGINE_CAPTURED", env),
                   all_reduce=config.get("SPARKCCL_ENGINE_ALL_REDUCE", env),
                   ep_partial=config.get("SPARKCCL_ENGINE_EP_PARTIAL", env))


def agreed_settings(group, what: str, env=None) -> RouteSettings:
    """The routing settings, read on every rank of ``group`` (a gloo ProcessGroup;
    collective) and checked alike: a value that does not parse on any rank raises
    ``ConfigError`` on every rank, and ranks that disagree raise ``ValueError`` on every
    rank, naming them — never one rank failing while the others wait for it."""
    import torch.distributed as dist
    try:
        s, error = RouteSettings.from_env(env), None
        mine = (s.min_bytes, s.topology, s.transport, s.captured, s.all_reduce, s.ep_partial)
    except ConfigError as e:
        s, mine, error = None, None, str(e)
    seen: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, (mine, error), group=group)
    errors = [f"rank {i}: {e}" for i, (_, e) in enumerate(seen) if e is not None]
    if errors:
        raise ConfigError(f"sparkccl: {what}: " + "; ".join(errors))
    if any(m != seen[0][0] for m, _ in seen):
        rows = "; ".join(f"rank {i}: min_bytes={m[0]} topology={m[1]} transport={m[2]} "
                         f"captured={int(m[3])} all_reduce={int(m[4])} ep_partial={int(m[5])}"
                         for i, (m, _) in enumerate(seen))
        raise ValueError(f"sparkccl: {what}: the ranks disagree on SPARKCCL_ENGINE_MIN_BYTES "
                         f"/ _TOPOLOGY / _TRANSPORT / _CAPTURED / _ALL_REDUCE / _EP_PARTIAL "
                         f"({rows}); set them alike on "
                         "every rank, or ranks would pick different paths for one collective "
                         "and hang")
    return s


class Decision(NamedTuple):
    route: bool   # True: sparkccl; False: the engine's own path
    reason: str   # why, short enough for a counter key and a debug line

    def __bool__(self) -> bool:
        return self.route


def should_route(op: str, shape: Sequence[int], dtype: torch.dtype, dim: int, world: int,
                 settings: RouteSettings, *, capturing: bool = False,
                 sizes: Sequence[int] | None = None, rs_ready: bool = True) -> Decision:
    """Whether ``op`` on a per-rank input of ``shape`` / ``dtype`` along ``dim`` goes to
    sparkccl. ``sizes``: per-rank row counts of a ``*v`` collective (None: equal).
    ``rs_ready``: the buffers the call needs exist (asked under capture): for a
    reduce-scatter the communicator's reduce-scatter buffers, for an all-reduce
    :func:`sparkccl.allreduce.capturable`.

    all-gather: ``shape`` is one rank's input; reduce-scatter: the full input
    ``[world * m, ...]``; all-reduce: the tensor (``dim`` is not looked at). The size
    compared with ``settings.min_bytes`` is the whole buffer (gathered output /
    reduce-scatter input); an all-reduce routes at every size.
    """
    if op not in OPS:
        raise ValueError(f"op={op!r}: must be one of {', '.join(OPS)}")
    if op == "all_reduce" and not settings.all_reduce:
        return Decision(False, "all-reduce off")
    if capturing:
        if not settings.captured:
            return Decision(False, "graph capture")
        if op != "all_gather" and not rs_ready:
            return Decision(False, "graph capture before the first reduce-scatter")
    if world < 2:
        return Decision(False, "single rank")
    if op == "all_reduce":
        if dtype not in RS_DTYPES:
            return Decision(False, f"dtype {dtype}")
        return Decision(math.prod(shape) > 0, "sparkccl" if math.prod(shape) else "empty")
    ndim = len(shape)
    if ndim == 0:
        return Decision(False, "0-dim tensor")
    if not -ndim <= dim < ndim:
        return Decision(False, f"dim {dim} out of range")
    if dim % ndim != 0:
        return Decision(False, "dim != 0")
    if dtype.is_complex or dtype == torch.bool or not _plain(dtype):
        return Decision(False, f"dtype {dtype}")
    if op == "reduce_scatter" and dtype not in RS_DTYPES:
        return Decision(False, f"dtype {dtype}")
    if sizes is not None and (len(sizes) != world or any(s != sizes[0] for s in sizes)):
        return Decision(False, "uneven sizes")
    if op == "reduce_scatter" and shape[0] % world:
        return Decision(False, "uneven sizes")
    nbytes = math.prod(shape) * dtype.itemsize * (world if op == "all_gather" else 1)
    if nbytes == 0:
        return Decision(False, "empty")
    if nbytes < settings.min_bytes:
        return Decision(False, "below threshold")
    return Decision(True, "sparkccl")


def _plain(dtype: torch.dtype) -> bool:
    # Quantized dtypes carry scales outside the bytes; sparkccl moves bytes only.
    return dtype not in (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2)


def stream_capturing() -> bool:
    """True while the current CUDA stream records a graph (False without CUDA)."""
    try:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return False


def describe(group: str, world: int, comm, settings: RouteSettings) -> str:
    """The one start-up line per group: what goes where."""
    captured = ("captured calls too (SPARKCCL_ENGINE_CAPTURED=1); smaller, " if settings.captured
                else "smaller, captured, ")
    ar = ("all_reduce at every size and " if settings.all_reduce else "")
    return (f"sparkccl: {group} (world {world}): {ar}dim-0 all_gather / reduce_scatter from "
            f"{_size(settings.min_bytes)} (whole buffer) on sparkccl, topology {comm.topology}, "
            f"transport {comm.transport}; {captured}other-dim and uneven calls stay on the "
            "engine's NCCL")


def _size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:g} {unit}"
    return f"{n} B"
