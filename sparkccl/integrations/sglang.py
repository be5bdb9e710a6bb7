"""SGLang plugin: sparkccl under SGLang's tensor-parallel all-reduce, all-gather and
reduce-scatter.

Loaded by SGLang through the ``sglang.srt.plugins`` entry point; does nothing unless
``SPARKCCL_SGLANG=1``. When on, it registers AROUND hooks on
``GroupCoordinator._all_gather_into_tensor(output, input)`` and
``_reduce_scatter_tensor(output, input)`` (where SGLang's custom ops, and on CPU the public
methods, end) and an AFTER hook on ``GroupCoordinator.__init__`` that builds a sparkccl
``Communicator`` over the group's gloo ``cpu_group`` for tensor-parallel groups (``tp:*``).
Both calls are dim 0 on whole buffers (SGLang moves other dims itself), so the rule of
:func:`sparkccl.integrations.routing.should_route` sees dim 0; whatever it declines runs
SGLang's original method.

All-reduce is hooked AROUND the public ``GroupCoordinator.all_reduce(input_)``, before
SGLang picks among its paths (custom all-reduce, symmetric memory, pynccl, the CPU shm
kernel): a routed call returns sparkccl's result (a new tensor; SGLang's callers use the
returned tensor). Under ``torch.compile`` tracing the call declines (a Python hook would be
traced), so with ``--enable-torch-compile`` all-reduce stays on SGLang's path. See
docs/VLLM_SGLANG.md.
"""
from __future__ import annotations

import collections
import logging

import torch

from .. import allreduce, config
from . import routing

log = logging.getLogger("sparkccl.sglang")

TARGET = "sglang.srt.distributed.parallel_state.GroupCoordinator"
ROUTED_GROUPS = ("tp",)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: register the hooks when switched on.

    SGLang applies registered hooks right after its plugins ran (``load_plugins``)."""
    if not config.get("SPARKCCL_SGLANG"):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from . import sglang_ep
    sglang_ep.register()  # expert parallelism: its own switch, SPARKCCL_SGLANG_EP
    HookRegistry.register(f"{TARGET}.__init__", attach, HookType.AFTER)
    HookRegistry.register(f"{TARGET}.destroy", detach, HookType.AFTER)
    HookRegistry.register(f"{TARGET}._all_gather_into_tensor", all_gather_into_tensor,
                          HookType.AROUND)
    HookRegistry.register(f"{TARGET}._reduce_scatter_tensor", reduce_scatter_tensor,
                          HookType.AROUND)
    HookRegistry.register(f"{TARGET}.all_reduce", all_reduce, HookType.AROUND)
    log.info("sparkccl: SGLang plugin on: %s groups route through sparkccl",
             "/".join(ROUTED_GROUPS))


def attach(result, group, *args, **kwargs):
    """AFTER ``GroupCoordinator.__init__``: every rank of the group builds its sparkccl
    communicator here, together (creation is collective)."""
    _state(group)
    return result


def detach(result, group, *args, **kwargs):
    """AFTER ``GroupCoordinator.destroy``: close the group's communicator on every rank
    (a barrier, then a graceful stop: peers see a goodbye, not a crash)."""
    st = group.__dict__.pop("_sparkccl", None)
    if st is not None and st.comm is not None:
        st.comm.close()
    return result


class _GroupState:
    def __init__(self, group):
        self.settings = None  # set (agreed by every rank) for routed groups
        self.counts = collections.Counter()
        self.comm = None
        world = group.world_size
        if group.unique_name.split(":")[0] not in ROUTED_GROUPS or world < 2:
            return
        from ..comm import Communicator
        s = self.settings = routing.agreed_settings(group.cpu_group,
                                                    f"SGLang group {group.unique_name}")
        self.comm = Communicator(group=group.cpu_group, device=group.device,
                                 topology=s.topology, transport=s.transport)
        log.info("%s", routing.describe(f"SGLang group {group.unique_name}", world,
                                        self.comm, s))


def _state(group) -> _GroupState:
    st = group.__dict__.get("_sparkccl")
    if st is None:
        st = group._sparkccl = _GroupState(group)
    return st


def _decide(group, op, input, output) -> _GroupState | None:
    st = _state(group)
    if st.comm is None:
        return None
    d = routing.should_route(op, tuple(input.shape), input.dtype, 0, group.world_size,
                             st.settings, capturing=routing.stream_capturing(),
                             rs_ready=st.comm.rs_ready)
    if d.route and not _fits(op, input, output, group.world_size):
        d = routing.Decision(False, "output shape")
    st.counts[(op, d.reason)] += 1
    return st if d.route else None


def all_reduce(original, group, input_: torch.Tensor):
    st = _state(group)
    if st.comm is None:
        return original(group, input_)
    if torch.compiler.is_compiling():
        d = routing.Decision(False, "torch.compile")
    else:
        capturing = routing.stream_capturing()
        d = routing.should_route("all_reduce", tuple(input_.shape), input_.dtype, 0,
                                 group.world_size, st.settings, capturing=capturing,
                                 rs_ready=not capturing or allreduce.capturable(
                                     st.comm, input_.nbytes))
    st.counts[("all_reduce", d.reason)] += 1
    if not d.route:
        return original(group, input_)
    return st.comm.all_reduce(input_.contiguous())


def _fits(op, input, output, world) -> bool:
    # SGLang preallocates output; its element count fixes the meaning, the same on every
    # rank (shapes are), so a mismatch declines everywhere alike.
    n = input.numel() * world if op == "all_gather" else input.numel() // world
    return output.dtype == input.dtype and output.numel() == n


def all_gather_into_tensor(original, group, output: torch.Tensor, input: torch.Tensor):
    st = _decide(group, "all_gather", input, output)
    if st is None:
        return original(group, output, input)
    x = input.contiguous()
    shape = (group.world_size * (x.shape[0] if x.dim() else 1), *x.shape[1:])
    if output.is_contiguous():
        st.comm.all_gather(x, out=output.view(shape))
    else:
        output.copy_(st.comm.all_gather(x).view(output.shape))
    return output


def reduce_scatter_tensor(original, group, output: torch.Tensor, input: torch.Tensor):
    st = _decide(group, "reduce_scatter", input, output)
    if st is None:
        return original(group, output, input)
    x = input.contiguous()
    shape = (x.shape[0] // group.world_size, *x.shape[1:])
    if output.is_contiguous():
        st.comm.reduce_scatter(x, out=output.view(shape))
    else:
        output.copy_(st.comm.reduce_scatter(x).view(output.shape))
    return output
