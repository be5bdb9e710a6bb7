"""The vLLM plugin, against the real vLLM package, and the routing rule it shares with the
SGLang hook (docs/VLLM_SGLANG.md).

The rule's tests run everywhere. The plugin's tests need vLLM importable in this
interpreter and skip, with the import error as the reason, where it is not (they fail
instead with TEST_REQUIRE_ENGINES=1); ``benchmarks/integrations_check.sh``, which CI runs,
installs vLLM into a venv and runs them (output in ``benchmarks/integrations_cpu.txt``).

How the real vLLM runs here, on a CPU-only machine: ranks are processes over gloo;
vLLM's plugin loader (``vllm.plugins.load_general_plugins``) finds the ``sparkccl`` entry
point and runs it; vLLM's own ``GroupCoordinator`` builds the tensor-parallel group and its
communicator. Two things differ from a GPU box. The CPU platform names ``CpuCommunicator``,
so the test gives the platform the CUDA platform's answer (``CudaCommunicator``) before
the plugins load, as on a GPU box; and vLLM's NCCL wrapper disables itself without NCCL,
so calls that decline reach ``CudaCommunicator``'s own methods, which fall back to gloo
for all-gather (checked by value) but cannot reduce-scatter (checked by a recorder put
in place of the base method: the call arrived there, with its arguments unchanged).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers import engine_missing
from sparkccl.integrations import routing
from sparkccl.localrun import check, run_ranks
from sparkccl.reference import (all_gather_reference, all_reduce_reference, bits, make_input,
                                reduce_scatter_reference)

MIN = 64 << 10   # threshold in these tests: 64 KiB whole buffer
SETTINGS = routing.RouteSettings(min_bytes=MIN, topology="mesh", transport="auto")
CUDA_COMMUNICATOR = "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator"
bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32


# ---- the rule (no vLLM needed) ---------------------------------------------------------
RULE_CASES = [
    # op, per-rank shape, dtype, dim, world, sizes, capturing -> reason
    ("all_gather", (64, 256), bf16, 0, 2, None, False, "sparkccl"),        # 64 KiB: at it
    ("all_gather", (63, 256), bf16, 0, 2, None, False, "below threshold"),
    ("all_gather", (64, 256), bf16, -2, 2, None, False, "sparkccl"),
    ("all_gather", (64, 256), bf16, 1, 2, None, False, "dim != 0"),
    ("all_gather", (64, 256), bf16, -1, 2, None, False, "dim != 0"),
    ("all_gather", (32768,), torch.uint8, -1, 2, None, False, "sparkccl"),  # 1-D: -1 is 0
    ("all_gather", (64, 256), bf16, 0, 2, None, True, "graph capture"),
    ("all_gather", (64, 256), bf16, 0, 1, None, False, "single rank"),
    ("all_gather", (64, 256), torch.complex64, 0, 2, None, False, "dtype torch.complex64"),
    ("all_gather", (), f32, 0, 2, None, False, "0-dim tensor"),
    ("all_gather", (0, 256), bf16, 0, 2, None, False, "empty"),
    ("reduce_scatter", (128, 256), bf16, 0, 2, None, False, "sparkccl"),
    ("reduce_scatter", (126, 256), bf16, 0, 2, None, False, "below threshold"),
    ("reduce_scatter", (129, 256), bf16, 0, 2, None, False, "uneven sizes"),
    ("reduce_scatter", (128, 256), bf16, 0, 2, [60, 68], False, "uneven sizes"),
    ("reduce_scatter", (128, 256), bf16, 0, 2, [64, 64], False, "sparkccl"),
    ("reduce_scatter", (128, 256), torch.int32, 0, 2, None, False, "dtype torch.int32"),
    ("reduce_scatter", (64, 256), f32, 0, 2, None, False, "sparkccl"),
    ("reduce_scatter", (128, 256), bf16, 1, 2, None, False, "dim != 0"),
    ("reduce_scatter", (128, 256), bf16, 0, 2, None, True, "graph capture"),
    # all-reduce: every size (the threshold is not looked at), any shape, dim ignored
    ("all_reduce", (4, 256), bf16, 0, 2, None, False, "sparkccl"),          # 2 KiB
    ("all_reduce", (1,), f16, -1, 2, None, False, "sparkccl"),              # 2 bytes
    ("all_reduce", (), f32, 0, 3, None, False, "sparkccl"),
    ("all_reduce", (8192, 4096), bf16, 1, 4, None, False, "sparkccl"),      # 64 MiB prefill
    ("all_reduce", (64, 256), torch.int32, 0, 2, None, False, "dtype torch.int32"),
    ("all_reduce", (0, 256), bf16, 0, 2, None, False, "empty"),
    ("all_reduce", (64, 256), bf16, 0, 1, None, False, "single rank"),
    ("all_reduce", (64, 256), bf16, 0, 2, None, True, "graph capture"),
]


@pytest.mark.parametrize("op,shape,dtype,dim,world,sizes,capturing,reason", RULE_CASES)
def test_rule(op, shape, dtype, dim, world, sizes, capturing, reason):
    d = routing.should_route(op, shape, dtype, dim, world, SETTINGS, capturing=capturing,
                             sizes=sizes)
    assert d == routing.Decision(reason == "sparkccl", reason)


def test_captured_calls_route_only_with_the_setting():
    """SPARKCCL_ENGINE_CAPTURED=1: a captured call meets the same rule as an eager one,
    except a reduce-scatter before the communicator's reduce-scatter buffers exist (their
    setup cannot be captured)."""
    on = routing.RouteSettings(MIN, "mesh", "auto", captured=True)
    for op, shape, dtype, dim, world, sizes, _, reason in RULE_CASES:
        eager = routing.should_route(op, shape, dtype, dim, world, on, sizes=sizes)
        captured = routing.should_route(op, shape, dtype, dim, world, on, capturing=True,
                                        sizes=sizes)
        assert captured == eager, (op, shape, dtype, dim, world, sizes)
        assert routing.should_route(op, shape, dtype, dim, world, SETTINGS, capturing=True,
                                    sizes=sizes) == routing.Decision(False, "graph capture")
    args = ("reduce_scatter", (128, 256), bf16, 0, 2)
    assert routing.should_route(*args, on, capturing=True, rs_ready=False) == routing.Decision(
        False, "graph capture before the first reduce-scatter")
    assert routing.should_route(*args, on, rs_ready=False).route      # eager: it sets them up
    assert routing.should_route("all_gather", (64, 256), bf16, 0, 2, on, capturing=True,
                                rs_ready=False).route
    # an all-reduce whose regime needs the reduce-scatter buffers (allreduce.capturable)
    assert routing.should_route("all_reduce", (64, 256), bf16, 0, 2, on, capturing=True,
                                rs_ready=False) == routing.Decision(
        False, "graph capture before the first reduce-scatter")


def test_all_reduce_can_be_switched_off():
    off = routing.RouteSettings(MIN, "mesh", "auto", all_reduce=False)
    for capturing in (False, True):
        assert routing.should_route("all_reduce", (64, 256), bf16, 0, 2, off,
                                    capturing=capturing) == routing.Decision(False,
                                                                             "all-reduce off")
    assert routing.should_route("all_gather", (64, 256), bf16, 0, 2, off).route
    assert not routing.RouteSettings.from_env({"SPARKCCL_ENGINE_ALL_REDUCE": "0"}).all_reduce
    assert routing.RouteSettings.from_env({}).all_reduce


def test_rule_settings_from_env():
    s = routing.RouteSettings.from_env({"SPARKCCL_ENGINE_MIN_BYTES": "1M",
                                        "SPARKCCL_ENGINE_TOPOLOGY": "ring"})
    assert s == routing.RouteSettings(1 << 20, "ring", "auto")
    assert routing.RouteSettings.from_env({}).min_bytes == 32 << 20
    assert not routing.RouteSettings.from_env({}).captured
    assert routing.RouteSettings.from_env({"SPARKCCL_ENGINE_CAPTURED": "1"}).captured
    assert not routing.RouteSettings.from_env({}).ep_partial
    assert routing.RouteSettings.from_env({"SPARKCCL_ENGINE_EP_PARTIAL": "1"}).ep_partial
    from sparkccl.errors import ConfigError
    with pytest.raises(ConfigError, match="SPARKCCL_ENGINE_TRANSPORT='ib'"):
        routing.RouteSettings.from_env({"SPARKCCL_ENGINE_TRANSPORT": "ib"})


def _rule_job(rank, world, store):
    """Each rank decides on its own tensors, which differ from the peers' in everything
    the rule must not look at: values, addresses, contiguity, storage offsets."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        s = routing.agreed_settings(dist.group.WORLD, "test group")
        out = []
        for op, shape, dtype, dim, case_world, sizes, capturing, _ in RULE_CASES:
            if rank % 2:
                big = torch.zeros((3, *shape), dtype=dtype)
                t = big[1]                       # a view at an offset
                if t.dim() >= 2:
                    t = t.t().contiguous().t()   # non-contiguous, same shape
            else:
                t = torch.full(shape, rank + 1, dtype=dtype) if dtype != torch.complex64 \
                    else torch.zeros(shape, dtype=dtype)
            out.append(tuple(routing.should_route(op, t.shape, t.dtype, dim, case_world, s,
                                                  capturing=capturing, sizes=sizes)))
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_rule_is_the_same_on_every_rank():
    env = {"SPARKCCL_ENGINE_MIN_BYTES": str(MIN)}
    res = check(run_ranks(_rule_job, world=3, env=env, timeout_s=120))
    assert res[0] == res[1] == res[2]
    assert [r for _, r in res[0]] == [c[-1] for c in RULE_CASES]


