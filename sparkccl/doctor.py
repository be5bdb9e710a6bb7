"""``sparkccl doctor``: what RDMA hardware this host has and what sparkccl would use.

It prints every setting's effective value and where it came from (argument, ``SPARKCCL_*``,
``NCCL_*``, discovered / computed, default), the memory a communicator of ``--world`` ranks
needs per rank against the free space of ``/dev/shm`` (``--local-ranks`` of them on this
host) and the memlock limit, the RDMA devices, and the lanes each topology would use.

Exit status: 0 when what was asked for can work (or, on a host without RDMA devices, when
nothing RDMA-specific was asked for); 1 with the reasons otherwise. Without RDMA devices
that is not a failure: the shm transport still serves ranks on one host.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import resource
import shutil
import sys
import textwrap
from typing import Callable, Mapping, TextIO

from . import config
from .fabric import (
    FabricError, Fabric, Port, Selection, discover, evaluate, resolve_gid_index,
    select_mesh, select_ring,
)
from .fabric.discovery import Ipv4Lookup

# Variables that ask for specific RDMA devices or GIDs: failing them is an error even on a
# host without RDMA devices. (NCCL_* are often exported for NCCL alone, so they only hint.)
_RDMA_REQUESTS = ("SPARKCCL_IB_HCA", "SPARKCCL_RING_PREV_HCA", "SPARKCCL_RING_NEXT_HCA",
                  "SPARKCCL_IB_GID_INDEX")
SHM_DIR = "/dev/shm"
_CAP_IPC_LOCK = 14


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "doctor", help="effective settings and their sources, shared memory and memlock "
                  "against what a communicator needs, RDMA devices, what sparkccl would use",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", choices=["mesh", "ring"],
                   help="check only this topology (default: show both; fail only if "
                        "neither can work)")
    p.add_argument("--devices", help="mesh devices, NCCL_IB_HCA syntax "
                                     "(overrides SPARKCCL_IB_HCA / NCCL_IB_HCA)")
    p.add_argument("--prev-devices", help="ring: the two devices of the port facing prev")
    p.add_argument("--next-devices", help="ring: the two devices of the port facing next")
    p.add_argument("--gid-index", type=int, help="force this GID index on every device")
    p.add_argument("--roots", type=int, choices=[1, 2],
                   help="devices (roots) per port to use (default: SPARKCCL_ROOTS or 2)")
    p.add_argument("--sysfs-root", help="read sysfs here (default: $SPARKCCL_SYSFS_ROOT or /sys)")
    p.add_argument("--world", type=int, default=4,
                   help="ranks of the communicator the memory figures are for")
    p.add_argument("--local-ranks", type=int, default=1,
                   help="ranks on this host (all of --world for the shm transport)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    return doctor(topology=args.topology, devices=args.devices,
                  prev_devices=args.prev_devices, next_devices=args.next_devices,
                  gid_index=args.gid_index, roots=args.roots, sysfs_root=args.sysfs_root,
                  world=args.world, local_ranks=args.local_ranks)


# -- host checks -------------------------------------------------------------------------

def verbs_status() -> tuple[bool, str, list[str] | None]:
    """(loadable, description, device names libibverbs lists or None)."""
    lib, name, errors = None, None, []
    # The library the verbs transport would load (SPARKCCL_IBVERBS_LIB), then the usual one.
    for candidate in dict.fromkeys((config.get("SPARKCCL_IBVERBS_LIB"), "libibverbs.so.1",
                                    "find_library")):
        if candidate == "find_library":
            candidate = ctypes.util.find_library("ibverbs")
            if candidate is None:
                break
        try:
            lib, name = ctypes.CDLL(candidate, use_errno=True), candidate
            break
        except OSError as e:
            errors.append(str(e))
    if lib is None:
        return False, (f"libibverbs cannot be loaded ({'; '.join(errors) or 'not found'}); "
                       "install rdma-core: apt install libibverbs1 ibverbs-providers"), None
    lib.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
    lib.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.ibv_get_device_name.restype = ctypes.c_char_p
    lib.ibv_get_device_name.argtypes = [ctypes.c_void_p]
    lib.ibv_free_device_list.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    count = ctypes.c_int(0)
    devs = lib.ibv_get_device_list(ctypes.byref(count))
    if not devs:  # NULL: e.g. ENOSYS without the kernel's uverbs support
        err = ctypes.get_errno()
        return True, f"{name} loaded; ibv_get_device_list failed: {os.strerror(err)}", []
    names = [lib.ibv_get_device_name(devs[i]).decode() for i in range(count.value)]
    lib.ibv_free_device_list(devs)
    return True, f"{name} loaded; it lists {len(names)} device(s)", names


def _can_lock_memory() -> bool:
    # RLIMIT_MEMLOCK does not bind a process with CAP_IPC_LOCK (root, usually).
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except (OSError, ValueError):
        pass
    return os.geteuid() == 0


def memlock_status(need: int) -> tuple[bool, str]:
    """(enough, description) for pinning ``need`` bytes of registered memory."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return True, "unlimited"
    text = f"{_mib(soft)} (sparkccl pins about {_mib(need)} per rank)"
    if _can_lock_memory():
        return True, text + "; not binding: this process has CAP_IPC_LOCK"
    if soft < need:
        return False, (text + ": too small, memory registration will fail; raise it "
                       "(ulimit -l unlimited, docker --ulimit memlock=-1, or "
                       "/etc/security/limits.conf)")
    return True, text + "; warning: not unlimited"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


