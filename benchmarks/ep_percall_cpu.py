"""Per-call time of ExpertParallel.dispatch (the torch path vs the native CPU pack / unpack,
``ep._native_cpu``) and combine on CPU ranks over shm, no NIC emulation: slowest rank, median of 7;
512 tokens, hidden 2048 bf16, top-4 of 8 experts per rank, uniform routing, world 1 and 2.

    python3 benchmarks/ep_percall_cpu.py
"""
from __future__ import annotations

import sys
import time

import torch

from sparkccl.localrun import check, run_ranks


def job(rank, world, store):
    import torch.distributed as dist

    import sparkccl
    from sparkccl.ep_reference import make_ep_input, run_experts
    T, H, K, E = 512, 2048, 4, 8 * world
    inp = make_ep_input(11, rank, tokens=T, hidden=H, topk=K, num_experts=E, world=world)
    g = torch.Generator().manual_seed(1000 + rank)
    inp["topk_idx"] = torch.rand(T, E, generator=g).topk(K).indices
    res = {}
    with sparkccl.Communicator(store=dist.PrefixStore("pc", store), rank=rank, world_size=world,
                               timeout_s=60) as comm:
        for mode in ("high_throughput", "low_latency"):
            ep = sparkccl.ExpertParallel(comm, num_experts=E, hidden=H, max_tokens=T, mode=mode)
            for native in (False, True):
                ep._native_cpu = native
                recv, h = ep.dispatch(inp["x"], inp["topk_idx"], inp["topk_weights"])
                out = run_experts(ep, recv)
                td, tc = [], []
                for _ in range(7):
                    t = time.perf_counter()
                    recv, h = ep.dispatch(inp["x"], inp["topk_idx"], inp["topk_weights"])
                    td.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    ep.combine(out, h, shared=inp["shared"])
                    tc.append(time.perf_counter() - t)
                res[(mode, native)] = (sorted(td)[3] * 1e3, sorted(tc)[3] * 1e3)
    return res



def main() -> int:
    for W in (1, 2):
        r = check(run_ranks(job, W, timeout_s=300))
        for key in r[0]:
            d, c = (max(x[key][i] for x in r) for i in (0, 1))
            print(f"world {W} {key[0]:<16} {'native' if key[1] else 'torch ':<6} "
                  f"dispatch {d:7.2f} ms  combine {c:7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
