"""The GPU data plane: the same steps as :mod:`sparkccl.dataplane.cpu`, as CUDA kernels
(``kernels/``, compiled at run time with NVRTC, ``nvrtc.py``, cached on disk), launched on
the caller's current torch stream through the device seam (:mod:`.device`).

Per collective: its seq and first publish-ring index come from the device state
(``self.state``, protocol.h ``STATE_*``), not from kernel arguments, so a collective
captured in a CUDA graph takes fresh values at every replay (docs/PROTOCOL.md "Sequence
state"); the publish role copies the input piece by piece and writes each piece's ring
entry for the proxy, or, GPU-direct (same-host peers over shm, the default there), writes
straight into the peers' mapped regions and flag words itself; the wait role polls the
pinned flag words and copies out (all-gather) or sums the sources in rank order in fp32,
rounded once (reduce-scatter). How, is an engine's (:mod:`.engines`, :mod:`.ce_engine`,
chosen per collective by :mod:`.engine_choice`; docs/PROTOCOL.md "GPU-direct"); each
collective's pointers and call word are :mod:`.cuda_calls`'.

This module is the data plane the Communicator drives: the regions (the shared segments,
pinned with ``cudaHostRegister``, :mod:`.cuda_runtime`), the host's account of seq and
ring index, the checks before each call (the GPU record, the abort word, the peers' calls:
:mod:`.peer_check`), the eager fast path (:mod:`.launch_plan`), completion and failure.
Every wait watches the abort word and the timeout on the GPU clock and records a failure
in the control block's GPU record, which :mod:`.monitor`'s watchdog turns into a
:class:`CollectiveError`; then, by ``SPARKCCL_ON_FAILURE``, the kernel traps ("stop") or
``sccl_poison`` overwrites the outputs with NaN ("poison"; docs/PROTOCOL.md "Failure").

Collectives are asynchronous like NCCL's: they return once launched. All collectives of
one communicator must run on one stream (or streams ordered with events): a collective's
buffers are reused three (all-gather) or two (reduce-scatter) collectives later on the
assumption that the previous ones finished in order.

cuda-python is imported only when a :class:`CudaDataPlane` is created: CPU users never
need it.
"""
from __future__ import annotations

import ctypes

import torch

from .. import config, layout
from ..errors import CollectiveError, ConfigError
from ..plan.geometry import ALIGN, PIECES, round_up
from ..plan.model import REGION_SLOTS, Op, RankPlan, Region
from . import clock, timeline
from .base import OP_NAMES, DataPlaneBase
from .cpu import fin_slice
from .ce_engine import CePlan
from .engine_choice import Engines, direct_blocks_setting
from .engines import MAX_WAIT_BLOCKS, RS_WAIT
from .cuda_runtime import AlreadyRegistered
from .cuda_runtime import kernel_u64 as _n
from .cuda_runtime import u64_at as _u64
from .device import CudaDevice, Device
from . import cuda_calls
from .direct_tables import DirectTables
from .kernel_args import WaitBlocks
from .launch_plan import CallPtr, PlanCache, PlanSetting, plain
from .monitor import FailureMonitor

_P = layout.protocol_constants()
COUNTER_SETS = _P["COUNTER_SETS"]  # publish counters are indexed by seq % COUNTER_SETS
FIN_SET = _P["FIN_SET"]  # finalize counters per set: item counters, then the claim counter
STATE_SEQ, STATE_RING, STATE_TIMEOUT = _P["STATE_SEQ"], _P["STATE_RING"], _P["STATE_TIMEOUT"]
_GPU_STATUS_WORD = layout.CTL_GPU_STATUS // 8
_ABORT_WORD = layout.CTL_ABORT // 8
SLOT_SHIFT = _P["SLOT_SHIFT"]
CTL_GPU_ACK, CTL_GPU_MODE = layout.CTL_GPU_ACK, layout.CTL_GPU_MODE  # fail-stop handshake
FAIL_MODES = {"stop": _P["GPU_FAIL_STOP"], "poison": _P["GPU_FAIL_POISON"]}
# Before a collective the peers' sizes are compared every SIZE_CHECK_CALLS-th call only: each
# comparison reads rows the peers' GPUs write (cache misses across PCIe, microseconds per
# call), and a mismatch said a few calls later is as clear (synchronize() checks them all).
SIZE_CHECK_CALLS = 8
POISON_THREADS = 256
MAX_WORLD = 64


# ---------------------------------------------------------------- the data plane