def shm_free(path: str = SHM_DIR) -> int | None:
    """Bytes an unprivileged process may still allocate in ``path`` (None: no such mount)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def bytes_per_rank(world: int, topology: str | None, slot_bytes: int, roots: int) -> int:
    """Shared memory one rank of a ``world``-rank communicator holds (control block,
    all-gather slots, and the reduce-scatter slots once used); the larger topology when
    ``topology`` is None."""
    try:
        from .buffers import bytes_per_rank as per_rank
    except ImportError:  # TODO(integrator): sparkccl/buffers.py (H-A) replaces the fallback
        per_rank = _bytes_per_rank
    return max(per_rank(world, t, slot_bytes, roots)
               for t in ((topology,) if topology else ("mesh", "ring")))


def _bytes_per_rank(world: int, topology: str, slot_bytes: int, roots: int) -> int:
    from . import layout
    from .plan.build import build_plan
    from .plan.geometry import ALIGN
    from .plan.model import REGION_SLOTS, Region
    max_slice = (slot_bytes // world) // ALIGN * ALIGN
    most = 0
    for rank in range(world):
        plan = build_plan(topology, world, rank, roots)
        most = max(most, layout.control_bytes(plan.num_flag_words)
                   + REGION_SLOTS[Region.AG] * layout.slot_stride(slot_bytes)
                   + REGION_SLOTS[Region.RS_SEND] * layout.slot_stride(slot_bytes)
                   + REGION_SLOTS[Region.RS_RECV]
                   * layout.slot_stride(plan.rs_recv_blocks * max_slice))
    return most


def _memory(world: int, local_ranks: int, topology: str | None, slot_bytes: int, roots: int,
            shm_space: Callable[[], int | None], out: TextIO) -> tuple[list[str], int]:
    """Print the memory a communicator needs against /dev/shm; (problems, bytes per rank)."""
    try:
        need = bytes_per_rank(world, topology, slot_bytes, roots)
    except ValueError as e:
        return [f"--world {world}: {e}"], 0
    host = need * local_ranks
    free = shm_space()
    size = config.format_bytes
    print(f"memory: {size(need)} of shared memory per rank (world {world}, slot "
          f"{size(slot_bytes)}: all-gather 3 slots, reduce-scatter 2 send + 2 receive slots "
          f"once used, control block); {local_ranks} rank(s) here: {size(host)}", file=out)
    problems = []
    if free is None:
        text = f"{SHM_DIR} is not mounted: the shm segments cannot be created"
        problems.append(text)
    elif free < host:
        text = (f"{size(free)} free, {size(host)} needed: too small; a collective would die "
                f"with SIGBUS or fail to reserve its memory; enlarge it (docker run "
                f"--shm-size={-(-host // (1 << 30)) + 1}g, or mount -o remount,size=... "
                f"{SHM_DIR}) or lower SPARKCCL_SLOT_BYTES")
        problems.append(f"{SHM_DIR}: {text}")
    else:
        room = f"room for {free // need} rank(s) of this size" if need else "nothing needed"
        text = f"{size(free)} free ({room})"
    print(f"{SHM_DIR}: {text}", file=out)
    return problems, need


# -- report ------------------------------------------------------------------------------

def width() -> int:
    """Columns of the report: the terminal's ($COLUMNS, else the terminal, else 100)."""
    return max(60, shutil.get_terminal_size((100, 24)).columns)


