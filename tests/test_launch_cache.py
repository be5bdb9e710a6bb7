"""The CPU data plane's launch plans (built by the first call of an (op, length, slot, dtype),
reused after; counted by ``plan_stats``) and the proxy's publish -> first post latency
stats. Results are checked bit for bit against the rank-order references, with the cache
on and off."""
from __future__ import annotations

import time

import pytest
import torch

import sparkccl
from sparkccl.localrun import check, run_ranks
from sparkccl.reference import all_gather_reference, bits, make_input, reduce_scatter_reference


def _ag(comm, seed, shape, dtype):
    xs = [make_input(seed, r, shape, dtype) for r in range(comm.world_size)]
    y = comm.all_gather(xs[comm.rank])
    return bool((bits(y) == all_gather_reference(xs)).all())


def _rs(comm, seed, m, h, dtype):
    xs = [make_input(seed, r, (comm.world_size * m, h), dtype) for r in range(comm.world_size)]
    y = comm.reduce_scatter(xs[comm.rank])
    return bool((bits(y) == reduce_scatter_reference(xs, comm.rank)).all())


def _cache_job(rank, world, store):
    log = []
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, transport="shm",
                               slot_bytes=1 << 20) as comm:
        dp = comm._dp
        st = dp.plan_stats

        def snap(what, ok):
            log.append((what, ok, dict(st)))

        # All-gather, one shape: slots 0, 1, 2 each build a plan; the 4th call reuses slot 0's.
        for k in range(4):
            snap(f"ag{k}", _ag(comm, k, (100, 3), torch.float32))
        # A new shape is a new plan (seq 4: slot 1); the old shape on slot 2 (seq 5) hits.
        snap("ag new shape", _ag(comm, 10, (7, 5), torch.float32))
        snap("ag old shape", _ag(comm, 11, (100, 3), torch.float32))
        # Same bytes, another dtype: all-gather moves bytes, so it is the same plan (seq 6: 0).
        snap("ag same bytes", _ag(comm, 12, (200, 3), torch.bfloat16))
        plans_before_rs = len(dp._plans)
        # The first reduce-scatter attaches its buffers: every plan is dropped, then RS builds
        # its own (seq 7: RS slot 1).
        snap("rs first", _rs(comm, 20, 3, 64, torch.bfloat16))
        snap("ag after drop", _ag(comm, 13, (100, 3), torch.float32))  # seq 8: AG slot 2
        snap("rs slot 1 again", _rs(comm, 21, 3, 64, torch.bfloat16))  # seq 9: RS slot 1
        snap("rs new dtype", _rs(comm, 22, 3, 32, torch.float32))      # seq 10: slot 0, 384 B
        snap("rs again", _rs(comm, 23, 3, 64, torch.bfloat16))         # seq 11: RS slot 1
        # Large slices go piece by piece (8 groups): also exact, with plans and without.
        snap("ag large", _ag(comm, 30, (40000,), torch.float32))
        snap("rs large", _rs(comm, 31, 40000, 1, torch.float32))
        dp.cache_plans = False
        frozen = dict(st)
        snap("ag uncached", _ag(comm, 40, (100, 3), torch.float32))
        snap("rs uncached", _rs(comm, 41, 40000, 1, torch.float32))
        unchanged = dict(st) == frozen
        dp.cache_plans = True
        proxy = comm.proxy_stats()
    return {"log": log, "plans_before_rs": plans_before_rs, "unchanged": unchanged,
            "proxy": proxy}


