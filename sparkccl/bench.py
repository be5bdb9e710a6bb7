"""`sparkccl bench`: nccl-tests-style bandwidth, with torch.distributed measured in the same run.

Columns follow nccl-tests: size is the whole buffer (the gathered output of an
all-gather, the input of a reduce-scatter), algbw = size / time, busbw = algbw x
(world - 1) / world. Baselines run on the same ranks, sizes and dtype in the same
invocation: gloo on CPU; on CUDA, NCCL three ways (default, P2P off = through host
shared memory, P2P and SHM off = sockets), each in fresh processes because NCCL reads
its environment once. The ratio column is baseline time / sparkccl time (above 1:
sparkccl is faster). ``--collective`` picks the tables: all_gather and reduce_scatter by
default, all_reduce (busbw = algbw x 2 (world - 1) / world, as nccl-tests), and ep (one
MoE layer's dispatch + combine per token count, sparkccl/ep_bench.py). ``--plot FILE.png``
draws bus bandwidth against size for sparkccl and each baseline, one panel per collective
(matplotlib: ``pip install 'sparkccl[plot]'``).
"""
from __future__ import annotations

from dataclasses import dataclass

from .bench_timing import buffers, setup_device, slowest, time_calls, timer

CUDA_BASELINES = (
    ("nccl", {}),
    ("nccl-p2p-off", {"NCCL_P2P_DISABLE": "1"}),
    ("nccl-sockets", {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}),
)
CPU_BASELINES = (("gloo", {}),)
# --collective name -> (key in the timing rows, busbw factor of the world size)
SIZED = {"all_gather": ("ag", lambda w: (w - 1) / w),
         "reduce_scatter": ("rs", lambda w: (w - 1) / w),
         "all_reduce": ("ar", lambda w: 2 * (w - 1) / w)}
COLLECTIVES = (*SIZED, "ep")
DEFAULT_COLLECTIVES = ("all_gather", "reduce_scatter")
# NVLink multicast stays off on shared GPU hosts.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def _sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4 if hi // lo >= 64 else 2
    return out


def _progress(rank: int, label: str, done: int, total: int) -> None:
    if rank == 0:  # every rank times the same sizes
        from .localrun import report_progress
        report_progress((label, done, total, "sizes"))


def _sparkccl_rank(rank, world, store, topology, transport, device, sizes, iters,
                   collectives=DEFAULT_COLLECTIVES):
    import sparkccl

    dev = setup_device(device, rank)
    sync = timer(dev)
    rows = []
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology=topology,
                               transport=transport, device=dev,
                               slot_bytes=max(sizes)) as comm:
        def barrier():
            comm.all_gather(barrier_token)
            comm.synchronize() if dev.type == "cuda" else None
        import torch
        barrier_token = torch.zeros(16, dtype=torch.uint8, device=dev)
        for size in sizes:
            x_ag, out, x_rs, out_rs = buffers(size, world, dev)
            calls = {"ag": lambda: comm.all_gather(x_ag, out=out),
                     "rs": lambda: comm.reduce_scatter(x_rs, out=out_rs),
                     "ar": lambda: comm.all_reduce(x_rs, out=out)}
            t = {}
            for name in collectives:
                key = SIZED[name][0]
                t[key] = time_calls(calls[key], iters, barrier, sync, t, key + "_host")
            rows.append((size, t))
            _progress(rank, "sparkccl", len(rows), len(sizes))
        stats = comm.proxy_stats()
        # SPARKCCL_GPU_STAMPS: how well the GPU's stamps sit on the proxy's clock
        stats["clock_error_ns"] = comm.data_plane.clock_error_ns  # (world >= 2: a plane)
    return {"rows": rows, "proxy": stats}


