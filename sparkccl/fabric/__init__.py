"""RDMA fabric: what the host has (sysfs discovery) and what sparkccl uses (selection).

Pure Python, no libibverbs: the verbs transport and ``sparkccl doctor`` build on this.
"""
from __future__ import annotations

from .discovery import (
    Device, Fabric, GidEntry, Port, discover, netdev_ipv4, roce_active_mtu,
)
from .select import (
    FabricError, GidChoice, RootChoice, Selection, choose_gid, evaluate, parse_hca,
    resolve_gid_index, select_mesh, select_ring,
)

__all__ = [
    "Device", "Fabric", "GidEntry", "Port", "discover", "netdev_ipv4", "roce_active_mtu",
    "FabricError", "GidChoice", "RootChoice", "Selection", "choose_gid", "evaluate",
    "parse_hca", "resolve_gid_index", "select_mesh", "select_ring",
]
