"""The data-plane contract, and what every data plane shares.

:class:`DataPlaneBase` declares every operation and query the communicator
(``sparkccl/comm.py``) and its wiring (``sparkccl/wiring.py``) use, for the CPU and the
CUDA plane alike: the collectives, the regions they are given, completion
(:meth:`~DataPlaneBase.synchronize`, :meth:`~DataPlaneBase.check_status`,
:meth:`~DataPlaneBase.close`) and the CUDA-graph capture rules
(:meth:`~DataPlaneBase.seq_on_host`, :meth:`~DataPlaneBase.refuse_capture`). Nobody probes
a plane with ``hasattr``: a plane that lacks a feature says so through the declared
capabilities (``typed_io``, ``zero_copy_results``, ``maps_peers``) or inherits the
documented default. A new collective adds its method in the "collectives" section below
(docs/ARCHITECTURE.md "Where to add things").

It also holds what both planes share: the rank's view of its control block, and failure
reporting (the abort record, the error naming rank, peer and connection; the cross-rank
check of every call against the sources' call entries is :mod:`.peer_check`). :class:`~.cpu.CpuDataPlane` and :class:`~.cuda.CudaDataPlane` both build on
it; neither is the other's parent."""
from __future__ import annotations

import ctypes

import torch

from .. import layout
from ..errors import CollectiveError
from ..plan.geometry import FLAG_STRIDE
from ..plan.model import PREV, Op, RankPlan, decode_flag_word
from .peer_check import PeerCheck

OP_NAMES = {Op.AG: "all_gather", Op.RS: "reduce_scatter"}


