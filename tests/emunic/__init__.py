"""The emulated RoCE NIC (emunic.cpp here): build it, and describe a host that uses it.

:func:`host_env` makes a GB10 host -- a fake sysfs tree (tests/fakesysfs.py) that both
sparkccl's discovery and the emulated NIC read -- and returns the environment under which
every process started with it runs ``transport="verbs"`` through the emulated NIC:

- ``SPARKCCL_IBVERBS_LIB``: the emulated NIC, loaded in place of libibverbs;
- ``SPARKCCL_EMUNIC_CONFIG`` and ``SPARKCCL_SYSFS_ROOT``: the tree;
- ``SPARKCCL_IB_GID_INDEX=3``: the RoCE v2 GID of each root's IPv4 address (the automatic
  choice needs the address on a real netdev, which a fake tree has not).
"""
from __future__ import annotations

import os

import fakesysfs
import testlibs

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "emunic.cpp")
GID_INDEX = 3


def library_path() -> str:
    return testlibs.build("sparkccl_emunic", [SOURCE])


def host_env(root, *, rate_gbps: float | None = None, latency_us: float | None = None,
             reorder_ms: float | None = None, **gb10) -> dict[str, str]:
    """A GB10 tree under ``root`` (``gb10``: tests/fakesysfs.gb10's options; an existing
    tree is reused) and the
    environment that runs the verbs transport on it. ``rate_gbps``: every root's send rate;
    ``latency_us``: one-way latency of a write; ``reorder_ms``: PCIe reordering (non-inline
    write data lands this much later)."""
    root = str(root)
    if not os.path.isdir(os.path.join(root, "class", "infiniband")):  # else: reuse the host
        fakesysfs.gb10(root, **gb10)
    conf = []
    if rate_gbps:
        conf.append(f"rate_gbps={rate_gbps}")
    if latency_us:
        conf.append(f"latency_us={latency_us}")
    if reorder_ms:
        conf.append(f"reorder_ms={reorder_ms}")
    with open(os.path.join(root, "emunic.conf"), "w") as f:
        f.write("".join(c + "\n" for c in conf))
    return {"SPARKCCL_IBVERBS_LIB": library_path(), "SPARKCCL_EMUNIC_CONFIG": root,
            "SPARKCCL_SYSFS_ROOT": root, "SPARKCCL_IB_GID_INDEX": str(GID_INDEX)}


def set_port_state(root, device: str, active: bool, port: int = 1) -> None:
    """Flip a port's link (the emulated NIC raises PORT_ERR / PORT_ACTIVE async events)."""
    path = os.path.join(str(root), "class", "infiniband", device, "ports", str(port), "state")
    with open(path, "w") as f:
        f.write("4: ACTIVE\n" if active else "1: DOWN\n")