class CudaDataPlane(DataPlaneBase):
    """The CUDA twin of :class:`~.cpu.CpuDataPlane` (same constructor and collective methods;
    tensors are CUDA ``uint8`` views). ``ag`` / ``attach_rs`` take the host (CPU) tensors
    over the shared segments; ``self.ag`` / ``self.rs_send`` / ``self.rs_recv`` become CUDA
    views of the same memory."""

    # What the planning code reads besides the shape (launch plans are keyed by shape).
    direct_mode = PlanSetting()
    phases = PlanSetting()
    on_failure = PlanSetting()
    max_publish_blocks = PlanSetting()
    max_wait_blocks = PlanSetting()
    max_direct_blocks = PlanSetting()
    max_direct_wait_blocks = PlanSetting()
    ce_min_slice = PlanSetting()

    def __init__(self, native, *, plan: RankPlan, ctl_addr: int, flags_addr: int,
                 ag: torch.Tensor, ag_stride: int, timeout_s: float,
                 peer_calls: memoryview | None = None, device=None, on_failure: str | None = None,
                 device_ops: Device | None = None):
        # Settings first: a bad value is refused before anything is pinned or launched.
        direct_mode = config.get("SPARKCCL_DIRECT_MODE")  # auto or one of DIRECT_MODES
        if on_failure is None:
            on_failure = config.get("SPARKCCL_ON_FAILURE")
        if on_failure not in FAIL_MODES:
            raise ConfigError(f"on_failure={on_failure!r}: expected one of {', '.join(FAIL_MODES)}")
        ce_min_slice = int(config.get("SPARKCCL_CE_MIN_BYTES"))
        direct_blocks = direct_blocks_setting()
        super().__init__(native, plan=plan, ctl_addr=ctl_addr, flags_addr=flags_addr, ag=ag,
                         ag_stride=ag_stride, timeout_s=timeout_s, peer_calls=peer_calls)
        if self.world > MAX_WORLD:
            raise ValueError(f"the CUDA data plane supports world sizes up to {MAX_WORLD}")
        self._registered: list[int] = []
        self._closed = False
        self.on_failure = on_failure
        self._last_event = None
        self._last_seq = 0  # the latest eager collective's seq (messages; host count)
        # seq -> the name of recent collectives (error messages: "all_gather", "all_reduce")
        self._ops: dict[int, str] = {}
        # The control block's words, the GPU record's code word (_GPU_STATUS_WORD) among them,
        # for the checks before every collective (a plain read each:
        # cheaper than ctypes or a native call; x86 and arm64 loads of aligned words are
        # atomic).
        self._ctl_words = memoryview(
            (ctypes.c_uint8 * layout.CTL_BYTES).from_address(ctl_addr)).cast("B").cast("Q")
        self.plans = PlanCache()  # the eager fast path (launch_plan.py)
        # The device seam (device.py): the CUDA driver, or the tests' host emulation.
        self.gpu = device_ops if device_ops is not None else CudaDevice(native, device)
        self.device, self.sms = self.gpu.device, self.gpu.sms
        # The watchdog, the fail-stop handshake, the release of stuck waits (monitor.py).
        self.monitor = FailureMonitor(self, self.gpu.trap_lock_path)
        # Grid caps (tunable: benchmarks; in-process tests with several ranks on one GPU
        # lower the wait cap so that every rank's spinning wait kernel fits beside the others);
        # the engines size each launch's grid within them (engines.Engine.publish_blocks ...).
        self.max_publish_blocks = 2 * self.sms
        self.max_wait_blocks = min(self.sms, MAX_WAIT_BLOCKS)
        self.phases = ("publish", "wait")  # benchmarks/kernel_roofline.py times one at a time
        try:
            ctl_bytes = layout.control_bytes(plan.num_flag_words)
            self.ctl_dev = self._register(ctl_addr, ctl_bytes)
            self.flags_dev = self.ctl_dev + (flags_addr - ctl_addr)
            self.ag_dev = self._register(ag.data_ptr(), ag.numel())
        except BaseException:
            self.close()
            raise
        self.ag = self.gpu.view(self.ag_dev, ag.numel())
        # Device state (protocol.h STATE_*): progress word, dead, the next collective's seq
        # and first ring index, the finalize gate's bumps, the timeout. Publish counters
        # per (seq % 4, piece).
        head = int(_u64(ctl_addr + layout.CTL_RING_HEAD).value)
        init = torch.zeros(_P["STATE_WORDS"], dtype=torch.int64)
        init[STATE_RING], init[STATE_TIMEOUT] = head, int(timeout_s * 1e9)
        self.timeline = timeline.attach(self.gpu, init)  # SPARKCCL_GPU_TIMELINE's stamps
        self.state = self.gpu.to_device(init)
        # The host's copy of the next seq and ring index: true until a collective is
        # captured in a CUDA graph (replays advance only the device's; see seq_on_host).
        self._seq_next, self._ring_next = 0, head
        self._graph = False   # a collective was captured: the host's copy is stale
        self._in_capture = False  # the current call is being captured
        self._graph_bufs: list[torch.Tensor] = []  # scratch a captured graph uses: kept
        self.ag_code = REGION_SLOTS[Region.AG] << SLOT_SHIFT | ag_stride
        self.counters = self.gpu.to_device(torch.zeros(COUNTER_SETS * PIECES, dtype=torch.int32))
        # Finalize: counters per (seq % 4) set, the bad-pos record, the own-chunk buffer.
        self.fin_counters = self.gpu.to_device(torch.zeros(COUNTER_SETS * FIN_SET,
                                                           dtype=torch.int32))
        self.fin_bad = self.gpu.to_device(torch.zeros(4, dtype=torch.int32))
        # GPU-direct finalize: own-rows gate per piece (monotonic; the device state's
        # STATE_GATE counts the bumps of every launch so far: each publish block bumps each
        # piece once).
        self.fin_gate = self.gpu.to_device(torch.zeros(PIECES, dtype=torch.int32))
        self._fin_used = False
        self._scratch_bufs: dict[str, torch.Tensor] = {}  # see _scratch
        self._retired: list[torch.Tensor] = []
        # The wait role's tables and constants per op (protocol.h kargs::WaitParams; every
        # kernel with a wait role takes a pointer to one; seq is read from the device state).
        self.timeout_ns = int(timeout_s * 1e9)
        self.waits = WaitBlocks(self)
        self.maxw = self.waits.maxw
        # GPU-direct (map_peers / map_peers_rs): per-op stream tables in device memory, and
        # the hand-offs' counters per (seq % 4, piece) (dcounters, below).
        # Blocks of sccl_*_direct: publish role, wait role (both resident: 2 per SM). Tunable
        # for measurements: SPARKCCL_DIRECT_BLOCKS="publish,wait" (e.g. "132,131").
        self.max_direct_blocks, self.max_direct_wait_blocks = self.sms, max(1, self.sms - 1)
        if direct_blocks is not None:
            self.max_direct_blocks, self.max_direct_wait_blocks = direct_blocks
        self.direct_mode = direct_mode
        self.ce_min_slice = ce_min_slice
        self._side_streams: dict[str, torch.cuda.Stream] = {}  # modes split / ce (see _fork)
        # the GPU-direct hand-offs' block counters (kernels/direct.cu hand_off)
        self.dcounters = self.gpu.to_device(torch.zeros(COUNTER_SETS * PIECES, dtype=torch.int32))
        # The peers' regions mapped here and the GPU-direct stream tables (map_peers).
        self.direct = DirectTables(plan, self.rank, self._register_peer, self.gpu.to_device)
        self.direct_launches = 0
        self.ll_table = None  # the ranks' LL areas (enable_ll), else the flag-word way
        self.ll_proxy = False  # enable_ll(through_proxy=True): the proxy posts the lines
        self.ll_launches = 0
        self.engines = Engines(self)  # proxy path, fused, split, ce: chosen per collective
        # What a failed wait does (kernels/wait.cu record_failure), before the first launch.
        _u64(ctl_addr + CTL_GPU_ACK).value = 0
        _u64(ctl_addr + CTL_GPU_MODE).value = FAIL_MODES[on_failure]
        # The GPU's publish stamps (SPARKCCL_GPU_STAMPS): CLOCK_MONOTONIC - %globaltimer, and
        # half the round trip of the handshake that measured it (its uncertainty), in ns.
        self.clock_offset_ns = self.clock_error_ns = None
        if config.get("SPARKCCL_GPU_STAMPS"):
            found, self._clock_buf = clock.stamps(self.gpu, self._register, self.rank,
                                                  self.state)
            if found is not None:
                self.clock_offset_ns, self.clock_error_ns = found
        self.gpu.synchronize()
        self.monitor.start()

    # ---- on the device (through the seam, device.py) ---------------------------------
    def _register(self, addr: int, size: int) -> int:
        dev = self.gpu.register(addr, size)
        self._registered.append(addr)
        return dev

    def _register_peer(self, addr: int, size: int) -> int:
        """Like _register, for a peer's segment mapped here; a range this process pinned
        already (ranks of one process, as in the in-process tests) is used as it is."""
        try:
            return self._register(addr, size)
        except AlreadyRegistered:
            return self.gpu.host_pointer(addr)

    def launch(self, stream, name: str, grid: int, block: int, *args) -> None:
        """Launch kernel ``name``; recorded into the launch plan being built, if any
        (parameters may be :class:`~.launch_plan.CallPtr`)."""
        self.plans.record(name, grid, block, args)
        self.gpu.launch_kernel(stream, name, grid, block, *plain(args))

    def launch_struct(self, stream, name: str, grid: int, block: int, words: list,
                      early: bool = False) -> None:
        """Launch kernel ``name`` whose one parameter is a protocol.h ``kargs`` struct
        (``words``: :func:`sparkccl.layout.pack_struct`'s); recorded as :meth:`launch`
        records, so a call pointer's patch sets the field at its byte offset."""
        self.plans.record(name, grid, block, tuple(words), by_value=True)
        self.gpu.launch_struct(stream, name, grid, block, plain(words), early=early)

    def end(self, ts) -> None:
        self.issued(self.gpu.mark(ts), ts)

    def issued(self, event, ts) -> None:
        """The latest collective was issued on torch stream ``ts`` and ends at ``event`` (what
        synchronize() and the watchdog ask about)."""
        self._last_event, self._last_ts = event, ts

    def _issue_plan(self, plan, args: tuple) -> bool:
        got = self.gpu.issue_plan(plan, args)
        if got is None:
            return False
        self._last_event, self._last_ts = got
        return True

    def latest_event(self, keep: bool = False):
        """The event after this plane's latest collective, or None (nothing issued). Once a
        collective was captured, replays leave no event of ours, but by the one-stream rule
        they ran on the stream of the latest eager call: a fresh event there lies after them
        (None: no eager call yet). ``keep``: it becomes the latest event."""
        if not self._graph:
            return self._last_event
        ts = getattr(self, "_last_ts", None)
        ev = None if ts is None else self.gpu.mark(ts)
        if keep and ev is not None:
            self._last_event = ev
        return ev

    @property
    def last_seq(self) -> int:
        """The latest eager collective's seq (as the host counted it)."""
        return self._last_seq

    def side_stream(self, name: str):
        """This data plane's torch stream ``name`` ("side": the sending side of modes split
        and ce; "watch": mode ce's piece waits), made on first use."""
        st = self._side_streams.get(name)
        if st is None:
            st = self._side_streams[name] = self.gpu.new_stream()
        return st

    def fork(self, ts, name: str = "side"):
        """(torch stream, cuda.core stream) of stream ``name``, ordered after everything
        queued on ``ts`` so far."""
        return self.gpu.fork(ts, self.side_stream(name))

    def join(self, ts, side_ts) -> None:
        self.gpu.join(ts, side_ts)

    @property
    def captured(self) -> bool:
        """Was a collective of this plane captured in a CUDA graph? (The host's seq and ring
        index are stale from then on: replays advance the device's only.)"""
        return self._graph

    @property
    def ring_next(self) -> int:
        """The host's copy of the next collective's first publish-ring index."""
        return self._ring_next

    # ---- regions -------------------------------------------------------------------
    def attach_rs(self, send: torch.Tensor, send_stride: int, recv: torch.Tensor,
                  recv_stride: int) -> None:
        s, n = send.data_ptr(), send.numel()
        r, m = recv.data_ptr(), recv.numel()
        if r == s + n:  # one segment: register once
            base = self._register(s, n + m)
            send_dev, recv_dev = base, base + n
        else:
            send_dev = self._register(s, n)
            recv_dev = self._register(r, m)
        self.rs_send_dev, self.rs_recv_dev = send_dev, recv_dev
        self.rs_send = self.gpu.view(send_dev, n)
        self.rs_recv = self.gpu.view(recv_dev, m)
        self.rs_send_stride, self.rs_recv_stride = send_stride, recv_stride
        self.send_code = REGION_SLOTS[Region.RS_SEND] << SLOT_SHIFT | send_stride
        self.recv_code = REGION_SLOTS[Region.RS_RECV] << SLOT_SHIFT | recv_stride
        self.plans.invalidate()

    def close(self, *, abort_if_busy: bool = True) -> None:
        """Wait for this data plane's kernels, then unpin the regions (call before the
        segments are unmapped). Kernels still running are first told to stop through the
        abort word (``abort_if_busy``), so closing never waits for a whole timeout."""
        self._closed = True
        monitor = getattr(self, "monitor", None)
        if monitor is not None:
            monitor.stop()
        try:
            self._release(abort_if_busy)
        finally:
            for st in getattr(self, "_side_streams", {}).values():
                self.gpu.close_stream(st)

    def _release(self, abort_if_busy: bool) -> None:
        regs = getattr(self, "_registered", None)
        if not regs:
            return
        try:
            if abort_if_busy and self.monitor.busy():
                # A deliberate close stops the kernels without the fail-stop trap (which
                # would lose the process's CUDA context): what they would have produced is
                # undefined once the communicator is closed. The peers still fail-stop.
                _u64(self.ctl + CTL_GPU_MODE).value = FAIL_MODES["poison"]
                self.nat.set_abort(self.ctl, layout.ABORT_USER,
                                   f"rank {self.rank}: communicator closed while collectives "
                                   "were still running on the GPU")
            self.monitor.wait_last()
        except Exception:
            pass
        self._registered = []
        if self.monitor.stuck:
            # Unpinning memory a kernel or copy may still write would be worse than the leak:
            # it stays pinned until the process exits (which it must: the GPU is stuck).
            return
        for addr in regs:
            try:
                self.gpu.unregister(addr)
            except Exception:
                pass
        try:
            self.engines.close()
        except Exception:
            pass
        self.plans.invalidate()  # (they record the event freed here)
        self.gpu.close()

    # ---- GPU-direct: peers' regions mapped here -----------------------------------------
    def map_peers(self, ctl: dict[int, tuple[int, int]], ag: dict[int, tuple[int, int]]) -> None:
        """Pin the peers' control segments (flag words at ``layout.FLAGS_OFFSET``) and AG
        regions, given as ``{peer: (host address, bytes)}`` of their mappings in this
        process, and execute this rank's all-gather publish streams on the GPU from now on
        (the proxy must have been given :func:`gpu_streams` with ``set_gpu_streams``)."""
        self.direct.map("ctl", ctl)
        self.direct.map("ag", ag)
        self._build_direct(Op.AG)

    def enable_ll(self, through_proxy: bool = False) -> None:
        """One-shot all-reduces of ``L`` bytes, ``L * (world - 1) <= layout.LL_MAX_BYTES``,
        go the LL way from now on
        (kernels/allreduce.cu allreduce_ll: lines that carry their own flags, read by each
        rank in its LL area). GPU-direct: written straight into every rank's LL area, after
        :meth:`map_peers` with every peer's control segment. ``through_proxy``: written into
        this rank's own LL block, and the proxy posts them (ring entries of chunk
        ``CHUNK_LL``; a mesh: the proxy refuses them where a stream relays or the data plane
        sends). Every rank calls it or none, the same way (a rank waiting for lines a peer
        never writes would time out), so the wiring agrees on it at creation
        (``SPARKCCL_ALLREDUCE_LL``)."""
        off = layout.ll_area(self.plan.num_flag_words)[0]
        addrs = [self.ctl_dev + off if r == self.rank
                 else 0 if through_proxy else self.direct.peers[(r, "ctl")][0] + off
                 for r in range(self.world)]
        self.ll_table = self.gpu.to_device(torch.tensor(addrs, dtype=torch.int64))
        self.ll_proxy = through_proxy
        self.plans.invalidate()

    def map_peers_rs(self, rs: dict[int, tuple[int, int]], send_bytes: int) -> None:
        """The same for the peers' reduce-scatter segments (send slots, then from
        ``send_bytes`` on the receive slots); after :meth:`map_peers` and :meth:`attach_rs`."""
        self.direct.map_rs(rs, send_bytes)
        self._build_direct(Op.RS)

    def _build_direct(self, op: Op) -> None:
        """The stream table of sccl_*_direct for op, once its regions are known."""
        if op == Op.RS and self.rs_send is None:  # attach_rs() not called yet
            return
        stride = self.ag_stride if op == Op.AG else self.rs_recv_stride
        if self.direct.build(op, stride):
            self.plans.invalidate()

    def direct_table(self, op: Op, S: int):
        """The direct table for a collective of slice S, or None (then the proxy sends)."""
        return self.direct.table(op, S)

    def scratch(self, name: str, nbytes: int) -> torch.Tensor:
        """A device buffer of at least ``nbytes`` kept per data plane under ``name`` and
        reused by every call: each use is written and read on the collectives' one stream,
        or on streams that stream joins before the call ends (the "ce" sums), so a later
        call's writes come after the earlier reads. Outgrown buffers are kept
        until synchronize(), for kernels and copies still queued. Names: "finalize own"
        (this rank's own rows of a finalize, read by the wait kernel that follows) and
        "ce stage" (mode "ce": the reduce-scatter's received chunks)."""
        buf = self._scratch_bufs.get(name)
        if buf is None or buf.numel() < nbytes:
            if buf is not None:
                self._retired.append(buf)
                self.plans.invalidate()  # plans hold the address of the buffer replaced
            buf = self._scratch_bufs[name] = torch.empty(max(nbytes, 16), dtype=torch.uint8,
                                                         device=self.device)
        if self._in_capture and not any(b is buf for b in self._graph_bufs):
            # A captured graph keeps using this address at every replay: never freed.
            self._graph_bufs.append(buf)
        return buf

    # ---- capture ----------------------------------------------------------------------
    def seq_on_host(self) -> bool:
        """Does the host know the next collective's seq (and so its slots)? False while the
        caller's stream is being captured into a CUDA graph and ever after one collective
        was: replays advance the device state only (docs/CONTRACT.md "CUDA graphs")."""
        return not self._graph and not self.gpu.capturing()

    def refuse_capture(self, what: str) -> None:
        if self.gpu.capturing():
            raise RuntimeError(f"rank {self.rank}: {what}: the communicator's first "
                               "reduce-scatter sets up its buffers and cannot be captured in a "
                               "CUDA graph: run one reduce-scatter (or finalize) before capturing "
                               "(docs/CONTRACT.md \"CUDA graphs\")")

    def begin(self, op: Op, seq: int, S: int, call: int, entries: int = PIECES,
               zero_copy: str | None = None, what: str | None = None) -> int:
        """Checks before a collective's first launch; returns the host's copy of its first
        ring index (valid while seq_on_host(); only mode "ce" uses it). call: its ring
        entries' call word. zero_copy names a feature that needs the slot of seq on the
        host: refused once the host no longer knows it. what: the collective's name in
        messages (default: the op's; the one-shot all-reduce is an AG on the wire)."""
        what = what or OP_NAMES[op]
        if self._closed:
            raise ValueError("this CUDA data plane is closed")
        self._in_capture = self.gpu.capturing()
        if self._in_capture and not self._graph:
            self._graph = True
            self.plans.invalidate()  # (planned under the host's seq; a launch plan key is a shape)
            self._ops.clear()
            if self.peer_check is not None:
                self.peer_check.forget()
        if zero_copy and self._graph:
            raise RuntimeError(f"rank {self.rank}: {what}: {zero_copy} needs the "
                               "collective's slot on the host, which it no longer knows once a "
                               "collective of this communicator was captured in a CUDA graph "
                               "(docs/CONTRACT.md \"CUDA graphs\")")
        if not self._graph and seq != self._seq_next:
            raise ValueError(f"rank {self.rank}: {what} seq {seq}: the CUDA data plane "
                             f"expected seq {self._seq_next} (the GPU numbers collectives one "
                             "per call, in call order)")
        self._check_call()
        self.plans.called(call)
        return self._count(op, seq, S, entries, call, what)

    def _count(self, op: Op, seq: int, S: int, entries: int, call: int, what: str) -> int:
        """The host's account of a collective about to be issued (its first ring index)."""
        first = self._ring_next
        if not self._graph:
            ops = self._ops
            ops[seq] = what
            ops.pop(seq - 512, None)
            if seq > self._last_seq:
                self._last_seq = seq
            if self.peer_check is not None:
                self.peer_check.note(op, seq, S, call)
        self._seq_next += 1
        self._ring_next += entries
        return first

    # ---- the eager fast path (launch_plan.py) ----------------------------------------
    def _planned(self, key, op: Op, seq: int, S: int, *args, what: str | None = None) -> bool:
        """Issue the collective from its plan, if there is one (a launch plan, or mode "ce"'s
        program: ce_engine.CePlan): the checks of :meth:`begin`, one native call, the
        host's account. False (nothing done): no plan,
        or the stream is being captured (the planning path then handles the capture), or
        something the planning path reports. ``key`` is the collective's shape: whatever else
        its planning reads drops every plan when it changes (a setting, see launch_plan.PlanSetting;
        the tables, the buffers, the first capture: plans.invalidate())."""
        found = self.plans.plans.get(key)
        if found is None or self._closed or (not self._graph and seq != self._seq_next):
            return False
        plan, entries, direct, call = found
        self._check_call()
        if not (self.engines.ce.issue_plan(plan, seq, args) if type(plan) is CePlan
                else self._issue_plan(plan, args)):
            return False
        self.plans.stats["hits"] += 1
        self.direct_launches += direct
        self._in_capture = False
        self._count(op, seq, S, entries, call, what or OP_NAMES[op])
        return True

    def finish(self, ts, stream, entries: int = PIECES, gate_add: int = 0,
                advanced: bool = False) -> None:
        """After the collective's last kernel: unless it advanced the device state itself
        (``advanced``), sccl_advance moves it on to the next collective (seq + 1, ring +
        entries, the finalize gate + gate_add)."""
        if not advanced:
            self.launch(stream, "sccl_advance", 1, 32, self.state.data_ptr(), _n(entries),
                         _n(gate_add))
        if not self._in_capture:  # (an event of a capture cannot be waited for)
            self.end(ts)

    def check_sizes(self, final: bool = False) -> None:
        """Every rank must make the same call: compare recent collectives with the sources'
        call entries once those arrive (the GPU cannot do it before it waits, so a
        difference is reported at a later call or at synchronize(); peer_check.py).
        ``final`` (synchronize: every collective issued has completed): wait for the
        entries still on their way, up to the timeout."""
        if self.peer_check is not None:
            self.peer_check.run(self.timeout_s if final else 0.0,
                                lambda: self.nat.abort_code(self.ctl) != 0)

    # ---- collectives -----------------------------------------------------------------
    typed_io = True  # the collectives take tensors of any dtype and count bytes themselves
    zero_copy_results = True  # all_gather(..., dst=None): the result stays in the pinned slot
    maps_peers = True  # GPU-direct: map_peers / map_peers_rs

    def all_gather(self, seq: int, src: torch.Tensor, dst: torch.Tensor | None, dst_off: int,
                   dst_stride: int, dtype: torch.dtype | None = None,
                   part: tuple[int, int] | None = None) -> None:
        """Gather ``src`` (CUDA, contiguous, L bytes) of every rank: rank i's bytes land at
        byte ``i * dst_stride + dst_off`` of ``dst``. ``dst=None``: zero-copy, the result
        stays in AG slot ``seq % 3`` (rank i at ``i * round_up(L, 16)``, see
        :meth:`ag_slot`); the launch then only waits for the pieces. The kernels take the
        slot from the device state's seq (slot base + code, kernels/common.cuh slot_at).
        Later calls of the same shape run from its launch plan."""
        L = src.nbytes
        dtype = dtype or src.dtype
        key = None
        if dst is not None:
            key = (Op.AG, L, dst_stride, dtype, part)
            src_p, dst_p = src.data_ptr(), dst.data_ptr() + dst_off
            if self._planned(key, Op.AG, seq, round_up(L, ALIGN), src_p, dst_p):
                return
        with self.plans.planning(key, self.gpu.make_plan):
            cuda_calls.all_gather(self, seq, src, dst, dst_off, dst_stride, L, dtype, part)

    def ag_slot(self, seq: int, nbytes: int) -> torch.Tensor:
        """CUDA uint8 view of the first ``nbytes`` of AG slot ``seq % 3`` (zero-copy result;
        valid while the next two collectives of any kind are issued: docs/CONTRACT.md)."""
        if self._graph:
            raise RuntimeError(f"rank {self.rank}: ag_slot: the host no longer knows the slots "
                               "once a collective was captured in a CUDA graph")
        base = (seq % 3) * self.ag_stride
        return self.ag[base:base + nbytes]

    def reduce_scatter(self, seq: int, src: torch.Tensor | None, src_off: int, src_stride: int,
                       L: int, dst: torch.Tensor, dst_off: int, dtype: torch.dtype,
                       part: tuple[int, int] | None = None) -> None:
        """Reduce-scatter chunks of L bytes: chunk j of ``src`` (CUDA, contiguous) starts at
        its byte ``j * src_stride + src_off``; this rank's sum lands at byte ``dst_off`` of
        ``dst``. ``src=None``: the chunks are already in the send slot (zero-copy input) at
        ``j * L``, L a multiple of 16. Later calls of the same shape run from its launch
        plan."""
        key = (Op.RS, L, src_stride, dtype, src is None, part)
        src_p = 0 if src is None else src.data_ptr() + src_off
        dst_p = dst.data_ptr() + dst_off
        if self._planned(key, Op.RS, seq, round_up(L, ALIGN), src_p, dst_p):
            return  # (a key with a plan passed the checks below when it was planned)
        if dtype not in RS_WAIT:
            raise TypeError(f"reduce_scatter: dtype {dtype} is not supported")
        if self.rs_send is None:
            raise RuntimeError("reduce_scatter: attach_rs() was not called")
        S = round_up(L, ALIGN)
        if src is None and S != L:
            raise ValueError("reduce_scatter: a zero-copy input needs chunks of a multiple of 16 "
                             "bytes")
        with self.plans.planning(key, self.gpu.make_plan):
            cuda_calls.reduce_scatter(self, seq, src, src_p, src_stride, L, dst_p, dtype, part)

    has_all_to_all = True

    def all_to_all(self, seq: int, src: torch.Tensor, src_off: int, src_stride: int, L: int,
                   dst: torch.Tensor, dst_off: int, dst_stride: int,
                   dtype: torch.dtype, sized: bool = False) -> None:
        """(DataPlaneBase.all_to_all) The reduce-scatter's wire and engines, each source's
        chunk copied out where the reduce-scatter sums (:func:`.cuda_calls.all_to_all`);
        any dtype (the bytes are never read as numbers). Later calls of the same shape run
        from its launch plan. ``sized``: the kernels and the proxy cut each chunk at the
        length its first 8 bytes say (the copy engines of mode "ce" do not)."""
        key = ("all_to_all", L, src_stride, dst_stride, dtype, sized)
        src_p, dst_p = src.data_ptr() + src_off, dst.data_ptr() + dst_off
        if self._planned(key, Op.RS, seq, round_up(L, ALIGN), src_p, dst_p, what="all_to_all"):
            return
        if self.rs_send is None:
            raise RuntimeError("all_to_all: attach_rs() was not called")
        with self.plans.planning(key, self.gpu.make_plan):
            cuda_calls.all_to_all(self, seq, src, src_p, src_stride, L, dst_p, dst_stride, dtype,
                                  sized)

    # ---- one-shot all-reduce (allreduce_engine.py) -------------------------------------
    one_shot_all_reduce = True

    def all_reduce_one_shot(self, seq: int, src: torch.Tensor, dst: torch.Tensor,
                            avg: bool, pad: int = 0) -> None:
        """One launch: an all-gather of ``src`` on the wire, summed into ``dst`` in rank
        order (:mod:`.allreduce_engine`). Later calls of the shape run from its plan."""
        L, dtype = src.nbytes, src.dtype
        a0, b0 = src.data_ptr(), dst.data_ptr()
        in_place = a0 < b0 + dst.nbytes and b0 < a0 + L
        if in_place and a0 != b0 and self.ll_for(L):
            # (the LL kernel reads and writes each unit in one thread: dst may be src, not a
            # shifted view of it)
            src = src.clone()
            a0, in_place = src.data_ptr(), False
        key = ("all_reduce_one_shot", L, dtype, avg, in_place, pad)
        if self._planned(key, Op.AG, seq, round_up(L, ALIGN), a0, b0, what="all_reduce"):
            return
        if dtype not in RS_WAIT:
            raise TypeError(f"all_reduce: dtype {dtype} is not supported")
        with self.plans.planning(key, self.gpu.make_plan):
            cuda_calls.all_reduce_one_shot(self, seq, a0, b0, L, dtype, avg, pad, in_place)

    def ll_for(self, L: int) -> bool:
        """(DataPlaneBase.ll_for) While what a reader polls each round, ``L * (world - 1)``,
        is at most ``LL_MAX_BYTES`` (8 KiB: the crossover measured against the flag words,
        protocol.h). The same answer on every rank: :meth:`enable_ll` was called on all or
        none."""
        return self.ll_table is not None and L * (self.world - 1) <= layout.LL_MAX_BYTES

    # ---- two-step all-reduce as one operation (allreduce_engine.py TwoStepEngine) --------
    # One kernel, GPU-direct or the proxy path (each rank's choice, which peers cannot tell).
    fused_all_reduce, fused_input_in_slot = True, False

    def all_reduce(self, seq: int, src, src_off: int, src_stride: int, L: int, dst,
                   dst_off: int, dst_stride: int, dtype: torch.dtype, avg: bool, pad: int = 0):
        """One launch (DataPlaneBase.all_reduce); later calls of the shape run from its plan."""
        key = ("all_reduce", L, src_stride, dst_stride, dtype, avg, src is None, pad)
        src_p = None if src is None else src.data_ptr() + src_off
        dst_p = dst.data_ptr() + dst_off
        if self._planned(key, Op.RS, seq, L, src_p or 0, dst_p, what="all_reduce"):
            return
        with self.plans.planning(key, self.gpu.make_plan):
            cuda_calls.all_reduce_fused(self, seq, src_p, src_stride, L, dst_p, dst_stride,
                                        dtype, avg, pad)

    # ---- MoE finalize + reduce-scatter -----------------------------------------------
    def moe_finalize_reduce_scatter(self, seq: int, f, row_lo: int, rows: int,
                                    dst: torch.Tensor, dst_off: int) -> None:
        """The CUDA twin of :meth:`.cpu.CpuDataPlane.moe_finalize_reduce_scatter`:
        ``sccl_finalize`` computes the rows piece-major into the send slot (own chunk into
        device memory) and publishes each (row piece, destination) as it completes, in
        (W - 1) * 8 ring entries; the bf16 reduce-scatter wait kernel then sums this rank's
        rows over ranks in rank order into ``dst``."""
        if self.rs_send is None:
            raise RuntimeError("moe_finalize_reduce_scatter: attach_rs() was not called")
        S, _ = fin_slice(rows, 2 * f.H)
        key = ("finalize", f.num_tokens, f.topk, f.H, f.R, f.fp8, f.rows_per_rank, row_lo, rows,
               f.scales is None)
        args = (f.y.data_ptr(), 0 if f.scales is None else f.scales.data_ptr(),
                f.pos.data_ptr(), f.weights.data_ptr(), f.shared.data_ptr(),
                dst.data_ptr() + dst_off)
        self._fin_used = True
        if self._planned(key, Op.RS, seq, S, *args):
            return
        with self.plans.planning(key, self.gpu.make_plan):
            cuda_calls.finalize(self, seq, f, row_lo, rows, tuple(CallPtr(a, i) if a else 0
                                                                  for i, a in enumerate(args)))

    def check_finalize_inputs(self) -> None:
        """Raise ``ValueError`` if a finalize kernel met a bad ``pos`` (after the kernels
        finished: reads device memory; :func:`.cuda_calls.check_finalize_inputs`)."""
        if self._fin_used:
            cuda_calls.check_finalize_inputs(self)

    # ---- completion and failure ------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every collective launched so far, then raise :class:`CollectiveError`
        if one of them failed (timeout or abort), or ``ValueError`` if a finalize met a bad
        ``pos`` value. After a fail-stop (a device trap: the CUDA context is lost) the CUDA
        error is raised as the :class:`CollectiveError` that caused it."""
        try:
            self.monitor.wait_last()
        except CollectiveError:
            raise  # the GPU did not stop after the failure (monitor.wait_last)
        except RuntimeError as cuda_error:
            # A lost context after a known failure: this rank's trap, or under MPS another
            # process's, which ends every client's context (then the abort word may be all
            # the host knows). Without a known failure the CUDA error is all there is.
            if not self.monitor.failure_known():
                raise
            try:
                self.check_status()
                self.check_abort()
            except CollectiveError as failure:
                raise failure from cuda_error
            raise
        self._retired.clear()
        self.check_failures()
        self.check_finalize_inputs()

    def check_failures(self) -> None:
        """Raise what the host sees without waiting for the GPU: a GPU failure record, the
        abort word, a peer's different size (before every collective and after a
        synchronization)."""
        self.check_status()
        self.check_abort()
        self.check_sizes(final=True)
        self.check_abort()  # (a failure that ended the wait for the sources' entries)

    def _check_call(self) -> None:
        """check_failures before a collective: the GPU record and the abort word read in
        place (check_status and check_abort raise when one is set), the sizes every
        SIZE_CHECK_CALLS-th collective."""
        words = self._ctl_words
        if words[_GPU_STATUS_WORD] or words[_ABORT_WORD]:
            self.check_status()
            self.check_abort()
        if not self._seq_next % SIZE_CHECK_CALLS:
            self.check_sizes()

    def check_status(self) -> None:
        """Raise if a kernel recorded a failure (no synchronization: reads the record)."""
        if self._ctl_words[_GPU_STATUS_WORD]:
            self.monitor.raise_record()

    def name_of(self, seq: int) -> str | None:
        """The name of recent collective ``seq`` (for messages), if the host knows it."""
        return self._ops.get(seq)

    # ---- fail-stop and poison (docs/CONTRACT.md "Failure behaviour") ----------------------
    def poison_call(self, out: torch.Tensor) -> None:
        if self.on_failure == "poison" and out.numel():
            self.poison_if_failed(self.gpu.current_stream()[1], out.data_ptr(), 0, 1,
                                   out.numel() * out.element_size())

    def poison_if_failed(self, stream, dst: int, stride: int, count: int, nbytes: int) -> None:
        """Mode "poison": queue ``sccl_poison`` after the collective, which overwrites its
        output with 0xFF bytes (NaN in every floating type) if any wait of this data plane
        failed. Mode "stop" needs nothing: a failed wait traps, and the context is lost."""
        if self.on_failure != "poison" or not nbytes:
            return
        grid = max(1, min(self.sms, -(-count * nbytes // (POISON_THREADS * 64))))
        self.launch(stream, "sccl_poison", grid, POISON_THREADS, self.state.data_ptr(), dst,
                     _n(stride), _n(count), _n(nbytes))
