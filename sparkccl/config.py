"""Settings: arguments first, then ``SPARKCCL_*`` environment variables, then defaults.

| variable | default | meaning |
| --- | --- | --- |
| ``SPARKCCL_SLOT_BYTES`` | 64 MiB | capacity of one slot: the whole gathered / reduce-scattered tensor of one collective (world x slice). Accepts ``67108864``, ``64M``, ``64MiB``, ``1G``. |
| ``SPARKCCL_TIMEOUT_S`` | 120 | seconds a collective (or the bootstrap) may wait for peers before it fails with ``CollectiveError`` |
| ``SPARKCCL_BOOTSTRAP_TIMEOUT_S`` | max(timeout, 120) | seconds the ranks may take to all join (construction) and to all reach ``close()`` |
| ``SPARKCCL_ROOTS`` | 2 | PCIe functions ("roots") per port that traffic is split over (1 or 2) |
| ``SPARKCCL_RS_UP_FRONT`` | 0 | 1: create the reduce-scatter buffers at construction instead of on first use |
| ``SPARKCCL_PROXY_SPIN_US`` | 200000 (50 when oversubscribed) | proxy keeps spinning this long after its last work |
| ``SPARKCCL_PROXY_NAP_US`` | 200 (50 when oversubscribed) | then naps this long per idle turn |
| ``SPARKCCL_CHECK_SIZES`` | 1 | 0: skip the cross-rank size check done on each collective's first piece |
| ``SPARKCCL_GPU_DIRECT`` | 1 | CUDA tensors on one host (shm transport): the GPU writes its data straight into the peers' mapped regions and flags (docs/PROTOCOL.md "GPU-direct"); 0: the proxy's copy workers send it |
| ``SPARKCCL_DIRECT_MODE`` | auto | GPU-direct engines: ``fused`` (one kernel: publish and wait blocks), ``split`` (the two roles as kernels on two streams), ``ce`` (copy engines move the bytes both ways; kernels only wait and sum), ``auto`` (``ce`` from ``SPARKCCL_CE_MIN_BYTES`` per rank, else ``fused``); see ``sparkccl/dataplane/cuda.py`` |
| ``SPARKCCL_CE_MIN_BYTES`` | 16 MiB | ``auto``: the smallest per-rank slice that uses the copy engines |
| ``SPARKCCL_TCP_ADDRS`` | 127.0.0.1 | tcp transport, mesh: this rank's address per root (``10.0.0.1,10.0.1.1``); see ``sparkccl/transport/tcp.py`` |
| ``SPARKCCL_TCP_PREV_ADDRS`` / ``SPARKCCL_TCP_NEXT_ADDRS`` | ``SPARKCCL_TCP_ADDRS`` | tcp transport, ring: addresses per root of the port facing prev / next |

Sizing: the default slot (64 MiB) holds a prefill-sized call on GB10 (tens of MB per rank
per call, e.g. 8k tokens x 4096 hidden x bf16 = 64 MiB gathered). Memory held per rank:
all-gather 3 slots, reduce-scatter (only once used) 2 send slots + 2 receive slots, so
about 7-8 x slot_bytes per rank with the default. Larger inputs are split into several
collectives automatically.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .errors import ConfigError

DEFAULT_SLOT_BYTES = 64 << 20
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_BOOTSTRAP_TIMEOUT_S = 120.0
DEFAULT_ROOTS = 2
DEFAULT_SPIN_US = 200_000
DEFAULT_NAP_US = 200
OVERSUBSCRIBED_SPIN_US = 50
OVERSUBSCRIBED_NAP_US = 50
MIN_SLOT_BYTES = 4096
PROXY_THREADS_PER_RANK = 2

_UNITS = {"": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str | int, what: str) -> int:
    """``"64M"`` / ``"64MiB"`` / ``"1g"`` / ``"4096"`` -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{what}: cannot parse {text!r} as a byte size "
                         "(use e.g. 67108864, 64M, 64MiB, 1.5G)")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n != int(n):
        raise ValueError(f"{what}: {text!r} is not a whole number of bytes")
    return int(n)


def _env(name: str, env=None) -> str | None:
    v = (os.environ if env is None else env).get(name)
    return None if v is None or v.strip() == "" else v.strip()


def _env_int(name: str, default: int) -> int:
    v = _env(name)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r}: expected an integer") from None


def _env_float(name: str, default: float) -> float:
    v = _env(name)
    if v is None:
        return default
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"{name}={v!r}: expected a number of seconds") from None


def env_bool(name: str, default: bool, env=None) -> bool:
    """A 0/1 switch from the environment (or the mapping ``env``); unset or empty: default."""
    v = _env(name, env)
    if v is None:
        return default
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={v!r}: expected 0 or 1")


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# ---- one declaration per environment variable ------------------------------------------
# Every SPARKCCL_* variable the package reads is declared here, once: its type, default,
# meaning and the layer that uses it. Readers call get(NAME) (or lookup(NAME) for the
# source as well); nothing else in the package parses os.environ for SPARKCCL_* names.


