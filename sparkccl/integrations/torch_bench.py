"""`sparkccl bench --api torch`: the bench's collectives through torch.distributed with the
sparkccl backend, timed like the direct API (sparkccl/bench.py), and the overhead of the
integration layer printed beside it (docs/TORCH.md)."""
from __future__ import annotations


def torch_api_rank(rank, world, store, topology, transport, device, sizes, iters):
    """One rank: ``dist.all_gather_into_tensor`` / ``dist.reduce_scatter_tensor`` on a
    "sparkccl" group, the same buffers and timing as the direct API's rows."""
    import warnings

    import torch.distributed as dist

    from ..bench_timing import buffers, setup_device, time_calls, timer
    from .torch_backend import Options

    # torch 2.13 renames these; the old names keep working on older torch too.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    dev = setup_device(device, rank)
    sync = timer(dev)
    dist.init_process_group("sparkccl", store=store, rank=rank, world_size=world,
                            pg_options=Options(topology=topology, transport=transport,
                                               slot_bytes=max(sizes), min_bytes=0))
    pg = dist.group.WORLD
    rows = []
    try:
        for size in sizes:
            x_ag, out, x_rs, out_rs = buffers(size, world, dev)
            rows.append((size, {
                "ag": time_calls(lambda: dist.all_gather_into_tensor(out, x_ag), iters,
                                        dist.barrier, sync),
                "rs": time_calls(lambda: dist.reduce_scatter_tensor(out_rs, x_rs), iters,
                                        dist.barrier, sync)}))
        declined = dict(pg.declined)
    finally:
        dist.destroy_process_group()
    return {"rows": rows, "declined": declined}


def print_overhead(direct: list, via_torch: list, sizes: list[int]) -> None:
    """The table: the slowest rank's time per call, direct API vs torch.distributed."""
    from ..bench_timing import slowest

    declined = [v["declined"] for v in via_torch if v["declined"]]
    print("\nsparkccl through torch.distributed (backend \"sparkccl\") vs the direct API"
          + (f" -- calls sent to the fallback: {declined[0]}" if declined else ""))
    for key, title in (("ag", "all_gather_into_tensor"), ("rs", "reduce_scatter_tensor")):
        if slowest(direct, 0, key) is None:  # (not among the bench's --collective)
            continue
        print(f"\n{title}")
        print(f"{'size':>12} {'direct(us)':>11} {'torch(us)':>11} {'overhead':>9}")
        for i, size in enumerate(sizes):
            d, t = slowest(direct, i, key), slowest(via_torch, i, key)
            print(f"{size:>12} {d * 1e6:>11.1f} {t * 1e6:>11.1f} {(t / d - 1) * 100:>8.1f}%")
