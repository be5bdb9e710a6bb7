"""Bad input raises ValueError / TypeError before anything is sent, with a message that says
what to change; construction errors; the small pure-Python pieces (config, validation)."""
from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

import sparkccl
from sparkccl import bootstrap, config
from sparkccl.transport import check as lane_check
from helpers import assert_no_problems, expect_errors
from sparkccl.localrun import check, run_ranks
from sparkccl.reference import bits, make_input, reduce_scatter_reference


def _bad_cases(comm):
    """(name, callable, expected exception type, substring of the message)."""
    w = comm.world_size
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    rs = torch.zeros(w * 2, 4, dtype=torch.bfloat16)
    stale = comm.reduce_scatter_input((w * 4, 8), torch.float32)
    comm._handout = None  # as if a reduce-scatter had consumed it
    qx = torch.quantize_per_tensor(torch.zeros(4), 0.1, 0, torch.quint8)
    return [
        ("ag: not a tensor", lambda: comm.all_gather([1, 2, 3]), TypeError, "torch.Tensor"),
        ("ag: numpy array", lambda: comm.all_gather(x.numpy()), TypeError, "torch.Tensor"),
        ("ag: non-contiguous", lambda: comm.all_gather(x.t()), ValueError, ".contiguous()"),
        ("ag: sparse", lambda: comm.all_gather(x.to_sparse()), TypeError, "dense"),
        ("ag: wrong device", lambda: comm.all_gather(torch.zeros(4, device="meta")),
         ValueError, ".to('cpu')"),
        ("ag: quantized", lambda: comm.all_gather(qx), TypeError, "quantized"),
        ("ag: out wrong shape", lambda: comm.all_gather(x, out=torch.empty(3, 4)), ValueError,
         f"shape [{3 * w}, 4]"),
        ("ag: out wrong dtype", lambda: comm.all_gather(x, out=torch.empty(3 * w, 4,
                                                                         dtype=torch.float16)),
         ValueError, "dtype torch.float32"),
        ("ag: out non-contiguous", lambda: comm.all_gather(x, out=torch.empty(4, 3 * w).t()),
         ValueError, "contiguous"),
        ("ag: out not a tensor", lambda: comm.all_gather(x, out="buffer"), TypeError, "torch.Tensor"),
        ("rs: int dtype", lambda: comm.reduce_scatter(torch.zeros(w * 2, dtype=torch.int32)),
         TypeError, "torch.bfloat16"),
        ("rs: float64", lambda: comm.reduce_scatter(torch.zeros(w * 2, dtype=torch.float64)),
         TypeError, "torch.float32"),
        ("rs: dim0 not divisible", lambda: comm.reduce_scatter(torch.zeros(w * 2 + 1, 4)),
         ValueError, "multiple of the world size"),
        ("rs: 0-dim", lambda: comm.reduce_scatter(torch.tensor(1.0)), ValueError, "0-dim"),
        ("rs: non-contiguous", lambda: comm.reduce_scatter(torch.zeros(4, w * 2).t()),
         ValueError, ".contiguous()"),
        ("rs: out wrong shape", lambda: comm.reduce_scatter(rs, out=torch.empty(w * 2, 4,
                                                                               dtype=torch.bfloat16)),
         ValueError, "shape [2, 4]"),
        ("rs: out wrong dtype", lambda: comm.reduce_scatter(rs, out=torch.empty(2, 4)),
         ValueError, "dtype torch.bfloat16"),
        ("rs: stale zero-copy buffer", lambda: comm.reduce_scatter(stale), ValueError,
         "reduce_scatter_input() again"),
        ("rsi: bad dtype", lambda: comm.reduce_scatter_input((w, 4), torch.int8), TypeError,
         "torch.bfloat16"),
        ("rsi: shape not divisible", lambda: comm.reduce_scatter_input((w + 1, 4)), ValueError,
         "[world * m, ...]"),
        ("rsi: shape not ints", lambda: comm.reduce_scatter_input(("a", 4)), TypeError,
         "tuple of ints"),
    ]