MIN_COLUMN = 24  # a wide column is narrowed to this at most (its cells wrap inside it)


def _table(rows: list[list[str]], columns: int | None = None, header: bool = False) -> str:
    """Rows aligned in columns (``columns=None``: as wide as they are). When they do not
    fit, the columns wider than MIN_COLUMN are narrowed and their cells wrap; if that is
    not enough and ``rows[0]`` is a header, each row becomes a block of ``header: value``
    lines."""
    n = len(rows[0])
    widths = [max(len(r[i]) for r in rows) for i in range(n)]
    limit = columns if columns is not None else sum(widths) + 2 * (n - 1)
    while sum(widths) + 2 * (n - 1) > limit:
        i = max(range(n), key=widths.__getitem__)
        if widths[i] <= MIN_COLUMN:
            break
        widths[i] -= 1
    if sum(widths) + 2 * (n - 1) > limit and header:
        return "\n".join(f"{r[0]}:\n" + "\n".join(f"  {h}: {c}" for h, c in
                                                     zip(rows[0][1:], r[1:]))
                         for r in rows[1:])
    lines = []
    for r in rows:
        cells = [textwrap.wrap(c, w, break_on_hyphens=False) or [""]
                 for c, w in zip(r, widths)]
        for k in range(max(map(len, cells))):
            lines.append("  ".join((cell[k] if k < len(cell) else "").ljust(w)
                                   for cell, w in zip(cells, widths)).rstrip())
    return "\n".join(lines)


class _Wrapping:
    """A text stream that wraps each line it is given to ``columns``, continuation lines
    indented two more spaces than the line (tables arrive already narrow enough)."""

    def __init__(self, out: TextIO, columns: int):
        self.out, self.columns, self._part = out, columns, ""

    def __getattr__(self, name):  # (anything else a stream has)
        return getattr(self.out, name)

    def write(self, text: str) -> int:
        *lines, self._part = (self._part + text).split("\n")
        for line in lines:
            self.out.write(self._wrap(line) + "\n")
        return len(text)

    def _wrap(self, line: str) -> str:
        if len(line) <= self.columns:
            return line
        indent = line[:len(line) - len(line.lstrip())]
        return textwrap.fill(line, self.columns, subsequent_indent=indent + "  ",
                             break_on_hyphens=False, break_long_words=False)

    def flush(self) -> None:
        if self._part:
            self.out.write(self._wrap(self._part))
            self._part = ""
        if hasattr(self.out, "flush"):
            self.out.flush()


def _port_row(fabric: Fabric, dev, port: Port, gid: tuple[int | None, str]) -> list[str]:
    try:
        c = evaluate(dev, port, *gid)
        gid_col, why = str(c.gid_index), c.why
    except FabricError as e:
        gid_col, why = "-", f"unusable: {e}"
    mtu = (str(port.active_mtu) if port.active_mtu else "?") + \
        (f" ({port.netdev_mtu})" if port.netdev_mtu else "")
    return [dev.name, f"{dev.group}/{dev.root}", str(port.port),
            f"{port.state}/{port.phys_state}", port.rate.replace("Gb/sec", "Gb/s"),
            port.link_layer, port.netdev or "-", str(port.ipv4) if port.ipv4 else "-",
            mtu, gid_col, why]


