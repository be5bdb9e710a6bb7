"""vLLM expert parallelism on sparkccl: a ``FusedMoEPrepareAndFinalizeModular`` whose
prepare is :meth:`sparkccl.ExpertParallel.dispatch` and whose finalize is its combine,
with the one-box finalize bits (docs/EXPERT_PARALLEL.md "Inside the engines").

Switched on by ``SPARKCCL_VLLM=1`` and ``SPARKCCL_VLLM_EP=1`` (the vLLM plugin calls
:func:`register`), used by layers that vLLM runs with ``--enable-expert-parallel`` over
data parallelism and the default ``--all2all-backend allgather_reducescatter``
(``ParallelConfig.all2all_backend`` is a fixed ``Literal`` in 0.33.0: no name can be added).

The hook, the smallest vLLM 0.33.0 allows: vLLM has no registry of all-to-all backends;
``fused_moe/all2all_utils.py`` ``maybe_make_prepare_finalize(moe, quant_config, ...)``
picks the class from the backend name, and its callers (``fused_moe/oracle/*.py``, the
elastic EP code) import it by name. :func:`register` replaces that one module attribute
with a wrapper (modules that imported it already are rebound to the wrapper, so every
caller sees it): for a layer it takes (see :func:`decline_reason`, which looks only at
the layer's configuration, the same on every rank), it returns
:class:`SparkcclPrepareAndFinalize`; for any other it calls vLLM's function unchanged.

Two formats, as vLLM's DeepEP backends (the experts kernel vLLM picks decides which):

* ``Standard`` (:class:`SparkcclPrepareAndFinalize`, as DeepEP high-throughput's): prepare
  returns the ``R`` rows this rank's experts received (grouped by local expert, in (source
  rank, token) order), each as a token with top-k 1, its expert's global id and weight 1.0,
  so the experts compute exactly ``expert(row)``. The high-throughput dispatch reads ``R``
  on the host, so it cannot be captured in a CUDA graph.
* ``BatchedExperts`` (:class:`SparkcclBatchedPrepareAndFinalize`, as DeepEP low-latency's),
  for layers whose experts vLLM runs in its batched format (``--moe-backend
  batched_triton``): sparkccl's low-latency mode, ``[E_local, world * max_num_tokens, H]``
  with per-expert counts on the device; nothing is read on the host, so vLLM's CUDA graphs
  capture it (decode). fp8 layers are taken here too (``quant_reason``): for blocks of
  128 columns vLLM's quantizer runs on the home rank and the e4m3 rows travel with their
  scales (as vLLM's DeepEP low-latency backend sends them), otherwise the received rows
  are quantized by the same call.

Either way finalize sends the expert outputs home and computes ``sum_k w[t, k] * out(t, k)``
in fp32, k in top-k order, rounded once: the bits of every expert on one box, whatever
the EP size.

CUDA graphs: vLLM turns graphs off itself for the backends that cannot be captured
(DeepEP high-throughput, MoonEP), not for ``allgather_reducescatter``, so :func:`register`
also wraps ``VllmConfig.__post_init__``: a configuration whose MoE layers this hook takes
in the ``Standard`` format (expert parallelism with an all-to-all, the
``allgather_reducescatter`` backend, an unquantized bf16 model, a MoE backend other than
``batched_triton``) gets ``cudagraph_mode`` NONE before vLLM resolves it, as if
``--enforce-eager`` had been given (:func:`graphs_off_reason`; logged). A ``Standard``
prepare under capture anyway (a quantized model whose layers the hook takes, a mode set
after the config) raises before anything is sent, naming the remedy.
"""
from __future__ import annotations

import logging
import sys

import torch

from .. import config
from . import engine_ep, routing

log = logging.getLogger("sparkccl.vllm")

TARGET_MODULE = "vllm.model_executor.layers.fused_moe.all2all_utils"
TARGET = "maybe_make_prepare_finalize"
BACKEND = "allgather_reducescatter"
BATCHED_MOE_BACKEND = "batched_triton"  # vLLM's experts in the batched format
CONFIG_MODULE = "vllm.config.vllm"
CAPTURE_HINT = ("vLLM: the sparkccl hook sets cudagraph_mode NONE for expert parallelism "
                "with an all-to-all; keep it so (or run with --enforce-eager), or run the "
                f"experts in the batched format (--moe-backend {BATCHED_MOE_BACKEND}), "
                "whose low-latency dispatch graphs capture")


