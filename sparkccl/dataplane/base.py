"""What every data plane shares: the rank's view of its control block, and failure
reporting (the abort record, the error naming rank, peer and connection, the cross-rank
size check). :class:`~.cpu.CpuDataPlane` and :class:`~.cuda.CudaDataPlane` both build on
it; neither is the other's parent."""
from __future__ import annotations

import ctypes

import torch

from .. import layout
from ..errors import CollectiveError
from ..plan.geometry import FLAG_STRIDE
from ..plan.model import PREV, Op, RankPlan, decode_flag_word

OP_NAMES = {Op.AG: "all_gather", Op.RS: "reduce_scatter"}


class DataPlaneBase:
    def __init__(self, native, *, plan: RankPlan, ctl_addr: int, flags_addr: int,
                 ag: torch.Tensor, ag_stride: int, timeout_s: float,
                 peer_rings: list | None = None):
        self.nat = native
        self.plan = plan
        self.rank = plan.rank
        self.world = plan.world
        self.ctl = ctl_addr
        self.flags = flags_addr
        self.ag = ag
        self.ag_stride = ag_stride
        self.timeout_s = timeout_s
        # peer_rings[p]: uint64 [256, 8] view of peer p's publish ring (size check), or None.
        self.peer_rings = peer_rings
        self.rs_send = self.rs_recv = None
        self.rs_send_stride = self.rs_recv_stride = 0

    # ---- the fused all-reduce (docs/PROTOCOL.md "All-reduce") -------------------------
    fused_all_reduce = False
    """Whether :meth:`all_reduce` is implemented: the reduce-scatter and all-gather of an
    all-reduce as one operation under one sequence number. Planes without it get the
    two-collective path of ``sparkccl/allreduce.py``."""

    def all_reduce(self, seq: int, src, src_off: int, src_stride: int, L: int, dst,
                   dst_off: int, dst_stride: int, dtype: torch.dtype, avg: bool) -> None:
        """All-reduce chunks of L bytes (a multiple of 16) as one operation: chunk j of
        ``src`` is its bytes ``j * src_stride + src_off ... + L`` (``src=None``: already in
        the reduce-scatter send slot at ``j * L``); the rank-order fp32 sum of chunk i
        (``avg``: divided once by the world size), rounded once to ``dtype``, lands at bytes
        ``i * dst_stride + dst_off ... + L`` of ``dst`` for every i."""
        raise NotImplementedError(f"{type(self).__name__} has no fused all-reduce "
                                  "(fused_all_reduce is False): use sparkccl/allreduce.py's "
                                  "reduce-scatter + all-gather")

    # ---- failure -------------------------------------------------------------------
    def poison_call(self, out) -> None:
        """After the collectives of one call that was split into several: mode "poison"
        of the CUDA plane poisons the whole output if any of them failed (a caller never
        sees half a result beside half NaN). Nothing to do on the CPU: a failure raises."""

    def check_abort(self) -> None:
        code = self.nat.abort_code(self.ctl)
        if code:
            self._raise_recorded(code)

    def _raise_recorded(self, code: int, context: str = "") -> None:
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

    def _timed_out(self, what: str, piece: int, word: int, note: str = "") -> None:
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

    def _check_size(self, op: Op, seq: int, source: int, slice_bytes: int) -> bool:
        """Every rank must pass the same sizes: compare with the source's own publish entry.
        False while that entry has not appeared yet (nothing compared)."""
        ring = self.peer_rings[source]
        if ring is None:
            return True
        rows = ring[(ring[:, 1] == seq) & (ring[:, 0] != 0)]
        if len(rows) == 0:
            return False
        theirs = int(rows[0, 2])
        if theirs != slice_bytes:
            self.fail(f"rank {self.rank}: {OP_NAMES[op]} seq {seq}: rank {source} passed a "
                      f"different size than this rank ({theirs} vs {slice_bytes} bytes per "
                      "rank, padded to 16); every rank must pass the same shape",
                      layout.ABORT_USER, peer=source)
        return True