@pytest.mark.slow
def test_ranks_with_different_settings_refuse_alike():
    res = run_ranks(_rule_job, world=2, env={"SPARKCCL_ENGINE_MIN_BYTES": str(MIN)},
                    rank_env={1: {"SPARKCCL_ENGINE_MIN_BYTES": "1M"}}, timeout_s=120)
    for r in res:
        assert r.error_type == "ValueError", (r.rank, r.error_type, r.message)
        assert "rank 0: min_bytes=65536" in r.message and "rank 1: min_bytes=1048576" in r.message


@pytest.mark.slow
def test_ranks_that_disagree_on_captured_calls_refuse_alike():
    res = run_ranks(_rule_job, world=2, env={"SPARKCCL_ENGINE_MIN_BYTES": str(MIN)},
                    rank_env={1: {"SPARKCCL_ENGINE_CAPTURED": "1"}}, timeout_s=120)
    for r in res:
        assert r.error_type == "ValueError", (r.rank, r.error_type, r.message)
        assert "rank 0: min_bytes=65536 topology=mesh transport=auto captured=0" in r.message
        assert "rank 1: min_bytes=65536 topology=mesh transport=auto captured=1" in r.message


@pytest.mark.slow
def test_a_bad_setting_on_one_rank_fails_every_rank():
    res = run_ranks(_rule_job, world=2, rank_env={1: {"SPARKCCL_ENGINE_TOPOLOGY": "torus"}},
                    timeout_s=120)
    for r in res:
        assert r.error_type == "ConfigError", (r.rank, r.error_type, r.message)
        assert "rank 1: SPARKCCL_ENGINE_TOPOLOGY='torus'" in r.message, r.message


