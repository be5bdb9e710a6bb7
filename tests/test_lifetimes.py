"""A slice of benchmarks/lifetimes.py: create / collective / close cycles and two
communicators alive at once leave the fd, thread and /dev/shm counts where they started
(the record of 1,000 cycles is benchmarks/lifetimes_cpu.txt)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import lifetimes  # noqa: E402

from sparkccl.localrun import check, run_ranks


def test_cycles_and_two_live_communicators_leak_nothing():
    values = check(run_ranks(lifetimes.lifetime_job, 2, args=(6, 2, "shm"), timeout_s=180))
    for v in values:
        assert v["wrong"] == 0, v
        for k in ("fds", "threads", "shm", "locked_kb"):
            assert v["start"][k] == v["after_cycles"][k] == v["end"][k], (k, v)
