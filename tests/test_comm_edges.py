"""Edges of creation: a world of one rank (computed locally, bit-exact against the
rank-order references), and the bootstrap timeout (its own setting, honoured as given,
named in the error)."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import sparkccl
from sparkccl.reference import (all_gather_reference, bits, make_finalize_input, make_input,
                                moe_finalize_reference, reduce_scatter_reference)


def _solo(**kw):
    return sparkccl.Communicator(store=dist.HashStore(), rank=0, world_size=1, **kw)


def test_world_one_is_exact_and_holds_nothing():
    with _solo() as comm:
        # Nothing is built: no segment (pinned_bytes counts every one), proxy or transport.
        assert comm.transport == "none" and comm.pinned_bytes == 0
        assert comm.proxy_stats() == {}
        for seed, (shape, dt) in enumerate([((37,), torch.uint8), ((5, 3), torch.float16),
                                            ((), torch.float32), ((4, 8), torch.bfloat16)]):
            x = make_input(seed, 0, shape, dt)
            y = comm.all_gather(x)
            assert y.shape == ((1,) if x.dim() == 0 else x.shape)
            assert (bits(y) == all_gather_reference([x])).all()
        for seed, dt in enumerate((torch.bfloat16, torch.float16, torch.float32)):
            x = make_input(10 + seed, 0, (6, 5), dt)  # -0.0 included: stays -0.0
            assert (bits(comm.reduce_scatter(x)) == reduce_scatter_reference([x], 0)).all()
            buf = comm.reduce_scatter_input(x.shape, dt)
            buf.copy_(x)
            assert (bits(comm.reduce_scatter(buf)) == reduce_scatter_reference([x], 0)).all()
        for seed, fp8 in ((20, False), (21, True)):
            T, Tpad, H = 13, 16, 256
            inp = make_finalize_input(seed, 0, tokens=T, hidden=H, topk=4, experts_rows=9,
                                      fp8=fp8, pow2_weights=not fp8)
            got = comm.moe_finalize_reduce_scatter(inp["y"], inp["pos"], inp["weights"],
                                                   inp["shared"], num_tokens=T,
                                                   padded_tokens=Tpad, y_scales=inp["y_scales"])
            assert got.shape == (Tpad, H)
            assert (bits(got) == moe_finalize_reference([inp], 0, T, Tpad)).all()
        assert comm.seq == 0  # nothing went on a wire
        comm.synchronize()
        bad = inp["pos"].clone()
        bad[5] = 9  # R = 9 rows of y
        with pytest.raises(ValueError, match=r"pos\[5\] = 9 .* not a row of y"):
            comm.moe_finalize_reduce_scatter(inp["y"], bad, inp["weights"], inp["shared"],
                                             num_tokens=T, padded_tokens=Tpad,
                                             y_scales=inp["y_scales"])
    assert comm.closed
    with pytest.raises(ValueError, match="topology='star'"):
        _solo(topology="star")
    with pytest.raises(ValueError, match="slot_bytes=100"):
        _solo(slot_bytes=100)


def _alone(**kw):
    """Rank 0 of a world of 2 whose rank 1 never arrives."""
    t0 = time.monotonic()
    with pytest.raises(sparkccl.CollectiveError) as e:
        sparkccl.Communicator(store=dist.HashStore(), rank=0, world_size=2, **kw)
    return str(e.value), time.monotonic() - t0


def test_bootstrap_timeout_is_honoured_and_named(monkeypatch):
    monkeypatch.delenv("SPARKCCL_BOOTSTRAP_TIMEOUT_S", raising=False)
    monkeypatch.delenv("SPARKCCL_TIMEOUT_S", raising=False)
    msg, elapsed = _alone(timeout_s=60, bootstrap_timeout_s=1.5)
    assert "timed out after 1.5 s (bootstrap_timeout_s=1.5)" in msg, msg
    assert "rank(s) 1 to join the communicator" in msg, msg
    assert elapsed < 30, elapsed  # the argument, not timeout_s, not a hidden 120 s floor
    # Without it, the collective timeout given is used as is (no max(timeout, 120)).
    msg, elapsed = _alone(timeout_s=1.5)
    assert "(bootstrap_timeout_s defaults to timeout_s=1.5)" in msg, msg
    assert elapsed < 30, elapsed
    monkeypatch.setenv("SPARKCCL_BOOTSTRAP_TIMEOUT_S", "1.5")
    msg, _ = _alone(timeout_s=60)
    assert "(SPARKCCL_BOOTSTRAP_TIMEOUT_S=1.5)" in msg, msg


def test_bootstrap_timeout_bad_values():
    from sparkccl.bootstrap import timeout as bootstrap_timeout
    with pytest.raises(TypeError, match="bootstrap_timeout_s must be a number"):
        _solo(bootstrap_timeout_s="soon")
    with pytest.raises(ValueError, match="bootstrap_timeout_s=0: must be > 0"):
        bootstrap_timeout(0, None)
    assert bootstrap_timeout(None, 7)[0] == 7.0
