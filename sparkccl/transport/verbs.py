"""Setup of the ``verbs`` transport: RDMA RC queue pairs over RoCE v2 or InfiniBand.

Python computes, native executes. The native side (``native/src/verbs_transport.cpp``,
libibverbs loaded at run time) opens devices, creates and connects QPs, registers memory
and moves bytes; everything that is a decision happens here, once per communicator:

1. **Lanes.** Which device port (and GID) carries each (channel, root) of the plan:
   :func:`sparkccl.fabric.select_mesh` / :func:`~sparkccl.fabric.select_ring` (docs/CONTRACT.md §6:
   arguments, ``SPARKCCL_IB_HCA`` / ``SPARKCCL_RING_PREV_HCA`` + ``SPARKCCL_RING_NEXT_HCA``,
   ``NCCL_IB_HCA``, then discovery; GID: ``SPARKCCL_IB_GID_INDEX``, ``NCCL_IB_GID_INDEX``,
   else the RoCE v2 GID of the root's own IPv4 address). Mesh: lane (0, k) = root k of
   the chosen port. Ring: (0, k) = root k of the port facing prev, (1, k) of the port
   facing next; a QP to prev lives on a prev-facing device, and so on.
2. **Open.** One RC QP per plan connection (RESET -> INIT), memory registered on every
   lane's device: the flag words and the AG region now, the reduce-scatter regions when
   the communicator creates them.
3. **Exchange.** Every rank publishes one connection record through the store: world,
   topology, roots, ordering mode, per lane (device, port, GID, LID, active MTU, link
   layer, IPv4), per connection (QP number, PSN), per memory key (address, size, rkey per
   lane) -- or the error that kept it from opening. Every rank checks all records the same
   way and raises one :class:`~sparkccl.fabric.FabricError` naming every rank and reason
   when they cannot work together (a rank could not open its lanes; world, topology,
   roots or ordering differ; devices per rank differ; a connection has no partner; link
   layers differ; a lane has no usable MTU or GID).
4. **Connect.** My connection (peer p, channel c, root k) pairs with p's connection
   (me, arrival channel, k): the same channel in a mesh, the other one in a ring (my prev
   port is cabled to p's next port). Path MTU = min of both ends' active MTU. INIT -> RTR
   -> RTS; then every rank reports, and all raise together if any QP failed.
5. **Wire.** The peer's region addresses and sizes go to the proxy's registry (as for
   shm, but remote addresses), the rkeys to the endpoint, and the endpoint becomes the
   proxy's transport. The lane check (:mod:`sparkccl.transport.check`) then proves every
   QP with one small write and flag before the first collective.

Settings (arguments first, then ``SPARKCCL_*``, then ``NCCL_*``, then the default):

| variable | default | meaning |
| --- | --- | --- |
| ``SPARKCCL_IB_TIMEOUT`` (``NCCL_IB_TIMEOUT``) | 18 | QP local ACK timeout: 4.096 us x 2^t per attempt (18: ~1.07 s) |
| ``SPARKCCL_IB_RETRY_CNT`` (``NCCL_IB_RETRY_CNT``) | 7 | retransmissions before a write fails with "retry counter exceeded" |
| ``SPARKCCL_IB_RNR_RETRY`` | 7 | receiver-not-ready retries (7 = forever; only strict ordering posts receives) |
| ``SPARKCCL_IB_ORDERING`` | ``inline`` | ``inline``: the flag is an inline RDMA WRITE after the data on the same QP (RC order). ``strict``: for hosts whose PCIe bridges may reorder posted writes: the flag travels as an RDMA WRITE_WITH_IMM; the receiving proxy stores it only after its receive completion, i.e. after the NIC reported the data placed |
| ``SPARKCCL_IB_TC`` (``NCCL_IB_TC``) | 0 | RoCE traffic class (DSCP << 2 \\| ECN) |
| ``SPARKCCL_IB_SL`` (``NCCL_IB_SL``) | 0 | service level |
| ``SPARKCCL_IBVERBS_LIB`` | ``libibverbs.so.1`` | the library to load |

Every rank must use the same ordering mode (checked at setup).
"""
from __future__ import annotations

