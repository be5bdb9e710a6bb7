"""SGLang expert parallelism on sparkccl: a ``BaseDispatcher`` whose dispatch is
:meth:`sparkccl.ExpertParallel.dispatch` and whose combine is its combine, with the one-box
finalize bits (docs/EXPERT_PARALLEL.md "Inside the engines").

Switched on by ``SPARKCCL_SGLANG=1`` and ``SPARKCCL_SGLANG_EP=1`` (the SGLang plugin calls
:func:`register`), used by MoE layers that SGLang runs with ``--moe-a2a-backend
customized``. SGLang 0.5.23 names that backend but builds nothing for it:
``create_moe_dispatcher`` (``layers/moe/fused_moe_triton/layer.py``) raises
``NotImplementedError``. The hook, the smallest SGLang allows, is an AROUND hook on that
one function through the plugin's ``HookRegistry``: for ``customized`` it returns
:class:`SparkcclDispatcher` (or raises ``ValueError`` naming what sparkccl cannot take);
for every other backend it calls SGLang's function unchanged.

The format is SGLang's ``standard`` one: dispatch returns the ``R`` rows this rank's
experts received (grouped by local expert, in (source rank, token) order), each a token
with top-k 1, its local expert's id and weight 1.0, so the runner computes exactly
``expert(row)``; combine sends those rows home and computes ``sum_k w[t, k] * out(t, k)``
in fp32, k in top-k order, rounded once. Experts are placed as SGLang's standard
dispatcher places them (rank r holds experts r * E_local .. (r + 1) * E_local - 1).
"""
from __future__ import annotations

import logging

import torch

from .. import config
from . import engine_ep

log = logging.getLogger("sparkccl.sglang")

TARGET = "sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher"
# The dispatch is the high-throughput mode's (it reads the received row count on the host),
# which SGLang's decode graphs cannot capture: a dispatch under capture raises this.
CAPTURE_HINT = ("SGLang: run with --cuda-graph-backend-decode=disabled (and "
                "--cuda-graph-backend-prefill=disabled where prefill is captured)")


def register() -> None:
    """Register the AROUND hook when ``SPARKCCL_SGLANG_EP=1`` (called by the SGLang plugin,
    itself on only with ``SPARKCCL_SGLANG=1``)."""
    if not config.get("SPARKCCL_SGLANG_EP"):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    HookRegistry.register(TARGET, create_moe_dispatcher, HookType.AROUND)
    log.info("sparkccl: SGLang EP hook on: --moe-a2a-backend customized dispatches and "
             "combines through sparkccl")


def create_moe_dispatcher(original, moe_runner_config, *args, **kwargs):
    """AROUND ``create_moe_dispatcher``: sparkccl's dispatcher for ``customized``."""
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend
    if not get_moe_a2a_backend().is_customized():
        return original(moe_runner_config, *args, **kwargs)
    why = decline_reason(moe_runner_config)
    if why is not None:
        raise ValueError(f"sparkccl: --moe-a2a-backend customized (SPARKCCL_SGLANG_EP=1) "
                         f"cannot take this MoE layer: {why}")
    return make_dispatcher(moe_runner_config)


def decline_reason(cfg) -> str | None:
    """Why sparkccl cannot take a layer (None: it can). Reads only the layer's runner
    configuration, the same on every rank."""
    from ..expert_parallel import MAX_TOPK
    if cfg.params_dtype not in (None, torch.bfloat16):
        return f"activations {cfg.params_dtype} (sparkccl dispatches bf16)"
    if cfg.num_fused_shared_experts:
        return "fused shared experts (--disable-shared-experts-fusion keeps them apart)"
    if cfg.hidden_size % 8:
        return f"hidden {cfg.hidden_size} not a multiple of 8"
    if not 1 <= cfg.top_k <= MAX_TOPK:
        return f"top-{cfg.top_k} (at most {MAX_TOPK})"
    if cfg.apply_router_weight_on_input:
        return "apply_router_weight_on_input"
    return None