@pytest.mark.slow
def test_launch_plan_hits_and_invalidation():
    values = check(run_ranks(_cache_job, 2, timeout_s=300))
    for v in values:
        log = {what: (ok, st) for what, ok, st in v["log"]}
        assert all(ok for ok, _ in log.values()), [w for w, (ok, _) in log.items() if not ok]
        hm = {what: (st["hits"], st["misses"], st["dropped"]) for what, (_, st) in log.items()}
        assert hm["ag0"] == (0, 1, 0)
        assert hm["ag2"] == (0, 3, 0)
        assert hm["ag3"] == (1, 3, 0)              # slot 0 reused: a hit
        assert hm["ag new shape"] == (1, 4, 0)     # new shape: a miss
        assert hm["ag old shape"] == (2, 4, 0)
        assert hm["ag same bytes"] == (3, 4, 0)
        assert v["plans_before_rs"] == 4
        assert hm["rs first"] == (3, 5, 4)         # buffers attached: 4 plans dropped
        assert hm["ag after drop"] == (3, 6, 4)    # its plan was dropped: a miss
        assert hm["rs slot 1 again"] == (4, 6, 4)  # the same slot and shape: a hit
        assert hm["rs new dtype"] == (4, 7, 4)     # same bytes, new dtype: a miss
        assert hm["rs again"] == (5, 7, 4)
        assert hm["rs large"] == (5, 9, 4)
        assert v["unchanged"]                      # cache off: nothing counted
        st = v["proxy"]  # (the proxy's publish -> first post stats, over shm)
        assert st["publish_samples"] > 0 and 0 < st["publish_p50_ns"] <= st["publish_p99_ns"]


def _latency_job(rank, world, store, transport):
    with sparkccl.Communicator(store=store, rank=rank, world_size=world,
                               transport=transport) as comm:
        for k in range(6):
            assert _ag(comm, k, (4096,), torch.float32)
        return comm.proxy_stats()


@pytest.mark.slow
def test_proxy_reports_publish_to_post_latency():
    """Over tcp here; shm and the in-process proxies are covered by the tests around."""
    for transport in ("tcp",):
        for st in check(run_ranks(_latency_job, 2, args=(transport,), timeout_s=300)):
            # One sample per piece at its first post. This rank's pieces of the first 5
            # collectives have surely been posted (the peer published collective 6 only after
            # receiving them); the 6th's may still be under way.
            assert 40 <= st["publish_samples"] <= 48, (transport, st)
            assert st["publish_samples"] == st["delay_samples"], (transport, st)
            assert 0 < st["publish_p50_ns"] <= st["publish_p99_ns"], (transport, st)
            # Piece 0 of each collective alone (one in 8 of the samples).
            assert 5 <= st["first_samples"] <= 6, (transport, st)
            assert 0 < st["first_p50_ns"] <= st["first_p99_ns"], (transport, st)
            assert 0 < st["first_delay_p50_ns"] <= st["first_delay_p99_ns"], (transport, st)
            assert st["shm_flag_samples"] == st["shm_worker_sleeps"] == 0, st  # (shm's own)


@pytest.mark.slow
def test_shm_reports_flag_latency():
    """Over shm between processes (world 2, CPU): every data flag the proxy posted is sampled
    on its way through its copy worker (pushed -> taken -> stored) once stored; the figures
    are ordered (per sample taken <= stored, so pushed -> stored bounds pushed -> taken at
    every quantile) and within the run's time."""
    for st in check(run_ranks(_latency_job, 2, args=("shm",), timeout_s=300)):
        # One sample per flag: the proxy's, and the lane check's one per connection at set-up
        # (sparkccl/transport/check.py: through the transport, not the proxy's posts; mesh,
        # 2 roots: 2). The rank returns while its last collective's flags (one per
        # connection) may be on their way; and stats() reads the workers' samples before the
        # proxy's count, which takes a flag right after its push (the post in progress may
        # have its flag sampled and not yet counted).
        lane_checks = 2
        assert st["shm_flag_samples"] > lane_checks, st
        assert -1 <= st["flags"] - (st["shm_flag_samples"] - lane_checks) <= 2, st
        assert 0 < st["write_flag_samples"] <= st["flags"], st
        assert 0 < st["write_flag_p50_ns"] <= st["write_flag_p99_ns"] < 60 * 10**9, st
        for k in ("take", "store", "total"):
            assert 0 <= st[f"shm_flag_{k}_p50_ns"] <= st[f"shm_flag_{k}_p99_ns"] < 60 * 10**9, st
        assert 0 < st["shm_flag_total_p50_ns"], st
        for q in ("p50", "p99"):
            assert st[f"shm_flag_take_{q}_ns"] <= st[f"shm_flag_total_{q}_ns"], st
            assert st[f"shm_flag_store_{q}_ns"] <= st[f"shm_flag_total_{q}_ns"], st
        assert st["shm_worker_sleeps"] >= 0


