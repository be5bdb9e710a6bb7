"""What one communicator holds, and how it is built and torn down.

The Communicator (``sparkccl/comm.py``) first has the ranks :func:`join` (exchange and
check their join records, choose the transport once), then makes a :class:`Wiring`. :meth:`Wiring.build` creates this rank's segments
(:mod:`sparkccl.buffers`), connects the transport (:mod:`sparkccl.transport.base`), builds
the native proxy and hands it the transport, builds the data plane (CPU or CUDA, with the
GPU-direct engines when the peers are mapped here), runs the lane check and starts the
proxy and, where the transport needs it, the liveness channel (:mod:`sparkccl.liveness`).
The reduce-scatter buffers follow on first use (:meth:`Wiring.ensure_rs`).
:meth:`Wiring.teardown` releases it all in an order that leaks nothing even when a step
fails. Every step runs on every rank together (docs/PROTOCOL.md).
"""
from __future__ import annotations

import ctypes
import logging
import os
import time

from . import bootstrap, config, layout, liveness
from .buffers import Buffers, bytes_per_rank, mib, shortage_message
from .dataplane.cpu import CpuDataPlane
from .dataplane.peer_check import calls_view
from .errors import CollectiveError, ShmSpaceError
from .plan.build import TOPOLOGIES, build_plan
from .plan.model import REGION_SLOTS, Region
from .transport import base as transports
from .transport import registry
from .transport import check as lane_check

log = logging.getLogger("sparkccl")

SLOTS = [REGION_SLOTS[Region.AG], REGION_SLOTS[Region.RS_SEND], REGION_SLOTS[Region.RS_RECV]]
PROTOCOL_VERSION = 1
LL_MAX_WORLD = 8  # the LL all-reduce reads every source's lines at once (allreduce.cu BATCH)
# What every rank's join record must agree on (each rank raises the same ValueError).
AGREED = ("version", "world", "topology", "transport", "slot_bytes", "roots", "rs_up_front",
          "allreduce_oneshot_bytes")
JOIN_FIELDS = AGREED + ("host", "boot_id", "uid", "pid")  # in every rank's record



def join(rv: bootstrap.Rendezvous, world: int, topology: str, transport: str,
         settings: config.Settings) -> tuple[list[dict], type[transports.Transport]]:
    """Exchange this rank's join record (settings, host, process, every transport's
    probe), check that the ranks agree, and choose the transport for all of them: -> (every
    rank's record, the transport class)."""
    s = settings
    host, boot_id = bootstrap.host_id()
    info = dict(version=PROTOCOL_VERSION, world=world, topology=topology, transport=transport,
                slot_bytes=s.slot_bytes, roots=s.roots, rs_up_front=s.rs_up_front,
                allreduce_oneshot_bytes=s.allreduce_oneshot_bytes,
                host=host, boot_id=boot_id, uid=os.getuid(),
                pid=os.getpid(), **registry.join_record(transport, topology, s.roots))
    infos = rv.exchange("info", info, "join the communicator")
    malformed = [(i, why) for i, d in enumerate(infos) if (why := _unusable(d)) is not None]
    if malformed:
        raise ValueError("sparkccl.Communicator: could not be created: "
                         + "; ".join(f"rank {i}'s join record {why}" for i, why in malformed))
    failed = [(i, d["error"]) for i, d in enumerate(infos) if "error" in d]
    if failed:
        raise ValueError("sparkccl.Communicator: could not be created because of settings on "
                         + "; ".join(f"rank {i}: {e}" for i, e in failed))
    bootstrap.validate(infos, AGREED)
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology={topology!r}: must be one of {', '.join(TOPOLOGIES)}")
    return infos, registry.select(transport, infos)  # the only place a name is looked at