import ctypes
import ipaddress
import logging
import mmap
import os
from dataclasses import dataclass
from typing import Mapping

from .. import config, layout
from ..bootstrap import describe_disagreement
from ..buffers import LABELS
from ..errors import CollectiveError
from ..fabric import FabricError, RootChoice, Selection, select_mesh, select_ring
from ..plan.model import arrival
from .base import Transport

log = logging.getLogger("sparkccl")

ENV_TIMEOUT = "SPARKCCL_IB_TIMEOUT"
ENV_RETRY_CNT = "SPARKCCL_IB_RETRY_CNT"
ENV_RNR_RETRY = "SPARKCCL_IB_RNR_RETRY"
ENV_ORDERING = "SPARKCCL_IB_ORDERING"
ENV_TC = "SPARKCCL_IB_TC"
ENV_SL = "SPARKCCL_IB_SL"

MTU_ENUM = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
MTU_BYTES = {v: k for k, v in MTU_ENUM.items()}
LINK_LAYERS = {0: "unspecified", 1: "InfiniBand", 2: "Ethernet"}
LINK_ETHERNET = 2
KEY_FLAGS = 3
KEY_INBOX = 4  # the abort inbox: one control-block-shaped slot per peer (verbs_transport.h)
INBOX_SLOT = 4096  # layout.CTL_BYTES
RECORD_VERSION = 1


def _native():
    from .. import _native as nat
    return nat


# ---- settings ---------------------------------------------------------------------------

@dataclass(frozen=True)
class VerbsSettings:
    timeout: int = 18
    retry_cnt: int = 7
    rnr_retry: int = 7
    ordering: str = "inline"
    traffic_class: int = 0
    service_level: int = 0
    stall_s: float = 120.0

    def native(self) -> dict:
        return dict(timeout=self.timeout, retry_cnt=self.retry_cnt, rnr_retry=self.rnr_retry,
                    strict=self.ordering == "strict", traffic_class=self.traffic_class,
                    service_level=self.service_level, stall_s=self.stall_s)


def resolve_settings(env: Mapping[str, str] | None = None, *, timeout=None, retry_cnt=None,
                     rnr_retry=None, ordering=None, traffic_class=None, service_level=None,
                     stall_s: float = 120.0) -> VerbsSettings:
    """Arguments, then ``SPARKCCL_IB_*``, then ``NCCL_IB_*``, then defaults, each through its
    declaration in :mod:`sparkccl.config` (ConfigError names the argument or variable)."""
    return VerbsSettings(
        timeout=config.setting(ENV_TIMEOUT, timeout, "timeout", env),
        retry_cnt=config.setting(ENV_RETRY_CNT, retry_cnt, "retry_cnt", env),
        rnr_retry=config.setting(ENV_RNR_RETRY, rnr_retry, "rnr_retry", env),
        ordering=config.setting(ENV_ORDERING, ordering, "ordering", env),
        traffic_class=config.setting(ENV_TC, traffic_class, "traffic_class", env),
        service_level=config.setting(ENV_SL, service_level, "service_level", env),
        stall_s=float(stall_s))


# ---- lanes ------------------------------------------------------------------------------

def channel_name(topology: str, channel: int) -> str:
    return "mesh" if topology == "mesh" else ("prev", "next")[channel]


def select_lanes(topology: str, roots: int, *, rank: int = 0, env: Mapping[str, str] | None = None,
                 devices=None, prev_devices=None, next_devices=None,
                 gid_index: int | None = None) -> Selection:
    """The checked :class:`~sparkccl.fabric.Selection` for this rank (FabricError if none).
    Tests replace this function to give each in-process rank its own fake devices."""
    if topology == "mesh":
        sel = select_mesh(devices=devices, gid_index=gid_index, roots=roots, env=env)
    else:
        sel = select_ring(prev_devices=prev_devices, next_devices=next_devices,
                          gid_index=gid_index, roots=roots, env=env)
    return sel.check()


