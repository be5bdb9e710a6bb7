"""Exceptions raised by sparkccl.

Bad input raises the builtin ``ValueError`` / ``TypeError`` before anything is sent.
Everything that goes wrong while a collective runs (a wait past its timeout, a dead or
aborted peer, a transport failure, sizes that differ across ranks) raises
:class:`CollectiveError`; once a communicator has failed, every later call on it raises
``CollectiveError`` with the recorded cause. Build a new communicator to recover.
"""
from __future__ import annotations


class SparkcclError(Exception):
    """Base of every exception sparkccl defines."""


class ConfigError(SparkcclError, ValueError):
    """A setting (argument or environment variable) has a value sparkccl cannot use; the
    message names the setting and the value."""


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
