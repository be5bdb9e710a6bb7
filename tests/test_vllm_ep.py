"""The vLLM expert-parallel hook (sparkccl/integrations/vllm_ep.py), against the real vLLM
package, on CPU ranks (docs/EXPERT_PARALLEL.md "Inside the engines").

Skips, with the import error as the reason, where vLLM's fused-MoE layer does not import
(CI: not installed); ``benchmarks/integrations_check.sh`` installs vLLM into a venv and
runs this. As in tests/test_vllm_plugin.py, ranks are processes over gloo, vLLM's own
plugin loader runs the ``sparkccl`` entry point, and vLLM's own ``GroupCoordinator``
builds the EP group. The layer's ``FusedMoEConfig`` is vLLM's own class, and the
prepare/finalize comes from vLLM's ``maybe_make_prepare_finalize`` as the fused-MoE oracles
call it. The experts are the tests' stand-ins (sparkccl/ep_reference.py: vLLM's expert kernels
need a GPU); finalize's output is checked bit for bit against the one-box fused finalize
reference of each rank's tokens (with SPARKCCL_ENGINE_EP_PARTIAL=1: against the per-rank
partial combine's reference).
"""
from __future__ import annotations

import importlib
import importlib.util

import numpy as np
import pytest
import torch

from sparkccl.ep_reference import (combine_reference, expert_fn, make_ep_input,
                                   partial_combine_reference)
from sparkccl.localrun import check, run_ranks

VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_PLUGINS": "sparkccl", "VLLM_DISABLE_PYNCCL": "1",
            "VLLM_LOGGING_LEVEL": "WARNING", "SPARKCCL_VLLM": "1"}
CUDA_COMMUNICATOR = "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator"
AU = "vllm.model_executor.layers.fused_moe.all2all_utils"
H, K, T = 64, 4, 12


@pytest.fixture(scope="module")
def vllm_ok():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (benchmarks/integrations_check.sh installs it in a "
                    "venv)")
    import os
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        importlib.import_module(AU)
        importlib.import_module("vllm.model_executor.layers.fused_moe.oracle.unquantized")
    except Exception as e:  # noqa: BLE001 - any import failure is the reason to skip
        pytest.skip(f"vLLM's fused MoE does not import here: {type(e).__name__}: {e}")


def _moe(world, rank, E, backend="allgather_reducescatter", use_ep=True, eplb=False,
         dtype=torch.bfloat16, moe_backend="auto", hidden=H):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig,
                                                             FusedMoEParallelConfig,
                                                             RoutingMethodType)
    p = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=world, ep_size=world,
                               tp_rank=0, pcp_rank=0, dp_rank=rank, ep_rank=rank, sp_size=1,
                               use_ep=use_ep, all2all_backend=backend, enable_eplb=eplb)
    return FusedMoEConfig(num_experts=E, experts_per_token=K, hidden_dim=hidden,
                          intermediate_size=128, num_local_experts=E // world,
                          num_logical_experts=E, activation=MoEActivation.SILU, device="cpu",
                          routing_method=RoutingMethodType.Renormalize, moe_parallel_config=p,
                          in_dtype=dtype, max_num_tokens=T, moe_backend=moe_backend)


