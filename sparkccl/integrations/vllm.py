"""vLLM plugin: sparkccl under vLLM's tensor-parallel all-reduce, all-gather and
reduce-scatter.

Loaded by vLLM itself through the ``vllm.general_plugins`` entry point (every process,
before the groups are built). Does nothing unless ``SPARKCCL_VLLM=1``. When on, it makes
the platform's ``get_device_communicator_cls()`` answer :class:`SparkcclCudaCommunicator`,
a ``CudaCommunicator`` subclass (``GroupCoordinator.graph_capture`` asserts that type), so
every group gets it; only tensor-parallel groups (``tp:*``) build a sparkccl
``Communicator`` and route. What routes is decided by
:func:`sparkccl.integrations.routing.should_route`; everything else goes to ``super()``,
vLLM's own NCCL path. See docs/VLLM_SGLANG.md.
"""
from __future__ import annotations

import collections
import logging

import torch

from .. import allreduce, config
from . import routing

log = logging.getLogger("sparkccl.vllm")

QUALNAME = "sparkccl.integrations.vllm.SparkcclCudaCommunicator"
ROUTED_GROUPS = ("tp",)
# The MoE combine asks for its reduce-scatter input buffer under this role (vLLM 0.33+).
COMBINE_ROLE = "moe_ag_rs_combine"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the communicator when switched on.

    vLLM may call plugins more than once per process; installing twice is harmless."""
    if not config.get("SPARKCCL_VLLM"):
        return
    from . import vllm_ep
    vllm_ep.register()  # expert parallelism: its own switch, SPARKCCL_VLLM_EP
    from vllm.platforms import current_platform
    try:
        from vllm.utils.import_utils import resolve_obj_by_qualname
    except ImportError:  # before vLLM split its utils module
        from vllm.utils import resolve_obj_by_qualname
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    platform_cls = type(current_platform)
    name = platform_cls.get_device_communicator_cls()
    if name == QUALNAME:
        return
    base = resolve_obj_by_qualname(name)
    if not (isinstance(base, type) and issubclass(base, CudaCommunicator)):
        log.warning("sparkccl: SPARKCCL_VLLM=1, but vLLM's %s platform communicates with %s, "
                    "not CudaCommunicator: the plugin stays inert", current_platform.device_name,
                    name)
        return
    platform_cls.get_device_communicator_cls = classmethod(lambda cls: QUALNAME)
    log.info("sparkccl: vLLM plugin on: %s replaces %s for every group; %s groups route "
             "through sparkccl", QUALNAME, name, "/".join(ROUTED_GROUPS))


def _base():
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    return CudaCommunicator


def _make_class():
    CudaCommunicator = _base()

    class SparkcclCudaCommunicator(CudaCommunicator):
        """vLLM's CUDA communicator, with sparkccl for large dim-0 all-gather /
        reduce-scatter of tensor-parallel groups.

        Attributes: ``sparkccl`` (the Communicator, None when this group does not route),
        ``route_settings``, ``route_counts`` (``(op, reason) -> calls``, for checks).
        """

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.sparkccl = None
            self.route_settings = None  # set (agreed by every rank) for routed groups
            self.route_counts = collections.Counter()
            kind = self.unique_name.split(":")[0]
            if kind not in ROUTED_GROUPS or self.world_size < 2:
                return
            from torch.distributed.distributed_c10d import _world
            if _world.pg_map.get(self.cpu_group) is None:
                # A stateless group has no c10d store to bootstrap over.
                log.info("sparkccl: vLLM group %s is stateless: it stays on NCCL",
                         self.unique_name)
                return
            from ..comm import Communicator
            s = self.route_settings = routing.agreed_settings(
                self.cpu_group, f"vLLM group {self.unique_name}")
            self.sparkccl = Communicator(group=self.cpu_group, device=self.device,
                                         topology=s.topology, transport=s.transport)
            log.info("%s", routing.describe(f"vLLM group {self.unique_name}", self.world_size,
                                            self.sparkccl, s))

        # ---- the decision --------------------------------------------------------
        def _decide(self, op, shape, dtype, dim, sizes=None) -> bool:
            if self.sparkccl is None:
                return False
            d = routing.should_route(op, tuple(shape), dtype, dim, self.world_size,
                                     self.route_settings, capturing=routing.stream_capturing(),
                                     sizes=sizes, rs_ready=self.sparkccl.rs_ready)
            self.route_counts[(op, d.reason)] += 1
            return d.route

        def _gather(self, x):
            return self.sparkccl.all_gather(x.contiguous())

        def _scatter(self, x, output=None):
            x = x.contiguous()
            if output is not None and output.is_contiguous():
                return self.sparkccl.reduce_scatter(x, out=output)
            y = self.sparkccl.reduce_scatter(x)
            return y if output is None else output.copy_(y)

        # ---- routed collectives ----------------------------------------------------
        def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
            # Out of place, as vLLM's own: GroupCoordinator.all_reduce returns the result.
            if self.sparkccl is not None:
                # (rs_ready only matters under capture; asked there alone, it costs nothing)
                capturing = routing.stream_capturing()
                d = routing.should_route(
                    "all_reduce", tuple(input_.shape), input_.dtype, 0, self.world_size,
                    self.route_settings, capturing=capturing,
                    rs_ready=not capturing or allreduce.capturable(self.sparkccl,
                                                                   input_.nbytes))
                self.route_counts[("all_reduce", d.reason)] += 1
                if d.route:
                    return self.sparkccl.all_reduce(input_.contiguous())
            return super().all_reduce(input_)

        def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
            if self._decide("all_gather", input_.shape, input_.dtype, dim):
                return self._gather(input_)
            return super().all_gather(input_, dim)

        def reduce_scatter(self, input_: torch.Tensor, dim: int = -1):
            if self._decide("reduce_scatter", input_.shape, input_.dtype, dim):
                return self._scatter(input_)
            return super().reduce_scatter(input_, dim)

        if hasattr(CudaCommunicator, "custom_all_gather"):
            def custom_all_gather(self, input_: torch.Tensor):
                if self._decide("all_gather", input_.shape, input_.dtype, 0):
                    return self._gather(input_)
                return super().custom_all_gather(input_)

        if hasattr(CudaCommunicator, "custom_reduce_scatter"):
            def custom_reduce_scatter(self, input_: torch.Tensor):
                if self._decide("reduce_scatter", input_.shape, input_.dtype, 0):
                    return self._scatter(input_)
                return super().custom_reduce_scatter(input_)

        if hasattr(CudaCommunicator, "reduce_scatterv"):
            def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes=None):
                if self._decide("reduce_scatter", input_.shape, input_.dtype, dim, sizes):
                    return self._scatter(input_)
                return super().reduce_scatterv(input_, dim, sizes)

        if hasattr(CudaCommunicator, "reduce_scatterv_into_output"):
            def reduce_scatterv_into_output(self, input_: torch.Tensor, output: torch.Tensor,
                                            dim: int = -1, sizes=None) -> torch.Tensor:
                if self._decide("reduce_scatter", input_.shape, input_.dtype, dim, sizes):
                    return self._scatter(input_, output)
                return super().reduce_scatterv_into_output(input_, output, dim, sizes)

        if hasattr(CudaCommunicator, "get_symmetric_memory_buffer"):
            def get_symmetric_memory_buffer(self, role, shape, dtype, device):
                # The MoE combine writes its output here and reduce-scatters it next:
                # sparkccl's send slot then saves the input copy. Same rule as the
                # reduce-scatter that follows, so both sides agree on every rank.
                if (role == COMBINE_ROLE and torch.device(device) == self.device
                        and self._decide("reduce_scatter", shape, dtype, 0)):
                    return self.sparkccl.reduce_scatter_input(tuple(shape), dtype)
                return super().get_symmetric_memory_buffer(role, shape, dtype, device)

        def destroy(self):
            if self.sparkccl is not None:
                self.sparkccl.close()
                self.sparkccl = None
            super().destroy()

    SparkcclCudaCommunicator.__module__ = __name__
    return SparkcclCudaCommunicator


def __getattr__(name):
    # Built on first use: importing this module (the entry point) must not import vLLM's
    # CUDA communicator while the plugin is off.
    if name == "SparkcclCudaCommunicator":
        cls = _make_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