def register() -> None:
    """Install the wrapper when ``SPARKCCL_VLLM_EP=1`` (called by the vLLM plugin, itself
    on only with ``SPARKCCL_VLLM=1``). Installing twice is harmless."""
    if not config.get("SPARKCCL_VLLM_EP"):
        return
    import importlib
    mod = importlib.import_module(TARGET_MODULE)
    original = getattr(mod, TARGET)
    if getattr(original, "_sparkccl_original", None) is not None:
        return
    wrapper = _make_wrapper(original)
    setattr(mod, TARGET, wrapper)
    # Callers import the function by name: rebind the ones imported before us.
    for m in list(sys.modules.values()):
        if getattr(m, "__name__", "").startswith("vllm.") and \
                getattr(m, TARGET, None) is original:
            setattr(m, TARGET, wrapper)
    _hook_config(importlib.import_module(CONFIG_MODULE).VllmConfig)
    log.info("sparkccl: vLLM EP hook on: --enable-expert-parallel layers with "
             "--all2all-backend %s dispatch and combine through sparkccl", BACKEND)


def _hook_config(cls) -> None:
    """Wrap ``cls.__post_init__`` (vLLM's ``VllmConfig``) so that a configuration whose MoE
    layers the hook takes runs without CUDA graphs (module docstring). Once only."""
    original = cls.__post_init__
    if getattr(original, "_sparkccl_original", None) is not None:
        return

    def __post_init__(self, *args, **kwargs):
        try:
            why = graphs_off_reason(self)
        except AttributeError as e:  # (another vLLM's config: graphs as it decides)
            log.warning("sparkccl: vLLM EP hook: cannot read the configuration (%s); CUDA "
                        "graphs as vLLM sets them: a captured MoE dispatch will raise", e)
            why = None
        if why is not None:
            from vllm.config.compilation import CUDAGraphMode
            log.info("sparkccl: vLLM CUDA graphs off (cudagraph_mode NONE, as vLLM does for "
                     "DeepEP high-throughput): %s", why)
            self.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        return original(self, *args, **kwargs)
    __post_init__._sparkccl_original = original
    __post_init__.__wrapped__ = original
    cls.__post_init__ = __post_init__


def graphs_off_reason(vllm_config) -> str | None:
    """Why this configuration must run without CUDA graphs (None: it need not): its MoE
    layers would take the hook's dispatch, which cannot be captured. Where the layers' own
    answer (:func:`decline_reason`) is not known yet, from the configuration: expert
    parallelism with an all-to-all (``ParallelConfig.use_all2all``: data, sequence or
    prefill-context parallelism), the ``allgather_reducescatter`` backend, an unquantized
    MoE model in bf16 (other dtypes are declined; a quantized model's layers may be too,
    fp8 activations are, so its graphs stay: a layer taken under capture raises with the
    remedy), a MoE backend other than ``batched_triton`` (whose layers take the batched
    format's low-latency dispatch, which graphs capture). Graphs already off: None."""
    p, m = vllm_config.parallel_config, vllm_config.model_config
    c = vllm_config.compilation_config
    if not (p.enable_expert_parallel and p.use_all2all and p.all2all_backend == BACKEND):
        return None
    kernel = getattr(vllm_config, "kernel_config", None)
    if getattr(kernel, "moe_backend", None) == BATCHED_MOE_BACKEND:
        return None
    if m is not None and (not getattr(m, "is_moe", True) or m.dtype != torch.bfloat16
                          or getattr(m, "quantization", None) is not None):
        return None
    mode = c.cudagraph_mode
    if mode is not None and getattr(mode, "name", None) == "NONE":
        return None
    return (f"the sparkccl EP hook takes the MoE layers (--enable-expert-parallel, "
            f"--all2all-backend {BACKEND}, an all-to-all: data parallel size "
            f"{p.data_parallel_size}); its high-throughput dispatch reads the row count on "
            "the host, which a graph cannot capture (SPARKCCL_VLLM_EP=0 keeps graphs and "
            "vLLM's backend)")