def bad_input_job(rank, world, store):
    comm = sparkccl.Communicator(store=store, rank=rank, world_size=world, timeout_s=20,
                                 slot_bytes=1 << 20)
    out = expect_errors(comm, _bad_cases(comm))
    # Nothing was sent: the next collectives line up and are exact.
    xs = [make_input(9, r, (world * 5, 3), torch.float16) for r in range(world)]
    ok = (bits(comm.reduce_scatter(xs[rank])) == reduce_scatter_reference(xs, rank)).all()
    out["rs after bad calls"] = None if ok else "wrong result"
    y = comm.all_gather(torch.full((2,), rank))
    out["ag after bad calls"] = None if y.tolist() == [r for r in range(world) for _ in (0, 1)] \
        else f"wrong {y.tolist()}"
    # Empty inputs: empty results, nothing sent, no sequence number used.
    seq = comm.seq
    e1 = comm.all_gather(torch.zeros(0, 5))
    e2 = comm.reduce_scatter(torch.zeros(0, 4, dtype=torch.bfloat16))
    e3 = comm.reduce_scatter(torch.zeros(world * 3, 0))
    out["empty"] = None if (e1.shape == (0, 5) and e2.shape == (0, 4) and e3.shape == (3, 0)
                            and comm.seq == seq) else f"{e1.shape} {e2.shape} {e3.shape}"
    # 0-dim all-gather counts as shape [1].
    g = comm.all_gather(torch.tensor(float(rank)))
    out["0-dim ag"] = None if g.tolist() == [float(r) for r in range(world)] else g.tolist()
    comm.close()
    try:
        comm.all_gather(torch.zeros(2))
        out["closed"] = "no exception"
    except ValueError as e:
        out["closed"] = None if "closed" in str(e) else str(e)
    return out


@pytest.mark.slow
def test_bad_inputs_raise_before_sending():
    values = check(run_ranks(bad_input_job, 2, timeout_s=120))
    assert_no_problems(values, at_least=25)


# ---- construction errors, in this process (fail before touching a store) ---------------

def _store():
    return dist.HashStore()


def test_constructor_argument_errors(monkeypatch):
    C = sparkccl.Communicator
    with pytest.raises(ValueError, match="needs rank= and world_size="):
        C(store=_store())
    with pytest.raises(ValueError, match=r"0\.\.1"):
        C(store=_store(), rank=2, world_size=2)
    with pytest.raises(TypeError, match="rank must be an int"):
        C(store=_store(), rank="0", world_size=2)
    with pytest.raises(TypeError, match="torch.distributed.Store"):
        C(store=object(), rank=0, world_size=2)
    with pytest.raises(ValueError, match="not both"):
        C(object(), store=_store(), rank=0, world_size=2)
    with pytest.raises(ValueError, match="init_process_group"):
        C()
    with pytest.raises(ValueError, match="device='meta'"):
        C(store=_store(), rank=0, world_size=2, device="meta")
    if not torch.cuda.is_available():  # a clear error, before any bootstrap
        with pytest.raises((ValueError, RuntimeError), match="(?i)cuda"):
            C(store=_store(), rank=0, world_size=2, device="cuda")
    with pytest.raises(TypeError, match="topology must be a str"):
        C(store=_store(), rank=0, world_size=2, topology=3)
    with pytest.raises(TypeError, match="timeout_s"):
        C(store=_store(), rank=0, world_size=2, timeout_s="10")
    with pytest.raises(ValueError, match="slot_bytes=100"):
        C(store=_store(), rank=0, world_size=2, slot_bytes=100)
    monkeypatch.setenv("SPARKCCL_SLOT_BYTES", "lots")
    with pytest.raises(ValueError, match="SPARKCCL_SLOT_BYTES"):
        C(store=_store(), rank=0, world_size=2)
    monkeypatch.setenv("SPARKCCL_SLOT_BYTES", "1M")
    monkeypatch.setenv("SPARKCCL_ROOTS", "3")
    with pytest.raises(ValueError, match="SPARKCCL_ROOTS"):
        C(store=_store(), rank=0, world_size=2)


def test_bootstrap_timeout_names_missing_ranks(monkeypatch):
    monkeypatch.setenv("SPARKCCL_BOOTSTRAP_TIMEOUT_S", "0.3")
    store = _store()
    store.set("sparkccl/token/1", "feedbeef0000")  # as if rank 0 had started
    with pytest.raises(sparkccl.CollectiveError, match=r"rank\(s\) 0, 2 to join"):
        sparkccl.Communicator(store=store, rank=1, world_size=3, timeout_s=0.3)