def lanes_of(sel: Selection, topology: str, roots: int) -> dict[tuple[int, int], RootChoice]:
    """(channel, root) -> the device port carrying it."""
    if topology == "mesh":
        sides = [sel.mesh]
    else:
        sides = [sel.prev, sel.next]
    out = {}
    for ch, side in enumerate(sides):
        if len(side) != roots:
            raise FabricError(f"{channel_name(topology, ch)}: {len(side)} device(s) selected, "
                              f"{roots} needed (one per root)")
        for k, choice in enumerate(side):
            out[(ch, k)] = choice
    return out


def probe(topology: str, roots: int, env: Mapping[str, str] | None = None) -> str | None:
    """None if this host could run the verbs transport, else why not (for ``auto``)."""
    ok, lib = _native().verbs_library()
    if not ok:
        return lib
    try:
        select_lanes(topology, roots, env=env)
    except FabricError as e:
        return str(e)
    return None


# ---- records ----------------------------------------------------------------------------

def flags_key_bytes(num_flag_words: int) -> int:
    """The bytes ``KEY_FLAGS`` registers from the flag words on: the flag words, the call
    words after them (Transport::put_call) and the LL area past those (Transport::put_lines,
    the one-shot all-reduce's LL lines through the proxy), one registration."""
    start, n = layout.ll_area(num_flag_words)
    return start + n - layout.FLAGS_OFFSET


def _lane_key(ch: int, k: int) -> str:
    return f"{ch}/{k}"


def _lane_label(topology: str, lane: str, rec: dict | None = None) -> str:
    ch, k = (int(x) for x in lane.split("/"))
    text = f"{channel_name(topology, ch)} root {k}"
    if rec is not None and lane in rec.get("lanes", {}):
        text += f" ({rec['lanes'][lane]['device']})"
    return text


def check_records(records: list[dict], topology: str) -> list[str]:
    """Every reason the ranks' records cannot work together (same text on every rank)."""
    problems = []
    errors = [(r, rec["error"]) for r, rec in enumerate(records) if rec.get("error")]
    if errors:
        return [f"rank {r}: {e}" for r, e in errors]
    for fld, label in (("version", "record version"), ("world", "world"),
                       ("topology", "topology"), ("roots", "roots"),
                       ("ordering", "ordering mode (SPARKCCL_IB_ORDERING)")):
        p = describe_disagreement(label, [rec.get(fld) for rec in records])
        if p:
            problems.append(p)
    p = describe_disagreement("devices per rank", [len(rec["lanes"]) for rec in records])
    if p:
        problems.append(p)
    if problems:
        return problems
    for r, rec in enumerate(records):
        for lane, info in sorted(rec["lanes"].items()):
            if info["mtu"] not in MTU_BYTES:
                problems.append(f"rank {r} {_lane_label(topology, lane, rec)}: no usable active "
                                f"MTU (enum {info['mtu']})")
            if info["link_layer"] == LINK_ETHERNET and not any(bytes.fromhex(info["gid"])):
                problems.append(f"rank {r} {_lane_label(topology, lane, rec)}: GID index "
                                f"{info['gid_index']} is empty")
    for r, rec in enumerate(records):
        for c in rec["conns"]:
            p, ch, k = c["peer"], c["channel"], c["root"]
            if not 0 <= p < len(records):
                problems.append(f"rank {r}: connection to rank {p}, which does not exist")
                continue
            arr = arrival(topology, ch)
            mine = _lane_key(ch, k)
            theirs = _lane_key(arr, k)
            match = [pc for pc in records[p]["conns"]
                     if (pc["peer"], pc["channel"], pc["root"]) == (r, arr, k)]
            if not match:
                problems.append(f"rank {r}'s {_lane_label(topology, mine)} connection to rank "
                                f"{p} has no partner there (rank {p} has no "
                                f"{_lane_label(topology, theirs)} connection to rank {r})")
                continue
            if r > p:
                continue  # the pair is checked once, from its lower rank
            a, b = rec["lanes"][mine], records[p]["lanes"][theirs]
            if a["link_layer"] != b["link_layer"]:
                problems.append(
                    f"rank {r} {_lane_label(topology, mine, rec)} is "
                    f"{LINK_LAYERS.get(a['link_layer'], a['link_layer'])} but rank {p} "
                    f"{_lane_label(topology, theirs, records[p])} is "
                    f"{LINK_LAYERS.get(b['link_layer'], b['link_layer'])}")
    return problems