def _make_wrapper(original):
    def maybe_make_prepare_finalize(moe, quant_config, *args, **kwargs):
        why = decline_reason(moe, quant_config)
        if why is not None:
            log.info("sparkccl: vLLM MoE layer stays on vLLM's %s: %s",
                     moe.moe_parallel_config.all2all_backend, why)
            return original(moe, quant_config, *args, **kwargs)
        batched = getattr(moe, "moe_backend", None) == BATCHED_MOE_BACKEND
        return _pf_class(batched).for_layer(moe)
    maybe_make_prepare_finalize._sparkccl_original = original
    maybe_make_prepare_finalize.__wrapped__ = original
    maybe_make_prepare_finalize.__doc__ = original.__doc__
    return maybe_make_prepare_finalize


def decline_reason(moe, quant_config) -> str | None:
    """Why a layer keeps vLLM's own prepare/finalize (None: it takes sparkccl's). Reads only
    the layer's configuration, the same on every rank of the EP group."""
    from ..expert_parallel import MAX_TOPK
    p = moe.moe_parallel_config
    if not p.use_all2all_kernels:
        return "no all-to-all (expert parallelism off, or neither DP, PCP nor SP above 1)"
    if p.all2all_backend != BACKEND:
        return f"--all2all-backend {p.all2all_backend} (sparkccl takes {BACKEND})"
    if p.enable_eplb:
        return "EPLB (redundant experts) is not supported"
    if moe.in_dtype != torch.bfloat16:
        return f"activations {moe.in_dtype} (sparkccl dispatches bf16)"
    why = quant_reason(moe, quant_config)
    if why is not None:
        return why
    if moe.num_experts % p.ep_size:
        return f"{moe.num_experts} experts over {p.ep_size} ranks"
    if moe.hidden_dim % 8:
        return f"hidden {moe.hidden_dim} not a multiple of 8"
    if not 1 <= moe.experts_per_token <= MAX_TOPK:
        return f"top-{moe.experts_per_token} (at most {MAX_TOPK})"
    return None


FP8 = torch.float8_e4m3fn
FP8_GROUP = 128  # ExpertParallel's e4m3 dispatch: one fp32 scale per row and 128 columns


def quant_reason(moe, quant_config) -> str | None:
    """Why the layer's activation quantization keeps it on vLLM's backend (None: none, or
    one the hook takes). Taken: fp8 e4m3 with a scale per row or group of a row, or a static
    one (each row's bits the same whichever batch it is quantized in), in the batched format
    (whose low-latency dispatch graphs capture; a quantized model keeps its graphs)."""
    q = _activation_quant(quant_config)
    if q is None:
        return None
    if getattr(moe, "moe_backend", None) != BATCHED_MOE_BACKEND:
        return (f"quantized activations ({q.quant_dtype}): sparkccl takes them in vLLM's "
                f"batched format only (--moe-backend {BATCHED_MOE_BACKEND})")
    if q.quant_dtype != FP8:
        return f"quantized activations ({q.quant_dtype}): sparkccl takes fp8 e4m3 only"
    if q.block_shape is None and not q.per_act_token_quant and q.a1_scale is None:
        return ("fp8 activations with one dynamic scale per tensor (a scale over a batch: "
                "the experts would see scales of other batches than one box's)")
    return None


def _activation_quant(quant_config):
    """The layer's quant config where its activations are quantized, else None."""
    if quant_config is None or quant_config.quant_dtype is None:
        return None
    return quant_config


def _fp8_dispatch(quant_config, hidden: int) -> bool:
    """Whether the tokens travel as vLLM quantized them (e4m3 and a scale per 128
    columns, what ExpertParallel sends), as vLLM's DeepEP low-latency backend does for
    blocks of 128; otherwise bf16 travels and the received rows are quantized."""
    b = quant_config.block_shape
    return b is not None and b[1] == FP8_GROUP and hidden % FP8_GROUP == 0


