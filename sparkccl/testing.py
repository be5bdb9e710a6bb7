"""Run a function on W local ranks (processes), each with a shared torch Store.

Used by the tests and by ``sparkccl demo``::

    from sparkccl.testing import run_ranks

    def job(rank, world, store, size):
        with sparkccl.Communicator(store=store, rank=rank, world_size=world) as comm:
            return comm.all_gather(torch.full((size,), rank)).tolist()

    results = run_ranks(job, world=4, args=(8,))     # list of RankResult, in rank order
    values = [r.value for r in results]              # raises if any rank failed: check()

``fn`` must be importable by a fresh interpreter (a module-level function): ranks are
started with the ``spawn`` method. The store is a ``TCPStore`` served by the calling
process, so a rank that dies does not take the store down. Each rank runs with one torch
thread (the ranks share the host's cores).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import signal
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

KILLED = "killed"


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error: BaseException | None = None
    error_type: str | None = None  # class name, also when the exception could not be pickled
    message: str | None = None
    traceback: str | None = None
    exitcode: int | None = None
    elapsed_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error_type is None and self.exitcode == 0

    @property
    def killed(self) -> bool:
        return self.exitcode is not None and self.exitcode < 0


class RanksFailed(RuntimeError):
    def __init__(self, results: list[RankResult]):
        self.results = results
        lines = []
        for r in results:
            if r.ok:
                continue
            if r.error_type:
                lines.append(f"rank {r.rank}: {r.error_type}: {r.message}\n{r.traceback or ''}")
            else:
                lines.append(f"rank {r.rank}: exit code {r.exitcode} without a result")
        super().__init__("some ranks failed:\n" + "\n".join(lines))


def check(results: list[RankResult]) -> list[Any]:
    """Values in rank order; raises :class:`RanksFailed` if any rank failed."""
    if not all(r.ok for r in results):
        raise RanksFailed(results)
    return [r.value for r in results]


def _rank_main(fn, rank, world, host, port, args, kwargs, env, q, torch_threads):
    os.environ.update(env or {})
    t0 = time.monotonic()
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(torch_threads)
        store = dist.TCPStore(host, port, world_size=None, is_master=False,
                              timeout=timedelta(seconds=300))
        value = fn(rank, world, store, *args, **kwargs)
        q.put(("ok", rank, value, time.monotonic() - t0))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        q.put(("err", rank, failure_record(e), time.monotonic() - t0))


def failure_record(e: BaseException) -> tuple:
    """What a rank process reports of its exception (call it in the ``except`` block): the
    exception itself if it pickles (else None), its type name, its text, the traceback."""
    import pickle
    tb = traceback.format_exc()
    try:
        pickle.dumps(e)
        err = e
    except Exception:
        err = None
    return err, type(e).__name__, str(e), tb


def run_ranks(fn: Callable, world: int, *, args: tuple = (), kwargs: dict | None = None,
              timeout_s: float = 300.0, env: dict | None = None,
              rank_env: dict[int, dict] | None = None, torch_threads: int = 1,
              raise_on_error: bool = False) -> list[RankResult]:
    """Start ``world`` processes running ``fn(rank, world, store, *args, **kwargs)``.

    Returns one :class:`RankResult` per rank (value or error, exit code, time). A rank that
    has not finished after ``timeout_s`` is killed (SIGKILL) and reported with
    ``error_type == "Timeout"``. ``env`` is applied in every rank, ``rank_env[r]`` in rank r.
    """
    import torch.distributed as dist
    ctx = mp.get_context("spawn")
    server = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                           timeout=timedelta(seconds=300), wait_for_workers=False)
    q = ctx.Queue()
    procs = []
    try:
        for r in range(world):
            e = dict(env or {})
            e.update((rank_env or {}).get(r, {}))
            p = ctx.Process(target=_rank_main, name=f"sparkccl-rank{r}",
                            args=(fn, r, world, "127.0.0.1", server.port, args, kwargs or {},
                                  e, q, torch_threads),
                            daemon=True)
            p.start()
            procs.append(p)
        results = [RankResult(rank=r) for r in range(world)]
        pending = set(range(world))
        deadline = time.monotonic() + timeout_s
        dead_since: dict[int, float] = {}
        while pending and time.monotonic() < deadline:
            try:
                kind, rank, payload, elapsed = q.get(timeout=0.1)
                _record(results, kind, rank, payload, elapsed)
                pending.discard(rank)
                continue
            except queue_mod.Empty:
                pass
            now = time.monotonic()
            for r in list(pending):
                if procs[r].exitcode is None:
                    continue
                # Dead without a result (yet): allow its last message a moment to arrive.
                if now - dead_since.setdefault(r, now) > 1.0:
                    pending.discard(r)
                    code = procs[r].exitcode
                    results[r].error_type = KILLED if code < 0 else "Exited"
                    results[r].message = f"exit code {code}"
        for r in pending:
            results[r].error_type = "Timeout"
            results[r].message = f"no result after {timeout_s:g} s"
        for r, p in enumerate(procs):
            # A rank that already answered may still be closing (close() waits for every
            # rank); on an oversubscribed host that can take a while.
            p.join(timeout=60 if r not in pending else 0.1)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=5)
            results[r].exitcode = p.exitcode
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=5)
        q.close()
        del server
    if raise_on_error:
        check(results)
    return results


def _record(results, kind, rank, payload, elapsed):
    res = results[rank]
    res.elapsed_s = elapsed
    if kind == "ok":
        res.value = payload
    else:
        err, tname, msg, tb = payload
        res.error, res.error_type, res.message, res.traceback = err, tname, msg, tb


def shm_leftovers(token: str) -> list[str]:
    """Names in /dev/shm that belong to the communicator with ``token`` (should be none)."""
    from .shm import PREFIX, SHM_DIR
    tag = f"-{token}-"
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX) and tag in n)
    except FileNotFoundError:
        return []


# ---- deterministic inputs and independent references (numpy, not the data plane) -------

def make_input(seed: int, rank: int, shape, dtype, *, zeros: bool = True):
    """The tensor rank ``rank`` contributes to test ``seed``: any rank can rebuild any
    other rank's input. Floats are normal(0, 1) scaled by 2**(rank % 5 - 2) so that sums
    round; with ``zeros`` every 7th element is -0.0 on every rank (checks that the sum
    starts from rank 0's value, not from +0)."""
    import torch
    g = torch.Generator().manual_seed((seed * 1_000_003 + rank * 7919) & 0x7FFFFFFFFFFF)
    shape = tuple(shape)
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g, dtype=torch.float32) * float(2.0 ** (rank % 5 - 2))
        x = x.to(dtype)
        if zeros and x.numel():
            x.view(-1)[::7] = -0.0
        return x
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    info = torch.iinfo(dtype)
    if info.bits <= 8:  # draw the dtype directly (big uint8 buffers stay cheap)
        return torch.randint(info.min, info.max + 1, shape, generator=g, dtype=dtype)
    lo, hi = max(info.min, -(1 << 30)), min(info.max, 1 << 30)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def bits(t):
    """The raw bytes of a tensor as a numpy uint8 array (for bit-exact comparison)."""
    return t.detach().contiguous().reshape(-1).view(__import__("torch").uint8).numpy()