def _lanes(choices) -> str:
    return " + ".join(f"{c.device}:{c.port} (GID {c.gid_index}, {c.ipv4 or 'no IPv4'}, "
                      f"MTU {c.mtu or '?'})" for c in choices)


def _describe(sel: Selection, out: TextIO) -> None:
    head = f"{sel.topology}" + (f" [{sel.source}]" if sel.source else "")
    if sel.ok and sel.topology == "mesh":
        print(f"{head}: {_lanes(sel.mesh)}", file=out)
    elif sel.ok:
        print(f"{head}:\n  prev: {_lanes(sel.prev)}\n  next: {_lanes(sel.next)}", file=out)
    else:
        print(f"{head}: cannot work", file=out)
    for e in sel.errors:
        print(f"  error: {e}", file=out)
    for n in sel.notes:
        print(f"  note: {n}", file=out)


def doctor(*, topology: str | None = None, devices: str | None = None,
           prev_devices: str | None = None, next_devices: str | None = None,
           gid_index: int | None = None, roots: int | None = None,
           sysfs_root: str | None = None, env: Mapping[str, str] | None = None,
           ipv4_of: Ipv4Lookup | None = None, out: TextIO | None = None,
           verbs: Callable[[], tuple[bool, str, list[str] | None]] = verbs_status,
           memlock: Callable[[int], tuple[bool, str]] = memlock_status,
           shm_space: Callable[[], int | None] = shm_free,
           world: int = 4, local_ranks: int = 1, columns: int | None = None) -> int:
    """Print the report; return the exit status. Tests inject sysfs/env/ipv4/checks.
    ``columns``: wrap the report to that width (default: :func:`width` on stdout, no
    wrapping into a given ``out``)."""
    if columns is None and out is None:
        columns = width()
    out = out if out is not None else sys.stdout
    if columns is not None:
        out = _Wrapping(out, columns)
    try:
        return _report(out, columns, topology=topology, devices=devices,
                       prev_devices=prev_devices, next_devices=next_devices,
                       gid_index=gid_index, roots=roots, sysfs_root=sysfs_root, env=env,
                       ipv4_of=ipv4_of, verbs=verbs, memlock=memlock, shm_space=shm_space,
                       world=world, local_ranks=local_ranks)
    finally:
        out.flush()


