"""Helpers only the tests use: issuing op lists, bad-input cases, /dev/shm leftovers, a peer
killed between collectives."""
from __future__ import annotations

import os
from typing import Any

from sparkccl.exact_checks import reduce_scatter_via_input


def posted_bytes(comm, limit_s: float = 10.0) -> int:
    """The bytes this rank's proxy has posted (``proxy_stats()["bytes"]``), once every
    collective issued so far went out whole: the proxy may still be posting after a call
    returned."""
    import time
    px = comm._wiring.proxy
    deadline = time.monotonic() + limit_s
    while (px.delivered() < comm.seq or px.outstanding()) and time.monotonic() < deadline:
        time.sleep(0.001)
    return comm.proxy_stats()["bytes"]


def issue_ops(comm, ops, inputs) -> list:
    """Issue ``ops`` back to back on ``comm`` with this rank's ``inputs``: kind "ag" an
    all-gather, "rs" a reduce-scatter, anything else a reduce-scatter through the zero-copy
    input buffer. Returns the outputs, unchecked."""
    out = []
    for (kind, _, shape, dt), x in zip(ops, inputs):
        if kind == "ag":
            out.append(comm.all_gather(x))
        elif kind == "rs":
            out.append(comm.reduce_scatter(x))
        else:
            out.append(reduce_scatter_via_input(comm, x))
    return out




def expect_errors(comm, cases) -> dict[str, Any]:
    """Run bad-input cases (name, fn, exception type, text in the message) on a rank:
    {name: None if fn raised that, else what happened}, then whether the sequence number
    stayed at 0 (nothing was sent)."""
    out: dict[str, Any] = {}
    for name, fn, etype, text in cases:
        try:
            fn()
            out[name] = "no exception"
        except Exception as e:  # noqa: BLE001
            ok = isinstance(e, etype) and text in str(e)
            out[name] = None if ok else f"{type(e).__name__}: {e}"
    out["seq after bad calls"] = None if comm.seq == 0 else f"seq moved to {comm.seq}"
    return out


def assert_no_problems(values: list[dict], at_least: int) -> None:
    """Every rank's {check: None or problem} came back clean, with at least ``at_least``
    checks."""
    for r, v in enumerate(values):
        bad = {k: e for k, e in v.items() if e is not None}
        assert not bad, f"rank {r}: {bad}"
    assert len(values[0]) >= at_least




def shm_leftovers(token: str) -> list[str]:
    """Names in /dev/shm that belong to the communicator with ``token`` (should be none)."""
    from sparkccl.shm import PREFIX, SHM_DIR  # TODO(integrator): sparkccl.transport.shm if moved
    tag = f"-{token}-"
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX) and tag in n)
    except FileNotFoundError:
        return []


def _gone(pid: int) -> bool:
    """Has process ``pid`` died (exited or a zombie not reaped yet)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def killed_peer_job(rank, world, store, transport, numel, op="all_gather"):
    """Every rank gets one ``op`` (a Communicator method taking one tensor: all_gather,
    all_reduce) right, then rank 1 kills itself (SIGKILL) and, once it
    is dead, the survivors go on calling: their next collective's writes to it are never
    acknowledged (had they started while it still ran, its NIC could have acknowledged them
    and the survivors would only wait for its data, until the collective timeout). Returns
    (the survivor's CollectiveError text or None, seconds from the death to it)."""
    import signal
    import time

    import torch

    import sparkccl
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology="mesh",
                               transport=transport, timeout_s=60) as comm:
        x = torch.ones(numel)
        call = getattr(comm, op)
        call(x)
        if rank == 1:
            store.set("victim-pid", str(os.getpid()))
        store.add("first-done", 1)  # every rank has its first result
        while store.add("first-done", 0) < world:
            time.sleep(0.01)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        victim = int(store.get("victim-pid"))
        deadline = time.monotonic() + 30
        while not _gone(victim) and time.monotonic() < deadline:
            time.sleep(0.005)
        t0 = time.monotonic()
        try:
            for _ in range(100):
                call(x)
        except sparkccl.CollectiveError as e:
            return str(e), time.monotonic() - t0
        return None, time.monotonic() - t0


REQUIRE_ENGINES = "TEST_REQUIRE_ENGINES"


def engine_missing(why: str) -> None:
    """vLLM / SGLang cannot be used here: skip, or fail where they must be
    (TEST_REQUIRE_ENGINES=1: benchmarks/integrations_check.sh, which installs them)."""
    import pytest
    if os.environ.get(REQUIRE_ENGINES) == "1":
        pytest.fail(f"{REQUIRE_ENGINES}=1 and {why}", pytrace=False)
    pytest.skip(why)