def _to_f32(t):
    import numpy as np
    import torch
    if t.dtype == torch.bfloat16:
        u = t.contiguous().view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16
        return u.view(np.float32)
    if t.dtype == torch.float16:
        return t.contiguous().view(torch.int16).numpy().view(np.float16).astype(np.float32)
    return t.contiguous().numpy().astype(np.float32)


def _round_f32(a, dtype):
    """fp32 numpy array -> raw uint8 bytes of ``dtype``, round to nearest even."""
    import numpy as np
    import torch
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == torch.float32:
        return a.view(np.uint8)
    if dtype == torch.float16:
        return a.astype(np.float16).view(np.uint8)
    if dtype == torch.bfloat16:
        u = a.view(np.uint32).astype(np.uint64)
        nan = np.isnan(a)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
        return r.view(np.uint8)
    raise TypeError(dtype)


def reduce_scatter_reference(inputs, rank: int):
    """Raw bytes of chunk ``rank`` of the sum of ``inputs`` (one per rank, in rank order):
    fp32 sum in rank order starting from rank 0's value, rounded once (numpy)."""
    world = len(inputs)
    m = inputs[0].shape[0] // world
    acc = None
    for x in inputs:
        part = _to_f32(x[rank * m:(rank + 1) * m].reshape(-1))
        acc = part.copy() if acc is None else acc + part
    return _round_f32(acc, inputs[0].dtype)


