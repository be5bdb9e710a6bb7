"""Settings: arguments first, then ``SPARKCCL_*`` environment variables, then the NCCL
variables a GB10 setup already carries, then defaults (or what discovery finds).

Every ``SPARKCCL_*`` variable sparkccl reads is declared once in :data:`VARIABLES` (type,
default, meaning, the layer that reads it, NCCL fallbacks) and read with :func:`get` /
:func:`lookup`, one parser that raises :class:`~sparkccl.errors.ConfigError` naming the
variable and the value. The table below is generated from the declarations
(``python -m sparkccl.config`` prints it; README.md carries the same table). Precedence and
where each layer applies them: docs/CONTRACT.md "Configuration".

Sizing: the default slot (64 MiB) holds a prefill-sized call on GB10 (tens of MB per rank
per call, e.g. 8k tokens x 4096 hidden x bf16 = 64 MiB gathered). Memory held per rank:
all-gather 3 slots, reduce-scatter (only once used) 2 send slots + 2 receive slots, plus a
small control block (``sparkccl doctor`` computes the figure). Larger inputs are split
into several collectives automatically.

"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

from .errors import ConfigError

DEFAULT_SLOT_BYTES = 64 << 20
DEFAULT_TIMEOUT_S = 120.0
# The one-shot all-reduce's largest tensor by default, per world (why: docs/CONTRACT.md
# "All-reduce"): at world 2 it moves no more bytes than the two steps and saves a hop.
DEFAULT_ALLREDUCE_ONESHOT_BYTES = 256 << 10
ALLREDUCE_ONESHOT_BYTES_WORLD2 = 2 << 20
DEFAULT_ROOTS = 2
DEFAULT_SPIN_US = 200_000
DEFAULT_NAP_US = 200
OVERSUBSCRIBED_SPIN_US = 50
OVERSUBSCRIBED_NAP_US = 50
MIN_SLOT_BYTES = 4096
PROXY_THREADS_PER_RANK = 2
# The GPU-direct engines of the CUDA data plane, by SPARKCCL_DIRECT_MODE name (declared here
# once: the setting's choices and sparkccl/dataplane/engine_choice.py's table follow it).
DIRECT_ENGINES = ("fused", "split", "ce")

_UNITS = {"": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str | int, what: str) -> int:
    """``"64M"`` / ``"64MiB"`` / ``"1g"`` / ``"1.5G"`` / ``"4096"`` -> bytes (binary units);
    the one byte-size parser (variables, arguments, the command line). ``what`` names the
    setting in the :class:`ConfigError`."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{what}={text!r}: expected a byte size "
                          "(e.g. 67108864, 64M, 64MiB, 1.5G)")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n != int(n):
        raise ConfigError(f"{what}={text!r}: not a whole number of bytes")
    return int(n)


def format_bytes(n: int) -> str:
    """``67108864`` -> ``"64 MiB"`` (binary units, 4 significant digits)."""
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.4g} {unit}"
    return f"{n} B"


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
    expect: str = ""          # what a value must be, for the error (default: from kind)


def _parse(var: Variable, source: str, text: str):
    t = text.strip()
    bad = f"{source}={text!r}"
    if var.kind == "bool":
        if t.lower() in ("1", "true", "yes", "on"):
            return True
        if t.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{bad}: expected 0 or 1")
    if var.kind == "str":
        return t
    if var.kind == "list":
        items = tuple(p.strip() for p in t.split(","))
        if not all(items):
            raise ConfigError(f"{bad}: an empty item in the comma-separated list")
        return items
    if var.kind == "choice":
        if t.lower() not in var.choices:
            raise ConfigError(f"{bad}: expected one of {', '.join(var.choices)}")
        return t.lower()
    if var.kind == "bytes":
        value = parse_bytes(t, source)
    else:
        try:
            value = int(t) if var.kind == "int" else float(t)
        except ValueError:
            what = "an integer" if var.kind == "int" else "a number"
            raise ConfigError(f"{bad}: expected {var.expect or what}") from None
    if (var.lo is not None and value < var.lo) or (var.hi is not None and value > var.hi):
        lo = "" if var.lo is None else f"{var.lo:g}"
        hi = "" if var.hi is None else f"{var.hi:g}"
        raise ConfigError(f"{bad}: must be in [{lo}, {hi}]" if lo and hi else
                          f"{bad}: must be >= {lo}" if lo else f"{bad}: must be <= {hi}")
    return value