@dataclass(frozen=True)
class Variable:
    name: str
    kind: str                 # "bytes", "int", "float", "bool", "str", "choice", "list"
    default: object           # None: unset means "the caller decides" (default_text says how)
    meaning: str
    layer: str                # which part of sparkccl reads it
    default_text: str = ""    # how a computed default is chosen, for tables and doctor
    choices: tuple = ()       # kind "choice"
    lo: float | None = None   # inclusive bounds for int / float / bytes
    hi: float | None = None
    nccl: tuple = ()          # NCCL variables consulted when the SPARKCCL_* one is unset


def _parse(var: Variable, source: str, text: str):
    t = text.strip()
    bad = f"{source}={text!r}"
    if var.kind == "bool":
        if t.lower() in ("1", "true", "yes", "on"):
            return True
        if t.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{bad}: expected 0 or 1")
    if var.kind in ("str", "list"):
        return t if var.kind == "str" else tuple(p.strip() for p in t.split(",") if p.strip())
    if var.kind == "choice":
        if t.lower() not in var.choices:
            raise ConfigError(f"{bad}: expected one of {', '.join(var.choices)}")
        return t.lower()
    try:
        value = (parse_bytes(t, source) if var.kind == "bytes" else
                 int(t) if var.kind == "int" else float(t))
    except ValueError:
        what = {"bytes": "a byte size (e.g. 67108864, 64M, 64MiB, 1.5G)",
                "int": "an integer", "float": "a number"}[var.kind]
        raise ConfigError(f"{bad}: expected {what}") from None
    if (var.lo is not None and value < var.lo) or (var.hi is not None and value > var.hi):
        lo = "" if var.lo is None else f"{var.lo:g}"
        hi = "" if var.hi is None else f"{var.hi:g}"
        raise ConfigError(f"{bad}: must be in [{lo}, {hi}]" if lo and hi else
                          f"{bad}: must be >= {lo}" if lo else f"{bad}: must be <= {hi}")
    return value


def lookup(name: str, env=None):
    """``(value, source)`` of a declared variable: the ``SPARKCCL_*`` value, else the first
    NCCL variable it honours, else ``(default, "default")``. Raises :class:`ConfigError`
    naming the variable and the value when the value does not parse."""
    var = VARIABLES[name]
    env = os.environ if env is None else env
    for source in (name, *var.nccl):
        text = env.get(source)
        if text is not None and text.strip() != "":
            return _parse(var, source, text), source
    return var.default, "default"


def get(name: str, env=None):
    """The value of a declared variable (its default when unset); see :func:`lookup`."""
    return lookup(name, env)[0]

