"""ibv_reg_mr refused with ENOMEM (issue 32; GB10 kernels do that when pinned memory or CMA
runs out), through the emulated NIC: at creation every rank raises an error that names
ibv_reg_mr and ENOMEM, and at the lazy reduce-scatter setup every rank raises
CollectiveError; nothing is left in /dev/shm and a new communicator works once
registrations succeed again."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import emunic  # noqa: E402

import sparkccl  # noqa: E402
from helpers import shm_leftovers  # noqa: E402
from sparkccl.localrun import run_ranks  # noqa: E402


def _comm(store, prefix, rank, world):
    return sparkccl.Communicator(store=dist.PrefixStore(prefix, store), rank=rank,
                                 world_size=world, transport="verbs", timeout_s=5,
                                 slot_bytes=1 << 20)


def enomem_job(rank, world, store, root):
    out = {}
    if rank == 0:
        emunic.refuse_registrations(root)
    store.set(f"refusing{rank}", "1")
    store.wait([f"refusing{r}" for r in range(world)])
    try:  # at creation
        _comm(store, "create", rank, world).close()
        out["create"] = None
    except Exception as e:  # noqa: BLE001 - the type is part of the finding
        out["create"] = f"{type(e).__name__}: {e}"
    store.set(f"created{rank}", "1")
    store.wait([f"created{r}" for r in range(world)])
    if rank == 0:
        emunic.refuse_registrations(root, False)
    store.set(f"allowed{rank}", "1")
    store.wait([f"allowed{r}" for r in range(world)])
    comm = _comm(store, "lazy", rank, world)
    out["token"] = comm.token
    y = comm.all_gather(torch.full((64,), float(rank)))
    out["ag"] = y.view(world, -1)[:, 0].tolist()
    store.set(f"ag{rank}", "1")
    store.wait([f"ag{r}" for r in range(world)])
    if rank == 0:
        emunic.refuse_registrations(root)
    store.set(f"refusing2{rank}", "1")
    store.wait([f"refusing2{r}" for r in range(world)])
    try:  # the reduce-scatter buffers are registered on first use
        comm.reduce_scatter(torch.ones(world * 8, 4))
        out["lazy"] = None
    except Exception as e:  # noqa: BLE001
        out["lazy"] = f"{type(e).__name__}: {e}"
    comm.close()
    store.set(f"closed{rank}", "1")
    store.wait([f"closed{r}" for r in range(world)])
    if rank == 0:
        emunic.refuse_registrations(root, False)
    store.set(f"allowed2{rank}", "1")
    store.wait([f"allowed2{r}" for r in range(world)])
    with _comm(store, "after", rank, world) as c:
        z = c.reduce_scatter(torch.ones(world * 8, 4))
        out["after"] = bool((z == world).all())
    return out


@pytest.mark.slow
def test_registration_refused_with_enomem(tmp_path):
    root = tmp_path / "emunic"
    env = emunic.host_env(root)
    res = run_ranks(enomem_job, 2, args=(str(root),), env=env, timeout_s=120)
    for r in res:
        assert r.ok, (r.error_type, r.message)
        v = r.value
        assert v["create"] is not None and "ibv_reg_mr" in v["create"], v
        assert "ENOMEM" in v["create"] or "Cannot allocate memory" in v["create"], v
        assert v["ag"] == [0.0, 1.0], v
        assert v["lazy"] is not None and v["lazy"].startswith("CollectiveError"), v
        assert "ibv_reg_mr" in v["lazy"] and "Cannot allocate memory" in v["lazy"], v
        assert v["after"], v
        assert shm_leftovers(v["token"]) == []
