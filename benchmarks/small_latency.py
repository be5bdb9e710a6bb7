"""GPU time per small collective, world 2 with both ranks in ONE process on one GPU.

Small collectives are latency, not bytes: what a call costs the GPU is the chain of
hand-offs over pinned memory that its 8 pieces go through (benchmarks/sysmem_sync.cu times
each step). This times ``--calls`` collectives issued back to back by both ranks (host
issue stays ahead of the GPU) and reports the GPU time per collective, per engine:

* ``fused``: GPU-direct, one kernel per collective (SPARKCCL_DIRECT_MODE=fused);
* ``proxy``: the proxy path (the GPU publishes into its own region, the proxy's copy
  workers move the bytes; the only path between GB10 boxes).

Every output of the last round is checked bit for bit (all-gather against the inputs,
reduce-scatter against the rank-order fp32 reference). Two ranks share the link here, so
this is no stand-in for the two-GPU ratios against NCCL; it tells engine variants apart.

    python benchmarks/small_latency.py [--kib 4 64 256 1024] [--calls 50] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# Both ranks' streams live in this one process: give each its own hardware queue (as the
# tests do, tests/conftest.py), or a spinning wait of one rank can hold back the other's work.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sparkccl.dataplane import engines as EN  # noqa: E402
from sparkccl.reference import reduce_scatter_reference  # noqa: E402
from tests.test_cuda_dataplane import World  # noqa: E402  (the in-process world of the tests)


def run(engine: str, kib: list[int], calls: int, rounds: int, backend: str = "cuda") -> list:
    W = 2
    max_slice = max(kib) << 10
    rows = []
    # As a Communicator runs by default (fail-stop: no sccl_poison launch per collective).
    on_failure = "stop"
    with World(backend, "mesh", W, 2, max_slice=max_slice, timeout_s=60.0,
               on_failure=on_failure,
               direct=engine != "proxy", mode="fused" if engine != "proxy" else None) as w:
        dev = w.be.device
        cuda = backend == "cuda"
        for k in kib:
            L = k << 10
            gen = torch.Generator().manual_seed(k)
            xs = [torch.randint(0, 255, (L,), dtype=torch.uint8, generator=gen) for _ in range(W)]
            x = [t.to(dev) for t in xs]
            out = [torch.empty(W * L, dtype=torch.uint8, device=dev) for _ in range(W)]
            xr_cpu = [torch.randn(W * L // 2, generator=gen).to(torch.bfloat16) for _ in range(W)]
            xr = [t.to(dev).view(torch.uint8) for t in xr_cpu]
            outr = [torch.empty(L, dtype=torch.uint8, device=dev) for _ in range(W)]
            for op in ("ag", "rs"):
                def burst(n: int) -> float:
                    t0 = time.perf_counter()
                    if cuda:
                        starts = [torch.cuda.Event(enable_timing=True) for _ in range(W)]
                        ends = [torch.cuda.Event(enable_timing=True) for _ in range(W)]
                        for r in range(W):
                            with w.be.on(r):
                                starts[r].record()
                    for _ in range(n):
                        w.issue(op, x if op == "ag" else xr, out if op == "ag" else outr, L)
                    if cuda:
                        for r in range(W):
                            with w.be.on(r):
                                ends[r].record()
                    w.be.sync()
                    if not cuda:  # (the CPU emulation, to try the script: wall time)
                        return (time.perf_counter() - t0) / n
                    # a collective ends when both ranks have it: the later stream's time
                    return max(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3 / n
                burst(3)  # warm-up: the launch plans of this shape
                t = statistics.median(burst(calls) for _ in range(rounds))
                if op == "ag":
                    want = torch.cat(xs).numpy()
                    ok = all(np.array_equal(o.cpu().numpy(), want) for o in out)
                else:
                    ok = all(np.array_equal(outr[r].cpu().numpy(),
                                            reduce_scatter_reference(xr_cpu, r))
                             for r in range(W))
                rows.append((engine, op, k, t, ok))
        w.sync()
        w.healthy()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kib", type=int, nargs="+", default=[4, 64, 256, 1024])
    ap.add_argument("--engines", nargs="+", default=["fused", "proxy"],
                    choices=["fused", "proxy"])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--wait-bytes", type=int, default=EN.WAIT_BYTES_PER_BLOCK,
                    help="bytes per consumer block (the engines' WAIT_BYTES_PER_BLOCK), "
                    "to try other block counts")
    ap.add_argument("--backend", default="cuda", choices=["cuda", "emu"],
                    help="emu: the CPU emulation of the tests (to try the script, no timing)")
    args = ap.parse_args()
    EN.WAIT_BYTES_PER_BLOCK = args.wait_bytes  # (read at every planning)
    name = torch.cuda.get_device_name() if args.backend == "cuda" else "CPU emulation"
    print(f"# {name}: world 2 in one process, mesh, bf16; GPU us per "
          f"collective over {args.calls} back to back, median of {args.rounds}; KiB per rank; "
          f"{args.wait_bytes >> 10} KiB per consumer block")
    print(f"{'engine':>7} {'op':>3} {'KiB':>6} {'us':>8}  exact")
    bad = False
    for engine in args.engines:
        for engine_, op, k, t, ok in run(engine, args.kib, args.calls, args.rounds, args.backend):
            print(f"{engine_:>7} {op:>3} {k:6d} {t * 1e6:8.1f}  {'yes' if ok else 'NO'}")
            bad |= not ok
    if bad:
        raise SystemExit("small_latency: an output differs from its reference")


if __name__ == "__main__":
    main()