def _lookup(var: Variable, env) -> tuple[object, str]:
    env = os.environ if env is None else env
    for source in (var.name, *var.nccl):
        text = env.get(source)
        if text is not None and text.strip() != "":
            return _parse(var, source, text), source
    return var.default, "default"


def lookup(name: str, env=None) -> tuple[object, str]:
    """``(value, source)`` of a declared variable: the ``SPARKCCL_*`` value, else the first
    NCCL variable it honours, else ``(default, "default")``. Raises :class:`ConfigError`
    naming the variable and the value when the value does not parse."""
    return _lookup(VARIABLES[name], env)


def get(name: str, env=None):
    """The value of a declared variable (its default when unset); see :func:`lookup`."""
    return _lookup(VARIABLES[name], env)[0]


def lookup_nccl(name: str, env=None) -> tuple[object, str | None]:
    """``(value, source)`` from only the NCCL variables ``name`` honours (``(None, None)``
    when none is set): for readers that treat an NCCL value differently from their own
    (``NCCL_IB_HCA`` only narrows discovery, see sparkccl/fabric/select.py)."""
    var = VARIABLES[name]
    if not var.nccl:
        return None, None
    value, source = _lookup(dataclasses.replace(var, name=var.nccl[0], default=None,
                                                nccl=var.nccl[1:]), env)
    return (value, source) if source != "default" else (None, None)


def setting(name: str, argument=None, argument_name: str | None = None, env=None):
    """An argument if given (checked against ``name``'s declaration; errors name the
    argument), else the variable as :func:`get` reads it."""
    if argument is None:
        return get(name, env)
    return _parse(VARIABLES[name], argument_name or name.lower(), str(argument))