def _keeps_global_ids(cfg) -> bool:
    # The runners that take global expert ids (SGLang's standard dispatcher asks the same
    # question of the same private helper; absent, local ids, its default).
    try:
        from sglang.srt.layers.moe.token_dispatcher.standard import _keeps_global_expert_ids
    except ImportError:
        return False
    return bool(_keeps_global_expert_ids(cfg.runner_backend))


def make_dispatcher(cfg):
    from sglang.srt.distributed.parallel_state import get_moe_ep_group
    from sglang.srt.layers.moe.token_dispatcher.base import (BaseDispatcher,
                                                             CombineInputFormat)
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput, TopKOutputChecker

    g = get_moe_ep_group()
    what = f"SGLang MoE EP group {g.unique_name}"
    if cfg.num_experts % g.world_size or cfg.num_local_experts * g.world_size != \
            cfg.num_experts:
        raise ValueError(f"sparkccl: {what}: {cfg.num_experts} experts, "
                         f"{cfg.num_local_experts} per rank, over {g.world_size} ranks")
    comm = engine_ep.group_comm(g.cpu_group, g.device, g.unique_name, what)
    ep = engine_ep.expert_parallel(comm, g.unique_name, num_experts=cfg.num_experts,
                                   hidden=cfg.hidden_size, max_tokens=_max_tokens(),
                                   placement="contiguous")
    global_ids = _keeps_global_ids(cfg)

    class SparkcclDispatcher(BaseDispatcher):
        """dispatch = sparkccl ExpertParallel.dispatch (standard format, top-1 rows);
        combine = its combine with the one-box finalize."""

        def __init__(self):
            super().__init__()
            self.ep, self.runner_backend = ep, cfg.runner_backend
            self._pending = None

        def dispatch(self, hidden_states: torch.Tensor, topk_output) -> StandardDispatchOutput:
            if TopKOutputChecker.format_is_bypassed(topk_output):
                topk_output = topk_output.to_standard()
            d = engine_ep.dispatch_rows(self.ep, hidden_states, topk_output.topk_ids,
                                        topk_output.topk_weights, capture_hint=CAPTURE_HINT)
            self._pending = d
            ids = (d.expert_global if global_ids else d.expert_local)
            ids = ids.to(topk_output.topk_ids.dtype).view(-1, 1)
            ones = torch.ones((d.x.shape[0], 1), dtype=torch.float32, device=d.x.device)
            return StandardDispatchOutput(hidden_states=d.x, hidden_states_scale=None,
                                          topk_output=StandardTopKOutput(ones, ids, None))

        def combine(self, combine_input) -> torch.Tensor:
            if combine_input.format != CombineInputFormat.STANDARD or \
                    getattr(combine_input, "routewise_layout", None) is not None:
                raise ValueError(f"sparkccl: {what}: combine takes the standard format's "
                                 f"finished rows, got {combine_input.format}")
            if self._pending is None:
                raise RuntimeError(f"sparkccl: {what}: combine without a dispatch")
            d, self._pending = self._pending, None
            return engine_ep.combine_rows(self.ep, d, combine_input.hidden_states,
                                          partial=engine_ep.partial_combine(g.unique_name))

    SparkcclDispatcher.__module__ = __name__
    SparkcclDispatcher.__qualname__ = "SparkcclDispatcher"
    return SparkcclDispatcher()


def _max_tokens() -> int:
    """Most tokens one rank dispatches in one call: ``SPARKCCL_SGLANG_EP_MAX_TOKENS``, else
    SGLang's ``chunked_prefill_size`` (its largest forward batch), the same on every rank."""
    n = config.get("SPARKCCL_SGLANG_EP_MAX_TOKENS")
    if n:
        return n
    from sglang.srt.runtime_context import get_server_args
    n = getattr(get_server_args(), "chunked_prefill_size", None)
    if not n or n <= 0:
        raise ValueError("sparkccl: SGLang EP needs a bound on the tokens per call: set "
                         "SPARKCCL_SGLANG_EP_MAX_TOKENS (SGLang's chunked_prefill_size is "
                         f"{n})")
    return n