def _v(name, kind, default, layer, meaning, **kw) -> Variable:
    return Variable(name, kind, default, meaning, layer, **kw)


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    _v("SPARKCCL_SLOT_BYTES", "bytes", DEFAULT_SLOT_BYTES, "communicator",
       "capacity of one slot: the whole gathered / reduce-scattered tensor of one collective "
       "(world x slice); larger inputs are split", lo=MIN_SLOT_BYTES),
    _v("SPARKCCL_TIMEOUT_S", "float", DEFAULT_TIMEOUT_S, "communicator",
       "seconds a collective may wait for peers before it raises CollectiveError", lo=1e-3),
    _v("SPARKCCL_BOOTSTRAP_TIMEOUT_S", "float", None, "communicator",
       "seconds the ranks may take to all join (construction) and to all reach close()",
       default_text="max(timeout, 120)", lo=1e-3),
    _v("SPARKCCL_ROOTS", "int", DEFAULT_ROOTS, "plan",
       "PCIe functions (roots) per port that traffic is split over", lo=1, hi=2),
    _v("SPARKCCL_RS_UP_FRONT", "bool", False, "communicator",
       "1: create the reduce-scatter buffers at construction instead of on first use"),
    _v("SPARKCCL_PROXY_SPIN_US", "int", None, "proxy",
       "the proxy keeps spinning this long after its last work",
       default_text=f"{DEFAULT_SPIN_US} ({OVERSUBSCRIBED_SPIN_US} when oversubscribed)", lo=0),
    _v("SPARKCCL_PROXY_NAP_US", "int", None, "proxy",
       "then naps this long per idle turn",
       default_text=f"{DEFAULT_NAP_US} ({OVERSUBSCRIBED_NAP_US} when oversubscribed)", lo=0),
    _v("SPARKCCL_CHECK_SIZES", "bool", True, "data plane",
       "0: skip the cross-rank size check done on each collective's first piece"),
    _v("SPARKCCL_GPU_DIRECT", "bool", True, "data plane (CUDA)",
       "CUDA on one host (shm): the GPU writes its data straight into the peers' mapped "
       "regions and flags; 0: the proxy's copy workers send it"),
    _v("SPARKCCL_DIRECT_MODE", "choice", "auto", "data plane (CUDA)",
       "GPU-direct engine: fused, split, ce, or auto (ce from SPARKCCL_CE_MIN_BYTES per rank)",
       choices=("auto", "fused", "split", "ce")),
    _v("SPARKCCL_CE_MIN_BYTES", "bytes", 16 << 20, "data plane (CUDA)",
       "auto: the smallest per-rank slice that uses the copy engines", lo=0),
    _v("SPARKCCL_DIRECT_BLOCKS", "list", None, "data plane (CUDA)",
       "for measurements: thread blocks of the GPU-direct kernels as 'publish,wait'",
       default_text="SM count, SM count - 1"),
    _v("SPARKCCL_CACHE_DIR", "str", None, "data plane (CUDA)",
       "where compiled kernels are cached", default_text="~/.cache/sparkccl"),
    _v("SPARKCCL_TCP_ADDRS", "list", None, "transport tcp",
       "mesh: this rank's address per root (e.g. 10.0.0.1,10.0.1.1)", default_text="127.0.0.1"),
    _v("SPARKCCL_TCP_PREV_ADDRS", "list", None, "transport tcp",
       "ring: addresses per root of the port facing prev", default_text="SPARKCCL_TCP_ADDRS"),
    _v("SPARKCCL_TCP_NEXT_ADDRS", "list", None, "transport tcp",
       "ring: addresses per root of the port facing next", default_text="SPARKCCL_TCP_ADDRS"),
    _v("SPARKCCL_TCP_CONNECT_TIMEOUT_S", "float", 10.0, "transport tcp",
       "seconds one connection attempt may take", lo=1e-3),
    _v("SPARKCCL_TCP_BUF_BYTES", "bytes", None, "transport tcp",
       "SO_SNDBUF / SO_RCVBUF; 0 = kernel autotuning",
       default_text="4 MiB where net.core.[rw]mem_max allows it, else autotuning", lo=0),
    _v("SPARKCCL_IB_HCA", "str", None, "fabric",
       "mesh: the devices (roots) to use, in NCCL_IB_HCA syntax", nccl=("NCCL_IB_HCA",),
       default_text="discovered"),
    _v("SPARKCCL_RING_PREV_HCA", "str", None, "fabric",
       "ring: the two roots of the port facing prev", default_text="discovered"),
    _v("SPARKCCL_RING_NEXT_HCA", "str", None, "fabric",
       "ring: the two roots of the port facing next", default_text="discovered"),
    _v("SPARKCCL_IB_GID_INDEX", "int", None, "fabric",
       "RoCE GID index", nccl=("NCCL_IB_GID_INDEX",), lo=0,
       default_text="the RoCE v2 GID of the root's IPv4 address"),
    _v("SPARKCCL_SYSFS_ROOT", "str", None, "fabric",
       "where RDMA devices are discovered (tests point it at a fake tree)",
       default_text="/sys/class/infiniband"),
    _v("SPARKCCL_IB_TIMEOUT", "int", 18, "transport verbs",
       "QP local ACK timeout: 4.096 us x 2^t per attempt (18: ~1.07 s)", lo=1, hi=31,
       nccl=("NCCL_IB_TIMEOUT",)),
    _v("SPARKCCL_IB_RETRY_CNT", "int", 7, "transport verbs",
       "retransmissions before a write fails with retry-exceeded", lo=0, hi=7,
       nccl=("NCCL_IB_RETRY_CNT",)),
    _v("SPARKCCL_IB_RNR_RETRY", "int", 7, "transport verbs",
       "receiver-not-ready retries (7 = forever; only strict ordering posts receives)",
       lo=0, hi=7),
    _v("SPARKCCL_IB_ORDERING", "choice", "inline", "transport verbs",
       "inline: the flag is an inline RDMA WRITE after the data; strict: WRITE_WITH_IMM, "
       "stored after the receive completion (hosts whose PCIe may reorder posted writes)",
       choices=("inline", "strict")),
    _v("SPARKCCL_IB_TC", "int", 0, "transport verbs", "RoCE traffic class", lo=0, hi=255,
       nccl=("NCCL_IB_TC",)),
    _v("SPARKCCL_IB_SL", "int", 0, "transport verbs", "service level", lo=0, hi=15,
       nccl=("NCCL_IB_SL",)),
    _v("SPARKCCL_IBVERBS_LIB", "str", "libibverbs.so.1", "transport verbs",
       "the libibverbs library to load"),
    _v("SPARKCCL_LANE_CHECK", "bool", True, "transport",
       "0: skip the one-write check of every connection at creation"),
    _v("SPARKCCL_LANE_CHECK_TIMEOUT_S", "float", None, "transport",
       "how long a rank waits for its lanes to check", default_text="min(timeout, 30)",
       lo=1e-3),
    _v("SPARKCCL_TORCH_MIN_BYTES", "bytes", 1 << 20, "torch.distributed backend",
       "smallest collective (gathered output, reduce-scatter input, all-reduce tensor) sent "
       "through sparkccl; smaller ones go to the fallback group (docs/TORCH.md)", lo=0),
    _v("SPARKCCL_SELFTEST_TRACEBACK", "bool", False, "selftest",
       "1: print the traceback of a failed self-test"),
)}


