"""What the vLLM and SGLang expert-parallel hooks share (docs/EXPERT_PARALLEL.md "Inside
the engines"): one sparkccl Communicator per engine EP group, one
:class:`sparkccl.ExpertParallel` per layer shape, and the engine-neutral step of each side:

* :func:`dispatch_rows` sends this rank's tokens and returns the rows its experts received
  as an ordinary token batch: ``[R, H]`` (high-throughput receive layout, grouped by local
  expert, (source rank, token) order), each row with top-k 1, its expert's id and weight
  1.0, so any engine expert kernel computes ``expert(row) * 1.0`` — the row itself;
* :func:`combine_rows` returns those rows to their home ranks and finalizes there with the
  routing weights kept at dispatch: the one-box finalize bits (fp32 FMA chain in top-k
  order, rounded once); with ``SPARKCCL_ENGINE_EP_PARTIAL=1`` (agreed by every rank of the
  group, :func:`partial_combine`) the per-rank partial combine instead
  (``ExpertParallel.combine(partial=True)``: an explicit opt-in with other bits);
* :func:`dispatch_batched` / :func:`combine_batched`, the same in the low-latency mode:
  the receive rows in the engines' batched format (``[E_local, world * max_tokens, H]``
  with per-expert counts on the device), nothing read on the host, so a CUDA graph can
  capture them.

Everything here is collective over the EP group, in the same order on every rank, as the
engines' own all-to-all backends are.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from . import routing

log = logging.getLogger("sparkccl.ep")

_lock = threading.Lock()
_comms: dict = {}  # engine group name -> Communicator
_partial: dict = {}  # engine group name -> its combines take partial=True
_eps: dict = {}    # (group name, E, H, T, placement) -> ExpertParallel


def group_comm(cpu_group, device, name: str, what: str):
    """The sparkccl Communicator of an engine's EP group (built once, on every rank of the
    group together: collective)."""
    with _lock:
        comm = _comms.get(name)
        if comm is not None:
            return comm
        from ..comm import Communicator
        s = routing.agreed_settings(cpu_group, what)
        comm = _comms[name] = Communicator(group=cpu_group, device=device,
                                           topology=s.topology, transport=s.transport)
        _partial[name] = s.ep_partial
        log.info("sparkccl: %s (world %d): MoE dispatch / combine on sparkccl, topology %s, "
                 "transport %s, combine %s", what, comm.world_size, comm.topology,
                 comm.transport, "per-rank partial" if s.ep_partial else "one-box exact")
        return comm


def partial_combine(name: str) -> bool:
    """Whether group ``name``'s combines take ``partial=True`` (SPARKCCL_ENGINE_EP_PARTIAL,
    read with the group's other settings when :func:`group_comm` built it: the same on
    every rank)."""
    with _lock:
        return _partial.get(name, False)


def placement_from_local_ids(comm, local_ids: torch.Tensor, num_experts: int) -> list[int]:
    """The owner of every expert, from each rank's map ``global expert id -> local id``
    (-1: not here) gathered over ``comm`` (collective). Refuses (``ValueError``, on every
    rank alike: every rank sees every map) a map that is not a partition of the experts
    or whose local ids do not ascend with the global ids (ExpertParallel's local order)."""
    W = comm.world_size
    maps = comm.all_gather(local_ids.to(device=comm.device, dtype=torch.int32).contiguous())
    maps = maps.view(W, num_experts).cpu()
    owners = []
    for e in range(num_experts):
        held = [r for r in range(W) if int(maps[r, e]) >= 0]
        if len(held) != 1:
            raise ValueError(f"sparkccl EP: expert {e} is held by ranks {held}: the engine's "
                             "expert map must give every expert to exactly one rank "
                             "(redundant experts / EPLB are not supported)")
        owners.append(held[0])
    for r in range(W):
        mine = [int(maps[r, e]) for e in range(num_experts) if owners[e] == r]
        if mine != list(range(len(mine))):
            raise ValueError(f"sparkccl EP: rank {r}'s local expert ids {mine} do not ascend "
                             "with the global ids")
    return owners


def expert_parallel(comm, name: str, *, num_experts: int, hidden: int, max_tokens: int,
                    placement, mode: str = "high_throughput", dtype=torch.bfloat16):
    """One ExpertParallel per (group, layer shape, placement, mode, dispatch dtype), shared
    by the layers that have it (a layer's dispatch and combine run before the next layer's:
    the engines call them in order on one stream)."""
    from ..expert_parallel import ExpertParallel
    key = (name, num_experts, hidden, max_tokens,
           placement if isinstance(placement, str) else tuple(placement), mode, dtype)
    with _lock:
        ep = _eps.get(key)
        if ep is None:
            ep = _eps[key] = ExpertParallel(comm, num_experts=num_experts, hidden=hidden,
                                            max_tokens=max_tokens, dtype=dtype,
                                            mode=mode, placement=placement)
            if mode == "low_latency":  # (fixed buffers: say what they take)
                log.info("sparkccl: %s: low-latency EP, %d experts, hidden %d, max_tokens "
                         "%d, %s: the receive rows alone take %.2f GiB", name, num_experts,
                         hidden, max_tokens, dtype, num_experts * max_tokens * hidden
                         * dtype.itemsize / 2**30)
        return ep


@dataclass
class Dispatched:
    """:func:`dispatch_rows`'s answer: ``x`` ``[R, H]`` bf16, ``expert_global`` /
    ``expert_local`` (int64 ``[R]``: each row's expert), ``counts`` (int32
    ``[E_local]``), and the handle :func:`combine_rows` needs."""

    x: torch.Tensor
    expert_global: torch.Tensor
    expert_local: torch.Tensor
    counts: torch.Tensor
    handle: object


def refuse_capture(rank: int, world: int, capture_hint: str) -> None:
    """Raise ``RuntimeError`` under CUDA graph capture: the high-throughput dispatch of
    :func:`dispatch_rows` cannot be captured."""
    if routing.stream_capturing():
        raise RuntimeError(
            f"sparkccl EP: a MoE dispatch under CUDA graph capture (rank {rank} of {world}): "
            f"the engine hooks' high-throughput dispatch reads the received row count on "
            f"the host, which a graph cannot capture. {capture_hint}")


def dispatch_rows(ep, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, *, capture_hint: str) -> Dispatched:
    """Dispatch this rank's tokens (``[n, H]`` bf16, top-k ids and fp32 weights ``[n, K]``);
    the weights stay with the handle for :func:`combine_rows`. Under CUDA graph capture it
    raises ``RuntimeError`` before anything is sent (the high-throughput mode reads the
    received row count on the host), naming ``capture_hint``: what the engine's user does
    about it. Every rank of the group captures the same layers, so none is left waiting."""
    refuse_capture(ep.rank, ep.world, capture_hint)
    recv, handle = ep.dispatch(x.contiguous(), topk_ids.contiguous(),
                               topk_weights.to(torch.float32).contiguous())
    counts = recv.counts.to(torch.int64)
    dev = recv.x.device
    local = torch.repeat_interleave(torch.arange(len(recv.experts), device=dev), counts)
    glob = torch.tensor(recv.experts, dtype=torch.int64, device=dev)[local]
    return Dispatched(recv.x, glob, local, recv.counts, handle)


def combine_rows(ep, d: Dispatched, expert_out: torch.Tensor,
                 out: torch.Tensor | None = None, *, partial: bool = False) -> torch.Tensor:
    """The expert outputs of ``d``'s rows (``[R, H]`` or ``[R, 1, H]``, bf16) back home,
    finalized: ``[n, H]`` bf16 (into ``out`` when given); ``partial``: the per-rank partial
    combine (:func:`partial_combine` of the group)."""
    R, H = d.x.shape
    return _combine(ep, d.handle, expert_out.reshape(R, H), out, partial)


def _combine(ep, handle, expert_out, out, partial):
    y = ep.combine(expert_out.contiguous(), handle, partial=partial)
    return y if out is None else out.copy_(y)


def dispatch_batched(ep, x: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor, x_scales: torch.Tensor | None = None):
    """Dispatch in the low-latency mode (``ep.mode``): returns ``(recv, handle)``, ``recv.x``
    ``[E_local, world * max_tokens, H]`` (bf16, or e4m3 with ``recv.x_scales`` for an e4m3
    ExpertParallel, ``x_scales`` fp32 ``[n, H / 128]``) with expert ``e``'s rows
    ``recv.x[e, :recv.counts[e]]`` in (source rank, token) order (the engines' batched
    experts format), ``recv.counts`` int32 on the device. Nothing is read on the host:
    capturable, once an eager call has set the buffers up."""
    if ep.mode != "low_latency":
        raise ValueError(f"sparkccl EP: dispatch_batched needs a low-latency ExpertParallel, "
                         f"got mode {ep.mode!r}")
    return ep.dispatch(x.contiguous(), topk_ids.contiguous(),
                       topk_weights.to(torch.float32).contiguous(),
                       None if x_scales is None else x_scales.contiguous())


def combine_batched(ep, handle, expert_out: torch.Tensor, out: torch.Tensor | None = None,
                    *, partial: bool = False) -> torch.Tensor:
    """The expert outputs of a :func:`dispatch_batched` (``recv.x``'s shape, bf16; rows past
    the counts ignored) back home, finalized as :func:`combine_rows`."""
    return _combine(ep, handle, expert_out, out, partial)