def _report(out: TextIO, columns: int | None, *, topology, devices, prev_devices, next_devices,
            gid_index, roots, sysfs_root, env, ipv4_of, verbs, memlock, shm_space, world,
            local_ranks) -> int:
    env = os.environ if env is None else env
    problems: list[str] = []

    arguments = {"SPARKCCL_IB_HCA": devices, "SPARKCCL_RING_PREV_HCA": prev_devices,
                 "SPARKCCL_RING_NEXT_HCA": next_devices, "SPARKCCL_IB_GID_INDEX": gid_index,
                 "SPARKCCL_ROOTS": roots, "SPARKCCL_SYSFS_ROOT": sysfs_root}
    rows = config.effective(arguments, env)
    print("settings (value, where it comes from):", file=out)
    print(_table([["  " + n, v, src] for n, v, src in rows], columns) + "\n", file=out)
    problems += [src for _, v, src in rows if v == "INVALID"]
    try:
        settings = config.resolve(env=env)
        slot_bytes, default_roots = settings.slot_bytes, settings.roots
    except ValueError:  # already reported as INVALID above
        slot_bytes, default_roots = config.DEFAULT_SLOT_BYTES, config.DEFAULT_ROOTS
    roots = roots if roots is not None else default_roots
    more, need = _memory(world, local_ranks, topology, slot_bytes, roots, shm_space, out)
    problems += more

    fabric = discover(sysfs_root, ipv4_of=ipv4_of)
    asked = [f"--{n.replace('_', '-')}" for n, v in
             (("devices", devices), ("prev_devices", prev_devices),
              ("next_devices", next_devices), ("gid_index", gid_index)) if v is not None]
    asked += [v for v in _RDMA_REQUESTS if config.is_set(v, env)]

    if not fabric.devices:
        print(f"no RDMA devices found ({fabric.ib_class_dir} "
              f"{'is empty' if os.path.isdir(fabric.ib_class_dir) else 'does not exist'}); "
              "the shm transport (one host) remains available, and tcp between hosts",
              file=out)
        # For information only: neither matters without an RDMA device.
        print(f"memlock: {memlock(need)[1]}", file=out)
        print(f"libibverbs: {verbs()[1]}", file=out)
        for v in ("NCCL_IB_HCA", "NCCL_IB_GID_INDEX"):
            if env.get(v, "").strip():
                print(f"note: {v} is set but there is nothing for it to select", file=out)
        if asked:
            problems.append(f"{', '.join(asked)} asks for RDMA devices, and there are none")
        if problems:
            print("FAIL: " + "\n      ".join(problems), file=out)
            return 1
        return 0

    print(f"RDMA devices under {fabric.ib_class_dir}:\n", file=out)
    try:
        gid = resolve_gid_index(gid_index, env)
    except FabricError:  # the selections below report it
        gid = (None, "")
    rows = [["device", "QSFP/root", "port", "state", "speed", "link", "netdev", "IPv4",
             "MTU (netdev)", "GID", "why"]]
    rows += [_port_row(fabric, d, p, gid) for d, p in fabric.ports()]
    print(_table(rows, columns, header=True) + "\n", file=out)

    ok, text = memlock(need)
    print(f"memlock: {text}", file=out)
    if not ok:
        problems.append(f"memlock limit: {text}")
    ok, text, listed = verbs()
    print(f"libibverbs: {text}", file=out)
    if not ok:
        problems.append(text)
    elif listed is not None:
        unseen = [d.name for d in fabric.devices if d.name not in listed]
        if len(unseen) == len(fabric.devices):
            problems.append("libibverbs lists none of the devices in sysfs (is the mlx5 "
                            "provider, package ibverbs-providers, installed?)")
        elif unseen:
            print(f"  note: libibverbs does not list {', '.join(unseen)}", file=out)
    print(f"settings: {roots} root(s) per port, slot {_mib(slot_bytes)}", file=out)
    try:
        from .transport.verbs import resolve_settings
        vs = resolve_settings(env)
        per_try = 4.096e-6 * (1 << vs.timeout)
        print(f"verbs: ordering {vs.ordering} (SPARKCCL_IB_ORDERING), QP timeout {vs.timeout} "
              f"({per_try:.3g} s per attempt, {vs.retry_cnt + 1} attempts), RNR retry "
              f"{vs.rnr_retry}, traffic class {vs.traffic_class}, SL {vs.service_level}\n",
              file=out)
    except ValueError as e:
        problems.append(str(e))
        print(f"verbs: {e}\n", file=out)

    mesh_asked = devices is not None or config.is_set("SPARKCCL_IB_HCA", env)
    ring_asked = (prev_devices, next_devices) != (None, None) or any(
        config.is_set(v, env) for v in ("SPARKCCL_RING_PREV_HCA", "SPARKCCL_RING_NEXT_HCA"))
    sels = []
    if topology in (None, "mesh"):
        sels.append(select_mesh(fabric, devices=devices, gid_index=gid_index, roots=roots,
                                env=env))
    if topology in (None, "ring"):
        sels.append(select_ring(fabric, prev_devices=prev_devices, next_devices=next_devices,
                                gid_index=gid_index, roots=roots, env=env))
    for sel in sels:
        _describe(sel, out)
    failed = [s for s in sels if not s.ok]
    # A failing topology counts when it was asked for; otherwise only if nothing works
    # (a box on a switch has no ring, a ring box may have no switch port).
    must = [s for s in failed if topology is not None
            or (s.topology == "mesh" and mesh_asked) or (s.topology == "ring" and ring_asked)]
    if failed and len(failed) == len(sels):
        must = failed
    problems += [f"{s.topology}: {'; '.join(s.errors)}" for s in must]

    if problems:
        print("\nFAIL: " + "\n      ".join(problems), file=out)
        return 1
    usable = ", ".join(s.topology for s in sels if s.ok)
    print(f"\nOK: sparkccl can use RDMA here ({usable})", file=out)
    return 0