@dataclass(frozen=True)
class Settings:
    slot_bytes: int
    timeout_s: float
    bootstrap_timeout_s: float
    roots: int
    rs_up_front: bool
    spin_us: int
    nap_us: int
    check_sizes: bool
    oversubscribed: bool
    gpu_direct: bool = True


def bootstrap_timeout(timeout_s: float | None = None) -> float:
    """The bootstrap timeout, never raising (bad values are reported by :func:`resolve`)."""
    try:
        t = float(timeout_s) if timeout_s is not None else _env_float("SPARKCCL_TIMEOUT_S",
                                                                        DEFAULT_TIMEOUT_S)
        boot = _env_float("SPARKCCL_BOOTSTRAP_TIMEOUT_S", max(t, DEFAULT_BOOTSTRAP_TIMEOUT_S))
        return boot if boot > 0 else DEFAULT_BOOTSTRAP_TIMEOUT_S
    except (TypeError, ValueError):
        return DEFAULT_BOOTSTRAP_TIMEOUT_S


def resolve(*, slot_bytes: int | str | None = None, timeout_s: float | None = None,
            local_ranks: int = 1) -> Settings:
    """Settings for one communicator; raises ValueError naming the bad argument or variable."""
    if slot_bytes is None:
        v = _env("SPARKCCL_SLOT_BYTES")
        slot = parse_bytes(v, "SPARKCCL_SLOT_BYTES") if v is not None else DEFAULT_SLOT_BYTES
        slot_src = "SPARKCCL_SLOT_BYTES"
    else:
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, (int, str)):
            raise TypeError(f"slot_bytes must be an int (bytes), got {type(slot_bytes).__name__}")
        slot = parse_bytes(slot_bytes, "slot_bytes")
        slot_src = "slot_bytes"
    if slot < MIN_SLOT_BYTES:
        raise ValueError(f"{slot_src}={slot}: must be at least {MIN_SLOT_BYTES} bytes")

    if timeout_s is None:
        timeout = _env_float("SPARKCCL_TIMEOUT_S", DEFAULT_TIMEOUT_S)
        t_src = "SPARKCCL_TIMEOUT_S"
    else:
        timeout, t_src = float(timeout_s), "timeout_s"
    if not timeout > 0:
        raise ValueError(f"{t_src}={timeout}: must be > 0 seconds")

    boot = _env_float("SPARKCCL_BOOTSTRAP_TIMEOUT_S", max(timeout, DEFAULT_BOOTSTRAP_TIMEOUT_S))
    if not boot > 0:
        raise ValueError(f"SPARKCCL_BOOTSTRAP_TIMEOUT_S={boot}: must be > 0 seconds")

    roots = _env_int("SPARKCCL_ROOTS", DEFAULT_ROOTS)
    if roots not in (1, 2):
        raise ValueError(f"SPARKCCL_ROOTS={roots}: must be 1 or 2")

    oversub = local_ranks * PROXY_THREADS_PER_RANK > usable_cpus()
    spin = _env_int("SPARKCCL_PROXY_SPIN_US", OVERSUBSCRIBED_SPIN_US if oversub else DEFAULT_SPIN_US)
    nap = _env_int("SPARKCCL_PROXY_NAP_US", OVERSUBSCRIBED_NAP_US if oversub else DEFAULT_NAP_US)
    if spin < 0 or nap < 0:
        raise ValueError("SPARKCCL_PROXY_SPIN_US / SPARKCCL_PROXY_NAP_US must be >= 0")
    return Settings(slot_bytes=slot, timeout_s=timeout, bootstrap_timeout_s=boot, roots=roots,
                    rs_up_front=env_bool("SPARKCCL_RS_UP_FRONT", False),
                    spin_us=spin, nap_us=nap,
                    check_sizes=env_bool("SPARKCCL_CHECK_SIZES", True),
                    oversubscribed=oversub,
                    gpu_direct=env_bool("SPARKCCL_GPU_DIRECT", True))
