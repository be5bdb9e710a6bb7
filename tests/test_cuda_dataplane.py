"""The GPU data plane (sparkccl/dataplane/cuda.py + kernels/), in process: every rank of a
world lives in this process with its own control block, regions, native Proxy (shm
transport) and CudaDataPlane, each rank launching on its own stream. Results are checked
bit for bit against the numpy references in sparkccl.reference.

Every test runs on two backends:

* ``cuda``: the real kernels on a GPU (marked ``cuda``; skipped with the reason shown when
  ``torch.cuda.is_available()`` is false);
* ``emu``: the same kernels (kernels/kernels.cu and its includes) compiled as host C++ (tests/cuda_emu/: one thread per
  block, all blocks concurrent) and driven by the same CudaDataPlane code with the device
  operations replaced by CPU ones, so that the kernels' logic and the host plumbing are
  checked on machines without a GPU (needs g++).

The end-to-end tests through the Communicator (several processes sharing a GPU) are at the
bottom (``cuda`` only).
"""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import mmap
import os
import queue
import re
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from sparkccl import layout as L
from sparkccl.errors import CollectiveError, ConfigError
from sparkccl.plan import geometry as G
from sparkccl import config
from sparkccl.plan import waits as PW
from sparkccl.plan.build import build_plan
from sparkccl.plan.model import REGION_SLOTS, Op, Region, num_flag_words
from sparkccl.reference import all_gather_reference, make_input, reduce_scatter_reference

import sparkccl._native as N  # noqa: E402 - the native layer is not optional: no skip
from sparkccl.dataplane import cuda as C  # noqa: E402
from sparkccl.dataplane import cuda_runtime, nvrtc  # noqa: E402
from sparkccl.dataplane import ce_engine as E  # noqa: E402
from sparkccl.dataplane import engines as EN  # noqa: E402
from sparkccl.dataplane import monitor as M  # noqa: E402
from sparkccl.dataplane.device import Device  # noqa: E402

SLOTS = [REGION_SLOTS[Region.AG], REGION_SLOTS[Region.RS_SEND], REGION_SLOTS[Region.RS_RECV]]
PID = os.getpid()
HAVE_GPU = torch.cuda.is_available()
EMU_DIR = Path(__file__).parent / "cuda_emu"
CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
EMU_TRAP_LOCK = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"sparkccl-emu-trap-{PID}.lock")
atexit.register(lambda: os.path.exists(EMU_TRAP_LOCK) and os.unlink(EMU_TRAP_LOCK))

cuda_only = [pytest.mark.cuda,
             pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() "
                                                     "is False")]
BACKENDS = [pytest.param("cuda", marks=cuda_only),
            pytest.param("emu", marks=pytest.mark.skipif(CXX is None, reason="needs g++ to "
                                                         "build the CPU emulation of the kernels"))]


# ---------------------------------------------------------------- the CPU emulation backend

_emu_libs: dict = {}
_emu_lock = threading.Lock()
# Extra -D flags of the emulation streams started from now on (a test that reaches a
# kernel's rare branch with a smaller constant sets them, e.g. -DSIZED_CHUNKS=2).
EMU_DEFINES: tuple[str, ...] = ()


def emu_lib():
    """tests/cuda_emu/emu.cpp + kernels.cu built as a shared library (once per session and
    EMU_DEFINES)."""
    defines = tuple(EMU_DEFINES)
    with _emu_lock:
        if defines not in _emu_libs:
            kernels = Path(nvrtc.KERNELS_CU).resolve()
            srcs = [*nvrtc.source_files(), EMU_DIR / "emu.cpp", EMU_DIR / "sccl_emu.h"]
            h = hashlib.sha256(b"".join(p.read_bytes() for p in srcs)
                               + " ".join(defines).encode()).hexdigest()[:16]
            out = Path(os.environ.get("TMPDIR", "/tmp")) / f"sparkccl-emu-{os.getuid()}-{h}.so"
            if not out.exists():
                tmp = out.with_suffix(f".{os.getpid()}.tmp")
                cmd = [CXX, "-std=c++17", "-O1", "-g", "-fPIC", "-shared", "-pthread",
                       "-Wno-unknown-pragmas", "-DSCCL_TIMELINE", *defines, f"-I{EMU_DIR}",
                       *(f"-I{d}" for d in nvrtc.INCLUDE_DIRS), f'-DKERNELS_CU="{kernels}"',
                       str(EMU_DIR / "emu.cpp"), "-o", str(tmp)]
                r = subprocess.run(cmd, capture_output=True, text=True)
                assert r.returncode == 0, f"building the kernel emulation failed:\n{r.stderr}"
                os.replace(tmp, out)
            lib = ctypes.CDLL(str(out))
            lib.sccl_emu_run.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.POINTER(ctypes.c_uint64)]
            lib.sccl_emu_run.restype = ctypes.c_int
            _emu_libs[defines] = lib
        return _emu_libs[defines]


class EmuContext:
    """What the streams of one emulated process share: once a kernel trapped, nothing more
    runs on any of them and every synchronization raises (as a lost CUDA context)."""

    def __init__(self):
        self.trapped: str | None = None
        self.trapped_at = 0.0

    def check(self):
        if self.trapped:
            raise RuntimeError(f"CUDA error: unspecified launch failure (emulated device trap "
                               f"in {self.trapped})")


class EmuStream:
    """A stream: launches run in order on a worker thread (ctypes drops the GIL)."""

    def __init__(self, ctx: EmuContext | None = None):
        self.ctx = ctx or EmuContext()
        self.q: queue.Queue = queue.Queue()
        self.errors: list[str] = []
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        lib = emu_lib()
        while True:
            item = self.q.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            if self.ctx.trapped:  # a lost context runs nothing
                continue
            if callable(item):  # a stream operation other than a launch
                item()
                continue
            name, grid, args = item
            rc = lib.sccl_emu_run(name.encode(), grid, args)
            if rc == 1:
                self.ctx.trapped, self.ctx.trapped_at = name, time.monotonic()
            elif rc != 0:
                self.errors.append(f"unknown kernel {name}")

    def submit(self, name, grid, args):
        arr = (ctypes.c_uint64 * len(args))(*[int(a) for a in args])
        self.q.put((name, grid, arr))

    def record(self) -> threading.Event:
        ev = EmuEvent(self.ctx)
        self.q.put(ev)
        return ev

    def put(self, fn):
        self.q.put(fn)

    def wait_event(self, ev: threading.Event, timeout=120.0):
        self.q.put(lambda: ev.wait(timeout) or self.errors.append("cross-stream wait timed out"))

    def synchronize(self, timeout=120.0):
        assert self.record().wait(timeout), "emulated stream did not drain"
        self.ctx.check()
        assert not self.errors, self.errors

    def close(self):
        self.q.put(None)
        self.t.join(10)


_emu_current = threading.local()


def emu_wait_value(addr: int, value: int, timeout: float = 120.0) -> bool:
    """cuStreamWaitValue64 (GEQ) on the CPU: spin until (int64)(*addr - value) >= 0."""
    word = ctypes.c_uint64.from_address(addr)
    deadline = time.monotonic() + timeout
    while ((word.value - value) & (1 << 63)) and time.monotonic() < deadline:
        time.sleep(20e-6)
    return not (word.value - value) & (1 << 63)


EMU_DONE_EVENT = 1 << 40  # the done event's handle (no event _new_events gives)
EMU_COPY_BATCH = 1  # OpProgram.calls: a cuMemcpyBatchAsync


@dataclass
class EmuProgram:
    native: object  # the native OpProgram (evaluated, not issued: no CUDA here)
    names: list     # its kernel table's names


class EmuEvent(threading.Event):
    """An event of an emulated stream; it knows the stream's context (a lost context raises
    when asked, as a CUDA event query does)."""

    def __init__(self, ctx: EmuContext):
        super().__init__()
        self.ctx = ctx


class EmuDevice(Device):
    """The device seam (sparkccl/dataplane/device.py) on the CPU: 'device pointers' are host
    addresses, launches go to the emulated kernels, streams are EmuStreams."""

    device = torch.device("cpu")
    sms = 4
    trap_lock_path = EMU_TRAP_LOCK  # every emulated rank of this process "shares one GPU"

    def __init__(self):
        self.streams: dict[int, EmuStream] = {}  # stream term -> stream
        self.events: dict[int, EmuEvent] = {}    # program event handle -> its latest record
        self.next_event = 1
        self.emu_skip: set = set()  # kernel names a program's launches drop (tests)
        self.emu_launched: list[str] = []  # kernels launched by programs
        self.emu_programs_run = self.emu_ops_run = 0
        self.probe = None

    def register(self, addr, size):
        return addr

    def host_pointer(self, addr):
        return addr

    def unregister(self, addr):
        pass

    def view(self, ptr, nbytes):
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)

    def to_device(self, t):
        return t.clone()

    def synchronize(self):
        pass

    def current_stream(self):
        s = _emu_current.stream
        return s, s

    def capturing(self):
        return getattr(_emu_current, "capture", None) is not None

    def launch_kernel(self, stream, name, grid, block, *args):
        capture = getattr(_emu_current, "capture", None)
        if capture is not None:  # an emulated graph capture: recorded, not run
            capture.append((stream, name, grid, [int(a) for a in args]))
            return
        stream.submit(name, grid, args)

    def make_plan(self, rec):
        return rec  # replayed launch by launch (issue_plan)

    def caller_stream(self):
        if self.capturing():
            return None
        ts = _emu_current.stream
        return self.stream_term(ts), ts

    def issue_plan(self, rec, args):
        if self.capturing():
            return None
        ts = _emu_current.stream
        for name, grid, block, params in rec.launches_for(args):
            self.launch_kernel(ts, name, grid, block, *params)
        return ts.record(), ts

    def mark(self, ts):
        return ts.record()

    def event_done(self, ev):
        ev.ctx.check()  # (a lost context raises, as the query of a CUDA event does)
        return ev.is_set()

    def release_waits(self, state, dead, progress):  # the state words are host memory here
        state[1] = dead
        state[0] = progress

    def probe_stream(self):
        st = self.probe = EmuStream()
        return st, st

    def new_stream(self):
        return EmuStream(_emu_current.stream.ctx)

    def close_stream(self, st):
        st.close()

    def fork(self, ts, st):
        st.wait_event(ts.record())
        return st, st

    def join(self, ts, side):
        ts.wait_event(side.record())

    def stream_term(self, st):
        if st is None:
            return 0
        self.streams[id(st)] = st
        return id(st)

    def new_events(self, n):
        first = self.next_event
        self.next_event = first + n
        return list(range(first, first + n))

    def destroy_events(self, events):
        pass

    def done_handle(self):
        return EMU_DONE_EVENT

    def new_program(self, kernels, patches, rows):
        table = [(k + 1, block, ps) for k, (_, block, ps) in enumerate(kernels)]
        return EmuProgram(N.OpProgram(1, E.N_TERMS, table, patches, rows),
                          [name for name, _, _ in kernels])

    def run_program(self, program, terms, ts):
        """The program's operations as the native OpProgram evaluates them, run on the
        emulated streams (launches whose kernel is in ``self.emu_skip`` are dropped). The
        copies of one batched driver call (OpProgram.calls) run last to first: the GPU
        gives them no order among themselves, and no program may need one."""
        ops = program.native.evaluate(terms)
        params = program.native.parameters(terms)
        order, done = [], None
        for first, count, how in program.native.calls(terms):
            run = range(first, first + count)
            order.extend(reversed(run) if how == EMU_COPY_BATCH else run)
        for k in (5 * i for i in order):
            kind, st, a, b, c = ops[k:k + 5]
            stream = self.streams[st]
            if kind == E.OP_COPY:
                stream.put(lambda d=a, s=b, n=c: ctypes.memmove(d, s, n))
            elif kind == E.OP_WRITE64:  # an aligned 8-byte store after the stream's copies
                stream.put(lambda p=a, v=b: setattr(ctypes.c_uint64.from_address(p), "value", v))
            elif kind == E.OP_RECORD:
                if a == EMU_DONE_EVENT:
                    done = stream.record()
                else:
                    self.events[a] = stream.record()
            elif kind == E.OP_WAIT_EVENT:
                stream.wait_event(self.events[a])
            elif kind == E.OP_WAIT_VALUE:  # until the 64-bit word at a reaches b
                stream.put(lambda p=a, v=b, s=stream: emu_wait_value(p, v)
                           or s.errors.append(f"value wait for {v} at {p:#x} timed out"))
            else:
                assert kind == E.OP_LAUNCH, kind
                if program.names[a] not in self.emu_skip:
                    self.emu_launched.append(program.names[a])
                    stream.submit(program.names[a], c, [b, *params[a][1:]])
        self.emu_programs_run += 1
        self.emu_ops_run += len(ops) // 5
        return done

    def can_write_values(self):
        return True


def emu_data_plane(**kw) -> C.CudaDataPlane:
    """The CUDA data plane over the emulated device."""
    return C.CudaDataPlane(N, device_ops=EmuDevice(), **kw)


class Backend:
    def __init__(self, name: str, world: int):
        self.name = name
        if name == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.streams = [torch.cuda.Stream(self.device) for _ in range(world)]
        else:
            self.device = torch.device("cpu")
            self.streams = [EmuStream() for _ in range(world)]

    def make_dp(self, **kw):
        if self.name == "cuda":
            return C.CudaDataPlane(N, device=self.device, **kw)
        return emu_data_plane(**kw)

    @contextmanager
    def on(self, r: int):
        if self.name == "cuda":
            with torch.cuda.stream(self.streams[r]):
                yield
        else:
            _emu_current.stream = self.streams[r]
            try:
                yield
            finally:
                _emu_current.stream = None

    def to_dev(self, t):
        return t.to(self.device) if self.name == "cuda" else t.clone()

    def sync(self):
        for s in self.streams:
            s.synchronize()

    def close(self):
        if self.name == "emu":
            for s in self.streams:
                s.close()


# ---------------------------------------------------------------- in-process world

class Buf:
    def __init__(self, nbytes: int):
        self.mm = mmap.mmap(-1, max(nbytes, 1))
        self.a = np.frombuffer(self.mm, dtype=np.uint8)
        self.addr = self.a.ctypes.data
        self.t = torch.frombuffer(self.mm, dtype=torch.uint8)


