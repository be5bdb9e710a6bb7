"""Partition campaign (issue 32): tcp between network namespaces (tests/netns.py), one link
taken down -- or one connection reset -- in the middle of a run of collectives while the
management network (the bootstrap store, the liveness channel) stays up.

Each case (drawn from ``--seed``): a fabric (``switch`` for mesh, ``ring`` for ring), a
world of 2..6, 1 or 2 roots (SPARKCCL_ROOTS; with 2, one root of two goes down: sparkccl
does not carry on over the other root, every rank fails), a fault and a victim box:

* ``portdown``: ``ip link set down`` on one port of the victim box (switch: its ``rt{k}``;
  ring: its ``nx{k}``), root k drawn;
* ``reset``: every tcp connection of the victim box on root k is killed (``ss -K``: the
  kernel aborts the sockets and the peers get a reset).

Checks: every rank raises CollectiveError within the collective timeout + 1 s of the fault
(the fault time is the driver's clock, the same clock as the ranks'), no rank hangs, every
result returned before is bit-exact, nothing of the communicator left in /dev/shm, and
with the link back up a new communicator on the same boxes is exact.

::

    sudo-less here (the test machine runs as root):
    nice -n 19 python benchmarks/partition_campaign.py --cases 12 --seed 1 --out benchmarks/partition_campaign_cpu.txt
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)

TIMEOUT_S = 5.0
FAULTS = ("portdown", "reset")


@dataclass(frozen=True)
class Case:
    topology: str
    world: int
    roots: int
    fault: str
    victim: int
    root: int
    delay_ms: float
    seed: int

    def label(self) -> str:
        return (f"tcp-netns/{self.topology} w{self.world} roots {self.roots} {self.fault} box "
                f"{self.victim} root {self.root} +{self.delay_ms:.0f} ms")


def draw_cases(n: int, seed: int) -> list[Case]:
    rnd = random.Random(f"partition/{seed}")
    out = []
    for i in range(n):
        topology = rnd.choice(("mesh", "ring"))
        world = rnd.randint(2, 6) if topology == "mesh" else rnd.randint(3, 6)
        roots = rnd.choice((1, 2))
        out.append(Case(topology, world, roots, rnd.choice(FAULTS), rnd.randrange(world),
                        rnd.randrange(roots), rnd.uniform(0, 300), seed * 1000 + i))
    return out


def partition_job(rank, world, store, fields: dict, marker_dir: str):
    case = Case(**fields)  # (a dict on the way: the rank unpickles its spec before imports)
    import sparkccl
    from sparkccl.errors import CollectiveError
    from sparkccl.reference import bits
    from soak import issue, reference
    rnd = random.Random(case.seed)
    comm = sparkccl.Communicator(store=store, rank=rank, world_size=world,
                                 topology=case.topology, transport="tcp", timeout_s=TIMEOUT_S,
                                 bootstrap_timeout_s=120, slot_bytes=4 << 20)
    token = comm.token
    wrong, n, error, failed_at = [], 0, None, None
    t_end = time.monotonic() + 120
    try:
        while time.monotonic() < t_end:
            kind = rnd.choice(("ag", "rs"))
            op = (kind, case.seed * 100000 + n, rnd.choice((1, 1000, 65536)), "bfloat16")
            y = issue(comm, op, rank, world, lambda t: t)
            want = reference(op, rank, world)
            if not (bits(y) == want).all():
                wrong.append(f"{kind} #{n}")
            n += 1
            if n == 10:
                open(os.path.join(marker_dir, f"started{rank}"), "w").close()
    except CollectiveError as e:
        error, failed_at = str(e), time.time()
        comm.__exit__(CollectiveError, None, None)
    else:
        comm.close()
    return dict(n=n, error=error, failed_at=failed_at, wrong=wrong, token=token)


def after_job(rank, world, store, topology):
    import torch
    import sparkccl
    with sparkccl.Communicator(store=store, rank=rank, world_size=world, topology=topology,
                               transport="tcp", timeout_s=30) as comm:
        y = comm.all_gather(torch.full((1000,), float(rank)))
        return y.view(world, -1)[:, 0].tolist() == [float(q) for q in range(world)]


def _port(case: Case) -> str:
    return f"rt{case.root}" if case.topology == "mesh" else f"nx{case.root}"


def _reset(fab, case: Case) -> None:
    """Kill every tcp socket of the victim box on root k's subnet (ss -K)."""
    import netns
    lk = fab.link(case.victim, "root" if case.topology == "mesh" else "next", case.root)
    addr = lk.addr.split("/")[0]
    netns.in_ns(fab.boxes[case.victim], "ss", "-K", "-t", "src", addr, check=False)


