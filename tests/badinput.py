"""Generated bad input (issue 32): hypothesis strategies of calls a communicator must refuse,
and of cross-rank mismatches it must fail on every rank, never hang on or answer wrongly.

Shared by tests/test_bad_input_generated.py (a small seeded slice) and
benchmarks/bad_input.py (the record). The ranks are threads of this process over a
HashStore (the shm transport works within one process), so a case costs no process start.

* :func:`local_bad_calls`: one rank's call with bad arguments (x, out, dtypes, shapes,
  strides, devices, finalize indices and sizes, reduce_scatter_input) -> ``(label, call,
  expected exception types)``. :func:`refused` checks it raised one of them and that nothing
  was sent (the sequence number and the proxy's ring entries unchanged).
* :func:`mismatches`: what each rank of a world of two calls, differing in size (also sizes
  that pad to the same 16 bytes), dtype (also of one width) or collective ->
  :func:`run_mismatch` checks every rank raised CollectiveError within the timeout, naming
  both calls' exact bytes and dtypes where the collective is the same.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import torch
import torch.distributed as dist
from hypothesis import strategies as st

import sparkccl
from sparkccl.reference import (all_gather_reference, bits, make_input,
                                reduce_scatter_reference)

W = 2
RS_OK = (torch.bfloat16, torch.float16, torch.float32)
RS_BAD = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float64,
          torch.bool, torch.complex64)
ANY_DTYPE = RS_OK + RS_BAD
shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


def _tensor(shape, dtype):
    if dtype.is_complex or dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype) if dtype != torch.bool else torch.zeros(shape).bool()


@st.composite
def non_contiguous(draw, dtype=None):
    """A strided view that is not contiguous: a transpose or a step slice."""
    dtype = dtype or draw(st.sampled_from(ANY_DTYPE))
    a, b = draw(st.integers(2, 6)), draw(st.integers(2, 6))
    base = _tensor((W * a, 2 * b), dtype)
    return base.t() if draw(st.booleans()) else base[:, ::2]


@st.composite
def not_a_tensor(draw):
    return draw(st.one_of(st.none(), st.integers(), st.text(max_size=4),
                          st.lists(st.integers(), max_size=4),
                          st.builds(lambda n: np.zeros(n, np.float32), st.integers(0, 5))))


def _wrong_shape(draw, shape):
    other = draw(shapes.filter(lambda s: s != tuple(shape)))
    return other


@st.composite
def local_bad_calls(draw, comm):
    """(label, call, expected exception types) of one bad call on ``comm`` (world W)."""
    kind = draw(st.sampled_from(("ag-x", "ag-out", "rs-x", "rs-out", "rsi", "finalize")))
    if kind == "ag-x":
        sub = draw(st.sampled_from(("not-a-tensor", "non-contiguous", "sparse", "meta",
                                    "quantized")))
        if sub == "not-a-tensor":
            x = draw(not_a_tensor())
            return f"ag x={type(x).__name__}", lambda: comm.all_gather(x), (TypeError,)
        if sub == "non-contiguous":
            x = draw(non_contiguous())
            return f"ag x non-contiguous {tuple(x.shape)} stride {x.stride()}", \
                lambda: comm.all_gather(x), (ValueError,)
        if sub == "sparse":
            x = torch.zeros(draw(shapes)).to_sparse()
            return "ag x sparse", lambda: comm.all_gather(x), (TypeError,)
        if sub == "meta":
            x = torch.zeros(draw(shapes), dtype=draw(st.sampled_from(ANY_DTYPE)), device="meta")
            return f"ag x on meta {x.dtype}", lambda: comm.all_gather(x), (ValueError,)
        x = torch.quantize_per_tensor(torch.zeros(draw(shapes)), 0.1, 0, torch.quint8)
        return "ag x quantized", lambda: comm.all_gather(x), (TypeError,)
    if kind == "ag-out":
        shape, dtype = draw(shapes), draw(st.sampled_from(ANY_DTYPE))
        x = _tensor(shape, dtype)
        want = (W * shape[0], *shape[1:])
        sub = draw(st.sampled_from(("shape", "dtype", "non-contiguous", "meta", "not-a-tensor",
                                    "is-x")))
        if sub == "shape":
            out = _tensor(_wrong_shape(draw, want), dtype)
        elif sub == "dtype":
            out = _tensor(want, draw(st.sampled_from([d for d in ANY_DTYPE if d != dtype])))
        elif sub == "non-contiguous":  # every dimension's rows every other one of a
            out = _tensor((2 * want[0], *want[1:]), dtype)[::2]  # twice as tall tensor
        elif sub == "meta":
            out = torch.empty(want, dtype=dtype, device="meta")
        elif sub == "is-x":
            out = x  # the input as its own output: [n] where [W * n] is needed
        else:  # (None is the default: a fresh result)
            out = draw(not_a_tensor().filter(lambda v: v is not None))
        exp = (TypeError,) if sub == "not-a-tensor" else (ValueError,)
        return f"ag out {sub} (x {list(shape)} {dtype})", \
            lambda: comm.all_gather(x, out=out), exp
    if kind == "rs-x":
        sub = draw(st.sampled_from(("dtype", "0-dim", "rows", "non-contiguous", "meta",
                                    "not-a-tensor")))
        if sub == "dtype":
            d = draw(st.sampled_from(RS_BAD))
            x = _tensor((W * draw(st.integers(1, 4)), draw(st.integers(1, 5))), d)
            return f"rs x {d}", lambda: comm.reduce_scatter(x), (TypeError,)
        if sub == "0-dim":
            x = torch.tensor(1.0, dtype=draw(st.sampled_from(RS_OK)))
            return "rs x 0-dim", lambda: comm.reduce_scatter(x), (ValueError,)
        if sub == "rows":
            rows = draw(st.integers(1, 40).filter(lambda n: n % W))
            x = _tensor((rows, draw(st.integers(1, 5))), draw(st.sampled_from(RS_OK)))
            return f"rs x rows {rows}", lambda: comm.reduce_scatter(x), (ValueError,)
        if sub == "non-contiguous":
            x = draw(non_contiguous(draw(st.sampled_from(RS_OK))))
            return f"rs x non-contiguous {tuple(x.shape)} stride {x.stride()}", \
                lambda: comm.reduce_scatter(x), (ValueError,)
        if sub == "meta":
            x = torch.zeros((W * 2, 3), dtype=draw(st.sampled_from(RS_OK)), device="meta")
            return "rs x on meta", lambda: comm.reduce_scatter(x), (ValueError,)
        x = draw(not_a_tensor())
        return f"rs x={type(x).__name__}", lambda: comm.reduce_scatter(x), (TypeError,)
    if kind == "rs-out":
        m, h, dtype = draw(st.integers(1, 4)), draw(st.integers(1, 5)), draw(st.sampled_from(RS_OK))
        x = _tensor((W * m, h), dtype)
        sub = draw(st.sampled_from(("shape", "dtype", "meta", "not-a-tensor", "is-x",
                                    "non-contiguous")))
        if sub == "shape":
            out = _tensor(_wrong_shape(draw, (m, h)), dtype)
        elif sub == "dtype":
            out = _tensor((m, h), draw(st.sampled_from([d for d in ANY_DTYPE if d != dtype])))
        elif sub == "meta":
            out = torch.empty((m, h), dtype=dtype, device="meta")
        elif sub == "is-x":
            out = x  # [W * m, h] where [m, h] is needed
        elif sub == "non-contiguous":  # (a view with one element per row and column is
            m, h = m + 1, h + 1          # contiguous whatever its strides)
            x = _tensor((W * m, h), dtype)
            out = _tensor((h, m), dtype).t()
        else:  # (None is the default: a fresh result)
            out = draw(not_a_tensor().filter(lambda v: v is not None))
        exp = (TypeError,) if sub == "not-a-tensor" else (ValueError,)
        return f"rs out {sub} (x [{W * m}, {h}] {dtype})", \
            lambda: comm.reduce_scatter(x, out=out), exp
    if kind == "rsi":
        if draw(st.booleans()):
            d = draw(st.sampled_from(RS_BAD))
            return f"rsi dtype {d}", lambda: comm.reduce_scatter_input((W, 4), d), (TypeError,)
        rows = draw(st.integers(1, 40).filter(lambda n: n % W))
        return f"rsi rows {rows}", lambda: comm.reduce_scatter_input((rows, 4)), (ValueError,)
    return draw(finalize_bad(comm))


@st.composite
def finalize_bad(draw, comm):
    """A fused MoE finalize call with one thing wrong (the rest valid)."""
    T, topk, H = draw(st.integers(1, 12)), draw(st.integers(1, 4)), 16
    R = draw(st.integers(1, 20))
    Tpad = W * max(8, -(-T // W))
    g = torch.Generator().manual_seed(draw(st.integers(0, 1 << 20)))
    args = dict(y=torch.randn(R, H, generator=g).bfloat16(),
                pos=torch.randint(0, R, (T * topk,), generator=g, dtype=torch.int32),
                weights=torch.rand(T, topk, generator=g),
                shared=torch.randn(T, H, generator=g).bfloat16())
    kw = dict(num_tokens=T, padded_tokens=Tpad)
    sub = draw(st.sampled_from(("pos-high", "pos-negative", "pos-dtype", "tokens", "padded",
                                "topk", "y-dtype", "weights-shape", "out-shape")))
    exp = (ValueError,)
    if sub == "pos-high":
        i = draw(st.integers(0, T * topk - 1))
        args["pos"][i] = R + draw(st.integers(0, 1000))
    elif sub == "pos-negative":
        args["pos"][draw(st.integers(0, T * topk - 1))] = -draw(st.integers(1, 1000))
    elif sub == "pos-dtype":
        args["pos"] = args["pos"].to(draw(st.sampled_from((torch.int64, torch.int16,
                                                           torch.float32))))
        exp = (TypeError,)
    elif sub == "tokens":
        kw["num_tokens"] = Tpad + draw(st.integers(1, 10))
    elif sub == "padded":
        kw["padded_tokens"] = Tpad + draw(st.integers(1, W - 1)) if W > 1 else -1
    elif sub == "topk":
        args["weights"] = torch.rand(T, 17)
        args["pos"] = torch.zeros(T * 17, dtype=torch.int32)
    elif sub == "y-dtype":
        args["y"] = args["y"].to(draw(st.sampled_from((torch.float32, torch.float16))))
        exp = (TypeError,)
    elif sub == "weights-shape":
        args["weights"] = torch.rand(T, topk + 1)
    else:
        kw["out"] = torch.empty(Tpad // W + 1, H, dtype=torch.bfloat16)
    return (f"finalize {sub} (T {T} topk {topk} R {R})",
            lambda: comm.moe_finalize_reduce_scatter(**args, **kw), exp)


def refused(comm, label, call, expected) -> str | None:
    """None if ``call`` raised one of ``expected`` and sent nothing, else the problem."""
    if not comm._closed and comm._abort_word is not None and comm._abort_word[0]:
        return f"{label}: not tried: the communicator failed on an earlier case"
    seq, entries = comm.seq, comm.proxy_stats().get("entries", 0)
    try:
        call()
        problem = "accepted (no exception)"
    except expected as e:
        problem = None if str(e) else "raised with an empty message"
    except Exception as e:  # noqa: BLE001 - the wrong kind is the finding
        problem = f"raised {type(e).__name__} instead of {expected[0].__name__}: {e}"
    if problem is None:
        time.sleep(0)  # (the proxy would have consumed an entry at once; checked below)
        if comm.seq != seq or comm.proxy_stats().get("entries", 0) != entries:
            problem = "refused, but something was sent first"
    return None if problem is None else f"{label}: {problem}"


# ---- worlds of threads ------------------------------------------------------------------

def world(n: int = W, timeout_s: float = 2.0, **kw) -> list:
    """n communicators of one world, one per thread of this process (a fresh HashStore)."""
    store = dist.HashStore()
    comms: list = [None] * n
    errors: list = []

    def make(r):
        try:
            comms[r] = sparkccl.Communicator(store=store, rank=r, world_size=n,
                                             timeout_s=timeout_s, slot_bytes=1 << 20, **kw)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    on_threads([lambda r=r: make(r) for r in range(n)])
    if errors:
        raise errors[0]
    return comms


def on_threads(calls: list) -> list:
    """Run calls[r] on thread r; -> their results or exceptions."""
    out: list = [None] * len(calls)

    def run(r):
        try:
            out[r] = calls[r]()
        except BaseException as e:  # noqa: BLE001 - returned to the caller
            out[r] = e
    ts = [threading.Thread(target=run, args=(r,)) for r in range(len(calls))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    return out


def healthy(comms, seed: int) -> str | None:
    """One all-gather and one reduce-scatter on every rank, bit-exact: None, else why not."""
    n = len(comms)
    xs = [make_input(seed, r, (n * 3, 5), torch.bfloat16) for r in range(n)]
    res = on_threads([lambda c=c, r=r: (c.all_gather(xs[r]), c.reduce_scatter(xs[r]))
                      for r, c in enumerate(comms)])
    for r, got in enumerate(res):
        if isinstance(got, BaseException):
            return f"rank {r}: {type(got).__name__}: {got}"
        if not ((bits(got[0]) == all_gather_reference(xs)).all()
                and (bits(got[1]) == reduce_scatter_reference(xs, r)).all()):
            return f"rank {r}: wrong result"
    return None


# ---- cross-rank mismatches --------------------------------------------------------------

@st.composite
def mismatches(draw):
    """Per rank (op, rows, cols, dtype): the ranks differ in size (``padding``: sizes that
    pad to the same 16 bytes), dtype (of one width or not) or collective. ``ar`` is an
    all-reduce in the two-step regime (the fused operation where the plane has it)."""
    op0 = draw(st.sampled_from(("ag", "rs", "ar")))
    dtype = draw(st.sampled_from(RS_OK))
    rows, cols = W * draw(st.integers(1, 64)), draw(st.integers(1, 64))
    a = (op0, rows, cols, dtype)
    sub = draw(st.sampled_from(("size", "padding", "collective", "dtype")))
    if sub == "size":
        rows2 = W * draw(st.integers(1, 64).filter(lambda k: W * k * cols != rows * cols))
        b = (op0, rows2, cols, dtype)
    elif sub == "padding":  # one row per rank (rs: per chunk), columns within one 16 bytes
        per16 = 16 // dtype.itemsize
        base = per16 * draw(st.integers(0, 8))
        c1, c2 = draw(st.lists(st.integers(1, per16), min_size=2, max_size=2, unique=True)) \
            if per16 > 1 else (1, 2)
        r = W if op0 == "rs" else 1
        a, b = (op0, r, base + c1, dtype), (op0, r, base + c2, dtype)
    elif sub == "collective":
        b = (draw(st.sampled_from([o for o in ("ag", "rs", "ar") if o != op0])), rows, cols,
             dtype)
    else:
        b = (op0, rows, cols, draw(st.sampled_from([d for d in RS_OK if d != dtype])))
    ranks = [a, b] if draw(st.booleans()) else [b, a]
    return sub, ranks


def _issue(comm, spec, seed):
    op, rows, cols, dtype = spec
    x = make_input(seed, comm.rank, (rows, cols), dtype)
    if op == "ag":
        return comm.all_gather(x), x
    if op == "rs":
        return comm.reduce_scatter(x), x
    return comm.all_reduce(x, regime="two_step"), x


def said(spec) -> str:
    """What a rank's call is named in the error: its exact bytes (per rank, or in all for an
    all-reduce) and dtype."""
    op, rows, cols, dtype = spec
    n = rows * cols * dtype.itemsize // (W if op == "rs" else 1)
    return f"{n} bytes of {str(dtype).replace('torch.', '')}"


def run_mismatch(sub: str, specs: list, seed: int, timeout_s: float = 2.0,
                 **kw) -> str | None:
    """Every rank raises CollectiveError within the timeout + 1 s, naming both calls (their
    exact bytes and dtypes) where the ranks made the same collective. -> None, or the
    problem."""
    comms = world(len(specs), timeout_s, **kw)
    try:
        t0 = time.monotonic()
        res = on_threads([lambda c=c, s=s: _issue(c, s, seed) for c, s in zip(comms, specs)])
        took = time.monotonic() - t0
        for r, got in enumerate(res):
            if not isinstance(got, sparkccl.CollectiveError):
                what = "returned a result" if not isinstance(got, BaseException) else \
                    f"raised {type(got).__name__}: {got}"
                return f"rank {r} {what} for {specs}"
        if took > timeout_s + 1:
            return f"took {took:.1f} s (> timeout {timeout_s:g} s + 1 s)"
        if sub != "collective":
            for r, e in enumerate(res):
                if not all(said(s) in str(e) for s in specs):
                    return f"rank {r}: error does not name both calls {[said(s) for s in specs]}: {e}"
        return None
    finally:
        on_threads([lambda c=c: c.__exit__(sparkccl.CollectiveError, None, None) for c in comms])