class World:
    """W ranks: control block, AG region, RS region (send then recv), Proxy, data plane.
    ``direct``: GPU-direct (the data planes write the peers' regions and flags themselves
    and the proxies keep only the relays, as a CUDA + shm Communicator does); ``ll``: the
    one-shot all-reduce's LL way (CudaDataPlane.enable_ll), GPU-direct with ``direct``,
    else through the proxies (a mesh). ``on_failure``:
    "poison" by default, since a
    fail-stop trap would lose the CUDA context of this (the test) process; "stop" with mode
    "ce", which mode poison runs as "fused" (engine_choice.Engines.choose)."""

    def __init__(self, backend: str, topology: str, world: int, roots: int = 2,
                 max_slice: int = 1 << 16, timeout_s: float = 30.0, direct: bool = False,
                 mode: str | None = None, on_failure: str | None = None, hold: tuple = (),
                 ll: bool = False):
        if on_failure is None:
            on_failure = "stop" if mode == "ce" else "poison"
        self.world = world
        self.be = Backend(backend, world)
        self.plans = [build_plan(topology, world, r, roots) for r in range(world)]
        nfw = num_flag_words(world)
        self.ctl = [Buf(L.control_bytes(nfw)) for _ in range(world)]
        for c in self.ctl:
            N.init_control(c.addr, PID)
        self.max_slice = max_slice
        self.ag_stride = L.slot_stride(world * max_slice)
        self.send_stride = L.slot_stride(world * max_slice)
        self.recv_stride = L.slot_stride(self.plans[0].rs_recv_blocks * max_slice)
        self.send_bytes = SLOTS[1] * self.send_stride
        self.ag = [Buf(SLOTS[0] * self.ag_stride) for _ in range(world)]
        self.rs = [Buf(self.send_bytes + SLOTS[2] * self.recv_stride) for _ in range(world)]
        self.proxies, self.dps = [], []
        self._keep = []
        try:
            for r, plan in enumerate(self.plans):
                t = plan.to_tables()
                p = N.Proxy(r, world, self.ctl[r].addr, self.ctl[r].addr + L.FLAGS_OFFSET,
                            t["connections"], t["streams"], t["items"], SLOTS, 2000, 50)
                p.attach(N.ShmTransport())
                self._regions(p.set_region, r)
                for q in range(world):
                    if q != r:
                        p.set_peer(q, self.ctl[q].addr, self.ctl[q].addr + L.FLAGS_OFFSET, PID)
                        self._regions(lambda g, a, s, q=q, p=p: p.set_peer_region(q, g, a), q)
                self.proxies.append(p)
            for r, plan in enumerate(self.plans):
                dp = self.be.make_dp(plan=plan, ctl_addr=self.ctl[r].addr,
                                     flags_addr=self.ctl[r].addr + L.FLAGS_OFFSET,
                                     ag=self.ag[r].t, ag_stride=self.ag_stride,
                                     timeout_s=timeout_s, on_failure=on_failure)
                rs = self.rs[r].t
                dp.attach_rs(rs[:self.send_bytes], self.send_stride, rs[self.send_bytes:],
                             self.recv_stride)
                if mode is not None:
                    dp.direct_mode = mode
                # Several ranks share one GPU here: keep every rank's spinning wait kernel
                # small enough to fit beside the others' kernels.
                if backend == "cuda":
                    dp.max_wait_blocks = max(1, dp.sms // (2 * world))
                else:
                    dp.max_wait_blocks, dp.max_publish_blocks = 2, 16
                self.dps.append(dp)
            if direct:
                nfb = L.control_bytes(nfw)
                for r, (p, dp) in enumerate(zip(self.proxies, self.dps)):
                    p.set_gpu_streams(self.plans[r].publish_streams())
                    peers = [q for q in range(world) if q != r]
                    dp.map_peers(ctl={q: (self.ctl[q].addr, nfb) for q in peers},
                                 ag={q: (self.ag[q].addr, len(self.ag[q].mm)) for q in peers})
                    dp.map_peers_rs({q: (self.rs[q].addr, len(self.rs[q].mm)) for q in peers},
                                    self.send_bytes)
                    if ll:  # (the wiring's choice where every peer is mapped: a mesh)
                        dp.enable_ll()
            elif ll:  # (the wiring's choice on the proxy path of a mesh)
                for dp in self.dps:
                    dp.enable_ll(through_proxy=True)
        except BaseException:
            self.close()
            raise
        for r, p in enumerate(self.proxies):
            if r not in hold:  # (held: the test starts it later)
                p.start()
        self.seq = 0

    def _regions(self, set_region, r):
        set_region(int(Region.AG), self.ag[r].addr, self.ag_stride)
        set_region(int(Region.RS_SEND), self.rs[r].addr, self.send_stride)
        set_region(int(Region.RS_RECV), self.rs[r].addr + self.send_bytes, self.recv_stride)

    def close(self):
        for dp in self.dps:
            try:
                dp.close()
            except Exception:
                pass
        for p in self.proxies:
            p.stop()
        self.be.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def keep(self, t):
        """Tensors the queued kernels use stay alive until the next sync (and are made on
        the rank's stream, so the caching allocator does not hand them out early)."""
        self._keep.append(t)
        return t

    def sync(self):
        self.be.sync()
        for dp in self.dps:
            dp.synchronize()
        self._keep.clear()

    def healthy(self):
        for r in range(self.world):
            assert N.abort_code(self.ctl[r].addr) == 0, N.error_text(self.ctl[r].addr)

    # ---- collectives (inputs: CPU tensors, one per rank) -----------------------------
    def all_gather(self, xs, *, out_offset: int = 0, zero_copy: bool = False):
        W = self.world
        n = xs[0].numel() * xs[0].element_size()
        assert n <= self.max_slice
        seq = self.seq
        self.seq += 1
        outs = []
        for r in range(W):
            with self.be.on(r):
                src = self.keep(self.be.to_dev(xs[r]).reshape(-1).view(torch.uint8))
                if zero_copy:
                    self.dps[r].all_gather(seq, src, None, 0, 0)
                    outs.append((seq, n))
                else:
                    buf = self.keep(self.be.to_dev(torch.full((out_offset + W * n + 5,), 0xAB,
                                                              dtype=torch.uint8)))
                    self.dps[r].all_gather(seq, src, buf, out_offset, n)
                    outs.append(buf)
        return outs

    def issue(self, op: str, srcs, outs, L: int, dtype=torch.bfloat16) -> None:
        """One collective of every rank on tensors already on the device, nothing kept or
        checked (the benchmarks' loop): "ag" gathers L bytes per rank into outs, "rs" sums
        chunks of L bytes (dtype) into outs."""
        seq = self.seq
        self.seq += 1
        for r in range(self.world):
            with self.be.on(r):
                if op == "ag":
                    self.dps[r].all_gather(seq, srcs[r], outs[r], 0, L)
                else:
                    self.dps[r].reduce_scatter(seq, srcs[r], 0, L, L, outs[r], 0, dtype)

    def reduce_scatter(self, xs, *, zero_copy: bool = False, out_offset: int = 0):
        W = self.world
        chunk = xs[0].numel() * xs[0].element_size() // W
        assert chunk <= self.max_slice
        seq = self.seq
        self.seq += 1
        outs = []
        for r in range(W):
            with self.be.on(r):
                buf = self.keep(self.be.to_dev(torch.full((out_offset + chunk + 5,), 0xAB,
                                                          dtype=torch.uint8)))
                dp = self.dps[r]
                if zero_copy:
                    assert chunk % 16 == 0
                    base = (seq % 2) * dp.rs_send_stride
                    dst = dp.rs_send[base:base + W * chunk]
                    dst.copy_(self.be.to_dev(xs[r]).reshape(-1).view(torch.uint8))
                    dp.reduce_scatter(seq, None, 0, chunk, chunk, buf, out_offset, xs[r].dtype)
                else:
                    src = self.keep(self.be.to_dev(xs[r]).reshape(-1).view(torch.uint8))
                    dp.reduce_scatter(seq, src, 0, chunk, chunk, buf, out_offset, xs[r].dtype)
            outs.append(buf)
        return outs


def check_ag(w: World, xs, outs, out_offset=0):
    n = xs[0].numel() * xs[0].element_size()
    ref = all_gather_reference(xs)
    for r, buf in enumerate(outs):
        got = buf.cpu().numpy()
        assert np.array_equal(got[out_offset:out_offset + w.world * n], ref), f"all_gather rank {r}"
        assert (got[:out_offset] == 0xAB).all() and (got[out_offset + w.world * n:] == 0xAB).all(), \
            f"all_gather rank {r} wrote outside its output"


def check_rs(w: World, xs, outs, out_offset=0):
    chunk = xs[0].numel() * xs[0].element_size() // w.world
    for r, buf in enumerate(outs):
        got = buf.cpu().numpy()
        ref = reduce_scatter_reference(xs, r)
        assert np.array_equal(got[out_offset:out_offset + chunk], ref), \
            f"reduce_scatter rank {r} {xs[0].dtype} {list(xs[0].shape)}: " \
            f"{np.flatnonzero(got[out_offset:out_offset + chunk] != ref)[:10]}"
        assert (got[:out_offset] == 0xAB).all() and (got[out_offset + chunk:] == 0xAB).all()


def inputs(seed, world, shape, dtype):
    return [make_input(seed, r, shape, dtype) for r in range(world)]


def check_queued(w: World, ag_inputs, rs_inputs, *, sync_every_other: bool = False):
    """Queue the all-gathers, then the reduce-scatters (synchronizing after every other
    all-gather if asked), then check every output against its reference."""
    pending = []
    for k, xs in enumerate(ag_inputs):
        pending.append((check_ag, xs, w.all_gather(xs)))
        if sync_every_other and k % 2:
            w.sync()
    for xs in rs_inputs:
        pending.append((check_rs, xs, w.reduce_scatter(xs)))
    w.sync()
    for check, xs, outs in pending:
        check(w, xs, outs)


# ---------------------------------------------------------------- tests

CONFIGS = [("mesh", 2, 2), ("mesh", 3, 1), ("mesh", 4, 2), ("ring", 2, 2), ("ring", 3, 2),
           ("ring", 4, 2), ("ring", 4, 1),
           # multi-hop relays and the largest worlds
           ("ring", 5, 2), ("ring", 6, 2), ("mesh", 8, 2), ("ring", 8, 2)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topology,world,roots", CONFIGS)
def test_all_gather_exact(backend, topology, world, roots):
    sizes = [1, 15, 16, 17, 100, 1000, 4096 * 3 + 5, 40000]
    if backend == "cuda":
        sizes += [1 << 20, (3 << 20) + 6]
    with World(backend, topology, world, roots, max_slice=max(sizes)) as w:
        for k, n in enumerate(sizes):
            for dtype, shape in ((torch.uint8, (n,)), (torch.bfloat16, (max(1, n // 2),))):
                xs = inputs(k, world, shape, dtype)
                outs = w.all_gather(xs)
                w.sync()
                check_ag(w, xs, outs)
        w.healthy()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topology,world,roots", CONFIGS)
def test_reduce_scatter_exact(backend, topology, world, roots):
    cases = [(torch.bfloat16, (world * 3, 5)), (torch.float16, (world * 8,)),
             (torch.float32, (world * 7, 3)), (torch.bfloat16, (world * 1000, 8)),
             (torch.float16, (world * 333, 4)), (torch.float32, (world * 4096,)),
             (torch.bfloat16, (world,))]
    if backend == "cuda":
        cases += [(torch.bfloat16, (world * 4096, 128)), (torch.float32, (world * 1000, 257))]
    max_slice = max(np.prod(s) * torch.empty((), dtype=d).element_size() // world for d, s in cases)
    with World(backend, topology, world, roots, max_slice=int(max_slice)) as w:
        for k, (dtype, shape) in enumerate(cases):
            xs = inputs(100 + k, world, shape, dtype)
            outs = w.reduce_scatter(xs)
            w.sync()
            check_rs(w, xs, outs)
        w.healthy()


@pytest.mark.parametrize("backend", BACKENDS)
def test_unaligned_outputs_and_inputs(backend):
    """Device pointers off 16-byte alignment take the unaligned paths; bytes are the same."""
    world = 3
    with World(backend, "mesh", world, max_slice=1 << 14) as w:
        for n in (37, 1000, 4099):
            xs = inputs(7, world, (n,), torch.uint8)
            outs = w.all_gather(xs, out_offset=3)
            w.sync()
            check_ag(w, xs, outs, out_offset=3)
        # Inputs at an odd element offset (bf16: 2 bytes off 16-byte alignment).
        for dtype, rows in ((torch.bfloat16, 37), (torch.float32, 101)):
            xs = inputs(8, world, (world * rows,), dtype)
            seq = w.seq
            w.seq += 1
            chunk = rows * xs[0].element_size()
            outs = []
            for r in range(world):
                with w.be.on(r):
                    big = w.keep(w.be.to_dev(torch.cat([torch.zeros(1, dtype=dtype), xs[r]])))
                    src = big[1:].view(torch.uint8)
                    out = w.keep(w.be.to_dev(torch.full((chunk + 2 + 5,), 0xAB, dtype=torch.uint8)))
                    w.dps[r].reduce_scatter(seq, src, 0, chunk, chunk, out, 2, dtype)
                outs.append(out)
            w.sync()
            check_rs(w, xs, outs, out_offset=2)
        w.healthy()


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_copy(backend):
    world = 4
    with World(backend, "ring", world, max_slice=1 << 14) as w:
        xs = inputs(3, world, (world * 512,), torch.bfloat16)  # chunk 1024 bytes
        outs = w.reduce_scatter(xs, zero_copy=True)
        w.sync()
        check_rs(w, xs, outs)
        ys = inputs(4, world, (640,), torch.float32)
        res = w.all_gather(ys, zero_copy=True)
        w.sync()
        ref = all_gather_reference(ys)
        # The view's documented lifetime (docs/CONTRACT.md): the next two collectives of any
        # kind leave it intact (seq counts them all; its slot is reused at seq + 3).
        w.reduce_scatter(inputs(5, world, (world * 512,), torch.bfloat16))
        w.all_gather(inputs(6, world, (640,), torch.float32))
        w.sync()
        for r, (seq, n) in enumerate(res):
            got = w.dps[r].ag_slot(seq, world * n).cpu().numpy()
            assert np.array_equal(got, ref), r
        w.healthy()


@pytest.mark.parametrize("backend", BACKENDS)
def test_back_to_back_without_sync(backend):
    """Many collectives queued before any synchronization: slots rotate, the publish ring
    wraps (more than 256 entries), the per-seq counters and progress words are reused."""
    world = 3
    count = 40 if backend == "cuda" else 36
    with World(backend, "mesh", world, max_slice=1 << 12) as w:
        pending = []
        for k in range(count):
            if k % 3 == 2:
                xs = inputs(200 + k, world, (world * 40,), torch.bfloat16)
                pending.append(("rs", xs, w.reduce_scatter(xs)))
            else:
                xs = inputs(200 + k, world, (300 + k,), torch.uint8)
                pending.append(("ag", xs, w.all_gather(xs)))
        w.sync()
        for kind, xs, outs in pending:
            (check_rs if kind == "rs" else check_ag)(w, xs, outs)
        w.healthy()
        assert w.proxies[0].stats()["entries"] == 8 * count


# The proxy path (None) and every GPU-direct mode.
WAIT_MODES = [None, *config.DIRECT_ENGINES]


def _skip_trapping_ce(backend: str, mode: str | None) -> None:
    """Mode ce fails by a trap (mode stop: World's default for it, since mode poison runs
    "ce" as "fused"), which on the GPU would lose this process's CUDA context and every test
    after it: the emulation checks ce's failure path (test_fail_stop_reports_then_traps)."""
    if backend == "cuda" and mode == "ce":
        pytest.skip("mode ce fails by a device trap: on the GPU that loses this process's "
                    "context; the emulation checks it")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", WAIT_MODES)
def test_timeout_raises_and_names_the_peer(backend, mode):
    _skip_trapping_ce(backend, mode)
    world = 2
    with World(backend, "mesh", world, roots=2, max_slice=4096, timeout_s=0.5,
               direct=mode is not None, mode=mode) as w:
        xs = inputs(1, world, (100,), torch.uint8)
        seq = w.seq
        w.seq += 3
        with w.be.on(0):
            src = w.keep(w.be.to_dev(xs[0]).view(torch.uint8))
            outs = [w.keep(w.be.to_dev(torch.zeros(200, dtype=torch.uint8))) for _ in range(3)]
        w.be.sync()
        t0 = time.monotonic()
        with w.be.on(0):  # only rank 0 calls: rank 1 never sends
            for k in range(3):
                w.dps[0].all_gather(seq + k, src, outs[k], 0, 100)
        with pytest.raises(CollectiveError) as ei:
            w.dps[0].synchronize()
        elapsed = time.monotonic() - t0
        msg = str(ei.value)
        assert "timed out" in msg and f"seq {seq} piece 0 from rank 1" in msg, msg
        assert ei.value.peer == 1 and "channel 0 root" in ei.value.connection
        # The later waits failed at once (the first failure marks the data plane dead).
        assert elapsed < 0.5 + 5.0, elapsed
        assert N.abort_code(w.ctl[0].addr) == L.ABORT_TIMEOUT
        assert "timed out" in N.error_text(w.ctl[0].addr)
        with pytest.raises(CollectiveError):
            with w.be.on(0):
                w.dps[0].all_gather(seq + 3, src, outs[0], 0, 100)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", WAIT_MODES)
def test_abort_stops_a_waiting_kernel(backend, mode):
    _skip_trapping_ce(backend, mode)
    world = 2
    with World(backend, "ring", world, max_slice=4096, timeout_s=60, direct=mode is not None,
               mode=mode) as w:
        xs = inputs(2, world, (world * 64,), torch.float32)
        with w.be.on(0):
            src = w.keep(w.be.to_dev(xs[0]).view(torch.uint8))
            out = w.keep(w.be.to_dev(torch.zeros(256, dtype=torch.uint8)))
            w.dps[0].reduce_scatter(0, src, 0, 256, 256, out, 0, torch.float32)
        time.sleep(0.3)
        assert N.set_abort(w.ctl[0].addr, L.ABORT_USER, "closed by the test")
        t0 = time.monotonic()
        with pytest.raises(CollectiveError, match="closed by the test"):
            w.dps[0].synchronize()
        assert time.monotonic() - t0 < 10


# (collective, (elements, dtype) per rank, what each rank is said to have passed): sizes
# that pad to the same 16 bytes, and dtypes of one width (issue 32)
CALL_MISMATCHES = [
    ("ag", ((3, torch.float32), (4, torch.float32)),
     ("12 bytes of float32 per rank to all_gather", "16 bytes of float32 per rank to all_gather")),
    ("rs", ((5, torch.bfloat16), (6, torch.bfloat16)),
     ("10 bytes of bfloat16 per rank to reduce_scatter",
      "12 bytes of bfloat16 per rank to reduce_scatter")),
    ("ag", ((5, torch.bfloat16), (5, torch.float16)),
     ("10 bytes of bfloat16 per rank to all_gather", "10 bytes of float16 per rank to all_gather")),
    ("rs", ((5, torch.bfloat16), (5, torch.float16)),
     ("10 bytes of bfloat16 per rank to reduce_scatter",
      "10 bytes of float16 per rank to reduce_scatter")),
    ("ag", ((100, torch.uint8), (200, torch.uint8)),
     ("100 bytes of uint8 per rank to all_gather", "200 bytes of uint8 per rank to all_gather")),
    # the first step of an all-reduce of 3 vs 4 fp32 (sparkccl/allreduce.py: both padded to
    # 16-byte chunks), and of a sum beside an average
    ("rs", ((4, torch.float32, (3, 20)), (4, torch.float32, (3, 16))),
     ("12 bytes of float32 to all_reduce(sum)", "16 bytes of float32 to all_reduce(sum)")),
    ("rs", ((4, torch.float32, (3, 0)), (4, torch.float32, (4, 0))),
     ("32 bytes of float32 to all_reduce(sum)", "32 bytes of float32 to all_reduce(avg)")),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct", [False, True], ids=["proxy", "fused"])
@pytest.mark.parametrize("op,calls,said", CALL_MISMATCHES,
                         ids=["ag-3v4-f32", "rs-5v6-bf16", "ag-bf16-f16", "rs-bf16-f16",
                              "ag-100v200-u8", "ar-3v4-f32", "ar-sum-avg"])
def test_a_different_call_on_a_peer_is_reported(backend, direct, op, calls, said):
    """The ranks' exact bytes and dtypes cross in the call entries the proxies send (also
    where the GPU wrote the data and flags itself, "fused"): a difference the 16-byte
    padding or the element width hides fails every rank at synchronize(), naming both
    calls."""
    from sparkccl.dataplane.peer_check import calls_view
    world = 2
    with World(backend, "mesh", world, max_slice=4096, timeout_s=20, direct=direct) as w:
        for r in range(world):
            w.dps[r].peer_calls = calls_view(w.ctl[r].t, num_flag_words(world))
        for r, (n, dtype, *part) in enumerate(calls):
            part = part[0] if part else None
            with w.be.on(r):
                esize = dtype.itemsize
                if op == "ag":
                    src = w.keep(w.be.to_dev(torch.zeros(n, dtype=dtype)))
                    out = w.keep(w.be.to_dev(torch.zeros(world * n * esize, dtype=torch.uint8)))
                    w.dps[r].all_gather(0, src, out, 0, n * esize, part=part)
                else:
                    src = w.keep(w.be.to_dev(torch.zeros(world * n, dtype=dtype)))
                    out = w.keep(w.be.to_dev(torch.zeros(n, dtype=dtype)))
                    w.dps[r].reduce_scatter(0, src, 0, n * esize, n * esize, out, 0, dtype,
                                            part)
        w.be.sync()
        name = {"ag": "all_gather", "rs": "reduce_scatter"}[op]
        if len(calls[0]) > 2:
            name = "all_reduce\\(sum\\)"
        with pytest.raises(CollectiveError, match=rf"rank 0: {name} seq 0: rank 1 made a "
                           rf"different call than rank 0 \(this rank\): rank 1 passed "
                           rf"{re.escape(said[1])}, rank 0 passed {re.escape(said[0])}; every "
                           "rank must pass the same shape, dtype and operation"):
            w.dps[0].synchronize()
        with pytest.raises(CollectiveError, match=rf"rank 1 passed {re.escape(said[1])}"):
            w.dps[1].synchronize()  # (its own check, or rank 0's abort through the proxy)
        assert N.abort_code(w.ctl[0].addr) == L.ABORT_USER


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("on_failure", ["poison", "stop"])
def test_close_while_waiting_aborts_promptly(backend, on_failure):
    """Also in mode stop: a deliberate close does not trap (the process keeps its context)."""
    if backend == "cuda" and on_failure == "stop":
        pytest.skip("a wrong trap would lose this process's CUDA context: emu only")
    world = 2
    with World(backend, "mesh", world, max_slice=4096, timeout_s=60, on_failure=on_failure) as w:
        with w.be.on(1):
            src = w.keep(w.be.to_dev(torch.zeros(64, dtype=torch.uint8)))
            out = w.keep(w.be.to_dev(torch.zeros(128, dtype=torch.uint8)))
            w.dps[1].all_gather(0, src, out, 0, 64)
        time.sleep(0.2)
        t0 = time.monotonic()
        w.dps[1].close()
        assert time.monotonic() - t0 < 10
        assert N.abort_code(w.ctl[1].addr) == L.ABORT_USER
        assert "closed while collectives were still running" in N.error_text(w.ctl[1].addr)
        if backend == "emu":
            assert not w.be.streams[1].ctx.trapped


@pytest.mark.parametrize("backend", BACKENDS)
def test_piece_bounds_kernel_matches_geometry(backend):
    sizes = list(range(0, 2000, 7)) + [2**31 + 5, 2**40 + 12345, 123456789]
    be = Backend(backend, 1)
    try:
        host = torch.tensor(sizes, dtype=torch.int64)
        dev_in = be.to_dev(host)
        dev_out = be.to_dev(torch.zeros(len(sizes) * G.PIECES * 2, dtype=torch.int64))
        with be.on(0):
            if backend == "cuda":
                k = cuda_runtime.kernels_for(be.device.index)["sccl_piece_bounds"]
                cc = nvrtc.import_cuda_core()
                s = cc.Stream.from_handle(int(torch.cuda.current_stream().cuda_stream))
                with torch.cuda.device(be.device):
                    cc.launch(s, cc.LaunchConfig(grid=4, block=128), k, dev_in.data_ptr(),
                              np.uint64(len(sizes)), dev_out.data_ptr())
            else:
                be.streams[0].submit("sccl_piece_bounds", 2,
                                     [dev_in.data_ptr(), len(sizes), dev_out.data_ptr()])
        be.sync()
        got = dev_out.cpu().view(-1, G.PIECES, 2).tolist()
        for i, S in enumerate(sizes):
            assert [tuple(b) for b in got[i]] == [G.piece_bounds(S, c) for c in range(G.PIECES)], S
    finally:
        be.close()


# ---------------------------------------------------------------- GPU-direct

DIRECT_CONFIGS = [("mesh", 2, 2), ("mesh", 3, 2), ("mesh", 4, 2), ("mesh", 4, 1),
                  ("ring", 2, 2), ("ring", 3, 2), ("ring", 4, 2), ("ring", 5, 2), ("ring", 6, 2),
                  ("ring", 6, 1)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct", [False, True], ids=["proxy", "direct"])
@pytest.mark.parametrize("topology,world,roots", [("mesh", 2, 2), ("mesh", 3, 1),
                                                  ("ring", 4, 2)])
def test_both_sides_of_the_one_handoff_slice(backend, topology, world, roots, direct):
    """Slices up to ONE_HANDOFF_SLICE go in one hand-off (the GPU-direct publish flags the
    last piece only; the waits take the whole slice at once), larger ones piece by piece:
    the same bits on both sides of the bound and at it, tails included, back to back."""
    oh = EN.ONE_HANDOFF_SLICE
    ag_sizes = [oh - 21, oh, oh + 1]  # S = oh - 16, oh (one hand-off); oh + 16 (pieces)
    rs_cases = [(torch.bfloat16, (world * (oh // 2),)), (torch.bfloat16, (world * (oh // 2 + 1),)),
                (torch.float32, (world * (oh // 4 - 3),))]
    with World(backend, topology, world, roots, max_slice=oh + 16, direct=direct) as w:
        check_queued(w, [inputs(700 + k, world, (n,), torch.uint8) for k, n in enumerate(ag_sizes)],
                     [inputs(710 + k, world, shape, dtype)
                      for k, (dtype, shape) in enumerate(rs_cases)])
        w.healthy()


def test_wait_blocks_cover_a_one_handoff_slice_and_stay_capped(monkeypatch):
    """The wait role's blocks: enough for the whole slice where it goes in one hand-off (the
    kernels wait once, then move all of it), for a piece above; and by default never more
    than MAX_WAIT_BLOCKS, however many SMs (they spin: ranks sharing a GPU need SMs left for
    each other's publishing blocks)."""
    init, defaults = C.CudaDataPlane.__init__, []

    def recording(self, *a, **kw):
        init(self, *a, **kw)
        defaults.append(self.max_wait_blocks)
    monkeypatch.setattr(EmuDevice, "sms", 200)
    monkeypatch.setattr(C.CudaDataPlane, "__init__", recording)
    with World("emu", "mesh", 2, max_slice=4096) as w:
        assert defaults == [EN.MAX_WAIT_BLOCKS] * 2
        dp = w.dps[0]
        dp.max_wait_blocks = EN.MAX_WAIT_BLOCKS
        oh, per = EN.ONE_HANDOFF_SLICE, EN.WAIT_BYTES_PER_BLOCK
        grids = dp.engines.proxy  # (every engine sizes its grids so)
        assert grids.slice_wait_blocks(oh) == oh // per
        assert grids.slice_wait_blocks(oh + 16) == -(-G.piece_bounds(oh + 16, 0)[1] // per)
        assert grids.slice_wait_blocks(1 << 30) == EN.MAX_WAIT_BLOCKS


def direct_streams(plan, op, S: int) -> int:
    """How many of ``plan``'s publish-triggered streams of ``op`` carry a collective of slice
    ``S`` (an idle root 1's send nothing: G.root1_idle)."""
    idle = G.root1_idle(S)
    return len([s for s in plan.publish_streams() if plan.streams[s].op == op
                and not (idle and plan.connections[plan.streams[s].conn].root == 1)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", config.DIRECT_ENGINES)
@pytest.mark.parametrize("topology,world,roots", DIRECT_CONFIGS)
def test_direct_exact(backend, topology, world, roots, mode):
    """The data planes execute the publish-triggered streams themselves (writes into the
    peers' regions, flags into the peers' flag words); the proxies only relay (rings of 4
    and more). Same bits as the references, for all-gather and reduce-scatter, aligned and
    not, zero-copy both ways, many collectives queued back to back."""
    ag_sizes = [1, 16, 17, 1000, 4096 * 3 + 5, 40000]
    rs_cases = [(torch.bfloat16, (world * 3, 5)), (torch.float16, (world * 333, 4)),
                (torch.float32, (world * 4096,)), (torch.bfloat16, (world * 1000, 8))]
    if backend == "cuda":
        ag_sizes += [1 << 20, (3 << 20) + 6]
        rs_cases += [(torch.bfloat16, (world * 4096, 128))]
    max_slice = max(max(ag_sizes), max(int(np.prod(s)) * torch.empty((), dtype=d).element_size()
                                       // world for d, s in rs_cases))
    with World(backend, topology, world, roots, max_slice=max_slice, direct=True,
               mode=mode) as w:
        check_queued(w, [inputs(300 + k, world, (n,), torch.uint8) for k, n in enumerate(ag_sizes)],
                     [inputs(400 + k, world, shape, dtype)
                      for k, (dtype, shape) in enumerate(rs_cases)], sync_every_other=True)
        xs = inputs(500, world, (world * 512,), torch.bfloat16)  # zero-copy input, chunk 1 KiB
        outs = w.reduce_scatter(xs, zero_copy=True)
        ys = inputs(501, world, (640,), torch.float32)  # zero-copy result
        res = w.all_gather(ys, zero_copy=True)
        w.sync()
        check_rs(w, xs, outs)
        ref = all_gather_reference(ys)
        for r, (seq, n) in enumerate(res):
            assert np.array_equal(w.dps[r].ag_slot(seq, world * n).cpu().numpy(), ref), r
        w.healthy()
        n_coll = len(ag_sizes) + len(rs_cases) + 2
        for r in range(world):
            assert w.dps[r].direct_launches == n_coll
            # Every publish-triggered stream piece went from the GPU, none from the proxy
            # (which consumes the last entries on its own time: the GPU no longer waits for it).
            # (an idle root 1's streams send nothing: G.root1_idle of the slice)
            ag_slices = [*ag_sizes, 640 * 4]
            rs_slices = [int(np.prod(s)) * torch.empty((), dtype=d).element_size() // world
                         for d, s in rs_cases] + [1024]
            want = sum(8 * direct_streams(w.plans[r], op, G.round_up(n, G.ALIGN))
                       for op, slices in ((0, ag_slices), (1, rs_slices)) for n in slices)
            n_pub = [len([s for s in w.plans[r].publish_streams() if w.plans[r].streams[s].op == op])
                     for op in (0, 1)]
            deadline = time.monotonic() + 10
            while True:
                st = w.proxies[r].stats()
                if (st["entries"], st["gpu_pieces"]) == (8 * n_coll, want) or \
                        time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            assert (st["entries"], st["gpu_pieces"]) == (8 * n_coll, want), st
            relays = len(w.plans[r].streams) - sum(n_pub)
            assert (st["flags"] > 0) == (relays > 0), st  # the proxy writes relay flags only


def test_auto_mode_picks_the_engine_by_slice():
    """SPARKCCL_DIRECT_MODE=auto: copy engines from ce_min_slice bytes per rank, the fused
    kernel below; and "ce" falls back to "split" where streams cannot write values. The
    results are the same bits either way."""
    world = 2
    with World("emu", "mesh", world, max_slice=1 << 16, direct=True, mode="auto",
               on_failure="stop") as w:  # (no sccl_poison launches to count)
        issued, launched = [], []
        for dp in w.dps:
            dp.ce_min_slice = 4096
            run, launch, launch_struct = dp.gpu.run_program, dp.launch, dp.launch_struct
            dp.gpu.run_program = lambda p, t, ts, f=run: (issued.append(p.names), f(p, t, ts))[1]
            dp.launch = lambda st, name, *a, f=launch: (launched.append(name), f(st, name, *a))
            dp.launch_struct = lambda st, name, *a, f=launch_struct: (launched.append(name),
                                                                      f(st, name, *a))
        small = inputs(20, world, (4000,), torch.uint8)
        outs = w.all_gather(small)
        w.sync()
        check_ag(w, small, outs)
        assert issued == [] and set(launched) == {"sccl_ag_direct"}
        launched.clear()
        big = inputs(21, world, (5000,), torch.uint8)  # S = 5008 >= 4096
        outs = w.all_gather(big)
        w.sync()
        check_ag(w, big, outs)
        # one program per rank: copies, piece waits, the guard of mode stop, then the
        # advance of the device's sequence state; nothing launched beside it
        assert issued == [["sccl_wait_piece", "sccl_fail_guard", "sccl_advance"]] * world
        assert launched == []
        issued.clear()
        launched.clear()
        for dp in w.dps:
            dp.direct_mode = "ce"
            dp.gpu.can_write_values = lambda: False
        outs = w.all_gather(big)
        w.sync()
        check_ag(w, big, outs)
        assert issued == [] and sorted(set(launched)) == ["sccl_advance", "sccl_ag_direct",
                                                          "sccl_ag_wait"]
        w.healthy()


@pytest.mark.parametrize("world", [2, 4])
def test_ce_sends_a_piece_in_one_copy_batch_and_one_value_batch(world):
    """Mode "ce", the sending stream: every piece's copies (one per item) come before its
    flags and tag, so the native issue makes one cuMemcpyBatchAsync and one
    cuStreamBatchMemOp of each piece (OpProgram.calls), where it made one call per copy and
    per value before; the results stay exact (the emulation runs a batch's copies last to
    first)."""
    L = 1 << 16
    with World("emu", "mesh", world, max_slice=L, direct=True, mode="ce") as w:
        dp = w.dps[0]
        seen = []
        run = dp.gpu.run_program

        def watch(program, terms, ts):
            seen.append((program.native.evaluate(terms), program.native.calls(terms), terms))
            return run(program, terms, ts)
        dp.gpu.run_program = watch
        xs = inputs(5, world, (world * L // 2,), torch.bfloat16)
        ag = [x[:L // 2] for x in xs]
        outs = w.all_gather(ag)
        w.sync()
        check_ag(w, ag, outs)
        outs = w.reduce_scatter(xs)
        w.sync()
        check_rs(w, xs, outs)
        w.healthy()
        assert len(seen) == 2
        for ops, calls, terms in seen:
            side = terms[E.T_SIDE]
            kinds = [(ops[5 * f], how, n) for f, n, how in calls if ops[5 * f + 1] == side]
            # the fork's event wait; per piece the batch of its copies (one per item) and
            # the batch of its flags (one per publish stream) and tag; the join's record
            copies = sum(1 for k in range(0, len(ops), 5)
                         if ops[k + 1] == side and ops[k] == E.OP_COPY) // G.PIECES
            values = sum(1 for k in range(0, len(ops), 5)
                         if ops[k + 1] == side and ops[k] == E.OP_WRITE64) // G.PIECES
            assert copies >= 2 and values >= 3, (copies, values)
            piece = [(E.OP_COPY, 1, copies), (E.OP_WRITE64, 2, values)]
            assert kinds == ([(E.OP_WAIT_EVENT, 0, 1)] + piece * G.PIECES
                             + [(E.OP_RECORD, 0, 1)]), kinds


def test_ce_keeps_a_sum_whose_word_no_source_sends():
    """Mode "ce" walks the wait words of a piece; a word that no source sends is skipped,
    except where the reduce-scatter sums (the whole piece after the last word, for sources
    that split pieces differently): that sum must still be launched."""
    with World("emu", "mesh", 2, max_slice=1 << 14, direct=True, mode="ce") as w:
        dp = w.dps[0]
        W, maxw = dp.world, dp.maxw
        waits = [[-1] * maxw for _ in range(W)]
        waits[1][0] = 7  # source 1 sends word 0 only
        parts = [[PW.PART_NONE] * maxw for _ in range(W + 1)]
        parts[1][0] = PW.PART_WHOLE
        parts[W][maxw - 1] = PW.PART_WHOLE  # the sum after the last word
        ce = dp.engines.ce
        ce.words = {C.Op.RS: PW.ce_words(waits, parts, dp.rank, reduce=True)}
        rows, launches = [], []

        def row(kind, st, a=(0, E.T_ZERO, 0), b=(0, E.T_ZERO, 0), c=0):
            rows.append((kind, st, a, b, c))

        def launch(st, k, unit=None, blocks=1):
            launches.append((st, k, unit))
        units = ce._pieces(C.Op.RS, 4096, 4096, 0, None, ce.words[C.Op.RS])[1][0]
        ce._receive_rows(row, launch, units, (0, 0, 0, 0),
                            ("sums", list(range(1, 8 * maxw + 1))), 4096, 1)
        waits = [b for kind, st, a, b, c in rows if kind == E.OP_WAIT_VALUE]
        # the progress word of unit (0, k): seq * PROG_STRIDE (term T_PROG) + (k + 1) * W
        unit_done = [((k + 1) * W, E.T_PROG, 1) for k in range(maxw)]
        assert waits == [unit_done[0], unit_done[maxw - 1]], waits  # word 0, the summing word
        assert launches == [(E.T_SUMS, E.K_SUM, maxw - 1)], launches  # the sum at the last word
        w.healthy()


@pytest.mark.parametrize("backend", BACKENDS)
def test_direct_and_proxy_ranks_mix(backend):
    """GPU-direct is each rank's own choice: a rank that sends through its proxy and ranks
    whose GPUs write directly interoperate (the same flag words, the same bytes)."""
    world = 3
    with World(backend, "ring", world, max_slice=1 << 14, direct=True) as w:
        w.dps[1].direct.tables.clear()  # rank 1: back to the proxy (its entries say chunk -1)
        xs = inputs(9, world, (3000,), torch.uint8)
        outs = w.all_gather(xs)
        zs = inputs(10, world, (world * 100, 3), torch.float32)
        rs = w.reduce_scatter(zs)
        w.sync()
        check_ag(w, xs, outs)
        check_rs(w, zs, rs)
        w.healthy()
        assert w.dps[1].direct_launches == 0 and w.proxies[1].stats()["gpu_pieces"] == 0
        assert w.proxies[1].stats()["writes"] > 0  # its data went through the proxy
        assert w.dps[0].direct_launches == 2 and w.proxies[0].stats()["writes"] == 0


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
def test_direct_entry_without_gpu_streams_fails_clearly():
    """A ring entry that says the data plane sent the piece itself (chunk -2) reaching a
    proxy that was not told which streams the data plane runs is an error, not a second
    writer of the same flag words."""
    world = 2
    with World("emu", "mesh", world, max_slice=4096, timeout_s=5) as w:
        nfw = num_flag_words(world)
        w.dps[0].map_peers(ctl={1: (w.ctl[1].addr, L.control_bytes(nfw))},
                           ag={1: (w.ag[1].addr, len(w.ag[1].mm))})
        _lone_all_gathers(w, 64, 1, torch.uint8)
        with pytest.raises(CollectiveError, match="GPU-direct"):
            w.dps[0].synchronize()


@pytest.mark.parametrize("var,value", [("SPARKCCL_DIRECT_MODE", "fast"),
                                       ("SPARKCCL_CE_MIN_BYTES", "lots"),
                                       ("SPARKCCL_DIRECT_BLOCKS", "12"),
                                       ("SPARKCCL_DIRECT_BLOCKS", "12,x")])
def test_bad_engine_settings_are_refused_before_anything_is_pinned(monkeypatch, var, value):
    """The engine settings go through sparkccl.config: a bad value raises ConfigError naming
    the variable and the value (it used to be ignored with a warning), before the data plane
    pins or launches anything (the addresses here are not even valid)."""
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=f"{var}=.*{value}"):
        emu_data_plane(plan=build_plan("mesh", 2, 0, 2), ctl_addr=0, flags_addr=0,
                       ag=torch.zeros(16, dtype=torch.uint8), ag_stride=4096, timeout_s=1.0)


def test_engine_settings_are_read_through_config(monkeypatch):
    monkeypatch.setenv("SPARKCCL_DIRECT_MODE", "SPLIT")
    monkeypatch.setenv("SPARKCCL_CE_MIN_BYTES", "1M")
    monkeypatch.setenv("SPARKCCL_DIRECT_BLOCKS", "3,0")
    with World("emu", "mesh", 2, max_slice=4096) as w:
        dp = w.dps[0]
        assert (dp.direct_mode, dp.ce_min_slice) == ("split", 1 << 20)
        assert (dp.max_direct_blocks, dp.max_direct_wait_blocks) == (3, 1)


# ---------------------------------------------------------------- CUDA graphs
# (docs/CONTRACT.md "CUDA graphs"): each collective takes its seq and ring indices from the
# device state, so a captured sequence replays with fresh values, in step with eager calls.

def graph_specs(world: int, big: bool) -> list:
    """~10 mixed collectives: (kind, input shape, dtype)."""
    W = world
    specs = [("ag", (100,), torch.uint8), ("rs", (W * 48,), torch.float32),
             ("ag", (4096 * 3 + 5,), torch.uint8), ("rs", (W * 333, 4), torch.float16),
             ("ag", (640,), torch.bfloat16), ("rs", (W * 1000, 8), torch.bfloat16),
             ("ag", (17,), torch.uint8), ("rs", (W * 16,), torch.bfloat16),
             ("ag", (2000,), torch.float32), ("rs", (W * 4096,), torch.float32)]
    if big:  # 1 MiB per rank each way
        specs += [("ag", (1 << 19,), torch.bfloat16), ("rs", (W * (1 << 19),), torch.bfloat16)]
    return specs


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()


class GraphCase:
    """Static inputs and outputs per (collective, rank), what a captured graph reads and
    writes at every replay (the outputs' last 5 bytes are a guard that stays 0xAB)."""

    def __init__(self, w: World, specs: list):
        self.w, self.specs = w, specs
        W = w.world
        self.inp, self.out = [], []
        for kind, shape, dtype in specs:
            n = _nbytes(shape, dtype)
            m = W * n if kind == "ag" else n // W
            assert (n if kind == "ag" else n // W) <= w.max_slice
            self.inp.append([w.be.to_dev(torch.zeros(shape, dtype=dtype)) for _ in range(W)])
            self.out.append([w.be.to_dev(torch.full((m + 5,), 0xAB, dtype=torch.uint8))
                             for _ in range(W)])

    def issue(self, r: int) -> None:
        """Rank r's collectives, in order (on the current stream; the seq labels are the
        World's: the data planes number them on the GPU)."""
        w, W = self.w, self.w.world
        for k, (kind, shape, dtype) in enumerate(self.specs):
            src = self.inp[k][r].reshape(-1).view(torch.uint8)
            n = src.numel()
            if kind == "ag":
                w.dps[r].all_gather(w.seq + k, src, self.out[k][r], 0, n)
            else:
                w.dps[r].reduce_scatter(w.seq + k, src, 0, n // W, n // W, self.out[k][r], 0,
                                        dtype)

    def fill(self, seed: int) -> list:
        """Fresh inputs (written on each rank's stream); returns them for the check."""
        xs = []
        for k, (kind, shape, dtype) in enumerate(self.specs):
            xs.append(inputs(seed * 100 + k, self.w.world, shape, dtype))
            for r in range(self.w.world):
                with self.w.be.on(r):
                    self.inp[k][r].copy_(self.w.be.to_dev(xs[k][r]))
        return xs

    def check(self, xs: list, what: str) -> None:
        W = self.w.world
        for k, (kind, shape, dtype) in enumerate(self.specs):
            for r in range(W):
                got = self.out[k][r].cpu().numpy()
                if kind == "ag":
                    ref = all_gather_reference(xs[k])
                else:
                    ref = reduce_scatter_reference(xs[k], r)
                assert np.array_equal(got[:-5], ref), \
                    f"{what}: {kind} {list(shape)} {dtype} rank {r}: " \
                    f"{np.flatnonzero(got[:-5] != ref)[:10]}"
                assert (got[-5:] == 0xAB).all(), f"{what}: {kind} rank {r} wrote past its output"


class Graphs:
    """One captured graph per rank: torch.cuda.CUDAGraph on the GPU; on the emulation the
    launches recorded during the 'capture' (nothing runs) and submitted again per replay,
    with no host code in between, as a graph launch does."""

    def __init__(self, w: World):
        self.w = w
        self.graphs: list = []

    def capture(self, issue) -> None:
        """issue(r): rank r's collectives, in order, on the current stream."""
        w = self.w
        for r in range(w.world):
            if w.be.name == "cuda":
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=w.be.streams[r]):
                    issue(r)
            else:
                g = []
                with w.be.on(r):
                    _emu_current.capture = g
                    try:
                        issue(r)
                    finally:
                        _emu_current.capture = None
            self.graphs.append(g)

    def replay(self) -> None:
        w = self.w
        for r, g in enumerate(self.graphs):
            if w.be.name == "cuda":
                with w.be.on(r):
                    g.replay()
            else:
                for stream, name, grid, args in g:
                    stream.submit(name, grid, args)


def device_seq(w: World, r: int) -> int:
    return int(w.dps[r].state.cpu()[C.STATE_SEQ])


GRAPH_CONFIGS = [("mesh", 2, 2), ("ring", 3, 2), ("ring", 4, 1)]


# The emulated capture records launches only, not the cross-stream events of modes split
# and ce: those two are captured on the GPU alone.
GRAPH_RUNS = [pytest.param(b.values[0], m, marks=b.marks, id=f"{b.values[0]}-{m}")
              for b in BACKENDS for m in (None, "fused", "split", "ce")
              if b.values[0] == "cuda" or m in (None, "fused")]


@pytest.mark.parametrize("backend,mode", GRAPH_RUNS)
@pytest.mark.parametrize("topology,world,roots", GRAPH_CONFIGS)
def test_graph_replay_interleaved_with_eager(backend, topology, world, roots, mode):
    """Capture ~10 mixed collectives per rank, replay them many times with fresh inputs
    written into the captured input tensors, an eager all-gather and reduce-scatter between
    replays: every output equals the rank-order references bit for bit, and the device's
    seq counted every collective (eager and replayed). Mode ce is captured as "fused"."""
    big = backend == "cuda"
    specs = graph_specs(world, big)
    max_slice = max(max(_nbytes(s, d) // (world if k == "rs" else 1) for k, s, d in specs), 4096)
    replays = 20 if backend == "cuda" else 6
    with World(backend, topology, world, roots, max_slice=max_slice, direct=mode is not None,
               mode=mode) as w:
        # Eager first (also makes the side streams and scratch of the engines).
        xs = inputs(1, world, (world * 64,), torch.bfloat16)
        rsout = w.reduce_scatter(xs)
        ys = inputs(2, world, (300,), torch.uint8)
        agout = w.all_gather(ys)
        w.sync()
        check_rs(w, xs, rsout)
        check_ag(w, ys, agout)
        case = GraphCase(w, specs)
        graphs = Graphs(w)
        graphs.capture(case.issue)
        assert all(not dp.seq_on_host() for dp in w.dps)
        count = 2
        for it in range(replays):
            xs_g = case.fill(10 + it)
            graphs.replay()
            count += len(specs)
            if it % 2 == 0:  # eager calls between replays, queued behind the replay
                ex = inputs(500 + it, world, (world * 40, 3), torch.float32)
                eo = w.reduce_scatter(ex)
                ey = inputs(600 + it, world, (1000 + it,), torch.uint8)
                ea = w.all_gather(ey)
                count += 2
            w.sync()
            case.check(xs_g, f"replay {it}")
            if it % 2 == 0:
                check_rs(w, ex, eo)
                check_ag(w, ey, ea)
        for r in range(world):
            assert device_seq(w, r) == count, (r, device_seq(w, r), count)
            check_ring_tickets(w, r, count)
        w.healthy()


def check_ring_tickets(w: World, r: int, count: int) -> None:
    """The last 32 collectives' publish-ring entries of rank r (8 indices each): entry i
    carries tag i + 1 and seq i // 8, so no seq was taken twice or skipped and every slot
    (seq % 3, seq % 2) followed the one numbering the reuse chain is defined by
    (docs/PROTOCOL.md "Slot reuse"). A collective handed off in one entry (CHUNK_WHOLE, the
    one-shot all-reduce's proxy path) has it at its first index, for all 8 pieces."""
    ring = np.frombuffer((ctypes.c_uint64 * (L.RING_ENTRIES * L.RING_ENTRY_BYTES // 8))
                         .from_address(w.ctl[r].addr + L.RING_OFFSET), dtype=np.uint64)
    ring = ring.reshape(L.RING_ENTRIES, -1)
    head = 8 * count
    whole = None  # the seq of the CHUNK_WHOLE entry whose indices these are
    for i in range(max(0, head - L.RING_ENTRIES), head):
        if whole == i // 8:
            continue
        e = ring[i % L.RING_ENTRIES]
        assert (int(e[L.ENT_TAG // 8]), int(e[L.ENT_SEQ // 8])) == (i + 1, i // 8), (r, i)
        chunk = int(e[L.ENT_CHUNK // 8]) & 0xFFFFFFFF
        if chunk == L.CHUNK_WHOLE & 0xFFFFFFFF:
            assert i % 8 == 0 and int(e[L.ENT_OP // 8]) >> L.CALL_PIECE_SHIFT & 0xFF == 7, (r, i)
            whole = i // 8


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
def test_after_a_capture_host_slot_features_are_refused():
    """Once a collective was captured the host no longer knows the slots: a zero-copy
    result or input is refused with a RuntimeError naming it (never a wrong slot), and the
    emulated replay of the same recorded launches, without the host, is still exact."""
    world = 2
    with World("emu", "mesh", world, max_slice=4096) as w:
        case = GraphCase(w, [("ag", (64,), torch.uint8), ("rs", (world * 32,), torch.float32)])
        graphs = Graphs(w)
        assert w.dps[0].seq_on_host()
        graphs.capture(case.issue)
        with w.be.on(0):
            src = w.keep(torch.zeros(64, dtype=torch.uint8))
            with pytest.raises(RuntimeError, match="zero-copy result.*CUDA graph"):
                w.dps[0].all_gather(w.seq, src, None, 0, 0)
            with pytest.raises(RuntimeError, match="zero-copy input.*CUDA graph"):
                w.dps[0].reduce_scatter(w.seq, None, 0, 64, 64, w.keep(torch.zeros(64, dtype=torch.uint8)),
                                        0, torch.float32)
            with pytest.raises(RuntimeError, match="ag_slot"):
                w.dps[0].ag_slot(0, 64)
        for it in range(3):
            xs = case.fill(it)
            graphs.replay()
            w.sync()
            case.check(xs, f"replay {it}")
        assert [device_seq(w, r) for r in range(world)] == [6, 6]


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
@pytest.mark.parametrize("mode,extra", [(None, 0), ("fused", 0), ("split", 1), ("ce", 1)])
def test_last_kernel_advances_the_state(mode, extra):
    """The proxy path and mode fused advance the device state in the collective's last
    kernel (no launch of its own); modes split and ce, whose kernels run on other streams
    too, queue sccl_advance. Either way the device's seq counts every collective."""
    world = 2
    with World("emu", "mesh", world, max_slice=1 << 16, direct=mode is not None,
               mode=mode) as w:
        names = []
        for dp in w.dps:
            launch = dp.launch

            def counted(stream, name, *a, launch=launch):
                names.append(name)
                launch(stream, name, *a)
            dp.launch = counted
        pend = []
        for k in range(3):
            xs = inputs(800 + k, world, (world * 64,), torch.float32)
            pend.append((check_rs, xs, w.reduce_scatter(xs)))
            ys = inputs(900 + k, world, (500,), torch.uint8)
            pend.append((check_ag, ys, w.all_gather(ys)))
        w.sync()
        for check, xs, outs in pend:
            check(w, xs, outs)
        names += [n for dp in w.dps for n in dp.gpu.emu_launched]  # (mode ce)
        assert names.count("sccl_advance") == extra * 6 * world, names
        assert [device_seq(w, r) for r in range(world)] == [6] * world


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
def test_seq_out_of_order_is_refused():
    """The GPU numbers collectives itself: a caller's seq that skips one is an error, not a
    silent mismatch between the host's labels and the device's slots."""
    with World("emu", "mesh", 2, max_slice=4096) as w:
        with w.be.on(0):
            src = w.keep(torch.zeros(64, dtype=torch.uint8))
            out = w.keep(torch.zeros(128, dtype=torch.uint8))
            with pytest.raises(ValueError, match="expected seq 0"):
                w.dps[0].all_gather(1, src, out, 0, 64)


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
def test_ring_full_waits_on_the_gpu():
    """More collectives queued than the publish ring holds (256 entries: 32 collectives)
    while rank 1's proxy is not running: GPU-direct, so rank 1's kernels go on without it
    until its ring is full, then its publish blocks wait on the GPU for the ring's tail
    (the host returned long before), and everything completes exactly once the proxy runs."""
    world, n_calls = 2, 40
    with World("emu", "mesh", world, max_slice=4096, timeout_s=60, direct=True, mode="fused",
               hold=(1,)) as w:
        pend = []
        for k in range(n_calls):
            xs = inputs(700 + k, world, (48,), torch.uint8)
            pend.append((xs, w.all_gather(xs)))
        tail = ctypes.c_uint64.from_address(w.ctl[1].addr + L.CTL_RING_TAIL)
        ring = np.frombuffer((ctypes.c_uint64 * (L.RING_ENTRIES * L.RING_ENTRY_BYTES // 8))
                             .from_address(w.ctl[1].addr + L.RING_OFFSET), dtype=np.uint64)
        tags = ring.reshape(L.RING_ENTRIES, -1)[:, L.ENT_TAG // 8]
        deadline = time.monotonic() + 30
        while (tags != 0).sum() < L.RING_ENTRIES and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert (tags != 0).sum() == L.RING_ENTRIES and tail.value == 0
        assert int(tags.max()) == L.RING_ENTRIES  # nothing was overwritten past the tail
        assert device_seq(w, 1) <= L.RING_ENTRIES // 8 + 1  # the GPU waits for the ring
        w.proxies[1].start()
        w.sync()
        for xs, outs in pend:
            check_ag(w, xs, outs)
        # The tail the GPU keeps (STATE_TAIL, to spare reads across PCIe): one it read,
        # so never past the proxy's; the collectives after the wait read a moving one.
        kept = int(w.dps[1].state[L.protocol_constants()["STATE_TAIL"]])
        assert 0 < kept <= tail.value, (kept, tail.value)
        w.healthy()


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
def test_ring_wait_times_out_on_the_gpu():
    """A ring that never frees (the device's ring index put 300 entries past the tail):
    the publish kernel's ring wait gives up after the timeout, on the GPU clock, and the
    host raises a CollectiveError that says so."""
    with World("emu", "mesh", 2, max_slice=4096, timeout_s=0.5) as w:
        w.dps[0].state[C.STATE_RING] = 300
        _lone_all_gathers(w, 64, 1, torch.uint8)
        with pytest.raises(CollectiveError, match="space in the publish ring"):
            w.dps[0].synchronize()
        assert N.abort_code(w.ctl[0].addr) == L.ABORT_TIMEOUT


# ---------------------------------------------------------------- through the Communicator

def _comm_job(rank, world, store, topology, slot_bytes):
    """The same collectives on a CUDA and a CPU communicator of the same ranks: both must
    equal the numpy reference (so the GPU results equal the CPU data plane's)."""
    import torch as T
    import torch.distributed as dist

    import sparkccl
    from sparkccl.reference import all_gather_reference as agr
    from sparkccl.reference import bits as B
    from sparkccl.reference import make_input as mk
    from sparkccl.reference import reduce_scatter_reference as rsr
    T.cuda.set_device(rank % T.cuda.device_count())
    W = world
    ag_cases = [((1,), T.uint8), ((1000,), T.uint8), ((W * 64, 33), T.bfloat16),
                ((777,), T.float16), ((4096, 64), T.bfloat16), ((3, 5), T.int64),
                ((3 << 19,), T.uint8), ((5,), T.float32)]
    rs_cases = [((W * 3, 5), T.bfloat16), ((W * 333, 4), T.float16),
                ((W * 1000, 65), T.float32), ((W * 1024, 64), T.bfloat16), ((W,), T.bfloat16)]
    bad = []
    kw = dict(rank=rank, world_size=W, topology=topology, slot_bytes=slot_bytes, timeout_s=60)
    with sparkccl.Communicator(store=dist.PrefixStore("gpu", store), device="cuda", **kw) as g, \
            sparkccl.Communicator(store=dist.PrefixStore("cpu", store), device="cpu", **kw) as c:
        seed = 0
        for shape, dtype in ag_cases:
            seed += 1
            xs = [mk(seed, r, shape, dtype) for r in range(W)]
            y = g.all_gather(xs[rank].cuda())
            assert y.is_cuda and y.shape == (W * shape[0], *shape[1:])
            yc = c.all_gather(xs[rank])
            got = B(y.cpu())
            if not (got == agr(xs)).all():
                bad.append(f"all_gather {list(shape)} {dtype}: differs from the reference")
            if not (got == B(yc)).all():
                bad.append(f"all_gather {list(shape)} {dtype}: GPU != CPU data plane")
        for shape, dtype in rs_cases:
            seed += 1
            xs = [mk(seed, r, shape, dtype) for r in range(W)]
            z = g.reduce_scatter(xs[rank].cuda())
            zc = c.reduce_scatter(xs[rank])
            got = B(z.cpu())
            if not (got == rsr(xs, rank)).all():
                bad.append(f"reduce_scatter {list(shape)} {dtype}: differs from the reference")
            if not (got == B(zc)).all():
                bad.append(f"reduce_scatter {list(shape)} {dtype}: GPU != CPU data plane")
        # Zero-copy input (the send slot itself, written on the GPU) and zero-copy output.
        seed += 1
        xs = [mk(seed, r, (W * 16, 64), T.bfloat16) for r in range(W)]
        buf = g.reduce_scatter_input((W * 16, 64), T.bfloat16)
        assert buf.is_cuda
        buf.copy_(xs[rank].cuda())
        if not (B(g.reduce_scatter(buf).cpu()) == rsr(xs, rank)).all():
            bad.append("zero-copy reduce_scatter input differs")
        seed += 1
        xs = [mk(seed, r, (256, 8), T.float32) for r in range(W)]
        v = g.all_gather(xs[rank].cuda(), zero_copy=True)
        g.synchronize()
        if not (B(v.cpu()) == agr(xs)).all():
            bad.append("zero-copy all_gather differs")
        g.synchronize()
    return bad


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
@pytest.mark.parametrize("topology,world,slot_bytes", [
    ("mesh", 2, 8 << 20), ("ring", 2, 8 << 20), ("mesh", 4, 8 << 20), ("ring", 4, 8 << 20),
    ("ring", 4, 256 << 10),  # a small slot: inputs are split into several collectives
    ("ring", 3, 8 << 20)])
def test_communicator_cuda(topology, world, slot_bytes):
    from sparkccl.localrun import check, run_ranks
    values = check(run_ranks(_comm_job, world, args=(topology, slot_bytes), timeout_s=600))
    bad = [f"rank {r}: {b}" for r, v in enumerate(values) for b in v]
    assert not bad, "\n".join(bad)


def _different_calls_job(rank, world, store, op, case):
    """Ranks passing sizes that pad alike or dtypes of one width through CUDA
    communicators: every rank raises CollectiveError naming both calls, at the latest at
    synchronize() (the CUDA plane compares with the peers' entries after launching)."""
    import torch as T

    import sparkccl
    T.cuda.set_device(rank % T.cuda.device_count())
    n, dtype = {"3v4-f32": ((3, 4), (T.float32, T.float32)),
                "5v6-bf16": ((5, 6), (T.bfloat16, T.bfloat16)),
                "bf16-f16": ((5, 5), (T.bfloat16, T.float16))}[case]
    comm = sparkccl.Communicator(store=store, rank=rank, world_size=world, device="cuda",
                                 timeout_s=10, slot_bytes=1 << 20)
    x = T.arange(1, n[rank] + 1, device="cuda").to(dtype[rank])
    try:
        if op == "ag":
            comm.all_gather(x)
        elif op == "rs":
            comm.reduce_scatter(T.cat([x] * world))
        else:
            comm.all_reduce(x, regime="two_step")
        comm.synchronize()
        return "no error"
    except sparkccl.CollectiveError as e:
        return str(e)
    finally:
        comm.__exit__(sparkccl.CollectiveError, None, None)


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
@pytest.mark.parametrize("op", ["ag", "rs", "ar"])
@pytest.mark.parametrize("case", ["3v4-f32", "5v6-bf16", "bf16-f16"])
def test_communicator_cuda_different_calls_fail_every_rank(op, case):
    from sparkccl.localrun import check, run_ranks
    values = check(run_ranks(_different_calls_job, 2, args=(op, case), timeout_s=120))
    for r, v in enumerate(values):
        assert "made a different call than" in v and "rank 0 passed" in v \
            and "rank 1 passed" in v, (r, v)


def _graph_comm_job(rank, world, store, topology, replays):
    """A torch.cuda.CUDAGraph of mixed collectives through the Communicator (all-gathers
    and reduce-scatters of several sizes and dtypes, a reduce_scatter_input buffer, a
    finalize), replayed with fresh inputs copied into the captured input tensors, eager
    calls between replays on the same stream: every output equals the reference."""
    import torch as T
    import torch.distributed as dist

    import sparkccl
    from sparkccl.reference import all_gather_reference as agr
    from sparkccl.reference import bits as B
    from sparkccl.reference import make_finalize_input as mkf
    from sparkccl.reference import make_input as mk
    from sparkccl.reference import moe_finalize_reference as mfr
    from sparkccl.reference import reduce_scatter_reference as rsr
    T.cuda.set_device(0)
    W = world
    specs = [("ag", (100,), T.uint8), ("rs", (W * 48,), T.float32), ("ag", (W * 64, 33), T.bfloat16),
             ("rs", (W * 333, 4), T.float16), ("ag", (777,), T.float16),
             ("rs", (W * 1024, 64), T.bfloat16), ("ag", (1 << 19,), T.bfloat16),
             ("rs", (W * (1 << 19),), T.bfloat16), ("ag", (5,), T.float32), ("rsi", (W * 16, 64), T.bfloat16)]
    Tn, Tp, H, topk = 8 * W - 3, 16 * W, 128, 4
    bad = []
    kw = dict(rank=rank, world_size=W, topology=topology, slot_bytes=8 << 20, timeout_s=60)
    with sparkccl.Communicator(store=dist.PrefixStore("graph", store), device="cuda", **kw) as g:
        xin = [T.zeros(shape, dtype=dtype, device="cuda") for _, shape, dtype in specs]
        f0 = mkf(0, rank, tokens=Tn, hidden=H, topk=topk, experts_rows=Tn + 5)
        fin = {k: v.cuda() for k, v in f0.items() if v is not None}

        def step():
            outs = []
            for (kind, shape, dtype), x in zip(specs, xin):
                if kind == "ag":
                    outs.append(g.all_gather(x))
                elif kind == "rs":
                    outs.append(g.reduce_scatter(x))
                else:  # in a capture: a plain tensor, copied as usual
                    buf = g.reduce_scatter_input(shape, dtype)
                    buf.copy_(x)
                    outs.append(g.reduce_scatter(buf))
            outs.append(g.moe_finalize_reduce_scatter(fin["y"], fin["pos"], fin["weights"],
                                                      fin["shared"], num_tokens=Tn, padded_tokens=Tp))
            return outs

        # Eager first (sets the reduce-scatter buffers up; torch's capture wants a warm-up).
        step()
        g.synchronize()
        graph = T.cuda.CUDAGraph()
        with T.cuda.graph(graph):
            outs = step()
        for it in range(replays):
            xs = [[mk(100 * it + k, r, shape, dtype) for r in range(W)]
                  for k, (_, shape, dtype) in enumerate(specs)]
            fs = [mkf(1000 + it, r, tokens=Tn, hidden=H, topk=topk, experts_rows=Tn + 5)
                  for r in range(W)]
            for x, v in zip(xin, xs):
                x.copy_(v[rank])
            for k in ("y", "pos", "weights", "shared"):
                fin[k].copy_(fs[rank][k])
            graph.replay()
            if it % 2 == 0:  # eager calls queued behind the replay, on the same stream
                ex = [mk(5000 + it, r, (W * 40, 3), T.float32) for r in range(W)]
                ey = [mk(6000 + it, r, (1000 + it,), T.uint8) for r in range(W)]
                ez = [mk(7000 + it, r, (256, 8), T.float32) for r in range(W)]
                eo = g.reduce_scatter(ex[rank].cuda())
                ea = g.all_gather(ey[rank].cuda())
                ev = g.all_gather(ez[rank].cuda(), zero_copy=True)  # a fresh tensor now
            g.synchronize()
            for k, (kind, shape, dtype) in enumerate(specs):
                ref = agr(xs[k]) if kind == "ag" else rsr(xs[k], rank)
                if not (B(outs[k].cpu()) == ref).all():
                    bad.append(f"replay {it}: {kind} {list(shape)} {dtype} differs")
            want = mfr(fs, rank, Tn, Tp)
            if not (B(outs[-1].cpu()).reshape(-1) == want.reshape(-1)).all():
                bad.append(f"replay {it}: finalize differs")
            if it % 2 == 0:
                if not (B(eo.cpu()) == rsr(ex, rank)).all():
                    bad.append(f"eager after replay {it}: reduce_scatter differs")
                if not (B(ea.cpu()) == agr(ey)).all() or not (B(ev.cpu()) == agr(ez)).all():
                    bad.append(f"eager after replay {it}: all_gather differs")
        g.synchronize()
    return bad


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
@pytest.mark.parametrize("env", [{}, {"SPARKCCL_GPU_DIRECT": "0"}, {"SPARKCCL_DIRECT_MODE": "ce"},
                                 {"SPARKCCL_DIRECT_MODE": "split"}],
                         ids=["direct", "proxy", "ce", "split"])
@pytest.mark.parametrize("topology,world", [("mesh", 2), ("ring", 3)])
def test_communicator_cuda_graph(topology, world, env):
    from sparkccl.localrun import check, run_ranks
    values = check(run_ranks(_graph_comm_job, world, args=(topology, 20), env=env,
                             timeout_s=300))
    bad = [f"rank {r}: {b}" for r, v in enumerate(values) for b in v]
    assert not bad, "\n".join(bad)


def test_cpu_communicator_rejects_unknown_device():
    import sparkccl
    with pytest.raises(ValueError, match="cpu"):
        sparkccl.Communicator(store=None, rank=0, world_size=1, device="meta")


@pytest.mark.skipif(HAVE_GPU, reason="checks the error on machines without a GPU")
def test_cuda_communicator_without_gpu_is_a_clear_error():
    import sparkccl
    with pytest.raises(RuntimeError, match="torch.cuda.is_available"):
        sparkccl.Communicator(store=None, rank=0, world_size=1, device="cuda")


# ---------------------------------------------------------------- fail-stop and poison
# (docs/CONTRACT.md "Failure behaviour"; the multi-process GPU runs are tests/test_failstop.py)

def _lone_all_gathers(w: World, n: int, count: int, dtype=torch.float32):
    """Rank 0 alone issues `count` all-gathers (rank 1 never calls): every one fails."""
    xs = inputs(1, w.world, (n,), dtype)
    nbytes = n * xs[0].element_size()
    seq = w.seq
    w.seq += count
    outs = []
    with w.be.on(0):
        src = w.keep(w.be.to_dev(xs[0]).view(torch.uint8))
        for k in range(count):
            out = w.keep(w.be.to_dev(torch.full((w.world * nbytes,), 0xAB, dtype=torch.uint8)))
            w.dps[0].all_gather(seq + k, src, out, 0, nbytes)
            outs.append(out)
    return seq, outs


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
@pytest.mark.parametrize("mode", WAIT_MODES)
def test_fail_stop_reports_then_traps(mode, capfd):
    """Mode stop: the failed wait's record is printed on stderr by the watchdog as the
    CollectiveError text, acknowledged, and only then the kernel traps: the emulated context
    is lost (nothing queued after it runs, every synchronization raises a CUDA error), and
    synchronize() raises the CollectiveError itself."""
    with World("emu", "mesh", 2, max_slice=4096, timeout_s=0.5, direct=mode is not None,
               mode=mode, on_failure="stop") as w:
        dp = w.dps[0]
        report = dp.monitor._report_gpu_failure  # the watchdog looks it up when the record appears

        def timed_report():  # (it acks last: the kernel may trap before this returns)
            dp.reported_at = time.monotonic()
            report()
        dp.monitor._report_gpu_failure = timed_report
        seq, outs = _lone_all_gathers(w, 25, 3)
        with pytest.raises(CollectiveError) as ei:
            dp.synchronize()
        msg = str(ei.value)
        assert f"timed out after 0.5 s waiting for all_gather seq {seq} piece 0 from rank 1" in msg
        assert "unspecified launch failure" in str(ei.value.__cause__)
        assert w.be.streams[0].ctx.trapped  # the kernel trapped ...
        assert ctypes.c_uint64.from_address(w.ctl[0].addr + C.CTL_GPU_ACK).value == 1  # ... acked
        assert dp.reported_at <= w.be.streams[0].ctx.trapped_at  # ... once the report began
        err = capfd.readouterr().err
        assert f"sparkccl: CollectiveError: rank 0: timed out after 0.5 s waiting for all_gather " \
               f"seq {seq} piece 0 from rank 1 (connection: channel 0 root" in err, err
        assert "restart the process" in err
        assert dp.monitor.failure_report and dp.monitor.failure_report in err
        # The abort word is set by the watchdog, so the peers learn of it at once.
        assert N.abort_code(w.ctl[0].addr) == L.ABORT_TIMEOUT
        with pytest.raises(RuntimeError, match="unspecified launch failure"):
            w.be.streams[0].synchronize()
        # Nothing after the trap ran: the later results keep their fill bytes.
        assert all(bytes(o.numpy()) == b"\xab" * o.numel() for o in outs[1:])
        with pytest.raises(CollectiveError):  # and every later call raises
            with w.be.on(0):
                w.dps[0].all_gather(seq + 3, w.keep(torch.zeros(8, dtype=torch.uint8)),
                                    w.keep(torch.zeros(16, dtype=torch.uint8)), 0, 8)


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
def test_fail_stop_says_so_when_the_trap_does_not_stop_the_gpu(capfd):
    """A trap the driver never acts on (seen with several processes time-slicing one GPU
    without MPS: two ranks trapped at once and both stayed halted past the trap, their
    host threads waiting in cuStreamSynchronize forever) is not a silent hang: once the
    GPU is still busy trap_grace_s after the ack, the watchdog says on stderr that the
    process is wedged and must be killed. A trap that works says nothing more."""
    with World("emu", "mesh", 2, max_slice=4096, timeout_s=0.3, on_failure="stop") as w:
        dp = w.dps[0]
        dp.monitor.trap_grace_s = 0.4
        busy = dp.monitor.busy
        dp.monitor.busy = lambda: True  # the emulated GPU "never stops" after the trap
        try:
            _lone_all_gathers(w, 25, 2)
            deadline = time.monotonic() + 10
            while not dp.monitor.trap_wedged and time.monotonic() < deadline:
                time.sleep(0.05)
            assert dp.monitor.trap_wedged
        finally:
            dp.monitor.busy = busy
        err = capfd.readouterr().err
        assert "sparkccl: CollectiveError: rank 0: timed out after 0.3 s" in err, err
        assert ("sparkccl: rank 0: the GPU did not stop within 0.4 s of the fail-stop trap"
                in err), err
        assert "kill the process" in err and "MPS" in err
        with pytest.raises(CollectiveError):
            dp.synchronize()
    with World("emu", "mesh", 2, max_slice=4096, timeout_s=0.3, on_failure="stop") as w:
        dp = w.dps[0]
        dp.monitor.trap_grace_s = 0.4
        _lone_all_gathers(w, 25, 1)
        with pytest.raises(CollectiveError):
            dp.synchronize()
        time.sleep(0.8)
        assert not dp.monitor.trap_wedged
        assert "did not stop" not in capfd.readouterr().err


def _ack(w: World, r: int) -> int:
    return ctypes.c_uint64.from_address(w.ctl[r].addr + C.CTL_GPU_ACK).value


def _record_goes(dp, goes: list) -> None:
    """Record (rank, time, ack word before) whenever dp's watchdog gives the kernel its GO."""
    give = dp.monitor._give_go

    def give_go():
        goes.append((dp.rank, time.monotonic(), ctypes.c_uint64.from_address(
            dp.ctl + C.CTL_GPU_ACK).value))
        give()
    dp.monitor._give_go = give_go


def _failing_all_gathers(w: World, ranks, n: int = 25):
    """One all-gather on each of `ranks` (the others never call: every one fails)."""
    xs = inputs(1, w.world, (n,), torch.float32)
    nbytes = n * xs[0].element_size()
    seq = w.seq
    w.seq += 1
    for r in ranks:
        with w.be.on(r):
            src = w.keep(w.be.to_dev(xs[r]).view(torch.uint8))
            out = w.keep(w.be.to_dev(torch.zeros(w.world * nbytes, dtype=torch.uint8)))
            w.dps[r].all_gather(seq, src, out, 0, nbytes)
    return seq


def _wait_for(cond, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
def test_fail_stop_holds_the_trap_until_the_gpus_trap_lock_is_free(capfd):
    """Mode stop: after the report the watchdog writes ACK_HOLD; the kernel, held, waits
    past ACK_WAIT_NS (the trap lock is taken by "another process" here for longer than
    that) and traps only after the watchdog took the lock and wrote ACK_GO; the lock is
    free again once the context is lost. The host's bound counts from the GO meanwhile:
    synchronize() raises the CollectiveError, not "the GPU is stuck"."""
    other = M.TrapLock(EMU_TRAP_LOCK)
    assert other.try_acquire()
    hold_s = C._P["ACK_WAIT_NS"] / 1e9 + 1.0
    with World("emu", "mesh", 2, max_slice=4096, timeout_s=0.3, on_failure="stop") as w:
        dp = w.dps[0]
        goes = []
        _record_goes(dp, goes)
        try:
            seq = _failing_all_gathers(w, [0])
            assert _wait_for(lambda: dp.monitor.trap_held_at is not None)
            assert _ack(w, 0) == M.ACK_HOLD
            time.sleep(hold_s)
            assert not w.be.streams[0].ctx.trapped  # still held, past ACK_WAIT_NS
            assert not goes
        finally:
            other.release()
        with pytest.raises(CollectiveError, match=f"all_gather seq {seq} piece 0 from rank 1"):
            dp.synchronize()
        ctx = w.be.streams[0].ctx
        assert ctx.trapped and not dp.monitor.stuck
        assert len(goes) == 1 and goes[0][2] == M.ACK_HOLD  # GO after HOLD, once
        assert goes[0][1] >= dp.monitor.trap_held_at + hold_s
        assert ctx.trapped_at >= goes[0][1]  # the trap came after the GO
        assert _ack(w, 0) == M.ACK_GO
        assert _wait_for(lambda: not dp.monitor._thread.is_alive())
        assert other.try_acquire()  # the watchdog let the lock go
        other.release()
        err = capfd.readouterr().err
        assert f"sparkccl: CollectiveError: rank 0: timed out after 0.3 s waiting for all_gather " \
               f"seq {seq} piece 0 from rank 1" in err, err
        assert "without the GPU's trap lock" not in err


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
def test_fail_stop_traps_of_ranks_sharing_a_gpu_come_one_at_a_time(capfd):
    """Two emulated processes "on one GPU" (one trap lock) fail (world 3, rank 2 never
    calls) while a third holds the lock, so both are held at once; once it is free, one
    takes it, gives its GO and traps, and the other's GO comes only after that context was
    lost (and TRAP_SETTLE_S more); both trap."""
    other = M.TrapLock(EMU_TRAP_LOCK)
    assert other.try_acquire()
    with World("emu", "mesh", 3, max_slice=4096, timeout_s=0.3, on_failure="stop") as w:
        goes = []
        try:
            for r in (0, 1):
                _record_goes(w.dps[r], goes)
            _failing_all_gathers(w, [0, 1])
            assert _wait_for(lambda: all(w.dps[r].monitor.trap_held_at for r in (0, 1)))
            time.sleep(0.1)
            assert not goes
        finally:
            free_at = time.monotonic()
            other.release()
        for r in (0, 1):
            with pytest.raises(CollectiveError):
                w.dps[r].synchronize()
        assert _wait_for(lambda: len(goes) == 2), goes
        (first, t_first, ack_first), (second, t_second, ack_second) = sorted(goes, key=lambda g: g[1])
        assert ack_first == ack_second == M.ACK_HOLD
        assert t_first >= free_at
        ctx = [w.be.streams[r].ctx for r in range(3)]
        assert ctx[0].trapped and ctx[1].trapped
        assert t_first <= ctx[first].trapped_at <= t_second, (goes, ctx[first].trapped_at)
        assert t_second >= t_first + M.TRAP_SETTLE_S
        assert ctx[second].trapped_at >= t_second
        err = capfd.readouterr().err
        for r in (0, 1):
            assert f"sparkccl: CollectiveError: rank {r}:" in err, err
            assert (f"sparkccl: rank {r}: fail-stop: trapping after " in err
                    and "waiting for the GPU's trap lock" in err), err
        assert "without the GPU's trap lock" not in err


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
def test_fail_stop_traps_anyway_when_the_trap_lock_is_not_free_in_time(capfd):
    """The watchdog tries the trap lock for trap_lock_wait_s at most: past that it writes
    ACK_GO anyway and says so; the kernel traps, and synchronize() raises."""
    other = M.TrapLock(EMU_TRAP_LOCK)
    assert other.try_acquire()  # held by "another process" throughout
    try:
        with World("emu", "mesh", 2, max_slice=4096, timeout_s=0.3, on_failure="stop") as w:
            dp = w.dps[0]
            dp.monitor.trap_lock_wait_s = 0.4
            goes = []
            _record_goes(dp, goes)
            _failing_all_gathers(w, [0])
            with pytest.raises(CollectiveError, match="from rank 1"):
                dp.synchronize()
            assert w.be.streams[0].ctx.trapped
            assert len(goes) == 1 and goes[0][1] >= dp.monitor.trap_held_at + 0.4
            err = capfd.readouterr().err
            assert (f"sparkccl: rank 0: fail-stop: trapping without the GPU's trap lock "
                    f"{EMU_TRAP_LOCK}: another process of this GPU held it for 0.4 s") in err, err
    finally:
        other.release()
    # A lock file that cannot be opened: GO at once, said too.
    with World("emu", "mesh", 2, max_slice=4096, timeout_s=0.3, on_failure="stop") as w:
        dp = w.dps[0]
        dp.monitor.trap_lock_path = "/nonexistent-dir/sparkccl-trap.lock"
        _failing_all_gathers(w, [0])
        with pytest.raises(CollectiveError, match="from rank 1"):
            dp.synchronize()
        assert w.be.streams[0].ctx.trapped
        err = capfd.readouterr().err
        assert "trapping without the GPU's trap lock /nonexistent-dir/sparkccl-trap.lock: " \
               "it cannot be used" in err, err


def _lose_context_before_any_report(w: World, r: int):
    """Rank r's stream is busy with work of its own (the collective queued behind it never
    runs) when its context is lost from outside: as under MPS, where another process's
    trap ends every client's context. Returns the blocker to release."""
    stream = w.be.streams[r]
    blocker = threading.Event()
    stream.put(lambda: blocker.wait(30))
    _failing_all_gathers(w, [r])
    stream.ctx.trapped, stream.ctx.trapped_at = "another process (MPS)", time.monotonic()
    return blocker


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
def test_fail_stop_explains_a_context_lost_before_the_report(capfd):
    """The context is lost before this rank's GPU wait recorded anything: the watchdog
    prints a CollectiveError line with the cause the host knows (here the proxy's abort
    word), saying the context was lost; synchronize() raises that CollectiveError from the
    CUDA error."""
    with World("emu", "mesh", 2, max_slice=4096, timeout_s=30, on_failure="stop") as w:
        dp = w.dps[0]
        blocker = _lose_context_before_any_report(w, 0)
        try:
            time.sleep(0.1)
            assert "sparkccl" not in capfd.readouterr().err  # nothing known yet: nothing said
            N.set_abort(w.ctl[0].addr, L.ABORT_PEER, "rank 0: peer 1 (pid 4242) exited")
            assert _wait_for(lambda: dp.monitor.failure_report is not None)
            err = capfd.readouterr().err
            assert ("sparkccl: CollectiveError: rank 0: communicator aborted: rank 0: peer 1 "
                    "(pid 4242) exited; the CUDA context of this process was lost before this "
                    "rank's GPU wait reported anything") in err, err
            assert "MPS" in err and "restart the process" in err
            assert not dp.monitor.gpu_record()[0]  # no GPU record: the host's cause
        finally:
            blocker.set()
        with pytest.raises(CollectiveError, match=r"peer 1 \(pid 4242\) exited") as ei:
            dp.synchronize()
        assert "emulated device trap" in str(ei.value.__cause__)


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
def test_fail_stop_says_when_a_lost_context_has_no_known_cause(capfd):
    """A context lost while the host knows no failure of the communicator: nothing is
    invented -- when the data plane closes, its watchdog says the context was lost and that
    no failure is known (not a CollectiveError), and synchronize() raises the CUDA error."""
    with World("emu", "mesh", 2, max_slice=4096, timeout_s=30, on_failure="stop") as w:
        dp = w.dps[0]
        blocker = _lose_context_before_any_report(w, 0)
        blocker.set()
        with pytest.raises(RuntimeError, match="emulated device trap") as ei:
            dp.synchronize()
        assert not isinstance(ei.value, CollectiveError)
        dp.monitor.stop()
        err = capfd.readouterr().err
        assert ("sparkccl: rank 0: the CUDA context of this process was lost before this rank's "
                "GPU wait reported anything") in err, err
        assert "no failure of this communicator is known to the host" in err
        assert "CollectiveError" not in err


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
@pytest.mark.parametrize("mode", WAIT_MODES)
def test_poison_overwrites_every_output_after_a_failure(mode, capfd):
    """Mode poison: no trap; a healthy collective before the failure keeps its exact result,
    the failed one and every one queued after it read 0xFF bytes (NaN) only, nothing is
    printed, and every later call raises."""
    world = 2
    with World("emu", "mesh", world, max_slice=4096, timeout_s=0.5, direct=mode is not None,
               mode=mode, on_failure="poison") as w:
        xs = inputs(3, world, (40,), torch.float32)
        good = w.all_gather(xs)
        w.sync()
        check_ag(w, xs, good)
        seq, outs = _lone_all_gathers(w, 25, 3)
        # A reduce-scatter queued behind them is poisoned too.
        rs_x = inputs(4, world, (world * 16,), torch.float32)[0]
        with w.be.on(0):
            rs_out = w.keep(w.be.to_dev(torch.zeros(64, dtype=torch.uint8)))
            w.dps[0].reduce_scatter(seq + 3, w.keep(rs_x.view(torch.uint8).clone()), 0, 64, 64,
                                    rs_out, 0, torch.float32)
        w.seq += 1
        with pytest.raises(CollectiveError, match=f"all_gather seq {seq} piece 0 from rank 1"):
            w.dps[0].synchronize()
        w.be.streams[0].synchronize()  # no trap: the stream still works
        assert not w.be.streams[0].ctx.trapped
        for o in outs + [rs_out]:
            assert bytes(o.numpy()) == b"\xff" * o.numel()
            assert torch.isnan(o.view(torch.float32)).all()
        check_ag(w, xs, good)  # the earlier result was not touched
        assert "sparkccl: CollectiveError" not in capfd.readouterr().err
        with pytest.raises(CollectiveError):
            with w.be.on(0):
                w.dps[0].all_gather(seq + 4, w.keep(torch.zeros(8, dtype=torch.uint8)),
                                    w.keep(torch.zeros(16, dtype=torch.uint8)), 0, 8)


@pytest.mark.parametrize("backend,on_failure", [
    pytest.param("emu", "stop", marks=pytest.mark.skipif(CXX is None, reason="needs g++")),
    pytest.param("emu", "poison", marks=pytest.mark.skipif(CXX is None, reason="needs g++")),
    # (mode stop would trap this process's CUDA context: the emulation checks it)
    pytest.param("cuda", "poison", marks=cuda_only)])
@pytest.mark.parametrize("sync", ["caller", "comm"])
def test_stream_value_waits_are_released_after_a_failure(backend, on_failure, sync):
    """Mode ce: the caller's stream waits (cuStreamWaitValue64) for the progress word that
    sccl_wait_piece relays; such a wait has no timeout and does not watch the abort word.
    When the kernels that would end it never run (dropped here; on a GPU: not scheduled),
    a survivor's next synchronization still ends within STOP_GRACE_S + RELEASE_GRACE_S of
    the failure: the caller's own stream synchronization (the watchdog releases the waits)
    or the data plane's synchronize() (which then raises CollectiveError); and nothing
    queued after the collective reads its output as valid: mode stop traps first
    (sccl_fail_guard, with the report printed), mode poison overwrites it. On the GPU this
    also shows that the host's release (a copy on a stream of its own) gets past the
    blocked stream. (Mode poison runs "ce" as "fused", engine_choice.Engines.choose: there the
    same bounds hold for the kernel's own wait.)"""
    world, n = 2, 64
    with World(backend, "mesh", world, max_slice=4096, timeout_s=60, direct=True, mode="ce",
               on_failure=on_failure) as w:
        dp = w.dps[0]
        dp.gpu.emu_skip = {"sccl_wait_piece"}
        seq, outs = _lone_all_gathers(w, n, 1)  # rank 1 never calls: it died
        stream = w.be.streams[0]
        seen = []
        if backend == "emu":  # the caller's next work on the stream
            stream.put(lambda: seen.append(bytes(outs[0].numpy())))
        else:
            with w.be.on(0):
                after = w.keep(outs[0].clone())
        time.sleep(0.2)
        assert not seen  # the stream is held by its value waits
        # What the proxy's watch does when a peer's process is gone.
        N.set_abort(w.ctl[0].addr, L.ABORT_PEER, "rank 0: peer 1 (pid 4242) exited")
        t0 = time.monotonic()
        result = {}

        def wait():
            try:
                (stream.synchronize if sync == "caller" else dp.synchronize)()
            except BaseException as e:  # noqa: BLE001 - checked below
                result["error"] = e
        t = threading.Thread(target=wait, daemon=True)
        t.start()
        t.join(20)
        elapsed = time.monotonic() - t0
        assert not t.is_alive(), "the synchronization blocked on stream waits nobody releases"
        assert elapsed < M.STOP_GRACE_S + M.RELEASE_GRACE_S + 1.0, elapsed
        err = result.get("error")
        if sync == "caller" and on_failure == "poison":
            assert err is None, err  # the stream ran on: the poison kernel, then our read
        elif sync == "caller":
            assert "unspecified launch failure" in str(err), err
        if sync == "comm" or on_failure == "poison":
            with pytest.raises(CollectiveError, match=r"peer 1 \(pid 4242\) exited"):
                dp.synchronize()
        assert not dp.monitor.stuck, err  # the release got the stream going: not stuck
        if on_failure == "stop":
            assert stream.ctx.trapped == "sccl_fail_guard", (err, elapsed, stream.errors)
            time.sleep(0.1)
            assert seen == []  # the lost context ran nothing after the guard
            assert dp.monitor.failure_report and "peer 1 (pid 4242) exited" in dp.monitor.failure_report
        else:
            stream.synchronize()
            got = seen[0] if backend == "emu" else bytes(after.cpu().numpy())
            assert got == b"\xff" * (world * 4 * n)  # poisoned before anything read it


def test_failure_mode_is_a_setting(monkeypatch):
    monkeypatch.setenv("SPARKCCL_ON_FAILURE", "later")
    with pytest.raises(ConfigError, match="SPARKCCL_ON_FAILURE"):
        C.CudaDataPlane(N, plan=None, ctl_addr=0, flags_addr=0, ag=None, ag_stride=0,
                        timeout_s=1)
    with pytest.raises(ConfigError, match="on_failure"):
        C.CudaDataPlane(N, plan=None, ctl_addr=0, flags_addr=0, ag=None, ag_stride=0,
                        timeout_s=1, on_failure="ignore")


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
@pytest.mark.parametrize("mode", [None, "fused"])
def test_poison_covers_a_zero_copy_result(mode):
    """A zero-copy all-gather's result is its slot: poisoned there (every rank's block)."""
    world = 2
    with World("emu", "mesh", world, max_slice=4096, timeout_s=0.3, direct=mode is not None,
               mode=mode, on_failure="poison") as w:
        n = 100
        seq = w.seq
        w.seq += 1
        with w.be.on(0):
            src = w.keep(torch.arange(n, dtype=torch.uint8))
            w.dps[0].all_gather(seq, src, None, 0, 0)
        with pytest.raises(CollectiveError, match="from rank 1"):
            w.dps[0].synchronize()
        S = G.round_up(n, G.ALIGN)
        slot = w.dps[0].ag_slot(seq, world * S)
        for i in range(world):
            assert bytes(slot[i * S:i * S + n].numpy()) == b"\xff" * n


# ---------------------------------------------------------------- launch plans (eager fast path)

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", [None, "fused", "split", "ce"])
@pytest.mark.parametrize("topology,world,roots", [("mesh", 2, 2), ("ring", 3, 2)])
def test_launch_plans_replay_with_the_calls_pointers(backend, mode, topology, world, roots):
    """The first call of a shape plans it; later calls of that shape replay its launch plan
    with their own pointers (every call writes a fresh output buffer and reads a fresh
    input: a parameter left at the first call's pointer would read or write the old ones),
    through every slot (seq % 3, seq % 2) more than twice. Another dtype of the same bytes,
    or another size, is another plan; new tables (peers mapped again) drop the plans.
    Mode ce's plan is its program, issued with each call's seq, slots and pointers. Mode
    split (host-side stream joins) and zero-copy results never plan. Every output equals
    the rank-order reference bit for bit."""
    planned = mode in (None, "fused", "ce")
    with World(backend, topology, world, roots, max_slice=1 << 14, direct=mode is not None,
               mode=mode) as w:
        pending = []
        for k in range(7):
            xs = inputs(700 + k, world, (1000,), torch.uint8)
            pending.append((check_ag, xs, w.all_gather(xs)))
            rs = inputs(720 + k, world, (world * 64,), torch.bfloat16)
            pending.append((check_rs, rs, w.reduce_scatter(rs)))
            if k in (2, 5):  # other shapes in between: the plans stay apart
                ys = inputs(740 + k, world, (1001,), torch.uint8)
                pending.append((check_ag, ys, w.all_gather(ys)))
                fs = inputs(760 + k, world, (world * 32,), torch.float32)  # bf16's bytes
                pending.append((check_rs, fs, w.reduce_scatter(fs)))
        zs = inputs(780, world, (64,), torch.float32)
        zero = w.all_gather(zs, zero_copy=True)
        w.sync()
        for check, xs, outs in pending:
            check(w, xs, outs)
        for r, (seq, n) in enumerate(zero):
            got = w.dps[r].ag_slot(seq, world * 256).cpu().view(torch.float32)
            assert torch.equal(got, torch.cat(zs)), f"zero-copy all_gather rank {r}"
        for dp in w.dps:
            st = dp.plans.stats
            if planned:  # 4 shapes planned (the zero-copy result is not): 14 + 4 - 4 hits
                assert (st["misses"], st["hits"], len(dp.plans.plans)) == (4, 14, 4), st
            else:
                assert st["hits"] == 0 and not dp.plans.plans, st
        if mode in ("fused", "ce"):
            for dp in w.dps:
                dp._build_direct(Op.AG)  # (what map_peers does): the tables are new
                assert not dp.plans.plans and dp.plans.stats["invalidations"] == 1
            xs = inputs(790, world, (1000,), torch.uint8)
            outs = w.all_gather(xs)
            w.sync()
            check_ag(w, xs, outs)
            assert all(dp.plans.stats["misses"] == 5 for dp in w.dps)
        w.healthy()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct", [False, True], ids=["proxy", "fused"])
@pytest.mark.parametrize("sizes", [(3, 4, 4, 4), (3, 3, 4, 4)], ids=["rank0", "halves"])
def test_a_different_call_in_a_ring_is_reported_on_every_rank(backend, direct, sizes):
    """A ring of 4: every rank compares each source's call entry, also one that came through
    a relay (GPU-direct: the relay waits for the origin's entry, which the origin's proxy
    sends after its GPU wrote the flag), and raises at synchronize()."""
    from sparkccl.dataplane.peer_check import calls_view
    world = 4
    with World(backend, "ring", world, max_slice=4096, timeout_s=20, direct=direct) as w:
        for r in range(world):
            w.dps[r].peer_calls = calls_view(w.ctl[r].t, num_flag_words(world))
        for r, n in enumerate(sizes):
            with w.be.on(r):
                src = w.keep(w.be.to_dev(torch.zeros(n, dtype=torch.float32)))
                out = w.keep(w.be.to_dev(torch.zeros(world * 4 * n, dtype=torch.uint8)))
                w.dps[r].all_gather(0, src, out, 0, 4 * n)
        w.be.sync()
        for r in range(world):
            with pytest.raises(CollectiveError, match=r"bytes of float32 per rank to all_gather"):
                w.dps[r].synchronize()


def test_size_check_compares_entries_of_their_seq_only():
    """The deferred check (peer_check.PeerCheck.run) reads each pending collective's call
    entry of each source, oldest first: a matching entry is checked off; one not written
    yet (an older seq's tag in the slot) stays pending, and so do that source's later ones,
    unasked; one a later seq of the same slot replaced is dropped unread (its size beside
    another seq's must not be reported as a mismatch)."""
    from sparkccl.dataplane.peer_check import PeerCheck
    world = 2
    calls = np.zeros(world * L.CALL_SLOTS * L.CALL_ENTRY_WORDS, dtype=np.uint64)
    failed = []
    pc = PeerCheck(0, world, memoryview(calls).cast("B").cast("Q"),
                   lambda message, peer: failed.append(message))
    word = L.call_word(int(Op.AG), 1, 1, 0)

    def entry(seq, S):
        tag = (seq + 1) & L.CALL_TAG_MASK
        at = (1 * L.CALL_SLOTS + seq % L.CALL_SLOTS) * L.CALL_ENTRY_WORDS
        calls[at + L.CALL_TAGGED] = (word & ~(0xFF | 0xFF << L.CALL_PIECE_SHIFT)) \
            | (tag & 0xFF) | (tag >> 8) << L.CALL_PIECE_SHIFT
        calls[at + L.CALL_SLICE] = S | tag << L.CALL_SLICE_TAG_SHIFT

    entry(400 + L.CALL_SLOTS, 999)  # seq 400's slot holds a later seq's entry: gone
    entry(497, 64)
    entry(498 - L.CALL_SLOTS, 128)  # seq 498's entry not written yet: the previous lap's
    for seq, S in ((400, 64), (497, 64), (498, 128), (499, 64)):
        pc.note(Op.AG, seq, S, word)
    pc.run()
    assert [u[1] for u in pc.pending] == [498, 499] and failed == []
    entry(498, 128)
    entry(499, 64)
    pc.run()
    assert pc.pending == [] and failed == []
    entry(500, 80)
    pc.note(Op.AG, 500, 64, word)
    pc.run()
    assert len(failed) == 1 and "rank 1 passed 80 bytes" in failed[0], failed


def test_checks_before_a_call_read_the_words_and_compare_sizes_every_few_calls():
    """Before each collective: the GPU record and the abort word (read in place; the
    raising checks run only once one is set), and the sizes every SIZE_CHECK_CALLS-th
    call (each comparison reads rows the peers' GPUs write)."""
    dp = object.__new__(C.CudaDataPlane)
    dp._ctl_words = [0] * (L.CTL_BYTES // 8)
    calls = []
    dp.check_sizes = lambda: calls.append(("sizes", dp._seq_next))
    dp.check_status = lambda: calls.append(("status", dp._seq_next))
    dp.check_abort = lambda: calls.append(("abort", dp._seq_next))
    K = C.SIZE_CHECK_CALLS
    for seq in range(1, 2 * K + 1):
        dp._seq_next = seq
        dp._check_call()
    assert calls == [("sizes", K), ("sizes", 2 * K)]
    calls.clear()
    dp._seq_next = 2 * K + 1
    for word in (L.CTL_ABORT, L.CTL_GPU_STATUS):
        dp._ctl_words[word // 8] = 7
        dp._check_call()
        assert calls == [("status", 2 * K + 1), ("abort", 2 * K + 1)], word
        dp._ctl_words[word // 8] = 0
        calls.clear()


@pytest.mark.skipif(CXX is None, reason="needs g++ to build the CPU emulation of the kernels")
@pytest.mark.parametrize("direct", [False, True], ids=["proxy", "fused"])
def test_a_failed_plane_publishes_nothing_more(direct):
    """Mode poison: collectives queued after a failure still run, but skip their waits; if
    they also published, a peer still reading a slot of an earlier collective would find it
    rewritten under flags that say it is complete (seen on the H200: a survivor's
    reduce-scatter, its waits passed, 75% of its bytes wrong, not poisoned). So once a wait
    of the data plane failed, its later collectives write nothing to the peers (GPU-direct)
    and nothing to its send slots or ring (the proxy path): the peer's flag words never show
    a seq after the failed one."""
    with World("emu", "mesh", 2, max_slice=4096, timeout_s=30, direct=direct,
               on_failure="poison") as w:
        xs = inputs(5, 2, (256,), torch.uint8)
        check = [w.all_gather(xs)]
        w.sync()
        check_ag(w, xs, check[0])
        seq, outs = _lone_all_gathers(w, 64, 4)  # rank 1 never calls: the first one waits
        time.sleep(0.1)
        N.set_abort(w.ctl[0].addr, L.ABORT_PEER, "rank 0: peer 1 (pid 4242) exited")
        with pytest.raises(CollectiveError):
            w.dps[0].synchronize()
        w.be.streams[0].synchronize()
        flags = np.frombuffer((ctypes.c_uint64 * num_flag_words(2)).from_address(
            w.ctl[1].addr + L.FLAGS_OFFSET), dtype=np.uint64)
        assert int(flags.max()) // G.FLAG_STRIDE <= seq, (flags, seq)
        ring = np.frombuffer((ctypes.c_uint64 * (L.RING_ENTRIES * L.RING_ENTRY_BYTES // 8))
                             .from_address(w.ctl[0].addr + L.RING_OFFSET), dtype=np.uint64)
        seqs = ring.reshape(L.RING_ENTRIES, -1)[:, L.ENT_SEQ // 8]
        tags = ring.reshape(L.RING_ENTRIES, -1)[:, L.ENT_TAG // 8]
        assert int(seqs[tags != 0].max()) <= seq  # no entry of a later collective either
        for out in outs:  # and every output of the failed plane is poisoned
            assert (out.numpy() == 0xFF).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_publish_stamps_reach_the_proxys_figures(backend, monkeypatch):
    """SPARKCCL_GPU_STAMPS: the data plane calibrates the GPU clock against the proxy's
    (CLOCK_MONOTONIC) and the publish kernels stamp each ring entry, so the proxy measures
    publish -> first post per piece on the proxy path, as it does for the CPU data plane.
    Off by default: no stamps, no calibration."""
    world = 2
    with World(backend, "mesh", world, max_slice=4096) as w:
        assert all(dp.clock_offset_ns is None for dp in w.dps)
        for n in (100, 4096):
            check_ag(w, *_ag_round(w, n))
        assert w.proxies[0].stats()["publish_samples"] == 0
    monkeypatch.setenv("SPARKCCL_GPU_STAMPS", "1")
    with World(backend, "mesh", world, max_slice=4096) as w:
        for dp in w.dps:
            assert dp.clock_offset_ns is not None and 0 <= dp.clock_error_ns < 50_000_000
        for n in (100, 4096):
            check_ag(w, *_ag_round(w, n))
        w.healthy()
        st = w.proxies[0].stats()
        # Stamps of both collectives reached the proxy. Not one sample per piece: a stamp
        # ahead of the proxy's clock (within the calibration's error, milliseconds on a
        # loaded 2-core machine) gives none, and the proxy posts a one-hand-off slice's
        # pieces at once, right after their entries (docs/PROTOCOL.md "Streams").
        assert st["publish_samples"] >= 2, st
        assert 0 < st["publish_p50_ns"] <= st["publish_p99_ns"] < 10 * 10**9, st


def _ag_round(w, n: int):
    xs = inputs(n, w.world, (n,), torch.uint8)
    outs = w.all_gather(xs)
    w.sync()
    return xs, outs
