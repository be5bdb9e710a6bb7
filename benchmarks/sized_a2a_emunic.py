"""A sized all-to-all (``Communicator.all_to_all(x, sized=True)``: each block says how many
of its bytes carry data) through the emulated RoCE NIC, its time against the line rate of
the bytes the proxies post, on meshes and switchless rings (docs/PROTOCOL.md "Sized
blocks"). What it shows: on a ring the relays cut the parts they forward at the length the
origin's call entry carries, so a block a quarter full costs a quarter of the wire on every
hop, as on a mesh.

Every rank's block for every peer holds ``--capacity`` bytes of which ``--fill`` carry data
(the header's count). Per row: the slowest rank's median time, the bytes every rank's proxy
posted for one call (own blocks and relayed parts), ``sent ms`` the line-rate time of the
busiest rank's posted bytes over its ports (one per peer direction: a mesh 1, a ring 2,
taken as evenly loaded, as benchmarks/ep_emunic.py) and ``data ms`` that of the data alone
(each block's filled bytes times its hops, the most loaded rank's share), and the ratio of
the time to it. The sparkccl it runs is whatever ``import sparkccl`` finds (PYTHONPATH), so
two trees can be compared with the same script:

    PYTHONPATH=. python3 benchmarks/sized_a2a_emunic.py --rate-gbps 0.2 --worlds 4,6
    PYTHONPATH=/path/to/other/tree python3 benchmarks/sized_a2a_emunic.py ...
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from emunic_efficiency import (  # noqa: E402  (puts tests/ on the path)
    add_nic_arguments, common_start, load_average, nic_env,
)
from helpers import posted_bytes  # noqa: E402


def _job(rank, world, store, topology, capacity, fill, iters):
    import torch

    import sparkccl
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology=topology,
                               transport="verbs", slot_bytes=world * capacity,
                               timeout_s=300) as comm:
        barrier = common_start(store, rank, world)
        x = torch.zeros(world, capacity, dtype=torch.uint8)
        x[:, :8].view(torch.int64)[:, 0] = fill
        comm.all_to_all(x, sized=True)  # (warm)
        barrier()
        b0 = posted_bytes(comm)
        comm.all_to_all(x, sized=True)
        posted = posted_bytes(comm) - b0
        ts = []
        for _ in range(iters):
            barrier()
            t0 = time.perf_counter()
            comm.all_to_all(x, sized=True)
            ts.append(time.perf_counter() - t0)
        return {"t": ts, "posted": posted, "file": sparkccl.__file__}


def main(argv=None) -> int:
    from sparkccl.config import parse_bytes
    from sparkccl.localrun import check, run_ranks
    from sparkccl.plan.geometry import sized_bytes
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_nic_arguments(ap, rate_gbps=0.2, sizes="", iters=5)
    ap.add_argument("--capacity", default="256K", help="bytes of each block")
    ap.add_argument("--fill", type=float, default=0.25, help="share of each block with data")
    a = ap.parse_args(argv)
    capacity = parse_bytes(a.capacity, "--capacity")
    fill = int(capacity * a.fill)
    env = nic_env(a, "sized-a2a-")
    print(f"# python benchmarks/sized_a2a_emunic.py {' '.join(argv or sys.argv[1:])}")
    print(f"# load average at start: {load_average()}")
    print(f"emulated roots at {a.rate_gbps:g} Gb/s each, {a.roots} per port; {os.cpu_count()} "
          f"CPUs; blocks of {capacity} bytes, {fill} with data; median of {a.iters} calls "
          "(slowest rank)")
    print(f"{'topology':<8} {'world':>5} {'posted KiB':>11} {'data KiB':>9} {'time ms':>8} "
          f"{'sent ms':>8} {'data ms':>8} {'of sent':>8} {'of data':>8}  sparkccl")
    byte_s = a.rate_gbps * 1e9 / 8 * a.roots  # one port
    for topology in a.topologies.split(","):
        for world in (int(w) for w in a.worlds.split(",")):
            vals = check(run_ranks(_job, world, args=(topology, capacity, fill, a.iters),
                                   timeout_s=900, env=env))
            t = statistics.median(max(it) for it in zip(*(v["t"] for v in vals)))
            posted = [v["posted"] for v in vals]
            ports = 1 if topology == "mesh" else 2
            hops = [min(d, world - d) if topology == "ring" else 1 for d in range(1, world)]
            data = sized_bytes(fill, capacity) * sum(hops)  # one rank's share (symmetric)
            sent_s = max(posted) / ports / byte_s
            data_s = data / ports / byte_s
            print(f"{topology:<8} {world:>5} {sum(posted) / 1024:>11.0f} "
                  f"{world * data / 1024:>9.0f} {t * 1e3:>8.1f} {sent_s * 1e3:>8.1f} "
                  f"{data_s * 1e3:>8.1f} {sent_s / t:>7.0%} {data_s / t:>7.0%}  "
                  f"{os.path.dirname(os.path.dirname(vals[0]['file']))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