# ---- the plugin in the real vLLM ---------------------------------------------------------
def _vllm_unavailable() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (benchmarks/integrations_check.sh installs it in a venv)"
    try:
        import vllm.distributed.device_communicators.cuda_communicator  # noqa: F401
        import vllm.distributed.parallel_state  # noqa: F401
        import vllm.plugins  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure is the reason to skip
        return f"vLLM does not import here: {type(e).__name__}: {e}"
    return None


@pytest.fixture(scope="module")
def vllm_ok():
    why = _vllm_unavailable()
    if why:
        engine_missing(why)


VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_PLUGINS": "sparkccl", "VLLM_DISABLE_PYNCCL": "1", "SPARKCCL_ENGINE_MIN_BYTES": str(MIN),
            "VLLM_LOGGING_LEVEL": "WARNING"}


def _load_plugins_as_on_cuda():
    """vLLM's own plugin loader, with the platform answering as the CUDA platform does."""
    from vllm.platforms import current_platform
    type(current_platform).get_device_communicator_cls = classmethod(
        lambda cls: CUDA_COMMUNICATOR)
    import vllm.plugins
    found = vllm.plugins.load_plugins_by_group(vllm.plugins.DEFAULT_PLUGINS_GROUP)
    vllm.plugins.load_general_plugins()
    return sorted(found), type(current_platform).get_device_communicator_cls()


def _tp_group(rank, world, store):
    import torch.distributed as dist
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    from vllm.distributed.parallel_state import GroupCoordinator
    return GroupCoordinator(group_ranks=[list(range(world))], local_rank=rank,
                            torch_distributed_backend="gloo", use_device_communicator=True,
                            group_name="tp")


