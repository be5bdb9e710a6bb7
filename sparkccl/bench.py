"""`sparkccl bench`: nccl-tests-style bandwidth, with torch.distributed measured in the same run.

Columns follow nccl-tests: size is the whole buffer (the gathered output of an
all-gather, the input of a reduce-scatter), algbw = size / time, busbw = algbw x
(world - 1) / world. The baseline is torch.distributed's gloo backend on the same ranks,
the same sizes and dtypes, in the same processes; the ratio column is baseline time /
sparkccl time (above 1: sparkccl is faster).
"""
from __future__ import annotations

import time


def _sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4 if hi // lo >= 64 else 2
    return out


def _time_calls(fn, iters: int, barrier) -> float:
    fn()  # warm-up: first-use allocations, page faults
    barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _bench_rank(rank, world, store, topology, transport, sizes, iters, baseline):
    import warnings

    import torch
    import torch.distributed as dist

    import sparkccl

    # torch 2.13 renames these; the old names keep working on older torch too.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

    rows = []
    pg = None
    if baseline:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        pg = dist.group.WORLD
    barrier = (lambda: dist.barrier(pg)) if pg is not None else (lambda: None)
    dtype = torch.bfloat16
    esize = torch.finfo(dtype).bits // 8
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology=topology,
                               transport=transport, slot_bytes=max(sizes)) as comm:
        for size in sizes:
            n = size // esize
            x_ag = torch.ones(n // world, dtype=dtype)
            out = torch.empty(n // world * world, dtype=dtype)
            x_rs = torch.ones(n // world * world, dtype=dtype)
            out_rs = torch.empty(n // world, dtype=dtype)
            t = {"ag": _time_calls(lambda: comm.all_gather(x_ag, out=out), iters, barrier),
                 "rs": _time_calls(lambda: comm.reduce_scatter(x_rs, out=out_rs), iters, barrier)}
            if pg is not None:
                t["ag_base"] = _time_calls(
                    lambda: dist.all_gather_into_tensor(out, x_ag, group=pg), iters, barrier)
                try:
                    t["rs_base"] = _time_calls(
                        lambda: dist.reduce_scatter_tensor(out_rs, x_rs, group=pg), iters, barrier)
                except (RuntimeError, ValueError, NotImplementedError) as e:
                    t["rs_base"] = None
                    t["rs_base_why"] = str(e).splitlines()[0][:80]
            rows.append((size, t))
    if pg is not None:
        dist.destroy_process_group()
    return rows


def run_bench(world: int = 4, topology: str = "mesh", transport: str = "shm", device: str = "cpu",
              min_bytes: int = 1 << 20, max_bytes: int = 64 << 20, iters: int = 5,
              baseline: bool = True) -> int:
    from .testing import run_ranks

    if device != "cpu":
        print(f"bench: device {device!r} is not available yet (only cpu)")
        return 2
    align = 16 * world
    sizes = [max(align, s // align * align) for s in _sizes(min_bytes, max_bytes)]
    print(f"sparkccl bench: world {world}, topology {topology}, transport {transport}, "
          f"device {device}, bf16, {iters} iterations per size"
          + (", baseline: torch.distributed gloo (same run)" if baseline else ""))
    results = run_ranks(_bench_rank, world, args=(topology, transport, sizes, iters, baseline),
                        timeout_s=1800)
    failed = [r for r in results if not r.ok]
    if failed:
        for r in failed:
            print(f"rank {r.rank} failed: {r.error_type}: {r.message}")
        return 1
    per_rank = [r.value for r in results]
    factor = (world - 1) / world
    for key, name in (("ag", "all_gather"), ("rs", "reduce_scatter")):
        print(f"\n{name}")
        cols = f"{'time(us)':>10} {'algbw':>8} {'busbw':>8}"
        print(f"{'size':>12} {cols}" + (f"   | {cols} {'ratio':>7}  (gloo)" if baseline else ""))
        for i, (size, _) in enumerate(per_rank[0]):
            # A call ends when its slowest rank has its result.
            t = max(v[i][1][key] for v in per_rank)
            line = f"{size:>12} {t * 1e6:>10.1f} {size / t / 1e9:>8.3f} {size / t / 1e9 * factor:>8.3f}"
            if baseline:
                bts = [v[i][1].get(key + "_base") for v in per_rank]
                if any(b is None for b in bts):
                    why = per_rank[0][i][1].get(key + "_base_why", "unsupported")
                    line += f"   | gloo n/a ({why})"
                else:
                    b = max(bts)
                    line += (f"   | {b * 1e6:>10.1f} {size / b / 1e9:>8.3f} "
                             f"{size / b / 1e9 * factor:>8.3f} {b / t:>6.2f}x")
            print(line)
    return 0
