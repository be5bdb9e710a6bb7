"""The exceptions sparkccl raises, all exported from the ``sparkccl`` package.

::

    SparkcclError                        base of everything below
    ├── ConfigError (ValueError)         a setting (argument or SPARKCCL_* / NCCL_* variable)
    │                                    has a value sparkccl cannot use
    ├── FabricError (ValueError)         the RDMA devices / ports / GIDs asked for (or found)
    │                                    cannot carry a communicator
    ├── CudaUnavailable (RuntimeError)   device="cuda" without a working CUDA data plane
    │                                    (cuda-python, NVRTC, a GPU of compute capability >= 8.0)
    └── CollectiveError (RuntimeError)   a collective (or the creation or close of a
                                         communicator) could not complete

What a caller catches: ``ConfigError`` / ``FabricError`` / ``CudaUnavailable`` when a
communicator is created (fix the setting or the host, then retry), ``CollectiveError`` from
any call afterwards (the communicator is then unusable: build a new one). ``SparkcclError``
catches all four. Bad arguments to a call (a wrong dtype, shape or device) raise the builtin
``ValueError`` / ``TypeError`` before anything is sent; the communicator stays usable.
Everything that goes wrong while a collective runs (a wait past its timeout, a dead or
aborted peer, a transport failure, sizes that differ across ranks) raises
``CollectiveError``; once a communicator has failed, every later call on it raises
``CollectiveError`` with the recorded cause.
"""
from __future__ import annotations


class SparkcclError(Exception):
    """Base of every exception sparkccl defines."""


class ConfigError(SparkcclError, ValueError):
    """A setting (argument or environment variable) has a value sparkccl cannot use; the
    message names the setting and the value."""


class FabricError(SparkcclError, ValueError):
    """The requested RDMA fabric configuration cannot work (devices, ports, GIDs, pairing
    of lanes across ranks); the message gives every reason."""


class CudaUnavailable(SparkcclError, RuntimeError):
    """cuda-python (cuda.core / cuda.bindings) or NVRTC is missing or unusable, or the GPU
    is older than the kernels need."""


class ShmSpaceError(ConfigError):
    """/dev/shm has too little free space for a communicator's segments.

    A :class:`ConfigError`: the remedy is configuration (the container's
    shared memory size, or a smaller slot), nothing has been sent, and retrying as is
    cannot succeed. ``needed`` and ``free`` are in bytes (``free`` when measured)."""

    def __init__(self, message: str, *, needed: int = 0, free: int | None = None):
        super().__init__(message)
        self.needed, self.free = needed, free

    def __reduce__(self):
        return (_rebuild_space_error, (str(self), self.needed, self.free))


def _rebuild_space_error(message, needed, free):
    return ShmSpaceError(message, needed=needed, free=free)


class CollectiveError(SparkcclError, RuntimeError):
    """A collective could not complete.

    Attributes:
        rank: the rank that raised.
        peer: the rank whose data or connection failed, when known (else ``None``).
        connection: the connection that failed, e.g. ``"channel 0 root 1"``, when known.
        cause: the recorded cause: the first failure anywhere in the communicator, as
            written into the abort record (may name another rank than ``rank``).
    """

    def __init__(self, message: str, *, rank: int | None = None, peer: int | None = None,
                 connection: str | None = None, cause: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.connection = connection
        self.cause = cause if cause is not None else message

    def __reduce__(self):
        # Keyword-only attributes survive pickling (errors cross process boundaries in tests).
        return (_rebuild, (str(self), self.rank, self.peer, self.connection, self.cause))


def _rebuild(message, rank, peer, connection, cause):
    return CollectiveError(message, rank=rank, peer=peer, connection=connection, cause=cause)
