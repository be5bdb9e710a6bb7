"""sparkccl: prefill-sized all-gather and reduce-scatter collectives without NCCL.

Public API: :class:`Communicator`, :class:`ExpertParallel` (expert-parallel dispatch and
combine, docs/EXPERT_PARALLEL.md), the exceptions of :mod:`sparkccl.errors`
(:class:`SparkcclError` and its subclasses :class:`ConfigError` (with
:class:`ShmSpaceError`), :class:`FabricError`,
:class:`CudaUnavailable`, :class:`CollectiveError`), ``__version__``.
"""
from __future__ import annotations

from .errors import (CollectiveError, ConfigError, CudaUnavailable, FabricError,
                     ShmSpaceError, SparkcclError)

__version__ = "0.1.0"

__all__ = ["Communicator", "ExpertParallel", "SparkcclError", "ConfigError", "ShmSpaceError", "FabricError",
           "CudaUnavailable", "CollectiveError", "__version__"]


def __getattr__(name):
    # Imported lazily so that `import sparkccl` (e.g. for `sparkccl plan`) stays light.
    if name == "Communicator":
        from .comm import Communicator
        return Communicator
    if name == "ExpertParallel":
        from .expert_parallel import ExpertParallel
        return ExpertParallel
    raise AttributeError(f"module 'sparkccl' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"Communicator", "ExpertParallel"})
