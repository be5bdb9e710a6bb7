"""World-2 GPU-direct collectives with both ranks on ONE GPU (one process, one stream each).

For when only a one-GPU machine is at hand: both ranks' traffic crosses the same link, so a
collective of per-rank slice L moves 2 L down and 2 L up that link, twice the per-link
traffic of the two-GPU case. What it shows is how well a data-plane variant overlaps the
two directions of the link, against the link's own duplex figures from
``benchmarks/pcie_duplex.py``; it is no stand-in for the two-GPU bench against NCCL.

    python benchmarks/direct_one_gpu.py [--mib 16 64 128] [--iters 5] [--blocks 66,65]
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

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sparkccl.config import DIRECT_ENGINES as DIRECT_MODES  # noqa: E402
from tests.test_cuda_dataplane import World  # noqa: E402  (the in-process world of the tests)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--blocks", default="66,65", help="publish,wait blocks per rank")
    args = ap.parse_args()
    W = 2
    npub, nwait = (int(v) for v in args.blocks.split(","))
    max_slice = max(args.mib) << 20
    with World("cuda", "mesh", W, 2, max_slice=max_slice, timeout_s=60.0, direct=True) as w:
        for dp in w.dps:
            dp.max_direct_blocks, dp.max_direct_wait_blocks = npub, nwait
            dp.max_wait_blocks = nwait
        dev = w.be.device
        print(f"# {torch.cuda.get_device_name(dev)}: world 2 on one GPU, mesh, GPU-direct, "
              f"blocks {npub},{nwait}; median of {args.iters}; link GB/s = bytes over the "
              "one link (both ranks, both directions) / time")
        print(f"{'op':>4} {'mode':>5} {'slice':>8} {'ms':>8} {'link GB/s':>10}")
        for mib in args.mib:
            L = mib << 20
            x = [torch.randint(0, 255, (L,), dtype=torch.uint8, device=dev) for _ in range(W)]
            out = [torch.empty(W * L, dtype=torch.uint8, device=dev) for _ in range(W)]
            xr = [torch.randn(W * L // 2, device=dev).to(torch.bfloat16).view(torch.uint8)
                  for _ in range(W)]
            outr = [torch.empty(L, dtype=torch.uint8, device=dev) for _ in range(W)]
            for mode in DIRECT_MODES:
                for dp in w.dps:
                    dp.direct_mode = mode
                for op in ("ag", "rs"):
                    def once():
                        w.issue(op, x if op == "ag" else xr, out if op == "ag" else outr, L)
                        w.be.sync()
                    once()
                    ts = []
                    for _ in range(args.iters):
                        t0 = time.perf_counter()
                        once()
                        ts.append(time.perf_counter() - t0)
                    t = statistics.median(ts)
                    if op == "ag":  # the bits, once per mode and size
                        want = torch.cat(x)
                        assert all(torch.equal(o, want) for o in out), f"all_gather {mode} wrong"
                    print(f"{op:>4} {mode:>5} {mib:6d}Mi {t * 1e3:8.3f} {4 * L / t / 1e9:10.1f}")
        w.sync()
        w.healthy()


if __name__ == "__main__":
    main()