def test_ce_launch_plans_hit_and_go_stale():
    """Mode "ce" (the copy-engine engine, on the kernels' CPU emulation): the per-piece
    copies, flags and waits are planned once per (op, S, L) as a program; later calls of
    the shape issue it from the plan cache (new pointers, seq, slots and ring indices every
    time: both parities of the reduce-scatter's slots, all three of the all-gather's, a
    zero-copy input too); a rebuilt stream table makes the plan stale. Results stay exact
    throughout."""
    import pytest
    dataplane = pytest.importorskip("test_cuda_dataplane")
    if dataplane.CXX is None:
        pytest.skip("needs g++ to build the CPU emulation of the kernels")
    Op = dataplane.C.Op
    world = 2
    with dataplane.World("emu", "mesh", world, max_slice=1 << 14, direct=True,
                         mode="ce") as w:
        def ag(seed, n):
            xs = dataplane.inputs(seed, world, (n,), torch.uint8)
            outs = w.all_gather(xs)
            w.sync()
            dataplane.check_ag(w, xs, outs)

        def misses():
            return [dp.engines.ce.stats["misses"] for dp in w.dps]

        def fast():  # calls issued from the plan cache
            return [dp.plans.stats["hits"] for dp in w.dps]

        def rs(seed, zero_copy=False):
            xs = dataplane.inputs(seed, world, (world * 1000, 8), torch.bfloat16)
            outs = w.reduce_scatter(xs, zero_copy=zero_copy)
            w.sync()
            dataplane.check_rs(w, xs, outs)

        ag(1, 5000)
        assert misses() == [1] * world and fast() == [0] * world
        for k in range(3):
            ag(2 + k, 5000)
        assert misses() == [1] * world and fast() == [3] * world
        ag(9, 3000)                                  # new length: a new plan
        assert misses() == [2] * world
        for k in range(3):
            rs(10 + k)                               # another op, then from its plan
        assert misses() == [3] * world and fast() == [5] * world
        for k in range(3):
            rs(20 + k, zero_copy=True)               # the input already in the send slot
        assert misses() == [4] * world and fast() == [7] * world
        for dp in w.dps:
            dp._build_direct(Op.AG)                  # the stream table rebuilt: stale
        ag(11, 5000)
        assert misses() == [5] * world and fast() == [7] * world
        w.healthy()


def test_publish_stamp_is_taken_and_cleared():
    """The native publish stamps each ring entry (ENT_PUBLISH_NS, CLOCK_MONOTONIC); the
    proxy takes the stamp and clears the word before handing the slot back, so an entry a
    GPU kernel later writes into the same slot (without a stamp) is not measured. One
    sample per piece at its first post."""
    import numpy as np
    import pytest
    native_tests = pytest.importorskip("test_native")
    from sparkccl import layout as L
    w = native_tests.World("mesh", 2, 1, 4096)
    w.start()
    try:
        for _ in range(3):
            native_tests.run_ag(w, 4096)
        w.check_healthy()
        for r in range(2):
            deadline = time.monotonic() + 10
            while w.proxies[r].stats()["publish_samples"] < 24 and time.monotonic() < deadline:
                time.sleep(0.01)
            st = w.proxies[r].stats()
            assert st["publish_samples"] == st["delay_samples"] == 24, st
            assert 0 < st["publish_p50_ns"] <= st["publish_p99_ns"], st
            ring = w.ctl[r].buf.a[L.RING_OFFSET:L.RING_OFFSET + L.RING_ENTRIES * L.RING_ENTRY_BYTES]
            stamps = ring.view(np.uint64).reshape(L.RING_ENTRIES, -1)[:, L.ENT_PUBLISH_NS // 8]
            assert not stamps.any(), stamps[:24]  # every consumed entry's stamp cleared
        # An entry without a stamp (as the GPU kernels write it): posted, not sampled.
        before = w.proxies[0].stats()["publish_samples"]
        native_tests._put_entry(w.ctl[0], 0, w.seq, 0, -1, 4096)
        deadline = time.monotonic() + 10
        while w.proxies[0].stats()["delay_samples"] < 25 and time.monotonic() < deadline:
            time.sleep(0.01)
        st = w.proxies[0].stats()
        assert st["delay_samples"] == 25 and st["publish_samples"] == before, st
    finally:
        w.stop()