def _baseline_rank(rank, world, store, backend, device, sizes, iters, label=None,
                   collectives=DEFAULT_COLLECTIVES):
    import warnings

    import torch.distributed as dist

    # torch 2.13 renames these; the old names keep working on older torch too.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    dev = setup_device(device, rank)
    sync = timer(dev)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            device_id=dev if dev.type == "cuda" else None)
    rows = []
    try:
        def barrier():
            dist.barrier()
        for size in sizes:
            x_ag, out, x_rs, out_rs = buffers(size, world, dev)
            calls = {"ag": lambda: dist.all_gather_into_tensor(out, x_ag),
                     "rs": lambda: dist.reduce_scatter_tensor(out_rs, x_rs),
                     "ar": lambda: dist.all_reduce(out)}  # (in place: on a copy of the input)
            out.copy_(x_rs)
            t = {}
            for name in collectives:
                key = SIZED[name][0]
                try:
                    t[key] = time_calls(calls[key], iters, barrier, sync, t, key + "_host")
                except (RuntimeError, ValueError, NotImplementedError) as e:
                    t[key] = None  # (gloo has no reduce_scatter_tensor)
                    t[key + "_why"] = str(e).splitlines()[0][:60]
            rows.append((size, t))
            _progress(rank, label or backend, len(rows), len(sizes))
    finally:
        dist.destroy_process_group()
    return {"rows": rows}


def _us(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e6:.1f}"


def _run(fn, world, args, env, what, runner=None, progress=None):
    from .localrun import run_ranks
    if runner is not None:  # e.g. ranks in network namespaces (benchmarks/netns_bench.py)
        results = runner(fn, args, env)
    else:
        results = run_ranks(fn, world, args=args, timeout_s=1800, env=env, progress=progress)
    failed = [r for r in results if not r.ok]
    if failed:
        for r in failed:
            print(f"{what}: rank {r.rank} failed: {r.error_type}: {r.message}")
        return None
    return [r.value for r in results]


def baselines_for(device: str, baseline: bool = True, only: list[str] | None = None) -> tuple:
    """The (name, extra environment) baselines to run; ``only`` picks some by name."""
    have = (CUDA_BASELINES if device == "cuda" else CPU_BASELINES) if baseline else ()
    if not only:
        return have
    unknown = set(only) - {b for b, _ in have}
    if unknown:
        raise ValueError(f"unknown baseline {', '.join(sorted(unknown))} for device {device} "
                         f"(have: {', '.join(b for b, _ in have) or 'none'})")
    return tuple(b for b in have if b[0] in only)


@dataclass(frozen=True)
class EpShape:
    """``--collective ep``'s MoE layer: token counts per rank (one row each), hidden size,
    top-k, experts per rank, ExpertParallel mode."""
    tokens: tuple = (128, 1024)
    hidden: int = 2048
    topk: int = 8
    experts_per_rank: int = 8
    mode: str = "high_throughput"


def run_bench(world: int = 4, topology: str = "mesh", transport: str = "shm", device: str = "cpu",
              min_bytes: int = 1 << 20, max_bytes: int = 64 << 20, iters: int = 5,
              baseline: bool = True, runner=None, only: list[str] | None = None,
              plot: str | None = None, api: str = "direct",
              collectives: tuple = DEFAULT_COLLECTIVES, ep: EpShape = EpShape()) -> int:
    """``runner(fn, args, env) -> [RankResult]`` starts the ranks (default: local processes
    through sparkccl.localrun.run_ranks). ``only``: the names of the baselines to run (default:
    all of the device's). ``plot``: write a bus bandwidth plot (PNG) there. ``api="torch"``:
    also time the same calls through torch.distributed (backend "sparkccl").
    ``collectives``: of :data:`COLLECTIVES`; ``"ep"`` runs the MoE layer ``ep``."""
    from .progress import Progress
    progress = Progress("bench")
    try:
        sized = tuple(c for c in COLLECTIVES if c in collectives and c != "ep")
        rc = 0
        if sized:
            rc = _bench(world, topology, transport, device, min_bytes, max_bytes, iters,
                        baseline, runner, only, plot, api, progress, sized)
        if "ep" in collectives and rc == 0:
            rc = _bench_ep(world, topology, transport, device, iters, baseline, runner, only,
                           progress, ep)
        return rc
    finally:
        progress.close()


