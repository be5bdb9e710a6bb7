"""How ``sparkccl bench`` times a collective, shared by the direct API's rows
(:mod:`sparkccl.bench`) and the torch.distributed rows
(:mod:`sparkccl.integrations.torch_bench`), so that both are timed the same way."""
from __future__ import annotations

import time


def setup_device(device: str, rank: int):
    import torch
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def timer(device):
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    return sync


def time_calls(fn, iters: int, barrier, sync, host: dict | None = None,
                key: str = "") -> float:
    """Mean time per call; ``host[key]``: the p50 of each call's own host time (until it
    returns: on CUDA the enqueue, on CPU the whole call), in seconds."""
    fn()  # warm-up: first-use allocations, page faults, kernel compilation
    sync()
    barrier()
    each = []
    clock = time.perf_counter
    t0 = clock()
    for _ in range(iters):
        t = clock()
        fn()
        each.append(clock() - t)
    sync()
    if host is not None:
        host[key] = sorted(each)[len(each) // 2]
    return (clock() - t0) / iters


def buffers(size: int, world: int, device):
    import torch
    dtype = torch.bfloat16
    n = size // 2 // world
    return (torch.ones(n, dtype=dtype, device=device),
            torch.empty(n * world, dtype=dtype, device=device),
            torch.ones(n * world, dtype=dtype, device=device),
            torch.empty(n, dtype=dtype, device=device))


def slowest(per_rank: list, i: int, key: str):
    """A call ends when its slowest rank has its result."""
    vals = [v["rows"][i][1].get(key) for v in per_rank]
    return None if any(v is None for v in vals) else max(vals)
