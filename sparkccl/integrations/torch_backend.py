"""The torch.distributed backend ``"sparkccl"`` (docs/TORCH.md).

::

    import sparkccl.integrations.torch_backend          # registers "sparkccl"
    dist.init_process_group("sparkccl")                  # or dist.new_group(backend="sparkccl")
    dist.all_gather_single(out, x)      # -> sparkccl (before torch 2.13: all_gather_into_tensor)
    dist.reduce_scatter_single(out, y)  # -> sparkccl, SUM / AVG (before 2.13: reduce_scatter_tensor)
    dist.all_reduce(z)                  # -> sparkccl, SUM / AVG, any size
    dist.all_to_all_single(out, x)      # -> sparkccl, equal blocks (no split sizes given)
    dist.broadcast(z, 0)                                 # -> the fallback group (gloo / NCCL)

The group is a Python ``ProcessGroup``: c10d uses it as it is, so it holds its own fallback
group (gloo for CPU tensors, NCCL for CUDA tensors where torch has it) built on the store
c10d hands the creator, and routes every call itself. A call goes to sparkccl only when
:func:`decline_reason` says so; that rule looks only at shapes, dtypes, the group and
settings, so every rank makes the same choice (one rank in sparkccl while another waits in
NCCL would hang both).

Reductions (all-reduce, reduce-scatter; SUM / AVG in bf16 / fp16 / fp32) stay in sparkccl
at every size, so their sums are the rank-order fp32 sums everywhere (gloo's and NCCL's
are not). ``SPARKCCL_TORCH_MIN_BYTES`` sends small all-gathers and all-to-alls (exact on
either path) to the fallback; small reductions follow it only on the opt-in
``SPARKCCL_TORCH_INEXACT_SMALL=1``, which gives up exactness for them.

The Communicator of a device type is created on the first call routed to sparkccl for that
device type. Creation is collective; it happens at the same call on every rank because the
routing rule is the same on every rank.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions,
                                        ReduceScatterOptions)

from .. import config
from ..allreduce import divide
from ..errors import CollectiveError

BACKEND_NAME = "sparkccl"
REDUCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_BYTES_VARIABLE = "SPARKCCL_TORCH_MIN_BYTES"
INEXACT_SMALL_VARIABLE = "SPARKCCL_TORCH_INEXACT_SMALL"
DEFAULT_TIMEOUT = timedelta(minutes=30)

_PG = dist.ProcessGroup
# torch 2.13 renamed the single-tensor collectives; the fallback is called by the names its
# torch knows (our group answers to both generations, see the class body).
_AG_SINGLE = "all_gather_single" if hasattr(_PG, "all_gather_single") else "_allgather_base"
_RS_SINGLE = ("reduce_scatter_single" if hasattr(_PG, "reduce_scatter_single")
              else "_reduce_scatter_base")
_A2A_SINGLE = "all_to_all_single" if hasattr(_PG, "all_to_all_single") else "alltoall_base"

# Calls that always go to the fallback group, by every name some torch version uses.
FALLBACK_METHODS = (
    "allgather", "allgather_coalesced", "allreduce_coalesced", "alltoall", "barrier",
    "broadcast", "gather", "monitored_barrier", "recv", "recv_anysource", "reduce",
    "reduce_scatter", "scatter", "send",
)


@dataclass(frozen=True)
class Options:
    """What ``pg_options=`` of ``init_process_group`` / ``new_group`` can set for this backend.

    ``topology``, ``transport``, ``slot_bytes``, ``timeout_s`` go to the
    :class:`sparkccl.Communicator`; ``min_bytes`` overrides ``SPARKCCL_TORCH_MIN_BYTES``,
    ``inexact_small`` ``SPARKCCL_TORCH_INEXACT_SMALL``.
    """
    topology: str = "mesh"
    transport: str = "auto"
    slot_bytes: int | str | None = None
    timeout_s: float | None = None
    min_bytes: int | str | None = None
    inexact_small: bool | None = None


def _parse_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"sparkccl backend: {name} must be a bool, got {type(value).__name__}")
    return value


def _is_sum(op) -> bool:
    return op == dist.ReduceOp.SUM


def _is_avg(op) -> bool:
    return op == dist.ReduceOp.AVG


def _op_name(op) -> str:
    kind = getattr(op, "op", op)  # a ReduceOp wraps a RedOpType
    return getattr(kind, "name", str(kind))


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph. Checked for every call, CPU
    tensors included (all ranks capture together); a process that never started CUDA is
    not capturing, and asking would start CUDA."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def decline_reason(kind: str, inp: torch.Tensor, out: torch.Tensor, *, world: int,
                   min_bytes: int, op=None, inexact_small: bool = False,
                   split_sizes: tuple = ()) -> str | None:
    """Why a call goes to the fallback group, or None when sparkccl takes it.

    ``kind`` is ``"all_gather"`` (``out`` is the gathered tensor), ``"reduce_scatter"``
    (``inp`` is the full tensor), ``"all_reduce"`` (``inp is out``) or ``"all_to_all"``
    (``all_to_all_single``; ``split_sizes``: its output and input split lists). The answer
    depends only on shapes, dtypes, layout, device type, the group's size, the reduce op and
    the settings (and on CUDA graph capture, which every rank enters together), never on
    anything one rank could see differently. ``min_bytes`` applies to all-gathers and
    all-to-alls, and to reductions only with ``inexact_small`` (the fallback's sums are not
    rank-order exact).

    An all-to-all with split lists goes to the fallback even when every list is equal:
    the lists are per-rank data, and one rank's can be equal while another's are not in
    the same valid call (world 2: rank 0 [2, 2] / [2, 2], rank 1 [2, 5] / [2, 5]); the two
    ranks would then wait in different groups. Without lists every rank's blocks are
    dim0 / world rows, the same bytes on every rank.
    """
    if world < 2:
        # The Communicator needs two ranks or more.
        return "world size 1"
    dev = inp.device
    if dev.type not in ("cpu", "cuda") or out.device != dev:
        return f"device {dev.type}"
    if capturing():
        return "CUDA graph capture"
    if inp.layout != torch.strided or out.layout != torch.strided:
        return "layout"
    if inp.is_quantized or out.is_quantized:
        return "quantized dtype"
    if not (inp.is_contiguous() and out.is_contiguous()):
        return "non-contiguous"
    if inp.dtype != out.dtype:
        return "mixed dtypes"
    if kind == "all_gather":
        if out.numel() != world * inp.numel():
            return "uneven sizes"
        full = out
    elif kind == "all_to_all":
        if any(len(s) for s in split_sizes):
            return "split sizes given"
        if inp.dim() == 0 or out.dim() == 0:
            return "0-dim tensor"
        if inp.shape[0] % world or out.shape[0] % world or inp.numel() != out.numel():
            return "uneven sizes"
        full = inp
    else:
        if inp.dtype not in REDUCE_DTYPES:
            return f"dtype {inp.dtype}"
        if not (_is_sum(op) or _is_avg(op)):
            return f"reduce op {_op_name(op)}"
        if kind == "reduce_scatter" and inp.numel() != world * out.numel():
            return "uneven sizes"
        full = inp
    if ((kind in ("all_gather", "all_to_all") or inexact_small)
            and full.numel() * full.element_size() < min_bytes):
        return f"below {MIN_BYTES_VARIABLE}"
    return None


class _Work(dist.Work):
    """A finished (CPU) or enqueued (CUDA) sparkccl call, or a set of fallback calls.

    ``wait()`` raises the call's ``CollectiveError``; on CUDA it makes the caller's current
    stream wait for the stream the call was enqueued on, as NCCL's Work does.
    """

    def __init__(self, outputs: list, *, error: BaseException | None = None,
                 pending: list | None = None):
        super().__init__()
        self._outputs = outputs
        self._error = error
        self._pending = [w for w in (pending or []) if w is not None]
        self._event = None
        self._device = dev = next((t.device for t in outputs if t.device.type == "cuda"), None)
        if dev is not None and error is None:
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(dev))
            self._future = torch.futures.Future(devices=[dev])
        else:
            self._future = torch.futures.Future()
        # A failed call's future is never completed with the exception: C++ callers (DDP's
        # Reducer) rethrow a future's error without the GIL, and a Python exception there
        # crashed the process. wait() and get_future() raise it instead, under the GIL.
        if error is None and not self._pending:
            self._future.set_result(outputs)

    def wait(self, timeout=None) -> bool:
        for w in self._pending:
            w.wait()
        if self._error is not None:
            raise self._error
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        if not self._future.done():
            self._future.set_result(self._outputs)
        return True

    def is_completed(self) -> bool:
        return ((self._event is None or self._event.query())
                and all(w.is_completed() for w in self._pending))

    def is_success(self) -> bool:
        return self._error is None and all(w.is_success() for w in self._pending)

    def exception(self):
        return self._error

    def get_future(self):
        if self._error is not None or (self._pending and not self._future.done()):
            self.wait()
        return self._future


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _write_into(output: torch.Tensor, input: torch.Tensor, call) -> None:
    """``call(out)`` with ``out`` = ``output`` flattened, or a temporary copied into it when
    ``input`` overlaps ``output`` (FSDP's in-place all-gather passes a slice of the output)."""
    dst = output.view(-1)
    tmp = torch.empty_like(dst) if _shares_memory(input, output) else dst
    call(tmp)
    if tmp is not dst:
        dst.copy_(tmp)


class SparkcclProcessGroup(dist.ProcessGroup):
    """A ProcessGroup that sends all-gather, reduce-scatter, all-reduce (SUM / AVG) and
    all-to-all of equal blocks through sparkccl and everything else through its own
    fallback group.

    ``routed`` counts the calls sparkccl ran (by collective), ``declined`` the calls sent
    to the fallback instead (by reason).
    """

    def __init__(self, store, rank: int, world_size: int, timeout: timedelta = DEFAULT_TIMEOUT,
                 options: Options | None = None, global_ranks: list[int] | None = None):
        super().__init__(rank, world_size)
        if options is not None and not isinstance(options, Options):
            raise TypeError("pg_options for the sparkccl backend must be "
                            "sparkccl.integrations.torch_backend.Options, got "
                            f"{type(options).__name__}")
        self.options = options or Options()
        self._rank = rank
        self._world = world_size
        self._store = store
        self.min_bytes = int(self._agreed(store, "min_bytes", MIN_BYTES_VARIABLE,
                                          self.options.min_bytes, config.parse_bytes))
        self.inexact_small = self._agreed(store, "inexact_small", INEXACT_SMALL_VARIABLE,
                                          self.options.inexact_small, _parse_bool) == "True"
        self._comms: dict = {}
        self._lock = threading.Lock()
        self.routed: Counter = Counter()
        self.declined: Counter = Counter()
        self._fallback = self._build_fallback(store, rank, world_size, timeout, global_ranks)

    def _agreed(self, store, name: str, variable: str, given, parse) -> str:
        """A routing setting (``given``, else ``variable``) as text, checked to be the same
        on every rank: the routing rule reads it, and ranks that disagree would route the
        same call differently and hang. A rank whose setting does not parse still posts
        (its error), so every rank raises at once."""
        try:
            mine = str(config.get(variable) if given is None else parse(given, name))
            failed = False
        except (ValueError, TypeError) as e:
            mine, failed = f"{type(e).__name__}: {e}", True
        store.set(f"sparkccl-settings/{name}/{self._rank}", mine)
        values = [store.get(f"sparkccl-settings/{name}/{r}").decode() for r in range(self._world)]
        if len(set(values)) > 1 or failed:
            raise ValueError(f"sparkccl backend: the ranks must agree on {name} / {variable}: "
                             + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
        return mine

    def _build_fallback(self, store, rank, world_size, timeout, global_ranks) -> dist.ProcessGroup:
        fb = dist.ProcessGroup(dist.PrefixStore("fallback/", store), rank, world_size)
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size, timeout)
        cpu, cuda = torch.device("cpu"), torch.device("cuda")
        backends = [(cpu, _PG.BackendType.GLOO, gloo)]
        if torch.cuda.is_available() and dist.is_nccl_available():
            # NCCL connects on its first collective, so an unused one costs nothing.
            o = dist.ProcessGroupNCCL.Options()
            o._timeout = timeout
            _split_like_c10d(o, global_ranks)
            nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, world_size, o)
            backends.append((cuda, _PG.BackendType.NCCL, nccl))
        else:
            backends.append((cuda, _PG.BackendType.GLOO, gloo))
        for group in (fb, self):
            # Registered on this group too, so that c10d's device queries (object
            # collectives pick "cpu") and any call not overridden here reach them.
            for device, kind, backend in backends:
                group._register_backend(device, kind, backend)
            group._set_default_backend(_PG.BackendType.GLOO)
        self._fallback_backends = backends
        return fb

    # ---- identity -------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return (f"SparkcclProcessGroup(rank={self._rank}, world_size={self._world}, "
                f"topology={self.options.topology!r}, min_bytes={self.min_bytes}, "
                f"inexact_small={self.inexact_small})")

    # ---- the communicators ----------------------------------------------------------
    def communicator(self, device: torch.device | str = "cpu"):
        """The group's :class:`sparkccl.Communicator` for ``device``'s type, created on first
        use. Creation is collective: every rank must ask for it at the same point."""
        device = torch.device(device)
        with self._lock:
            comm = self._comms.get(device.type)
            if comm is None:
                from ..comm import Communicator
                o = self.options
                comm = Communicator(store=dist.PrefixStore(f"sparkccl/{device.type}/", self._store),
                                    rank=self._rank, world_size=self._world,
                                    device=device, topology=o.topology, transport=o.transport,
                                    slot_bytes=o.slot_bytes, timeout_s=o.timeout_s)
                self._comms[device.type] = comm
        if device.type == "cuda" and device.index is not None and device != comm.device:
            raise ValueError(f"sparkccl backend, rank {self._rank}: a tensor on {device}, but "
                             f"this group's CUDA communicator works on {comm.device}; keep one "
                             "GPU per rank (torch.cuda.set_device before the first collective)")
        return comm

    def decline_reason(self, kind: str, inp: torch.Tensor, out: torch.Tensor, op=None,
                       split_sizes: tuple = ()):
        return decline_reason(kind, inp, out, world=self._world, min_bytes=self.min_bytes, op=op,
                              inexact_small=self.inexact_small, split_sizes=split_sizes)

    def _route(self, kind, inp, out, op=None, split_sizes: tuple = ()) -> bool:
        reason = self.decline_reason(kind, inp, out, op, split_sizes)
        if reason is None:
            self.routed[kind] += 1
            return True
        self.declined[reason] += 1
        return False

    def _run(self, outputs: list, fn) -> _Work:
        # Bad input raises here; a failed collective is delivered by wait(), which c10d
        # calls at once for a synchronous call, so both reach the caller of dist.*.
        try:
            fn()
        except CollectiveError as e:
            return _Work(outputs, error=e)
        return _Work(outputs)

    # ---- all-gather -----------------------------------------------------------------
    def _all_gather_into(self, output, input, opts=None):
        if not self._route("all_gather", input, output):
            return getattr(self._fallback, _AG_SINGLE)(output, input, opts or AllgatherOptions())
        comm = self.communicator(input.device)

        def run():
            _write_into(output, input, lambda out: comm.all_gather(input.reshape(-1), out=out))
        return self._run([output], run)

    # torch <= 2.12 calls the first name of each pair, 2.13+ the second.
    _allgather_base = all_gather_single = _all_gather_into

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self._all_gather_into(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return _Work(list(outputs), pending=works)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # ---- reduce-scatter -------------------------------------------------------------
    def _reduce_scatter_into(self, output, input, opts=None):
        opts = opts or ReduceScatterOptions()
        op = opts.reduceOp
        if not self._route("reduce_scatter", input, output, op):
            return self._fallback_reduce(_RS_SINGLE, (output, input), output, opts)
        comm = self.communicator(input.device)
        W = self._world

        def run():
            if _is_avg(op):
                # The exact fp32 sum in rank order, divided once (16-bit inputs travel as fp32).
                s = comm.reduce_scatter(input.reshape(-1).float())
                output.view(-1).copy_(divide(s, W))
            else:
                _write_into(output, input,
                            lambda out: comm.reduce_scatter(input.reshape(-1), out=out))
        return self._run([output], run)

    _reduce_scatter_base = reduce_scatter_single = _reduce_scatter_into

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self._reduce_scatter_into(o, i, opts)
                 for o, i in zip(outputs, inputs, strict=True)]
        return _Work(list(outputs), pending=works)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---- all-reduce -----------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        if isinstance(opts, dist.ReduceOp) or opts is None:
            o = AllreduceOptions()
            o.reduceOp = dist.ReduceOp.SUM if opts is None else opts
            opts = o
        op = opts.reduceOp
        if len(tensors) != 1 or not self._route("all_reduce", tensors[0], tensors[0], op):
            return self._fallback_reduce("allreduce", (tensors,), tensors, opts)
        t = tensors[0]
        comm = self.communicator(t.device)
        return self._run([t], lambda: comm.all_reduce(t, "avg" if _is_avg(op) else "sum", out=t))

    def _fallback_reduce(self, method: str, args: tuple, outputs, opts):
        """The fallback's reduce; AVG on gloo (which has no AVG) as SUM, then one division."""
        first = outputs[0] if isinstance(outputs, list) else outputs
        if (_is_avg(opts.reduceOp) and first.is_floating_point()
                and self._backend_kind(first.device) == _PG.BackendType.GLOO):
            o = type(opts)()
            o.reduceOp = dist.ReduceOp.SUM
            o.timeout = opts.timeout
            getattr(self._fallback, method)(*args, o).wait()
            for t in (outputs if isinstance(outputs, list) else [outputs]):
                t.div_(self._world)
            return _Work(outputs if isinstance(outputs, list) else [outputs])
        return getattr(self._fallback, method)(*args, opts)

    def _backend_kind(self, device: torch.device):
        for dev, kind, _ in self._fallback_backends:
            if dev.type == device.type:
                return kind
        return None

    # ---- all-to-all -----------------------------------------------------------------
    def _all_to_all_into(self, output, input, output_split_sizes, input_split_sizes,
                         opts=None):
        if not self._route("all_to_all", input, output,
                           split_sizes=(output_split_sizes, input_split_sizes)):
            return getattr(self._fallback, _A2A_SINGLE)(
                output, input, output_split_sizes, input_split_sizes,
                AllToAllOptions() if opts is None else opts)
        comm = self.communicator(input.device)

        def run():
            # Contiguous, dim0 % world == 0 on both sides and the same numel: block j of
            # the flat input is its j-th byte chunk, block i of the output likewise.
            _write_into(output, input, lambda out: comm.all_to_all(input.reshape(-1), out=out))
        return self._run([output], run)

    # torch's older name first, then the one c10d's all_to_all_single calls from 2.13.
    alltoall_base = all_to_all_single = _all_to_all_into

    # ---- lifetime -------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close the communicators (waits, bounded, for every rank to close) and the fallback."""
        self._close_comms()
        self._fallback.shutdown()

    def abort(self) -> None:
        self._close_comms()
        self._fallback.abort()

    def _close_comms(self) -> None:
        with self._lock:
            comms, self._comms = list(self._comms.values()), {}
        for c in comms:
            c.close()


