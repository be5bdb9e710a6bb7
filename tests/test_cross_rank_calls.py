"""Ranks that make different calls fail on every rank, naming both calls, before any result
is returned (issue 32): sizes that pad to the same 16 bytes (3 vs 4 fp32 elements, 5 vs 6
bf16) and dtypes of one width (bf16 vs fp16), for all-gather, reduce-scatter and
all-reduce (both regimes: the one shot's all-gather says all-reduce too), an all-reduce of
sums beside one of averages (both regimes), and one rank's one shot beside another's two
steps. The ranks' exact bytes, dtype and collective cross in each collective's call entry,
which the proxy sends to every directly connected peer ahead of the collective's first piece
(sparkccl/dataplane/peer_check.py, docs/PROTOCOL.md "Call words"): on every transport, shm,
tcp and verbs through the emulated NIC (both orderings); ranks are threads of this process.
The CUDA plane's twins are tests/test_cuda_dataplane.py::test_a_different_call_on_a_peer_is_reported
and ::test_a_different_call_in_a_ring_is_reported_on_every_rank."""
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
        took = time.monotonic() - t0
        if all(isinstance(e, sparkccl.CollectiveError) for e in res):
            # afterwards the communicator stays failed: the next call raises at once
            x = torch.ones(4)
            again = B.on_threads([lambda c=c: c.all_gather(x) for c in comms])
            assert all(isinstance(e, sparkccl.CollectiveError) for e in again), again
        return res, took
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


# ---- every transport -------------------------------------------------------------------
# The call entries travel the transports' ordered connections (Transport::put_call): the
# same mismatches over tcp (loopback) and verbs (the emulated NIC; strict ordering writes
# the entry plainly, since its immediate carries only a flag's low bits), and a ring of 4
# where only rank 0 differs (rank 2 gets rank 0's data only through a relay) and where
# ranks {0, 1} and {2, 3} differ.

TRANSPORTS = ["tcp", "verbs-inline", "verbs-strict"]


def _use(request, monkeypatch) -> str:
    name = request.param
    if name.startswith("verbs"):  # this process's verbs calls go to the emulated NIC
        _, env = request.getfixturevalue("emunic_host")
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("SPARKCCL_IB_ORDERING", name.split("-")[1])
        return "verbs"
    return name


@pytest.fixture(params=["shm"] + TRANSPORTS)
def transport(request, monkeypatch):
    return _use(request, monkeypatch)


@pytest.fixture(params=TRANSPORTS)
def network(request, monkeypatch):
    """The transports other than shm (which runs the full matrix above)."""
    return _use(request, monkeypatch)


def _all_name_both(res, ranks_said):
    for r, got in enumerate(res):
        assert isinstance(got, sparkccl.CollectiveError), (r, got)
        for q, what in ranks_said:
            assert f"rank {q} passed {what}" in str(got), (r, str(got))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("op", ["ag", "rs", "ar-fused"])
def test_a_different_call_fails_every_rank_over_the_network(network, op, case):
    calls, said = CASES[case]
    if op == "rs":
        said = tuple(f"{n * d.itemsize} bytes of {str(d)[6:]}" for n, d in calls)
    res, took = _run(2, [lambda c, n=n, d=d: _call(op, c, n, d) for n, d in calls],
                     transport=network)
    _all_name_both(res, [(q, _said(op, said[q], 2)) for q in (0, 1)])
    assert took < TIMEOUT_S + 1


def test_sums_beside_averages_over_the_network(network):
    x = torch.arange(1, 33, dtype=F32)
    res, _ = _run(2, [lambda c: c.all_reduce(x, "sum", regime="two_step"),
                      lambda c: c.all_reduce(x, "avg", regime="two_step")], transport=network)
    _all_name_both(res, [(0, "128 bytes of float32 to all_reduce(sum)"),
                         (1, "128 bytes of float32 to all_reduce(avg)")])


RING4 = {"rank0-differs": (3, 4, 4, 4), "halves-differ": (3, 3, 4, 4)}  # fp32 per rank


@pytest.mark.parametrize("pattern", list(RING4))
def test_ring_of_four_fails_every_rank(transport, pattern):
    """Every rank raises, also one whose neighbours made its call: it compares the own call
    entry of each source (forwarded by the relays ahead of the data), or learns of the
    failure by the abort first."""
    sizes = RING4[pattern]
    res, took = _run(4, [lambda c, n=n: _call("ag", c, n, F32) for n in sizes],
                     topology="ring", transport=transport)
    differ = [(a, b) for a in range(4) for b in range(a) if sizes[a] != sizes[b]]
    for r, got in enumerate(res):
        assert isinstance(got, sparkccl.CollectiveError), (r, got)
        # the text names both calls of some pair of ranks that differ
        assert any(all(f"rank {q} passed {4 * sizes[q]} bytes of float32 per rank" in str(got)
                       for q in pair) for pair in differ), (r, str(got))
    assert took < TIMEOUT_S + 1


def test_the_same_calls_stay_exact_over_the_network(network):
    """The control: equal calls pass the check over the network, and the proxy sends one
    call entry per connection per collective (these slices leave root 1 idle: root 0's
    connections carry them all)."""
    comms = B.world(2, TIMEOUT_S, transport=network)
    try:
        before = [c.proxy_stats()["call_entries"] for c in comms]
        for n, d in ((3, F32), (5, BF16), (5, F16)):
            res = B.on_threads([lambda c=c: _call("ag", c, n, d) for c in comms])
            want = torch.cat([torch.arange(1, n + 1).to(d)] * 2)
            assert all(torch.equal(y, want) for y in res), res
            res = B.on_threads([lambda c=c: _call("ar-fused", c, n, d) for c in comms])
            assert all(torch.equal(y, 2 * torch.arange(1, n + 1).to(d)) for y in res), res
        assert B.healthy(comms, 3) is None  # (an all-gather and a reduce-scatter)
        collectives = 3 * 2 + 2  # (a fused all-reduce is one collective: one seq)
        busy = [cn for cn in comms[0].plan.connections if cn.root == 0]
        assert len(busy) < len(comms[0].plan.connections)  # (two roots)
        for c, b in zip(comms, before):
            sent = c.proxy_stats()["call_entries"] - b
            assert sent == len(busy) * collectives, (sent, c.plan.connections)
    finally:
        B.on_threads([c.close for c in comms])
