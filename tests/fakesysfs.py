"""Builds fake sysfs trees laid out like the kernel's, for fabric discovery tests.

Real layout reproduced: ``class/infiniband/<dev>`` and ``class/net/<netdev>`` are symlinks
into ``devices/pci<domain>:00/.../<pci address>/``, ``<dev>/device`` links back to the PCI
function, empty GID slots are all-zero with unreadable ``gid_attrs`` (EINVAL in sysfs; a
missing file here), and upper devices (VLANs) live under ``devices/virtual/net``.
IPv4 addresses are not in sysfs: :meth:`FakeSysfs.ipv4_of` plays the ioctl.
"""
from __future__ import annotations

import ipaddress
import os
from pathlib import Path

V1, V2 = "IB/RoCE v1", "RoCE v2"
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


def gid_text(addr: str) -> str:
    """``"fe80::1"`` or ``"::ffff:10.0.0.1"`` -> sysfs form (8 groups of 4 hex digits)."""
    return ipaddress.IPv6Address(addr).exploded


def mapped(ipv4: str) -> str:
    return gid_text(f"::ffff:{ipv4}")


class FakeSysfs:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.addresses: dict[str, ipaddress.IPv4Interface] = {}
        (self.root / "class" / "infiniband").mkdir(parents=True, exist_ok=True)
        (self.root / "class" / "net").mkdir(parents=True, exist_ok=True)

    def ipv4_of(self, netdev: str) -> ipaddress.IPv4Interface | None:
        return self.addresses.get(netdev)

    @staticmethod
    def _write(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    def _link(self, link: Path, target: Path) -> None:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(target, link.parent))

    def add_netdev(self, name: str, *, mtu: int = 9000, ipv4: str | None = None,
                   pci_dir: Path | None = None, dev_port: int = 0) -> None:
        """A netdev: under its PCI function, or virtual (an upper device) without one."""
        ndir = (pci_dir / "net" / name) if pci_dir else self.root / "devices/virtual/net" / name
        self._write(ndir / "mtu", str(mtu))
        self._write(ndir / "dev_port", str(dev_port))
        self._link(self.root / "class" / "net" / name, ndir)
        if ipv4:
            self.addresses[name] = ipaddress.IPv4Interface(ipv4)

    def add_device(self, name: str, pci: str, *, netdev: str, netdev_mtu: int = 9000,
                   ipv4: str | None = None) -> Path:
        """An RDMA device on PCI function ``pci`` ("0002:01:00.1") with its netdev."""
        domain = pci.split(":")[0]
        pci_dir = self.root / "devices" / f"pci{domain}:00" / f"{domain}:00:00.0" / pci
        devdir = pci_dir / "infiniband" / name
        devdir.mkdir(parents=True)
        self._link(devdir / "device", pci_dir)
        self._link(self.root / "class" / "infiniband" / name, devdir)
        self.add_netdev(netdev, mtu=netdev_mtu, ipv4=ipv4, pci_dir=pci_dir)
        return devdir

    def add_port(self, dev: str, port: int = 1, *, state: str = "4: ACTIVE",
                 phys_state: str = "5: LinkUp", rate: str = "200 Gb/sec (2X NDR)",
                 link_layer: str = "Ethernet",
                 gids: list[tuple[str, str | None, str | None]] = (), table_size: int = 16):
        """``gids``: (address, type, ndev) for indexes 0.. in order; the rest are empty."""
        pdir = self.root / "class" / "infiniband" / dev / "ports" / str(port)
        for fname, text in (("state", state), ("phys_state", phys_state), ("rate", rate),
                            ("link_layer", link_layer)):
            self._write(pdir / fname, text)
        for k in range(max(table_size, len(gids))):
            if k < len(gids):
                addr, gtype, ndev = gids[k]
                self._write(pdir / "gids" / str(k), gid_text(addr))
                if gtype:
                    self._write(pdir / "gid_attrs" / "types" / str(k), gtype)
                if ndev:
                    self._write(pdir / "gid_attrs" / "ndevs" / str(k), ndev)
            else:
                self._write(pdir / "gids" / str(k), ZERO_GID)


# The GB10 layout: two QSFP ports (PCIe functions f0, f1), each reached through two PCI
# domains (roots). Each root has its own netdev and subnet.
GB10 = {
    # device:         (PCI address,     netdev,          IPv4)
    "rocep1s0f0": ("0000:01:00.0", "enp1s0f0np0", "192.168.100.1/24"),
    "roceP2p1s0f0": ("0002:01:00.0", "enP2p1s0f0np0", "192.168.101.1/24"),
    "rocep1s0f1": ("0000:01:00.1", "enp1s0f1np1", "192.168.102.1/24"),
    "roceP2p1s0f1": ("0002:01:00.1", "enP2p1s0f1np1", "192.168.103.1/24"),
}


def standard_gids(netdev: str, ipv4: str | None, index: int) -> list[tuple[str, str, str]]:
    """What mlx5 populates: link-local v1/v2 at 0/1, then the IPv4-mapped v1/v2 at 2/3."""
    ll = f"fe80::{index + 1:x}:aff:fe00:1"
    out = [(ll, V1, netdev), (ll, V2, netdev)]
    if ipv4:
        ip = ipv4.split("/")[0]
        out += [(f"::ffff:{ip}", V1, netdev), (f"::ffff:{ip}", V2, netdev)]
    return out


def gb10(root: str | os.PathLike, *, down: tuple[str, ...] = (),
         vlan_on: str | None = "rocep1s0f1", vlan_ip: str = "10.10.0.1/24",
         vlan_first: bool = False, netdev_mtu: int = 9000,
         no_ipv4: tuple[str, ...] = ()) -> FakeSysfs:
    """A GB10 tree. ``down``: devices whose port 1 is DOWN. ``vlan_on``: the device whose
    netdev carries a VLAN upper ``<netdev>.100`` with ``vlan_ip``, whose GIDs appear in that
    device's table (before the device's own IPv4 GIDs when ``vlan_first``)."""
    fs = FakeSysfs(root)
    for i, (dev, (pci, netdev, ipv4)) in enumerate(GB10.items()):
        ipv4 = None if dev in no_ipv4 else ipv4
        fs.add_device(dev, pci, netdev=netdev, netdev_mtu=netdev_mtu, ipv4=ipv4)
        gids = standard_gids(netdev, ipv4, i)
        if dev == vlan_on:
            upper = f"{netdev}.100"
            fs.add_netdev(upper, mtu=netdev_mtu, ipv4=vlan_ip)
            ip = vlan_ip.split("/")[0]
            vlan = [(f"::ffff:{ip}", V1, upper), (f"::ffff:{ip}", V2, upper)]
            gids = gids[:2] + vlan + gids[2:] if vlan_first else gids + vlan
        if dev in down:
            fs.add_port(dev, state="1: DOWN", phys_state="3: Disabled",
                        rate="10 Gb/sec (1X QDR)", gids=gids[:2])
        else:
            fs.add_port(dev, gids=gids)
    return fs
