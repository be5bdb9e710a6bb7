"""The SGLang hook, against the real SGLang package (docs/VLLM_SGLANG.md).

Skips, with the import error as the reason, where ``sglang.srt.distributed`` does not
import (fails instead with TEST_REQUIRE_ENGINES=1); ``benchmarks/integrations_check.sh``,
which CI runs, installs it into a venv and runs this (output in ``benchmarks/integrations_cpu.txt``). The shared routing rule is
tested without SGLang in tests/test_vllm_plugin.py.

How the real SGLang runs here: ranks are processes over gloo; SGLang's plugin loader
(``sglang.srt.plugins.load_plugins``) finds the ``sparkccl`` entry point, runs it and
applies the hooks it registered with ``HookRegistry``; SGLang's own ``GroupCoordinator``
builds the tensor-parallel group (no pynccl, no custom all-reduce: no GPU). Its
``_all_gather_into_tensor`` / ``_reduce_scatter_tensor`` are the hooked methods; declined
calls run SGLang's original body, which here is torch.distributed over gloo, so every
result, routed or declined, is checked bit for bit.

One dependency is replaced: ``sglang.srt.utils.common`` imports ``triton`` unconditionally,
and triton (a GPU compiler) is not installed on the CPU machine. Where ``import triton``
fails, the rank processes get a placeholder module holding only the names SGLang's
import-time code touches (``jit`` as identity, ``cdiv``, ...); no triton kernel runs in
these tests, and SGLang's own classes are unchanged.
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

MIN = 64 << 10
bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
SGLANG_ENV = {"SPARKCCL_ENGINE_MIN_BYTES": str(MIN), "SGLANG_PLUGINS": "sparkccl"}


TRITON_PLACEHOLDER = '''
"""Placeholder for triton, which is not installed here: the names SGLang's imports touch."""
import sys, types
jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
autotune = heuristics = lambda *a, **k: (lambda f: f)
Config = type("Config", (), {"__init__": lambda self, *a, **k: None})
cdiv = lambda a, b: -(-a // b)
next_power_of_2 = lambda n: 1 << (n - 1).bit_length()
language = types.ModuleType("triton.language")
language.constexpr = object
def _any(name):  # tl.float32, tl.tensor, ... in annotations; no module attributes
    if name.startswith("__"):
        raise AttributeError(name)
    return object
language.__getattr__ = _any
runtime = types.ModuleType("triton.runtime")
runtime.jit = types.ModuleType("triton.runtime.jit")
runtime.jit.JITFunction = type("JITFunction", (), {})
sys.modules.update({"triton.language": language, "triton.runtime": runtime,
                    "triton.runtime.jit": runtime.jit})
__version__ = "0.0.0"
'''
PLACEHOLDER_ENV = "TEST_SGLANG_TRITON_PLACEHOLDER"


def _import_sglang():
    import os
    import sys
    where = os.environ.get(PLACEHOLDER_ENV)
    if where and where not in sys.path:
        import torch._dynamo  # noqa: F401 - torch looks for triton first, and finds none

        sys.path.insert(0, where)
    import sglang.srt.distributed.parallel_state  # noqa: F401
    import sglang.srt.plugins  # noqa: F401


def _import_job(rank, world, store):
    _import_sglang()
    import sglang
    return sglang.__version__


@pytest.fixture(scope="module")
def sglang_env(tmp_path_factory):
    """The rank environment, or a skip naming why SGLang cannot be imported here."""
    if importlib.util.find_spec("sglang") is None:
        engine_missing("SGLang is not installed (benchmarks/integrations_check.sh installs "
                       "it in a venv)")
    env = dict(SGLANG_ENV)
    if importlib.util.find_spec("triton") is None:
        d = tmp_path_factory.mktemp("triton_placeholder")
        (d / "triton").mkdir()
        (d / "triton" / "__init__.py").write_text(TRITON_PLACEHOLDER)
        env[PLACEHOLDER_ENV] = str(d)
    r = run_ranks(_import_job, world=1, env=env, timeout_s=300)[0]
    if r.error_type:
        engine_missing(f"SGLang does not import here: {r.error_type}: {r.message}")
    return env


def _tp_group(rank, world, store):
    import torch.distributed as dist
    _import_sglang()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    return GroupCoordinator(group_ranks=[list(range(world))], local_rank=rank,
                            torch_distributed_backend="gloo", use_pynccl=False,
                            use_mscclpp=False, use_custom_allreduce=False,
                            use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False,
                            use_xpu_communicator=False, group_name="tp")


def _inert_job(rank, world, store):
    tp = _tp_group(rank, world, store)
    from sglang.srt.plugins.hook_registry import HookRegistry
    hooked = sorted(t for t in HookRegistry._hooks if "GroupCoordinator" in t)
    return hooked, "_sparkccl" in tp.__dict__


@pytest.mark.slow
def test_sglang_hook_is_inert_when_off(sglang_env):
    res = check(run_ranks(_inert_job, world=2, env={**sglang_env, "SPARKCCL_SGLANG": "0"},
                          timeout_s=600))
    for hooked, attached in res:
        assert hooked == [] and attached is False


def _on_job(rank, world, store):
    import logging
    log_lines = []
    h = logging.Handler(logging.INFO)
    h.emit = lambda rec: log_lines.append(rec.getMessage())
    logging.getLogger("sparkccl.sglang").addHandler(h)
    logging.getLogger("sparkccl.sglang").setLevel(logging.INFO)
    tp = _tp_group(rank, world, store)
    st = tp._sparkccl   # built by the AFTER hook on GroupCoordinator.__init__
    out = {"topology": st.comm.topology, "transport": st.comm.transport}
    inputs = lambda seed, shape, dtype: [make_input(seed, r, shape, dtype) for r in range(world)]

    def exact(got, want_bits):
        return bool((bits(got) == want_bits).all())

    def ag(seed, shape, dtype):
        xs = inputs(seed, shape, dtype)
        o = torch.empty((world * shape[0], *shape[1:]), dtype=dtype)
        tp._all_gather_into_tensor(o, xs[rank])
        return exact(o, all_gather_reference(xs))

    def rs(seed, shape, dtype, noncontig=False):
        xs = inputs(seed, shape, dtype)
        x = xs[rank]
        if noncontig and rank == 1:
            x = torch.empty(shape[::-1], dtype=dtype).t()
            x.copy_(xs[rank])
        o = torch.empty((shape[0] // world, *shape[1:]), dtype=dtype)
        tp._reduce_scatter_tensor(o, x)
        return exact(o, reduce_scatter_reference(xs, rank))

    # Routed (>= 64 KiB whole buffer)
    out["ag_bf16"] = ag(1, (64, 256), bf16)
    out["ag_u8"] = ag(2, (32768,), torch.uint8)
    out["rs_bf16"] = rs(3, (128, 256), bf16, noncontig=True)
    out["rs_f16"] = rs(4, (128, 256), f16)
    out["rs_f32"] = rs(5, (64, 256), f32)
    # (SGLang's public all_gather_into_tensor / reduce_scatter_tensor reach these two
    # methods through its custom ops sglang::reg_*, registered for CUDA only.)
    # All-reduce through the public GroupCoordinator.all_reduce: every size, both regimes.
    ar_ok = []
    for seed, shape, dtype in ((20, (1,), bf16), (21, (3, 5), f16), (22, (16, 4096), bf16),
                               (23, (129, 1000), bf16)):
        xs = inputs(seed, shape, dtype)
        ar_ok.append(exact(tp.all_reduce(xs[rank].clone()), all_reduce_reference(xs)))
    out["ar"] = ar_ok
    routed = dict(st.counts)
    # Declined: SGLang's original method (gloo here), still exact.
    out["ag_small"] = ag(7, (8, 256), bf16)
    out["rs_small"] = rs(8, (16, 256), bf16)
    routing.stream_capturing = lambda: True
    out["ag_captured"] = ag(9, (64, 256), bf16)
    out["rs_captured"] = rs(10, (128, 256), bf16)
    out["ar_captured"] = tp.all_reduce(torch.full((64,), rank + 1.0)).tolist()
    routing.stream_capturing = lambda: False
    # an int32 all-reduce: SGLang's own path (gloo here)
    out["ar_int"] = tp.all_reduce(torch.full((64,), rank + 1, dtype=torch.int32)).tolist()
    out["routed"] = routed
    out["log"] = log_lines
    out["counts"] = dict(st.counts)
    return out


@pytest.mark.slow
def test_sglang_hook_routes_and_declines_through_the_real_group_coordinator(sglang_env):
    res = check(run_ranks(_on_job, world=2, env={**sglang_env, "SPARKCCL_SGLANG": "1"},
                          timeout_s=600))
    for rank, r in enumerate(res):
        assert (r["topology"], r["transport"]) == ("mesh", "shm")
        assert r["log"][-1] == (
            "sparkccl: SGLang group tp:0 (world 2): all_reduce at every size and dim-0 "
            "all_gather / reduce_scatter from "
            "64 KiB (whole buffer) on sparkccl, topology mesh, transport shm; smaller, "
            "captured, other-dim and uneven calls stay on the engine's NCCL"), r["log"]
        for k in ("ag_bf16", "ag_u8", "rs_bf16", "rs_f16", "rs_f32",
                  "ag_small", "rs_small", "ag_captured", "rs_captured"):
            assert r[k] is True, (rank, k)
        assert r["ar"] == [True] * 4, (rank, r["ar"])
        assert r["ar_captured"] == [3.0] * 64 and r["ar_int"] == [3] * 64
        assert r["routed"] == {("all_gather", "sparkccl"): 2, ("reduce_scatter", "sparkccl"): 3,
                               ("all_reduce", "sparkccl"): 4}
        c = r["counts"]
        assert c[("all_gather", "below threshold")] == 1
        assert c[("reduce_scatter", "below threshold")] == 1
        assert c[("all_gather", "graph capture")] == 1
        assert c[("reduce_scatter", "graph capture")] == 1
        assert c[("all_reduce", "graph capture")] == 1
        assert c[("all_reduce", "dtype torch.int32")] == 1


def _captured_job(rank, world, store):
    """SPARKCCL_ENGINE_CAPTURED=1, capture faked: captured calls route (exact), but a
    captured reduce-scatter before the communicator's first one stays on SGLang's path."""
    tp = _tp_group(rank, world, store)
    st = tp._sparkccl
    inputs = lambda seed, shape, dtype: [make_input(seed, r, shape, dtype) for r in range(world)]

    def rs(seed):
        xs = inputs(seed, (128, 256), bf16)
        o = torch.empty((128 // world, 256), dtype=bf16)
        tp._reduce_scatter_tensor(o, xs[rank])
        return bool((bits(o) == reduce_scatter_reference(xs, rank)).all())

    def ar(seed, shape):
        xs = inputs(seed, shape, bf16)
        return bool((bits(tp.all_reduce(xs[rank])) == all_reduce_reference(xs)).all())

    out = {}
    routing.stream_capturing = lambda: True
    try:
        out["rs_before_setup"] = rs(1)
        out["counts_before_setup"] = dict(st.counts)
        out["ar_small_before_setup"] = ar(11, (16, 256))    # one shot: routes
        out["ar_big_before_setup"] = ar(12, (256, 1024))    # two step: SGLang's path (gloo)
        routing.stream_capturing = lambda: False
        out["rs_eager"] = rs(2)
        routing.stream_capturing = lambda: True
        xs = inputs(3, (64, 256), bf16)
        o = torch.empty((world * 64, 256), dtype=bf16)
        tp._all_gather_into_tensor(o, xs[rank])
        out["ag_captured"] = bool((bits(o) == all_gather_reference(xs)).all())
        out["rs_captured"] = rs(4)
        out["ar_captured"] = ar(13, (256, 1024))
    finally:
        routing.stream_capturing = lambda: False
    out["counts"] = dict(st.counts)
    return out


@pytest.mark.slow
def test_sglang_hook_routes_captured_calls_with_the_setting(sglang_env):
    # (the one-shot limit pinned below the (256, 1024) bf16 all-reduces, 512 KiB, so they take
    # the two-step regime whatever the world's default: the case this test is about)
    env = {**sglang_env, "SPARKCCL_SGLANG": "1", "SPARKCCL_ENGINE_CAPTURED": "1",
           "SPARKCCL_ALLREDUCE_ONESHOT_BYTES": "256K"}
    for r in check(run_ranks(_captured_job, world=2, env=env, timeout_s=600)):
        assert all(r[k] is True for k in ("rs_before_setup", "rs_eager", "ag_captured",
                                          "rs_captured")), r
        assert r["counts_before_setup"] == {
            ("reduce_scatter", "graph capture before the first reduce-scatter"): 1}
        c = r["counts"]
        assert c[("all_gather", "sparkccl")] == 1 and c[("reduce_scatter", "sparkccl")] == 2
        assert r["ar_small_before_setup"] and r["ar_captured"], r
        assert c[("all_reduce", "graph capture before the first reduce-scatter")] == 1
        assert c[("all_reduce", "sparkccl")] == 2