def all_gather_reference(inputs):
    """Raw bytes of the gathered tensor."""
    import numpy as np
    return np.concatenate([bits(x) for x in inputs]) if inputs else np.zeros(0, np.uint8)


# ---- op lists (kind, seed, shape, dtype) of the burst tests -------------------------------

def issue_ops(comm, ops, inputs) -> list:
    """Issue ``ops`` back to back on ``comm`` with this rank's ``inputs``: kind "ag" an
    all-gather, "rs" a reduce-scatter, anything else a reduce-scatter through the zero-copy
    input buffer. Returns the outputs, unchecked."""
    out = []
    for (kind, _, shape, dt), x in zip(ops, inputs):
        if kind == "ag":
            out.append(comm.all_gather(x))
        elif kind == "rs":
            out.append(comm.reduce_scatter(x))
        else:
            out.append(reduce_scatter_via_input(comm, x))
    return out


def reduce_scatter_via_input(comm, x):
    """A reduce-scatter of ``x`` through the communicator's zero-copy input buffer."""
    buf = comm.reduce_scatter_input(x.shape, x.dtype)
    buf.copy_(x)
    return comm.reduce_scatter(buf)


# ---- bad input ------------------------------------------------------------------------------

def expect_errors(comm, cases) -> dict[str, Any]:
    """Run bad-input cases (name, fn, exception type, text in the message) on a rank:
    {name: None if fn raised that, else what happened}, then whether the sequence number
    stayed at 0 (nothing was sent)."""
    out: dict[str, Any] = {}
    for name, fn, etype, text in cases:
        try:
            fn()
            out[name] = "no exception"
        except Exception as e:  # noqa: BLE001
            ok = isinstance(e, etype) and text in str(e)
            out[name] = None if ok else f"{type(e).__name__}: {e}"
    out["seq after bad calls"] = None if comm.seq == 0 else f"seq moved to {comm.seq}"
    return out


def assert_no_problems(values: list[dict], at_least: int) -> None:
    """Every rank's {check: None or problem} came back clean, with at least ``at_least``
    checks."""
    for r, v in enumerate(values):
        bad = {k: e for k, e in v.items() if e is not None}
        assert not bad, f"rank {r}: {bad}"
    assert len(values[0]) >= at_least


# ---- bursts of mixed collectives (demo, selftest) ------------------------------------------

BURST_SIZES = (1, 7, 64, 1000, 4099, 1 << 14, 1 << 16)


def burst_ops(seed: int, count: int, sizes=BURST_SIZES) -> list[tuple[str, int, str]]:
    """The same random mix of collectives on every rank: (kind, elements, dtype name);
    kind "reduce_scatter_input" goes through the zero-copy input buffer."""
    import random
    rnd = random.Random(seed)
    ops = []
    for _ in range(count):
        kind = rnd.choice(["all_gather", "reduce_scatter", "reduce_scatter_input"])
        elems = rnd.choice(sizes)
        if kind == "all_gather":
            dname = rnd.choice(["uint8", "bfloat16", "float32", "int32"])
        else:
            dname = rnd.choice(["bfloat16", "float16", "float32"])
        ops.append((kind, elems, dname))
    return ops


def run_bursts(comm, world: int, rank: int, *, bursts: int, per_burst: int, op_seed: int,
               input_seed: int, to: Callable, sync: Callable,
               sizes=BURST_SIZES) -> tuple[int, list[str]]:
    """Issue bursts of ``per_burst`` mixed collectives back to back (burst b: ops from seed
    ``op_seed + b``, call i's inputs from seed ``input_seed * (b + 1) + i``), check every
    result bit for bit only after the whole burst; ``to`` puts an input on the
    communicator's device, ``sync`` waits for its work. Returns (calls, failures)."""
    import torch
    bad, total = [], 0
    for b in range(bursts):
        ops = burst_ops(op_seed + b, per_burst, sizes)
        outs = []
        for i, (kind, elems, dname) in enumerate(ops):
            dtype, seed = getattr(torch, dname), input_seed * (b + 1) + i
            if kind == "all_gather":
                outs.append(comm.all_gather(to(make_input(seed, rank, (elems,), dtype))))
            else:
                x = to(make_input(seed, rank, (world * elems,), dtype))
                outs.append(reduce_scatter_via_input(comm, x) if kind == "reduce_scatter_input"
                            else comm.reduce_scatter(x))
        sync()
        for i, ((kind, elems, dname), y) in enumerate(zip(ops, outs)):
            dtype, seed = getattr(torch, dname), input_seed * (b + 1) + i
            if kind == "all_gather":
                want = all_gather_reference([make_input(seed, q, (elems,), dtype)
                                             for q in range(world)])
            else:
                want = reduce_scatter_reference(
                    [make_input(seed, q, (world * elems,), dtype) for q in range(world)], rank)
            got = bits(y.cpu())
            total += 1
            if got.size != want.size or not (got == want).all():
                bad.append(f"burst {b} call {i} ({kind} {elems} x {dname})")
    return total, bad