def is_set(name: str, env=None) -> bool:
    """Whether the declared ``SPARKCCL_*`` variable itself is set (non-empty), whatever its
    value: for reports of what a user asked for (``sparkccl doctor``)."""
    VARIABLES[name]  # a KeyError for a name nobody declared
    return bool(((os.environ if env is None else env).get(name) or "").strip())


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
       default_text="the timeout (timeout_s / SPARKCCL_TIMEOUT_S)", lo=1e-3),
    _v("SPARKCCL_LIVENESS_S", "float", 1.5, "communicator",
       "verbs / tcp: a peer whose host acknowledges nothing on the liveness channel for "
       "about this long (TCP user timeout; heartbeats every 1/6 of it over the bootstrap "
       "network) is declared dead, as is one whose process exited (at once); a peer that is "
       "only silent (stopped, starved) is not: the collective timeout reports it; 0 = no "
       "liveness channel", lo=0),
    _v("SPARKCCL_ROOTS", "int", DEFAULT_ROOTS, "plan",
       "PCIe functions (roots) per port that traffic is split over", lo=1, hi=2),
    _v("SPARKCCL_RS_UP_FRONT", "bool", False, "communicator",
       "1: create the reduce-scatter buffers at construction instead of on first use"),
    _v("SPARKCCL_ALLREDUCE_ONESHOT_BYTES", "bytes", None,
       "communicator",
       "all-reduce: the largest tensor (bytes per rank) summed in one shot (one all-gather, "
       "then a local sum); larger ones run reduce-scatter + all-gather. Same bits either "
       "way; every rank must agree", lo=0,
       default_text="2 MiB at world 2, 256 KiB from world 3"),
    _v("SPARKCCL_PROXY_SPIN_US", "int", None, "proxy",
       "the proxy keeps spinning this long after its last work",
       default_text=f"{DEFAULT_SPIN_US} ({OVERSUBSCRIBED_SPIN_US} when oversubscribed)", lo=0),
    _v("SPARKCCL_SHM_WORKER_SPIN_US", "int", None, "transport shm",
       "a copy worker keeps spinning this long after its last operation, then sleeps (a "
       "sleeping worker costs the proxy a wake-up per post)",
       default_text="SPARKCCL_PROXY_SPIN_US's value (0 unless every rank's proxy, caller and "
       "copy workers have a core)", lo=0),
    _v("SPARKCCL_PROXY_NAP_US", "int", None, "proxy",
       "then naps this long per idle turn",
       default_text=f"{DEFAULT_NAP_US} ({OVERSUBSCRIBED_NAP_US} when oversubscribed)", lo=0),
    _v("SPARKCCL_RELAY_LEAD", "int", -1, "proxy",
       "ring: own pieces a connection may carry ahead of the pieces relayed on it, so relays "
       "are not queued behind them; -1 = no limit", lo=-1, hi=7),
    _v("SPARKCCL_CHECK_SIZES", "bool", True, "data plane",
       "0: skip the cross-rank check of every call's exact bytes, dtype and collective"),
    _v("SPARKCCL_GPU_DIRECT", "bool", True, "data plane (CUDA)",
       "CUDA on one host (shm): the GPU writes its data straight into the peers' mapped "
       "regions and flags; 0: the proxy's copy workers send it"),
    _v("SPARKCCL_ALLREDUCE_LL", "bool", True, "data plane (CUDA)",
       "GPU-direct on a mesh: one-shot all-reduces of up to 8 KiB / (world - 1) per rank "
       "send lines that carry their own flags (no fence, flag word or poller; the same "
       "bits); on only where every rank has it on (agreed at creation); 0: the flag-word way"),
    _v("SPARKCCL_ALLREDUCE_LL_PROXY", "bool", False, "data plane (CUDA)",
       "with SPARKCCL_ALLREDUCE_LL, ranks that are not GPU-direct (tcp, verbs, shm without "
       "GPU-direct) send those lines too, posted by their proxy; off by default: on an H200, "
       "where the GPU polls them across PCIe, 8 KiB at world 2 took 39-40 us against 23-28 "
       "us with flag words (GB10's memory is coherent: not measured there)"),
    _v("SPARKCCL_LAUNCH_EARLY", "bool", True, "data plane (CUDA)",
       "sm_90 and later: the one-shot all-reduce's kernel is launched with programmatic "
       "dependent launch, so it is resident while the kernel before it ends and waits for "
       "it on the GPU (the launch gap between two such calls shrinks); 0: plain launches"),
    _v("SPARKCCL_DIRECT_MODE", "choice", "auto", "data plane (CUDA)",
       "GPU-direct engine: fused, split, ce, or auto (ce from SPARKCCL_CE_MIN_BYTES per rank)",
       choices=("auto", *DIRECT_ENGINES)),
    _v("SPARKCCL_ON_FAILURE", "choice", "stop", "data plane (CUDA)",
       "a failed collective on the GPU: stop (print the error, trap: the process must be "
       "restarted) or poison (outputs set to NaN / 0xFF bytes, later calls raise, check())",
       choices=("stop", "poison")),
    _v("SPARKCCL_GPU_STAMPS", "bool", False, "data plane (CUDA)",
       "1: the GPU stamps each publish-ring entry with the proxy's clock (calibrated once), "
       "for the proxy's publish -> first post figure (proxy_stats, sparkccl bench)"),
    _v("SPARKCCL_GPU_TIMELINE", "bool", False, "data plane (CUDA)",
       "1: kernels compiled with step stamps on the GPU clock (a measurement aid: "
       "dataplane/timeline.py, benchmarks/decode_latency.py and ep_latency.py --timeline)"),
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
    _v("SPARKCCL_TCP_BUF_BYTES", "bytes", 4 << 20, "transport tcp",
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
       expect="a GID index (an integer >= 0)",
       default_text="the RoCE v2 GID of the root's IPv4 address"),
    _v("SPARKCCL_SYSFS_ROOT", "str", "/sys", "fabric",
       "the sysfs whose class/infiniband lists the RDMA devices (tests point it at a fake "
       "tree)"),
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
    _v("SPARKCCL_VLLM", "bool", False, "integrations",
       "1: the vllm.general_plugins entry point gives vLLM's tensor-parallel groups "
       "sparkccl all-reduce / all-gather / reduce-scatter (docs/VLLM_SGLANG.md); 0: the plugin "
       "does nothing"),
    _v("SPARKCCL_SGLANG", "bool", False, "integrations",
       "1: the sglang.srt.plugins entry point hooks SGLang's tensor-parallel all-reduce / "
       "all-gather / reduce-scatter into sparkccl (docs/VLLM_SGLANG.md); 0: the plugin does "
       "nothing"),
    _v("SPARKCCL_VLLM_EP", "bool", False, "integrations",
       "with SPARKCCL_VLLM=1: 1: vLLM MoE layers run with --enable-expert-parallel (data "
       "parallel, --all2all-backend allgather_reducescatter) dispatch and combine through "
       "sparkccl ExpertParallel: with --moe-backend batched_triton in the low-latency mode "
       "and vLLM's batched format, which CUDA graphs capture (fp8 layers too: e4m3 dispatch "
       "for blocks of 128); otherwise high-throughput (bf16 layers), and "
       "such configurations run without CUDA graphs, as vLLM does for DeepEP high-throughput "
       "(docs/EXPERT_PARALLEL.md); 0: they stay on vLLM's backend"),
    _v("SPARKCCL_SGLANG_EP", "bool", False, "integrations",
       "with SPARKCCL_SGLANG=1: 1: SGLang MoE layers run with --moe-a2a-backend customized "
       "dispatch and combine through sparkccl ExpertParallel (not capturable: run SGLang "
       "with --cuda-graph-backend-decode=disabled; docs/EXPERT_PARALLEL.md); 0: customized "
       "stays unsupported, as in SGLang"),
    _v("SPARKCCL_SGLANG_EP_MAX_TOKENS", "int", None, "integrations",
       "SGLang EP: most tokens one rank dispatches in one MoE call (the ExpertParallel "
       "max_tokens)", default_text="SGLang's chunked_prefill_size", lo=1),
    _v("SPARKCCL_ENGINE_EP_PARTIAL", "bool", False, "integrations",
       "vLLM / SGLang EP: 1: the combine sums each rank's experts of a token first "
       "(ExpertParallel.combine(partial=True): DeepEP normal mode's grouping, fewer rows "
       "back, bits that depend on the world size and placement); 0: one box's bits"),
    _v("SPARKCCL_ENGINE_MIN_BYTES", "bytes", 32 << 20, "integrations",
       "vLLM / SGLang: smallest collective (gathered output / reduce-scatter input, all "
       "ranks) sent to sparkccl; smaller ones stay on the engine's NCCL", lo=0),
    _v("SPARKCCL_ENGINE_TOPOLOGY", "choice", "mesh", "integrations",
       "vLLM / SGLang: topology of the communicators built for the engine's groups",
       choices=("mesh", "ring")),
    _v("SPARKCCL_ENGINE_TRANSPORT", "choice", "auto", "integrations",
       "vLLM / SGLang: transport of the communicators built for the engine's groups",
       choices=("auto", "shm", "tcp", "verbs")),
    _v("SPARKCCL_ENGINE_CAPTURED", "bool", False, "integrations",
       "vLLM / SGLang: 1: calls under CUDA graph capture route like eager ones (the graphs then "
       "replay sparkccl collectives; from the first capture on, eager reduce-scatters copy "
       "their input and mode ce runs as fused); 0: captured calls stay on the engine's NCCL"),
    _v("SPARKCCL_ENGINE_ALL_REDUCE", "bool", True, "integrations",
       "vLLM / SGLang: 1: the tensor-parallel group's all-reduce (bf16 / fp16 / fp32) runs on "
       "sparkccl at every size (captured calls as SPARKCCL_ENGINE_CAPTURED says); 0: it stays "
       "on the engine's custom all-reduce / NCCL"),
    _v("SPARKCCL_TORCH_MIN_BYTES", "bytes", 1 << 20, "torch.distributed backend",
       "smallest all-gather (gathered output) or all-to-all (input) sent through sparkccl; "
       "smaller ones go to the "
       "fallback group, exact either way. Reductions stay in sparkccl at every size unless "
       "SPARKCCL_TORCH_INEXACT_SMALL=1 (docs/TORCH.md)", lo=0),
    _v("SPARKCCL_TORCH_INEXACT_SMALL", "bool", False, "torch.distributed backend",
       "1 (opt-in, inexact): all-reduces and reduce-scatters below SPARKCCL_TORCH_MIN_BYTES "
       "go to the fallback group too (gloo / NCCL, whose sums are not in rank order); 0: "
       "reductions are rank-order exact at every size"),
    _v("SPARKCCL_SELFTEST_TRACEBACK", "bool", False, "selftest",
       "1: print the traceback of a failed self-test"),
    _v("SPARKCCL_EMUNIC_CONFIG", "str", None, "tests",
       "the emulated RoCE NIC (tests/emunic, loaded through SPARKCCL_IBVERBS_LIB): the fake "
       "sysfs root its devices come from"),
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
    worker_spin_us: int  # shm copy workers (SPARKCCL_SHM_WORKER_SPIN_US)
    gpu_direct: bool = True
    allreduce_ll: bool = True
    allreduce_ll_proxy: bool = False
    relay_lead: int = -1
    allreduce_oneshot_bytes: int = DEFAULT_ALLREDUCE_ONESHOT_BYTES


