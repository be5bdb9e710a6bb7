"""Lifetimes (issue 32): many create / collective / close cycles in one process per rank,
and two communicators alive at once on the same ranks (a TP group beside an EP group)
interleaving calls; what the process holds is counted at the start and at the end.

Counted per rank: open file descriptors (/proc/self/fd), threads (/proc/self/task),
/dev/shm entries of sparkccl, locked memory (VmLck and VmPin of /proc/self/status: locked and pinned pages),
mapped memory (VmSize). "start" is after one warm-up cycle (the first cycle loads modules
and starts torch's and the store client's threads once per process); "before" is before any
communicator. Every collective is checked bit-exact against the rank-order reference.
On CPU nothing is pinned (VmLck stays 0; CUDA pins with cudaHostRegister: run it with a CUDA
device for that figure). VmSize is printed, not compared: it is address space, and glibc
reserves an arena the first time threads of two communicators allocate at once.

::

    python benchmarks/lifetimes.py --cycles 1000 --pairs 100 --world 2 --out benchmarks/lifetimes_cpu.txt
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def counts(tokens=()) -> dict:
    """What this process holds; /dev/shm: the entries of the communicators with ``tokens``
    (other processes' communicators share the directory)."""
    from sparkccl.shm import PREFIX, SHM_DIR
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            status[k] = v.strip()
    return dict(fds=len(os.listdir("/proc/self/fd")), threads=len(os.listdir("/proc/self/task")),
                shm=sum(1 for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)
                        and any(f"-{t}-" in n for t in tokens)),
                locked_kb=int(status.get("VmLck", "0 kB").split()[0]),
                pinned_kb=int(status.get("VmPin", "0 kB").split()[0]),
                vm_mb=int(status.get("VmSize", "0 kB").split()[0]) // 1024)


def lifetime_job(rank, world, store, cycles, pairs, transport, device="cpu"):
    import torch
    import torch.distributed as dist
    import sparkccl
    from sparkccl.reference import all_gather_reference, bits, make_input, reduce_scatter_reference

    tokens: list = []

    def make(prefix):
        c = sparkccl.Communicator(store=dist.PrefixStore(prefix, store), rank=rank,
                                     world_size=world, transport=transport, timeout_s=30,
                                     slot_bytes=1 << 20, device=device)
        tokens.append(c.token)
        return c

    wrong = 0

    def use(comm, seed):
        nonlocal wrong
        xs = [make_input(seed, r, (world * 2, 33), torch.bfloat16) for r in range(world)]
        x = xs[rank].to(device)
        wrong += not (bits(comm.all_gather(x).cpu()) == all_gather_reference(xs)).all()
        wrong += not (bits(comm.reduce_scatter(x).cpu()) == reduce_scatter_reference(xs, rank)).all()

    before = counts(tokens)
    c = make("warm")
    use(c, 0)
    c.close()
    start = counts(tokens)
    t0 = time.monotonic()
    for i in range(cycles):
        c = make(f"c{i}")
        use(c, i)
        c.close()
    mid = counts(tokens)
    t1 = time.monotonic()
    for i in range(pairs):  # a TP group and an EP group on the same ranks, interleaved
        tp, ep = make(f"tp{i}"), make(f"ep{i}")
        for k in range(5):
            use(tp, 3 * k)
            use(ep, 3 * k + 1)
        (tp.close(), ep.close()) if i % 2 else (ep.close(), tp.close())
    end = counts(tokens)
    return dict(before=before, start=start, after_cycles=mid, end=end, wrong=wrong,
                cycle_s=(t1 - t0) / max(cycles, 1), pair_s=(time.monotonic() - t1) / max(pairs, 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--pairs", type=int, default=100)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--device", default="cpu", help="cuda: ranks share the GPU; VmLck then "
                    "counts the pinned (cudaHostRegister) pages")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from sparkccl.localrun import check, run_ranks
    t0 = time.monotonic()
    values = check(run_ranks(lifetime_job, a.world, args=(a.cycles, a.pairs, a.transport, a.device),
                             timeout_s=7200))
    lines = [f"lifetimes: python benchmarks/lifetimes.py --cycles {a.cycles} --pairs {a.pairs} "
             f"--world {a.world} --transport {a.transport} --device {a.device}  ({time.monotonic() - t0:.0f} s, "
             f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)",
             f"{a.cycles} create / all-gather + reduce-scatter / close cycles, then {a.pairs} "
             "times two communicators alive at once (5 interleaved rounds each)",
             f"{'rank':>4} {'when':13} {'fds':>5} {'threads':>7} {'/dev/shm':>8} "
             f"{'VmLck kB':>8} {'VmPin kB':>8} {'VmSize MB':>9}"]
    same = True
    for r, v in enumerate(values):
        for when in ("before", "start", "after_cycles", "end"):
            c = v[when]
            lines.append(f"{r:>4} {when:13} {c['fds']:>5} {c['threads']:>7} {c['shm']:>8} "
                         f"{c['locked_kb']:>8} {c['pinned_kb']:>8} {c['vm_mb']:>9}")
        for k in ("fds", "threads", "shm", "locked_kb", "pinned_kb"):
            same &= v["start"][k] == v["after_cycles"][k] == v["end"][k]
        lines.append(f"     wrong results {v['wrong']}; {v['cycle_s'] * 1e3:.0f} ms per cycle, "
                     f"{v['pair_s'] * 1e3:.0f} ms per pair")
    wrong = sum(v["wrong"] for v in values)
    lines.append(f"counts equal at start, after the cycles and at the end on every rank: "
                 f"{'yes' if same else 'NO'}; wrong results: {wrong}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0 if same and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
