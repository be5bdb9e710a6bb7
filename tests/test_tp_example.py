"""examples/tp_transformer.py: torch's own tensor-parallel API
(``parallelize_module``, colwise / rowwise plans) on backend "sparkccl", CPU. Its
collectives reach sparkccl (the group's counts), and the logits are bit-identical across
mesh / ring, shm / tcp and repeated runs, on every rank."""
from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest

from sparkccl.localrun import check, run_ranks

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tp_transformer.py"
# mesh / ring, shm / tcp, and the first one again (a repeated run)
CONFIGS = [("mesh", "shm"), ("ring", "shm"), ("ring", "tcp"), ("mesh", "shm")]


def _example():
    spec = importlib.util.spec_from_file_location("tp_transformer", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tp_job(rank, world, store):
    import torch.distributed as dist

    import sparkccl.integrations.torch_backend as tb
    warnings.filterwarnings("ignore")
    ex = _example()
    out = []
    for i, (topology, transport) in enumerate(CONFIGS):
        # A fresh default group per configuration: DTensor keeps meshes (and the groups
        # they resolve to) by their ranks, so a second group of the same ranks would not
        # be the one its collectives use. min_bytes 0: the logits' all-gather (a few KiB)
        # is counted as sparkccl's too.
        dist.init_process_group("sparkccl", store=dist.PrefixStore(f"tp{i}", store),
                                rank=rank, world_size=world, pg_options=tb.Options(
                                    topology=topology, transport=transport, min_bytes=0))
        pg = dist.group.WORLD
        logits = ex.logits_on(pg)
        comm = pg.communicator("cpu")
        out.append((topology, comm.transport, ex.digest(logits), tuple(logits.shape),
                    dict(pg.routed), dict(pg.declined)))
        dist.destroy_process_group()
    return out


def _check(world):
    ex = _example()
    values = check(run_ranks(tp_job, world, timeout_s=300))
    want = values[0][0][2]
    for rank, runs in enumerate(values):
        assert [(t, tr) for t, tr, *_ in runs] == CONFIGS, runs
        for topology, transport, dig, shape, routed, declined in runs:
            where = (world, rank, topology, transport)
            assert dig == want, where
            assert shape == (ex.BATCH, ex.SEQ, ex.VOCAB), where
            # two row-parallel all-reduces per layer, one all-gather of the logits
            assert routed == {"all_reduce": 2 * ex.LAYERS, "all_gather": 1}, (where, routed)
            assert declined == {}, (where, declined)


def test_parallelize_module_on_sparkccl_is_bit_identical_across_topologies_and_runs():
    _check(3)


@pytest.mark.slow
def test_parallelize_module_world_2():
    _check(2)
