"""All-reduce: every rank gets the elementwise sum (or mean) over ranks of its ``x``.

The one definition (docs/CONTRACT.md "All-reduce"): the sum is taken in fp32 in rank order
0, 1, ..., world-1, starting from rank 0's value, and rounded once to ``x.dtype``; AVG
divides that fp32 sum once by the world size (an fp32 division) and then rounds once. It
is the same definition as reduce-scatter's, so every rank, topology and transport gets the
same bits, whichever of the two regimes below ran:

* **one shot** (decode, latency-bound sizes): one all-gather of every rank's whole vector
  (on a ring the all-gather relays), then each rank sums the W vectors locally in rank
  order. One collective on the wire; each rank receives (W-1) x n bytes. Where the data
  plane has it (``one_shot_all_reduce``: the CUDA plane), that is one operation, one
  kernel launch that publishes, waits and sums straight from the receive slots into the
  result (docs/PROTOCOL.md "All-reduce"); elsewhere an all-gather and torch adds.
* **two step** (prefill, bandwidth-bound sizes): a reduce-scatter (each rank sums its
  1/W chunk, through the zero-copy input buffer) then an all-gather of the reduced chunks;
  each rank receives 2 (W-1)/W x n bytes. Where the data plane implements it
  (``fused_all_reduce``: the CPU twin; the CUDA plane, one kernel per collective), the two
  are one operation under one sequence
  number: piece c of the rank's reduced chunk is published as all-gather piece c as soon
  as it is summed (docs/PROTOCOL.md "All-reduce"), and AVG's inputs travel in their own
  dtype (the plane divides its fp32 sum before rounding). Elsewhere two collectives.

The crossover is ``SPARKCCL_ALLREDUCE_ONESHOT_BYTES`` (the tensor's bytes, every rank's
is the same), which every rank must agree on (checked at creation): the choice looks at
nothing else, so every rank runs the same collectives.

Both regimes are built only from all-gather, reduce-scatter and elementwise torch ops
queued on the caller's stream: on CUDA nothing synchronizes the host, and the temporaries
come from torch's caching allocator (a CUDA graph capture takes them from its own pool),
so an all-reduce can be captured once the communicator has run one reduce-scatter
eagerly (the reduce-scatter buffers are set up on first use, which cannot be captured).
"""
from __future__ import annotations

import torch

from . import checks
from .dataplane.peer_check import ALL_REDUCE_AVG, ALL_REDUCE_SUM
from .plan.geometry import ALIGN, round_up

OPS = ("sum", "avg")
ONE_SHOT = "one_shot"
TWO_STEP = "two_step"
REGIMES = (ONE_SHOT, TWO_STEP)


def check_op(op, what: str) -> bool:
    """``op`` checked; True for AVG."""
    if not isinstance(op, str):
        raise TypeError(f"{what}: op must be a str ('sum' or 'avg'), got {type(op).__name__}")
    if op.lower() not in OPS:
        raise ValueError(f"{what}: op={op!r}: must be 'sum' or 'avg'")
    return op.lower() == "avg"


def regime_for(comm, nbytes: int) -> str:
    """The regime an all-reduce of ``nbytes`` (per rank) runs in on ``comm``: a function of
    the size and the agreed setting only, so the same on every rank."""
    return ONE_SHOT if nbytes <= comm.allreduce_oneshot_bytes else TWO_STEP


def capturable(comm, nbytes: int) -> bool:
    """Can an all-reduce of ``nbytes`` be captured in a CUDA graph now? One shot: always;
    reduce-scatter + all-gather: once the reduce-scatter buffers exist (their setup cannot
    be captured). The same answer on every rank that made the same calls before."""
    return regime_for(comm, nbytes) == ONE_SHOT or comm.rs_ready


def all_reduce(comm, x: torch.Tensor, op: str, out: torch.Tensor | None, *, fused_op,
               one_shot_op=None, regime: str | None = None,
               fused: bool | None = None) -> torch.Tensor:
    """:meth:`sparkccl.Communicator.all_reduce`, which checks that ``comm`` is open and
    passes ``fused_op(flat, avg, dst)``, its fused operation, and ``one_shot_op(flat, avg,
    dst)``, the one-shot regime as the data plane's one operation (used where the plane has
    it, ``one_shot_all_reduce``, and the vector fits one slot); ``regime`` forces one,
    ``fused=False`` the two-step regime's two collectives where the plane has the fused
    operation (tests, benchmarks: ``Communicator.all_reduce`` takes both too)."""
    what = "all_reduce"
    checks.tensor(x, comm.device, what)
    if x.dtype not in checks.REDUCE_DTYPES:
        raise TypeError(f"{what}: dtype {x.dtype} is not supported; use torch.bfloat16, "
                        "torch.float16 or torch.float32 (e.g. x.to(torch.bfloat16))")
    avg = check_op(op, what)
    if regime is not None and regime not in REGIMES:
        raise ValueError(f"{what}: regime={regime!r}: must be one of {', '.join(REGIMES)}")
    out = checks.out(out, comm.device, what, tuple(x.shape), x.dtype)
    n = x.numel()
    if n == 0:  # every rank has the same empty shape: nothing to send, no sequence number
        return out
    dst = out.view(-1)
    if comm.single:  # the sum of one term (divided by 1) is the term itself
        dst.copy_(x.detach().reshape(-1))
        return out
    flat = x.detach().reshape(-1)
    if (regime or regime_for(comm, x.nbytes)) == ONE_SHOT:
        # (out partly over x, shifted: the kernel would read terms it already wrote; the LL
        # way copies x first, and must be taken by every rank: its wire is its own)
        plane = comm.data_plane
        if (one_shot_op is not None and plane.one_shot_all_reduce
                and x.nbytes <= comm.max_slice
                and (dst.data_ptr() == flat.data_ptr() or not _overlaps(dst, flat)
                     or plane.ll_for(x.nbytes))):
            one_shot_op(flat, avg, dst)
        else:
            _one_shot(comm, flat, avg, dst)
    elif (comm.data_plane.fused_all_reduce if fused is None else fused):
        fused_op(flat, avg, dst)
    else:
        _two_collectives(comm, flat, avg, dst)
    return out


