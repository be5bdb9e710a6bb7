"""Expert parallelism: token dispatch to the ranks that hold their experts, and the combine
back to each token's home rank with the MoE finalize (docs/EXPERT_PARALLEL.md).

::

    ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T)
    recv, handle = ep.dispatch(x, topk_idx, topk_weights)   # recv.x: per local expert
    expert_out = run_my_experts(recv)                        # bf16, recv.x's layout
    y = ep.combine(expert_out, handle, shared=shared)        # [n, H] bf16 on the home rank

``y[t] = shared[t] + sum_k topk_weights[t, k] * out(t, k)`` as the fp32 FMA chain in top-k
order, rounded once to bf16: the one-box finalize (on CPU :func:`sparkccl.finalize.single_rank`,
native ``finalize_rows``; on CUDA the data plane's ``fin_unit`` in a kernel of its own,
:mod:`sparkccl.ep_cuda`), so EP gives the same bits as every expert on one box.

The movement is two all-to-alls (:meth:`sparkccl.Communicator.all_to_all`: the
reduce-scatter's wire, so the same slots, roots, ring relays and failure behaviour), each
one block per (source, destination) pair of a capacity every rank knows:

* dispatch: each token goes once to every rank that holds one of its experts, with its
  token index and top-k ids (a block of ``P`` such rows per destination, in token order,
  of which only the rows that exist travel: :class:`BlockLayout`); the receiver keeps the
  entries of its own experts, ordered by (local expert, source rank, token);
* combine: each computed row goes back to its token's home rank at the place that rank
  computed for it at dispatch (the entries (t, k) it sent to that rank, in (t, k) order),
  and the home rank runs the finalize over them.

On CUDA dispatch packs and selects with fused kernels (:mod:`sparkccl.ep_cuda`, both modes);
the torch code here is their specification and the CPU path.

``high_throughput`` learns the capacities from the counts, exchanged first (one small
all-gather: per destination the tokens and the entries; ``P`` = the largest pair), so the
blocks hold the largest pair's rows, not ``max_tokens``; ``low_latency`` uses the fixed
bounds (``max_tokens`` tokens, ``max_tokens * min(topk, E / world)`` entries per pair) and
reads nothing on the host. Both all-to-alls are sized (each block's first bytes say how
much of it carries data, read on the device), so in either mode only each pair's own rows
travel.
"""
from __future__ import annotations

import ctypes
import math
import operator
from dataclasses import dataclass

import torch

from . import checks
from . import finalize as _finalize

MODES = ("high_throughput", "low_latency")
MAX_TOPK = _finalize.MAX_TOPK
SCALE_COLS = _finalize.SCALE_COLS
_FP8 = getattr(torch, "float8_e4m3fn", None)
INDEX_DTYPES = (torch.int32, torch.int64)
NAN_BF16 = 0x7FC0
_ALIGN = 16  # block sections start on 16-byte boundaries (the collectives' granule)


