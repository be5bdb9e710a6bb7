"""A seeded slice of the generated bad input (tests/badinput.py; the record of hundreds is
benchmarks/bad_input_cpu.txt): every bad call refused with ValueError / TypeError before
anything is sent, cross-rank mismatches fail on every rank (naming both calls: exact bytes and
dtypes, also where sizes pad alike or dtypes have one width), malformed
join records refused with a clear error. Ranks are threads of this process."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, seed, settings

import badinput as B
from sparkccl import bootstrap, config, wiring

FAST = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def pair():
    comms = B.world()
    yield comms
    assert B.healthy(comms, 5) is None  # nothing was sent: the next collectives are exact
    B.on_threads([c.close for c in comms])


def test_generated_bad_calls_are_refused_before_sending(pair):
    problems = []

    @seed(32)
    @FAST
    @given(data=B.st.data())
    def one(data):
        label, call, expected = data.draw(B.local_bad_calls(pair[0]))
        p = B.refused(pair[0], label, call, expected)
        if p:
            problems.append(p)
    one()
    assert problems == []


@seed(33)
@settings(max_examples=6, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(case=B.mismatches())
def test_generated_cross_rank_mismatches_fail_on_every_rank(case):
    sub, specs = case
    assert B.run_mismatch(sub, specs, seed=1) is None


class _Rv:
    """A Rendezvous stand-in whose exchange hands back prepared records."""
    def __init__(self, records):
        self.records = records

    def exchange(self, name, value, what):
        return [value if r is None else r for r in self.records]


@pytest.mark.parametrize("peer,match", [
    ({"version": 0}, "has protocol version 0, and this rank speaks 1"),
    ({"version": 1, "world": 2}, "is truncated: it has no topology, transport"),
    (["not", "a", "dict"], "is not a record"),
])
def test_malformed_join_records_are_refused(peer, match):
    s = config.resolve(slot_bytes=1 << 20, timeout_s=5, local_ranks=2)
    with pytest.raises(ValueError, match=f"rank 1's join record {match}"):
        wiring.join(_Rv([None, peer]), 2, "mesh", "shm", s)


def test_a_truncated_store_message_is_refused():
    import torch.distributed as dist
    st = dist.HashStore()
    rv = bootstrap.Rendezvous(st, "p", 0, 2, 1.0)
    st.set(rv.key("info", 1), json.dumps({"version": 1, "world": 2})[:9])
    with pytest.raises(ValueError, match="rank 1's 'info' message in the store is not one"):
        rv.exchange("info", {"version": 1}, "join")