def _one_shot(comm, flat: torch.Tensor, avg: bool, dst: torch.Tensor) -> None:
    n, W = flat.numel(), comm.world_size
    # The peers compare it as this all-reduce (sum or avg, the caller's size), as they do
    # the data plane's one-shot operation, which carries the same call word.
    kind = ALL_REDUCE_AVG if avg else ALL_REDUCE_SUM
    gathered = comm.all_gather(flat, part_of=(kind, flat.nbytes))
    rank_order_sum([gathered[r * n:(r + 1) * n] for r in range(W)], avg, dst)


def _two_collectives(comm, flat: torch.Tensor, avg: bool, dst: torch.Tensor) -> None:
    n, W = flat.numel(), comm.world_size
    # AVG divides the fp32 sum, not a sum already rounded to 16 bits: its reduce-scatter
    # runs in fp32 (the values convert exactly; the same fp32 additions in the same order).
    work = torch.float32 if avg else flat.dtype
    # Chunks of a multiple of 16 bytes: the input can be the send slot itself (zero-copy).
    total = padded(n, W, work)[0]
    buf = comm.reduce_scatter_input((total,), work)
    buf[:n].copy_(flat)
    if total > n:
        buf[n:].zero_()  # its sums are computed and dropped
    # The peers compare each step with theirs as a part of this all-reduce (its op, the
    # caller's size): a sum beside an average, or sizes that pad to one chunk, fail.
    kind = ALL_REDUCE_AVG if avg else ALL_REDUCE_SUM
    chunk = comm.reduce_scatter(buf, part_of=(kind, n * work.itemsize))
    if avg:
        chunk = divide(chunk, W).to(dst.dtype)
    part = (kind, n * dst.dtype.itemsize)
    if total == n:
        comm.all_gather(chunk, out=dst, part_of=part)
    else:
        dst.copy_(comm.all_gather(chunk, part_of=part)[:n])


def padded(n: int, world: int, dtype: torch.dtype) -> tuple[int, int]:
    """(elements, chunk bytes) of ``n`` elements padded with zeros to ``world`` chunks of a
    multiple of 16 bytes: the two-step regime's shape (the fused operation's chunks)."""
    total = round_up(n, world * (ALIGN // dtype.itemsize))
    return total, total // world * dtype.itemsize


def zero_bytes(nbytes: int, chunk: int, world: int, off: int, L: int) -> int:
    """The zero bytes one collective of the fused operation carries (its ring entries say
    it, docs/PROTOCOL.md "Publish ring"): the caller's ``nbytes`` padded to
    ``world`` chunks of ``chunk`` bytes, of which the collective moves ``[off, off + L)``
    of every chunk."""
    return sum(max(0, min(j * chunk + off + L, world * chunk) - max(j * chunk + off, nbytes))
               for j in range(world))


def rank_order_sum(parts: list, avg: bool, dst: torch.Tensor) -> None:
    """``dst`` = the sum of ``parts`` (rank 0's first) in fp32, AVG divided once, rounded
    once. One elementwise add per term, in order (never a reduction over the rank
    dimension, whose order torch does not specify)."""
    if dst.dtype == torch.float32 and not any(_overlaps(dst, p) for p in parts[1:]):
        acc = dst
        acc.copy_(parts[0])
    else:
        acc = parts[0].to(torch.float32, copy=True)
    for p in parts[1:]:
        acc.add_(p)  # a 16-bit term converts exactly to fp32; one fp32 rounding per add
    if avg:
        divide(acc, len(parts))
    if acc is not dst:
        dst.copy_(acc)  # the one rounding to dst's dtype (round to nearest even)


def divide(t: torch.Tensor, w: int) -> torch.Tensor:
    """``t /= w`` in place as an IEEE fp32 division of every element. The divisor is a
    tensor on ``t``'s device: torch's CUDA division by a Python number multiplies by the
    reciprocal instead, which rounds differently for a w that is not a power of two."""
    return t.div_(torch.full((1,), float(w), dtype=t.dtype, device=t.device))


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes
