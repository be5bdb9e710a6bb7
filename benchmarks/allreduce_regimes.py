"""All-reduce regimes measured against each other in one run: the data for
``SPARKCCL_ALLREDUCE_ONESHOT_BYTES`` (docs/CONTRACT.md "All-reduce").

    python benchmarks/allreduce_regimes.py --device cuda --world 2    # one GPU (MPS), or one each
    python benchmarks/allreduce_regimes.py --device cuda --world 4 --graph
    python benchmarks/allreduce_regimes.py --device cpu --world 2 --iters 50
    python benchmarks/allreduce_regimes.py --device cuda --world 2 --transport tcp \
        --sizes 8388608,67108864 --iters 50   # the proxy path: the fused two steps

For each size (bytes per rank, bf16) every rank times, on the same communicator: the
all-reduce forced into one shot, forced into two steps (``2step``: the data plane's fused
operation where it has one, docs/PROTOCOL.md "All-reduce"), the two steps forced into two
collectives (``2step x2``: ``fused=False``, the path a plane without the fused operation
takes), and, as floors, one all-gather of the same tensor and one reduce-scatter +
all-gather of the same bytes (``rs+ag``). p50 per call over ``--iters`` calls (the slowest
rank's), host-synchronized after every call (eager latency); ``--graph`` (CUDA) also replays
each all-reduce captured in a CUDA graph, ``--per-graph`` calls per replay, and reports the
p50 per call. Ratios are taken within the run: ``2step/1shot`` > 1 means one shot is faster
at that size; ``2step/rs+ag`` is what fusing the two steps saves against the two
collectives run on their own (the header says whether ``2step`` was fused). On one host
``--transport tcp`` makes the proxy carry every byte (GB10's path between boxes); the default
(shm) runs the CUDA kernels GPU-direct (``SPARKCCL_GPU_DIRECT=0``: through the proxy), where
the two collectives' ``auto`` mode takes the copy engines from 16 MiB and the fused kernel
SMs. Every result of the timed all-reduces is checked bit for bit against the rank-order
reference once, before timing.
"""
from __future__ import annotations

import argparse
import statistics
import time

SIZES = [8 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20,
         8 << 20, 64 << 20]


def _job(rank, world, store, device, topology, sizes, iters, graph, per_graph, transport):
    import torch

    import sparkccl
    from sparkccl import allreduce as A
    from sparkccl.reference import all_reduce_reference, bits, make_input
    dev = torch.device(device)
    if dev.type == "cuda":  # (one GPU: every rank on it, under MPS; else a GPU per rank)
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    rows = []
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, device=dev,
                               topology=topology, transport=transport,
                               timeout_s=120) as comm:
        comm.reduce_scatter(torch.zeros(world * 8, device=dev))  # reduce-scatter buffers
        fused = comm.data_plane.fused_all_reduce
        for size in sizes:
            n = size // 2
            xs = [make_input(size, r, (n,), torch.bfloat16) for r in range(world)]
            x = xs[rank].to(dev)
            want = all_reduce_reference(xs)
            calls = {
                "1shot": lambda: comm.all_reduce(x, regime=A.ONE_SHOT),
                "2step": lambda: comm.all_reduce(x, regime=A.TWO_STEP),
                "2step x2": lambda: comm.all_reduce(x, regime=A.TWO_STEP, fused=False),
                "ag": lambda: comm.all_gather(x),
                "rs+ag": lambda: comm.all_gather(comm.reduce_scatter(
                    x[:n // world * world])),
            }
            for k in ("1shot", "2step", "2step x2"):
                y = calls[k]()
                sync()
                if not (bits(y.cpu()) == want).all():
                    raise AssertionError(f"rank {rank}: {k} {size} B differs from the reference")
            row = {"size": size, "fused": fused}
            for k, fn in calls.items():
                fn()
                sync()
                each = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    each.append(time.perf_counter() - t0)
                row[k] = statistics.median(each)
            if graph and dev.type == "cuda":
                for k in ("1shot", "2step"):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for _ in range(per_graph):
                            calls[k]()
                    g.replay()
                    sync()
                    each = []
                    for _ in range(max(3, iters // per_graph)):
                        t0 = time.perf_counter()
                        g.replay()
                        sync()
                        each.append((time.perf_counter() - t0) / per_graph)
                    row[k + " graph"] = statistics.median(each)
                    del g
            rows.append(row)
        comm.synchronize()
    return rows


def main() -> None:
    from sparkccl.localrun import check, run_ranks
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--topology", default="mesh", choices=("mesh", "ring"))
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--graph", action="store_true", help="CUDA: also replay captured graphs")
    ap.add_argument("--per-graph", type=int, default=20)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--sizes", default=None,
                    help="comma-separated bytes per rank (default: the list up to --max-bytes)")
    ap.add_argument("--transport", default="auto", choices=("auto", "shm", "tcp", "verbs"),
                    help="tcp / verbs on one host: the proxy carries every byte (GB10's path)")
    a = ap.parse_args()
    sizes = ([int(v) for v in a.sizes.split(",")] if a.sizes
             else [s for s in SIZES if s <= a.max_bytes])
    per_rank = check(run_ranks(_job, a.world, args=(a.device, a.topology, sizes, a.iters,
                                                    a.graph, a.per_graph, a.transport),
                               timeout_s=1800))
    keys = [k for k in per_rank[0][0] if k not in ("size", "fused")]
    fused = "fused (one operation)" if per_rank[0][0]["fused"] else "two collectives"
    print(f"# all-reduce regimes: {a.device} world {a.world} {a.topology} transport "
          f"{a.transport}, bf16, p50 per call (us, slowest rank) over {a.iters} calls; "
          f"2step: {fused}")
    print("bytes/rank " + " ".join(f"{k:>12}" for k in keys) + "  2step/1shot  2step/rs+ag")
    for i, row in enumerate(per_rank[0]):
        t = {k: max(r[i][k] for r in per_rank) for k in keys}
        print(f"{row['size']:>10} " + " ".join(f"{t[k] * 1e6:12.1f}" for k in keys)
              + f"  {t['2step'] / t['1shot']:11.2f}  {t['2step'] / t['rs+ag']:11.2f}")


if __name__ == "__main__":
    main()
