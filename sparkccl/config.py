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
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{what}: cannot parse {text!r} as a byte size "
                         "(use e.g. 67108864, 64M, 64MiB, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


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
