"""A rank that ends without ``close()`` still delivers what it owes (issue 32).

The defect: a rank returned from its last reduce-scatter and exited (at-exit teardown);
its proxy had not yet posted that collective's pieces to the peer, so the peer, still
receiving, raised ``peer 0 (pid N) exited``. The cases make the race certain instead of
rare: the exiting rank's proxy naps ``SLOW_NAP_US`` between turns (spin 0), so its posts
come well after its own collective returned, while the peers' proxies are quick.
"""
from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

import sparkccl
from helpers import shm_leftovers
from sparkccl.localrun import check, run_ranks
from sparkccl.reference import (all_gather_reference, bits, make_input,
                                reduce_scatter_reference)

SLOW_NAP_US = 500_000
SLOW_PROXY = {"SPARKCCL_PROXY_SPIN_US": "0", "SPARKCCL_PROXY_NAP_US": str(SLOW_NAP_US)}
_kept = []  # communicators left open on purpose: the process ends without close()


def _open(store, prefix, rank, world, topology, transport="shm", timeout_s=20.0):
    return sparkccl.Communicator(store=dist.PrefixStore(prefix, store), rank=rank,
                                 world_size=world, topology=topology, transport=transport,
                                 timeout_s=timeout_s, slot_bytes=1 << 20)


def _one(comm, op, seed):
    w, r = comm.world_size, comm.rank
    xs = [make_input(seed, i, (w * 4, 96), torch.bfloat16) for i in range(w)]
    if op == "rs":
        return bool((bits(comm.reduce_scatter(xs[r])) == reduce_scatter_reference(xs, r)).all())
    return bool((bits(comm.all_gather(xs[r])) == all_gather_reference(xs)).all())


# (topology, transport, op): rank 0 drops the communicator right after the collective
# (Communicator.__del__), the others check their result and close().
DROPPED = [("ring", "shm", "rs"),   # rank 0 also relays the others' chunks
           ("ring", "shm", "ag"),
           ("mesh", "tcp", "rs")]   # tcp: the pieces and a goodbye go out before the sockets close


def leave_without_close_job(rank, world, store):
    out = {"dropped": [], "tokens": []}
    for k, (topo, transport, op) in enumerate(DROPPED):
        comm = _open(store, f"drop{k}", rank, world, topo, transport)
        out["tokens"].append(comm.token)
        ok = _one(comm, op, k)
        if rank == 0:
            del comm
            gc.collect()
        else:
            t0 = time.monotonic()
            comm.close()  # rank 0 told the store it left: no wait for it
            out.setdefault("close_s", []).append(time.monotonic() - t0)
        out["dropped"].append(ok)
    # A collective past the leaver's last one needs it: fails at once, naming it.
    comm = _open(store, "past", rank, world, "mesh", timeout_s=8.0)
    out["tokens"].append(comm.token)
    assert _one(comm, "ag", 9)
    if rank == 0:
        del comm
        gc.collect()
    else:
        t0 = time.monotonic()
        try:
            _one(comm, "ag", 10)
            out["past"] = None
        except sparkccl.CollectiveError as e:
            out["past"], out["past_s"] = str(e), time.monotonic() - t0
        comm.close()
    # The end of the script: the last collective, then the process exits without close().
    comm = _open(store, "exit", rank, world, "mesh")
    out["tokens"].append(comm.token)
    _kept.append(comm)
    out["at_exit"] = _one(comm, "rs", 11)
    return out


def test_a_rank_that_leaves_without_close_delivers_its_last_collective():
    """World 3, rank 0's proxy slow: dropped communicators (ring reduce-scatter with relays,
    ring all-gather, tcp), one collective past the leaver's last, and the exit itself."""
    res = run_ranks(leave_without_close_job, 3, rank_env={0: SLOW_PROXY}, timeout_s=180)
    values = check(res)
    for r, v in enumerate(values):
        assert v["dropped"] == [True] * len(DROPPED) and v["at_exit"], (r, v)
    for v in values[1:]:
        assert max(v["close_s"]) < 5.0, v  # not the bootstrap timeout
        assert v["past"] is not None and "peer 0" in v["past"], v
        assert "left the communicator without close() after seq 0" in v["past"], v
        assert v["past_s"] < 2.0, v  # the proxy's watch, not the 8 s timeout
    for token in values[0]["tokens"]:
        assert shm_leftovers(token) == []