def _fallback_method(name: str):
    def method(self, *args, **kwargs):
        return getattr(self._fallback, name)(*args, **kwargs)
    method.__name__ = name
    method.__doc__ = f"``{name}`` through the fallback group (gloo / NCCL)."
    return method


for _name in FALLBACK_METHODS:
    if hasattr(_PG, _name):
        setattr(SparkcclProcessGroup, _name, _fallback_method(_name))


def _split_like_c10d(nccl_options, global_ranks) -> None:
    """When the default group has a bound device, c10d makes the ranks *outside* a new group
    take part in an NCCL split of the default group's communicator; the ranks inside must
    then build their NCCL from the same split, or the split never completes. Mirrors what
    c10d does for its own NCCL groups."""
    from torch.distributed import distributed_c10d as c10d
    source = getattr(c10d, "_get_split_source", None)
    color = getattr(c10d, "_process_group_color", None)
    if not global_ranks or source is None or color is None or not dist.is_initialized():
        return
    default = c10d._get_default_group()
    split_from = source(default) if default.bound_device_id else None
    if split_from is not None:
        nccl_options.split_from = split_from
        nccl_options.split_color = color(global_ranks)


def _create(backend_opts, pg_options=None) -> SparkcclProcessGroup:
    """The creator c10d calls (``extended_api=True``)."""
    return SparkcclProcessGroup(backend_opts.store, backend_opts.group_rank,
                                backend_opts.group_size, backend_opts.timeout, pg_options,
                                list(backend_opts.global_ranks_in_group))


def register() -> None:
    """Register the backend name ``"sparkccl"`` with torch.distributed (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    # devices as a list: some torch versions iterate a string character by character.
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                  devices=["cpu", "cuda"])


register()