def _expert_map(E, world, rank, round_robin):
    owners = [e % world if round_robin else e // (E // world) for e in range(E)]
    m = torch.full((E,), -1, dtype=torch.int32)
    mine = [e for e in range(E) if owners[e] == rank]
    m[mine] = torch.arange(len(mine), dtype=torch.int32)
    return m


def _ep_job(rank, world, store):
    import importlib
    import os
    import types

    import torch.distributed as dist
    from sparkccl.integrations import vllm_ep
    out = {}
    # Off (SPARKCCL_VLLM_EP unset): registering changes nothing.
    vllm_ep.register()
    from vllm.config import CompilationConfig, KernelConfig, ParallelConfig, VllmConfig
    out["inert"] = not hasattr(importlib.import_module(AU).maybe_make_prepare_finalize,
                               "_sparkccl_original") and \
        not hasattr(VllmConfig.__post_init__, "_sparkccl_original")
    os.environ["SPARKCCL_VLLM_EP"] = "1"
    from vllm.platforms import current_platform
    type(current_platform).get_device_communicator_cls = classmethod(
        lambda cls: CUDA_COMMUNICATOR)
    import vllm.plugins
    vllm.plugins.load_general_plugins()
    au = importlib.import_module(AU)
    oracle = importlib.import_module("vllm.model_executor.layers.fused_moe.oracle.unquantized")
    out["hooked"] = oracle.maybe_make_prepare_finalize is au.maybe_make_prepare_finalize \
        and hasattr(au.maybe_make_prepare_finalize, "_sparkccl_original") \
        and hasattr(VllmConfig.__post_init__, "_sparkccl_original")

    # CUDA graphs: off where the hook takes the MoE layers, as vLLM's own rule for DeepEP
    # high-throughput (the CPU platform has none: it is made to claim them here).
    platform = type(current_platform)
    static = platform.__dict__.get("support_static_graph_mode")
    platform.support_static_graph_mode = classmethod(lambda cls: True)
    try:
        out["graphs"] = {
            name: VllmConfig(parallel_config=ParallelConfig(data_parallel_size=dp,
                                                            enable_expert_parallel=ep),
                             compilation_config=CompilationConfig(),
                             kernel_config=KernelConfig(moe_backend=moe_backend)
                             ).compilation_config.cudagraph_mode.name
            for name, dp, ep, moe_backend in (
                ("dp2 ep", 2, True, "auto"), ("dp2", 2, False, "auto"), ("ep", 1, True, "auto"),
                ("dp2 ep batched", 2, True, "batched_triton"))}
    finally:
        if static is None:
            del platform.support_static_graph_mode
        else:
            platform.support_static_graph_mode = static

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    import vllm.distributed.parallel_state as ps
    ps._EP = ps.GroupCoordinator(group_ranks=[list(range(world))], local_rank=rank,
                                 torch_distributed_backend="gloo",
                                 use_device_communicator=False, group_name="ep")
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.config import (FUSED_MOE_UNQUANTIZED_CONFIG,
                                                             fp8_w8a8_moe_quant_config)
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate)
    make = oracle.maybe_make_prepare_finalize
    E = 4 * world

    # Declined: the same answer as vLLM's own function.
    declined = {
        "ep off": (_moe(world, rank, E, use_ep=False), FUSED_MOE_UNQUANTIZED_CONFIG),
        "eplb": (_moe(world, rank, E, eplb=True), FUSED_MOE_UNQUANTIZED_CONFIG),
        "fp16": (_moe(world, rank, E, dtype=torch.float16), FUSED_MOE_UNQUANTIZED_CONFIG),
        "fp8": (_moe(world, rank, E), fp8_w8a8_moe_quant_config(
            w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None,
            block_shape=[128, 128])),
        # batched, but one dynamic fp8 scale per tensor (a scale over a batch)
        "fp8 per tensor": (_moe(world, rank, E, moe_backend="batched_triton"),
                           fp8_w8a8_moe_quant_config(w1_scale=None, w2_scale=None)),
    }
    out["declined"] = {}
    # (vLLM's all-to-all manager needs CUDA; its EP world size is all these paths read.)
    manager = types.SimpleNamespace(world_size=world)
    for name, (moe, qc) in declined.items():
        got = make(moe, qc, allow_new_interface=True, all2all_manager=manager)
        want = au.maybe_make_prepare_finalize._sparkccl_original(
            moe, qc, allow_new_interface=True, all2all_manager=manager)
        out["declined"][name] = (type(got).__name__, type(want).__name__)

    # Under CUDA graph capture (simulated): refused before anything is sent, the same on
    # every rank.
    from sparkccl.integrations import routing
    pf = make(_moe(world, rank, E), FUSED_MOE_UNQUANTIZED_CONFIG, allow_new_interface=True)
    mine = make_ep_input(60, rank, tokens=T, hidden=H, topk=K, num_experts=E, world=world)
    capturing, routing.stream_capturing = routing.stream_capturing, lambda: True
    try:
        pf.prepare(mine["x"], mine["topk_weights"], mine["topk_idx"], E,
                   _expert_map(E, world, rank, False), False, FUSED_MOE_UNQUANTIZED_CONFIG,
                   False)
        out["capture"] = "no error"
    except RuntimeError as e:
        out["capture"] = str(e)
    finally:
        routing.stream_capturing = capturing

    # Taken: two layers (contiguous and round-robin expert maps), tokens per rank that
    # differ (rank 1 none in the second round).
    bad = []
    for layer, rr in enumerate((False, True)):
        pf = make(_moe(world, rank, E), FUSED_MOE_UNQUANTIZED_CONFIG, allow_new_interface=True)
        out[f"class{layer}"] = (type(pf).__name__,
                                isinstance(pf, mk.FusedMoEPrepareAndFinalizeModular),
                                pf.activation_format == mk.FusedMoEActivationFormat.Standard,
                                pf.output_is_reduced(), pf.num_dispatchers())
        emap = _expert_map(E, world, rank, rr)
        for rnd in range(2):
            ns = [5 + 3 * r for r in range(world)] if rnd == 0 else \
                [0 if r == 1 else T for r in range(world)]
            inputs = [make_ep_input(70 + 10 * layer + rnd, r, tokens=ns[r], hidden=H, topk=K,
                                    num_experts=E, world=world) for r in range(world)]
            mine = inputs[rank]
            a, a_scale, meta, ids, w = pf.prepare(mine["x"], mine["topk_weights"],
                                                  mine["topk_idx"], E, emap, False,
                                                  FUSED_MOE_UNQUANTIZED_CONFIG, False)
            # Each received row: the experts this rank holds, their rows in (rank, token).
            want_rows = [(int(inp["topk_idx"][t, k]), s, t) for s, inp in enumerate(inputs)
                         for t in range(inp["topk_idx"].shape[0]) for k in range(K)
                         if int(emap[int(inp["topk_idx"][t, k])]) >= 0]
            want_rows.sort(key=lambda v: int(emap[v[0]]))  # stable: (rank, token) kept
            got_ids = ids.view(-1).tolist()
            if got_ids != [e for e, _, _ in want_rows]:
                bad.append(f"layer {layer} round {rnd}: row experts {got_ids}")
            want_x = torch.stack([inputs[s]["x"][t] for _, s, t in want_rows]) \
                if want_rows else a
            if not torch.equal(a.view(torch.int16), want_x.view(torch.int16)):
                bad.append(f"layer {layer} round {rnd}: received rows differ")
            if a_scale is not None or not torch.equal(w, torch.ones_like(w)):
                bad.append(f"layer {layer} round {rnd}: scales / weights {a_scale}, {w}")
            counts = meta.expert_num_tokens.tolist()
            if counts != [sum(int(emap[e]) == i for e, _, _ in want_rows)
                          for i in range(E // world)]:
                bad.append(f"layer {layer} round {rnd}: counts {counts}")
            fused = torch.empty((a.shape[0], 1, H), dtype=torch.bfloat16)
            for e in set(got_ids):
                sel = ids.view(-1) == e
                fused[sel, 0] = expert_fn(e, a[sel], None)
            y = torch.full((ns[rank], H), float("nan"), dtype=torch.bfloat16)
            pf.finalize(y, fused, w, ids, False, TopKWeightAndReduceDelegate())
            got = y.view(torch.int16).numpy().view(np.uint16)
            if os.environ.get("SPARKCCL_ENGINE_EP_PARTIAL") == "1":
                owners = [e % world if rr else e // (E // world) for e in range(E)]
                want = partial_combine_reference(mine, owners, world, shared=False)
            else:
                want = combine_reference(mine, shared=False)
            if not np.array_equal(got, want):
                bad.append(f"layer {layer} round {rnd}: finalize differs from the reference")
    out["batched"], b = _batched_checks(make, rank, world, E)
    out["fp8"], b8 = _fp8_kernel_checks(make, rank, world, E,
                                        os.environ.get("SPARKCCL_ENGINE_EP_PARTIAL") == "1")
    out["bad"] = bad + b + b8
    return out


def _want_rows(inputs, emap):
    """Each row this rank's experts receive, (global expert, source rank, token), grouped by
    local expert, (rank, token) order within."""
    K_ = inputs[0]["topk_idx"].shape[1]
    rows = [(int(inp["topk_idx"][t, k]), s, t) for s, inp in enumerate(inputs)
            for t in range(inp["topk_idx"].shape[0]) for k in range(K_)
            if int(emap[int(inp["topk_idx"][t, k])]) >= 0]
    rows.sort(key=lambda v: int(emap[v[0]]))  # stable: (rank, token) kept
    return rows


def _batched_checks(make, rank, world, E):
    """Layers whose experts run in vLLM's batched format (--moe-backend batched_triton) get
    the low-latency prepare/finalize: the receive layout ``[E_local, world * T, H]`` with
    device counts, rows past the counts never read (NaN there), the one-box finalize bits
    (or the partial combine's, with SPARKCCL_ENGINE_EP_PARTIAL=1), and no refusal under a
    simulated capture (round 2); then the same layer run by vLLM's own modular kernel
    (``FusedMoEKernel`` with ``NaiveBatchedExperts``, the batched experts that run on CPU)."""
    import os

    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate)

    from sparkccl.integrations import routing
    out, bad = {}, []
    El, partial = E // world, os.environ.get("SPARKCCL_ENGINE_EP_PARTIAL") == "1"
    for layer, rr in enumerate((False, True)):
        pf = make(_moe(world, rank, E, moe_backend="batched_triton"),
                  FUSED_MOE_UNQUANTIZED_CONFIG, allow_new_interface=True)
        out[f"class{layer}"] = (
            type(pf).__name__, pf.activation_format == mk.FusedMoEActivationFormat.BatchedExperts,
            pf.max_num_tokens_per_rank(), pf.num_dispatchers(), pf.output_is_reduced())
        emap = _expert_map(E, world, rank, rr)
        local = sorted((e for e in range(E) if int(emap[e]) >= 0), key=lambda e: int(emap[e]))
        owners = [e % world if rr else e // El for e in range(E)]
        for rnd in range(3):
            ns = [[5 + 3 * r for r in range(world)], [0 if r == 1 else T for r in range(world)],
                  [T - r for r in range(world)]][rnd]
            inputs = [make_ep_input(90 + 10 * layer + rnd, r, tokens=ns[r], hidden=H, topk=K,
                                    num_experts=E, world=world) for r in range(world)]
            mine, what = inputs[rank], f"batched layer {layer} round {rnd}"
            capturing = routing.stream_capturing
            if rnd == 2:
                routing.stream_capturing = lambda: True
            try:
                a, a_scale, meta, ids, w = pf.prepare(
                    mine["x"], mine["topk_weights"], mine["topk_idx"], E, emap, False,
                    FUSED_MOE_UNQUANTIZED_CONFIG, False)
                if a.shape != (El, world * T, H) or a_scale is not None or ids is not None \
                        or w is not None or meta.expert_num_tokens_cpu is not None:
                    bad.append(f"{what}: prepare gave {tuple(a.shape)}, {a_scale}, {ids}, {w}, "
                               f"{meta.expert_num_tokens_cpu}")
                    continue
                want = _want_rows(inputs, emap)
                counts = meta.expert_num_tokens.tolist()
                if counts != [sum(int(emap[e]) == i for e, _, _ in want) for i in range(El)]:
                    bad.append(f"{what}: counts {counts}")
                    continue
                fused = torch.full(a.shape, float("nan"), dtype=torch.bfloat16)
                for i, e in enumerate(local):
                    rows = [inputs[s]["x"][t] for g, s, t in want if g == e]
                    if rows and not torch.equal(a[i, :counts[i]].view(torch.int16),
                                                torch.stack(rows).view(torch.int16)):
                        bad.append(f"{what}: expert {e}'s received rows differ")
                    fused[i, :counts[i]] = expert_fn(e, a[i, :counts[i]], None)
                y = torch.full((ns[rank], H), float("nan"), dtype=torch.bfloat16)
                pf.finalize(y, fused, mine["topk_weights"], mine["topk_idx"], False,
                            TopKWeightAndReduceDelegate())
            finally:
                routing.stream_capturing = capturing
            ref = partial_combine_reference(mine, owners, world, shared=False) if partial \
                else combine_reference(mine, shared=False)
            if not np.array_equal(y.view(torch.int16).numpy().view(np.uint16), ref):
                bad.append(f"{what}: finalize differs from the reference")
    bad += _batched_kernel_checks(make, rank, world, E, partial)
    return out, bad


def _batched_kernel_checks(make, rank, world, E, partial):
    """The batched layer through vLLM's ``FusedMoEKernel`` and ``NaiveBatchedExperts`` (its
    torch GEMMs per expert, reading the counts): expert weights that select columns (so
    each GEMM is exact whatever its blocking) around a SiLU-and-mul (vLLM's op is a CUDA
    kernel: a torch stand-in, elementwise), against the one-box finalize of each token's
    rows computed one token at a time."""
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe as fbm

    fbm._is_capturing_or_compiling = lambda: False  # (it asks the accelerator: none on CPU)
    N = 32
    moe = _moe(world, rank, E, moe_backend="batched_triton")
    pf = make(moe, FUSED_MOE_UNQUANTIZED_CONFIG, allow_new_interface=True)
    experts = fbm.NaiveBatchedExperts(moe, FUSED_MOE_UNQUANTIZED_CONFIG,
                                      max_num_tokens=pf.max_num_tokens_per_rank(),
                                      num_dispatchers=pf.num_dispatchers())

    def act(x):  # [m, 2N] -> [m, N]
        return (torch.nn.functional.silu(x[:, :N].float()) * x[:, N:].float()).to(x.dtype)

    experts.activation = lambda activation, output, input, **kw: output.copy_(act(input))
    kernel = mk.FusedMoEKernel(pf, experts)
    w1 = torch.zeros((E, 2 * N, H), dtype=torch.bfloat16)
    w2 = torch.zeros((E, H, N), dtype=torch.bfloat16)
    for e in range(E):
        w1[e, torch.arange(2 * N), (torch.arange(2 * N) * 3 + e) % H] = 2.0 ** (e % 3 - 1)
        w2[e, torch.arange(H), (torch.arange(H) + e) % N] = 1.0
    emap = _expert_map(E, world, rank, False)
    local = [e for e in range(E) if int(emap[e]) >= 0]
    owners = [e // (E // world) for e in range(E)]

    def expert(e, x):  # [m, H] -> [m, H], as NaiveBatchedExperts computes it
        return act(x @ w1[e].T) @ w2[e].T

    return _kernel_rounds(kernel, w1[local], w2[local], expert, emap, owners, rank, world, E,
                          H, 130, partial, "vLLM FusedMoEKernel")


def _kernel_rounds(kernel, w1, w2, expert, emap, owners, rank, world, E, hidden, seed, partial,
                   what):
    """Two rounds of a layer through vLLM's ``FusedMoEKernel`` (tokens per rank that differ
    in the second), each output against the one-box finalize (or the partial combine's
    reference) of the rows ``expert`` computes one token at a time."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    bad = []
    for rnd in range(2):
        inp = make_ep_input(seed + rnd, rank, tokens=T - rnd * rank, hidden=hidden, topk=K,
                            num_experts=E, world=world)
        y = kernel.apply(inp["x"], w1, w2, inp["topk_weights"], inp["topk_idx"],
                         MoEActivation.SILU, E, emap, False)
        n = inp["x"].shape[0]
        rows = torch.stack([expert(int(inp["topk_idx"][t, k]), inp["x"][t:t + 1])[0]
                            for t in range(n) for k in range(K)])
        ref = partial_combine_reference(inp, owners, world, shared=False, rows=rows) \
            if partial else combine_reference(inp, shared=False, rows=rows)
        if not np.array_equal(y.view(torch.int16).numpy().view(np.uint16), ref):
            bad.append(f"{what} round {rnd}: output differs from the reference")
    return bad


def _fp8_twin(A, A_scale, quant_dtype, per_act_token_quant, block_shape=None, **kw):
    """A torch stand-in for vLLM's activation quantizer (``moe_kernel_quantize_input``,
    whose fp8 kernels need CUDA and triton) with its shapes: e4m3 rows and fp32 scales, one
    per ``block_shape[1]`` columns of a row, one per row (per-token), or the static
    ``A_scale``; a dynamic scale is the group's absolute maximum / 448 (vLLM's own floor on
    it aside). Row-wise, as the layers the hook takes are."""
    assert quant_dtype == torch.float8_e4m3fn, quant_dtype
    a = A.float()
    m, n = a.shape
    if block_shape is not None:
        g = block_shape[1]
        scale = a.view(m, n // g, g).abs().amax(-1).clamp(min=1e-10) / 448.0
        q = a.view(m, n // g, g) / scale.unsqueeze(-1)
    elif per_act_token_quant:
        scale = a.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
        q = a / scale
    else:
        scale = A_scale
        q = a / scale
    return q.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(m, n), scale


def _fp8_kernel_checks(make, rank, world, E, partial):
    """fp8 layers in the batched format (DeepSeek's block-quantized checkpoints; per-token
    scales) through vLLM's ``FusedMoEKernel`` and ``NaiveBatchedExperts`` (fp8 weights that
    select columns, scales 1: exact GEMMs), with vLLM's quantizer replaced by
    :func:`_fp8_twin`. Blocks of 128 columns: the home rank quantizes and the e4m3 rows
    travel with their scales (the hook's ExpertParallel is e4m3); per-token scales: bf16
    travels and the received rows are quantized. Against the one-box finalize of each
    token's rows, each quantized alone (quantization is row-wise, so where it happens
    changes no bit)."""
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe import utils as moe_utils
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
    from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe as fbm
    from vllm.model_executor.layers.quantization.utils.quant_utils import group_broadcast

    fbm._is_capturing_or_compiling = lambda: False  # (it asks the accelerator: none on CPU)
    moe_utils.moe_kernel_quantize_input = _fp8_twin
    F8, Hq, N = torch.float8_e4m3fn, 128, 64
    w1 = torch.zeros((E, 2 * N, Hq))
    w2 = torch.zeros((E, Hq, N))
    for e in range(E):
        w1[e, torch.arange(2 * N), (torch.arange(2 * N) * 3 + e) % Hq] = 2.0 ** (e % 3 - 1)
        w2[e, torch.arange(Hq), (torch.arange(Hq) + e) % N] = 1.0
    w1, w2 = w1.to(F8), w2.to(F8)
    emap = _expert_map(E, world, rank, False)
    local = [e for e in range(E) if int(emap[e]) >= 0]
    owners = [e // (E // world) for e in range(E)]
    ones = torch.ones((len(local), 1, 1))

    def act(x):  # [m, 2N] -> [m, N], as in _batched_kernel_checks
        return (torch.nn.functional.silu(x[:, :N].float()) * x[:, N:].float()).to(x.dtype)

    bad, travelled = [], {}
    for name, block, per_token in (("block 128", [128, 128], False),
                                   ("per token", None, True)):
        qc = fp8_w8a8_moe_quant_config(w1_scale=ones, w2_scale=ones, block_shape=block,
                                       per_act_token_quant=per_token)
        moe = _moe(world, rank, E, moe_backend="batched_triton", hidden=Hq)
        pf = make(moe, qc, allow_new_interface=True)
        experts = fbm.NaiveBatchedExperts(moe, qc, max_num_tokens=pf.max_num_tokens_per_rank(),
                                          num_dispatchers=pf.num_dispatchers())
        experts.activation = lambda activation, output, input, **kw: output.copy_(act(input))
        kernel = mk.FusedMoEKernel(pf, experts)

        def expert(e, x):  # one token's row, quantized alone, as NaiveBatchedExperts computes
            q, sc = _fp8_twin(x, None, F8, per_token, block)
            h = q.float() * group_broadcast(sc, q.shape)
            return act((h @ w1[e].float().T).to(torch.bfloat16)) @ \
                w2[e].float().to(torch.bfloat16).T

        bad += _kernel_rounds(kernel, w1[local], w2[local], expert, emap, owners, rank, world,
                              E, Hq, 150, partial, f"fp8 {name}")
        travelled[name] = sorted(str(d) for d in pf._eps)
    return travelled, bad


@pytest.mark.parametrize("partial", [False, True], ids=["exact", "partial"])
def test_vllm_ep_prepare_finalize_is_the_one_box_finalize(vllm_ok, partial):
    """The one-box finalize's bits; SPARKCCL_ENGINE_EP_PARTIAL=1: the per-rank partial
    combine's (an opt-in)."""
    world = 2
    env = {**VLLM_ENV, "SPARKCCL_ENGINE_EP_PARTIAL": "1" if partial else "0"}
    for rank, r in enumerate(check(run_ranks(_ep_job, world=world, env=env,
                                             timeout_s=600))):
        assert r["inert"] and r["hooked"], (rank, r)
        g = r["graphs"]  # (the others keep vLLM's default mode, whatever it is)
        assert g["dp2 ep"] == "NONE" and g["dp2"] != "NONE" and g["ep"] != "NONE" and \
            g["dp2 ep batched"] != "NONE", (rank, g)
        assert "under CUDA graph capture" in r["capture"] and \
            "cudagraph_mode NONE" in r["capture"], (rank, r["capture"])
        for name, (got, want) in r["declined"].items():
            assert got == want and got != "SparkcclPrepareAndFinalize", (rank, name, got, want)
        for layer in (0, 1):
            assert r[f"class{layer}"] == ("SparkcclPrepareAndFinalize", True, True, True,
                                          world), (rank, r[f"class{layer}"])
        for layer in (0, 1):
            assert r["batched"][f"class{layer}"] == (
                "SparkcclBatchedPrepareAndFinalize", True, T, world, True), (rank, r["batched"])
        assert r["fp8"] == {"block 128": ["torch.float8_e4m3fn"],
                            "per token": ["torch.bfloat16"]}, (rank, r["fp8"])
        assert r["bad"] == [], (rank, r["bad"])


def test_graphs_off_reason_reads_the_configuration():
    """Which vLLM configurations the hook runs without CUDA graphs (vllm_ep.graphs_off_reason,
    a pure function of the configuration's fields; the real VllmConfig is in the test above):
    expert parallelism with an all-to-all on allgather_reducescatter, an unquantized bf16 MoE
    model (or none known yet), experts not in the batched format (whose low-latency
    dispatch graphs capture), graphs not already off."""
    from types import SimpleNamespace as NS

    from sparkccl.integrations.vllm_ep import BACKEND, graphs_off_reason

    def cfg(ep=True, a2a=True, backend=BACKEND, model="bf16", quant=None, mode="FULL",
            moe_backend="auto"):
        m = None if model is None else NS(
            is_moe=model != "dense", quantization=quant,
            dtype=torch.float16 if model == "fp16" else torch.bfloat16)
        c = NS(parallel_config=NS(enable_expert_parallel=ep, use_all2all=a2a,
                                  all2all_backend=backend, data_parallel_size=2),
               model_config=m,
               compilation_config=NS(cudagraph_mode=None if mode is None else NS(name=mode)))
        if moe_backend is not None:
            c.kernel_config = NS(moe_backend=moe_backend)
        return c

    off = {"taken": cfg(), "no model yet": cfg(model=None), "mode unset": cfg(mode=None),
           "triton experts": cfg(moe_backend="triton"), "no kernel config": cfg(moe_backend=None)}
    kept = {"ep off": cfg(ep=False), "no all-to-all": cfg(a2a=False),
            "other backend": cfg(backend="deepep_low_latency"), "dense": cfg(model="dense"),
            "fp16": cfg(model="fp16"), "fp8": cfg(quant="fp8"), "graphs off": cfg(mode="NONE"),
            "batched experts": cfg(moe_backend="batched_triton")}
    for name, c in off.items():
        why = graphs_off_reason(c)
        assert why is not None and "cannot capture" in why, (name, why)
    for name, c in kept.items():
        assert graphs_off_reason(c) is None, name
