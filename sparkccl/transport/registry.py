"""The transports a communicator can choose from, in the order ``auto`` tries them, and
the choice itself. Apart from :mod:`.base` so that the transports (which subclass
:class:`.base.Transport`) and the table of them import in one direction only."""
from __future__ import annotations

from .base import AUTO, Transport
from .shm import ShmTransport
from .tcp import TcpTransport
from .verbs import VerbsTransport

def table() -> list[type[Transport]]:
    """The transports in the order ``auto`` tries them."""
    return [ShmTransport, VerbsTransport, TcpTransport]


def names() -> tuple[str, ...]:
    return (AUTO, *sorted(t.name for t in table()))


def join_record(requested: str, topology: str, roots: int) -> dict:
    """Every transport's probe of this rank, for the communicator's join record."""
    out: dict = {}
    for cls in table():
        out.update(cls.probe(requested, topology, roots))
    return out


def select(requested: str, infos: list[dict]) -> type[Transport]:
    """The transport class for ``requested`` (a name or ``auto``); ValueError if the ranks
    cannot use the one asked for."""
    classes = table()
    if requested == AUTO:
        for cls in classes:
            if cls.why_not(infos, explicit=False) is None:
                return cls
        raise ValueError("sparkccl.Communicator: no transport can connect these ranks")
    for cls in classes:
        if cls.name == requested:
            why = cls.why_not(infos, explicit=True)
            if why is not None:
                raise ValueError(f"sparkccl.Communicator: transport={requested!r}: {why}")
            return cls
    raise ValueError(f"transport={requested!r}: must be one of {', '.join(names())}")