def notes_for(records: list[dict], topology: str) -> list[str]:
    """Things that work but are worth a warning: MTU or subnet differences within a pair."""
    notes = []
    for r, rec in enumerate(records):
        for c in rec["conns"]:
            p, ch, k = c["peer"], c["channel"], c["root"]
            if r > p:
                continue
            mine, theirs = _lane_key(ch, k), _lane_key(arrival(topology, ch), k)
            a, b = rec["lanes"].get(mine), records[p]["lanes"].get(theirs)
            if a is None or b is None:
                continue
            if a["mtu"] != b["mtu"]:
                notes.append(f"ranks {r} and {p} {_lane_label(topology, mine)}: active MTUs "
                             f"{MTU_BYTES.get(a['mtu'])} and {MTU_BYTES.get(b['mtu'])}: path MTU "
                             f"{MTU_BYTES.get(min(a['mtu'], b['mtu']))}")
            if a.get("ipv4") and b.get("ipv4"):
                na = ipaddress.IPv4Interface(a["ipv4"]).network
                nb = ipaddress.IPv4Interface(b["ipv4"]).network
                if na != nb:
                    notes.append(f"rank {r} {_lane_label(topology, mine, rec)} ({a['ipv4']}) "
                                 f"and rank {p} {_lane_label(topology, theirs, records[p])} "
                                 f"({b['ipv4']}) are on different subnets: miscabled, or "
                                 "roots in another order?")
    return list(dict.fromkeys(notes))


def pair(records: list[dict], rank: int, topology: str) -> list[dict]:
    """For each of ``rank``'s connections: what its QP connects to (peer QP, PSN, LID, GID,
    path MTU, GRH or not) and the peer's rkeys for that QP's device."""
    rec = records[rank]
    out = []
    for c in rec["conns"]:
        p, ch, k = c["peer"], c["channel"], c["root"]
        arr = arrival(topology, ch)
        peer = records[p]
        pc = next(x for x in peer["conns"] if (x["peer"], x["channel"], x["root"]) == (rank, arr, k))
        mine, theirs = rec["lanes"][_lane_key(ch, k)], peer["lanes"][_lane_key(arr, k)]
        rkeys = {int(key): (m[0], m[1], m[2][_lane_key(arr, k)]) for key, m in peer["mem"].items()}
        out.append(dict(peer=p, qpn=pc["qpn"], psn=pc["psn"], lid=theirs["lid"],
                        gid=bytes.fromhex(theirs["gid"]), path_mtu=min(mine["mtu"], theirs["mtu"]),
                        global_route=mine["link_layer"] == LINK_ETHERNET, mem=rkeys))
    return out


# ---- one rank's endpoint ----------------------------------------------------------------

def _raise_all(kind, what: str, problems: list[str], rank: int):
    text = f"sparkccl verbs transport: {what}:\n  " + "\n  ".join(problems)
    if kind is CollectiveError:
        raise CollectiveError(f"rank {rank}: {text}", rank=rank, cause=text)
    raise kind(text)