def run_case(case: Case) -> tuple[bool, str, float]:
    import netns
    from bench_record import Verdict
    kind = "switch" if case.topology == "mesh" else "ring"
    with netns.Fabric(kind, case.world, roots=case.roots) as fab:
        marker = os.path.join(fab.tmp, "markers")
        os.makedirs(marker)
        env = {"SPARKCCL_ROOTS": str(case.roots)}
        run = fab.start(partition_job, (dict(case.__dict__), marker), env=env)
        deadline = time.monotonic() + 150
        while (len(os.listdir(marker)) < case.world and time.monotonic() < deadline
               and all(p.poll() is None for p in run.procs)):
            time.sleep(0.05)
        if len(os.listdir(marker)) < case.world:
            results = run.wait(30)
            return False, "the run did not start on every rank: " + "; ".join(
                f"rank {r.rank}: {r.error_type}: {(r.message or '')[:300]}" for r in results
                if not r.ok), 0.0
        time.sleep(case.delay_ms / 1000)
        t_fault = time.time()
        if case.fault == "portdown":
            fab.set_link(case.victim, _port(case), up=False)
        else:
            _reset(fab, case)
        results = run.wait(timeout_s=TIMEOUT_S * 4 + 60)
        verdict = Verdict(TIMEOUT_S + 1)
        for r in results:
            if not r.ok:
                verdict.rank_failed(r)
                continue
            v = r.value
            dt = None if v["error"] is None else v["failed_at"] - t_fault
            verdict.survivor(r.rank, v, dt, never_raised=f" ({v['n']} collectives)")
        verdict.check_leftovers()
        if case.fault == "portdown":
            fab.set_link(case.victim, _port(case), up=True)
        after = fab.run(after_job, (case.topology,), env=env, timeout_s=120)
        if not all(r.ok and r.value for r in after):
            verdict.problem("a new communicator afterwards failed: " + "; ".join(
                f"rank {r.rank}: {r.error_type}: {(r.message or '')[:200]}" for r in after
                if not (r.ok and r.value)))
    return verdict.result()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import netns
    from bench_record import case_line, emit
    why = netns.unavailable_reason()
    if why:
        print(f"network namespaces unavailable: {why}")
        return 2
    netns.cleanup_stale()
    header = (f"command: python benchmarks/partition_campaign.py {' '.join(argv or sys.argv[1:])}"
              f"\ncollective timeout {TIMEOUT_S:g} s; a pass = every rank raised within timeout "
              "+ 1 s of the fault, no hang, no wrong result, nothing left in /dev/shm, a new "
              f"communicator works with the link back (load {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} cores at the start)\n")
    lines = []
    passed = 0
    for i, case in enumerate(draw_cases(a.cases, a.seed)):
        t0 = time.monotonic()
        ok, why, dt = run_case(case)
        passed += ok
        lines.append(case_line(ok, f"{case.label()} (slowest {dt:.2f} s)",
                               time.monotonic() - t0, why))
        print(lines[-1], flush=True)
        emit(header + "\n".join(lines) + f"\n{passed} of {i + 1} passed", a.out, quiet=True)
    return 0 if passed == a.cases else 1


if __name__ == "__main__":
    import partition_campaign  # the rank processes load the job from the module by name
    sys.exit(partition_campaign.main())