def check_seconds(value, arg: str) -> float:
    """A duration given as an argument: a number > 0 (TypeError / ConfigError naming it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{arg} must be a number of seconds, got {type(value).__name__}")
    if not value > 0:
        raise ConfigError(f"{arg}={value!r}: must be > 0 seconds")
    return float(value)


def _seconds(name: str, arg: str, value, env) -> tuple[float, str]:
    if value is None:
        return lookup(name, env)
    return check_seconds(value, arg), arg


def resolve(*, slot_bytes: int | str | None = None, timeout_s: float | None = None,
            bootstrap_timeout_s: float | None = None, local_ranks: int = 1,
            world: int = 1, env=None) -> Settings:
    """Settings for one communicator: each argument beats its ``SPARKCCL_*`` variable, which
    beats the default. Raises :class:`ConfigError` naming the bad argument or variable."""
    if slot_bytes is None:
        slot = get("SPARKCCL_SLOT_BYTES", env)
    else:
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, (int, str)):
            raise TypeError(f"slot_bytes must be an int (bytes), got {type(slot_bytes).__name__}")
        slot = parse_bytes(slot_bytes, "slot_bytes")
        if slot < MIN_SLOT_BYTES:
            raise ConfigError(f"slot_bytes={slot}: must be at least {MIN_SLOT_BYTES} bytes")
    timeout, _ = _seconds("SPARKCCL_TIMEOUT_S", "timeout_s", timeout_s, env)
    boot, _ = _seconds("SPARKCCL_BOOTSTRAP_TIMEOUT_S", "bootstrap_timeout_s",
                       bootstrap_timeout_s, env)
    if boot is None:
        boot = timeout
    oversub = local_ranks * PROXY_THREADS_PER_RANK > usable_cpus()
    spin = get("SPARKCCL_PROXY_SPIN_US", env)
    worker_spin = get("SPARKCCL_SHM_WORKER_SPIN_US", env)
    roots = get("SPARKCCL_ROOTS", env)
    # Spinning copy workers need cores of their own too: one per connection (mesh: every
    # peer, each root), beside each rank's proxy and caller.
    workers_fit = (local_ranks * (PROXY_THREADS_PER_RANK + max(1, local_ranks - 1) * roots)
                   <= usable_cpus())
    nap = get("SPARKCCL_PROXY_NAP_US", env)
    return Settings(slot_bytes=slot, timeout_s=timeout, bootstrap_timeout_s=boot,
                    roots=roots,
                    rs_up_front=get("SPARKCCL_RS_UP_FRONT", env),
                    spin_us=spin if spin is not None else
                    OVERSUBSCRIBED_SPIN_US if oversub else DEFAULT_SPIN_US,
                    nap_us=nap if nap is not None else
                    OVERSUBSCRIBED_NAP_US if oversub else DEFAULT_NAP_US,
                    check_sizes=get("SPARKCCL_CHECK_SIZES", env),
                    oversubscribed=oversub,
                    worker_spin_us=worker_spin if worker_spin is not None else
                    (spin if spin is not None else DEFAULT_SPIN_US) if workers_fit else 0,
                    gpu_direct=get("SPARKCCL_GPU_DIRECT", env),
                    allreduce_ll=get("SPARKCCL_ALLREDUCE_LL", env),
                    allreduce_ll_proxy=get("SPARKCCL_ALLREDUCE_LL_PROXY", env),
                    relay_lead=get("SPARKCCL_RELAY_LEAD", env),
                    allreduce_oneshot_bytes=oneshot_bytes(
                        get("SPARKCCL_ALLREDUCE_ONESHOT_BYTES", env), world))


def oneshot_bytes(setting: int | None, world: int) -> int:
    """The all-reduce's one-shot limit: the setting, else the default for ``world`` (a
    function of what every rank agrees on, so every rank's is the same)."""
    if setting is not None:
        return setting
    return ALLREDUCE_ONESHOT_BYTES_WORLD2 if world == 2 else DEFAULT_ALLREDUCE_ONESHOT_BYTES