def _inert_job(rank, world, store):
    found, answer = _load_plugins_as_on_cuda()
    tp = _tp_group(rank, world, store)
    dc = tp.device_communicator
    return found, answer, type(dc).__name__, getattr(dc, "sparkccl", "absent")


@pytest.mark.slow
def test_vllm_plugin_is_inert_when_off(vllm_ok):
    res = check(run_ranks(_inert_job, world=2, env={**VLLM_ENV, "SPARKCCL_VLLM": "0"},
                          timeout_s=600))
    for found, answer, cls, comm in res:
        assert "sparkccl" in found          # vLLM's loader sees the entry point
        assert answer == CUDA_COMMUNICATOR  # ... which left the platform alone
        assert cls == "CudaCommunicator" and comm == "absent"


def _record_base(name, calls):
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    def recorder(self, *args, **kwargs):
        calls.append((name, tuple(a.shape if isinstance(a, torch.Tensor) else a
                                  for a in args)))
        return "base"
    setattr(CudaCommunicator, name, recorder)


def _log_lines(name):
    import logging
    lines = []
    h = logging.Handler(logging.INFO)
    h.emit = lambda rec: lines.append(rec.getMessage())
    logging.getLogger(name).addHandler(h)
    logging.getLogger(name).setLevel(logging.INFO)
    return lines


def _on_job(rank, world, store):
    log_lines = _log_lines("sparkccl.vllm")
    found, answer = _load_plugins_as_on_cuda()
    tp = _tp_group(rank, world, store)
    dc = tp.device_communicator
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    import vllm.distributed.parallel_state as ps
    out = {"found": found, "answer": answer, "cls": type(dc).__name__,
           "is_cuda_comm": isinstance(dc, CudaCommunicator),
           "topology": dc.sparkccl.topology, "transport": dc.sparkccl.transport}
    inputs = lambda seed, shape, dtype: [make_input(seed, r, shape, dtype) for r in range(world)]

    def exact(got, want_bits):
        return bool((bits(got) == want_bits).all())

    # Routed: through GroupCoordinator.all_gather / reduce_scatter (vLLM's public calls).
    xs = inputs(1, (64, 256), bf16)
    out["ag"] = exact(tp.all_gather(xs[rank], dim=0), all_gather_reference(xs))
    for seed, dtype in ((2, bf16), (3, f16), (4, f32)):
        xs = inputs(seed, (128, 256), dtype)
        x = xs[rank]
        if rank == 1:  # a non-contiguous input of the same shape on one rank only
            x = torch.empty((256, 128), dtype=dtype).t()
            x.copy_(xs[rank])
        out[f"rs_{dtype}"] = exact(tp.reduce_scatter(x, dim=0),
                                   reduce_scatter_reference(xs, rank))
    # Sequence parallelism's own call sites (custom_all_gather / custom_reduce_scatter).
    ps._TP = tp
    from vllm.models.common.ops.sequence_parallel import sp_all_gather, sp_reduce_scatter
    xs = inputs(5, (64, 512), bf16)
    out["sp_ag"] = exact(sp_all_gather(xs[rank]), all_gather_reference(xs))
    xs = inputs(6, (256, 256), bf16)
    out["sp_rs"] = exact(sp_reduce_scatter(xs[rank]), reduce_scatter_reference(xs, rank))
    # The MoE combine: its input buffer is sparkccl's send slot, then reduce_scatterv.
    xs = inputs(7, (128, 256), bf16)
    buf = dc.get_symmetric_memory_buffer("moe_ag_rs_combine", (128, 256), bf16, dc.device)
    out["combine_buffer"] = buf is not None
    buf.copy_(xs[rank])
    res = torch.empty((64, 256), dtype=bf16)
    got = tp.reduce_scatterv_into_output(buf, res, dim=0, sizes=[64] * world)
    out["combine"] = exact(res, reduce_scatter_reference(xs, rank)) and got is res
    # All-reduce (GroupCoordinator.all_reduce -> the communicator's all_reduce): every size,
    # both regimes (one shot up to 256 KiB, then reduce-scatter + all-gather), out of place.
    ar_ok = []
    for seed, shape, dtype in ((20, (1,), bf16), (21, (3, 5), f16), (22, (16, 4096), bf16),
                               (23, (40, 4096), f32), (24, (129, 1000), bf16)):
        xs = inputs(seed, shape, dtype)
        x = xs[rank].clone()
        y = tp.all_reduce(x)
        ar_ok.append(exact(y, all_reduce_reference(xs)) and exact(x, bits(xs[rank])))
    out["ar"] = ar_ok
    routed = dict(dc.route_counts)

    # Declined: all-gathers fall back to vLLM's own path (gloo here) and stay exact.
    xs = inputs(8, (8, 256), bf16)                              # 8 KiB: below threshold
    out["small_ag"] = exact(tp.all_gather(xs[rank], dim=0), all_gather_reference(xs))
    xs = inputs(9, (64, 256), bf16)                             # dim 1
    want = torch.cat(xs, dim=1)
    out["dim1_ag"] = exact(tp.all_gather(xs[rank], dim=1), bits(want))
    routing.stream_capturing = lambda: True                     # as under CUDA graph capture
    xs = inputs(10, (64, 256), bf16)
    out["captured_ag"] = exact(tp.all_gather(xs[rank], dim=0), all_gather_reference(xs))
    out["captured_custom_ag"] = dc.custom_all_gather(xs[rank]) is None  # vLLM's answer: no
    routing.stream_capturing = lambda: False
    # ... reduce-scatters reach CudaCommunicator's methods (recorded: no NCCL here).
    calls = []
    for name in ("reduce_scatter", "reduce_scatterv"):
        _record_base(name, calls)
    x = inputs(11, (16, 256), bf16)[rank]
    out["small_rs"] = tp.reduce_scatter(x, dim=0)
    x = inputs(12, (128, 256), bf16)[rank]
    out["dim1_rs"] = tp.reduce_scatter(x, dim=1)
    out["uneven_rs"] = tp.reduce_scatterv(x, dim=0, sizes=[60, 68])
    out["int_rs"] = tp.reduce_scatter(x.to(torch.int32), dim=0)
    # ... an int32 all-reduce: CudaCommunicator's own (torch.distributed over gloo here)
    out["int_ar"] = tp.all_reduce(torch.full((64,), rank + 1, dtype=torch.int32)).tolist()
    out["buffer_declined"] = dc.get_symmetric_memory_buffer(
        "moe_ag_rs_combine", (16, 256), bf16, dc.device)
    out["base_calls"] = calls
    out["counts"] = dict(dc.route_counts)
    out["routed"] = routed
    out["log"] = log_lines
    tp.destroy()
    return out


