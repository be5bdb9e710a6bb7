"""The SGLang expert-parallel hook (sparkccl/integrations/sglang_ep.py), against the real
SGLang package, on CPU ranks (docs/EXPERT_PARALLEL.md "Inside the engines").

Skips as tests/test_sglang_hook.py does (whose rank environment and triton placeholder it
uses) where SGLang does not import; ``benchmarks/integrations_check.sh`` installs it and
runs this. SGLang's own plugin loader runs the ``sparkccl`` entry point and applies the
AROUND hook on ``create_moe_dispatcher``; SGLang's own ``GroupCoordinator`` is the MoE EP
group and its ``MoeRunnerConfig`` describes the layer. The experts are the tests'
stand-ins (sparkccl/ep_reference.py); combine's output is checked bit for bit against the one-box
fused finalize reference of each rank's tokens.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from sparkccl.ep_reference import (combine_reference, expert_fn, make_ep_input,
                                   partial_combine_reference)
from sparkccl.localrun import check, run_ranks
from test_sglang_hook import _import_sglang, sglang_env  # noqa: F401 - the fixture

H, K, T = 64, 4, 12
LAYER = "sglang.srt.layers.moe.fused_moe_triton.layer"

# SGLang's MoE layer imports its model configs, one of which imports torchvision (an image
# library, not installed here) for image transforms it builds at run time only. Where it is
# missing, the ranks get a placeholder holding the names used at import time, put on the
# path after ``import sglang`` (by then transformers has found no torchvision and keeps
# that answer); no transform runs in these tests.
TORCHVISION_ENV = "TEST_SGLANG_TORCHVISION_PLACEHOLDER"
_ANY = ("def __getattr__(name):\n"
        "    if name.startswith('__'):\n"
        "        raise AttributeError(name)\n"
        "    return lambda *a, **k: None\n")
TORCHVISION_PLACEHOLDER = {
    "__init__.py": "from . import transforms\n__version__ = '0.0.0'\n",
    "transforms/__init__.py": "from . import functional\n"
                              "from .functional import InterpolationMode\n" + _ANY,
    "transforms/functional.py": "import enum\n"
                                "class InterpolationMode(enum.Enum):\n"
                                "    NEAREST = 'nearest'\n    BILINEAR = 'bilinear'\n"
                                "    BICUBIC = 'bicubic'\n" + _ANY,
}


@pytest.fixture(scope="module")
def sglang_ep_env(sglang_env, tmp_path_factory):  # noqa: F811
    env = dict(sglang_env)
    if importlib.util.find_spec("torchvision") is None:
        where = tmp_path_factory.mktemp("torchvision_placeholder")
        for name, text in TORCHVISION_PLACEHOLDER.items():
            (where / "torchvision" / name).parent.mkdir(parents=True, exist_ok=True)
            (where / "torchvision" / name).write_text(text)
        env[TORCHVISION_ENV] = str(where)
    return env


def _ep_job(rank, world, store):
    import importlib
    import os

    import sys

    import torch.distributed as dist
    _import_sglang()
    if os.environ.get(TORCHVISION_ENV):
        sys.path.insert(0, os.environ[TORCHVISION_ENV])
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sparkccl.integrations import sglang_ep
    out = {}
    sglang_ep.register()  # SPARKCCL_SGLANG_EP unset: nothing registered
    out["inert"] = sglang_ep.TARGET not in HookRegistry._hooks
    os.environ["SPARKCCL_SGLANG_EP"] = "1"
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    from sglang.srt.plugins import load_plugins
    load_plugins()
    out["hooked"] = sglang_ep.TARGET in HookRegistry._hooks
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    g = GroupCoordinator(group_ranks=[list(range(world))], local_rank=rank,
                         torch_distributed_backend="gloo", use_pynccl=False,
                         use_mscclpp=False, use_custom_allreduce=False,
                         use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False,
                         use_xpu_communicator=False, group_name="moe_ep")
    from sglang.srt.runtime_context import get_flags, get_parallel
    get_parallel().override_permanently(moe_ep_group=g, moe_ep_size=world, moe_ep_rank=rank)
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.layers.moe.utils import MoeA2ABackend
    layer = importlib.import_module(LAYER)
    E = 4 * world
    El = E // world
    os.environ["SPARKCCL_SGLANG_EP_MAX_TOKENS"] = str(T)

    def cfg(dtype=torch.bfloat16):
        return MoeRunnerConfig(num_experts=E, num_local_experts=El, hidden_size=H, top_k=K,
                               num_fused_shared_experts=0, params_dtype=dtype)

    # Another backend: SGLang's own dispatcher, untouched.
    get_flags().moe.a2a_backend = MoeA2ABackend.NONE
    out["none"] = type(layer.create_moe_dispatcher(cfg(), quant_method=None)).__name__
    get_flags().moe.a2a_backend = MoeA2ABackend.CUSTOMIZED
    try:
        layer.create_moe_dispatcher(cfg(torch.float16), quant_method=None)
        out["fp16"] = "no exception"
    except ValueError as e:
        out["fp16"] = str(e)
    disp = layer.create_moe_dispatcher(cfg(), quant_method=None)
    out["class"] = type(disp).__name__
    # Under CUDA graph capture (simulated): refused before anything is sent.
    from sparkccl.integrations import routing
    mine = make_ep_input(80, rank, tokens=T, hidden=H, topk=K, num_experts=E, world=world)
    capturing, routing.stream_capturing = routing.stream_capturing, lambda: True
    try:
        disp.dispatch(mine["x"], StandardTopKOutput(mine["topk_weights"],
                                                    mine["topk_idx"].to(torch.int32), None))
        out["capture"] = "no error"
    except RuntimeError as e:
        out["capture"] = str(e)
    finally:
        routing.stream_capturing = capturing
    bad = []
    for rnd in range(2):
        ns = [5 + 3 * r for r in range(world)] if rnd == 0 else \
            [0 if r == 1 else T for r in range(world)]
        inputs = [make_ep_input(90 + rnd, r, tokens=ns[r], hidden=H, topk=K, num_experts=E,
                                world=world) for r in range(world)]
        mine = inputs[rank]
        d = disp.dispatch(mine["x"], StandardTopKOutput(mine["topk_weights"],
                                                        mine["topk_idx"].to(torch.int32), None))
        a, ids = d.hidden_states, d.topk_output.topk_ids.view(-1)
        want = sorted(((int(inp["topk_idx"][t, k]), s, t) for s, inp in enumerate(inputs)
                       for t in range(inp["topk_idx"].shape[0]) for k in range(K)
                       if int(inp["topk_idx"][t, k]) // El == rank), key=lambda v: v[0])
        if ids.tolist() != [e - rank * El for e, _, _ in want]:  # local ids
            bad.append(f"round {rnd}: row experts {ids.tolist()}")
        want_x = torch.stack([inputs[s]["x"][t] for _, s, t in want]) if want else a
        if not torch.equal(a.view(torch.int16), want_x.view(torch.int16)):
            bad.append(f"round {rnd}: received rows differ")
        w = d.topk_output.topk_weights
        if d.hidden_states_scale is not None or not torch.equal(w, torch.ones_like(w)):
            bad.append(f"round {rnd}: scales / weights")
        rows = torch.empty_like(a)
        for e in set(ids.tolist()):
            sel = ids == e
            rows[sel] = expert_fn(e + rank * El, a[sel], None)
        y = disp.combine(StandardCombineInput(hidden_states=rows))
        got = y.view(torch.int16).numpy().view(np.uint16)
        if os.environ.get("SPARKCCL_ENGINE_EP_PARTIAL") == "1":  # (contiguous placement)
            ref = partial_combine_reference(mine, [e // El for e in range(E)], world,
                                            shared=False)
        else:
            ref = combine_reference(mine, shared=False)
        if not np.array_equal(got, ref):
            bad.append(f"round {rnd}: combine differs from the reference")
    out["bad"] = bad
    return out


@pytest.mark.parametrize("partial", [False, True], ids=["exact", "partial"])
def test_sglang_ep_dispatcher_is_the_one_box_finalize(sglang_ep_env, partial):
    """The one-box finalize's bits; SPARKCCL_ENGINE_EP_PARTIAL=1: the per-rank partial
    combine's (an opt-in)."""
    env = {**sglang_ep_env, "SPARKCCL_SGLANG": "1",
           "SPARKCCL_ENGINE_EP_PARTIAL": "1" if partial else "0"}
    for rank, r in enumerate(check(run_ranks(_ep_job, world=2, env=env, timeout_s=600))):
        assert r["inert"] and r["hooked"], (rank, r)
        assert r["none"] == "StandardDispatcher", r["none"]
        assert "cannot take this MoE layer: activations torch.float16" in r["fp16"], r["fp16"]
        assert r["class"] == "SparkcclDispatcher", r["class"]
        assert "under CUDA graph capture" in r["capture"] and \
            "--cuda-graph-backend-decode=disabled" in r["capture"], (rank, r["capture"])
        assert r["bad"] == [], (rank, r["bad"])
