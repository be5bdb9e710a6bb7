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
             reorder_ms: float | None = None, trace: bool = False, pace_on_wake: bool = False,
             **gb10) -> dict[str, str]:
    """A GB10 tree under ``root`` (``gb10``: tests/fakesysfs.gb10's options; an existing
    tree is reused) and the
    environment that runs the verbs transport on it. ``rate_gbps``: every root's send rate;
    ``latency_us``: one-way latency of a write; ``reorder_ms``: PCIe reordering (non-inline
    write data lands this much later); ``trace``: record every work request (:func:`take_trace`); ``pace_on_wake``:
    the limiter before it credited a late sender thread (emunic.cpp: pace)."""
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
    if trace:
        conf.append("trace=1")
    if pace_on_wake:
        conf.append("pace_on_wake=1")
    with open(os.path.join(root, "emunic.conf"), "w") as f:
        f.write("".join(c + "\n" for c in conf))
    return {"SPARKCCL_IBVERBS_LIB": library_path(), "SPARKCCL_EMUNIC_CONFIG": root,
            "SPARKCCL_SYSFS_ROOT": root, "SPARKCCL_IB_GID_INDEX": str(GID_INDEX)}


def take_trace() -> list[list[str]]:
    """This process's emulated-NIC trace (``host_env(trace=True)``) since the last call, as
    split lines: ``S dev qpn seq opcode len posted slot go sent`` per work request sent
    (``slot``: the start of its time on the rate-limited root), ``R qpn src_qpn seq opcode
    len sent arrived landed`` per one received, and a last ``P calls wrs ns``: the time spent
    inside ``ibv_post_send`` so far. Times: CLOCK_MONOTONIC ns, the same in every process."""
    import ctypes
    lib = ctypes.CDLL(library_path())
    lib.emunic_trace.restype = ctypes.c_size_t
    lib.emunic_trace.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    cap = 1 << 16
    while True:
        buf = ctypes.create_string_buffer(cap)
        need = lib.emunic_trace(buf, cap)
        if need <= cap:
            return [line.split() for line in buf.value.decode().splitlines()]
        cap = need


def live_registrations() -> tuple[int, int]:
    """(count, bytes) of this process's memory registrations on the emulated NIC alive now
    (what ibv_reg_mr made and ibv_dereg_mr has not released)."""
    import ctypes
    lib = ctypes.CDLL(library_path())
    lib.emunic_live_mrs.restype = ctypes.c_size_t
    lib.emunic_live_mrs.argtypes = [ctypes.POINTER(ctypes.c_ulonglong)]
    nbytes = ctypes.c_ulonglong(0)
    return int(lib.emunic_live_mrs(ctypes.byref(nbytes))), int(nbytes.value)


def set_port_state(root, device: str, active: bool, port: int = 1) -> None:
    """Flip a port's link (the emulated NIC raises PORT_ERR / PORT_ACTIVE async events)."""
    path = os.path.join(str(root), "class", "infiniband", device, "ports", str(port), "state")
    with open(path, "w") as f:
        f.write("4: ACTIVE\n" if active else "1: DOWN\n")


def refuse_registrations(root, refuse: bool = True) -> None:
    """While set, every ``ibv_reg_mr`` on the emulated host fails with ENOMEM (what a GB10
    kernel does when pinned memory / CMA runs out)."""
    path = os.path.join(str(root), "emunic", "reg_mr_enomem")
    if refuse:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").close()
    elif os.path.exists(path):
        os.unlink(path)