@pytest.mark.slow
def test_vllm_plugin_routes_and_declines_through_the_real_group_coordinator(vllm_ok):
    res = check(run_ranks(_on_job, world=2, env={**VLLM_ENV, "SPARKCCL_VLLM": "1"},
                          timeout_s=600))
    for rank, r in enumerate(res):
        assert "sparkccl" in r["found"]
        assert r["answer"] == "sparkccl.integrations.vllm.SparkcclCudaCommunicator"
        assert r["cls"] == "SparkcclCudaCommunicator" and r["is_cuda_comm"]
        assert (r["topology"], r["transport"]) == ("mesh", "shm")
        assert r["log"][-1] == (
            "sparkccl: vLLM group tp:0 (world 2): all_reduce at every size and dim-0 "
            "all_gather / reduce_scatter from "
            "64 KiB (whole buffer) on sparkccl, topology mesh, transport shm; smaller, "
            "captured, other-dim and uneven calls stay on the engine's NCCL"), r["log"]
        for k in ("ag", f"rs_{bf16}", f"rs_{f16}", f"rs_{f32}", "sp_ag", "sp_rs",
                  "combine_buffer", "combine", "small_ag", "dim1_ag", "captured_ag",
                  "captured_custom_ag"):
            assert r[k] is True, (rank, k)
        assert r["ar"] == [True] * 5, (rank, r["ar"])
        assert r["int_ar"] == [3] * 64
        assert r["routed"] == {("all_gather", "sparkccl"): 2, ("reduce_scatter", "sparkccl"): 6,
                               ("all_reduce", "sparkccl"): 5}
        for k in ("small_rs", "dim1_rs", "uneven_rs", "int_rs"):
            assert r[k] == "base", (rank, k)
        assert r["base_calls"] == [
            ("reduce_scatter", (torch.Size([16, 256]), 0)),
            ("reduce_scatter", (torch.Size([128, 256]), 1)),
            ("reduce_scatterv", (torch.Size([128, 256]), 0, [60, 68])),
            ("reduce_scatter", (torch.Size([128, 256]), 0))]
        assert r["buffer_declined"] is None   # vLLM's own answer without NCCL symmetric memory
        c = r["counts"]
        assert c[("all_gather", "below threshold")] == 1
        assert c[("all_gather", "dim != 0")] == 1
        assert c[("all_gather", "graph capture")] == 2
        assert c[("reduce_scatter", "below threshold")] == 2   # small_rs + buffer_declined
        assert c[("reduce_scatter", "dim != 0")] == 1
        assert c[("reduce_scatter", "uneven sizes")] == 1
        assert c[("reduce_scatter", "dtype torch.int32")] == 1
        assert c[("all_reduce", "dtype torch.int32")] == 1