def _bench_ep(world, topology, transport, device, iters, baseline, runner, only, progress,
              shape: EpShape) -> int:
    from . import ep_bench
    E = shape.experts_per_rank * world
    baselines = baselines_for(device, baseline, only)
    print(f"\nsparkccl bench ep: world {world}, topology {topology}, transport {transport}, "
          f"device {device}; one MoE layer: tokens per rank {', '.join(map(str, shape.tokens))}, "
          f"hidden {shape.hidden} bf16, top-{shape.topk} of {E} experts "
          f"({shape.experts_per_rank} per rank), {shape.mode}; median of {iters} calls, "
          f"slowest rank; baselines in the same run: ag+rs (sparkccl), "
          f"{', '.join(b for b, _ in baselines) or 'no torch.distributed'}")
    env = dict(SAFE_ENV) if device == "cuda" else {}
    layer = (tuple(shape.tokens), shape.hidden, shape.topk, E, iters)
    ours = _run(ep_bench.sparkccl_rank, world,
                (topology, transport, device, *layer, shape.mode), env, "sparkccl ep", runner,
                progress)
    if ours is None:
        return 1
    base = {}
    for name, extra in baselines:
        backend = "nccl" if name.startswith("nccl") else "gloo"
        got = _run(ep_bench.baseline_rank, world, (backend, device, *layer),
                   {**env, **extra}, name, runner, progress)
        if got is not None:
            base[name] = got
    ep_bench.print_table(ours, base, shape.hidden)
    exact = all(r["exact"] and r["partial_exact"] for v in ours for r in v)
    return 0 if exact else 1