# ---- where each effective setting comes from (sparkccl doctor) ---------------------------

def _show(var: Variable, value) -> str:
    if value is None:
        return var.default_text or "-"
    if var.kind == "bytes":
        return format_bytes(value)
    if var.kind == "bool":
        return "1" if value else "0"
    if var.kind == "list":
        return ",".join(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def effective(arguments: dict[str, object] | None = None, env=None) -> list[tuple[str, str, str]]:
    """``(variable, value, source)`` for every declared variable: source is ``argument``
    (``arguments`` maps variable names to values given on a command line or to the
    constructor), the ``SPARKCCL_*`` or ``NCCL_*`` variable that set it, ``discovered`` /
    ``computed`` for a default chosen at run time, or ``default``. A value that does not
    parse shows as ``INVALID`` with the error as its source."""
    rows = []
    for name, var in VARIABLES.items():
        given = (arguments or {}).get(name)
        if given is not None:
            rows.append((name, _show(var, given), "argument"))
            continue
        try:
            value, source = _lookup(var, env)
        except ConfigError as e:
            rows.append((name, "INVALID", str(e)))
            continue
        if source == "default" and value is None:
            source = "discovered" if var.layer == "fabric" else "computed"
        rows.append((name, _show(var, value), source))
    return rows


def invalid(env=None) -> list[str]:
    """The error of every declared variable whose value does not parse (what a
    communicator would raise as :class:`ConfigError`), for checking before ranks start."""
    return [source for _, value, source in effective(env=env) if value == "INVALID"]


def variables_table() -> str:
    """The markdown table of every declared variable (module docstring, README)."""
    lines = ["| variable | default | read by | meaning |", "| --- | --- | --- | --- |"]
    for var in VARIABLES.values():
        default = var.default_text or _show(var, var.default)
        meaning = var.meaning + (f" (unset: {', '.join(var.nccl)})" if var.nccl else "")
        lines.append(f"| `{var.name}` | {default} | {var.layer} | {meaning} |")
    return "\n".join(lines)


__doc__ = (__doc__ or "") + "\n" + variables_table() + "\n"

if __name__ == "__main__":
    print(variables_table())
