"""The device seam of the CUDA data plane: every operation it and its engines ask of the
GPU, one method each, in the manner of c10d's ``Backend`` (one method per operation;
what comes back is a stream or an event to wait on).

:class:`Device` declares the operations; :class:`CudaDevice` is the implementation over
the CUDA driver (cuda-python, cuda.core, torch's streams and the native launch plans and
stream programs). The other implementation is the host emulation in
``tests/test_cuda_dataplane.py`` (``EmuDevice``: the kernels compiled as host C++, streams
as worker threads), which runs the plane's logic and the kernels' on a CPU. The plane
(:class:`~.cuda.CudaDataPlane`) takes one as ``device_ops`` and touches the GPU only
through it.

Handles: a *launch stream* is what :meth:`Device.launch_kernel` takes (cuda.core's stream;
the emulation's stream object); a *torch stream* is what the plane orders work by
(``wait_stream``, events). :meth:`Device.current_stream` gives both for the caller's
stream. A stream *term* is the integer a stream program names a stream by.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import config
from . import nvrtc
from .cuda_runtime import (check, check_available, device_view,
                           host_device_pointer, kernels_for, register_host, set_current,
                           unregister_host)
from .trap_lock import gpu_key, lock_path

_U64 = (1 << 64) - 1


class Device:
    """The operations (see the module docstring). Attributes: ``device`` (the torch device
    of tensors the plane makes), ``sms`` (streaming multiprocessors: grid caps),
    ``trap_lock_path`` (the GPU's fail-stop trap lock, or None: no GPU shared)."""

    device: torch.device
    sms: int
    trap_lock_path: str | None = None

    # ---- memory ----------------------------------------------------------------------
    def register(self, addr: int, size: int) -> int:
        """Pin host memory for the device; its device address. Raises
        :class:`~.cuda_runtime.AlreadyRegistered` for a range this process pinned already."""
        raise NotImplementedError

    def host_pointer(self, addr: int) -> int:
        """The device address of host memory this process pinned already (:meth:`register`
        raised :class:`~.cuda_runtime.AlreadyRegistered` for it)."""
        raise NotImplementedError

    def unregister(self, addr: int) -> None:
        raise NotImplementedError

    def view(self, ptr: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over ``nbytes`` at device address ``ptr``."""
        raise NotImplementedError

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for all work of the device."""
        raise NotImplementedError

    # ---- streams ---------------------------------------------------------------------
    def current_stream(self) -> tuple:
        """(torch stream, launch stream) of the caller's current stream."""
        raise NotImplementedError

    def caller_stream(self):
        """(stream term, torch stream) of the caller's current stream for a planned call,
        or None while it is being captured (the planning path handles that)."""
        raise NotImplementedError

    def probe_stream(self) -> tuple:
        """(torch stream, launch stream) of a new stream (the clock probe's)."""
        raise NotImplementedError

    def new_stream(self):
        """A new torch stream (the side streams, the ce sums')."""
        raise NotImplementedError

    def close_stream(self, st) -> None:
        """A stream of :meth:`new_stream` is no longer used."""

    def fork(self, ts, st) -> tuple:
        """Order stream ``st`` after everything queued on ``ts`` so far: (st, its launch
        stream)."""
        raise NotImplementedError

    def join(self, ts, side) -> None:
        """Order ``ts`` after everything queued on ``side`` so far."""
        raise NotImplementedError

    def stream_term(self, st) -> int:
        raise NotImplementedError

    def capturing(self) -> bool:
        """Is the caller's stream being captured into a CUDA graph?"""
        raise NotImplementedError

    # ---- launches ----------------------------------------------------------------------
    def launch_kernel(self, stream, name: str, grid: int, block: int, *args) -> None:
        raise NotImplementedError

    def launch_struct(self, stream, name: str, grid: int, block: int, words,
                      early: bool = False) -> None:
        """Launch a kernel whose one parameter is a struct of u64 fields (``words``, in
        field order: e.g. protocol.h ``ProxyArgs``, ``AllReduceArgs``). A launch plan's parameter words are
        contiguous, so a recorded struct launch replays unchanged. ``early``: the kernel
        may start before the one before it on the stream ended (programmatic dependent
        launch; the kernel waits for it first: common.cuh wait_previous_grid). Default:
        the words as the arguments (the emulation takes every launch's parameters as
        words, and runs launches one after another)."""
        self.launch_kernel(stream, name, grid, block, *words)

    def make_plan(self, rec):
        """The launch plan of a recording (:class:`~.launch_plan.Recording`)."""
        raise NotImplementedError

    def issue_plan(self, plan, args: tuple):
        """Issue a launch plan on the caller's stream with the call's pointers: (event
        after it, torch stream), or None, issuing nothing, while the stream is captured."""
        raise NotImplementedError

    def new_program(self, kernels: list, patches: list, rows: list):
        """A stream program (native OpProgram); kernels: (name, threads per block,
        parameters)."""
        raise NotImplementedError

    def run_program(self, program, terms: list, ts):
        """Issue a program with the call's terms; the event its last row records."""
        raise NotImplementedError

    def done_handle(self) -> int:
        """The event a program records last (as a launch plan does)."""
        raise NotImplementedError

    def can_write_values(self) -> bool:
        """Can streams write and wait for 64-bit values (mode "ce")?"""
        raise NotImplementedError

    # ---- events ------------------------------------------------------------------------
    def mark(self, ts):
        """An event recorded now on torch stream ``ts``."""
        raise NotImplementedError

    def event_done(self, ev) -> bool:
        """Has the device passed event ``ev``? (Raises the error of a lost context.)"""
        raise NotImplementedError

    def new_events(self, n: int) -> list[int]:
        raise NotImplementedError

    def destroy_events(self, events: list[int]) -> None:
        raise NotImplementedError

    # ---- failure -----------------------------------------------------------------------
    def release_waits(self, state: torch.Tensor, dead: int, progress: int) -> None:
        """Write ``dead`` to state word 1, then ``progress`` to word 0, from the host, on a
        stream of its own (the caller's are the stuck ones)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the device holds (its done event)."""


class _RawEvent:
    """The device's own CUDA event, recorded by launch plans and programs; queried like
    torch's."""

    __slots__ = ("nat", "handle")

    def __init__(self, nat, handle: int):
        self.nat, self.handle = nat, handle

    def query(self) -> bool:
        return self.nat.cuda_event_query(self.handle)

    def destroy(self) -> None:
        from cuda.bindings import driver as drv
        drv.cuEventDestroy(drv.CUevent(self.handle))


class CudaDevice(Device):
    """The CUDA driver implementation (cuda-python is imported when one is made)."""

    def __init__(self, nat, device=None):
        check_available(device)
        dev = (torch.device("cuda", torch.cuda.current_device()) if device is None
               else torch.device(device))
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.nat = nat
        self.device = dev
        self._index = dev.index
        self.kernels = kernels_for(dev.index)
        props = torch.cuda.get_device_properties(dev)
        self.sms = int(props.multi_processor_count)
        # Programmatic dependent launch (launch_struct's early) needs sm_90 or later; the
        # setting turns it off everywhere.
        self.early_launch = (props.major >= 9 and bool(config.get("SPARKCCL_LAUNCH_EARLY")))
        # release_waits: made now, because after a failure nothing may wait on the GPU.
        self._release_src = torch.empty(2, dtype=torch.int64, pin_memory=True)
        self._release_stream = torch.cuda.Stream(dev)
        # Launch plans run in torch's primary context of the device, and record one event
        # of this device (re-recorded by every planned call: the latest is the one the
        # plane's waits and watchdog ask about).
        from cuda.bindings import driver as drv
        with torch.cuda.device(dev):
            torch.cuda.current_stream(dev).synchronize()  # (torch made its context current)
            self._context = int(check("cuCtxGetCurrent", drv.cuCtxGetCurrent())[0])
            flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
            self._done_event = _RawEvent(nat, int(check("cuEventCreate",
                                                        drv.cuEventCreate(flags))[0]))
        self._fast_stream = (None, None)  # (raw handle, torch stream) of the latest planned call
        self._cc_streams: dict[int, object] = {}  # cuda.core stream per torch stream handle
        self._functions: dict[str, int] = {}  # CUfunction per kernel name
        self._write_values = None  # can streams write 64-bit values? asked once
        self.trap_lock_path = lock_path(gpu_key(dev))

    # ---- memory ----------------------------------------------------------------------
    def register(self, addr: int, size: int) -> int:
        with torch.cuda.device(self.device):
            return register_host(addr, size)

    def host_pointer(self, addr: int) -> int:
        with torch.cuda.device(self.device):
            return host_device_pointer(addr)

    def unregister(self, addr: int) -> None:
        with torch.cuda.device(self.device):
            unregister_host(addr)

    def view(self, ptr: int, nbytes: int) -> torch.Tensor:
        return device_view(ptr, nbytes, self.device)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    # ---- streams ---------------------------------------------------------------------
    def current_stream(self):
        set_current(self.device.index)
        ts = torch.cuda.current_stream(self.device)
        return ts, self._cc_stream(ts)

    def caller_stream(self):
        h = torch._C._cuda_getCurrentRawStream(self._index)
        if self.nat.cuda_stream_capturing(self._context, h):
            return None
        return h, self._torch_stream(h)

    def _torch_stream(self, h: int):
        """The torch stream of raw handle ``h``, the caller's current one (kept for the next
        call: asking torch for it costs microseconds)."""
        if self._fast_stream[0] != h:
            self._fast_stream = (h, torch.cuda.current_stream(self.device))
        return self._fast_stream[1]

    def probe_stream(self):
        ts = torch.cuda.Stream(self.device)
        return ts, self._cc_stream(ts)

    def _cc_stream(self, ts):
        h = int(ts.cuda_stream)
        s = self._cc_streams.get(h)
        if s is None:
            cc = nvrtc.import_cuda_core()
            s = self._cc_streams[h] = cc.Stream.from_handle(h)
        return s

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def fork(self, ts, st):
        st.wait_stream(ts)
        return st, self._cc_stream(st)

    def join(self, ts, side) -> None:
        ts.wait_stream(side)

    def stream_term(self, st) -> int:
        return st.cuda_stream if st is not None else 0

    def capturing(self) -> bool:
        # (torch asks the current device's stream: make it this one)
        with torch.cuda.device(self.device):
            return torch.cuda.is_current_stream_capturing()

    # ---- launches ----------------------------------------------------------------------
    def launch_kernel(self, stream, name: str, grid: int, block: int, *args) -> None:
        cc = nvrtc.import_cuda_core()
        cfg = cc.LaunchConfig(grid=grid, block=block)
        with torch.cuda.device(self.device):  # this device's primary context is current
            cc.launch(stream, cfg, self.kernels[name], *args)

    def launch_struct(self, stream, name: str, grid: int, block: int, words,
                      early: bool = False) -> None:
        # cuda.core takes scalars and pointers only: the driver call, with kernelParams[0]
        # pointing at the struct's bytes (the words, contiguous).
        from cuda.bindings import driver as drv
        buf = np.asarray([int(w) & _U64 for w in words], dtype=np.uint64)
        params = np.array([buf.ctypes.data], dtype=np.uint64)
        with torch.cuda.device(self.device):
            fn = drv.CUfunction(self._function(name))
            if not (early and self.early_launch):
                check("cuLaunchKernel", drv.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0,
                                                           stream.handle, params.ctypes.data, 0))
                return
            cfg = drv.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block, 1, 1
            cfg.sharedMemBytes, cfg.hStream = 0, stream.handle
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg.attrs, cfg.numAttrs = [attr], 1
            check("cuLaunchKernelEx", drv.cuLaunchKernelEx(cfg, fn, params.ctypes.data, 0))

    def make_plan(self, rec):
        with torch.cuda.device(self.device):
            rows = [(self._function(name), grid, block, list(params), by_value)
                    for name, grid, block, params, by_value in rec.rows]
        return self.nat.LaunchPlan(self._context, self._done_event.handle, rows,
                                   list(rec.patches))

    def issue_plan(self, plan, args: tuple):
        h = torch._C._cuda_getCurrentRawStream(self._index)
        if not plan.issue(h, *args):
            return None
        return self._done_event, self._torch_stream(h)

    def new_program(self, kernels: list, patches: list, rows: list):
        from .ce_engine import N_TERMS
        with torch.cuda.device(self.device):  # (the function handles are per context)
            table = [(self._function(name), block, ps) for name, block, ps in kernels]
        return self.nat.OpProgram(self._context, N_TERMS, table, patches, rows)

    def run_program(self, program, terms: list, ts):
        program.issue(terms)
        return self._done_event

    def done_handle(self) -> int:
        return self._done_event.handle

    def _function(self, name: str) -> int:
        """CUfunction handle of kernel ``name`` in this device's context."""
        f = self._functions.get(name)
        if f is None:
            from cuda.bindings import driver as drv
            h = self.kernels[name].handle
            if isinstance(h, drv.CUkernel):
                h = check("cuKernelGetFunction", drv.cuKernelGetFunction(h))[0]
            f = self._functions[name] = int(h)
        return f

    def can_write_values(self) -> bool:
        if self._write_values is None:
            try:
                from cuda.bindings import driver as drv
                attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
                err, v = drv.cuDeviceGetAttribute(attr, self.device.index)
                self._write_values = int(err) == 0 and bool(v)
            except Exception:
                self._write_values = False
        return self._write_values

    # ---- events ------------------------------------------------------------------------
    def mark(self, ts):
        ev = torch.cuda.Event()
        ev.record(ts)
        return ev

    def event_done(self, ev) -> bool:
        return ev.query()

    def new_events(self, n: int) -> list[int]:
        from cuda.bindings import driver as drv
        flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        with torch.cuda.device(self.device):
            return [int(check("cuEventCreate", drv.cuEventCreate(flags))[0]) for _ in range(n)]

    def destroy_events(self, events: list[int]) -> None:
        from cuda.bindings import driver as drv
        for e in events:
            drv.cuEventDestroy(drv.CUevent(e))

    # ---- failure -----------------------------------------------------------------------
    def release_waits(self, state: torch.Tensor, dead: int, progress: int) -> None:
        src = self._release_src
        src[0] = progress
        src[1] = dead
        with torch.cuda.device(self.device), torch.cuda.stream(self._release_stream):
            state[1:2].copy_(src[1:2], non_blocking=True)  # dead first: in stream order
            state[0:1].copy_(src[0:1], non_blocking=True)

    def close(self) -> None:
        ev, self._done_event = self._done_event, None
        if ev is not None:
            ev.destroy()