class VerbsLink:
    """This rank's verbs endpoint, from opening the devices to a wired proxy.

    All ranks call :meth:`connect` together (and :meth:`add_memory` together, e.g. on the
    first reduce-scatter); each exchanges through ``rv`` (a :class:`~sparkccl.bootstrap.
    Rendezvous`) and raises the same error on every rank when the setup cannot work.
    """

    def __init__(self, rv, plans, rank: int, topology: str, roots: int, *,
                 settings: VerbsSettings | None = None, env: Mapping[str, str] | None = None,
                 selection: Selection | None = None, timeout_s: float = 120.0,
                 stall_s: float = 120.0):
        self.rv, self.plans, self.rank = rv, plans, rank
        self.world = len(plans)
        self.topology, self.roots = topology, roots
        self.env = os.environ if env is None else env
        self.settings = settings  # None: resolved in _open, whose errors every rank hears
        self.stall_s = stall_s
        self.selection = selection
        self.timeout_s = timeout_s
        self.endpoint = None
        self.lanes: dict[tuple[int, int], RootChoice] = {}
        self.records: list[dict] = []
        self._paired: list[dict] = []
        self._mem: dict[int, tuple[int, int, dict]] = {}
        self._exchanges = 0
        # Abort inbox: peer p writes its abort record into slot p (a control-block layout
        # that this rank's proxy watches as p's control block).
        self._inbox = mmap.mmap(-1, self.world * INBOX_SLOT)
        self._inbox_addr = ctypes.addressof(ctypes.c_char.from_buffer(self._inbox))

    # -- setup steps --
    def _open(self, memory: dict[int, tuple[int, int]]) -> dict:
        nat = _native()
        ok, lib = nat.verbs_library()
        if not ok:
            raise RuntimeError(f"verbs transport: {lib}")
        if self.settings is None:
            self.settings = resolve_settings(self.env, stall_s=self.stall_s)
        sel = self.selection
        if sel is None:
            sel = select_lanes(self.topology, self.roots, rank=self.rank, env=self.env)
        self.selection = sel
        self.lanes = lanes_of(sel, self.topology, self.roots)
        conns = self.plans[self.rank].connections
        used = sorted({(c.channel, c.root) for c in conns})
        order = {lane: i for i, lane in enumerate(used)}
        lanes = [(self.lanes[l].device, self.lanes[l].port, self.lanes[l].gid_index) for l in used]
        self.endpoint = ep = nat.VerbsEndpoint(
            self.rank, self.world, lanes, [[c.peer, c.channel, c.root] for c in conns],
            [order[(c.channel, c.root)] for c in conns], self.settings.native())
        infos = ep.lanes()
        lane_rec = {}
        for lane, i in order.items():
            info, choice = infos[i], self.lanes[lane]
            if choice.gid and info["link_layer"] == LINK_ETHERNET:
                sysfs = ipaddress.IPv6Address(choice.gid).packed
                if sysfs != info["gid"]:
                    log.warning("sparkccl: rank %d: %s port %d GID %d is %s in sysfs but %s "
                                "from libibverbs", self.rank, choice.device, choice.port,
                                choice.gid_index, choice.gid,
                                ipaddress.IPv6Address(info["gid"]))
            lane_rec[_lane_key(*lane)] = dict(
                device=info["device"], port=info["port"], gid_index=info["gid_index"],
                gid=info["gid"].hex(), lid=info["lid"], mtu=info["active_mtu"],
                link_layer=info["link_layer"], state=info["state"], ipv4=choice.ipv4,
                netdev=choice.netdev)
        qps = ep.connections()
        conn_rec = [dict(peer=c.peer, channel=c.channel, root=c.root, qpn=q["qpn"], psn=q["psn"])
                    for c, q in zip(conns, qps)]
        self._used = used
        memory = {**memory, KEY_INBOX: (self._inbox_addr, self.world * INBOX_SLOT)}
        mem = {str(key): self._register(key, addr, size) for key, (addr, size) in memory.items()}
        return dict(version=RECORD_VERSION, world=self.world, topology=self.topology,
                    roots=self.roots, ordering=self.settings.ordering, lanes=lane_rec,
                    conns=conn_rec, mem=mem, error=None)

    def _register(self, key: int, addr: int, size: int) -> list:
        keys = self.endpoint.register_memory(key, addr, size)
        rkeys = {_lane_key(*lane): keys[i][1] for i, lane in enumerate(self._used)}
        self._mem[key] = (addr, size, rkeys)
        return [addr, size, rkeys]

    def _exchange(self, name: str, value, what: str, abort_check=None):
        self._exchanges += 1
        return self.rv.exchange(f"verbs-{name}", value, what, abort_check=abort_check,
                                timeout_s=self.timeout_s)

    def connect(self, proxy, memory: dict[int, tuple[int, int]]) -> None:
        """Open, exchange, check, connect and wire ``proxy`` (not started yet). ``memory``:
        key -> (address, size) to register now (``KEY_FLAGS`` and the AG region at least)."""
        try:
            record = self._open(memory)
        except (FabricError, RuntimeError, ValueError, OSError) as e:
            record = dict(version=RECORD_VERSION, error=str(e))
        records = self._exchange("records", record, "open its RDMA devices")
        problems = check_records(records, self.topology)
        if problems:
            what = ("some ranks could not open their RDMA devices"
                    if any(r.get("error") for r in records) else
                    "the ranks' RDMA setups do not pair")
            _raise_all(FabricError, what, problems, self.rank)
        for note in notes_for(records, self.topology):
            if self.rank == 0:
                log.warning("sparkccl: verbs: %s", note)
        self.records = records
        self._paired = paired = pair(records, self.rank, self.topology)
        error = None
        try:
            for i, info in enumerate(paired):
                for key, (_, _, rkey) in info["mem"].items():
                    self.endpoint.set_remote_key(i, key, rkey)
                iaddr, _, irkey = info["mem"][KEY_INBOX]
                self.endpoint.set_abort_inbox(i, iaddr + self.rank * INBOX_SLOT, irkey)
                self.endpoint.connect(i, info["qpn"], info["psn"], info["lid"], info["gid"],
                                      info["path_mtu"], info["global_route"])
        except (RuntimeError, ValueError) as e:
            error = str(e)
        states = self._exchange("rts", {"error": error}, "bring its queue pairs up")
        failed = [f"rank {r}: {s['error']}" for r, s in enumerate(states) if s.get("error")]
        if failed:
            _raise_all(CollectiveError, "could not connect every queue pair", failed, self.rank)
        self._wire(proxy, paired)
        proxy.attach(self.endpoint)

    def _wire(self, proxy, paired: list[dict]) -> None:
        seen = set()
        for info in paired:
            p = info["peer"]
            if p in seen:
                continue
            seen.add(p)
            faddr, _, _ = info["mem"][KEY_FLAGS]
            # The peer's "control block" here is its slot in our abort inbox; no pid (remote).
            proxy.set_peer(p, self._inbox_addr + p * INBOX_SLOT, faddr, 0)
            for key, (addr, size, _) in info["mem"].items():
                if key not in (KEY_FLAGS, KEY_INBOX):
                    proxy.set_peer_region(p, key, addr, size)

    def add_memory(self, proxy, memory: dict[int, tuple[int, int]], abort_check=None) -> None:
        """Register more regions (every rank together) and learn the peers' (e.g. the
        reduce-scatter buffers on first use)."""
        error = None
        mine = {}
        try:
            mine = {str(k): self._register(k, a, s) for k, (a, s) in memory.items()}
        except (RuntimeError, ValueError) as e:
            error = str(e)
        records = self._exchange(f"mem{self._exchanges}", {"mem": mine, "error": error},
                                 "register its reduce-scatter buffers", abort_check)
        failed = [f"rank {r}: {x['error']}" for r, x in enumerate(records) if x.get("error")]
        if failed:
            _raise_all(CollectiveError, "could not register memory", failed, self.rank)
        for i, info in enumerate(self._paired):
            p, arr = info["peer"], arrival(self.topology, self.plans[self.rank].connections[i].channel)
            lane = _lane_key(arr, self.plans[self.rank].connections[i].root)
            for key, (addr, size, rkeys) in records[p]["mem"].items():
                self.endpoint.set_remote_key(i, int(key), rkeys[lane])
        seen = set()
        for info in self._paired:
            p = info["peer"]
            if p in seen:
                continue
            seen.add(p)
            for key, (addr, size, _) in records[p]["mem"].items():
                proxy.set_peer_region(p, int(key), addr, size)

    def describe(self) -> list[str]:
        """One line per lane: what this rank uses."""
        out = []
        for (ch, k), c in sorted(self.lanes.items()):
            out.append(f"{channel_name(self.topology, ch)} root {k}: {c.device} port {c.port}, "
                       f"GID {c.gid_index} ({c.ipv4 or c.gid}), MTU {c.mtu}, {c.rate}")
        return out

    def close(self) -> None:
        """Destroy the QPs and deregister (after the proxy stopped). The inbox stays mapped
        as long as this object lives: the proxy may still hold its address."""
        ep, self.endpoint = self.endpoint, None
        if ep is not None:
            ep.close()