def _bench(world, topology, transport, device, min_bytes, max_bytes, iters, baseline, runner,
           only, plot, api, progress, collectives=DEFAULT_COLLECTIVES) -> int:
    align = 16 * world
    sizes = [max(align, s // align * align) for s in _sizes(min_bytes, max_bytes)]
    baselines = baselines_for(device, baseline, only)
    print(f"sparkccl bench: world {world}, topology {topology}, transport {transport}, "
          f"device {device}, bf16, {iters} iterations per size; baselines in the same run: "
          f"{', '.join(b for b, _ in baselines) or 'none'}")
    env = dict(SAFE_ENV) if device == "cuda" else {}
    ours = _run(_sparkccl_rank, world, (topology, transport, device, sizes, iters, collectives),
                env, "sparkccl", runner, progress)
    if ours is None:
        return 1
    via_torch = None
    if api == "torch":  # the same calls through torch.distributed (docs/TORCH.md)
        from .integrations.torch_bench import torch_api_rank
        via_torch = _run(torch_api_rank, world, (topology, transport, device, sizes, iters), env,
                         "sparkccl via torch.distributed", runner, progress)
        if via_torch is None:
            return 1
    base = {}
    for name, extra in baselines:
        backend = "nccl" if name.startswith("nccl") else "gloo"
        got = _run(_baseline_rank, world, (backend, device, sizes, iters, name, collectives),
                   {**env, **extra}, name, runner, progress)
        if got is not None:
            base[name] = got
    busbw: dict[str, dict[str, list]] = {}  # collective -> series name -> GB/s per size
    for title in collectives:
        key, factor_of = SIZED[title]
        factor = factor_of(world)
        series = busbw[title] = {"sparkccl": []}
        print(f"\n{title}")
        head = f"{'size':>12} {'time(us)':>10} {'host(us)':>9} {'algbw':>8} {'busbw':>8}"
        for name in base:
            head += f" | {name + ' busbw':>18} {'ratio':>6} {'host(us)':>9}"
        print(head)
        for i, size in enumerate(sizes):
            t = slowest(ours, i, key)
            series["sparkccl"].append(size / t / 1e9 * factor)
            h = slowest(ours, i, key + "_host")
            line = (f"{size:>12} {t * 1e6:>10.1f} {_us(h):>9} {size / t / 1e9:>8.3f} "
                    f"{size / t / 1e9 * factor:>8.3f}")
            for name, per_rank in base.items():
                b = slowest(per_rank, i, key)
                series.setdefault(name, []).append(None if b is None else
                                                   size / b / 1e9 * factor)
                if b is None:
                    line += f" | {'n/a':>18} {'':>6} {'':>9}"
                else:
                    line += (f" | {size / b / 1e9 * factor:>18.3f} {b / t:>5.2f}x "
                             f"{_us(slowest(per_rank, i, key + '_host')):>9}")
            print(line)
    print("\nhost(us): p50 of each call's own host time until it returns (the enqueue on "
          "CUDA, the whole call on CPU), slowest rank")
    if via_torch is not None:
        from .integrations.torch_bench import print_overhead
        print_overhead(ours, via_torch, sizes)
    stats = ours[0]["proxy"]
    if stats.get("publish_samples"):
        if stats.get("clock_error_ns") is not None:
            print(f"\nGPU publish stamps (SPARKCCL_GPU_STAMPS): the GPU clock on the proxy's "
                  f"within +-{stats['clock_error_ns'] / 1e3:.1f} us (half the calibration's "
                  "shortest round trip)", end="")
        print(f"\nproxy (rank 0): data plane publish -> first write posted: p50 "
              f"{stats['publish_p50_ns'] / 1e3:.1f} us, p99 {stats['publish_p99_ns'] / 1e3:.1f} us "
              f"over {stats['publish_samples']} pieces")
    if stats.get("first_samples"):
        print(f"proxy (rank 0): the same for each collective's piece 0 (no earlier piece of it "
              f"queued first): p50 {stats['first_p50_ns'] / 1e3:.1f} us, p99 "
              f"{stats['first_p99_ns'] / 1e3:.1f} us over {stats['first_samples']} collectives; "
              f"of it ring entry consumed -> posted: p50 {stats['first_delay_p50_ns'] / 1e3:.1f} "
              f"us, p99 {stats['first_delay_p99_ns'] / 1e3:.1f} us")
    if stats.get("delay_samples"):
        print("\n" + proxy_delay_line(stats))
    if stats.get("gpu_pieces"):
        print(f"\nGPU-direct (rank 0): the GPU wrote {stats['gpu_pieces']} stream pieces straight "
              f"into the peers' mapped regions; the proxy posted {stats.get('writes', 0)} writes "
              "(relays, and collectives not sent directly)")
    if plot:
        title = (f"world {world}, {topology}, transport {transport}, device {device}, bf16")
        plot_busbw(plot, sizes, busbw, title)
        print(f"\nplot: {plot}")
    return 0


PLOT_HINT = "--plot needs matplotlib: pip install 'sparkccl[plot]' (or: pip install matplotlib)"


def proxy_delay_line(stats: dict) -> str:
    """Rank 0's ring entry consumed -> first write posted, from ``proxy_stats()`` (where it
    has ``delay_samples``), as one line (sparkccl bench, benchmarks/decode_latency.py)."""
    return (f"proxy (rank 0): ring entry consumed -> first write posted: p50 "
            f"{stats['delay_p50_ns'] / 1e3:.1f} us, p99 {stats['delay_p99_ns'] / 1e3:.1f} us "
            f"over {stats['delay_samples']} entries")


def have_matplotlib() -> bool:
    import importlib.util
    return importlib.util.find_spec("matplotlib") is not None


def plot_busbw(path: str, sizes: list[int], busbw: dict[str, dict[str, list]],
               title: str) -> None:
    """Bus bandwidth (GB/s) against size (log2 axis), one panel per collective, one line
    per series (sparkccl, each baseline), as nccl-tests results are usually plotted."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(PLOT_HINT) from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    from .config import format_bytes
    fig, axes = plt.subplots(1, len(busbw), figsize=(6 * len(busbw), 4.5), squeeze=False)
    for ax, (collective, series) in zip(axes[0], busbw.items()):
        for name, values in series.items():
            pts = [(s, v) for s, v in zip(sizes, values) if v is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([format_bytes(s) for s in sizes], rotation=45)
        ax.set_xlabel("size (whole buffer)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(collective)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"sparkccl bench: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

