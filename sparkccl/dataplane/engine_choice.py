"""The one place that maps a collective to an engine of the CUDA data plane: (collective,
slice size, settings, capture state) -> :class:`~.engines.ProxyPathEngine`,
:class:`~.engines.FusedEngine`, :class:`~.engines.SplitEngine` or
:class:`~.ce_engine.CeEngine`; the one-shot all-reduce's
:class:`~.allreduce_engine.OneShotEngine` (GPU-direct or the proxy path) and the fused
two-step all-reduce's :class:`~.allreduce_engine.TwoStepEngine` (GPU-direct or the proxy
path, by the direct tables, as the one shot). One object of each per data plane, made once.

A new engine: a class with ``run(call: DirectCall)`` (GPU-direct) in its own module, its
name added to :data:`sparkccl.config.DIRECT_ENGINES` (the setting's choices) and to
``_CLASSES`` below, and its rule in :meth:`Engines.choose`.
"""
from __future__ import annotations

from .. import config
from ..errors import ConfigError
from ..plan.model import Op
from .allreduce_engine import OneShotEngine, TwoStepEngine
from .ce_engine import CeEngine
from .engines import Engine, FusedEngine, ProxyPathEngine, SplitEngine

_CLASSES = dict(zip(config.DIRECT_ENGINES, (FusedEngine, SplitEngine, CeEngine)))


class Engines:
    """A data plane's engines: ``proxy``, and the GPU-direct ones by name (``direct``)."""

    def __init__(self, plane):
        self.plane = plane
        self.proxy = ProxyPathEngine(plane)
        self.direct = {name: cls(plane) for name, cls in _CLASSES.items()}
        self.fused, self.split, self.ce = (self.direct[n] for n in ("fused", "split", "ce"))
        self.one_shot = OneShotEngine(plane)  # the one-shot all-reduce (allreduce_engine.py)
        self.two_step = TwoStepEngine(plane)  # the fused two-step all-reduce

    def choose(self, op: Op, S: int, table, finalize: bool = False) -> Engine:
        """The engine of a collective of slice ``S``; ``table``: the plane's GPU-direct
        stream table for ``op`` if this slice may go direct (else None: the proxy sends).

        * the proxy path without a table, or while a benchmark runs the wait role alone;
        * a finalize goes direct only with both roles (one fused kernel);
        * else ``SPARKCCL_DIRECT_MODE`` (the plane's ``direct_mode``): "auto" is "ce" from
          ``ce_min_slice`` per rank and "fused" below; "ce" needs streams that write 64-bit
          values (else "split"), and runs as "fused" once a collective was captured in a
          CUDA graph (its stream operations carry values the host computed from its own seq,
          which a replay would repeat) and in mode poison (collectives queued after a
          failure still run, and a failed plane must send nothing more, which copy engines
          cannot be told); a benchmark's publish role alone is the fused kernel's."""
        p = self.plane
        phases = p.phases
        if table is None or "publish" not in phases:
            return self.proxy
        if finalize:
            return self.fused if "wait" in phases else self.proxy
        mode = p.direct_mode
        if mode == "auto":
            mode = "ce" if S >= p.ce_min_slice else "fused"
        if mode == "ce" and not p.gpu.can_write_values():
            mode = "split"
        if mode == "ce" and (p.captured or p.on_failure == "poison"):
            mode = "fused"
        if "wait" not in phases:
            mode = "fused"
        return self.direct[mode]

    def one_shot_table(self, table):
        """The one-shot all-reduce's way for a slice whose GPU-direct AG table is ``table``
        (None where the slice may not go direct): that table (its one kernel writes the
        peers' AG slots itself, whatever ``SPARKCCL_DIRECT_MODE`` says: it is one launch,
        as "fused", at the decode sizes it serves), or None: the same kernel with the proxy
        sending. Benchmark phases do not apply (one kernel, both roles)."""
        return table

    def close(self) -> None:
        for engine in (self.proxy, *self.direct.values(), self.one_shot, self.two_step):
            engine.close()


def direct_blocks_setting() -> tuple[int, int] | None:
    """SPARKCCL_DIRECT_BLOCKS="publish,wait" (for measurements), or None when unset."""
    value = config.get("SPARKCCL_DIRECT_BLOCKS")
    if value is None:
        return None
    try:
        a, b = (int(v) for v in value)
    except ValueError:
        raise ConfigError(f"SPARKCCL_DIRECT_BLOCKS={','.join(value)!r}: expected two integers "
                          "'publish,wait'") from None
    return max(1, a), max(1, b)