def fmt_size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.4g} {unit}"
    return f"{n} B"


# ---- MoE finalize (SPEC §6): inputs and an independent numpy reference --------------------

def fma_f32(a, b, c):
    """fp32 fused multiply-add ``round_f32(a * b + c)`` (one rounding, nearest even) in numpy,
    elementwise with broadcasting: the product of two fp32 values is exact in float64; the
    float64 sum is made round-to-odd (TwoSum error term, then one ulp toward it when the
    rounded sum is inexact and even), and rounding a round-to-odd value with 53 >= 24 + 2 bits
    to fp32 gives the correctly rounded result (Boldo & Melquiond), so this equals C's
    ``fmaf`` / CUDA's ``__fmaf_rn`` bit for bit (NaN payloads aside)."""
    import numpy as np
    a = np.asarray(a, np.float32).astype(np.float64)
    b = np.asarray(b, np.float32).astype(np.float64)
    c = np.asarray(c, np.float32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        p = a * b  # exact: 24 + 24 significant bits
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)  # s + err == p + c exactly
        fix = np.isfinite(s) & (err != 0) & ((s.view(np.int64) & 1) == 0)
        s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def make_finalize_input(seed: int, rank: int, *, tokens: int, hidden: int, topk: int,
                        experts_rows: int, fp8: bool = False, pow2_weights: bool = True):
    """One rank's finalize inputs for test ``seed`` (any rank can rebuild any other's):
    dict(y, pos, weights, shared, y_scales). ``y`` is bf16 ``[R, H]`` or float8_e4m3fn with
    fp32 ``y_scales`` ``[R, H / 128]``; ``pos`` int32 ``[T * topk]`` in ``[0, R)``; weights fp32
    ``[T, topk]``: powers of two (then FMA equals multiply-add) or general values, with some
    zeros; shared bf16 ``[T, H]`` with some -0.0."""
    import torch
    g = torch.Generator().manual_seed((seed * 1_000_003 + rank * 7919 + 17) & 0x7FFFFFFFFFFF)
    T, H, R = tokens, hidden, experts_rows
    scale = float(2.0 ** (rank % 3 - 1))
    if fp8:
        # Clamped: torch versions differ on out-of-range e4m3 conversion (NaN or saturate).
        y = (torch.randn((R, H), generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        e = torch.randint(-8, 3, (R, H // 128), generator=g).to(torch.float32)
        y_scales = torch.exp2(e) * (1 + torch.rand((R, H // 128), generator=g)) * scale
    else:
        y = (torch.randn((R, H), generator=g) * scale).to(torch.bfloat16)
        y_scales = None
    pos = torch.randint(0, max(R, 1), (T * topk,), generator=g, dtype=torch.int32)
    if pow2_weights:
        ex = torch.randint(-6, 2, (T, topk), generator=g).to(torch.float32)
        sign = torch.where(torch.rand((T, topk), generator=g) < 0.25, -1.0, 1.0)
        weights = sign * torch.exp2(ex)
    else:
        weights = torch.rand((T, topk), generator=g, dtype=torch.float32) * 2 - 0.5
    if weights.numel():
        weights.view(-1)[::11] = 0.0
    shared = (torch.randn((T, H), generator=g) * scale).to(torch.bfloat16)
    if shared.numel():
        shared.view(-1)[::7] = -0.0
    return dict(y=y, pos=pos, weights=weights, shared=shared, y_scales=y_scales)


def finalize_rows_reference(inp: dict, num_tokens: int, padded_tokens: int):
    """One rank's finalize rows, ``[Tpad, H]`` fp32 values of the bf16-rounded rows (numpy):
    the fp32 FMA chain in k order by :func:`fma_f32`, e4m3 decoded by torch's own
    float8_e4m3fn conversion, times the scale in fp32."""
    import numpy as np
    import torch
    y, pos, w, shared, scales = (inp["y"], inp["pos"], inp["weights"], inp["shared"],
                                 inp.get("y_scales"))
    T, Tpad = num_tokens, padded_tokens
    H = shared.shape[1]
    topk = w.shape[1]
    if scales is not None:
        yv = y.view(torch.float8_e4m3fn) if y.dtype == torch.uint8 else y
        yf = yv.to(torch.float32).numpy()
        yf = (yf * np.repeat(scales.numpy().astype(np.float32), 128, axis=1)).astype(np.float32)
    else:
        yf = _to_f32(y.reshape(-1)).reshape(y.shape[0], H) if y.numel() else \
            np.zeros((y.shape[0], H), np.float32)
    acc = _to_f32(shared[:T].reshape(-1)).reshape(T, H)
    p = pos.reshape(-1)[:T * topk].numpy().reshape(T, topk).astype(np.int64)
    wn = w[:T].numpy().astype(np.float32)
    for k in range(topk):
        acc = fma_f32(wn[:, k:k + 1], yf[p[:, k]], acc)
    rows = np.zeros((Tpad, H), np.float32)
    rows[:T] = acc
    raw = _round_f32(rows.reshape(-1), torch.bfloat16).view(np.uint16)
    raw[np.isnan(rows.reshape(-1))] = 0x7FFF  # a NaN row element is the canonical NaN
    return bf16_bits_to_f32(raw.view(np.uint8)).reshape(Tpad, H)


def bf16_bits_to_f32(raw):
    """fp32 values of bfloat16 bits (a uint8 or uint16 numpy array, same shape in 16-bit
    units), exactly."""
    import numpy as np
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def moe_finalize_reference(inputs: list, rank: int, num_tokens: int, padded_tokens: int,
                           rows: list | None = None):
    """Raw bytes of rank ``rank``'s result of ``moe_finalize_reduce_scatter`` given every
    rank's inputs (in rank order): each rank's rows rounded to bf16, this rank's chunk
    summed over ranks in rank order in fp32 (starting from rank 0's value), rounded once.
    ``rows``: every rank's :func:`finalize_rows_reference`, if already computed."""
    import torch
    world = len(inputs)
    m = padded_tokens // world
    if rows is None:
        rows = [finalize_rows_reference(inp, num_tokens, padded_tokens) for inp in inputs]
    acc = None
    for full in rows:
        part = full[rank * m:(rank + 1) * m]
        acc = part.copy() if acc is None else acc + part
    return _round_f32(acc.reshape(-1), torch.bfloat16)


FINALIZE_DEMO_CASES = (
    # (num_tokens, padded tokens per rank, hidden, topk, fp8, pow2 weights)
    (37, 8, 256, 8, False, True),
    (100, 16, 512, 4, True, True),
    (61, 16, 384, 2, True, False),
)


def finalize_demo_case(comm, world: int, rank: int, seed: int) -> bool:
    """The fused MoE finalize on ``comm`` (CPU or CUDA), every result bit checked against
    :func:`moe_finalize_reference`: bf16 and e4m3 inputs, T < Tpad, powers of two and general
    routing weights. Every rank must call it with the same ``seed``; True when all agree."""
    import torch
    ok = True
    for k, (T, per_rank, H, topk, fp8, pow2) in enumerate(FINALIZE_DEMO_CASES):
        Tpad = per_rank * world
        T = min(T, Tpad - 1)
        s = seed * 100 + k
        inputs = [make_finalize_input(s, r, tokens=T, hidden=H, topk=topk, experts_rows=2 * T + 3,
                                      fp8=fp8, pow2_weights=pow2) for r in range(world)]
        mine = inputs[rank]
        dev = comm.device

        def on(t):
            return None if t is None else t.to(dev)

        z = comm.moe_finalize_reduce_scatter(on(mine["y"]), on(mine["pos"]), on(mine["weights"]),
                                             on(mine["shared"]), num_tokens=T,
                                             padded_tokens=Tpad, y_scales=on(mine["y_scales"]))
        if dev.type == "cuda":
            comm.synchronize()
        want = moe_finalize_reference(inputs, rank, T, Tpad)
        got = bits(z.cpu())
        ok = ok and tuple(z.shape) == (Tpad // world, H) and z.dtype == torch.bfloat16 \
            and got.size == want.size and bool((got == want).all())
    return ok
