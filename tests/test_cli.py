"""The command line's argument checks (sparkccl/cli.py) that need no ranks."""
from __future__ import annotations

import pytest

from sparkccl import bench
from sparkccl.cli import main


def test_bench_baselines_by_name():
    assert [b for b, _ in bench.baselines_for("cuda")] == ["nccl", "nccl-p2p-off", "nccl-sockets"]
    assert [b for b, _ in bench.baselines_for("cuda", only=["nccl-p2p-off"])] == ["nccl-p2p-off"]
    assert bench.baselines_for("cpu", baseline=False) == ()
    with pytest.raises(ValueError, match="unknown baseline nccl for device cpu"):
        bench.baselines_for("cpu", only=["nccl"])


def test_bench_refuses_an_unknown_baseline_before_starting(capsys):
    assert main(["bench", "--baseline", "gloo", "--baseline", "mpi"]) == 2
    err = capsys.readouterr().err
    assert "unknown baseline mpi for device cpu (have: gloo)" in err