def _unusable(record) -> str | None:
    """Why a peer's join record cannot be read (None: it can, or it carries that rank's
    own error): not a record, another protocol version, or fields missing."""
    if not isinstance(record, dict):
        return f"is not a record ({type(record).__name__})"
    if "error" in record:
        return None
    version = record.get("version")
    if version != PROTOCOL_VERSION:
        return (f"has protocol version {version!r}, and this rank speaks {PROTOCOL_VERSION}: "
                "install the same sparkccl on every rank")
    missing = [k for k in JOIN_FIELDS if k not in record]
    if missing:
        return f"is truncated: it has no {', '.join(missing)}"
    return None


class Wiring:
    """This rank's buffers, transport link, proxy, data plane and liveness channel.

    ``nat``: the native module; ``rv``: the communicator's rendezvous; ``settings``: its
    resolved :class:`sparkccl.config.Settings`; ``infos``: every rank's join record;
    ``plan`` / ``sizes``: this rank's plan and the buffer sizes (the same on every rank).
    """

    def __init__(self, nat, rv: bootstrap.Rendezvous, *, token: str, rank: int, world: int,
                 topology: str, device, settings: config.Settings, infos: list[dict], plan,
                 sizes):
        self.nat, self.rv, self.rank, self.world = nat, rv, rank, world
        self.topology, self.device, self.settings, self.infos = topology, device, settings, infos
        self.plan, self.sizes = plan, sizes
        self.buffers = Buffers(token, rank, sizes)
        self.link: transports.Transport | None = None
        self.proxy = None
        self.dp = None
        self.liveness = None
        self.ctl_addr: int | None = None
        self.flags_addr: int | None = None
        self.gpu_direct = False
        self.rs_ready = False
        self._reservations = 0

    @property
    def pinned_bytes(self) -> int:
        return self.buffers.pinned_bytes

    # ---- building ----------------------------------------------------------------------
    def build(self, chosen: type[transports.Transport], transport_name: str) -> None:
        nat, rv, r, w, s = self.nat, self.rv, self.rank, self.world, self.settings
        bufs = self.buffers
        self.reserve(["ctl", "ag"] + (["rs"] if s.rs_up_front else []),
                     "reserve its shared memory", chosen.setup_watch(self.infos, r))
        ctl = bufs["ctl"]
        nat.init_control(ctl.addr, os.getpid())
        self.ctl_addr = ctl.addr
        self.flags_addr = ctl.addr + layout.FLAGS_OFFSET
        plans = [build_plan(self.topology, w, p, s.roots) for p in range(w)]
        self.link = link = chosen(transports.Context(
            rv=rv, rank=r, world=w, topology=self.topology, roots=s.roots, plans=plans,
            infos=self.infos, buffers=bufs, flags_addr=self.flags_addr,
            bootstrap_timeout_s=s.bootstrap_timeout_s, timeout_s=s.timeout_s,
            worker_spin_us=s.worker_spin_us))
        link.connect()

        t = self.plan.to_tables()
        self.proxy = px = nat.Proxy(r, w, self.ctl_addr, self.flags_addr, t["connections"],
                                    t["streams"], t["items"], SLOTS, s.spin_us, s.nap_us)
        if s.relay_lead >= 0:
            px.set_relay_lead(s.relay_lead)
        for kind in bufs.segments:
            bufs.wire(px, kind)
        link.attach(px)
        calls = None
        if s.check_sizes:  # the sources' call entries arrive in this rank's call words
            calls = calls_view(ctl.tensor, self.plan.num_flag_words)
        ag = bufs["ag"]
        if self.device.type == "cuda":
            from .dataplane.cuda import CudaDataPlane
            self.dp = CudaDataPlane(nat, plan=self.plan, ctl_addr=self.ctl_addr,
                                    flags_addr=self.flags_addr, ag=ag.tensor,
                                    ag_stride=self.sizes.ag_stride, timeout_s=s.timeout_s,
                                    peer_calls=calls, device=self.device)
            if link.maps_peers and s.gpu_direct and self.dp.maps_peers:
                self._setup_gpu_direct()
        else:
            self.dp = CpuDataPlane(nat, plan=self.plan, ctl_addr=self.ctl_addr,
                                   flags_addr=self.flags_addr, ag=ag.tensor,
                                   ag_stride=self.sizes.ag_stride, timeout_s=s.timeout_s,
                                   peer_calls=calls)
        self._agree_ll()
        if bufs.has("rs"):
            self._attach_rs_dataplane()
        if lane_check.enabled():  # one small write and flag over every connection
            lane_check.lane_check(nat, px, plans, r, self.topology, transport_name, ag.tensor,
                                  self.sizes.ag_stride, self.flags_addr, rv,
                                  lane_check.timeout_for(s.timeout_s))
        px.start()
        self.liveness = liveness.start_for(chosen, rv, r, w, s.bootstrap_timeout_s,
                                           self._peer_died)

    def _peer_died(self, peer: int, cause: str) -> None:
        """From the liveness thread: stop the proxy and every wait (sparkccl/liveness.py)."""
        self.nat.set_abort(self.ctl_addr, layout.ABORT_PEER, f"rank {self.rank}: {cause}")

    def reserve(self, kinds: list[str], what: str, abort_check=None) -> None:
        """Create (and reserve) this rank's segments ``kinds``, then learn whether every
        rank could: a shortage anywhere raises the same ShmSpaceError on every rank, with
        nothing left in /dev/shm."""
        error = None
        try:
            for kind in kinds:
                self.buffers.create(kind)
        except ShmSpaceError as e:
            error = str(e)
        n = self._reservations
        self._reservations = n + 1
        states = self.rv.exchange(f"reserved{n}", {"error": error}, what, abort_check)
        failed = [(i, st["error"]) for i, st in enumerate(states) if st["error"]]
        if failed:
            for kind in kinds:
                self.buffers.drop(kind)
            here_id = bootstrap.host_id()
            here = sum(1 for i in self.infos if (i["host"], i.get("boot_id")) == here_id)
            s = self.settings
            per_rank = bytes_per_rank(self.world, self.topology, s.slot_bytes, s.roots)
            raise ShmSpaceError(shortage_message(failed, per_rank, here, s.slot_bytes,
                                                 self.world), needed=per_rank)

    def _setup_gpu_direct(self) -> None:
        """CUDA + shm: every peer's segments are mapped here, so the GPU writes this rank's
        data straight into them and writes their flag words (the publish-triggered streams
        of the plan, executed by the data plane instead of the proxy's copy workers; the
        proxy keeps the relays). ``SPARKCCL_GPU_DIRECT=0``: the proxy sends everything."""
        self.proxy.set_gpu_streams(self.plan.publish_streams())
        peers = [p for p in range(self.world) if p != self.rank]
        seg = self.link.peer_segment
        self.dp.map_peers(ctl={p: (seg(p, "ctl").addr, self.sizes.ctl_bytes) for p in peers},
                          ag={p: (seg(p, "ag").addr, self.sizes.ag_bytes) for p in peers})
        self.gpu_direct = True

    def _agree_ll(self) -> None:
        """The one-shot all-reduce's LL way (CudaDataPlane.enable_ll) where every rank can
        take it: CUDA, a mesh (no relays), world <= 8 and ``SPARKCCL_ALLREDUCE_LL`` on. Each
        rank GPU-direct to every peer writes its lines into the peers' LL areas; any other
        (tcp, verbs, shm without GPU-direct) has its proxy post them (``CHUNK_LL``), where
        ``SPARKCCL_ALLREDUCE_LL_PROXY`` says so: a reader cannot tell the two apart, so each
        rank takes its own. All or none: a rank that waits for LL lines a peer never writes
        would time out, so the ranks say what they can through the store."""
        if self.topology != "mesh":  # (agreed: no exchange)
            return
        s = self.settings
        able = bool(self.device.type == "cuda" and s.allreduce_ll and self.world <= LL_MAX_WORLD
                    and (self.gpu_direct or s.allreduce_ll_proxy))
        if all(self.rv.exchange("allreduce_ll", able, "agree on the LL all-reduce",
                                self.dp.check_abort)):
            self.dp.enable_ll(through_proxy=not self.gpu_direct)

    def _attach_rs_dataplane(self) -> None:
        sz = self.sizes
        t = self.buffers["rs"].tensor
        self.dp.attach_rs(t[:sz.rs_send_bytes], sz.rs_send_stride, t[sz.rs_send_bytes:],
                          sz.rs_recv_stride)
        if self.gpu_direct:
            self.dp.map_peers_rs({p: (self.link.peer_segment(p, "rs").addr, sz.rs_bytes)
                                  for p in range(self.world) if p != self.rank},
                                 sz.rs_send_bytes)
        self.rs_ready = True

    def ensure_rs(self) -> None:
        """Create the reduce-scatter buffers on first use (every rank reaches this at the
        same collective, so the exchange goes through the store here)."""
        if self.rs_ready:
            return
        nat, ctl = self.nat, self.ctl_addr
        check = self.dp.check_abort
        try:
            self.reserve(["rs"], "reserve its reduce-scatter buffers", check)
            # This rank's proxy knows the regions before any peer can send into them.
            self.buffers.wire(self.proxy, "rs")
            self.link.add_segment(self.proxy, "rs", check)
        except CollectiveError as e:
            self.link.unlink_names()
            if not nat.abort_code(ctl):
                nat.set_abort(ctl, layout.ABORT_TIMEOUT, str(e))
            raise
        except ShmSpaceError:
            raise  # every rank raises it together, and all-gathers still work
        except (OSError, ValueError) as e:  # e.g. a peer's segment of the wrong size
            msg = f"rank {self.rank}: could not set up reduce-scatter buffers: {e}"
            nat.set_abort(ctl, layout.ABORT_TRANSPORT, msg)
            raise CollectiveError(msg, rank=self.rank) from e
        self._attach_rs_dataplane()
        log.info("sparkccl: rank %d: reduce-scatter buffers created (+%s, now %s)",
                 self.rank, mib(self.sizes.rs_bytes), mib(self.pinned_bytes))

    # ---- while running -----------------------------------------------------------------
    def proxy_stats(self) -> dict:
        return self.proxy.stats() if self.proxy is not None else {}

    def leave(self, text: str) -> None:
        """This rank gives up (an exception left the ``with`` block): record why, so that
        the peers' proxies fail them now with this cause instead of at their timeout."""
        if self.proxy is not None:
            self.nat.set_abort(self.ctl_addr, layout.ABORT_USER, text)

    # ---- teardown ----------------------------------------------------------------------
    def depart(self, issued: int, timeout_s: float) -> bool:
        """Leaving without ``close()`` (at interpreter exit, or the communicator dropped):
        first deliver what this rank still owes its peers, so that a peer still receiving
        this rank's last collective does not take the exit for a crash.

        Waits (up to ``timeout_s``; at once when the communicator has failed, e.g. a peer
        died) until this rank's GPU work is done and its proxy has posted, and the transport
        completed, every piece of the ``issued`` collectives: its own and the ones it relays
        for others. Then marks the control segment (``CTL_LEFT``: a peer's proxy fails only
        once it is past this rank's last collective) and tells the store this rank closed
        (a peer's ``close()`` does not wait for it). -> whether all of it went out; then the
        teardown says goodbye on every connection."""
        nat, ctl, px, dp = self.nat, self.ctl_addr, self.proxy, self.dp
        if px is None or ctl is None or nat.abort_code(ctl):
            return False
        if dp is not None:  # queued GPU collectives publish their pieces first
            try:
                dp.synchronize()
            except Exception as e:  # noqa: BLE001 - failed: leave as after any failure
                log.warning("sparkccl: rank %d: leaving: a queued collective failed: %s",
                            self.rank, e)
                return False
        deadline = time.monotonic() + timeout_s
        pause = 1e-4
        while px.delivered() < issued or px.outstanding():
            if nat.abort_code(ctl) or not px.running:
                return False
            if time.monotonic() > deadline:
                log.warning("sparkccl: rank %d: leaving without close(): after %g s the proxy "
                            "still had not delivered collectives %d..%d to the peers; leaving "
                            "anyway", self.rank, timeout_s, px.delivered(), issued - 1)
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        ctypes.c_uint64.from_address(ctl + layout.CTL_LEFT).value = issued + 1
        try:
            self.rv.post("closed", 1)  # the key close()'s barrier waits for
        except Exception as e:  # noqa: BLE001 - store gone: peers fall back on the abort path
            log.warning("sparkccl: rank %d: leaving: could not tell the store: %s", self.rank, e)
        return True

    def teardown(self, barrier: bool, bootstrap_timeout_s: float, departed: bool = False) -> None:
        """Release everything. ``barrier``: first finish this rank's GPU work and wait (up
        to ``bootstrap_timeout_s``, abort-aware) until every rank got here, so that the
        transport's goodbye is clean and no peer takes this rank's exit for a crash.
        ``departed``: :meth:`depart` delivered everything, so the goodbye is clean too."""
        nat, ctl, dp = self.nat, self.ctl_addr, self.dp
        if barrier and dp is not None:  # GPU work of this rank finishes first
            try:
                dp.synchronize()
            except CollectiveError as e:
                log.warning("sparkccl: rank %d: close(): a queued collective failed: %s",
                            self.rank, e)
            except Exception as e:
                log.warning("sparkccl: rank %d: close(): waiting for the GPU failed: %s",
                            self.rank, e)
        clean = departed
        if barrier and self.proxy is not None and ctl is not None:
            def check():
                if nat.abort_code(ctl):
                    cause = nat.error_text(ctl) or "aborted"
                    raise CollectiveError(f"rank {self.rank}: aborted while closing: {cause}",
                                          rank=self.rank, cause=cause)
            try:
                if not nat.abort_code(ctl):
                    self.rv.barrier("closed", "close the communicator", check,
                                    bootstrap_timeout_s,
                                    f"bootstrap_timeout_s={bootstrap_timeout_s:g}")
                    clean = True
            except CollectiveError as e:
                log.warning("sparkccl: rank %d: close() did not hear from every rank (%s); "
                            "closing anyway", self.rank, e)
            except Exception as e:  # store gone etc.
                log.warning("sparkccl: rank %d: close() barrier failed: %s", self.rank, e)
        # Each release runs even when an earlier one failed: a leak of sockets, QPs or
        # shared memory is worse than a second error in the log.
        steps = []
        if self.liveness is not None:  # before the control segment goes: it sets the abort word
            code = nat.abort_code(ctl) if ctl is not None else 0
            text = nat.error_text(ctl) if code else None
            steps.append(("the liveness channel",
                          lambda lv=self.liveness: lv.stop(goodbye=clean, abort_text=text)))
        if dp is not None:  # unpin (stopping kernels still running) before unmapping
            steps.append(("the data plane", dp.close))
        if self.proxy is not None:  # tcp: a goodbye, so peers see no crash
            steps.append(("the proxy", lambda px=self.proxy: px.stop(graceful=clean)))
        if self.link is not None:  # after the proxy stopped: sockets, QPs, peer mappings
            steps.append(("the transport", self.link.close))
        bufs = self.buffers  # kept: pinned_bytes still says what this rank held
        steps.append(("the shared memory", lambda: (bufs.unlink_every_rank(self.world),
                                                    bufs.close())))
        self.liveness = self.proxy = self.link = self.dp = None
        for what, release in steps:
            try:
                release()
            except Exception as e:  # noqa: BLE001 - the remaining steps must still run
                log.warning("sparkccl: rank %d: close(): releasing %s failed: %s",
                            self.rank, what, e)

    def forget_after_fork(self) -> None:
        """In a forked child (:mod:`sparkccl.lifetime`): the proxy thread and the segments
        are the parent's; never tear them down here."""
        import ctypes
        px, self.proxy = self.proxy, None
        if px is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(px))  # never destroyed in the child
        self.link = None
        if self.liveness is not None:
            self.liveness.forget()
            self.liveness = None
        self.buffers.segments.clear()