def _quantize(rows: torch.Tensor, quant_config):
    """vLLM's own activation quantizer (moe_kernel_quantize_input, as its prepare/finalize
    classes call it) over ``rows`` [m, H]: (e4m3 rows, scales)."""
    from vllm.model_executor.layers.fused_moe import utils
    return utils.moe_kernel_quantize_input(rows, quant_config.a1_scale,
                                           quant_config.quant_dtype,
                                           quant_config.per_act_token_quant,
                                           quant_config.block_shape)


def _batched_scales(scales, num_experts: int):
    from vllm.model_executor.layers.fused_moe.utils import normalize_batched_scales_shape
    return normalize_batched_scales_shape(scales, num_experts)


def _modular_base():
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    return mk


def _make_class():
    mk = _modular_base()

    class SparkcclPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
        """Prepare = sparkccl dispatch, finalize = sparkccl combine with the one-box
        finalize. The ExpertParallel is built at the first prepare, from the expert map
        vLLM passes there (gathered from every rank: collective, as prepare is)."""

        MODE = "high_throughput"  # the ExpertParallel's

        def __init__(self, comm, group_name: str, num_experts: int, hidden: int,
                     max_tokens: int):
            super().__init__()
            self.comm, self.group_name = comm, group_name
            self.num_experts, self.hidden, self.max_tokens = num_experts, hidden, max_tokens
            self._eps = {}  # dispatch dtype -> ExpertParallel (one dtype per layer in practice)
            self._pending = None  # (ExpertParallel, what dispatch gave) prepare -> finalize

        @classmethod
        def for_layer(cls, moe):
            from vllm.distributed.parallel_state import get_ep_group
            g = get_ep_group()
            comm = engine_ep.group_comm(g.cpu_group, g.device, g.unique_name,
                                        f"vLLM EP group {g.unique_name}")
            return cls(comm, g.unique_name, moe.num_experts, moe.hidden_dim,
                       moe.max_num_tokens)

        # ---- what vLLM asks of a prepare/finalize -----------------------------------
        @property
        def activation_format(self):
            return mk.FusedMoEActivationFormat.Standard

        def topk_indices_dtype(self):
            return None

        def max_num_tokens_per_rank(self):
            return None

        def num_dispatchers(self) -> int:
            return self.comm.world_size

        def output_is_reduced(self) -> bool:
            return True  # finalize leaves each token's whole sum on its home rank

        # ---- prepare / finalize --------------------------------------------------------
        def _expert_parallel(self, expert_map, dtype=torch.bfloat16):
            ep = self._eps.get(dtype)
            if ep is None:
                if routing.stream_capturing():
                    raise RuntimeError(
                        "sparkccl EP: the layer's first prepare is under CUDA graph "
                        "capture; it gathers the expert map (a collective read on the "
                        "host): vLLM runs an eager pass first (its profile run), keep it")
                if expert_map is None:
                    raise ValueError("sparkccl EP: vLLM passed no expert map to prepare")
                owners = engine_ep.placement_from_local_ids(self.comm, expert_map,
                                                            self.num_experts)
                ep = self._eps[dtype] = engine_ep.expert_parallel(
                    self.comm, self.group_name, num_experts=self.num_experts,
                    hidden=self.hidden, max_tokens=self.max_tokens, placement=owners,
                    mode=self.MODE, dtype=dtype)
            return ep

        def _inputs(self, a1, topk_weights, topk_ids, expert_map,
                    apply_router_weight_on_input, dtype=torch.bfloat16):
            """(ExpertParallel, tokens, weights) of a prepare call."""
            ep = self._expert_parallel(expert_map, dtype)
            if not apply_router_weight_on_input:
                return ep, a1, topk_weights
            # vLLM's rule for all its all-to-all backends: top-1 only, weight on the
            # input; the finalize then weighs by 1.0.
            if topk_ids.shape[1] != 1:
                raise ValueError("sparkccl EP: apply_router_weight_on_input needs top-1, "
                                 f"got top-{topk_ids.shape[1]}")
            return (ep, a1 * topk_weights.to(a1.dtype),
                    torch.ones_like(topk_weights, dtype=torch.float32))

        def _take_pending(self):
            if self._pending is None:
                raise RuntimeError("sparkccl EP: finalize without a prepare")
            pending, self._pending = self._pending, None
            return pending

        def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                    apply_router_weight_on_input, quant_config, defer_input_quant=False):
            engine_ep.refuse_capture(self.comm.rank, self.comm.world_size, CAPTURE_HINT)
            ep, a1, topk_weights = self._inputs(a1, topk_weights, topk_ids, expert_map,
                                                apply_router_weight_on_input)
            d = engine_ep.dispatch_rows(ep, a1, topk_ids, topk_weights,
                                        capture_hint=CAPTURE_HINT)
            self._pending = (ep, d)
            meta = mk.ExpertTokensMetadata(expert_num_tokens=d.counts,
                                           expert_num_tokens_cpu=d.counts.cpu())
            ids = d.expert_global.to(topk_ids.dtype).view(-1, 1)
            ones = torch.ones((d.x.shape[0], 1), dtype=torch.float32, device=d.x.device)
            return d.x, None, meta, ids, ones

        def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                     apply_router_weight_on_input, weight_and_reduce_impl) -> None:
            ep, d = self._take_pending()
            engine_ep.combine_rows(ep, d, fused_expert_output, out=output,
                                   partial=engine_ep.partial_combine(self.group_name))

    class SparkcclBatchedPrepareAndFinalize(SparkcclPrepareAndFinalize):
        """The same in vLLM's batched format, as DeepEP low-latency's: prepare = sparkccl's
        low-latency dispatch (``[E_local, world * max_num_tokens, H]``, per-expert counts
        on the device), finalize = its combine; no host read, so CUDA graphs capture both
        (after vLLM's eager profile run has built the ExpertParallel)."""

        MODE = "low_latency"

        @property
        def activation_format(self):
            return mk.FusedMoEActivationFormat.BatchedExperts

        def max_num_tokens_per_rank(self):
            return self.max_tokens

        def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                    apply_router_weight_on_input, quant_config, defer_input_quant=False):
            quant = None if defer_input_quant else _activation_quant(quant_config)
            fp8 = quant is not None and _fp8_dispatch(quant, self.hidden)
            ep, a1, topk_weights = self._inputs(
                a1, topk_weights, topk_ids, expert_map, apply_router_weight_on_input,
                FP8 if fp8 else torch.bfloat16)
            if fp8:  # vLLM's quantizer here, its bits sent as they are (as DeepEP LL's)
                a1q, scales = _quantize(a1, quant)
                recv, handle = engine_ep.dispatch_batched(ep, a1q, topk_ids, topk_weights,
                                                          x_scales=scales)
                x, x_scales = recv.x, recv.x_scales
            else:
                recv, handle = engine_ep.dispatch_batched(ep, a1, topk_ids, topk_weights)
                x, x_scales = recv.x, None
                if quant is not None:  # the received rows, one by one (row-wise scales)
                    E_local, M, H = x.shape
                    x, x_scales = _quantize(x.view(E_local * M, H), quant)
                    x = x.view(E_local, M, H)
                    x_scales = _batched_scales(x_scales, E_local)
            self._pending = (ep, handle)
            meta = mk.ExpertTokensMetadata(expert_num_tokens=recv.counts,
                                           expert_num_tokens_cpu=None)
            return x, x_scales, meta, None, None

        def finalize(self, output, fused_expert_output, topk_weights, topk_ids,
                     apply_router_weight_on_input, weight_and_reduce_impl) -> None:
            ep, handle = self._take_pending()
            engine_ep.combine_batched(ep, handle, fused_expert_output, out=output,
                                      partial=engine_ep.partial_combine(self.group_name))

    for cls in (SparkcclPrepareAndFinalize, SparkcclBatchedPrepareAndFinalize):
        cls.__module__ = __name__
    return SparkcclPrepareAndFinalize, SparkcclBatchedPrepareAndFinalize


def _pf_class(batched: bool = False):
    mod = sys.modules[__name__]
    return mod.SparkcclBatchedPrepareAndFinalize if batched else mod.SparkcclPrepareAndFinalize


_CLASSES = ("SparkcclPrepareAndFinalize", "SparkcclBatchedPrepareAndFinalize")


def __getattr__(name):
    # Built on first use: importing this module must not import vLLM's fused MoE while
    # the hook is off.
    if name in _CLASSES:
        globals().update(zip(_CLASSES, _make_class()))
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
