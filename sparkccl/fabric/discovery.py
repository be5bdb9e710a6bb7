"""What RDMA hardware this host has, read from sysfs (no libibverbs needed).

Everything here is a fact about the machine; what sparkccl *uses* is decided in
:mod:`sparkccl.fabric.select`. The tree is read under a configurable root (default
``/sys``, or ``$SPARKCCL_SYSFS_ROOT``) so tests can point it at a fake tree, and the
IPv4 lookup is injectable because it comes from the kernel's network stack, not sysfs.

Layout read (per RDMA device ``D``, port ``N``, GID index ``K``)::

    class/infiniband/D/device            -> the PCI function (its name is the PCI address)
    class/infiniband/D/device/net/*      the device's own netdev(s)
    class/infiniband/D/ports/N/state     "4: ACTIVE"
    class/infiniband/D/ports/N/phys_state "5: LinkUp"
    class/infiniband/D/ports/N/rate      "200 Gb/sec (2X NDR)"
    class/infiniband/D/ports/N/link_layer "Ethernet" | "InfiniBand"
    class/infiniband/D/ports/N/gids/K    "0000:0000:0000:0000:0000:ffff:c0a8:6401"
    class/infiniband/D/ports/N/gid_attrs/types/K  "RoCE v2" | "IB/RoCE v1"
    class/infiniband/D/ports/N/gid_attrs/ndevs/K  "enp1s0f1np1" (or an upper device)
    class/net/<netdev>/mtu
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .. import config

DEFAULT_SYSFS_ROOT = "/sys"
SYSFS_ROOT_ENV = "SPARKCCL_SYSFS_ROOT"

ROCE_V2 = "RoCE v2"
ROCE_V1 = "IB/RoCE v1"

# IB MTU enum values (ibv_mtu), in bytes.
IB_MTUS = (256, 512, 1024, 2048, 4096)
# Bytes a RoCE packet carries around its IB payload: GRH 40 + UDP 8 + BTH 12 + XRC ext 4
# + AtomicETH 28 + ICRC 4 = 96. Same reduction as the kernel's iboe_get_mtu().
ROCE_HEADER_BYTES = 96

# ioctl numbers from <linux/sockios.h>.
SIOCGIFADDR = 0x8915
SIOCGIFNETMASK = 0x891B

Ipv4Lookup = Callable[[str], Optional[ipaddress.IPv4Interface]]


def rate_gbps(rate: str | None) -> float | None:
    """Gb/s of a sysfs port rate ("200 Gb/sec (2X NDR)"), or None."""
    m = re.match(r"\s*([\d.]+)\s*Gb/sec", rate or "")
    return float(m.group(1)) if m else None


@dataclass(frozen=True)
class GidEntry:
    index: int
    gid: str                    # as sysfs prints it: 8 groups of 4 hex digits
    type: str | None            # ROCE_V2 / ROCE_V1 / None (InfiniBand, or unreadable)
    ndev: str | None            # netdev the entry belongs to (may be a VLAN/upper device)

    @property
    def ipv4(self) -> str | None:
        """The IPv4 address of an IPv4-mapped GID (``::ffff:a.b.c.d``), else None."""
        mapped = ipaddress.IPv6Address(self.gid).ipv4_mapped
        return str(mapped) if mapped is not None else None


@dataclass(frozen=True)
class Port:
    device: str
    port: int
    state: str                  # "ACTIVE", "DOWN", "INIT", ...
    phys_state: str             # "LinkUp", "Disabled", "Polling", ...
    rate: str                   # "200 Gb/sec (2X NDR)"
    link_layer: str             # "Ethernet" | "InfiniBand"
    netdev: str | None
    netdev_mtu: int | None
    ipv4: ipaddress.IPv4Interface | None   # address/prefix of the netdev
    active_mtu: int | None      # bytes (an IB MTU); None where sysfs cannot tell (IB)
    gids: tuple[GidEntry, ...]  # non-empty entries only

    @property
    def name(self) -> str:
        return f"{self.device} port {self.port}"

    @property
    def rate_gbps(self) -> float | None:
        return rate_gbps(self.rate)

    @property
    def is_active(self) -> bool:
        return self.state == "ACTIVE"


@dataclass(frozen=True)
class Device:
    name: str
    pci: str | None             # "0002:01:00.1" when the device link resolves
    group: str                  # the PCIe function name shared by a QSFP port's roots: "p1s0f1"
    domain: int                 # PCI domain; orders the roots of a group
    root: int                   # 0 = lowest PCI domain within the group
    ports: tuple[Port, ...]


@dataclass(frozen=True)
class Fabric:
    sysfs_root: str
    devices: tuple[Device, ...]  # sorted by (group, root)

    @property
    def ib_class_dir(self) -> str:
        return os.path.join(self.sysfs_root, "class", "infiniband")

    def device(self, name: str) -> Device | None:
        return next((d for d in self.devices if d.name == name), None)

    def ports(self) -> list[tuple[Device, Port]]:
        return [(d, p) for d in self.devices for p in d.ports]


def sysfs_root_default() -> str:
    return config.get(SYSFS_ROOT_ENV)


def roce_active_mtu(netdev_mtu: int | None) -> int | None:
    """The IB MTU a RoCE port runs at for a given netdev MTU (what ibv_query_port reports).

    sysfs has no active_mtu file; mlx5 reports min(max_mtu=4096, iboe_get_mtu(netdev mtu)):
    the largest IB MTU that fits in the netdev MTU minus the RoCE headers. 9000 -> 4096,
    1500 -> 1024. None when even 256 does not fit.
    """
    if netdev_mtu is None:
        return None
    payload = netdev_mtu - ROCE_HEADER_BYTES
    fitting = [m for m in IB_MTUS if m <= payload]
    return fitting[-1] if fitting else None


def netdev_ipv4(netdev: str) -> ipaddress.IPv4Interface | None:
    """Primary IPv4 address/prefix of ``netdev`` in this network namespace, or None."""
    req = struct.pack("256s", netdev.encode()[:15])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            addr = fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)[20:24]
            mask = fcntl.ioctl(s.fileno(), SIOCGIFNETMASK, req)[20:24]
    except OSError:  # no such device, or no IPv4 address on it
        return None
    return ipaddress.IPv4Interface(f"{socket.inet_ntoa(addr)}/{socket.inet_ntoa(mask)}")


def _read(path: str) -> str | None:
    # Empty GID slots make gid_attrs reads fail with EINVAL: treat any error as "absent".
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _after_colon(text: str | None) -> str:
    # "4: ACTIVE" -> "ACTIVE"
    if not text:
        return "UNKNOWN"
    return text.split(":", 1)[1].strip() if ":" in text else text


def _numbered(path: str) -> list[int]:
    try:
        return sorted(int(n) for n in os.listdir(path) if n.isdigit())
    except OSError:
        return []


_PCI_ADDR = re.compile(r"^([0-9a-fA-F]{4,}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
# rdma-core's PCI naming ("roce"/"ibp" + optional P<domain> + p<bus>s<slot>[f<fn>]).
_PCI_NAME = re.compile(r"^(?:roce|ib)(?:P(\d+))?(p\d+s\d+(?:f\d+)?)")


def _group_of(name: str, pci: str | None) -> tuple[str, int]:
    """(function name, PCI domain): the two roots of a GB10 QSFP port are the same
    bus/slot/function in two PCI domains (``rocep1s0f1`` = 0000:01:00.1,
    ``roceP2p1s0f1`` = 0002:01:00.1)."""
    m = _PCI_ADDR.match(pci or "")
    if m:
        domain, bus, slot, fn = (int(x, 16) for x in m.groups())
        return f"p{bus}s{slot}f{fn}", domain
    m = _PCI_NAME.match(name)
    if m:
        return m.group(2), int(m.group(1) or 0)
    return name, 0  # unknown naming (e.g. mlx5_0 without a PCI link): a group of its own


def _netdev_for(devdir: str, port: int, gids: tuple[GidEntry, ...]) -> str | None:
    # The PCI function's own netdevs; upper devices (VLAN, bond, macvlan) never live here.
    net = os.path.join(devdir, "device", "net")
    try:
        names = sorted(os.listdir(net))
    except OSError:
        names = []
    if len(names) > 1:  # several ports on one function: dev_port is 0-based
        by_port = [n for n in names if _read(os.path.join(net, n, "dev_port")) == str(port - 1)]
        names = by_port or names
    if names:
        return names[0]
    # No PCI link: GID 0 (the default link-local entry) always belongs to the port's own netdev.
    first = next((g for g in gids if g.index == 0), None)
    return first.ndev if first else None


def _read_port(root: str, dev: str, devdir: str, n: int, ipv4_of: Ipv4Lookup) -> Port:
    pdir = os.path.join(devdir, "ports", str(n))
    gids = []
    for k in _numbered(os.path.join(pdir, "gids")):
        gid = _read(os.path.join(pdir, "gids", str(k)))
        try:
            if gid is None or ipaddress.IPv6Address(gid) == ipaddress.IPv6Address(0):
                continue  # unused slot
        except ValueError:
            continue
        gids.append(GidEntry(k, gid, _read(os.path.join(pdir, "gid_attrs", "types", str(k))),
                             _read(os.path.join(pdir, "gid_attrs", "ndevs", str(k)))))
    gids_t = tuple(gids)
    # Kernels without link_layer predate RoCE: their ports are InfiniBand.
    link_layer = _read(os.path.join(pdir, "link_layer")) or "InfiniBand"
    netdev = _netdev_for(devdir, n, gids_t)
    mtu_text = _read(os.path.join(root, "class", "net", netdev, "mtu")) if netdev else None
    netdev_mtu = int(mtu_text) if mtu_text and mtu_text.isdigit() else None
    return Port(
        device=dev, port=n,
        state=_after_colon(_read(os.path.join(pdir, "state"))),
        phys_state=_after_colon(_read(os.path.join(pdir, "phys_state"))),
        rate=_read(os.path.join(pdir, "rate")) or "unknown",
        link_layer=link_layer,
        netdev=netdev, netdev_mtu=netdev_mtu,
        ipv4=ipv4_of(netdev) if netdev else None,
        # InfiniBand's active MTU is negotiated by the subnet manager and not in sysfs.
        active_mtu=roce_active_mtu(netdev_mtu) if link_layer == "Ethernet" else None,
        gids=gids_t,
    )


def discover(sysfs_root: str | os.PathLike | None = None, *,
             ipv4_of: Ipv4Lookup | None = None) -> Fabric:
    """Every RDMA device and port under ``<sysfs_root>/class/infiniband``.

    A missing directory is not an error: it gives a Fabric with no devices.
    ``ipv4_of(netdev)`` returns the netdev's IPv4 interface (default: :func:`netdev_ipv4`).
    """
    root = str(sysfs_root) if sysfs_root is not None else sysfs_root_default()
    lookup = ipv4_of if ipv4_of is not None else netdev_ipv4
    ib = os.path.join(root, "class", "infiniband")
    try:
        names = sorted(os.listdir(ib))
    except OSError:
        names = []
    found = []
    for name in names:
        devdir = os.path.join(ib, name)
        link = os.path.join(devdir, "device")
        pci = Path(os.path.realpath(link)).name if os.path.exists(link) else None
        group, domain = _group_of(name, pci)
        ports = tuple(_read_port(root, name, devdir, n, lookup)
                      for n in _numbered(os.path.join(devdir, "ports")))
        found.append((group, domain, name, pci, ports))
    devices = []
    for group, domain, name, pci, ports in found:
        root_no = sorted(d for g, d, *_ in found if g == group).index(domain)
        devices.append(Device(name, pci, group, domain, root_no, ports))
    devices.sort(key=lambda d: (d.group, d.root, d.name))
    return Fabric(root, tuple(devices))
