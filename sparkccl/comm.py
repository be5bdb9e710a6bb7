"""The Communicator: creation, the collectives and their checks, lifetime.

::

    import sparkccl, torch
    with sparkccl.Communicator(store=store, rank=r, world_size=w) as comm:
        y = comm.all_gather(x)            # [w * x.shape[0], *x.shape[1:]]
        z = comm.reduce_scatter(y)        # [y.shape[0] // w, ...], fp32 sum in rank order

All ranks must create the communicator together and call the same collectives in the same
order with the same shapes (docs/PROTOCOL.md). See ``sparkccl/config.py`` for settings.
The pieces live elsewhere: what a communicator holds and how it is built and torn down
(segments, transport, proxy, data plane, liveness) in :mod:`sparkccl.wiring`, segments and
sizes in :mod:`sparkccl.buffers`, the transports behind one interface in
:mod:`sparkccl.transport.base`, fork/exit handling in :mod:`sparkccl.lifetime`.

Sequence numbers: one counter per communicator, +1 per collective on the wire. An input
larger than the slot is split into several collectives (several numbers). An empty input
returns an empty result at once and uses no number: every rank sees the same empty shape,
so the counters stay in step, and slot reuse stays safe (the reuse argument of
docs/PROTOCOL.md needs every numbered collective to exchange data with every rank).

Lifetime: segments are unlinked from /dev/shm as soon as every rank has mapped them, so a
killed process leaves nothing behind; ``close()`` waits for every rank to close (bounded,
abort-aware) so that an early exit does not look like a crash to a peer's proxy.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import threading

import torch

from . import bootstrap, checks, config, layout, lifetime, wiring
from . import allreduce as _allreduce
from . import finalize as _finalize
from .buffers import Sizes, mib
from .errors import CollectiveError
from .plan.build import TOPOLOGIES, build_plan
from .plan.geometry import ALIGN, round_up
from .plan.model import REGION_SLOTS, Region
from .transport import registry

log = logging.getLogger("sparkccl")

SINGLE_RANK = "none"  # the transport of a world of one: nothing leaves the process
RS_DTYPES = checks.REDUCE_DTYPES
RS_SLOTS = REGION_SLOTS[Region.RS_SEND]
_FAST_OPS = {"sum": False, "avg": True}  # all_reduce's fast path: op -> avg (else allreduce.py)


def _native():
    try:
        from . import _native as nat
    except ImportError as e:  # pragma: no cover - depends on the build
        raise ImportError("sparkccl's native module is not built: reinstall with "
                          "`pip install --no-build-isolation -e .` (needs a C++17 compiler and "
                          f"cmake): {e}") from e
    return nat


class Communicator:
    """A group of ranks that run all-gather and reduce-scatter together.

    Args:
        group: a ``torch.distributed`` ProcessGroup to bootstrap over (its store is used;
            default: the default group). Mutually exclusive with ``store``.
        store: a ``torch.distributed.Store`` shared by the ranks, with ``rank`` and
            ``world_size``. A world of one rank works too (every collective is a local
            copy with the same rounding; no shared memory, proxy or transport).
        device: where collective inputs live: ``"cpu"`` (the default) or a CUDA device
            (``"cuda"``, ``"cuda:1"``; needs the ``[cuda]`` extra: cuda-python and NVRTC).
            On CUDA, collectives are asynchronous like NCCL's: they are queued on the
            caller's current stream and return. All collectives of one communicator must be
            issued on one stream (or streams ordered by events). A failure (peer dead or
            stalled, timeout, abort) is never consumed as a success; ``SPARKCCL_ON_FAILURE``
            says how: ``stop`` (default) prints the ``CollectiveError`` on stderr and stops
            the GPU (device trap): the next synchronization (``.cpu()``,
            ``torch.cuda.synchronize()``, an event wait) raises a CUDA error and the process
            must be restarted, as with NCCL. ``poison``: the failed collective's outputs
            (and those of collectives queued after it) are overwritten with 0xFF bytes (NaN
            in every floating dtype), every later call raises ``CollectiveError``, and
            :meth:`check` raises it on demand: synchronize the stream, then call
            :meth:`check` before trusting outputs; after a failure close this communicator
            and build a new one (docs/CONTRACT.md "Failure behaviour").
        topology: ``"mesh"`` (every rank reaches every other) or ``"ring"`` (neighbours only,
            relays for the rest); results are bit-identical.
        transport: ``"auto"`` (``"shm"`` when all ranks are on one host, else ``"verbs"``
            when every rank has usable RDMA devices, else ``"tcp"``), ``"shm"``,
            ``"verbs"`` (RoCE / InfiniBand; see ``sparkccl/transport/verbs.py``) or
            ``"tcp"`` (any IP network; addresses per root from ``SPARKCCL_TCP_ADDRS`` /
            ``SPARKCCL_TCP_PREV_ADDRS`` / ``SPARKCCL_TCP_NEXT_ADDRS``, see
            ``sparkccl/transport/tcp.py``).
        slot_bytes: capacity of one slot = the whole gathered / reduce-scattered tensor of
            one collective (world x slice bytes); larger inputs are split into several
            collectives. Default ``SPARKCCL_SLOT_BYTES`` or 64 MiB. Shared memory per rank
            is about 8 x the slot (:func:`sparkccl.buffers.bytes_per_rank`), reserved in
            /dev/shm when created: a /dev/shm too small for it raises
            :class:`~sparkccl.errors.ShmSpaceError` (a ``ConfigError``) on every rank.
        timeout_s: how long a collective may wait for peers before it raises
            ``CollectiveError``. Default ``SPARKCCL_TIMEOUT_S`` or 120 s.
        bootstrap_timeout_s: how long creating the communicator (all ranks joining and
            connecting) and ``close()`` (all ranks closing) may wait for the other ranks
            before ``CollectiveError``, which names this setting. Default
            ``SPARKCCL_BOOTSTRAP_TIMEOUT_S``, else the same as ``timeout_s``. Raise it when
            ranks start far apart (e.g. slow imports on a busy host).

    Attributes ``rank``, ``world_size``, ``topology``, ``transport`` (the one in use:
    ``auto`` resolved; ``"none"`` for a world of one), ``slot_bytes``, ``timeout_s``,
    ``bootstrap_timeout_s``, ``pinned_bytes`` (shared memory this rank holds; grows by the
    reduce-scatter buffers on first reduce-scatter, unless ``SPARKCCL_RS_UP_FRONT=1``).

    Settings every rank must agree on (checked at creation, where every rank raises the
    same ``ValueError`` naming the ranks that disagree): topology, transport, world size,
    slot size, roots, ``SPARKCCL_RS_UP_FRONT``. All ranks must also call the same
    collectives in the same order with the same shapes; a size mismatch is detected on the
    first piece of the collective where it occurs (``CollectiveError``, after sending,
    when ``SPARKCCL_CHECK_SIZES`` is on) or shows as a timeout.
    """

    def __init__(self, group=None, *, store=None, rank=None, world_size=None, device=None,
                 topology: str = "mesh", transport: str = "auto", slot_bytes=None,
                 timeout_s=None, bootstrap_timeout_s=None):
        self._closed = True  # until fully built
        self._wiring: wiring.Wiring | None = None  # world 1: none
        for name, v in (("topology", topology), ("transport", transport)):
            if not isinstance(v, str):
                raise TypeError(f"{name} must be a str, got {type(v).__name__}")
        for name, v in (("timeout_s", timeout_s), ("bootstrap_timeout_s", bootstrap_timeout_s)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise TypeError(f"{name} must be a number of seconds, got {type(v).__name__}")
        dev = torch.device("cpu" if device is None else device)
        if dev.type == "cuda":
            from .dataplane import cuda_runtime as _cuda
            _cuda.check_available(dev)  # a clear error on every rank, before the bootstrap
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.type != "cpu":
            raise ValueError(f"device={str(dev)!r}: sparkccl works on CPU tensors "
                             "(device='cpu') or CUDA tensors (device='cuda')")
        self.device = dev

        st, r, w, _ = bootstrap.resolve_group(group, store, rank, world_size)
        self.rank, self.world_size, self.topology = r, w, topology
        self.seq = 0  # the next collective's sequence number
        self._rs_count = 0
        self._handout = None  # (tensor data_ptr, nbytes, slot parity, rs_count) of the zero-copy buffer
        self._lock = threading.Lock()
        if w == 1:
            self._create_single(topology, transport, slot_bytes, timeout_s, bootstrap_timeout_s)
            return
        # Join first: a rank whose local settings are bad still takes its turn (so later
        # communicators on this store stay in step) and tells the others, who fail at once.
        try:
            boot, boot_setting = bootstrap.timeout(bootstrap_timeout_s, timeout_s)
            bad_boot = None
        except (ValueError, TypeError) as e:
            boot, boot_setting, bad_boot = config.get("SPARKCCL_TIMEOUT_S", {}), "default", e
        self.token = token = bootstrap.new_token(st, r, w, boot, boot_setting)
        rv = bootstrap.Rendezvous(st, f"sparkccl/{token}", r, w, boot, boot_setting)
        try:
            if bad_boot is not None:
                raise bad_boot
            s = config.resolve(slot_bytes=slot_bytes, timeout_s=timeout_s, local_ranks=w,
                               world=w)
            s = dataclasses.replace(s, bootstrap_timeout_s=boot)
            self._nat = _native()
        except (ValueError, TypeError, ImportError) as e:
            rv.post("info", {"error": f"{type(e).__name__}: {e}"})
            raise
        self.slot_bytes, self.timeout_s, self.bootstrap_timeout_s = \
            s.slot_bytes, s.timeout_s, s.bootstrap_timeout_s

        infos, chosen = wiring.join(rv, w, topology, transport, s)
        self.transport = chosen.name
        self.plan = build_plan(topology, w, r, s.roots)
        self.sizes = Sizes.of(s.slot_bytes, w, self.plan)  # the same on every rank
        self.max_slice = self.sizes.max_slice
        self._wiring = wiring.Wiring(self._nat, rv, token=token, rank=r, world=w,
                                     topology=topology, device=dev, settings=s, infos=infos,
                                     plan=self.plan, sizes=self.sizes)
        try:
            self._wiring.build(chosen, self.transport)
        except BaseException:
            self._teardown(barrier=False)
            raise
        rv.timeout_s, rv.setting = s.timeout_s, "timeout_s"  # from here on, collectives wait
        self._calls_ready()
        self._closed = False
        lifetime.track(self)
        rs_note = ("reduce-scatter buffers held" if self._rs_ready else
                   f"+{mib(self.sizes.rs_bytes)} for reduce-scatter on first use")
        log.info("sparkccl: rank %d/%d %s/%s holds %s of shared memory (slot %s; %s); "
                 "timeout %g s, proxy spin %d us nap %d us%s",
                 r, w, topology, self.transport, mib(self.pinned_bytes), mib(s.slot_bytes),
                 rs_note, s.timeout_s, s.spin_us, s.nap_us,
                 " (oversubscribed host)" if s.oversubscribed else "")

    def _create_single(self, topology, transport, slot_bytes, timeout_s, bootstrap_timeout_s):
        """World 1: the settings are checked as for any world; nothing else is built."""
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology={topology!r}: must be one of {', '.join(TOPOLOGIES)}")
        if transport not in registry.names():
            raise ValueError(f"transport={transport!r}: must be one of "
                             f"{', '.join(registry.names())}")
        s = config.resolve(slot_bytes=slot_bytes, timeout_s=timeout_s, local_ranks=1)
        self.bootstrap_timeout_s = bootstrap.timeout(bootstrap_timeout_s, timeout_s)[0]
        self._nat = _native()
        self.slot_bytes, self.timeout_s = s.slot_bytes, s.timeout_s
        self.transport = SINGLE_RANK
        self.plan = None
        self.max_slice = s.slot_bytes // ALIGN * ALIGN
        self._calls_ready()
        self._closed = False

    @property
    def single(self) -> bool:
        """A world of one rank: every collective is computed locally."""
        return self.world_size == 1

    # ---- what the collectives reach (held by sparkccl/wiring.py) -----------------------
    @property
    def _dp(self):
        return self._wiring.dp if self._wiring is not None else None

    @property
    def _ctl_addr(self) -> int | None:
        return self._wiring.ctl_addr if self._wiring is not None else None

    @property
    def _rs_ready(self) -> bool:
        return self._wiring is not None and self._wiring.rs_ready

    @property
    def pinned_bytes(self) -> int:
        return self._wiring.pinned_bytes if self._wiring is not None else 0

    @property
    def rs_ready(self) -> bool:
        """Do the reduce-scatter buffers exist yet? (They are set up by the first
        reduce-scatter, which a CUDA graph cannot capture: integrations warm it up first.)"""
        return self._rs_ready

    @property
    def data_plane(self):
        """The data plane (:class:`sparkccl.dataplane.base.DataPlaneBase`), or None (world
        of one, or closed): for benchmarks and diagnostics (e.g. ``clock_error_ns``)."""
        return self._dp

    def lanes(self) -> dict:
        """(channel, root) -> the RDMA lane this rank uses ({} for transports without
        lanes, a world of one, or a closed communicator)."""
        link = self._wiring.link if self._wiring is not None else None
        return link.lanes() if link is not None else {}

    def describe_lanes(self) -> list[str]:
        """One line per RDMA lane this rank uses ([] without lanes)."""
        link = self._wiring.link if self._wiring is not None else None
        return link.describe() if link is not None else []

    def _ensure_rs(self) -> None:
        if not self._rs_ready:
            self._wiring.ensure_rs()
            self._note_send_slots()

    def _rs_plane(self, what: str):
        """Under the lock, what a collective on the reduce-scatter's buffers does first: the
        liveness check, the buffers set up on first use (refused inside a graph capture),
        then the data plane."""
        self._check_alive(what)
        if not self._rs_ready:
            self._check_setup_capturable(what)
            self._ensure_rs()
        return self._dp

    # ---- internal interface (finalize, selftest, bench, tests) -----------------------
    def proxy_stats(self) -> dict:
        """The native proxy's counters ({} without a proxy: world 1, or closed)."""
        return self._wiring.proxy_stats() if self._wiring is not None else {}

    def _calls_ready(self) -> None:
        """What every collective reads, found once: the abort word (read in place: cheaper
        than a native call), the data plane if it takes typed tensors, the send slots'
        bounds (see _match_handout; set with the reduce-scatter buffers)."""
        self._abort_word = None if self.single else memoryview(
            (ctypes.c_uint8 * 8).from_address(self._ctl_addr + layout.CTL_ABORT)).cast("B").cast("Q")
        dp = self._dp
        self._typed_dp = dp if dp is not None and dp.typed_io else None
        self._zero_copy_results = dp is not None and dp.zero_copy_results
        # The all-reduces that all_reduce's eager fast path takes: up to this many bytes (-1:
        # none) go to the plane's one-shot operation with no further decision. What
        # allreduce.all_reduce would choose for them too: the one-shot regime (the agreed
        # crossover, fixed at creation; forced: any size), the plane's one operation, one slot.
        self._one_shot_dp = dp if dp is not None and dp.one_shot_all_reduce else None
        fast = self._typed_dp is not None and self._one_shot_dp is not None
        self._one_shot_forced = self.max_slice if fast else -1
        self._one_shot_max = (min(self._wiring.settings.allreduce_oneshot_bytes, self.max_slice)
                              if fast else -1)
        self._send_bounds = (0, 0)
        self._note_send_slots()

    # ---- checks ----------------------------------------------------------------------
    def check_open(self, what: str) -> None:
        """Raise ``ValueError`` naming ``what`` if this communicator is closed (for the
        collectives built on it, e.g. :class:`sparkccl.ExpertParallel`)."""
        if self._closed:
            raise ValueError(f"{what}: this Communicator is closed; create a new one")

    def _check_tensor(self, x, what: str, name: str = "x") -> None:
        checks.tensor(x, self.device, what, name)

    def _check_out(self, out, what: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        return checks.out(out, self.device, what, shape, dtype)

    def _check_alive(self, what: str) -> None:
        word = self._abort_word
        if word is None:
            return
        if self._closed:  # (raises; the word may be unmapped by now)
            self.check_open(what)
        if not word[0]:
            return
        code = self._nat.abort_code(self._ctl_addr)
        if code:
            text = self._nat.error_text(self._ctl_addr) or f"aborted (code {code})"
            raise CollectiveError(f"rank {self.rank}: {what}: this communicator failed earlier "
                                  f"and cannot be used any more (create a new one): {text}",
                                  rank=self.rank, cause=text)

    def _part(self, part_of, chunk: int, off: int, L: int):
        """(kind, zero bytes) of one collective of an all-reduce's step (``part_of``: kind
        and the caller's bytes), or None. The collective carries each chunk padded to
        ALIGN bytes (a one-shot all-reduce's chunk is the whole vector)."""
        if part_of is None:
            return None
        kind, nbytes = part_of
        return kind, _allreduce.zero_bytes(nbytes, round_up(chunk, ALIGN), self.world_size, off,
                                           round_up(L, ALIGN))

    def _next_seq(self) -> int:
        s = self.seq
        self.seq += 1
        return s

    # ---- collectives -----------------------------------------------------------------
    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None,
                   zero_copy: bool = False,
                   part_of: tuple[int, int] | None = None) -> torch.Tensor:
        """Gather every rank's ``x`` (any dtype and shape, contiguous, same on every rank).

        Returns ``[world * x.shape[0], *x.shape[1:]]`` (a 0-dim ``x`` counts as shape
        ``[1]``, giving ``[world]``) with rank i's ``x`` at position i: a fresh tensor, or
        ``out``. Slices above the slot capacity are split into several collectives.

        ``zero_copy=True`` (CUDA only; ignored on CPU): return a view of the pinned receive
        slot instead of copying into device memory, valid while the next two collectives
        of any kind are issued (the third reuses the slot: docs/CONTRACT.md). Only when the slice is a multiple of 16 bytes and fits one slot,
        and not in or after a CUDA graph capture (otherwise a fresh tensor as usual).

        ``part_of``: (kind, the caller's bytes) of the all-reduce this all-gather is the
        second step of (:mod:`sparkccl.allreduce`): what the peers compare
        (docs/PROTOCOL.md "Publish ring").
        """
        # (The checks are written for the call that passes them, without a helper call
        # each: checks.usable reads each tensor property once; the helpers say what failed.)
        what = "all_gather"
        if self._closed:
            self.check_open(what)
        device = self.device
        if not checks.usable(x, device):
            self._check_tensor(x, what)
        shape = x.shape or (1,)  # (a 0-dim x counts as [1])
        out_shape = (self.world_size * shape[0], *shape[1:])
        n = x.nbytes
        if (zero_copy and out is None and n and self._zero_copy_results
                and n % ALIGN == 0 and n <= self.max_slice and self._seq_on_host()):
            with self._lock:
                self._check_alive(what)
                seq = self._next_seq()
                self._dp.all_gather(seq, x.detach().reshape(-1).view(torch.uint8), None, 0, 0,
                                    x.dtype, self._part(part_of, n, 0, n))
                view = self._dp.ag_slot(seq, self.world_size * n)
            return view.view(x.dtype).view(out_shape)
        out = checks.out(out, device, what, out_shape, x.dtype)
        if n == 0:
            return out
        if self.single:
            out.view(-1).copy_(x.detach().reshape(-1))
            return out
        with self._lock:
            self._check_alive(what)
            dp = self._typed_dp
            if dp is not None and n <= self.max_slice:
                # One collective, and the plane counts bytes itself: no views per call.
                dp.all_gather(self._next_seq(), x, out, 0, n,
                              part=None if part_of is None else self._part(part_of, n, 0, n))
                return out
            src = x.detach().reshape(-1).view(torch.uint8)
            dst = out.detach().reshape(-1).view(torch.uint8)
            for off in range(0, n, self.max_slice):
                L = min(self.max_slice, n - off)
                self._dp.all_gather(self._next_seq(), src[off:off + L], dst, off, n, x.dtype,
                                    self._part(part_of, n, off, L))
            if n > self.max_slice:
                self._dp.poison_call(out)
        return out

    def reduce_scatter(self, x: torch.Tensor, *, out: torch.Tensor | None = None,
                       part_of: tuple[int, int] | None = None) -> torch.Tensor:
        """Sum ``x`` (``[world * m, ...]``, bf16 / fp16 / fp32) over ranks; return chunk
        ``rank`` (``[m, ...]``) of the sum, taken in fp32 in rank order 0..world-1 and
        rounded once to ``x.dtype``. If ``x`` came from :meth:`reduce_scatter_input`, the
        input copy is skipped. ``part_of``: as in :meth:`all_gather` (the first step)."""
        what = "reduce_scatter"  # (checks written as in all_gather)
        if self._closed:
            self.check_open(what)
        device = self.device
        if not checks.usable(x, device):
            self._check_tensor(x, what)
        dtype, shape = x.dtype, x.shape
        if dtype not in RS_DTYPES:
            raise TypeError(f"{what}: dtype {dtype} is not supported; use torch.bfloat16, "
                            "torch.float16 or torch.float32 (e.g. x.to(torch.bfloat16))")
        if not shape:
            raise ValueError(f"{what}: x must have at least one dimension ([world * m, ...]), "
                             "got a 0-dim tensor")
        W = self.world_size
        if shape[0] % W:
            raise ValueError(f"{what}: x.shape[0] = {shape[0]} must be a multiple of the world "
                             f"size {W} (x is [world * m, ...]); pad it to "
                             f"{round_up(shape[0], W)} rows")
        out = checks.out(out, device, what, (shape[0] // W, *shape[1:]), dtype)
        chunk = x.nbytes // W
        lo, hi = self._send_bounds  # ((0, 0) until the reduce-scatter buffers exist)
        handout = self._match_handout(x, what) if lo <= x.data_ptr() < hi else None
        if chunk == 0:
            return out
        if self.single:  # the sum of one term in fp32, rounded once (as the data planes do)
            out.copy_(x.detach().to(torch.float32))
            return out
        with self._lock:
            dp = self._rs_plane(what)
            if chunk <= self.max_slice and self._typed_dp is not None:
                dst = out  # the plane counts bytes itself: no views per call
            else:
                dst = out.detach().reshape(-1).view(torch.uint8)
            part = None if part_of is None else self._part(part_of, chunk, 0, chunk)
            if handout is not None and handout == self.seq % RS_SLOTS:
                dp.reduce_scatter(self._next_seq(), None, 0, chunk, chunk, dst, 0, dtype, part)
            elif dst is out:
                dp.reduce_scatter(self._next_seq(), x, 0, chunk, chunk, out, 0, dtype, part)
            else:
                src = x.detach().reshape(-1).view(torch.uint8)
                for off in range(0, chunk, self.max_slice):
                    L = min(self.max_slice, chunk - off)
                    dp.reduce_scatter(self._next_seq(), src, off, chunk, L, dst, off, dtype,
                                      self._part(part_of, chunk, off, L))
                if chunk > self.max_slice:
                    dp.poison_call(out)
            self._rs_count += 1
            self._handout = None
        return out

    def all_to_all(self, x: torch.Tensor | None, *, out: torch.Tensor | None = None,
                   fill=None, arrived=None, sized: bool = False) -> torch.Tensor:
        """Exchange equal blocks: ``x`` is ``[world * m, ...]`` (any dtype, contiguous); block
        j (rows ``j * m ... (j + 1) * m``) goes to rank j, and rank i's block for this rank
        lands at block i of the result (``[world * m, ...]``, a fresh tensor or ``out``,
        which must not overlap ``x``): ``torch.distributed.all_to_all_single`` with equal
        splits. The bytes arrive unchanged. On the wire it is a reduce-scatter (the same
        slots, flags, roots and ring relays: docs/PROTOCOL.md "All-to-all") whose receiver
        copies each source's block instead of summing; blocks above the slot capacity are
        split into several collectives.

        For layers that overlap their own host work with the wire (expert parallelism),
        where the data plane streams (``DataPlaneBase.streams_all_to_all``: the CPU twin):
        ``fill(base, stride, lo, hi)`` instead of ``x`` (``x=None``, ``out`` given: it names
        the shape and dtype) writes bytes ``[lo, hi)`` of every block j (bytes of a block
        counted from its start) at ``base + j * stride + lo``, in order of ``lo``, just
        before they are sent; ``arrived(source, hi)``: bytes ``[0, hi)`` of source's block
        lie in ``out`` (this rank's own block is told whole, before any peer's).

        ``sized=True`` (blocks of at least 8 bytes; every rank the same): each block's first
        8 bytes, a little-endian uint64 counting themselves, say how many of its bytes
        carry data; only those travel (rounded up to 16 bytes, at most the block; below 8
        counts as 8), read on the device where the block is (no host read: capturable).
        In ``out`` each block's bytes past its sender's count are undefined. For blocks
        mostly empty at run time (expert parallelism's fixed-size blocks). A block above
        the slot capacity goes in several collectives of which only the first is cut."""
        what = "all_to_all"
        if self._closed:
            self.check_open(what)
        if not isinstance(sized, bool):
            raise TypeError(f"{what}: sized must be a bool, got {type(sized).__name__}")
        device = self.device
        if fill is not None:
            if x is not None or out is None:
                raise ValueError(f"{what}: fill takes x=None and out (the result's shape and "
                                 "dtype)")
            x = out
        elif not checks.usable(x, device):
            self._check_tensor(x, what)
        shape, W = x.shape, self.world_size
        if not shape:
            raise ValueError(f"{what}: x must have at least one dimension ([world * m, ...]), "
                             "got a 0-dim tensor")
        if shape[0] % W:
            raise ValueError(f"{what}: x.shape[0] = {shape[0]} must be a multiple of the world "
                             f"size {W} (x is [world * m, ...], block j for rank j)")
        out = checks.out(out, device, what, tuple(shape), x.dtype)
        n = x.nbytes
        a0, b0 = x.data_ptr(), out.data_ptr()
        if fill is None and n and a0 < b0 + n and b0 < a0 + n:
            raise ValueError(f"{what}: out overlaps x (an all-to-all is not done in place)")
        chunk = n // W
        if chunk == 0:
            return out
        if sized and chunk < 8:
            raise ValueError(f"{what}: sized=True needs blocks of at least 8 bytes (their "
                             f"first 8 say their length), got {chunk}")
        if self.single:
            if fill is not None:
                fill(out.data_ptr(), chunk, 0, chunk)
            else:
                out.copy_(x.detach())
            if arrived is not None:
                arrived(0, chunk)
            return out
        with self._lock:
            dp = self._rs_plane(what)
            if not dp.has_all_to_all:
                raise NotImplementedError(f"{what}: the {self.device.type} data plane "
                                          f"({type(dp).__name__}) has no all-to-all yet")
            streamed = fill is not None or arrived is not None
            if streamed and not dp.streams_all_to_all:
                raise NotImplementedError(f"{what}: the {self.device.type} data plane "
                                          f"({type(dp).__name__}) takes no fill / arrived")
            src = None if fill is not None else x.detach().reshape(-1).view(torch.uint8)
            dst = out.detach().reshape(-1).view(torch.uint8)
            for off in range(0, chunk, self.max_slice):
                L = min(self.max_slice, chunk - off)
                if streamed:  # (the plane counts a slice's bytes from the slice's start)
                    f = None if fill is None else (
                        lambda b, s, lo, hi, o=off: fill(b - o, s, lo + o, hi + o))
                    g = None if arrived is None else (
                        lambda i, hi, o=off: arrived(i, hi + o))
                    dp.all_to_all(self._next_seq(), src, off, chunk, L, dst, off, chunk,
                                  x.dtype, fill=f, arrived=g, sized=sized and off == 0)
                else:
                    dp.all_to_all(self._next_seq(), src, off, chunk, L, dst, off, chunk,
                                  x.dtype, sized=sized and off == 0)
            if chunk > self.max_slice:
                dp.poison_call(out)
            self._handout = None
        return out

    def all_reduce(self, x: torch.Tensor, op: str = "sum", *,
                   out: torch.Tensor | None = None, regime: str | None = None,
                   fused: bool | None = None) -> torch.Tensor:
        """Every rank's ``x`` (any shape, bf16 / fp16 / fp32, same on every rank) summed
        elementwise in fp32 in rank order 0..world-1 and rounded once to ``x.dtype``
        (``op="avg"``: that fp32 sum divided once by the world size, then rounded once):
        the same bits on every rank, topology and transport, at every size. Returns a
        fresh tensor of ``x``'s shape, or ``out`` (which may be ``x`` itself).

        Small tensors (up to ``SPARKCCL_ALLREDUCE_ONESHOT_BYTES``) take one all-gather and
        a local sum; larger ones a reduce-scatter and an all-gather; both give the same
        bits (:mod:`sparkccl.allreduce`). Bad input raises before anything is sent.
        ``regime`` (``"one_shot"`` / ``"two_step"``) forces one and ``fused=False`` the
        two-step regime's two collectives where the data plane has the fused operation:
        for tests and benchmarks (every rank must pass the same; the bits do not change).
        """
        # The eager fast path (the decode regime: an all-reduce of one slot on the CUDA plane),
        # checks written as in all_gather: the call that passes every check of
        # allreduce.all_reduce and that it would send to the plane's one-shot operation goes
        # there directly, with no views, no regime lookup through the layers, and the
        # plane's launch plan for its shape; anything else (a bad argument, which then
        # raises there, the two-step regime, another plane) takes allreduce.all_reduce.
        if self._closed:
            self.check_open("all_reduce")
        if regime is None:
            cap = self._one_shot_max
        elif regime.__class__ is str and regime == _allreduce.ONE_SHOT:
            cap = self._one_shot_forced
        else:
            cap = -1
        if cap > 0 and op.__class__ is str and x.__class__ is torch.Tensor:
            avg = _FAST_OPS.get(op)
            device, dtype = self.device, x.dtype
            if (avg is not None and dtype in RS_DTYPES and checks.usable(x, device)
                    and 0 < (n := x.nbytes) <= cap):
                if out is None:  # (x is contiguous: its shape, dtype and device, as checks.out)
                    out = torch.empty_like(x, memory_format=torch.contiguous_format)
                    self._one_shot(x, avg, out, n)
                    return out
                if (out.__class__ is torch.Tensor and out.dtype is dtype
                        and out.shape == x.shape and checks.usable(out, device)):
                    a0, b0 = x.data_ptr(), out.data_ptr()
                    # (out partly over x, shifted, takes allreduce.all_reduce's other way,
                    # as it would there: the kernel would read terms it already wrote)
                    if a0 == b0 or a0 >= b0 + n or b0 >= a0 + n:
                        self._one_shot(x, avg, out, n)
                        return out
        return _allreduce.all_reduce(self, x, op, out, fused_op=self._fused_all_reduce,
                                     one_shot_op=self._one_shot_all_reduce, regime=regime,
                                     fused=fused)

    @property
    def allreduce_oneshot_bytes(self) -> int:
        """All-reduces of at most this many bytes take the one-shot regime (the agreed
        ``SPARKCCL_ALLREDUCE_ONESHOT_BYTES``; 0 for a world of one)."""
        return self._wiring.settings.allreduce_oneshot_bytes if self._wiring is not None else 0

    def _one_shot_all_reduce(self, flat: torch.Tensor, avg: bool, dst: torch.Tensor) -> None:
        """The one-shot regime as the data plane's one operation
        (``DataPlaneBase.all_reduce_one_shot``): one collective, one sequence number."""
        self._one_shot(flat, avg, dst, flat.nbytes)

    def _one_shot(self, x: torch.Tensor, avg: bool, dst: torch.Tensor, n: int) -> None:
        """:meth:`_one_shot_all_reduce` of ``x`` (``n`` bytes, contiguous, any shape) into
        ``dst`` (the plane reads their bytes and pointers only)."""
        with self._lock:
            self._check_alive("all_reduce")
            # The padding as the all-gather of allreduce.py's one shot says it (_part): one
            # call word, whichever way each rank takes: zero_bytes(n, S, W, 0, S) with S = n
            # rounded up to ALIGN, in closed form (W chunks of S bytes carried, of which the
            # first n are the caller's; tests/test_allreduce.py checks the two agree).
            pad = self.world_size * round_up(n, ALIGN) - n
            self._one_shot_dp.all_reduce_one_shot(self._next_seq(), x, dst, avg, pad)

    def _fused_all_reduce(self, flat: torch.Tensor, avg: bool, dst: torch.Tensor) -> None:
        """The two-step regime as the data plane's one operation per slot-sized piece of the
        chunks (``DataPlaneBase.all_reduce``): the input padded with zeros to W chunks of a
        multiple of 16 bytes, written straight into the reduce-scatter send slot when the
        chunk fits one and the plane wants it there (``fused_input_in_slot``: zero-copy
        input, as :meth:`reduce_scatter_input`)."""
        n, W, dtype = flat.numel(), self.world_size, flat.dtype
        total, chunk = _allreduce.padded(n, W, dtype)
        res = dst if total == n else torch.empty(total, dtype=dtype, device=flat.device)
        with self._lock:
            dp = self._rs_plane("all_reduce")
            # (after a capture the slot is the GPU's: the host no longer knows it)
            if chunk <= self.max_slice and dp.fused_input_in_slot and self._seq_on_host():
                base = (self.seq % RS_SLOTS) * self.sizes.rs_send_stride
                buf = dp.rs_send[base:base + total * dtype.itemsize].view(dtype)
                buf[:n].copy_(flat)
                buf[n:].zero_()  # its sums are computed and dropped
                dp.all_reduce(self._next_seq(), None, 0, chunk, chunk, res, 0, chunk, dtype, avg,
                              _allreduce.zero_bytes(flat.nbytes, chunk, W, 0, chunk))
            else:
                src = flat
                if total > n:
                    src = torch.zeros(total, dtype=dtype, device=flat.device)
                    src[:n].copy_(flat)
                for off in range(0, chunk, self.max_slice):
                    L = min(self.max_slice, chunk - off)
                    dp.all_reduce(self._next_seq(), src, off, chunk, L, res, off, chunk, dtype,
                                  avg, _allreduce.zero_bytes(flat.nbytes, chunk, W, off, L))
                if chunk > self.max_slice:  # all of the result or none (CUDA)
                    dp.poison_call(res)
            # The send slot was overwritten: a reduce_scatter_input() buffer handed out
            # before is no longer the next reduce-scatter's (reduce_scatter refuses it).
            self._rs_count += 1
            self._handout = None
        if res is not dst:
            dst.copy_(res[:n])

    def _seq_on_host(self) -> bool:
        """False in and after a CUDA graph capture: the slots then follow the device's seq
        (the data plane's rule, DataPlaneBase.seq_on_host)."""
        return self.single or self._dp.seq_on_host()

    def _check_setup_capturable(self, what: str) -> None:
        """The first reduce-scatter sets its buffers up (pins memory, talks to the peers):
        the data plane refuses a capture of it (DataPlaneBase.refuse_capture)."""
        if not self._rs_ready:
            self._dp.refuse_capture(what)

    def _note_send_slots(self) -> None:
        """The bounds of the reduce-scatter send slots, once they exist: an input inside
        them is a handout (_match_handout); one outside is not, known from two compares."""
        if self._rs_ready:
            send = self._dp.rs_send
            lo = send.data_ptr()
            self._send_bounds = (lo, lo + send.numel())

    def _match_handout(self, x: torch.Tensor, what: str):
        """Slot parity if ``x``, which lies in the send slots, is the current zero-copy
        buffer (raises if it is not)."""
        p = x.data_ptr()
        if not self._seq_on_host():
            # The slot it lies in may be the one a replayed collective before this one still
            # sends from (the parity follows the device's seq): never copied from.
            raise RuntimeError(f"{what}: x is a reduce_scatter_input() buffer from before a CUDA "
                               "graph capture; in and after a capture reduce_scatter_input() "
                               "returns a plain tensor: call it again (docs/CONTRACT.md "
                               "\"CUDA graphs\")")
        h = self._handout
        if h is None or h[0] != p or h[1] != x.numel() * x.element_size() or h[3] != self._rs_count:
            raise ValueError(f"{what}: x lies in a reduce-scatter send slot but is not the buffer "
                             "from the latest reduce_scatter_input() (such a buffer is valid for "
                             "one reduce_scatter only); call reduce_scatter_input() again")
        return h[2]

    def reduce_scatter_input(self, shape, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A tensor of ``shape`` / ``dtype`` that *is* the next reduce-scatter's send slot:
        write the input into it and pass it to :meth:`reduce_scatter`, which then skips
        its input copy. Valid for the next reduce-scatter only.

        Zero-copy needs the per-rank chunk to be a multiple of 16 bytes and to fit one slot;
        otherwise (and if another collective runs in between, so the sequence parity moved)
        this still returns a usable tensor and reduce-scatter copies it as usual. In and
        after a CUDA graph capture the host no longer knows the next slot: a plain tensor.
        """
        what = "reduce_scatter_input"
        self.check_open(what)
        if dtype not in RS_DTYPES:
            raise TypeError(f"{what}: dtype {dtype} is not supported; use torch.bfloat16, "
                            "torch.float16 or torch.float32")
        try:
            shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list, torch.Size))
                                           else (shape,)))
        except (TypeError, ValueError):
            raise TypeError(f"{what}: shape must be a tuple of ints, got {shape!r}") from None
        W = self.world_size
        if len(shape) == 0 or shape[0] % W or any(d < 0 for d in shape):
            raise ValueError(f"{what}: shape must be [world * m, ...] with world = {W}, got "
                             f"{list(shape)}")
        nbytes = dtype.itemsize * math.prod(shape)
        chunk = nbytes // W
        if (self.single or chunk == 0 or chunk % ALIGN or chunk > self.max_slice
                or not self._seq_on_host()):
            return torch.empty(shape, dtype=dtype, device=self.device)
        with self._lock:
            self._check_alive(what)
            self._ensure_rs()
            parity = self.seq % RS_SLOTS
            base = parity * self.sizes.rs_send_stride
            t = self._dp.rs_send[base:base + nbytes].view(dtype).view(shape)
            self._handout = (t.data_ptr(), nbytes, parity, self._rs_count)
        return t

    def moe_finalize_reduce_scatter(self, y: torch.Tensor, pos: torch.Tensor,
                                    weights: torch.Tensor, shared: torch.Tensor, *,
                                    num_tokens: int, padded_tokens: int,
                                    y_scales: torch.Tensor | None = None,
                                    out: torch.Tensor | None = None) -> torch.Tensor:
        """The MoE finalize fused into a reduce-scatter (docs/PROTOCOL.md). Returns this rank's
        ``[padded_tokens / world, H]`` bf16 rows (token rows ``rank * Tpad/world ...``) of
        the sum over ranks of every rank's

            row[t] = shared[t] + sum_k weights[t, k] * y[pos[t * topk + k]]    (t < num_tokens)
            row[t] = 0                                                       (num_tokens <= t < Tpad)

        computed as an fp32 FMA chain in k order (``acc = float(shared[t])``, then
        ``acc = fma(weights[t, k], yv, acc)`` for k = 0..topk-1) and rounded once to bf16;
        the sum over ranks is taken in fp32 in rank order and rounded once, like
        :meth:`reduce_scatter`. Rows go straight into the send slot and are sent per
        (row piece, destination) as they are done, so the network runs under the finalize.

        Args:
            y: ``[R, H]`` bf16 expert outputs, or e4m3 values (``torch.float8_e4m3fn``, or
                their bytes as ``torch.uint8``) with ``y_scales``: then
                ``yv = float(e4m3) * y_scales[p, col // 128]`` (one fp32 multiply).
            pos: int32 ``[T * topk]`` (or ``[T, topk]``): the row of ``y`` for (token, k).
            weights: fp32 ``[T, topk]`` routing weights (scale folded in), topk <= 16.
            shared: bf16 ``[T, H]`` shared-expert output.
            num_tokens: T; rows of ``shared`` / ``weights`` / ``pos`` past T are ignored.
            padded_tokens: Tpad >= T, a multiple of the world size with Tpad / world >= 8.
            y_scales: fp32 ``[R, H / 128]`` for e4m3 ``y`` (H a multiple of 128).
            out: optional bf16 ``[Tpad / world, H]`` result tensor.

        Everything is checked before anything is sent (``TypeError`` / ``ValueError``),
        including ``0 <= pos < R`` on CPU. On CUDA the range check happens in the kernel
        (checking first would synchronize the stream): an out-of-range index is never read,
        its term is NaN, and :meth:`synchronize` raises ``ValueError`` naming it. Results
        larger than the slot are split into several collectives (row ranges of every chunk).
        """
        what = "moe_finalize_reduce_scatter"
        self.check_open(what)
        f = _finalize.check_inputs(self, what, y, pos, weights, shared, num_tokens,
                                   padded_tokens, y_scales)
        Rr, RB = f.rows_per_rank, f.row_bytes
        out = self._check_out(out, what, (Rr, f.H), torch.bfloat16)
        if self.single:
            _finalize.single_rank(self._nat, f, out)
            return out
        per = self.max_slice // (8 * RB) * 8  # rows of every chunk per collective (fin_slice)
        with self._lock:
            self._check_alive(what)
            self._check_setup_capturable(what)
            self._ensure_rs()
            dst = out.detach().reshape(-1).view(torch.uint8)
            for a in range(0, Rr, per):
                rows = min(per, Rr - a)
                self._dp.moe_finalize_reduce_scatter(self._next_seq(), f, a, rows, dst, a * RB)
            if Rr > per:
                self._dp.poison_call(out)
            self._rs_count += 1
            self._handout = None
        return out

    def synchronize(self) -> None:
        """Wait until this communicator's queued collectives have finished (CUDA; on CPU
        they already have) and raise ``CollectiveError`` if any of them failed."""
        self.check_open("synchronize")
        if self.single:
            return
        with self._lock:
            self._dp.synchronize()
            self._check_alive("synchronize")

    def check(self) -> None:
        """Raise the ``CollectiveError`` of this communicator's failure, if it failed; else
        return. It does not wait: on CUDA it sees failures of collectives that have run, so
        synchronize the stream first (an event, ``torch.cuda.synchronize()``) to cover
        everything queued (:meth:`synchronize` waits and checks in one call)."""
        self.check_open("check")
        if self.single:
            return
        self._dp.check_status()  # CUDA: the GPU record
        self._check_alive("check")

    # ---- lifetime --------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the communicator. Call it on every rank (or use ``with``): it waits (up to
        the bootstrap timeout) until every rank has closed, so that no rank's exit looks like
        a crash to a peer still finishing its last collective. Idempotent."""
        if self._closed:
            return
        self._closed = True
        lifetime.untrack(self)
        self._teardown(barrier=True)

    def _teardown(self, barrier: bool) -> None:
        if self._wiring is not None:
            self._wiring.teardown(barrier, self.bootstrap_timeout_s)

    def forget_after_fork(self) -> None:
        """In a forked child (:mod:`sparkccl.lifetime`): the proxy thread and the segments
        are the parent's; never tear them down here."""
        if self._wiring is not None:
            self._wiring.forget_after_fork()
        self._closed = True

    def release_at_exit(self) -> None:
        """At interpreter exit (:mod:`sparkccl.lifetime`): deliver what this rank owes its
        peers (bounded by the timeout, at once on a failed communicator), then tear down
        without waiting for the peers to close."""
        self._closed = True
        lifetime.untrack(self)
        if self._wiring is not None:
            departed = self._wiring.depart(self.seq, self.timeout_s)
            self._wiring.teardown(False, self.bootstrap_timeout_s, departed=departed)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None or self._closed:
            self.close()
            return
        # Leaving because of an exception: the peers may be waiting for this rank's data.
        # Record why, so their proxies fail them now (with this cause) instead of at their
        # timeout, and close without waiting for them.
        self._closed = True
        lifetime.untrack(self)
        try:
            if not issubclass(exc_type, CollectiveError) and self._wiring is not None:
                self._wiring.leave(f"rank {self.rank}: left the communicator because of an "
                                   f"exception: {exc_type.__name__}: {exc}")
        finally:
            self._teardown(barrier=False)

    def __del__(self):
        try:
            if not self._closed:
                self.release_at_exit()  # dropped without close(): the same as at exit
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"<sparkccl.Communicator rank {self.rank}/{self.world_size} {self.topology}/"
                f"{getattr(self, 'transport', '?')} {state}>")