def _round16(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _int(v, name: str, what: str) -> int:
    if isinstance(v, bool):
        raise TypeError(f"{what}: {name} must be an int, got bool")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{what}: {name} must be an int, got {type(v).__name__}") from None


def placement_table(placement, num_experts: int, world: int) -> list[int]:
    """The owner rank of every expert: ``"contiguous"`` (expert e on rank e // (E / world)),
    ``"round_robin"`` (e on rank e % world), or a sequence of E ranks in which every rank
    appears E / world times."""
    what = "ExpertParallel"
    per = num_experts // world
    if isinstance(placement, str):
        if placement == "contiguous":
            return [e // per for e in range(num_experts)]
        if placement == "round_robin":
            return [e % world for e in range(num_experts)]
        raise ValueError(f"{what}: placement={placement!r}: must be 'contiguous', "
                         "'round_robin' or a sequence of num_experts owner ranks")
    try:
        owners = [_int(r, "placement[e]", what) for r in placement]
    except TypeError:
        raise TypeError(f"{what}: placement must be 'contiguous', 'round_robin' or a sequence "
                        f"of ints, got {type(placement).__name__}") from None
    if len(owners) != num_experts:
        raise ValueError(f"{what}: placement has {len(owners)} entries, not num_experts = "
                         f"{num_experts}")
    for r in range(world):
        if owners.count(r) != per:
            raise ValueError(f"{what}: placement gives rank {r} {owners.count(r)} experts; every "
                             f"rank must hold num_experts / world = {per}")
    bad = [r for r in owners if not 0 <= r < world]
    if bad:
        raise ValueError(f"{what}: placement names rank {bad[0]}, outside 0..{world - 1}")
    return owners


def _touch_pages(t: torch.Tensor | None) -> None:
    """Write one byte per 4 KiB page of ``t`` (a fresh CPU tensor whose bytes are written
    later anyway): its page faults are taken now, while the wire runs, not in the copies
    after it."""
    if t is not None and t.numel():
        b = t.view(-1).view(torch.uint8)
        b[::4096].fill_(0)
        b[-1:].fill_(0)


@dataclass
class BlockLayout:
    """One dispatch block (bytes) from a source to a destination, the same size on every
    rank: a 16-byte header whose first 8 bytes (int64, little-endian) say how many of the
    block's bytes carry data (:meth:`data_bytes` of its token count: the all-to-all runs
    ``sized``, so only those travel), then per row ``topk`` int32 (the dispatch puts the
    token index first, then its top-k expert ids; -1: no token in that row), the rows' fp32
    scales (e4m3), then ``T`` token rows (bf16 or e4m3 bytes). Sections start on 16-byte
    boundaries. The ids come first so that a receiver knows where every row goes once the
    block's first bytes are in, and can move the rows as they arrive (the CPU twin does);
    they and the scales travel whole (a few percent of the block), the rows up to the
    block's tokens."""

    T: int
    H: int
    topk: int
    row_bytes: int
    scale_cols: int  # 0 for bf16

    idx_off = 16

    def data_bytes(self, rows):
        """The header's value for a block of ``rows`` tokens (an int or a tensor of them):
        everything up to the end of its last row."""
        return self.x_off + rows * self.row_bytes

    def header(self, blocks: torch.Tensor) -> torch.Tensor:
        """[B] int64 view of the headers of blocks [B, nbytes]."""
        return blocks[:, :8].view(torch.int64).view(-1)

    @property
    def scales_off(self) -> int:
        return self.idx_off + _round16(self.T * self.topk * 4)

    @property
    def x_off(self) -> int:
        return self.scales_off + _round16(self.T * self.scale_cols * 4)

    @property
    def nbytes(self) -> int:
        return self.x_off + _round16(self.T * self.row_bytes)

    def x(self, blocks: torch.Tensor) -> torch.Tensor:
        """[B, T, row_bytes] uint8 views of the token rows of blocks [B, nbytes]."""
        o = self.x_off
        return blocks[:, o:o + self.T * self.row_bytes].view(-1, self.T, self.row_bytes)

    def scales(self, blocks: torch.Tensor) -> torch.Tensor:
        o = self.scales_off
        return blocks[:, o:o + self.T * self.scale_cols * 4].view(
            blocks.shape[0], self.T, self.scale_cols * 4)

    def idx(self, blocks: torch.Tensor) -> torch.Tensor:
        o = self.idx_off
        return blocks[:, o:o + self.T * self.topk * 4].view(blocks.shape[0], self.T, self.topk * 4)


@dataclass
class DispatchResult:
    """What :meth:`ExpertParallel.dispatch` delivers to this rank, on the communicator's
    device, ordered per local expert by (source rank, token index).

    ``high_throughput``: ``x`` is ``[R, H]`` packed (R = the rows this rank received, known
    on the host), local expert e's rows are ``x[offsets[e]:offsets[e + 1]]``.
    ``low_latency``: ``x`` is ``[E_local, world * max_tokens, H]`` (fixed size, nothing
    depends on counts on the host), local expert e's rows are ``x[e, :counts[e]]``; rows
    past the count are undefined.

    ``x_scales`` (e4m3): fp32 per row and 128 columns, the same layout. ``counts``: int32
    ``[E_local]`` on the device. ``src_rank`` / ``src_token`` / ``src_k``: int32 per row, in
    ``x``'s layout (-1 past the counts in low-latency mode). ``experts``: the global ids of
    the local experts, in local order.
    """

    mode: str
    x: torch.Tensor
    x_scales: torch.Tensor | None
    counts: torch.Tensor
    offsets: torch.Tensor | None
    src_rank: torch.Tensor
    src_token: torch.Tensor
    src_k: torch.Tensor
    experts: list

    def expert(self, e: int) -> torch.Tensor:
        """Local expert ``e``'s rows (reads the count on the host: a convenience, not for
        graph capture)."""
        if self.mode == "low_latency":
            return self.x[e, :int(self.counts[e])]
        return self.x[int(self.offsets[e]):int(self.offsets[e + 1])]


@dataclass
class Handle:
    """What :meth:`ExpertParallel.combine` needs from its dispatch: ``feed`` (per row of
    combine's send block, the received row it takes, int64; source s's block holds, from
    row ``s * ret_rows``, that source's entries held here in (token, k) order), the rows of
    a dispatch block and of a combine block (``dispatch_rows``, ``ret_rows``: the same on
    every rank), ``pos`` (int32 ``[n * topk]``: where this rank's entry (t, k) arrives in
    combine's receive block; refused entries point at a NaN row), this rank's token count,
    top-k weights and top-k, the receive layout, and the entries refused on the device
    (CUDA, see :meth:`ExpertParallel.check`).

    ``ret_counts`` (int64 ``[world]``, on the device): the rows this rank returns to each
    home rank in combine, i.e. the entries of home d's tokens held here, at most
    ``ret_rows`` (with ``combine_rows`` the entries past it are refused, not returned).
    Combine (:meth:`ExpertParallel.combine`, sized on every path) sends ``1 +
    ret_counts[d]`` rows of its block for d: a header row, then the data rows.
    ``sized``: its per-handle plan (:class:`SizedCombine`), made once, at dispatch."""

    mode: str
    feed: torch.Tensor
    dispatch_rows: int
    ret_rows: int
    pos: torch.Tensor
    num_tokens: int
    topk: int
    weights: torch.Tensor
    bad_entries: torch.Tensor | None
    recv_shape: tuple
    ret_counts: torch.Tensor
    sized: SizedCombine | None = None
    # the received rows' (token, k) at their source, recv.x's layout flattened: for
    # combine(partial=True), which groups a token's entries held here
    row_token: torch.Tensor | None = None
    row_k: torch.Tensor | None = None


@dataclass
class SizedCombine:
    """The sized combine's layout for one handle (all on the device, made with a few small
    torch ops: no host read, capturable). A block is ``ret_rows + 1`` rows of ``hidden``
    bf16: row 0 a header whose first 8 bytes (int64) are the bytes of the block that carry
    data, ``(1 + ret_counts[d]) * 2 * hidden``, rows 1.. the returned rows (row j + 1 =
    the unsized block's row j). Only those bytes travel (``all_to_all(..., sized=True)``);
    the rest of a received block is undefined, and the finalize never reads it.

    ``feed``: int64 ``[world * (ret_rows + 1)]``, the received row each send row takes
    (header rows: 0, overwritten by ``header`` after the gather); ``header``: int64
    ``[world]``; ``pos``: int32 ``[n * topk]``, ``Handle.pos`` in the receive layout
    ``[world * (ret_rows + 1) + 1, hidden]`` (p -> p + p // ret_rows + 1; the refused
    entries' NaN row ``world * ret_rows`` -> the last row, ``world * (ret_rows + 1)``)."""

    feed: torch.Tensor
    header: torch.Tensor
    pos: torch.Tensor


def _finalize_as_rows_arrive(args: tuple, out: torch.Tensor, W: int, token_rows):
    """A combine's finalize beside its all-to-all (the CPU twin): ``(arrived, finish)``, the
    all-to-all's ``arrived`` hook and what to call after it. Each source's block is a header
    row, then rows in the home's token order; ``token_rows()`` (called at the first arrival:
    this rank's own block, before any wait) gives per source the token of each of its data
    rows, then ``n`` (none left). Once the rows before each source's first missing one are
    in, every token before the least of those tokens has all its rows: those are finalized
    (``_native.finalize_rows`` with ``args``, into ``out``, ``[n, H]`` bf16) while later
    ones travel; ``finish`` finalizes the rest."""
    from . import _native
    n, RB = out.shape[0], 2 * out.shape[1]
    out_p = out.data_ptr()
    have = [0] * W  # data rows of each source's block that are in
    done = [0]      # tokens finalized
    toks: list = []

    def upto(ready):
        if ready > done[0]:
            _native.finalize_rows(*args, done[0], ready - done[0], out_p + done[0] * RB)
            done[0] = ready

    def arrived(source, hi):
        if not toks:
            toks.extend(token_rows())
        have[source] = max(have[source], hi // RB - 1)
        upto(min(t[min(m, len(t) - 1)] for t, m in zip(toks, have)))

    return arrived, lambda: upto(n)


class ExpertParallel:
    """Expert-parallel dispatch and combine over a :class:`sparkccl.Communicator`.

    Args:
        comm: the communicator (every rank of it takes part in every call).
        num_experts: E, a multiple of the world size; each rank holds E / world experts.
        hidden: H, a multiple of 8 (of 128 for e4m3).
        max_tokens: T, the most tokens any rank dispatches in one call.
        dtype: of the dispatched tokens: ``torch.bfloat16``, or e4m3
            (``torch.float8_e4m3fn``, or its bytes as ``torch.uint8``) with ``x_scales``
            (fp32, one per row and 128 columns). Combine takes bf16 expert outputs.
        mode: ``"high_throughput"`` (packed receive rows; their number is read on the host)
            or ``"low_latency"`` (fixed-size receive buffers, no host read in dispatch).
        placement: ``"contiguous"`` (default: expert e on rank e // (E / world)),
            ``"round_robin"``, or a sequence of E owner ranks, E / world each.
        combine_rows: low-latency mode: the rows of a combine block (the expert outputs one
            rank returns to one home rank in a call). Default ``max_tokens * min(topk,
            E / world)``, which no routing exceeds; a smaller value moves less (uniform
            routing needs about ``max_tokens * topk / world``). A call whose routing exceeds
            it is refused for the entries past it: on CUDA on the device (their tokens'
            rows are NaN and :meth:`check` raises, as for a bad expert id), on CPU before
            anything is sent (``ValueError``). The same on every rank.

    All ranks must make the same calls in the same order with the same ``topk``, as for the
    collectives; the token count may differ per rank (up to ``max_tokens``).
    """

    def __init__(self, comm, *, num_experts: int, hidden: int, max_tokens: int,
                 dtype: torch.dtype = torch.bfloat16, mode: str = "high_throughput",
                 placement="contiguous", combine_rows: int | None = None,
                 _fused: bool | None = None):
        what = "ExpertParallel"
        W = comm.world_size
        E = _int(num_experts, "num_experts", what)
        H = _int(hidden, "hidden", what)
        T = _int(max_tokens, "max_tokens", what)
        if E <= 0 or E % W:
            raise ValueError(f"{what}: num_experts = {E} must be a positive multiple of the world "
                             f"size {W}")
        if T <= 0:
            raise ValueError(f"{what}: max_tokens = {T} must be positive")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{what}: dtype must be a torch.dtype, got {type(dtype).__name__}")
        if dtype not in _finalize.Y_DTYPES:
            raise TypeError(f"{what}: dtype must be torch.bfloat16 or e4m3 (torch.float8_e4m3fn, "
                            f"or its bytes as torch.uint8), got {dtype}")
        fp8 = dtype != torch.bfloat16
        if H <= 0 or H % 8:
            raise ValueError(f"{what}: hidden = {H} must be a positive multiple of 8")
        if fp8 and H % SCALE_COLS:
            raise ValueError(f"{what}: with e4m3 tokens hidden = {H} must be a multiple of "
                             f"{SCALE_COLS} (one fp32 scale per 128 columns)")
        if not isinstance(mode, str) or mode not in MODES:
            raise ValueError(f"{what}: mode={mode!r}: must be one of {', '.join(MODES)}")
        if combine_rows is not None:
            combine_rows = _int(combine_rows, "combine_rows", what)
            if mode != "low_latency" or combine_rows <= 0:
                raise ValueError(f"{what}: combine_rows = {combine_rows} needs "
                                 "mode='low_latency' and a positive value (high-throughput "
                                 "sizes its blocks from the counts)")
        self.combine_rows = combine_rows
        self.comm, self.num_experts, self.hidden, self.max_tokens = comm, E, H, T
        self.dtype, self.fp8, self.mode = dtype, fp8, mode
        self.world, self.rank = W, comm.rank
        self.num_local_experts = E // W
        owners = placement_table(placement, E, W)
        self.owners = owners
        local = [0] * E
        seen = [0] * W
        for e, r in enumerate(owners):
            local[e], seen[r] = seen[r], seen[r] + 1
        self.local_experts = [e for e in range(E) if owners[e] == comm.rank]
        dev = comm.device
        self._owner_dev = torch.tensor(owners, dtype=torch.int32, device=dev)
        self._local_dev = torch.tensor(local, dtype=torch.int32, device=dev)
        self._row_bytes = H * (1 if fp8 else 2)
        self._scale_cols = H // SCALE_COLS if fp8 else 0
        self._topk = 1  # of the dispatch being made (the low-latency bounds)
        self._entries_in = None  # high-throughput: the entries the dispatch being made receives
        self._scratch: dict[str, torch.Tensor] = {}
        self._zeros: torch.Tensor | None = None  # (_zero_hidden_rows)
        cuda = dev.type == "cuda"
        # CUDA checks the routing on the device (no stream sync) and counts refused entries
        # there (see check()); the tests turn this on for CPU too.
        self._device_checks = cuda
        # CPU: dispatch's host work in native/src/ep_cpu.cpp (one pass each for the send
        # blocks and the received rows); the torch path below stays the reference (the tests
        # turn this off to compare the two).
        self._native_cpu = dev.type == "cpu"
        # CPU: dispatch's unpack and combine's finalize run beside their all-to-alls, as the
        # rows arrive (arrived, Communicator.all_to_all); False: after them (the same bits;
        # A/B, tests). The send blocks are written into the send slot group by group either way.
        self._stream_cpu = dev.type == "cpu"
        self._bad_entries = torch.zeros((), dtype=torch.int64, device=dev)
        # the sized combine's feed of its header rows (SizedCombine: they gather row 0)
        self._zero_rows = torch.zeros((W, 1), dtype=torch.int64, device=dev)
        self._overflow = torch.zeros((), dtype=torch.int64, device=dev)  # (combine_rows)
        # The finalize kernel's record of a bad pos (never set: combine's pos are 0..n*topk-1).
        self._fin_bad = torch.zeros(4, dtype=torch.int32, device=dev) if cuda else None
        # CUDA dispatch runs fused kernels (ep_cuda: pack and unpack);
        # _fused=False keeps the torch path there, which is the specification (and the CPU
        # path), for the tests that compare the two.
        self._fused = cuda if _fused is None else bool(_fused)
        if self._fused and not cuda:
            raise ValueError(f"{what}: the fused dispatch kernels need a CUDA communicator")
        self._experts_dev = torch.tensor(self.local_experts, dtype=torch.int32, device=dev)
        if cuda:
            from . import ep_cuda
            ep_cuda.kernels(dev.index)  # compiled and loaded before any collective runs

    # ---- checks (everything before anything is sent) ----------------------------------
    def _check_dispatch(self, x, topk_idx, topk_weights, x_scales):
        what = "ExpertParallel.dispatch"
        dev = self.comm.device
        self.comm.check_open(what)
        names = (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights))
        for name, t in names + ((("x_scales", x_scales),) if x_scales is not None else ()):
            checks.tensor(t, dev, what, name)
        H, T = self.hidden, self.max_tokens
        if self.fp8:
            if x.dtype not in (_FP8, torch.uint8) or x.dtype is None:
                raise TypeError(f"{what}: this ExpertParallel dispatches e4m3 tokens: x must be "
                                f"torch.float8_e4m3fn (or its bytes as uint8), got {x.dtype}")
        elif x.dtype != torch.bfloat16:
            raise TypeError(f"{what}: this ExpertParallel dispatches bf16 tokens: x must be "
                            f"torch.bfloat16, got {x.dtype}")
        if x.dim() != 2 or x.shape[1] != H:
            raise ValueError(f"{what}: x must be [n, hidden] = [n, {H}], got {list(x.shape)}")
        n = int(x.shape[0])
        if n > T:
            raise ValueError(f"{what}: {n} tokens (x.shape[0]) exceed max_tokens = {T}")
        if topk_idx.dtype not in INDEX_DTYPES:
            raise TypeError(f"{what}: topk_idx must be torch.int64 or torch.int32, got "
                            f"{topk_idx.dtype}")
        if topk_idx.dim() != 2 or topk_idx.shape[0] != n:
            raise ValueError(f"{what}: topk_idx must be [n, topk] with n = {n}, got "
                             f"{list(topk_idx.shape)}")
        K = int(topk_idx.shape[1])
        if not 1 <= K <= MAX_TOPK:
            raise ValueError(f"{what}: topk = {K} (topk_idx.shape[1]) must be 1..{MAX_TOPK}")
        if topk_weights.dtype != torch.float32:
            raise TypeError(f"{what}: topk_weights must be torch.float32, got "
                            f"{topk_weights.dtype}")
        if tuple(topk_weights.shape) != (n, K):
            raise ValueError(f"{what}: topk_weights must be [n, topk] = [{n}, {K}], got "
                             f"{list(topk_weights.shape)}")
        checks.scales(x_scales, self.fp8, n, H, what, "x_scales", "tokens", "n, hidden")
        if n and not self._device_checks:
            self._check_routing(topk_idx, what)
        return n, K

    def _check_routing(self, topk_idx, what):
        """Expert ids in range and distinct per token (each token reaches an expert at most
        once: the receive regions hold world * max_tokens rows per expert). On the host;
        on CUDA the same checks run on the device (see :meth:`check`)."""
        E = self.num_experts
        bad = ((topk_idx < 0) | (topk_idx >= E)).nonzero()
        if bad.numel():
            t, k = (int(v) for v in bad[0])
            raise ValueError(f"{what}: topk_idx[{t}, {k}] = {int(topk_idx[t, k])} is not an "
                             f"expert (0 <= id < num_experts = {E}); {bad.shape[0]} such "
                             "entries")
        if topk_idx.shape[1] > 1:
            s, _ = topk_idx.sort(dim=1)
            dup = (s[:, 1:] == s[:, :-1]).any(dim=1).nonzero()
            if dup.numel():
                t = int(dup[0, 0])
                raise ValueError(f"{what}: token {t} names expert(s) more than once in topk_idx "
                                 f"({topk_idx[t].tolist()}); each token's top-k experts must "
                                 "be distinct")

    def _device_bad_entries(self, idx: torch.Tensor) -> torch.Tensor:
        """bool [n, K]: entries that are out of range or repeat an earlier k of their token
        (computed on the device, no host read)."""
        bad = (idx < 0) | (idx >= self.num_experts)
        K = idx.shape[1]
        if K > 1:
            eq = idx.unsqueeze(2) == idx.unsqueeze(1)  # [n, K, K]
            earlier = torch.ones(K, K, dtype=torch.bool, device=idx.device).tril(-1)
            bad = bad | (eq & earlier).any(dim=2)
        return bad

    def _capacities(self, counts) -> tuple[int, int]:
        """(dispatch rows, combine rows) a block: low-latency the fixed bounds; high-
        throughput the largest pair over every rank's counts (exchanged first: one
        all-gather, read on the host). ``counts``: a callable giving int32 [2W] (the tokens
        to each rank, then the entries), called in high-throughput mode only."""
        W, T = self.world, self.max_tokens
        if self.mode == "low_latency":
            self._entries_in = None
            return T, self.combine_rows or T * min(self._topk, self.num_local_experts)
        table = self.comm.all_gather(counts()).view(W, 2 * W)
        # (the entries this rank receives, every source's count of those it sends here:
        # the high-throughput receive rows, known before they arrive)
        self._entries_in = int(table[:, W + self.rank].sum())
        rows = table.amax(0)
        return max(int(rows[:W].max()), 1), max(int(rows[W:].max()), 1)

    def _buffer(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A work buffer kept between calls (grown when too small): a fresh large tensor
        per call costs page faults on CPU, and stable addresses suit graph capture. Later
        uses are ordered after earlier ones by the stream (CUDA) or the call (CPU)."""
        n = math.prod(shape) * dtype.itemsize
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < n:
            buf = self._scratch[name] = torch.empty(n, dtype=torch.uint8,
                                                    device=self.comm.device)
        return buf[:n].view(dtype).view(shape)

    def _zero_hidden_rows(self, n: int) -> torch.Tensor:
        """``[n, hidden]`` bf16 zeros kept between calls (zeroed once when made, never
        written after: no memset per call)."""
        z = self._zeros
        if z is None or z.shape[0] < n:
            z = self._zeros = torch.zeros((n, self.hidden), dtype=torch.bfloat16,
                                          device=self.comm.device)
        return z[:n]

    # ---- dispatch ---------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 x_scales: torch.Tensor | None = None) -> tuple[DispatchResult, Handle]:
        """Send every token to the ranks holding its top-k experts.

        Args:
            x: ``[n, hidden]`` tokens, n <= max_tokens, of the constructor's dtype.
            topk_idx: int64 / int32 ``[n, topk]`` expert ids, distinct per token, topk <= 16.
            topk_weights: fp32 ``[n, topk]``; the handle keeps this tensor for
                :meth:`combine` (not a copy: leave it unchanged until then).
            x_scales: fp32 ``[n, hidden / 128]`` for e4m3 tokens.

        Returns ``(recv, handle)``: :class:`DispatchResult` and the :class:`Handle` for
        :meth:`combine`. Shapes, dtypes and (on CPU) the routing are checked before anything
        is sent; on CUDA the routing is checked on the device (no stream sync): a bad entry
        reaches no expert, its token's combined row is NaN, and :meth:`check` raises.
        """
        n, K = self._check_dispatch(x, topk_idx, topk_weights, x_scales)
        self._topk = K
        recv, handle = self._dispatch(x, topk_idx, topk_weights, x_scales, n, K)
        handle.row_token, handle.row_k = recv.src_token.reshape(-1), recv.src_k.reshape(-1)
        # the sized combine's plan now (CUDA: inside the same graph as the dispatch when
        # captured), not in every combine
        handle.sized = self._sized_plan(handle)
        return recv, handle

    def _dispatch(self, x, topk_idx, topk_weights, x_scales, n: int, K: int):
        comm, W, H = self.comm, self.world, self.hidden
        dev = comm.device
        if self._fused:
            return self._dispatch_fused(x, topk_idx, topk_weights, x_scales, n, K)
        idx = topk_idx.to(torch.int32)
        bad = None
        if n and self._device_checks:
            bad = self._device_bad_entries(idx)
            idx = idx.masked_fill(bad, -1)
            self._bad_entries += bad.sum()
        if self._native_cpu:
            return self._dispatch_native(x, idx.contiguous(), topk_weights, x_scales, n, K, bad)
        # Every entry's owner rank (W: refused), the tokens each rank gets (once each), and
        # each entry's rank among this rank's entries with the same owner, in (t, k) order.
        own = torch.where(idx >= 0, self._owner_dev[idx.clamp(min=0).long()],
                          W).long().reshape(-1)
        # [n * K, W + 1] (not F.one_hot: on CUDA it checks its input on the host)
        onehot = (own.unsqueeze(1) == torch.arange(W + 1, device=dev)).long()
        hit = onehot[:, :W].view(n, K, W).any(1)  # [n, W]
        Pd, Pc = self._capacities(lambda: torch.cat([hit.sum(0), onehot[:, :W].sum(0)]).to(
            torch.int32))
        nth = onehot.cumsum(0).gather(1, own.unsqueeze(1)).squeeze(1) - 1
        pos = torch.where(own < W, own * Pc + nth, W * Pc)
        if self.combine_rows is not None and n:
            # entries past a block's rows (combine_rows): not returned, refused here
            over = (own < W) & (nth >= Pc)
            if not self._device_checks and bool(over.any()):
                d = int(own[over][0])
                raise ValueError(f"ExpertParallel.dispatch: {int(onehot[:, d].sum())} top-k "
                                 f"entries of this rank's tokens name experts on rank {d}, "
                                 f"more than combine_rows = {Pc}")
            self._overflow += over.sum()
            pos = torch.where(over, W * Pc, pos)
        pos = pos.to(torch.int32)

        # One block per destination (and a last one that takes the rows of no destination):
        # its tokens in order, each with its index and top-k ids.
        lay = BlockLayout(Pd, H, K + 1, self._row_bytes, self._scale_cols)
        send = self._buffer("dispatch send", (W + 1, lay.nbytes), torch.uint8)
        ids = lay.idx(send).view(torch.int32)  # [W + 1, Pd, K + 1] (views across blocks)
        ids.fill_(-1)
        if n:
            # (rows as 8-byte words, scales as 4-byte ones: indexed copies go by element)
            rows = lay.x(send).view(torch.int64)
            scales = lay.scales(send).view(torch.int32) if self.fp8 else None
            tagged = torch.cat([torch.arange(n, dtype=torch.int32, device=dev).unsqueeze(1),
                                idx], dim=1)
            xb = x.view(torch.uint8).view(torch.int64)
            sb = x_scales.view(torch.int32) if self.fp8 else None
            row_in = hit.cumsum(0) - 1  # [n, W]
            for d in range(W):
                at = (torch.where(hit[:, d], d, W), row_in[:, d].clamp(min=0))
                rows[at] = xb
                ids[at] = tagged
                if sb is not None:
                    scales[at] = sb
        lay.header(send)[:W] = lay.data_bytes(hit.sum(0))
        # [W, nbytes]: source s's block for this rank (past its header's bytes undefined)
        got = comm.all_to_all(send[:W], out=self._buffer("dispatch recv", (W, lay.nbytes),
                                                         torch.uint8), sized=True)
        recv, feed, ret_counts = self._select(got, lay, Pd, Pc, K)
        handle = Handle(self.mode, feed, Pd, Pc, pos, n, K, topk_weights, bad,
                        tuple(recv.src_rank.shape), ret_counts)
        return recv, handle

    def _select(self, got: torch.Tensor, lay: BlockLayout, Pd: int, Pc: int, K: int):
        """The torch path's selection of this rank's entries from the received blocks
        ``got`` [W, nbytes]: (recv, feed, ret_counts)."""
        W, T, H, El = self.world, self.max_tokens, self.hidden, self.num_local_experts
        dev = self.comm.device

        # This rank's entries (s, p, k) of every received row, by (local expert, s, token).
        g = lay.idx(got).view(torch.int32).view(W, Pd, K + 1)
        token, gid = g[:, :, 0], g[:, :, 1:]
        safe = gid.clamp(min=0).long()
        mine = (gid >= 0) & (self._owner_dev[safe] == self.rank)  # [W, Pd, K]
        key = torch.where(mine, self._local_dev[safe], El).reshape(-1)
        order = torch.sort(key, stable=True).indices
        counts_all = torch.zeros(El + 1, dtype=torch.int64, device=dev)
        counts_all.index_add_(0, key.long(), torch.ones_like(key, dtype=torch.int64))
        counts = counts_all[:El].to(torch.int32)
        # Each entry's row in combine's block for its source: the source's entries held
        # here, in (p, k) = (token, k) order, which is how the source numbered them (pos).
        nth_in = mine.view(W, Pd * K).cumsum(1) - 1
        ret = (nth_in + torch.arange(W, device=dev).unsqueeze(1) * Pc).reshape(-1)
        if self.combine_rows is not None:  # (past the block: the home refused them)
            ret = torch.where(nth_in.reshape(-1) < Pc, ret, -1)
        # the rows returned to each source: its entries held here, at most a block's
        ret_counts = mine.view(W, Pd * K).sum(1).clamp(max=Pc)

        rows_got = lay.x(got).view(torch.int64)  # [W, Pd, words]: (rows as 8-byte words)
        scales_got = lay.scales(got).view(torch.float32) if self.fp8 else None
        if self.mode == "high_throughput":
            R = int(counts_all[:El].sum())  # the host read (CUDA: a stream sync)
            ent = order[:R]
            offsets = torch.zeros(El + 1, dtype=torch.int64, device=dev)
            offsets[1:] = torch.cumsum(counts_all[:El], 0)
            recv_shape = (R,)
            at = (ent // K // Pd, ent // K % Pd)
            rx = rows_got[at]
            xs = scales_got[at] if self.fp8 else None
        else:
            # A token reaches each expert at most once (ids distinct per token), so at most
            # W * T rows per local expert and W * Pd * min(K, El) local entries, which the
            # stable order puts first. Only those rows are written (each region's rows past
            # its count are left as they are); the ones that are not this rank's go to rows
            # of their own past the end (no two writes to one row).
            cap = W * T
            M = min(W * Pd * min(K, El), key.numel())
            first = order[:M]
            ekey = key[first]
            starts = torch.cumsum(counts_all, 0) - counts_all
            rank_in = torch.arange(M, device=dev) - starts[ekey]
            spare = El * cap + torch.arange(M, device=dev)
            dest = torch.where(ekey < El, ekey * cap + rank_in, spare)
            ent = torch.full((El * cap + M,), -1, dtype=torch.int64, device=dev)
            ent[dest] = first
            ent = ent[:El * cap]
            offsets = None
            recv_shape = (El, cap)
            at = (first // K // Pd, first // K % Pd)
            rx = torch.empty((El * cap + M, rows_got.shape[2]), dtype=torch.int64, device=dev)
            rx[dest] = rows_got[at]
            rx = rx[:El * cap]
            xs = None
            if self.fp8:
                xs = torch.empty((El * cap + M, self._scale_cols), dtype=torch.float32,
                                 device=dev)
                xs[dest] = scales_got[at]
                xs = xs[:El * cap]
        rx = rx.view(torch.uint8).view(self.dtype).reshape(*recv_shape, H)
        if xs is not None:
            xs = xs.reshape(*recv_shape, self._scale_cols)

        none = ent < 0
        e = ent.clamp(min=0)
        src_row = e // K  # the row (s, p) of got
        src_rank = torch.where(none, -1, src_row // Pd).to(torch.int32)
        src_token = torch.where(none, -1, token.reshape(-1)[src_row]).to(torch.int32)
        src_k = torch.where(none, -1, e % K).to(torch.int32)
        slots = torch.where(none, -1, ret[e])
        none = slots < 0
        # combine's send rows gather from the received rows: feed[i] = the received row that
        # goes to send row i (0 where none does: those rows are sent, never read)
        N = W * Pc
        feed = torch.zeros(N + slots.numel(), dtype=torch.int64, device=dev)
        feed[torch.where(none, N + torch.arange(slots.numel(), device=dev), slots)] = \
            torch.arange(slots.numel(), device=dev)
        feed = feed[:N]
        recv = DispatchResult(self.mode, rx, xs, counts, offsets, src_rank.view(recv_shape),
                              src_token.view(recv_shape), src_k.view(recv_shape),
                              list(self.local_experts))
        return recv, feed, ret_counts

    def _dispatch_fused(self, x, topk_idx, topk_weights, x_scales, n: int, K: int):
        """dispatch on CUDA: sccl_ep_pack builds the send blocks, pos and the refusals (the
        device checks and their counts folded in); after the all-to-all, sccl_ep_unpack
        selects this rank's entries (high-throughput: after a count launch that sizes the
        packed rows on the host). The same bytes as the torch
        path wherever that defines them (tests/test_expert_parallel.py compares)."""
        from . import ep_cuda
        comm, W, T, H = self.comm, self.world, self.max_tokens, self.hidden
        El, E = self.num_local_experts, self.num_experts
        dev = comm.device
        if x.data_ptr() % _ALIGN:  # the row copies are 16-byte accesses
            x = x.clone()
        xb = x.view(torch.uint8)
        xs_in = x_scales if self.fp8 else None
        limit = self.combine_rows is not None
        bad = torch.empty((n, K), dtype=torch.bool, device=dev)
        pos = torch.empty(n * K, dtype=torch.int32, device=dev)
        scale_bytes = self._scale_cols * 4

        def pack(Pd, Pc, send, lay, counts=None):
            args = ep_cuda.pack_args(idx=topk_idx, owner=self._owner_dev, E=E, W=W, Pd=Pd, Pc=Pc,
                                     limit=limit, x=xb, x_scales=xs_in,
                                     row_bytes=self._row_bytes, scale_bytes=scale_bytes,
                                     send=send, lay=lay, pos=pos, bad=bad,
                                     bad_count=self._bad_entries, overflow=self._overflow,
                                     counts=counts)
            ep_cuda.launch(dev, "sccl_ep_pack", ep_cuda.pack_grid(W, Pd, counts is not None),
                           args)

        def counts():
            c = torch.empty(2 * W, dtype=torch.int32, device=dev)
            pack(1, 1, None, BlockLayout(1, H, K + 1, self._row_bytes, self._scale_cols), c)
            return c

        Pd, Pc = self._capacities(counts)
        if W * (Pc + 1) + 1 >= 2 ** 31:
            raise ValueError(f"ExpertParallel.dispatch: world * combine rows = {W} * {Pc + 1} "
                             "exceeds int32 (pos); lower max_tokens or combine_rows")
        lay = BlockLayout(Pd, H, K + 1, self._row_bytes, self._scale_cols)
        send = self._buffer("dispatch send", (W, lay.nbytes), torch.uint8)
        pack(Pd, Pc, send, lay)
        got = comm.all_to_all(send, out=self._buffer("dispatch recv", (W, lay.nbytes),
                                                     torch.uint8), sized=True)
        common = dict(got=got, lay=lay, owner=self._owner_dev, experts=self._experts_dev,
                      rank=self.rank, E=E, W=W, Pd=Pd, K=K, Pc=Pc, limit=limit,
                      row_bytes=self._row_bytes, scale_bytes=scale_bytes)
        ret_counts = torch.empty(W, dtype=torch.int64, device=dev)  # (the unpack writes it)
        if self.mode == "low_latency":
            cap = W * T
            rx = torch.empty((El, cap, H), dtype=self.dtype, device=dev)
            xs = (torch.empty((El, cap, self._scale_cols), dtype=torch.float32, device=dev)
                  if self.fp8 else None)
            counts_e = torch.empty(El, dtype=torch.int32, device=dev)
            src = [torch.empty((El, cap), dtype=torch.int32, device=dev) for _ in range(3)]
            feed = torch.empty(W * Pc, dtype=torch.int64, device=dev)
            ep_cuda.launch(dev, "sccl_ep_unpack", ep_cuda.unpack_grid(El, cap), ep_cuda.unpack_args(
                **common, cap=cap, rx=rx, xs=xs, counts=counts_e, src_rank=src[0],
                src_token=src[1], src_k=src[2], feed=feed, ret_counts=ret_counts))
            recv = DispatchResult(self.mode, rx, xs, counts_e, None, *src,
                                  list(self.local_experts))
        else:
            # a count launch, the offsets, R read on the host (a stream sync, as the torch
            # path's), then the rows packed at offsets[e] + their rank
            common["cap"] = 0
            counts_e = torch.empty(El, dtype=torch.int32, device=dev)
            ep_cuda.launch(dev, "sccl_ep_unpack", (El, 1), ep_cuda.unpack_args(
                **common, rx=None, xs=None, counts=counts_e, src_rank=None, src_token=None,
                src_k=None, feed=None, count_only=True))
            offsets = torch.zeros(El + 1, dtype=torch.int64, device=dev)
            offsets[1:] = torch.cumsum(counts_e, 0)
            R = int(offsets[El])
            rx = torch.empty((R, H), dtype=self.dtype, device=dev)
            xs = (torch.empty((R, self._scale_cols), dtype=torch.float32, device=dev)
                  if self.fp8 else None)
            src = [torch.empty(R, dtype=torch.int32, device=dev) for _ in range(3)]
            feed = torch.empty(W * Pc, dtype=torch.int64, device=dev)
            ep_cuda.launch(dev, "sccl_ep_unpack",
                           ep_cuda.unpack_grid(El, -(-R // El), ep_cuda.HT_SPREAD),
                           ep_cuda.unpack_args(**common, rx=rx, xs=xs, counts=counts_e,
                                               src_rank=src[0], src_token=src[1],
                                               src_k=src[2], feed=feed, offsets=offsets,
                                               ret_counts=ret_counts))
            recv = DispatchResult(self.mode, rx, xs, counts_e, offsets, *src,
                                  list(self.local_experts))
        handle = Handle(self.mode, feed, Pd, Pc, pos, n, K, topk_weights, bad if n else None,
                        tuple(recv.src_rank.shape), ret_counts)
        return recv, handle

    def _dispatch_native(self, x, idx, topk_weights, x_scales, n, K, bad):
        """dispatch on CPU with the native pack and unpack: the same send blocks, pos, rows,
        counts, src_* and feed as the torch path (``idx``: int32 [n, K], refused entries -1)."""
        from . import _native
        comm, W, T, H, E = self.comm, self.world, self.max_tokens, self.hidden, self.num_experts
        El = self.num_local_experts
        own, loc = self._owner_dev.data_ptr(), self._local_dev.data_ptr()

        def counts():
            c = torch.empty(2 * W, dtype=torch.int32)
            _native.ep_counts(idx.data_ptr(), n, K, own, E, W, c.data_ptr())
            return c

        Pd, Pc = self._capacities(counts)
        lay = BlockLayout(Pd, H, K + 1, self._row_bytes, self._scale_cols)
        pos = torch.empty(n * K, dtype=torch.int32)
        rowtok = self._buffer("dispatch rows", (W, Pd), torch.int32)
        over, d, ents = _native.ep_plan(idx.data_ptr(), n, K, own, E, W, Pd, Pc, pos.data_ptr(),
                                        rowtok.data_ptr())
        if over:  # (only with combine_rows: no routing exceeds the other bounds)
            if not self._device_checks:
                raise ValueError(f"ExpertParallel.dispatch: {ents} top-k entries of this rank's "
                                 f"tokens name experts on rank {d}, more than combine_rows = "
                                 f"{Pc}")
            self._overflow += over
        # the send blocks are written group by group straight into the all-to-all's send
        # slot, each just before it goes (the first rows travel while later ones are copied)
        fill_args = (x.data_ptr(), self._row_bytes, x_scales.data_ptr() if self.fp8 else 0,
                     self._scale_cols * 4, idx.data_ptr(), n, K, rowtok.data_ptr(), W, Pd,
                     lay.nbytes, lay.idx_off, lay.scales_off, lay.x_off)

        def fill(base, stride, lo, hi):
            _native.ep_fill_blocks(*fill_args, base, stride, lo, hi)

        # The receive tensors, sized before the rows arrive (high-throughput: from the
        # counts), their pages touched while the wire runs (a fresh tensor of MBs costs a
        # page fault per 4 KiB on first write, as much as the copies into it), and each
        # source's rows moved to them as they land, once every source's ids are in (they
        # lead each block).
        ll = self.mode == "low_latency"
        recv_shape = (El, W * T) if ll else (self._entries_in,)
        rows = math.prod(recv_shape)
        rx = torch.empty((*recv_shape, H), dtype=self.dtype)
        xs = torch.empty((*recv_shape, self._scale_cols), dtype=torch.float32) if self.fp8 \
            else None
        src = [torch.empty(recv_shape, dtype=torch.int32) for _ in range(3)]
        feed = torch.empty(W * Pc, dtype=torch.int64)
        cnt = torch.empty(El, dtype=torch.int64)
        cur = torch.empty(W * El, dtype=torch.int64)  # each source's next row per expert
        nth = torch.zeros(W, dtype=torch.int64)       # each source's entries moved
        got = self._buffer("dispatch recv", (W, lay.nbytes), torch.uint8)
        g = got.data_ptr()
        ids_in = lay.x_off  # a block's leading bytes: its ids and scales
        have = [0] * W      # bytes of each source's block in got
        moved = [0] * W     # rows of each source's block moved
        planned = []
        # (low-latency: only src_*, written whole; rx's rows past the counts are never
        # written, so their pages are never faulted)
        fresh = ([*src] if ll else [rx, xs, *src]) if self._stream_cpu else []
        out_args = (rx.data_ptr(), xs.data_ptr() if xs is not None else 0,
                    *(t.data_ptr() for t in src), feed.data_ptr())

        def move(s):
            p = min(Pd, max(have[s] - ids_in, 0) // self._row_bytes)
            if p > moved[s]:
                _native.ep_unpack_rows(g, W, lay.nbytes, lay.idx_off, lay.scales_off, lay.x_off,
                                       self._row_bytes, self._scale_cols * 4, Pd, K, own, loc,
                                       E, self.rank, El, Pc, rows, s, moved[s], p,
                                       cur.data_ptr(), nth.data_ptr(), *out_args)
                moved[s] = p

        def arrived(source, hi):
            while fresh:
                _touch_pages(fresh.pop())
            have[source] = hi
            if planned:
                move(source)
            elif min(have) >= ids_in:
                _native.ep_unpack_plan(g, W, lay.nbytes, lay.idx_off, Pd, K, own, loc, E,
                                       self.rank, El, ll, W * T, Pc, cnt.data_ptr(),
                                       cur.data_ptr(), feed.data_ptr(),
                                       *(t.data_ptr() for t in src))
                if not ll and int(cnt.sum()) != rows:
                    raise RuntimeError(f"ExpertParallel.dispatch: rank {self.rank} receives "
                                       f"{int(cnt.sum())} entries, the counts said {rows}")
                planned.append(True)
                for s in range(W):
                    move(s)

        comm.all_to_all(None, out=got, fill=fill,
                        arrived=arrived if self._stream_cpu else None, sized=True)
        if not self._stream_cpu:
            for s in range(W):
                arrived(s, lay.nbytes)
        if moved != [Pd] * W:
            raise RuntimeError(f"ExpertParallel.dispatch: rank {self.rank} moved {moved} rows "
                               f"of {Pd} per source")
        offsets = None
        if not ll:
            offsets = torch.zeros(El + 1, dtype=torch.int64)
            offsets[1:] = torch.cumsum(cnt, 0)
        recv = DispatchResult(self.mode, rx, xs, cnt.to(torch.int32), offsets, *src,
                              list(self.local_experts))
        # (nth[s]: source s's entries held here, all moved; past Pc refused by the home)
        handle = Handle(self.mode, feed, Pd, Pc, pos, n, K, topk_weights, bad, recv_shape,
                        nth.clamp(max=Pc))
        return recv, handle

    # ---- combine ----------------------------------------------------------------------
    def _sized_plan(self, handle: Handle) -> SizedCombine:
        """The sized combine's feed, headers and pos for ``handle`` (:class:`SizedCombine`):
        small torch ops on the device, no host read (capturable), which are the
        specification; the fused CUDA path makes the same in one launch
        (:func:`sparkccl.ep_cuda.sized_plan`)."""
        W, Pc, RB = self.world, handle.ret_rows, 2 * self.hidden
        if self._fused and handle.pos.is_contiguous() and handle.feed.is_contiguous():
            from . import ep_cuda
            return SizedCombine(*ep_cuda.sized_plan(handle.feed, handle.ret_counts, handle.pos,
                                                    W, Pc, RB))
        feed = torch.cat([self._zero_rows, handle.feed.view(W, Pc)], dim=1).view(-1)
        header = handle.ret_counts.mul(RB).add_(RB)
        # block b's row j (p = b * Pc + j < W * Pc) is row b * (Pc + 1) + 1 + j; the NaN row
        # (p = W * Pc, which that gives W * (Pc + 1) + 1) is the last, W * (Pc + 1)
        p = handle.pos
        pos = p.div(Pc, rounding_mode="floor").add_(p).add_(1).clamp_(max=W * (Pc + 1))
        return SizedCombine(feed, header, pos)

    def combine(self, expert_out: torch.Tensor, handle: Handle,
                shared: torch.Tensor | None = None, *, partial: bool = False) -> torch.Tensor:
        """Return every expert output row to its token's home rank and finalize there:
        ``[n, hidden]`` bf16 with row t = ``shared[t] + sum_k w[t, k] * out(t, k)`` (fp32 FMA
        chain in k order, rounded once; ``shared=None`` starts the chain from +0.0).

        ``expert_out``: bf16 in ``recv.x``'s layout (``[R, H]`` high-throughput,
        ``[E_local, world * max_tokens, H]`` low-latency; rows past the counts are ignored).

        ``partial=True`` (an opt-in: other bits): each rank first sums, per token, the
        weighted rows of its own experts, ``p_s[t]`` = the fp32 FMA chain from +0.0 over the
        k (in top-k order) whose expert rank s holds, rounded to bf16, and returns one row
        per (token, rank) instead of one per entry; the home rank then adds them in rank
        order, ``shared[t] + p_0[t] + ... + p_{W-1}[t]`` in fp32 (``p_s`` = +0.0 where s
        holds none of t's experts), rounded once. The grouping of DeepEP's normal-mode
        combine and of the all-gather + reduce-scatter formulation: fewer rows on the wire
        (about ``W (1 - (1 - 1/W)^topk)`` per token instead of ``topk``), bits that are the
        same on every topology and transport, deterministic, but that depend on the world
        size and the placement (docs/EXPERT_PARALLEL.md "Per-rank partial combine").
        """
        what = "ExpertParallel.combine"
        comm, W, H = self.comm, self.world, self.hidden
        dev = comm.device
        comm.check_open(what)
        if not isinstance(handle, Handle):
            raise TypeError(f"{what}: handle must be the Handle returned by dispatch, got "
                            f"{type(handle).__name__}")
        checks.tensor(expert_out, dev, what, "expert_out")
        if expert_out.dtype != torch.bfloat16:
            raise TypeError(f"{what}: expert_out must be torch.bfloat16, got {expert_out.dtype}")
        if tuple(expert_out.shape) != (*handle.recv_shape, H):
            raise ValueError(f"{what}: expert_out must have recv.x's shape "
                             f"{[*handle.recv_shape, H]}, got {list(expert_out.shape)}")
        n, K = handle.num_tokens, handle.topk
        if shared is not None:
            checks.tensor(shared, dev, what, "shared")
            if shared.dtype != torch.bfloat16:
                raise TypeError(f"{what}: shared must be torch.bfloat16, got {shared.dtype}")
            if tuple(shared.shape) != (n, H):
                raise ValueError(f"{what}: shared must be [n, hidden] = [{n}, {H}], got "
                                 f"{list(shared.shape)}")

        if not isinstance(partial, bool):
            raise TypeError(f"{what}: partial must be a bool, got {type(partial).__name__}")
        if partial and W > MAX_TOPK:  # (the home's finalize takes one slot per rank)
            raise ValueError(f"{what}: partial=True takes at most {MAX_TOPK} ranks, the "
                             f"world size is {W}")

        if shared is None:
            shared = torch.zeros((n, H), dtype=torch.bfloat16, device=dev)
        out = torch.empty((n, H), dtype=torch.bfloat16, device=dev)
        if partial:
            self._combine_partial(expert_out, handle, shared, out)
            return out

        def recv_rows(N, pos):
            # the receive blocks and a last row of NaN, where the refused entries (CUDA and
            # the device-side checks) point
            y = self._buffer("combine recv", (N + 1, H), torch.bfloat16)
            y[N].view(torch.int16).fill_(NAN_BF16)
            return y, _finalize.FinalizeInputs(y=y, scales=None, pos=pos,
                                               weights=handle.weights, shared=shared,
                                               num_tokens=n, padded_tokens=n, world=1, topk=K,
                                               H=H, R=N + 1)

        # Sized blocks (SizedCombine): a header row, then every computed row at its row of
        # the block for its home rank (a gather: rows past the counts are never read); only
        # the header and the rows that exist travel.
        plan = handle.sized
        if plan is None:
            plan = handle.sized = self._sized_plan(handle)
        N = W * (handle.ret_rows + 1)
        y, f = recv_rows(N, plan.pos)
        if self._stream_cpu:
            self._combine_streamed(expert_out, handle, plan, y, f, out)
            return out
        send = self._buffer("combine send", (N, H), torch.bfloat16)
        words = send.view(torch.int64)  # (rows as 8-byte words)
        if expert_out.numel():  # (none received: no data row is read)
            torch.index_select(expert_out.reshape(-1, H).view(torch.int64), 0, plan.feed,
                               out=words)
        words.view(W, -1)[:, 0] = plan.header  # each block's first 8 bytes
        comm.all_to_all(send, out=y[:N], sized=True)
        if n:
            self._finalize(f, out)
        return out

    def _finalize(self, f, out: torch.Tensor) -> None:
        """``out`` = the finalize rows of ``f`` (the one-box FMA chain per row)."""
        if self.comm.device.type == "cuda":
            from . import ep_cuda
            ep_cuda.finalize_rows(f, out, self._fin_bad)
        else:
            from . import _native
            _finalize.single_rank(_native, f, out)

    def _combine_partial(self, expert_out, handle: Handle, shared, out) -> None:
        """combine(partial=True): torch ops on the device and two finalize passes, no host
        read (capturable in low-latency mode). The top-k weights go to the expert ranks
        first, in combine's block order (one small all-to-all: ``pos`` numbers this rank's
        entries per owner); each rank gathers the rows it returns (as the exact combine
        does) plus a zero row, sums each home token's entries into one row (a finalize whose
        rows are the (home, token) groups, its slots the top-k positions, the empty ones
        the zero row with weight 0, its shared rows zero), and sends per home a header row,
        then those rows in token order (sized: only they travel). The home finalizes with
        one slot per rank (weight 1: fp32 additions in rank order, from shared)."""
        comm, W, H, dev = self.comm, self.world, self.hidden, self.comm.device
        n, K, Pc, Pd = handle.num_tokens, handle.topk, handle.ret_rows, handle.dispatch_rows
        RB, B, N = 2 * H, Pd + 1, W * Pc  # (a returned block: a header, then <= Pd tokens)
        # 1. the weights of this rank's entries, to their owners, in pos order
        wsend = self._buffer("partial w send", (N + 1,), torch.float32)
        wsend.zero_()
        if n:
            wsend[handle.pos.long()] = handle.weights.reshape(-1)
        wrecv = comm.all_to_all(wsend[:N], out=self._buffer("partial w recv", (N,),
                                                           torch.float32))
        # 2. the rows held here for each home (slot i = s * Pc + j: home s's j-th entry
        # held here, in its (token, k) order), then a zero row
        y = self._buffer("partial rows", (N + 1, H), torch.bfloat16)
        if expert_out.numel():
            torch.index_select(expert_out.reshape(-1, H), 0, handle.feed, out=y[:N])
        y[N].zero_()
        valid = (torch.arange(Pc, device=dev).unsqueeze(0)
                 < handle.ret_counts.unsqueeze(1))  # [W, Pc]
        if handle.row_token.numel():
            tok = torch.where(valid, handle.row_token[handle.feed].view(W, Pc), -1)
            kk = handle.row_k[handle.feed].view(W, Pc).long().clamp_(min=0)  # (-1: no row)
        else:  # (nothing received here)
            tok = torch.full((W, Pc), -1, dtype=torch.int32, device=dev)
            kk = torch.zeros((W, Pc), dtype=torch.int64, device=dev)
        # each slot's group (a home token): a new one where the token changes
        new = torch.ones_like(valid)
        new[:, 1:] = tok[:, 1:] != tok[:, :-1]
        new &= valid
        g = new.long().cumsum(1) - 1  # [W, Pc]
        groups = new.sum(1)  # [W]: the tokens of each home held here
        # the group rows: block s's row 1 + g (row 0: the header); invalid slots go to a
        # row of their own past the end, dropped
        M = W * B
        row = torch.where(valid, torch.arange(W, device=dev).unsqueeze(1) * B + 1 + g,
                          M).view(-1)
        pos1 = torch.full((M + 1, K), N, dtype=torch.int32, device=dev)
        w1 = torch.zeros((M + 1, K), dtype=torch.float32, device=dev)
        at = (row, kk.reshape(-1))
        pos1[at] = torch.arange(N, dtype=torch.int32, device=dev)
        w1[at] = wrecv
        sums = _finalize.FinalizeInputs(
            y=y, scales=None, pos=pos1[:M].reshape(-1), weights=w1[:M].contiguous(),
            shared=self._zero_hidden_rows(M), num_tokens=M, padded_tokens=M, world=1, topk=K,
            H=H, R=N + 1)
        lengths = groups.mul(RB).add_(RB)  # each block's data bytes: its header's first 8
        # 3. the home: one slot per rank; a token with a refused entry reads a NaN row
        recv = self._buffer("partial recv", (M + 2, H), torch.bfloat16)
        recv[M].zero_()
        recv[M + 1].view(torch.int16).fill_(NAN_BF16)
        idx = handle.pos.view(n, K).long()
        refused = idx == N
        owner = torch.where(refused, W, idx // Pc)  # [n, K]
        hit = (owner.unsqueeze(2) == torch.arange(W, device=dev)).any(1)  # [n, W]
        nth = hit.long().cumsum(0) - 1
        pos2 = torch.where(hit, torch.arange(W, device=dev) * B + 1 + nth, M)
        pos2[:, 0] = torch.where(refused.any(1), M + 1, pos2[:, 0])
        ones = torch.ones((n, W), dtype=torch.float32, device=dev)
        home = _finalize.FinalizeInputs(
            y=recv, scales=None, pos=pos2.to(torch.int32).reshape(-1), weights=ones,
            shared=shared, num_tokens=n, padded_tokens=n, world=1, topk=W, H=H, R=M + 2)
        if self._stream_cpu:
            self._combine_partial_streamed(sums, lengths, home, hit, recv, out, B)
            return
        send = self._buffer("partial send", (M, H), torch.bfloat16)
        self._finalize(sums, send)
        send.view(W, B, H)[:, 0].view(torch.int64)[:, 0] = lengths
        comm.all_to_all(send, out=recv[:M], sized=True)
        if n:
            self._finalize(home, out)

    def _combine_partial_streamed(self, sums, lengths, home, hit, recv, out, B: int) -> None:
        """combine(partial=True) on CPU beside the wire: each send block's rows (``sums``:
        this rank's per-(home, token) sums) are computed straight into the all-to-all's send
        slot just before their bytes go, and the home's sums (``home``) run on every token
        whose rows from every rank holding its experts have arrived while later ones travel.
        The same FMA chains per row as :meth:`_combine_partial`'s two passes: the same bits.
        ``lengths``: each block's data bytes (its header's first 8 bytes); ``hit`` [n, W]:
        the ranks that hold one of each token's experts (their rows come in token order)."""
        from . import _native
        W, n, RB = self.world, home.num_tokens, 2 * self.hidden
        sums_args, lengths = sums.native_args(), lengths.tolist()
        header = [v.to_bytes(8, "little") for v in lengths]
        rows_of = [v // RB for v in lengths]  # (the header row included)
        scratch = self._buffer("partial scratch", (B, self.hidden), torch.bfloat16)
        sp = scratch.data_ptr()

        def fill(base, stride, lo, hi):
            r0 = lo // RB
            for s in range(W):
                r1 = min(-(-hi // RB), rows_of[s])  # (rows past the block's count never go)
                if r0 >= r1:
                    continue
                _native.finalize_rows(*sums_args, s * B + r0, r1 - r0, sp)
                if r0 == 0:
                    ctypes.memmove(sp, header[s], 8)
                a, e = lo, min(hi, r1 * RB)
                ctypes.memmove(base + s * stride + a, sp + a - r0 * RB, e - a)

        def token_rows():  # (each source's rows: the tokens it holds experts of, in order)
            return [hit[:, s].nonzero().flatten().tolist() + [n] for s in range(W)]

        arrived, finish = _finalize_as_rows_arrive(home.native_args(), out, W, token_rows)
        self.comm.all_to_all(None, out=recv[:W * B], fill=fill, arrived=arrived if n else None,
                             sized=True)
        finish()

    def _combine_streamed(self, expert_out, handle: Handle, plan: SizedCombine, y, f,
                          out) -> None:
        """combine on CPU beside the wire, in the sized blocks (:class:`SizedCombine`):
        each group of the send blocks is gathered from ``expert_out`` straight into the
        all-to-all's send slot just before it goes (the header's first 8 bytes with the
        first group), and the finalize runs on every token whose rows have all arrived while
        later ones travel (the same rows, the same FMA chain per token: the same bits as
        finalizing at the end). Rows past a block's count never travel and are never read."""
        from . import _native
        W, H, Pc, n = self.world, self.hidden, handle.ret_rows, handle.num_tokens
        RB, B = 2 * H, handle.ret_rows + 1  # (a block: the header row, then Pc rows)
        eo = expert_out.reshape(-1, H)
        feed = plan.feed  # (header rows take row 0 of eo: their first 8 bytes are then set)
        header = [h.to_bytes(8, "little") for h in plan.header.tolist()]

        def fill(base, stride, lo, hi):
            _native.ep_fill_rows(eo.data_ptr(), eo.shape[0], RB, feed.data_ptr(), B, W, base,
                                 stride, lo, hi)
            if lo < 8:  # (each block's length: the part of its first 8 bytes in [lo, hi))
                e = min(hi, 8)
                for j, h in enumerate(header):
                    ctypes.memmove(base + j * stride + lo, h[lo:e], e - lo)

        def token_rows():
            # the token of this rank's j-th entry held by s (a source's rows come in this
            # rank's (token, k) order; past a block's count no row holds a token: n)
            t = torch.full((W * B + 1,), n, dtype=torch.int64)
            t[plan.pos.long()] = torch.arange(n * f.topk) // f.topk
            t = t.tolist()
            return [t[s * B + 1:s * B + 1 + Pc] + [n] for s in range(W)]

        arrived, finish = _finalize_as_rows_arrive(f.native_args(), out, W, token_rows)
        self.comm.all_to_all(None, out=y[:W * B], fill=fill, arrived=arrived if n else None,
                             sized=True)
        finish()

    def check(self) -> None:
        """CUDA: raise ``ValueError`` if a dispatch met top-k entries that are out of range or
        repeated, or past ``combine_rows`` (checked on the device, without a stream sync; such
        an entry's token's combined row is NaN). Synchronizes the current stream. CPU
        dispatch refuses them before sending, so this returns at once."""
        if not self._device_checks:
            return
        if self.comm.device.type == "cuda":
            torch.cuda.current_stream(self.comm.device).synchronize()
        n, over = int(self._bad_entries), int(self._overflow)
        if n:
            self._bad_entries.zero_()
            raise ValueError(f"rank {self.rank}: ExpertParallel.dispatch: {n} top-k entries "
                             f"were out of range (0 <= id < num_experts = {self.num_experts}) "
                             "or repeated a token's earlier expert; they reached no expert and "
                             "their tokens' combined rows are NaN")
        if over:
            self._overflow.zero_()
            raise ValueError(f"rank {self.rank}: ExpertParallel.dispatch: {over} top-k entries "
                             f"were past combine_rows = {self.combine_rows} (the rows one rank "
                             "returns to this one); their tokens' combined rows are NaN")
