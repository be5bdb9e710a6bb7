"""The verbs transport end to end through the emulated RoCE NIC (tests/emunic): what the
device looks like, and the failures RC semantics must turn into errors -- a killed peer
(retry exceeded on every survivor), a bad rkey (remote access error), a port going down or
a device failing (async events), and a host whose PCIe reorders posted writes (inline ordering caught by the
lane check, strict ordering exact). The bit-exact collectives over it are in
test_comm_exact.py and test_comm_burst.py.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import sparkccl
import sparkccl._native as N
from sparkccl import layout as L
from sparkccl.errors import CollectiveError
from sparkccl.localrun import check, run_ranks
from sparkccl.reference import all_gather_reference, bits, make_input, reduce_scatter_reference

import emunic
from fakesysfs import GB10
from helpers import killed_peer_job
# The in-process worlds of the fake-verbs tests run unchanged over the emulated NIC.
from test_verbs_fake import VWorld, _wait_abort, bad_rkey_case  # noqa: E402

# A lost peer fails after 4.096 us x 2^12 x (1 + 2) = 50 ms instead of the default ~8.6 s.
FAST_RETRY = {"SPARKCCL_IB_TIMEOUT": "12", "SPARKCCL_IB_RETRY_CNT": "2"}


@pytest.fixture
def in_process(emunic_host, monkeypatch):
    """This process's verbs calls go to the emulated NIC of the session's host."""
    root, env = emunic_host
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return root


def test_devices_look_like_a_gb10(in_process):
    ok, lib = N.verbs_library()
    assert ok and lib == emunic.library_path(), lib
    lanes = [(name, 1, emunic.GID_INDEX) for name in GB10]
    ep = N.VerbsEndpoint(0, 2, lanes, [[1, ch, k] for ch in (0, 1) for k in (0, 1)], [0, 1, 2, 3])
    try:
        for info, (name, (pci, netdev, ipv4)) in zip(ep.lanes(), GB10.items()):
            assert info["device"] == name
            assert info["state"] == 4 and info["link_layer"] == 2  # ACTIVE, Ethernet
            assert info["active_mtu"] == 5  # 4096: netdev MTU 9000 less the RoCE headers
            ip = bytes(int(x) for x in ipv4.split("/")[0].split("."))
            assert info["gid"] == bytes(10) + b"\xff\xff" + ip  # RoCE v2 GID of the root's IPv4
        qpns = [c["qpn"] for c in ep.connections()]
        assert len(set(qpns)) == 4 and all(0 < q < 1 << 24 for q in qpns)
        assert ep.qp_states() == [1, 1, 1, 1]  # INIT
    finally:
        ep.close()


def _exact_job(rank, world, store, topology):
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology=topology,
                               transport="verbs", timeout_s=60) as comm:
        xs = [make_input(3, r, (1000, 7), torch.float32) for r in range(world)]
        ag = bool((bits(comm.all_gather(xs[rank])) == all_gather_reference(xs)).all())
        xs = [make_input(4, r, (world * 64, 33), torch.bfloat16) for r in range(world)]
        rs = bool((bits(comm.reduce_scatter(xs[rank])) == reduce_scatter_reference(xs, rank)).all())
        return comm.transport, ag, rs


def _lanes_job(rank, world, store, topology):
    from sparkccl import selftest
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology=topology,
                               transport="verbs", timeout_s=60) as comm:
        return selftest.lanes(comm), selftest.port_rate(comm), sorted(comm.lanes())


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["mesh", "ring"])
def test_selftest_prints_the_lanes_and_the_port_rate(emunic_env, topology):
    """selftest's lane lines and link rate come from the communicator's transport (they
    printed nothing while selftest read an attribute the communicator no longer had)."""
    res = run_ranks(_lanes_job, 2, args=(topology,), env=emunic_env, timeout_s=120)
    for r in res:
        assert r.ok, r.message
        lines, rate, lanes = r.value
        channels = {ch for ch, _ in lanes}
        assert lanes == [(ch, k) for ch in sorted(channels) for k in (0, 1)]
        assert len(lines) == len(lanes)
        assert all(any(dev in line for dev in GB10) and " port 1, GID " in line
                   for line in lines), lines
        assert "no RDMA lanes" not in " ".join(lines)
        assert rate is not None and rate > 0


@pytest.mark.slow
def test_killed_peer_is_retry_exceeded_on_every_survivor(emunic_env):
    """Rank 1 dies: the survivors' writes to it are never acknowledged, their QPs fail with
    retry-exceeded after timeout x retries, and each raises CollectiveError (long before the
    60 s collective timeout)."""
    # The liveness channel would see the death first (tests/test_liveness.py): off here.
    res = run_ranks(killed_peer_job, 3, args=("verbs", 1 << 14), env={**emunic_env, **FAST_RETRY, "SPARKCCL_LIVENESS_S": "0"},
                    timeout_s=120)
    assert res[1].killed, res[1]
    for r in (0, 2):
        assert res[r].ok, res[r].message
        msg, dt = res[r].value
        assert msg is not None, f"rank {r} did not fail"
        assert dt < 20, (r, dt, msg)
        # Its own QP to rank 1 failed, or the other survivor's abort record said so first.
        assert "transport retry counter exceeded (status 12" in msg, msg
        assert "peer 1" in msg, msg


def test_bad_rkey_is_remote_access_error(in_process):
    bad_rkey_case("remote access error (status 10")


def test_port_down_is_an_async_event_on_every_rank(in_process):
    w = VWorld("mesh", 2, 2, 4096)
    try:
        w.check_setup()
        w.start()
        emunic.set_port_state(in_process, "roceP2p1s0f1", active=False)
        for r in (0, 1):
            code, text = _wait_abort(w, r)
            assert code in (L.ABORT_TRANSPORT, L.ABORT_PEER), text
        texts = [N.error_text(w.ctl[r].addr) for r in (0, 1)]
        assert any("device roceP2p1s0f1: async event port error (event 10) on port 1" in t
                   for t in texts), texts
    finally:
        emunic.set_port_state(in_process, "roceP2p1s0f1", active=True)
        w.stop()


def test_device_fatal_is_an_async_event(in_process):
    w = VWorld("mesh", 2, 1, 4096)
    marker = in_process / "emunic" / "fatal-rocep1s0f1"
    try:
        w.check_setup()
        w.start()
        marker.write_text("")
        code, text = _wait_abort(w, 0)
        assert code in (L.ABORT_TRANSPORT, L.ABORT_PEER), text
        texts = [N.error_text(w.ctl[r].addr) for r in (0, 1)]
        assert any("device rocep1s0f1: async event local catastrophic error (event 8)" in t
                   for t in texts), texts
    finally:
        marker.unlink(missing_ok=True)
        w.stop()


def _ordering_job(rank, world, store, ordering):
    import torch.distributed as dist
    os.environ["SPARKCCL_IB_ORDERING"] = ordering
    try:
        with sparkccl.Communicator(store=dist.PrefixStore(ordering, store), rank=rank,
                                   world_size=world, topology="ring", transport="verbs",
                                   timeout_s=60) as comm:
            xs = [make_input(1, r, (1 << 16,), torch.float32) for r in range(world)]
            ag = bool((bits(comm.all_gather(xs[rank])) == all_gather_reference(xs)).all())
            xs = [make_input(2, r, (world * 33, 65), torch.float32) for r in range(world)]
            y = comm.reduce_scatter(xs[rank])
            return None, [ag, bool((bits(y) == reduce_scatter_reference(xs, rank)).all())]
    except CollectiveError as e:
        return str(e), None


def _reorder_job(rank, world, store):
    return _ordering_job(rank, world, store, "inline"), _ordering_job(rank, world, store, "strict")


@pytest.mark.slow
def test_reordering_pcie_breaks_inline_ordering_and_strict_fixes_it(tmp_path):
    """A host whose PCIe lets a data write land after the flag that follows it (the emulated
    NIC delays non-inline write data by 1 s): with the default inline ordering the lane
    check sees a flag before its data and every rank refuses to start; with
    SPARKCCL_IB_ORDERING=strict (the flag stored after the receive completion, which
    follows every earlier write) the collectives are exact."""
    env = emunic.host_env(tmp_path / "host", reorder_ms=1000)
    for r, ((err, _), (strict_err, out)) in enumerate(
            check(run_ranks(_reorder_job, 3, env=env, timeout_s=180))):
        assert err is not None, f"rank {r} started despite the reordering"
        assert "does not keep the ordering contract" in err, err
        assert "SPARKCCL_IB_ORDERING=strict" in err, err
        assert strict_err is None, f"rank {r}: {strict_err}"
        assert out == [True, True], (r, out)


def _traced_job(rank, world, store):
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology="mesh",
                               transport="verbs", timeout_s=60) as comm:
        xs = [make_input(5, r, (1 << 18,), torch.float32) for r in range(world)]
        emunic.take_trace()

        def barrier(key):  # (bounded by run_ranks' limit)
            store.add(key, 1)
            while store.add(key, 0) < world:
                time.sleep(0.001)
        barrier("cleared")  # no rank sends before every rank's trace is empty
        ag = bool((bits(comm.all_gather(xs[rank])) == all_gather_reference(xs)).all())
        barrier("done")  # every rank's sends have gone out once all are done
        time.sleep(0.05)
        return ag, emunic.take_trace()


@pytest.mark.slow
def test_rate_limit_slots_follow_the_posts_and_never_overlap(tmp_path):
    """The emulated NIC's token bucket (emunic.cpp: pace): on every root, a work request's
    slot on the link starts no earlier than it was posted and than the previous slot ended
    (payload + 64 bytes at the rate), so the link never runs faster than its rate, however
    late the sender thread got to it; every write sent lands at its peer."""
    rate = 2.0  # Gb/s
    env = emunic.host_env(tmp_path / "host", rate_gbps=rate, trace=True)
    res = check(run_ranks(_traced_job, 2, env=env, timeout_s=120))
    sent, landed = {}, {}
    for rank, (ag, trace) in enumerate(res):
        assert ag, f"rank {rank}: all_gather not exact"
        by_dev = {}
        for f in trace:
            if f[0] == "S":
                qpn, seq, ln, posted, slot, go = (int(x) for x in (f[2], f[3], f[5], f[6], f[7], f[8]))
                by_dev.setdefault(f[1], []).append((slot, posted, ln))
                sent[(qpn, seq)] = go
            elif f[0] == "R":
                landed[(int(f[2]), int(f[3]))] = int(f[8])
        assert sum(len(v) for v in by_dev.values()) >= 2 * 8 * 2, by_dev.keys()  # both roots
        for dev, wrs in by_dev.items():
            wrs.sort()
            for (s0, _, n0), (s1, p1, _) in zip(wrs, wrs[1:]):
                assert s1 >= p1, (rank, dev, "slot before the post")
                assert s1 >= s0 + int((n0 + 64) * 8 / rate), (rank, dev, "slots overlap")
    assert set(sent) <= set(landed), "a write sent never landed"
    assert all(landed[k] >= sent[k] for k in sent)


@pytest.mark.slow
def test_relay_lead_ring_is_exact(emunic_env):
    """SPARKCCL_RELAY_LEAD (own pieces held back behind the relays on their connection)
    across processes over the emulated NIC: ring world 5, every collective bit-exact."""
    res = check(run_ranks(_exact_job, 5, args=("ring",),
                          env={**emunic_env, "SPARKCCL_RELAY_LEAD": "1"}, timeout_s=180))
    assert res == [("verbs", True, True)] * 5, res
