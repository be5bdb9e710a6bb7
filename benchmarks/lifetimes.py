"""Lifetimes (issue 32): many create / collective / close cycles in one process per rank,
and two communicators alive at once on the same ranks (a TP group's all-gather /
reduce-scatter / all-reduce beside an EP group's expert-parallel dispatch + combine)
interleaving calls; what the process holds is counted at the start and at the end.

Counted per rank: open file descriptors (/proc/self/fd), threads (/proc/self/task),
/dev/shm entries of sparkccl, locked memory (VmLck and VmPin of /proc/self/status: locked
and pinned pages), on verbs (the emulated NIC of tests/emunic) the memory registrations
alive and their bytes, and mapped memory (VmSize). "start" is after one warm-up cycle (the
first cycle loads modules and starts torch's and the store client's threads once per
process); "before" is before any communicator; "two_alive" while the first pair is alive
(the counts see what a communicator holds). Each count is taken once it has stopped changing
(the emulated NIC's wire threads for a peer's queue pairs end a moment after that peer's
close). Every collective is checked bit-exact against the rank-order reference.
On CPU nothing is pinned (VmLck stays 0; CUDA pins with cudaHostRegister: ``--device
cuda`` for that figure). VmSize is printed, not compared: it is address space, and glibc
reserves an arena the first time threads of two communicators allocate at once.

::

    python benchmarks/lifetimes.py --cycles 1000 --pairs 100 --transport shm,tcp,verbs \
        --out benchmarks/lifetimes_cpu.txt
    python benchmarks/lifetimes.py --cycles 1000 --pairs 100 --device cuda   # the GPU machine
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)


def counts(tokens=(), transport="shm", settle_s: float = 5.0) -> dict:
    """What this process holds, once it has stopped changing (for 0.5 s, at most
    ``settle_s``: the emulated NIC's wire threads and sockets for a peer's queue pairs end
    when that peer closes them, a moment after this rank's close returned)."""
    deadline = time.monotonic() + settle_s
    now = _counts_now(tokens, transport)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        again = _counts_now(tokens, transport)
        if again == now:
            break
        now = again
    return now


def _counts_now(tokens, transport) -> dict:
    """/dev/shm: the entries of the communicators with ``tokens`` (other processes'
    communicators share the directory); verbs (the emulated NIC): its memory registrations
    alive."""
    from sparkccl.shm import PREFIX, SHM_DIR
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            status[k] = v.strip()
    mrs, mr_bytes = 0, 0
    if transport == "verbs":
        import emunic
        mrs, mr_bytes = emunic.live_registrations()
    return dict(fds=len(os.listdir("/proc/self/fd")), threads=len(os.listdir("/proc/self/task")),
                mrs=mrs, mr_kb=mr_bytes // 1024,
                shm=sum(1 for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)
                        and any(f"-{t}-" in n for t in tokens)),
                locked_kb=int(status.get("VmLck", "0 kB").split()[0]),
                pinned_kb=int(status.get("VmPin", "0 kB").split()[0]),
                vm_mb=int(status.get("VmSize", "0 kB").split()[0]) // 1024)


# (tokens per rank, hidden, topk, e4m3) of the EP group's dispatch + combine
EP_SHAPE = (8, 128, 2, False)


def lifetime_job(rank, world, store, cycles, pairs, transport, device="cpu"):
    import torch
    import torch.distributed as dist
    import sparkccl
    from sparkccl.reference import bits
    from soak import issue, reference

    tokens: list = []

    def make(prefix):
        c = sparkccl.Communicator(store=dist.PrefixStore(prefix, store), rank=rank,
                                  world_size=world, transport=transport, timeout_s=30,
                                  slot_bytes=1 << 20, device=device)
        tokens.append(c.token)
        return c

    wrong = 0
    dev = torch.device(device)

    def use(comm, seed, kinds=("ag", "rs", "ar"), state=None):
        """One of each of ``kinds`` (soak.issue's ops), every result checked bit-exact."""
        nonlocal wrong
        for n, kind in enumerate(kinds):
            op = ((kind, seed * 10 + n, EP_SHAPE, "bfloat16") if kind == "ep" else
                  (kind, seed * 10 + n, 66, "bfloat16"))
            got = bits(issue(comm, op, rank, world, lambda t: t.to(dev), state).cpu())
            want = reference(op, rank, world)
            wrong += bool(got.size != want.size or not (got == want).all())

    before = counts(tokens, transport)
    c = make("warm")
    use(c, 0)
    c.close()
    start = counts(tokens, transport)
    t0 = time.monotonic()
    for i in range(cycles):
        c = make(f"c{i}")
        use(c, i)
        c.close()
    mid = counts(tokens, transport)
    t1 = time.monotonic()
    alive = mid  # (no pairs: nothing alive to count)
    for i in range(pairs):  # a TP group and an EP group on the same ranks, interleaved
        tp, ep = make(f"tp{i}"), make(f"ep{i}")
        ep_state: dict = {}  # the EP group's ExpertParallel, made on its first dispatch
        for k in range(5):
            use(tp, 3 * k)
            use(ep, 3 * k + 1, ("ep", "ag"), ep_state)
        if i == 0:  # what two live communicators hold: the counts see them
            alive = _counts_now(tokens, transport)
        (tp.close(), ep.close()) if i % 2 else (ep.close(), tp.close())
    end = counts(tokens, transport)
    return dict(before=before, start=start, after_cycles=mid, two_alive=alive, end=end,
                registered_peak=alive["mrs"], wrong=wrong,
                cycle_s=(t1 - t0) / max(cycles, 1), pair_s=(time.monotonic() - t1) / max(pairs, 1))


COUNTED = ("fds", "threads", "shm", "locked_kb", "pinned_kb", "mrs", "mr_kb")


def run(cycles: int, pairs: int, world: int, transport: str, device: str) -> tuple[list, bool]:
    """One transport: (the record's lines, whether every count stayed and all was exact)."""
    import tempfile
    from sparkccl.localrun import check, run_ranks
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lifetimes-") as tmp:
        env = {}
        if transport == "verbs":
            import emunic
            env = emunic.host_env(os.path.join(tmp, "emunic"))
        values = check(run_ranks(lifetime_job, world, env=env, timeout_s=7200,
                                 args=(cycles, pairs, transport, device)))
    lines = [f"lifetimes: python benchmarks/lifetimes.py --cycles {cycles} --pairs {pairs} "
             f"--world {world} --transport {transport} --device {device}  "
             f"({time.monotonic() - t0:.0f} s, load {os.getloadavg()[0]:.1f} on "
             f"{os.cpu_count()} cores)",
             f"{cycles} create / all-gather + reduce-scatter + all-reduce / close cycles, then "
             f"{pairs} times two communicators alive at once (5 interleaved rounds each: the "
             "TP group those three, the EP group an EP dispatch + combine and an all-gather)"
             + ("; MRs: the emulated NIC's live memory registrations" if transport == "verbs"
                else ""),
             f"{'rank':>4} {'when':13} {'fds':>5} {'threads':>7} {'/dev/shm':>8} "
             f"{'VmLck kB':>8} {'VmPin kB':>8} {'MRs':>5} {'MR kB':>7} {'VmSize MB':>9}"]
    same = True
    for r, v in enumerate(values):
        for when in ("before", "start", "after_cycles", "two_alive", "end"):
            c = v[when]
            lines.append(f"{r:>4} {when:13} {c['fds']:>5} {c['threads']:>7} {c['shm']:>8} "
                         f"{c['locked_kb']:>8} {c['pinned_kb']:>8} {c['mrs']:>5} "
                         f"{c['mr_kb']:>7} {c['vm_mb']:>9}")
        for k in COUNTED:
            same &= v["start"][k] == v["after_cycles"][k] == v["end"][k]
        lines.append(f"     wrong results {v['wrong']}; {v['cycle_s'] * 1e3:.0f} ms per cycle, "
                     f"{v['pair_s'] * 1e3:.0f} ms per pair")
    wrong = sum(v["wrong"] for v in values)
    lines.append(f"counts equal at start, after the cycles and at the end on every rank: "
                 f"{'yes' if same else 'NO'}; wrong results: {wrong}")
    return lines, same and not wrong


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--pairs", type=int, default=100)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--transport", default="shm",
                    help="shm, tcp, verbs (the emulated NIC of tests/emunic), or several "
                         "separated by commas, one after the other")
    ap.add_argument("--device", default="cpu", help="cuda: ranks share the GPU; VmLck then "
                    "counts the pinned (cudaHostRegister) pages")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from bench_record import emit
    lines, ok = [], True
    for transport in a.transport.split(","):
        more, good = run(a.cycles, a.pairs, a.world, transport, a.device)
        lines += more + [""]
        ok &= good
        emit(lines, a.out, quiet=True)  # as it goes
    emit(lines, a.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