class DataPlaneBase:
    def __init__(self, native, *, plan: RankPlan, ctl_addr: int, flags_addr: int,
                 ag: torch.Tensor, ag_stride: int, timeout_s: float,
                 peer_calls: memoryview | None = None):
        self.nat = native
        self.plan = plan
        self.rank = plan.rank
        self.world = plan.world
        self.ctl = ctl_addr
        self.flags = flags_addr
        self.ag = ag
        self.ag_stride = ag_stride
        self.timeout_s = timeout_s
        # this rank's call words (the cross-rank check, peer_check.py), or None.
        self.peer_calls = peer_calls
        self.rs_send = self.rs_recv = None
        self.rs_send_stride = self.rs_recv_stride = 0

    @property
    def peer_calls(self) -> memoryview | None:
        return self._peer_calls

    @peer_calls.setter
    def peer_calls(self, calls: memoryview | None) -> None:
        """``peer_check.calls_view`` of this rank's control segment (where the sources'
        call entries arrive), or ``None``: the check is off."""
        self._peer_calls = calls
        self.peer_check = None if calls is None else PeerCheck(
            self.rank, self.world, calls,
            lambda message, peer: self.fail(message, layout.ABORT_USER, peer=peer))

    # ---- capabilities ----------------------------------------------------------------
    typed_io = False
    """True: the collectives take contiguous tensors of any dtype and count bytes
    themselves (the communicator then passes its tensors as they are, no uint8 views)."""

    zero_copy_results = False
    """True: ``all_gather(seq, src, None, 0, 0)`` leaves the result in the all-gather slot,
    read with :meth:`ag_slot` (the CUDA plane: a view of pinned memory)."""

    maps_peers = False
    """True: the plane can write straight into peers' segments mapped in this process
    (:meth:`map_peers`, :meth:`map_peers_rs`: GPU-direct)."""

    clock_error_ns: int | None = None
    """Uncertainty of the publish stamps' clock calibration (SPARKCCL_GPU_STAMPS), or None."""

    # ---- regions -------------------------------------------------------------------
    def attach_rs(self, send: torch.Tensor, send_stride: int, recv: torch.Tensor,
                  recv_stride: int) -> None:
        """The reduce-scatter send and receive slots (host tensors over the "rs" segment),
        given on first use (or up front)."""
        raise NotImplementedError

    def map_peers(self, ctl: dict, ag: dict) -> None:
        """Peers' control and all-gather segments mapped here (``{peer: (address,
        bytes)}``); only where :attr:`maps_peers`."""
        raise NotImplementedError(f"{type(self).__name__} does not write into peers' memory")

    def map_peers_rs(self, rs: dict, send_bytes: int) -> None:
        """Peers' reduce-scatter segments mapped here; only where :attr:`maps_peers`."""
        raise NotImplementedError(f"{type(self).__name__} does not write into peers' memory")

    # ---- collectives (one method per collective; a new collective adds its own) ------
    # Each takes the collective's sequence number first (comm.py numbers them), then its
    # tensors and byte offsets; it returns once the collective is done (CPU) or queued on
    # the caller's current stream (CUDA), and raises CollectiveError on failure.
    def all_gather(self, seq: int, src: torch.Tensor, dst: torch.Tensor | None, dst_off: int,
                   dst_stride: int, dtype: torch.dtype | None = None,
                   part: tuple[int, int] | None = None) -> None:
        """Rank i's ``src`` bytes land at byte ``i * dst_stride + dst_off`` of ``dst``
        (``dst=None``: in the slot, see :attr:`zero_copy_results`). ``dtype``: the caller's
        element type where ``src`` is a byte view (default ``src.dtype``); ``part``: (kind,
        zero bytes) of the all-reduce this collective is a step of (default: an all-gather
        of ``src``); the peers compare both (:mod:`.peer_check`)."""
        raise NotImplementedError

    def ag_slot(self, seq: int, nbytes: int) -> torch.Tensor:
        """The zero-copy result of all-gather ``seq`` (only where :attr:`zero_copy_results`)."""
        raise NotImplementedError(f"{type(self).__name__} has no zero-copy results")

    def reduce_scatter(self, seq: int, src: torch.Tensor | None, src_off: int,
                       src_stride: int, L: int, dst: torch.Tensor, dst_off: int,
                       dtype: torch.dtype, part: tuple[int, int] | None = None) -> None:
        """Chunk j of ``src`` is its bytes ``j * src_stride + src_off ... + L``; this rank's
        fp32 rank-order sum lands at ``dst[dst_off:dst_off + L]`` (``src=None``: the
        chunks already lie in the send slot). ``part``: as in :meth:`all_gather`."""
        raise NotImplementedError

    has_all_to_all = False
    """Whether :meth:`all_to_all` is implemented."""

    streams_all_to_all = False
    """Whether :meth:`all_to_all` takes ``fill`` and ``arrived`` (the CPU twin): the caller
    writes each group of its blocks into the send slot just before it is published, and
    hears of each source's bytes as they land, so its own host work runs beside the wire."""

    def all_to_all(self, seq: int, src: torch.Tensor | None, src_off: int, src_stride: int,
                   L: int, dst: torch.Tensor, dst_off: int, dst_stride: int,
                   dtype: torch.dtype, fill=None, arrived=None, sized: bool = False) -> None:
        """The reduce-scatter's wire (same slots, flags, relays) with a copy for a sum: chunk
        j of ``src`` (bytes ``j * src_stride + src_off ... + L``) goes to rank j, and source
        i's chunk for this rank lands, byte for byte, at ``i * dst_stride + dst_off`` of
        ``dst``. ``dtype``: what the peers compare (the bytes are never read as numbers).

        Only where :attr:`streams_all_to_all`: ``fill(base, stride, lo, hi)`` (then ``src``
        is None) writes bytes ``[lo, hi)`` of every chunk j at ``base + j * stride + lo``
        (called in order of ``lo``, each range once, before that range is sent; ``base`` is
        only valid during the call); ``arrived(source, hi)``: bytes ``[0, hi)`` of source's
        chunk lie in ``dst`` (``hi`` grows per source; this rank's own chunk is told
        whole, first).

        ``sized`` (call word KIND_ALL_TO_ALL_SIZED; ``L >= 8``): chunk j's first 8 bytes
        (little-endian, counting themselves) say how many of its bytes carry data
        (:func:`sparkccl.plan.geometry.sized_bytes`); the bytes past that are not
        published, posted or copied out (the GPU-direct copy engines, which take their sizes
        from the host, send them all), so in ``dst`` they are undefined (and ``arrived``'s
        ``hi`` counts them as in)."""
        raise NotImplementedError(f"{type(self).__name__} has no all_to_all")

    def moe_finalize_reduce_scatter(self, seq: int, f, row_lo: int, rows: int,
                                    dst: torch.Tensor, dst_off: int) -> None:
        """One MoE-finalize collective (``f``: :class:`sparkccl.finalize.FinalizeInputs`)."""
        raise NotImplementedError

    # The fused all-reduce (docs/PROTOCOL.md "All-reduce").
    fused_all_reduce = False
    """Whether :meth:`all_reduce` is implemented: the reduce-scatter and all-gather of an
    all-reduce as one operation under one sequence number. Planes without it get the
    two-collective path of ``sparkccl/allreduce.py``."""

    def all_reduce(self, seq: int, src, src_off: int, src_stride: int, L: int, dst,
                   dst_off: int, dst_stride: int, dtype: torch.dtype, avg: bool,
                   pad: int = 0) -> None:
        """All-reduce chunks of L bytes (a multiple of 16) as one operation: chunk j of
        ``src`` is its bytes ``j * src_stride + src_off ... + L`` (``src=None``: already in
        the reduce-scatter send slot at ``j * L``); the rank-order fp32 sum of chunk i
        (``avg``: divided once by the world size), rounded once to ``dtype``, lands at bytes
        ``i * dst_stride + dst_off ... + L`` of ``dst`` for every i. ``pad``: the zero
        bytes this collective carries past the caller's data, over its chunks
        (``sparkccl.allreduce.zero_bytes``; the peers compare it)."""
        raise NotImplementedError(f"{type(self).__name__} has no fused all-reduce "
                                  "(fused_all_reduce is False): use sparkccl/allreduce.py's "
                                  "reduce-scatter + all-gather")

    fused_input_in_slot = True
    """True: :meth:`all_reduce` wants its input in the reduce-scatter send slot where the chunk
    fits one (the communicator writes it there; the CPU twin then publishes without a copy).
    False: it is given the input itself (the CUDA kernel copies the peers' chunks in its own
    launch: an unpadded input costs one launch, and the own chunk is never copied)."""

    # The one-shot all-reduce in one operation (docs/PROTOCOL.md "All-reduce").
    one_shot_all_reduce = False
    """Whether :meth:`all_reduce_one_shot` is implemented (the CUDA plane: one launch).
    Planes without it get ``sparkccl/allreduce.py``'s all-gather and local sum."""

    def ll_for(self, L: int) -> bool:
        """Does a one-shot all-reduce of ``L`` bytes per rank take the LL way (lines that carry
        their own flags: the CUDA plane between GPU-direct peers, ``CudaDataPlane.enable_ll``)?
        It copies a shifted input itself, and every rank must take it or none."""
        return False

    def all_reduce_one_shot(self, seq: int, src, dst, avg: bool, pad: int = 0) -> None:
        """All-reduce ``src`` (contiguous, bf16 / fp16 / fp32, at most one slot) into ``dst``
        (same dtype and size; may be ``src``) as one collective: an all-gather of ``src`` on
        the wire, then the rank-order fp32 sum of the W vectors (``avg``: divided once by
        the world size), rounded once. ``pad``: as in :meth:`all_reduce` (the W vectors'
        padding to 16 bytes, ``world * round_up(L, 16) - L``: what the all-gather of
        ``sparkccl/allreduce.py``'s one shot says, so either way the peers see one call)."""
        raise NotImplementedError(f"{type(self).__name__} has no one-shot all-reduce")

    # ---- completion ----------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every collective issued so far and raise if one failed. A plane whose
        collectives are done when they return (CPU) has nothing to wait for."""

    def check_status(self) -> None:
        """Raise a failure the plane recorded without waiting (CUDA: the GPU record)."""

    def close(self) -> None:
        """Release what the plane holds (before the segments are unmapped)."""

    # ---- CUDA-graph capture (docs/CONTRACT.md "CUDA graphs") ------------------------
    def seq_on_host(self) -> bool:
        """Does the host know the next collective's seq, and so its slots? Only a plane
        whose collectives can be captured and replayed ever says False."""
        return True

    def refuse_capture(self, what: str) -> None:
        """Raise if the caller's stream is being captured: ``what`` (setting up buffers:
        pinning memory, talking to the peers) cannot be captured."""

    # ---- failure -------------------------------------------------------------------
    def poison_call(self, out) -> None:
        """After the collectives of one call that was split into several: mode "poison"
        of the CUDA plane poisons the whole output if any of them failed (a caller never
        sees half a result beside half NaN). Nothing to do on the CPU: a failure raises."""

    def check_abort(self) -> None:
        code = self.nat.abort_code(self.ctl)
        if code:
            self.raise_recorded(code)

    def raise_recorded(self, code: int, context: str = "") -> None:
        text = self.nat.error_text(self.ctl) or f"aborted (code {code})"
        msg = f"rank {self.rank}: communicator aborted: {text}"
        if context:
            msg = f"rank {self.rank}: {context} failed: communicator aborted: {text}"
        raise CollectiveError(msg, rank=self.rank, cause=text)

    def fail(self, message: str, code: int, *, peer=None, connection=None) -> None:
        """Record ``message`` as the abort cause (unless something failed first) and raise."""
        first = self.nat.set_abort(self.ctl, code, message)
        cause = message if first else (self.nat.error_text(self.ctl) or message)
        if not first:
            message = f"{message} (the communicator had already failed: {cause})"
        raise CollectiveError(message, rank=self.rank, peer=peer, connection=connection,
                              cause=cause)

    def _sender(self, channel: int, origin: int) -> int:
        """The rank the data arrived from on ``channel`` (differs from origin for relays)."""
        if self.plan.topology != "ring":
            return origin
        return (self.rank - 1) % self.world if channel == PREV else (self.rank + 1) % self.world

    def timed_out(self, what: str, piece: int, word: int, note: str = "") -> None:
        """Fail with the timeout of a wait for flag ``word``: its origin, and the connection
        (and relaying neighbour) the data was to come through."""
        _, origin, channel, root = decode_flag_word(self.world, word)
        sender = self._sender(channel, origin)
        conn = f"channel {channel} root {root}"
        via = "" if sender == origin else f", relayed by rank {sender}"
        # What the flag word holds tells a sender that never started from one that stalled
        # part-way (value = seq * FLAG_STRIDE + piece + 1 of the last piece it published).
        seen = ctypes.c_uint64.from_address(self.flags + layout.FLAG_BYTES * word).value
        last = (f"seq {seen // FLAG_STRIDE} piece {seen % FLAG_STRIDE - 1}" if seen % FLAG_STRIDE
                else "nothing")
        self.fail(f"rank {self.rank}: timed out after {self.timeout_s:g} s waiting for "
                  f"{what} piece {piece} from rank {origin} (connection: {conn}{via}{note}; "
                  f"flag word {word} shows {last} arrived)",
                  layout.ABORT_TIMEOUT, peer=origin, connection=conn)
