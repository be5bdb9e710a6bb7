"""Expert-parallel dispatch and combine when a peer dies or freezes mid-call (docs/CONTRACT.md
§5, docs/EXPERT_PARALLEL.md "Checks and failures"): every survivor raises
``CollectiveError`` naming itself and the cause within the timeout + 1 s, as for the other
collectives (tests/test_comm_failure.py), and nothing is left in /dev/shm.

Each scenario runs a burst of one operation (dispatch, or combine of one dispatch's
handle) on every rank; a timer on the victim kills it (SIGKILL) or freezes it (SIGSTOP:
its proxy thread too, so nothing of it answers) 0.3 s into the burst (after one
warm-up dispatch and combine), after writing the
time to the store. A frozen victim is sent SIGCONT by a survivor once the survivors have
raised; its own next call then fails too.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import sparkccl
from sparkccl.ep_reference import make_ep_input
from helpers import shm_leftovers
from sparkccl.localrun import KILLED, check, run_ranks

TIMEOUT = 2.0
WORLD, VICTIM = 3, 1
H, K, T = 64, 2, 8


def _burst(comm, op, arm):
    """Dispatch (or combine) over and over until a CollectiveError; returns it and its
    time. ``arm()`` runs once every rank is set up (buffers mapped)."""
    W, r = comm.world_size, comm.rank
    ep = sparkccl.ExpertParallel(comm, num_experts=4 * W, hidden=H, max_tokens=T)
    inp = make_ep_input(7, r, tokens=6, hidden=H, topk=K, num_experts=4 * W, world=W)
    recv, handle = ep.dispatch(inp["x"], inp["topk_idx"], inp["topk_weights"])
    out = torch.zeros_like(recv.x)
    ep.combine(out, handle)  # every rank has been through both once
    comm.all_gather(torch.zeros(1))
    arm()
    try:
        while True:
            if op == "dispatch":
                ep.dispatch(inp["x"], inp["topk_idx"], inp["topk_weights"])
            else:
                ep.combine(out, handle)
    except sparkccl.CollectiveError as e:
        return e, time.time()


def ep_failure_job(rank, world, store, how, phases):
    """``phases``: [(op, topology)], each on a new communicator (a frozen victim survives
    its phase; a killed one ends the run, so it gets one phase)."""
    outs = []
    for n, (op, topology) in enumerate(phases):
        st = dist.PrefixStore(f"{n}-{op}-{how}", store)
        comm = sparkccl.Communicator(store=st, rank=rank, world_size=world,
                                     topology=topology, timeout_s=TIMEOUT,
                                     bootstrap_timeout_s=60,  # set-up is not under test
                                     slot_bytes=1 << 20)
        token = comm.token

        def strike(st=st):
            st.set("struck", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)

        def arm(st=st, strike=strike):
            if rank == VICTIM:
                st.set("victim-pid", str(os.getpid()))
                threading.Timer(0.3, strike).start()
        e, t_err = _burst(comm, op, arm)
        out = dict(phase=f"{op} {topology}", error=str(e), token=token,
                   attrs=(e.rank, e.peer, e.connection, e.cause))
        if rank != VICTIM:
            out["delay"] = t_err - float(st.get("struck").decode())
            st.add("survivors-raised", 1)
            if how == "stop" and rank == 0:
                while st.add("survivors-raised", 0) < world - 1:
                    time.sleep(0.01)
                os.kill(int(st.get("victim-pid")), signal.SIGCONT)
        comm.close()
        out["leftovers"] = shm_leftovers(token)
        outs.append(out)
    return outs


@pytest.mark.parametrize("how,phases", [
    ("kill", [("dispatch", "mesh")]),
    ("kill", [("combine", "ring")]),
    ("stop", [("dispatch", "ring"), ("combine", "mesh")])],
    ids=["kill-dispatch-mesh", "kill-combine-ring", "stop-dispatch-ring-combine-mesh"])
def test_peer_killed_or_frozen_mid_call(how, phases):
    res = run_ranks(ep_failure_job, WORLD, args=(how, phases), timeout_s=120)
    if how == "kill":
        assert res[VICTIM].error_type == KILLED, (res[VICTIM].error_type, res[VICTIM].message)
        survivors = [r for r in res if r.rank != VICTIM]
    else:
        survivors = res
    values = check(survivors)
    for r, outs in zip(survivors, values):
        assert len(outs) == len(phases), (r.rank, outs)
        for v in outs:
            rank, _, _, cause = v["attrs"]
            assert rank == r.rank and cause, (r.rank, v)
            assert f"rank {r.rank}" in v["error"], v["error"]
            if r.rank == VICTIM:  # frozen, then continued: its peers are gone
                continue
            assert v["delay"] <= TIMEOUT + 1.0, (r.rank, v["phase"], v["delay"], v["error"])
            # The cause: the victim (its data, or a peer that reported it), or the timeout.
            # (A survivor that saw the death itself says "peer V (pid N) exited"; one told
            # through another rank's abort words quotes that rank's text, which may say so.)
            named = (f"rank {VICTIM}" in v["error"] or f"peer {VICTIM} " in v["error"]
                     or "relayed by" in v["error"])
            assert named or f"timed out after {TIMEOUT:g} s" in v["error"], v["error"]
            assert not v["leftovers"], v["leftovers"]
    print([(r.rank, v["phase"], round(v.get("delay", -1), 3), v["error"][:160])
           for r, outs in zip(survivors, values) for v in outs])