def test_config_parsing(monkeypatch):
    assert config.parse_bytes("64M", "x") == 64 << 20
    assert config.parse_bytes("64MiB", "x") == 64 << 20
    assert config.parse_bytes("1g", "x") == 1 << 30
    assert config.parse_bytes("4096", "x") == 4096
    with pytest.raises(ValueError, match="SPARKCCL_SLOT_BYTES"):
        config.parse_bytes("12 parsecs", "SPARKCCL_SLOT_BYTES")
    s = config.resolve(local_ranks=1)
    assert s.slot_bytes == 64 << 20 and s.roots == 2 and s.timeout_s == 120
    monkeypatch.setenv("SPARKCCL_PROXY_SPIN_US", "7")
    monkeypatch.setenv("SPARKCCL_TIMEOUT_S", "5")
    s = config.resolve(local_ranks=64)
    assert s.oversubscribed and s.spin_us == 7 and s.nap_us == config.OVERSUBSCRIBED_NAP_US
    assert s.timeout_s == 5 and s.bootstrap_timeout_s == 5  # no hidden floor
    assert config.resolve(timeout_s=2.5).timeout_s == 2.5  # argument beats environment
    # 0/1 switches (the lane check's too) through their declarations
    assert config.get("SPARKCCL_RS_UP_FRONT", {"SPARKCCL_RS_UP_FRONT": " off "}) is False
    assert config.get("SPARKCCL_RS_UP_FRONT", {"SPARKCCL_RS_UP_FRONT": "1"}) is True
    assert config.get("SPARKCCL_CHECK_SIZES", {"SPARKCCL_CHECK_SIZES": ""}) is True
    with pytest.raises(ValueError, match="SPARKCCL_LANE_CHECK='maybe': expected 0 or 1"):
        lane_check.enabled({"SPARKCCL_LANE_CHECK": "maybe"})
    assert lane_check.enabled({}) and not lane_check.enabled({"SPARKCCL_LANE_CHECK": "0"})


def test_disagreement_message():
    msg = bootstrap.describe_disagreement("topology", ["mesh", "ring", "mesh", "mesh"])
    assert msg == "topology: 'mesh' on ranks 0, 2, 3; 'ring' on rank 1"
    assert bootstrap.describe_disagreement("x", [1, 1]) is None
    with pytest.raises(ValueError, match="slot_bytes: 1 on rank 0; 2 on rank 1"):
        bootstrap.validate([{"slot_bytes": 1}, {"slot_bytes": 2}], ("slot_bytes",))


def test_collective_error_pickles():
    e = sparkccl.CollectiveError("boom", rank=1, peer=2, connection="channel 0 root 1",
                                 cause="why")
    e2 = pickle.loads(pickle.dumps(e))
    assert isinstance(e2, RuntimeError) and str(e2) == "boom"
    assert (e2.rank, e2.peer, e2.connection, e2.cause) == (1, 2, "channel 0 root 1", "why")
    assert sparkccl.__version__


def process_group_job(rank, world, store):
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        out = {}
        with sparkccl.Communicator() as comm:  # the default group
            out["default"] = comm.all_gather(torch.tensor([rank])).tolist()
        sub = dist.new_group([1, 2])
        if rank in (1, 2):
            with sparkccl.Communicator(sub, topology="ring") as comm:
                out["sub"] = (comm.rank, comm.world_size,
                              comm.all_gather(torch.tensor([rank])).tolist())
        with sparkccl.Communicator(dist.group.WORLD, topology="ring") as comm:
            out["again"] = comm.reduce_scatter(torch.ones(world, 2)).tolist()
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_bootstrap_over_process_groups():
    values = check(run_ranks(process_group_job, 3, timeout_s=120))
    for r, v in enumerate(values):
        assert v["default"] == [0, 1, 2]
        assert v["again"] == [[3.0, 3.0]]
        if r in (1, 2):
            assert v["sub"] == (r - 1, 2, [1, 2])
