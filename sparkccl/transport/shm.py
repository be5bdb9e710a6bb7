"""The ``shm`` transport: every rank on one host maps every peer's segments.

Setup: each rank creates its segments, all ranks wait until all exist, map the peers', wait
until all are mapped, then every rank removes every name from /dev/shm (the mappings stay),
so a process killed later leaves nothing behind. Until the proxies watch each other, the
waits check that the peers' processes are still alive, so a rank that died during setup is
named at once. The native shm transport copies into the peers' mapped regions.
"""
from __future__ import annotations

import os

from .. import bootstrap, layout, shm
from ..buffers import KINDS, LABELS
from ..errors import CollectiveError
from .base import Transport


class ShmTransport(Transport):
    name = "shm"
    maps_peers = True

    def __init__(self, ctx):
        super().__init__(ctx)
        bootstrap.validate(ctx.infos, ("uid",))
        self.pids = [int(i["pid"]) for i in ctx.infos]
        self.peer_segs: dict[tuple[int, str], shm.Segment] = {}
        self._check_peers_alive = self.setup_watch(ctx.infos, ctx.rank)

    @classmethod
    def why_not(cls, infos, explicit):
        hosts = [(i["host"], i.get("boot_id")) for i in infos]
        if len(set(hosts)) == 1:
            return None
        p = bootstrap.describe_disagreement("host", [h[0] for h in hosts])
        return (f"needs every rank on one host, but they run on different hosts "
                f"({p or 'different boot ids'}); use transport='tcp' or 'auto'")

    def peers(self) -> list[int]:
        return [p for p in range(self.ctx.world) if p != self.ctx.rank]

    @classmethod
    def setup_watch(cls, infos, rank):
        """Until the proxies watch each other: a peer whose process is gone fails the
        setup waits at once (every rank is on this host)."""
        pids = [int(i["pid"]) for i in infos]

        def check() -> None:
            for p, pid in enumerate(pids):
                if p == rank:
                    continue
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    raise CollectiveError(f"rank {rank}: rank {p} (pid {pid}) exited while the "
                                          "communicator was being set up", rank=rank,
                                          peer=p) from None
                except PermissionError:
                    pass
        return check

    def _map(self, kind: str) -> None:
        bufs, r = self.ctx.buffers, self.ctx.rank
        size = bufs.sizes.segment_bytes(kind)
        for p in self.peers():
            name = bufs.name(p, kind)
            try:
                self.peer_segs[(p, kind)] = shm.Segment.attach(name, size)
            except FileNotFoundError:
                raise CollectiveError(
                    f"rank {r}: the shared memory of rank {p} ({shm.path_of(name)}) is gone: "
                    f"rank {p} or another rank gave up on this communicator or exited",
                    rank=r, peer=p) from None

    def _unlink(self, kinds) -> None:
        """Every rank's names of ``kinds`` (the mappings stay)."""
        for p in range(self.ctx.world):
            for kind in kinds:
                shm.unlink_name(self.ctx.buffers.name(p, kind))

    def connect(self) -> None:
        rv, kinds = self.ctx.rv, list(self.ctx.buffers.segments)
        rv.barrier("created", "create its shared memory", self._check_peers_alive)
        for kind in kinds:
            self._map(kind)
        rv.barrier("mapped", "map the shared memory of its peers", self._check_peers_alive)
        # Every segment is mapped by every rank: each rank removes all names, so none is
        # left once any rank has returned from here.
        self._unlink(kinds)

    def _wire_peer_regions(self, proxy, kind: str) -> None:
        for p in self.peers():
            base = self.peer_segs[(p, kind)].addr
            for reg, off, _, size in self.ctx.buffers.sizes.regions(kind):
                proxy.set_peer_region(p, int(reg), base + off, size)

    def attach(self, proxy) -> None:
        from .. import _native
        proxy.attach(_native.ShmTransport(self.ctx.worker_spin_us))
        for p in self.peers():
            pc = self.peer_segs[(p, "ctl")]
            proxy.set_peer(p, pc.addr, pc.addr + layout.FLAGS_OFFSET, self.pids[p])
        for kind in self.ctx.buffers.segments:
            self._wire_peer_regions(proxy, kind)

    def add_segment(self, proxy, kind, abort_check) -> None:
        rv = self.ctx.rv
        label = LABELS[kind]
        rv.barrier(f"{kind}-created", f"create its {label} buffers", abort_check)
        self._map(kind)
        rv.barrier(f"{kind}-mapped", f"map its peers' {label} buffers", abort_check)
        self._unlink([kind])
        self._wire_peer_regions(proxy, kind)

    def unlink_names(self) -> None:
        self._unlink(KINDS)

    def peer_segment(self, peer, kind):
        return self.peer_segs[(peer, kind)]

    def close(self) -> None:
        for seg in self.peer_segs.values():
            seg.close()
        self.peer_segs.clear()
