"""A slice of benchmarks/lifetimes.py: create / collective / close cycles and two
communicators alive at once (a TP group's all-gather / reduce-scatter / all-reduce beside an
EP group's dispatch + combine) leave the fd, thread, /dev/shm, locked-memory and (the
emulated NIC) memory-registration counts where they started (the record of 1,000 cycles per
transport: benchmarks/lifetimes_cpu.txt)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import lifetimes  # noqa: E402

from sparkccl.localrun import check, run_ranks


# tcp and verbs (~10 s each here) in the long run (-m "", CI); shm in the quick one
@pytest.mark.parametrize("transport", ["shm", pytest.param("tcp", marks=pytest.mark.slow),
                                       pytest.param("verbs", marks=pytest.mark.slow)])
def test_cycles_and_two_live_communicators_leak_nothing(transport, tmp_path):
    env = {}
    if transport == "verbs":
        import emunic
        env = emunic.host_env(tmp_path / "emunic")
    values = check(run_ranks(lifetimes.lifetime_job, 2, args=(6, 2, transport), env=env,
                             timeout_s=180))
    for v in values:
        assert v["wrong"] == 0, v
        for k in lifetimes.COUNTED:
            assert v["start"][k] == v["after_cycles"][k] == v["end"][k], (k, v)
    if transport == "verbs":  # registrations were counted: the communicators made some
        assert all(v["registered_peak"] > 0 for v in values)
