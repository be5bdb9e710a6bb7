"""Which RDMA devices, ports and GIDs sparkccl uses (docs/CONTRACT.md "Configuration").

Devices, first match wins:

1. arguments (``devices=`` for mesh; ``prev_devices=`` / ``next_devices=`` for ring),
2. ``SPARKCCL_IB_HCA`` (mesh) / ``SPARKCCL_RING_PREV_HCA`` + ``SPARKCCL_RING_NEXT_HCA`` (ring),
3. ``NCCL_IB_HCA``,
4. automatic discovery: ACTIVE Ethernet ports whose netdev's IPv4 address has a RoCE v2
   GID; the roots of one QSFP port (mesh), or of two ports (ring: the lower-numbered port
   faces prev, the higher faces next).

GID index, first match wins: ``gid_index=`` argument, ``SPARKCCL_IB_GID_INDEX``,
``NCCL_IB_GID_INDEX``, else the RoCE v2 GID holding the IPv4 address of the device's own
netdev (never a VLAN/upper device's entry).

Every device list uses NCCL's ``NCCL_IB_HCA`` syntax: a comma list of names, each with an
optional ``:port``; names match as prefixes, or exactly when the list starts with ``=``;
a leading ``^`` (before ``=``) excludes the listed devices instead. An include list from
arguments or ``SPARKCCL_*`` is taken literally: it must name exactly ``roots`` usable
device ports (per side in a ring). ``NCCL_IB_HCA`` (written for NCCL, which
uses every device it matches) and any ``^`` list only narrow what automatic discovery
considers. Lanes always come in (QSFP port, root) order, so lane i is the same root, on
the same subnet, on every box.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Sequence

from .. import config
from ..errors import ConfigError, FabricError
from .discovery import ROCE_V2, Device, Fabric, Ipv4Lookup, Port, discover


@dataclass(frozen=True)
class RootChoice:
    """One lane: a device port sparkccl opens one RC QP per peer on."""
    device: str
    port: int
    group: str             # the QSFP port (PCIe function name) the device belongs to
    root: int              # 0 = lower PCI domain of that group
    gid_index: int
    gid: str
    netdev: str | None
    ipv4: str | None       # "192.168.100.1/24"
    mtu: int | None        # active MTU in bytes; path MTU = min of both ends
    rate: str
    why: str               # why this GID index


@dataclass(frozen=True)
class Selection:
    topology: str                        # "mesh" | "ring"
    source: str                          # where the devices came from
    mesh: tuple[RootChoice, ...] = ()    # mesh lanes in (QSFP, root) order: lane i = mesh[i]
    prev: tuple[RootChoice, ...] = ()    # ring: the port facing rank r-1, one per lane
    next: tuple[RootChoice, ...] = ()    # ring: the port facing rank r+1
    notes: tuple[str, ...] = ()          # things skipped or worth knowing
    errors: tuple[str, ...] = ()         # why it cannot work; empty when it can

    @property
    def ok(self) -> bool:
        return not self.errors

    def check(self) -> "Selection":
        """Return self, or raise :class:`FabricError` listing every reason it cannot work."""
        if self.errors:
            raise FabricError(f"{self.topology} fabric: " + "; ".join(self.errors))
        return self


# -- device lists in NCCL_IB_HCA syntax ------------------------------------------------

@dataclass(frozen=True)
class HcaList:
    label: str                                  # e.g. "NCCL_IB_HCA=^mlx5_1"
    exclude: bool
    exact: bool
    entries: tuple[tuple[str, int | None], ...]

    def entry_matches(self, entry: tuple[str, int | None], port: Port) -> bool:
        name, num = entry
        hit = port.device == name if self.exact else port.device.startswith(name)
        return hit and (num is None or num == port.port)

    def admits(self, port: Port) -> bool:
        listed = any(self.entry_matches(e, port) for e in self.entries)
        return listed != self.exclude


def parse_hca(value: str | Sequence[str], source: str) -> HcaList:
    """Parse a device list. A sequence of names (each ``dev`` or ``dev:port``) is exact."""
    if isinstance(value, str):
        text = value.strip()
        label = f"{source}={text}"
        exclude = text.startswith("^")
        text = text[1:] if exclude else text
        exact = text.startswith("=")
        text = text[1:] if exact else text
        items = [t.strip() for t in text.split(",") if t.strip()]
    else:
        items = [str(t).strip() for t in value]
        label = f"{source}={','.join(items)}"
        exclude, exact = False, True
    entries = []
    for item in items:
        name, sep, num = item.partition(":")
        if sep and not num.strip().isdigit():
            raise FabricError(f"{label}: port {num!r} of {name!r} is not a number")
        entries.append((name.strip(), int(num) if sep else None))
    if not entries:
        raise FabricError(f"{label}: names no device")
    return HcaList(label, exclude, exact, tuple(entries))


# -- GID choice ------------------------------------------------------------------------

@dataclass(frozen=True)
class GidChoice:
    index: int
    gid: str
    why: str


def choose_gid(port: Port, gid_index: int | None = None, source: str = "gid_index") -> GidChoice:
    """The GID a port uses; ``gid_index`` forces one (``source`` names who forced it).

    Raises FabricError with the reason when none fits.
    """
    if gid_index is not None:
        entry = next((g for g in port.gids if g.index == gid_index), None)
        if entry is None:
            raise FabricError(f"{port.name}: GID index {gid_index} ({source}) is empty")
        why = f"forced by {source}"
        if port.link_layer == "Ethernet" and entry.type != ROCE_V2:
            why += f"; warning: a {entry.type or 'untyped'} entry, not RoCE v2"
        if port.netdev and entry.ndev and entry.ndev != port.netdev:
            why += f"; warning: belongs to {entry.ndev}, not {port.netdev}"
        return GidChoice(entry.index, entry.gid, why)

    if port.link_layer != "Ethernet":
        entry = next((g for g in port.gids if g.index == 0), None)
        if entry is None:
            raise FabricError(f"{port.name}: InfiniBand port has no GID 0")
        return GidChoice(0, entry.gid, "InfiniBand: GID 0, the port GID")

    if not port.netdev:
        raise FabricError(f"{port.name} has no netdev")
    if port.ipv4 is None:
        raise FabricError(f"{port.netdev} ({port.name}) has no IPv4 address")
    ip = str(port.ipv4.ip)
    own = [g for g in port.gids
           if g.type == ROCE_V2 and g.ndev == port.netdev and g.ipv4 == ip]
    # IPv4 GIDs of VLAN/bond/macvlan uppers share the table but route through the upper device.
    uppers = [g for g in port.gids if g.ipv4 is not None and g.ndev and g.ndev != port.netdev]
    if not own:
        hint = ""
        v1 = [g.index for g in port.gids if g.ndev == port.netdev and g.ipv4 == ip]
        if v1:
            hint = f" (only RoCE v1 entries {v1}: is RoCE v2 disabled?)"
        raise FabricError(f"no RoCE v2 GID holds the IPv4 address of {port.netdev} "
                          f"({ip}) on {port.name}{hint}")
    chosen = own[0]
    why = f"RoCE v2 GID of {ip}, the IPv4 address of {port.netdev}"
    for ndev in dict.fromkeys(g.ndev for g in uppers):
        skipped = ", ".join(str(g.index) for g in uppers if g.ndev == ndev)
        why += f"; skipped {skipped} (upper device {ndev})"
    return GidChoice(chosen.index, chosen.gid, why)


def evaluate(device: Device, port: Port, gid_index: int | None = None,
             gid_source: str = "gid_index") -> RootChoice:
    """The lane a port would be, or FabricError saying why it cannot carry sparkccl traffic."""
    if not port.is_active:
        raise FabricError(f"{port.name} is {port.state} (physical link {port.phys_state})")
    if port.link_layer == "Ethernet" and port.active_mtu is None:
        raise FabricError(f"{port.name}: netdev {port.netdev} MTU {port.netdev_mtu} "
                          "is too small for RoCE")
    g = choose_gid(port, gid_index, gid_source)
    return RootChoice(device=device.name, port=port.port, group=device.group, root=device.root,
                      gid_index=g.index, gid=g.gid, netdev=port.netdev,
                      ipv4=str(port.ipv4) if port.ipv4 else None, mtu=port.active_mtu,
                      rate=port.rate, why=g.why)


# -- selection -------------------------------------------------------------------------

class _Log:
    def __init__(self):
        self.notes: list[str] = []
        self.errors: list[str] = []




def resolve_gid_index(gid_index: int | None = None,
                      env: Mapping[str, str] | None = None) -> tuple[int | None, str]:
    """(forced GID index or None, who forced it): argument, SPARKCCL_IB_GID_INDEX, then
    NCCL_IB_GID_INDEX. Raises FabricError for a value that is not an index."""
    if gid_index is not None:
        if isinstance(gid_index, bool) or not isinstance(gid_index, int) or gid_index < 0:
            raise FabricError(f"gid_index={gid_index!r}: expected an integer >= 0")
        return gid_index, f"gid_index={gid_index}"
    try:
        value, source = config.lookup("SPARKCCL_IB_GID_INDEX", env)
    except ConfigError as e:
        raise FabricError(str(e)) from None
    return (None, "") if value is None else (value, f"{source}={value}")


def _spec(value, source: str, log: _Log) -> HcaList | None:
    try:
        return parse_hca(value, source)
    except FabricError as e:
        log.errors.append(str(e))
        return None


def _available(fabric: Fabric) -> str:
    names = ", ".join(d.name for d in fabric.devices)
    return f"found: {names}" if names else f"no RDMA devices under {fabric.ib_class_dir}"


def _strict(fabric: Fabric, spec: HcaList, count: int, gid, log: _Log) -> tuple[RootChoice, ...]:
    """An explicit include list: every entry must match, every match must work, and it must
    name exactly ``count`` device ports. Lanes come in (QSFP, root) order whatever the list's
    order, so lane i is the same root (the same subnet) on every box."""
    picked: list[tuple[Device, Port]] = []
    for entry in spec.entries:
        hits = [(d, p) for d, p in fabric.ports() if spec.entry_matches(entry, p)]
        if not hits:
            name = entry[0] + (f":{entry[1]}" if entry[1] is not None else "")
            log.errors.append(f"{spec.label}: {name!r} matches no device ({_available(fabric)})")
        picked += [h for h in hits if h not in picked]
    lanes = []
    for d, p in sorted(picked, key=lambda dp: (dp[0].group, dp[0].root, dp[0].name)):
        try:
            lanes.append(evaluate(d, p, *gid))
        except FabricError as e:
            log.errors.append(str(e))
    if picked and len(picked) != count:
        log.errors.append(
            f"{spec.label} names {len(picked)} device port(s) "
            f"({', '.join(p.name for _, p in picked)}); sparkccl uses {count} here, "
            "one per root (SPARKCCL_ROOTS sets 1 or 2)")
    return tuple(lanes)


def _groups(fabric: Fabric, spec: HcaList | None, count: int, gid,
            log: _Log) -> list[tuple[RootChoice, ...]]:
    """QSFP ports (groups) with ``count`` usable roots, among the ports ``spec`` admits.
    Ports left out are recorded in ``log.notes`` with the reason."""
    if spec is None:
        ports = fabric.ports()
    else:
        ports = [(d, p) for d, p in fabric.ports() if spec.admits(p)]
        if not ports:
            log.errors.append(f"{spec.label} matches no device ({_available(fabric)})")
            return []
        if not spec.exclude:
            for e in spec.entries:
                if not any(spec.entry_matches(e, p) for _, p in ports):
                    log.notes.append(f"{spec.label}: {e[0]!r} matches no device")
    usable: dict[str, list[RootChoice]] = {}
    for d, p in ports:
        if spec is None and p.link_layer != "Ethernet":
            log.notes.append(f"{p.name}: {p.link_layer} is not picked automatically "
                             "(name it in SPARKCCL_IB_HCA)")
            continue
        try:
            usable.setdefault(d.group, []).append(evaluate(d, p, *gid))
        except FabricError as e:
            usable.setdefault(d.group, [])
            log.notes.append(str(e))
    groups = []
    for group in sorted(usable):
        lanes = sorted(usable[group], key=lambda c: c.root)
        if len(lanes) >= count:
            groups.append(tuple(lanes[:count]))
        else:
            hint = " (SPARKCCL_ROOTS=1 uses one)" if lanes and count == 2 else ""
            log.notes.append(f"QSFP {group}: {len(lanes)} usable root(s), {count} needed{hint}")
    return groups


def _prepare(fabric, env, ipv4_of, gid_index, roots):
    log = _Log()
    env = os.environ if env is None else env
    fabric = fabric if fabric is not None else discover(ipv4_of=ipv4_of)
    if roots not in (1, 2):
        log.errors.append(f"roots={roots!r}: must be 1 or 2")
        roots = 2
    try:
        gid = resolve_gid_index(gid_index, env)
    except FabricError as e:
        log.errors.append(str(e))
        gid = (None, "")
    return log, env, fabric, gid, roots


def _finish(topology: str, source: str, log: _Log, **sides) -> Selection:
    if log.errors:  # a failed selection uses nothing
        sides = {}
    return Selection(topology, source, notes=tuple(log.notes), errors=tuple(log.errors), **sides)


def select_mesh(fabric: Fabric | None = None, *, devices: str | Sequence[str] | None = None,
                gid_index: int | None = None, roots: int = 2,
                env: Mapping[str, str] | None = None,
                ipv4_of: Ipv4Lookup | None = None) -> Selection:
    """The ``roots`` lanes this rank uses to reach every peer through a switch.

    ``fabric`` defaults to :func:`discover` (with ``ipv4_of``); ``env`` to ``os.environ``.
    Never raises for configuration problems: see ``Selection.errors`` / ``.check()``.
    """
    log, env, fabric, gid, roots = _prepare(fabric, env, ipv4_of, gid_index, roots)
    if log.errors:
        return _finish("mesh", "", log)
    spec, strict = None, False
    hca, hca_source = config.lookup("SPARKCCL_IB_HCA", env)
    for source, value in (("devices", devices), (hca_source, hca)):
        if value is not None:
            spec = _spec(value, source, log)
            # NCCL_IB_HCA was written for NCCL, which uses every device it matches: it
            # only narrows discovery.
            strict = spec is not None and not spec.exclude and source != "NCCL_IB_HCA"
            break
    if log.errors:
        return _finish("mesh", "", log)
    source = spec.label if spec else "automatic discovery"
    if strict:
        return _finish("mesh", source, log, mesh=_strict(fabric, spec, roots, gid, log))
    groups = _groups(fabric, spec, roots, gid, log)
    if not groups:
        if not log.errors:
            log.errors.append(
                f"no port has {roots} usable root(s)"
                + (f" among {spec.label}" if spec else "")
                + (f": {'; '.join(log.notes)}" if log.notes else f" ({_available(fabric)})"))
            log.notes.clear()  # folded into the error
        return _finish("mesh", source, log)
    for other in groups[1:]:
        log.notes.append(f"QSFP {other[0].group} is usable too (name devices to choose it)")
    return _finish("mesh", source, log, mesh=groups[0])


def select_ring(fabric: Fabric | None = None, *,
                prev_devices: str | Sequence[str] | None = None,
                next_devices: str | Sequence[str] | None = None,
                gid_index: int | None = None, roots: int = 2,
                env: Mapping[str, str] | None = None,
                ipv4_of: Ipv4Lookup | None = None) -> Selection:
    """The lanes facing prev (rank r-1) and next (rank r+1) in a switchless ring.

    Automatic choice (and ``NCCL_IB_HCA``, which cannot say which is which): the port with
    the lower PCIe function name faces prev, the other faces next, so cable port "next"
    (e.g. p1s0f1) of each box to port "prev" (p1s0f0) of the following box.
    """
    log, env, fabric, gid, roots = _prepare(fabric, env, ipv4_of, gid_index, roots)
    if log.errors:
        return _finish("ring", "", log)
    sides = {}
    for side, arg, var in (("prev", prev_devices, "SPARKCCL_RING_PREV_HCA"),
                           ("next", next_devices, "SPARKCCL_RING_NEXT_HCA")):
        for source, value in ((f"{side}_devices", arg), (var, config.get(var, env))):
            if value is not None:
                sides[side] = _spec(value, source, log)
                break
    if log.errors:
        return _finish("ring", "", log)
    if len(sides) == 1:
        (given_side, given), = sides.items()
        missing = "next" if given_side == "prev" else "prev"
        log.errors.append(f"{given.label} names the {given_side} port but nothing names the "
                          f"{missing} port ({missing}_devices= or "
                          f"SPARKCCL_RING_{missing.upper()}_HCA)")
        return _finish("ring", "", log)

    if sides and not any(s.exclude for s in sides.values()):
        prev = _strict(fabric, sides["prev"], roots, gid, log)
        nxt = _strict(fabric, sides["next"], roots, gid, log)
        shared = {c.device for c in prev} & {c.device for c in nxt}
        if shared:
            log.errors.append(f"{', '.join(sorted(shared))} named for both prev and next")
        elif prev and nxt and {c.group for c in prev} & {c.group for c in nxt}:
            log.notes.append("prev and next share a QSFP port")
        source = f"prev {sides['prev'].label}, next {sides['next'].label}"
        return _finish("ring", source, log, prev=prev, next=nxt)
    if sides:
        log.errors.append("ring devices cannot be given as ^ exclusions: name the prev and "
                          "next devices")
        return _finish("ring", "", log)

    nccl = config.lookup_nccl("SPARKCCL_IB_HCA", env)[0]
    spec = _spec(nccl, "NCCL_IB_HCA", log) if nccl is not None else None
    if log.errors:
        return _finish("ring", "", log)
    source = spec.label if spec else "automatic discovery"
    groups = _groups(fabric, spec, roots, gid, log)
    if len(groups) < 2:
        if not log.errors:
            found = ", ".join(g[0].group for g in groups) or "none"
            log.errors.append(
                f"a ring needs two ports with {roots} usable root(s) each"
                + (f" among {spec.label}" if spec else "") + f"; usable: {found}"
                + (f" ({'; '.join(log.notes)})" if log.notes else ""))
            log.notes.clear()  # folded into the error
        return _finish("ring", source, log)
    log.notes.append(f"prev = QSFP {groups[0][0].group}, next = QSFP {groups[1][0].group} "
                     "(lower faces prev; SPARKCCL_RING_PREV_HCA/NEXT_HCA to choose)")
    for other in groups[2:]:
        log.notes.append(f"QSFP {other[0].group} is usable too (not used)")
    return _finish("ring", source, log, prev=groups[0], next=groups[1])
