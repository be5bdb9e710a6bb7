"""The transport interface and the one place a transport is chosen.

In the manner of NCCL's ``struct ncclTransport`` table: each transport is one class with
the same hooks, and :func:`select` walks the table once per communicator. The
Communicator then only calls hooks; no code branches on the transport's name.

Hooks, in the order the Communicator calls them (every rank together; the transports' wire
formats are in docs/PROTOCOL.md):

1. ``probe(requested, topology, roots)`` (class method): this rank's facts for the join
   record; ``why_not(infos, explicit)``: None if these ranks can use it, else why;
   ``setup_watch(infos, rank)``: a check the setup barriers run (shm: are the peers'
   processes alive?), or None.
2. ``connect()``: exchange and connect, before the proxy exists (shm: map the peers'
   segments; tcp: the sockets; verbs: nothing yet).
3. ``attach(proxy)``: hand the (not yet started) native proxy its transport, the one way
   for every transport: ``proxy.attach(factory)`` with a native ``TransportFactory``
   (``_native.ShmTransport``, ``_native.TcpTransport``, ``_native.VerbsEndpoint``), and
   tell it the peers' regions.
4. ``add_segment(proxy, kind, abort_check)``: a segment created later (the reduce-scatter
   buffers on first use), after this rank's proxy knows its own regions in it.
5. ``close()``: after the proxy stopped.

Besides: ``peer_segment(peer, kind)`` (a peer's mapped segment, for the GPU-direct engines
of transports with ``maps_peers``), ``unlink_names()`` (remove this communicator's names
from /dev/shm after a failed setup), and the class flags ``maps_peers`` and
``needs_liveness`` (the Communicator runs the liveness channel of
:mod:`sparkccl.liveness` for transports that do not see a peer's death by themselves).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from ..buffers import Buffers
from ..bootstrap import Rendezvous

AUTO = "auto"


@dataclass
class Context:
    """What a transport needs from the communicator, given explicitly."""

    rv: Rendezvous
    rank: int
    world: int
    topology: str
    roots: int
    plans: list  # every rank's RankPlan
    infos: list[dict]  # every rank's join record (host, pid, uid, verbs probe)
    buffers: Buffers
    flags_addr: int
    bootstrap_timeout_s: float
    timeout_s: float
    worker_spin_us: int = 0  # shm copy workers: spin this long before sleeping (0: sleep)


class Transport:
    name: ClassVar[str]
    maps_peers: ClassVar[bool] = False  # True: the peers' segments are mapped here
    # True: a dead or silent peer may go unnoticed for seconds (sparkccl/liveness.py)
    needs_liveness: ClassVar[bool] = False

    def __init__(self, ctx: Context):
        self.ctx = ctx

    @classmethod
    def probe(cls, requested: str, topology: str, roots: int) -> dict:
        """This rank's facts for the join record that ``why_not`` reads (never raises)."""
        return {}

    @classmethod
    def why_not(cls, infos: list[dict], explicit: bool) -> str | None:
        return None

    @classmethod
    def setup_watch(cls, infos: list[dict], rank: int) -> Callable[[], None] | None:
        """A check for the setup waits that raises CollectiveError when a peer is known to
        be gone (before the proxies watch each other), or None."""
        return None

    def connect(self) -> None:
        pass

    def attach(self, proxy) -> None:
        raise NotImplementedError

    def add_segment(self, proxy, kind: str, abort_check: Callable[[], None]) -> None:
        raise NotImplementedError

    def peer_segment(self, peer: int, kind: str) -> Any:
        """The peer's mapped segment (``maps_peers`` transports only)."""
        raise LookupError(f"the {self.name} transport does not map its peers' memory")

    def unlink_names(self) -> None:
        """Remove from /dev/shm whatever names of this communicator this rank may remove
        (after a failed setup step; the mappings stay)."""
        self.ctx.buffers.unlink()

    def close(self) -> None:
        pass

    def lanes(self) -> dict:
        """(channel, root) -> the RDMA lane this rank uses there (a RootChoice: device,
        port, GID, rate); {} for a transport without lanes."""
        return {}

    def describe(self) -> list[str]:
        """One line per lane (selftest, logs); [] for a transport without lanes."""
        return []
