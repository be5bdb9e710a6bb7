"""Ranks that make different calls fail on every rank, naming both calls, before any result
is returned (issue 32): sizes that pad to the same 16 bytes (3 vs 4 fp32 elements, 5 vs 6
bf16) and dtypes of one width (bf16 vs fp16), for all-gather, reduce-scatter and
all-reduce (both regimes: the one shot's all-gather says all-reduce too), an all-reduce of
sums beside one of averages (both regimes), and one rank's one shot beside another's two
steps. The ranks'
exact bytes, dtype and collective cross in the publish entries' call word
(sparkccl/dataplane/peer_check.py), compared where the peers' publish rings are mapped
(transport shm; ranks are threads of this process). The CUDA plane's twin is
tests/test_cuda_dataplane.py::test_a_different_call_on_a_peer_is_reported."""
from __future__ import annotations

import time

import pytest
import torch

import badinput as B
import sparkccl

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
TIMEOUT_S = 2.0

# (elements, dtype) per rank, and what each is said to have passed (per rank, or in all)
CASES = {
    "3v4-f32": (((3, F32), (4, F32)), ("12 bytes of float32", "16 bytes of float32")),
    "5v6-bf16": (((5, BF16), (6, BF16)), ("10 bytes of bfloat16", "12 bytes of bfloat16")),
    "bf16-f16": (((5, BF16), (5, F16)), ("10 bytes of bfloat16", "10 bytes of float16")),
}


def _call(op: str, comm, n: int, dtype):
    x = torch.arange(1, n + 1).to(dtype)
    if op == "ag":
        return comm.all_gather(x)
    if op == "rs":  # n elements per rank's chunk
        return comm.reduce_scatter(torch.cat([x] * comm.world_size))
    if op == "ar-fused":
        return comm.all_reduce(x, regime="two_step")
    if op == "ar-two-collectives":
        return comm.all_reduce(x, regime="two_step", fused=False)
    return comm.all_reduce(x, regime="one_shot")


def _said(op: str, what: str, world: int) -> str:
    if op == "ag":
        return f"{what} per rank to all_gather"
    if op == "rs":  # the per-rank chunk
        n, rest = what.split(" ", 1)
        return f"{n} {rest} per rank to reduce_scatter"
    return f"{what} to all_reduce(sum)"


def _run(world: int, calls, **kw):
    comms = B.world(world, TIMEOUT_S, **kw)
    try:
        t0 = time.monotonic()
        res = B.on_threads([lambda c=c, f=f: f(c) for c, f in zip(comms, calls)])
        return res, time.monotonic() - t0
    finally:
        B.on_threads([lambda c=c: c.__exit__(sparkccl.CollectiveError, None, None)
                      for c in comms])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("op", ["ag", "rs", "ar-fused", "ar-two-collectives", "ar-one-shot"])
def test_a_different_call_fails_every_rank_naming_both(op, case):
    calls, said = CASES[case]
    if op == "rs":  # the chunk of rank r: n elements
        said = tuple(f"{n * d.itemsize} bytes of {str(d)[6:]}" for n, d in calls)
    res, took = _run(2, [lambda c, n=n, d=d: _call(op, c, n, d) for n, d in calls])
    for r, got in enumerate(res):
        assert isinstance(got, sparkccl.CollectiveError), (r, got)
        # every rank's text names both calls (the one that saw it first, or its abort)
        for q in (0, 1):
            assert f"rank {q} passed {_said(op, said[q], 2)}" in str(got), (r, str(got))
    assert took < TIMEOUT_S + 1


@pytest.mark.parametrize("fused", [True, False])
def test_all_reduce_of_sums_beside_one_of_averages(fused):
    """Each rank divides its own chunk (in the fused operation, or between its two
    collectives): a sum on one rank and an average on the other would gather a mix."""
    x = torch.arange(1, 33, dtype=F32)
    res, _ = _run(2, [lambda c: c.all_reduce(x, "sum", regime="two_step", fused=fused),
                      lambda c: c.all_reduce(x, "avg", regime="two_step", fused=fused)])
    for got in res:
        assert isinstance(got, sparkccl.CollectiveError), got
        assert "rank 0 passed 128 bytes of float32 to all_reduce(sum)" in str(got), str(got)
        assert "rank 1 passed 128 bytes of float32 to all_reduce(avg)" in str(got), str(got)


def test_one_shot_all_reduce_of_sums_beside_one_of_averages():
    """The one shot gathers the inputs, each rank divides its own sum: a sum on one rank and
    an average on the other return different results unless the call word says which."""
    x = torch.arange(1, 33, dtype=BF16)
    res, took = _run(2, [lambda c: c.all_reduce(x, "sum", regime="one_shot"),
                         lambda c: c.all_reduce(x, "avg", regime="one_shot")])
    for got in res:
        assert isinstance(got, sparkccl.CollectiveError), got
        assert "rank 0 passed 64 bytes of bfloat16 to all_reduce(sum)" in str(got), str(got)
        assert "rank 1 passed 64 bytes of bfloat16 to all_reduce(avg)" in str(got), str(got)
    assert took < TIMEOUT_S + 1


def test_one_shot_beside_two_steps(monkeypatch):
    """Sizes on either side of the agreed threshold: rank 0's one shot (an all-gather of its
    64 bytes) meets rank 1's two steps (first a reduce-scatter of 32-byte chunks of its 80
    bytes). Both call words say all_reduce(sum); the sizes tell them apart, once the waits
    for the other op's pieces time out (each rank then reads the peer's entry of the seq).
    (Before the first two-step call of both ranks, rank 1 waits for rank 0 to set up the
    reduce-scatter buffers instead, and says so at the timeout.)"""
    monkeypatch.setenv("SPARKCCL_ALLREDUCE_ONESHOT_BYTES", "64")
    first = torch.arange(1, 21, dtype=F32)
    res, took = _run(2, [lambda c: (c.all_reduce(first),
                                    c.all_reduce(torch.arange(1, 17, dtype=F32))),
                         lambda c: (c.all_reduce(first),
                                    c.all_reduce(torch.arange(1, 21, dtype=F32)))])
    for got in res:
        assert isinstance(got, sparkccl.CollectiveError), got
        assert "rank 0 passed 64 bytes of float32 to all_reduce(sum)" in str(got), str(got)
        assert "rank 1 passed 80 bytes of float32 to all_reduce(sum)" in str(got), str(got)
    assert took < TIMEOUT_S + 1


def test_ring_of_three_reduce_scatter_5v6_bf16():
    """A ring: the entries are compared with the origin's own, also where its data came
    through a relay."""
    sizes = (5, 5, 6)
    res, took = _run(3, [lambda c, n=n: _call("rs", c, n, BF16) for n in sizes],
                     topology="ring")
    for got in res:
        assert isinstance(got, sparkccl.CollectiveError), got
        assert "rank 2 passed 12 bytes of bfloat16 per rank to reduce_scatter" in str(got), \
            str(got)
    assert took < TIMEOUT_S + 1


def test_the_same_call_still_works_after_the_check():
    """Equal calls pass the check, on every dtype and padding (the control)."""
    comms = B.world(2, TIMEOUT_S)
    try:
        for n, d in ((3, F32), (5, BF16), (5, F16), (16, torch.uint8)):
            res = B.on_threads([lambda c=c: _call("ag", c, n, d) for c in comms])
            want = torch.cat([torch.arange(1, n + 1).to(d)] * 2)
            assert all(torch.equal(y, want) for y in res), res
        assert B.healthy(comms, 3) is None
    finally:
        B.on_threads([c.close for c in comms])
