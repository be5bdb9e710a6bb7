"""`sparkccl selftest` (sparkccl/selftest.py): run for real under torchrun with the shm
transport (PASS), with verbs where this host has no RDMA (a FAIL naming the reason on every
rank), and its verdict logic on made-up reports."""
from __future__ import annotations

import io
import os
import shutil
import subprocess

import pytest

from sparkccl import selftest as S

TORCHRUN = shutil.which("torchrun")


def _torchrun(*args, timeout=600):
    if TORCHRUN is None:
        pytest.skip("torchrun not found")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m",
                           "sparkccl.selftest", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.slow
def test_selftest_passes_over_shm():
    res = _torchrun("--transport", "shm", "--quick", "--slot-bytes", "4M")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "bit-exact:" in res.stdout and "all exact" in res.stdout
    assert "selftest: PASS on 2 ranks (mesh/shm)" in res.stdout
    assert "all_gather" in res.stdout and "Gb/s" in res.stdout


@pytest.mark.slow
def test_selftest_without_rdma_fails_with_the_reason():
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this host has RDMA devices")
    res = _torchrun("--quick", "--no-bandwidth", timeout=300)
    assert res.returncode != 0
    assert "selftest: FAIL on 2 ranks (mesh/verbs)" in res.stdout, res.stdout[-3000:]
    assert "ranks 0, 1: FabricError: sparkccl verbs transport" in res.stdout


def test_selftest_needs_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    out = io.StringIO()
    assert S.selftest(out=out) == 2
    assert "torchrun" in out.getvalue()


def _report(rank, **kw):
    rep = {"rank": rank, "host": f"box{rank}", "error": None, "checks": 20, "bad": [],
           "burst_total": 300, "burst_bad": [], "lanes": ["mesh root 0: rocep1s0f1 port 1"],
           "rows": [("all_gather", 1 << 20, 1e-4, 83.9), ("all_gather", 16 << 20, 1e-3, 180.2),
                    ("reduce_scatter", 16 << 20, 1.1e-3, 170.0)],
           "port_gbps": 200.0, "seconds": 3.0}
    rep.update(kw)
    return rep


def test_verdict_pass_names_best_bandwidth():
    out = io.StringIO()
    assert S._print([_report(0), _report(1)], "mesh", "verbs", "cuda", out) == 0
    text = out.getvalue()
    assert text.strip().splitlines()[-1] == (
        "selftest: PASS on 2 ranks (mesh/verbs): every collective bit-exact; all_gather 180.2 "
        "Gb/s (16 MiB per rank), reduce_scatter 170.0 Gb/s (16 MiB per rank)")
    assert "link 200 Gb/s" in text


def test_verdict_fail_on_mismatch_and_slow_note():
    out = io.StringIO()
    reps = [_report(0), _report(1, burst_bad=["burst 0 call 3 (all_gather 7 x uint8)"])]
    assert S._print(reps, "ring", "verbs", "cuda", out) == 1
    assert out.getvalue().strip().splitlines()[-1] == (
        "selftest: FAIL on 2 ranks (ring/verbs): rank 1: MISMATCH burst 0 call 3 "
        "(all_gather 7 x uint8)")
    out = io.StringIO()
    slow = [("all_gather", 16 << 20, 1e-2, 20.0)]
    assert S._print([_report(0, rows=slow), _report(1, rows=slow)], "mesh", "verbs", "cuda",
                    out) == 0
    assert "below half the link rate" in out.getvalue()