def connect(rv, plans, rank: int, topology: str, roots: int, proxy, memory, *,
            timeout_s: float = 120.0, env=None, selection=None, settings=None,
            stall_s: float = 120.0) -> VerbsLink:
    """Bring the verbs transport up for ``proxy`` (see the module docstring); all ranks
    call it together. Returns the :class:`VerbsLink` (keep it for :meth:`VerbsLink.add_memory`
    and :meth:`VerbsLink.close`)."""
    link = VerbsLink(rv, plans, rank, topology, roots, settings=settings, env=env,
                     selection=selection, timeout_s=timeout_s, stall_s=stall_s)
    try:
        link.connect(proxy, memory)
    except BaseException:
        link.close()
        raise
    return link



# ---- as a communicator's transport -------------------------------------------------------

def probe_quietly(transport: str, topology: str, roots: int) -> str | None:
    """For the communicator's join record: None when ``transport='auto'`` could use verbs
    on this host, else the reason (never raises)."""
    if transport != "auto":
        return "not probed"
    try:
        return probe(topology, roots)
    except Exception as e:  # noqa: BLE001 - auto falls back to tcp
        return f"{type(e).__name__}: {e}"


class VerbsTransport(Transport):
    """RDMA queue pairs: brought up in :meth:`attach` (the endpoint wires the proxy's
    registry); the reduce-scatter buffers are registered when they are created."""

    name = "verbs"
    needs_liveness = True  # RC retries take ~8.6 s

    def __init__(self, ctx):
        super().__init__(ctx)
        self.link: VerbsLink | None = None

    @classmethod
    def probe(cls, requested, topology, roots):
        return {"verbs": probe_quietly(requested, topology, roots)}

    @classmethod
    def why_not(cls, infos, explicit):
        if explicit:
            return None  # tried as asked; FabricError says what is missing
        # Every rank probed its RDMA lanes in its join record (probe_quietly).
        bad = [f"rank {r}: {i.get('verbs', 'not probed')}" for r, i in enumerate(infos)
               if "verbs" not in i or i["verbs"] is not None]
        return "; ".join(bad) or None

    def connect(self) -> None:
        self.ctx.buffers.unlink()  # peers reach this memory through the NICs only

    def _memory(self, kind: str) -> dict[int, tuple[int, int]]:
        return {int(reg): v for reg, v in self.ctx.buffers.memory(kind).items()}

    def attach(self, proxy) -> None:
        c = self.ctx
        memory = {KEY_FLAGS: (c.flags_addr, flags_key_bytes(c.plans[c.rank].num_flag_words))}
        for kind in c.buffers.segments:
            memory.update(self._memory(kind))
        self.link = connect(c.rv, c.plans, c.rank, c.topology, c.roots, proxy, memory,
                            timeout_s=c.bootstrap_timeout_s,
                            stall_s=c.timeout_s)
        log.info("sparkccl: rank %d: verbs lanes (%s ordering): %s", c.rank,
                 self.link.settings.ordering, "; ".join(self.link.describe()))

    def add_segment(self, proxy, kind, abort_check) -> None:
        c = self.ctx
        c.buffers.unlink()
        # Register, learn the peers' addresses and keys (every rank together).
        self.link.add_memory(proxy, self._memory(kind), abort_check)
        c.rv.barrier(f"{kind}-created", f"create its {LABELS[kind]} buffers", abort_check)

    def close(self) -> None:
        if self.link is not None:  # QPs and MRs, after the proxy stopped
            self.link.close()
            self.link = None

    def lanes(self) -> dict:
        return dict(self.link.lanes) if self.link is not None else {}

    def describe(self) -> list[str]:
        return self.link.describe() if self.link is not None else []
