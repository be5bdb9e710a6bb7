"""The liveness channel (sparkccl/liveness.py): over verbs (the emulated RoCE NIC, default
RC retries of ~8.6 s) a peer killed with SIGKILL or stopped with SIGSTOP fails every
survivor within 2 s (plus scheduling slack) with a cause naming the liveness channel; a
clean close is not a death; SPARKCCL_LIVENESS_S=0 turns it off; over tcp between network
namespaces, a box whose links go down fails the survivors within ~2 s, not at the
collective timeout.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch

import sparkccl
from sparkccl.errors import CollectiveError
from sparkccl.localrun import run_ranks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netns  # noqa: E402

# Multi-process, minutes on 2 cores: left out of the default run (README "Tests").
pytestmark = pytest.mark.slow

TIMEOUT_S = 60  # the collective timeout: far above what the liveness channel needs
SLACK_S = 2.5   # scheduling on a loaded 2-core host, process teardown


def _victim_job(rank, world, store, transport, victim, how, topology):
    """Every rank runs all-gathers until rank ``victim`` kills or stops itself; the
    survivors report (error text, seconds from the victim's signal to the error)."""
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology=topology,
                               transport=transport, timeout_s=TIMEOUT_S) as comm:
        x = torch.full((4096,), float(rank))
        comm.all_gather(x)
        store.add("ready", 1)
        while store.add("ready", 0) < world:
            time.sleep(0.01)
        if rank == victim:
            store.set("victim_pid", str(os.getpid()))
            store.set("t_signal", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            time.sleep(3600)  # SIGSTOP: the parent kills it at the end
        try:
            while True:
                y = comm.all_gather(x)
                assert y.view(world, -1)[:, 0].tolist() == [float(q) for q in range(world)]
        except CollectiveError as e:
            t = time.time()
            try:  # a stopped victim never exits by itself
                os.kill(int(store.get("victim_pid")), signal.SIGKILL)
            except ProcessLookupError:
                pass
            return str(e), t - float(store.get("t_signal").decode())


def _survivors(results, victim):
    out = []
    for r in results:
        if r.rank == victim:
            continue
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.message}\n{r.traceback}"
        out.append(r.value)
    return out


@pytest.mark.parametrize("how,world,topology", [("kill", 3, "mesh"), ("stop", 2, "mesh"),
                                                 ("kill", 4, "ring")])
def test_verbs_dead_peer_fails_survivors_within_2s(emunic_env, how, world, topology):
    victim = 1
    res = run_ranks(_victim_job, world, args=("verbs", victim, how, topology),
                    env=emunic_env, timeout_s=120)
    if how == "kill":
        assert res[victim].killed, res[victim]
    for msg, dt in _survivors(res, victim):
        assert "liveness" in msg, msg
        assert f"peer {victim}" in msg, msg
        if how == "kill":
            assert "closed its liveness connection" in msg, msg
        else:
            assert "stopped answering on the liveness channel (no heartbeat for 1.5 s" in msg, msg
        assert dt < 2 + SLACK_S, (dt, msg)


def _clean_close_job(rank, world, store, transport):
    import logging
    seen = []
    handler = logging.Handler()
    handler.emit = lambda rec: seen.append(rec.getMessage())
    logging.getLogger("sparkccl").addHandler(handler)
    with sparkccl.Communicator(store=store, rank=rank, world_size=world,
                               transport=transport, timeout_s=TIMEOUT_S) as comm:
        assert comm._wiring.liveness is not None
        y = comm.all_gather(torch.full((8,), float(rank)))
        time.sleep(0.5 * rank)  # ranks reach close() at different times
    # A second communicator after the first closed cleanly: no stale abort, works.
    with sparkccl.Communicator(store=store, rank=rank, world_size=world,
                               transport=transport, timeout_s=TIMEOUT_S) as comm:
        time.sleep(2.5)  # longer than the dead-after time: heartbeats keep it alive
        z = comm.all_gather(torch.full((8,), float(rank)))
    return y.tolist() == z.tolist(), [m for m in seen if "close()" in m or "liveness" in m]


def test_clean_close_is_not_a_death(emunic_env):
    for r in run_ranks(_clean_close_job, 3, args=("verbs",), env=emunic_env, timeout_s=120):
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.message}"
        same, warnings = r.value
        assert same and warnings == [], (r.rank, warnings)


def _off_job(rank, world, store):
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, transport="tcp",
                               timeout_s=TIMEOUT_S) as comm:
        return comm._wiring.liveness is None, comm.all_gather(torch.tensor([rank])).tolist()


def test_setting_zero_turns_it_off():
    for r in run_ranks(_off_job, 2, env={"SPARKCCL_LIVENESS_S": "0"}, timeout_s=120):
        assert r.ok, r.message
        assert r.value == (True, [0, 1])


# ---------------------------------------------------------------- tcp, a box's links down

def _netns_job(rank, world, store, marker_dir):
    x = torch.full((4096,), float(rank))
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology="ring",
                               transport="tcp", timeout_s=TIMEOUT_S) as comm:
        comm.all_gather(x)
        open(os.path.join(marker_dir, f"started{rank}"), "w").close()
        try:
            t_end = time.monotonic() + 90
            while time.monotonic() < t_end:
                comm.all_gather(x)
        except CollectiveError as e:
            return str(e), time.time()
        return None, None


@pytest.mark.skipif(netns.unavailable_reason() is not None,
                    reason=f"namespace testbed: {netns.unavailable_reason()}")
def test_tcp_box_links_down_fails_survivors_within_2s():
    """Box 1 loses every link (its management link too: the host is cut off). Its peers'
    tcp sockets see nothing (no RST on a dead link); the liveness channel fails them."""
    world, victim = 3, 1
    with netns.Fabric("ring", world) as fab:
        marker = os.path.join(fab.tmp, "markers")
        os.makedirs(marker)
        run = fab.start(_netns_job, (marker,))
        deadline = time.monotonic() + 120
        while (len(os.listdir(marker)) < world and time.monotonic() < deadline
               and all(p.poll() is None for p in run.procs)):
            time.sleep(0.05)
        assert len(os.listdir(marker)) == world, "the collectives did not start on every rank"
        time.sleep(0.3)
        t_down = time.time()
        for ifname in ("mg", "nx0", "nx1", "pv0", "pv1"):
            fab.set_link(victim, ifname, up=False)
        for r, p in enumerate(run.procs):
            if r != victim:
                p.wait(timeout=120)
        os.killpg(run.procs[victim].pid, signal.SIGKILL)  # cut off, it cannot close cleanly
        results = run.wait(timeout_s=30)
    for r in results:
        if r.rank == victim:
            continue
        assert r.ok, f"rank {r.rank}: {r.error_type}: {r.message}"
        msg, t = r.value
        assert msg is not None, f"rank {r.rank} never failed"
        assert "stopped answering on the liveness channel" in msg and f"peer {victim}" in msg, msg
        assert t - t_down < 2 + SLACK_S, (t - t_down, msg)
