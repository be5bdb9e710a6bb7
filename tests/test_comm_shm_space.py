"""A /dev/shm too small for the communicator: a clear ShmSpaceError on every rank, at
creation or at the first reduce-scatter (the lazily created buffers), never SIGBUS, and
nothing left in /dev/shm.

The ranks run in a private mount namespace with a small tmpfs on /dev/shm
(``unshare -m``, as root): this file re-executes itself there (``main``)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

# Multi-process, minutes on 2 cores: left out of the default run (README "Tests").
pytestmark = pytest.mark.slow

SLOT = 1 << 20  # world 2: 3.1 MiB at creation, +4.0 MiB reduce-scatter buffers per rank


def _job(rank, world, store):
    import torch
    import sparkccl
    from sparkccl import ShmSpaceError
    out = {}
    try:
        comm = sparkccl.Communicator(store=store, rank=rank, world_size=world, slot_bytes=SLOT,
                                     timeout_s=30)
    except ShmSpaceError as e:
        return dict(at="create", error=str(e), cls=type(e).__name__)
    x = torch.full((4096,), float(rank))
    out["ag"] = comm.all_gather(x).tolist()[::4096]
    try:
        comm.reduce_scatter(torch.ones(2 * 4096))
        out["rs"] = None
    except ShmSpaceError as e:
        out["rs"] = str(e)
        out["cls"] = type(e).__name__
    out["ag_after"] = comm.all_gather(x).tolist()[::4096]  # still usable
    out["pinned"] = comm.pinned_bytes
    comm.close()
    return out


def main(size: str) -> None:
    from sparkccl.localrun import run_ranks
    res = run_ranks(_job, 2, timeout_s=120)
    left = sorted(n for n in os.listdir("/dev/shm") if n.startswith("sparkccl-"))
    print(json.dumps(dict(values=[r.value for r in res],
                          errors=[r.message or r.error_type for r in res], left=left)))


def _run_in_small_shm(size: str) -> dict:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a private small /dev/shm")
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_comm_shm_space as t; t.main({size!r})"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"unshare -m is not permitted here: {probe.stderr.strip()}")
    cmd = (f"mount -t tmpfs -o size={size} tmpfs /dev/shm && "
           f"exec {sys.executable} -c \"{code}\"")
    p = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def _check_message(msg: str) -> None:
    assert "/dev/shm is too small" in msg and "cannot reserve" in msg, msg
    assert "free" in msg and "Each rank needs 7.1 MiB of /dev/shm" in msg, msg
    assert "--shm-size=" in msg and "SPARKCCL_SLOT_BYTES" in msg, msg


def test_too_small_at_creation_fails_every_rank_cleanly():
    r = _run_in_small_shm("4m")  # one rank's 3.1 MiB fits, not two
    assert r["errors"] == [None, None], r
    for v in r["values"]:
        assert v["at"] == "create" and v["cls"] == "ShmSpaceError", r
        _check_message(v["error"])
    assert r["left"] == [], r


def test_too_small_for_reduce_scatter_fails_every_rank_and_keeps_all_gather():
    r = _run_in_small_shm("10m")  # creation (6.2 MiB) fits, the 2 x 4 MiB reduce-scatter not
    assert r["errors"] == [None, None], r
    for v in r["values"]:
        assert v["ag"] == [0.0, 1.0] and v["ag_after"] == [0.0, 1.0], r
        assert v["cls"] == "ShmSpaceError", r
        _check_message(v["rs"])
        assert v["pinned"] < 4 << 20, r  # the reduce-scatter buffers were given back
    assert r["left"] == [], r
