"""sparkccl: prefill-sized all-gather and reduce-scatter collectives without NCCL.

Public API: :class:`Communicator`, :class:`CollectiveError`, ``__version__``.
"""
from __future__ import annotations

from .errors import CollectiveError

__version__ = "0.1.0"

__all__ = ["Communicator", "CollectiveError", "__version__"]


def __getattr__(name):
    # Imported lazily so that `import sparkccl` (e.g. for `sparkccl plan`) stays light.
    if name == "Communicator":
        from .comm import Communicator
        return Communicator
    raise AttributeError(f"module 'sparkccl' has no attribute {name!r}")
