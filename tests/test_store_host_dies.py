"""The rank that hosts the bootstrap store dies (issue 32): the survivors' collectives fail
naming it, close() does not hang on the lost store, nothing is left in /dev/shm, and a new
communicator (over a store that still runs) works in the same processes."""
from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import sparkccl
from helpers import shm_leftovers
from sparkccl.localrun import KILLED, run_ranks

TIMEOUT = 4.0


def store_host_dies_job(rank, world, store):
    if rank == 0:  # rank 0 hosts the communicator's store, as torchrun's rank 0 does
        own = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                            timeout=timedelta(seconds=30), wait_for_workers=False)
        store.set("port", str(own.port))
    else:
        port = int(store.get("port").decode())
        own = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False,
                            timeout=timedelta(seconds=30))
    comm = sparkccl.Communicator(store=own, rank=rank, world_size=world, timeout_s=TIMEOUT,
                                 slot_bytes=1 << 20)
    store.set(f"token{rank}", comm.token)
    x = torch.full((256,), float(rank))
    assert comm.all_gather(x).view(world, -1)[:, 0].tolist() == [float(r) for r in range(world)]
    store.set(f"done{rank}", "1")
    if rank == 0:
        store.wait([f"done{r}" for r in range(world)])
        store.set("t_kill", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    store.wait(["t_kill"])
    out = {}
    try:
        comm.reduce_scatter(torch.ones(world * 4, 8))  # (needs the store: its first use)
        out["error"] = None
    except sparkccl.CollectiveError as e:
        out["error"] = str(e)
        out["dt"] = time.time() - float(store.get("t_kill").decode())
    t0 = time.monotonic()
    comm.close()
    out["close_s"] = time.monotonic() - t0
    survivors = list(range(1, world))
    with sparkccl.Communicator(store=dist.PrefixStore("after", store),
                               rank=survivors.index(rank), world_size=len(survivors),
                               timeout_s=30) as c2:
        y = c2.all_gather(torch.full((100,), float(c2.rank)))
        out["after"] = y.view(len(survivors), -1)[:, 0].tolist()
    out["token"] = comm.token
    return out


@pytest.mark.slow
def test_the_store_hosts_death_fails_the_survivors_cleanly():
    res = run_ranks(store_host_dies_job, 3, timeout_s=120)
    assert res[0].error_type == KILLED, res[0]
    for r in res[1:]:
        assert r.ok, r
        v = r.value
        # the lazy reduce-scatter setup asks the store first: the store's failure, or the
        # proxy's watch when it saw rank 0's death first
        assert v["error"] is not None and ("bootstrap store failed" in v["error"]
                                           or "peer 0" in v["error"]), v
        assert v["dt"] < TIMEOUT + 1, v
        assert v["close_s"] < TIMEOUT + 1, v  # the lost store does not hold close()
        assert v["after"] == [0.0, 1.0], v
        assert shm_leftovers(v["token"]) == []