def _captured_job(rank, world, store):
    """SPARKCCL_ENGINE_CAPTURED=1, capture faked as in _on_job: captured calls route (exact);
    a captured reduce-scatter before the communicator's first one declines."""
    out = {"log": _log_lines("sparkccl.vllm")}
    _load_plugins_as_on_cuda()
    tp = _tp_group(rank, world, store)
    dc = tp.device_communicator
    inputs = lambda seed, shape, dtype: [make_input(seed, r, shape, dtype) for r in range(world)]
    routing.stream_capturing = lambda: True
    try:
        calls = []
        _record_base("reduce_scatter", calls)
        # A captured one-shot all-reduce needs no reduce-scatter buffers: it routes.
        xs = inputs(5, (16, 256), bf16)
        out["ar_small_before_setup"] = bool((bits(tp.all_reduce(xs[rank]))
                                             == all_reduce_reference(xs)).all())
        _record_base("all_reduce", calls)  # a two-step one would set them up: declined
        out["ar_big_before_setup"] = tp.all_reduce(inputs(6, (256, 1024), bf16)[rank])
        x = inputs(1, (128, 256), bf16)[rank]
        out["rs_before_setup"] = tp.reduce_scatter(x, dim=0)        # -> vLLM's own path
        out["rs_before_setup_calls"] = list(calls)
        routing.stream_capturing = lambda: False
        xs = inputs(2, (128, 256), bf16)                              # eager: sets RS up
        out["rs_eager"] = bool((bits(tp.reduce_scatter(xs[rank], dim=0))
                                == reduce_scatter_reference(xs, rank)).all())
        routing.stream_capturing = lambda: True
        xs = inputs(3, (64, 256), bf16)
        out["captured_ag"] = bool((bits(tp.all_gather(xs[rank], dim=0))
                                   == all_gather_reference(xs)).all())
        xs = inputs(4, (128, 256), bf16)
        out["captured_rs"] = bool((bits(tp.reduce_scatter(xs[rank], dim=0))
                                   == reduce_scatter_reference(xs, rank)).all())
        xs = inputs(7, (256, 1024), bf16)
        out["captured_ar_big"] = bool((bits(tp.all_reduce(xs[rank]))
                                       == all_reduce_reference(xs)).all())
        out["counts"] = dict(dc.route_counts)
    finally:
        routing.stream_capturing = lambda: False
    tp.destroy()
    return out


@pytest.mark.slow
def test_vllm_plugin_routes_captured_calls_with_the_setting(vllm_ok):
    # (the one-shot limit pinned below the (256, 1024) bf16 all-reduces, 512 KiB, so they take
    # the two-step regime whatever the world's default: the case this test is about)
    env = {**VLLM_ENV, "SPARKCCL_VLLM": "1", "SPARKCCL_ENGINE_CAPTURED": "1",
           "SPARKCCL_ALLREDUCE_ONESHOT_BYTES": "256K"}
    for r in check(run_ranks(_captured_job, world=2, env=env, timeout_s=600)):
        assert "captured calls too (SPARKCCL_ENGINE_CAPTURED=1)" in r["log"][-1], r["log"]
        assert r["rs_before_setup"] == "base" and r["ar_big_before_setup"] == "base"
        assert r["rs_before_setup_calls"] == [("all_reduce", (torch.Size([256, 1024]),)),
                                              ("reduce_scatter", (torch.Size([128, 256]), 0))]
        assert r["rs_eager"] and r["captured_ag"] and r["captured_rs"], r
        assert r["ar_small_before_setup"] and r["captured_ar_big"], r
        c = r["counts"]
        assert c[("reduce_scatter", "graph capture before the first reduce-scatter")] == 1
        assert c[("all_reduce", "graph capture before the first reduce-scatter")] == 1
        assert c[("all_gather", "sparkccl")] == 1 and c[("reduce_scatter", "sparkccl")] == 2
        assert c[("all_reduce", "sparkccl")] == 2
