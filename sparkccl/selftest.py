"""``sparkccl selftest``: is this cluster right? Run it under torchrun on every box.

1. **Bit-exact checks** of every collective (all-gather in several dtypes, reduce-scatter in
   bf16 / fp16 / fp32, the zero-copy reduce-scatter input, the fused MoE finalize when this
   build has it) at many sizes -- 1 byte to the slot, aligned and not -- then bursts of
   mixed collectives issued back to back and checked only afterwards (slot reuse at full
   speed). Every rank rebuilds every other rank's input from a seed and checks its own
   results against an independent rank-order reference (numpy, fp32, rounded once).
2. **Bandwidth** per collective and size: Gb/s *received per rank* ((world - 1) x slice x 8
   / time; the time of a call is the slowest rank's), next to the ports' link rate.
3. **A verdict line**: ``selftest: PASS ...`` (exit 0) or ``selftest: FAIL ...`` with the
   first problems (exit 1). A communicator that cannot be built (devices, GIDs, pairing,
   lane check) is a FAIL with the reason from every rank.

Switch (mesh), e.g. 4 boxes, on each box (``--node-rank`` 0..3; the bootstrap store goes
over the management network at ``--master-addr``)::

    torchrun --nnodes 4 --nproc-per-node 1 --node-rank R --master-addr box0 \\
        --master-port 29500 -m sparkccl.selftest --topology mesh

Switchless ring: the same with ``--topology ring`` (cable port "next" of box r to port
"prev" of box r+1; ``SPARKCCL_RING_PREV_HCA`` / ``SPARKCCL_RING_NEXT_HCA`` if the automatic
choice -- lower PCIe function faces prev -- is not how the cables run).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from . import config
from .config import format_bytes
from .fabric.discovery import rate_gbps

# (per-rank elements, dtype): 1 byte up, odd sizes, 16-byte multiples, a few MiB.
AG_CASES = [(1, "uint8"), (15, "uint8"), (16, "uint8"), (17, "uint8"), (1000, "uint8"),
            (2051, "bfloat16"), (4099, "float32"), (65536, "int32"), (1 << 19, "bfloat16"),
            (3 * (1 << 20) + 5, "uint8")]
RS_CASES = [(1, "bfloat16"), (7, "float16"), (333, "float32"), (4096, "bfloat16"),
            (65537, "float16"), (1 << 19, "bfloat16"), (1 << 20, "float32")]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "selftest", help="under torchrun on every box: bit-exact checks, bandwidth, a verdict",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _arguments(p)
    p.set_defaults(func=run)
    return p


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", choices=["mesh", "ring"], default="mesh",
                   help="mesh (boxes on a switch) or ring (switchless, cabled box to box)")
    p.add_argument("--transport", choices=["verbs", "tcp", "shm", "auto"], default="verbs",
                   help="default verbs (RDMA); tcp / shm to compare or to test the tool")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="where tensors live (auto: cuda:LOCAL_RANK when CUDA works)")
    p.add_argument("--slot-bytes", default=None,
                   help="slot size (default SPARKCCL_SLOT_BYTES or 64M); the largest size tested")
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size")
    p.add_argument("--bursts", type=int, default=3, help="bursts of 100 mixed collectives")
    p.add_argument("--quick", action="store_true", help="fewer sizes, one burst, 5 iterations")
    p.add_argument("--no-bandwidth", action="store_true", help="only the bit-exact checks")


def run(args: argparse.Namespace) -> int:
    return selftest(topology=args.topology, transport=args.transport, device=args.device,
                    slot_bytes=args.slot_bytes, timeout_s=args.timeout, iters=args.iters,
                    bursts=args.bursts, quick=args.quick, bandwidth=not args.no_bandwidth)


# ---- helpers --------------------------------------------------------------------------

def _dtype(name):
    import torch
    return getattr(torch, name)


class _Ctx:
    def __init__(self, comm, dist, device):
        self.comm, self.dist, self.device = comm, dist, device
        self.rank, self.world = comm.rank, comm.world_size

    def sync(self):
        if self.device.type == "cuda":
            self.comm.synchronize()

    def to(self, t):
        return t.to(self.device) if self.device.type != "cpu" else t


# ---- phase 1: bit-exact ----------------------------------------------------------------

def _exact(c: _Ctx, max_slice: int, quick: bool) -> tuple[int, list[str]]:
    import torch
    from .exact_checks import finalize_demo_case, reduce_scatter_via_input
    from .reference import all_gather_reference, bits, make_input, reduce_scatter_reference
    W, r = c.world, c.rank
    bad, n = [], 0
    for case, (elems, dname) in enumerate(AG_CASES):
        dtype = _dtype(dname)
        if elems * torch.empty((), dtype=dtype).element_size() > max_slice * 2 or \
                (quick and elems > (1 << 19)):
            continue  # above twice the slot share: splitting is tested by the largest ones
        xs = [make_input(case, q, (elems,), dtype) for q in range(W)]
        y = c.comm.all_gather(c.to(xs[r]))
        c.sync()
        n += 1
        got, want = bits(y.cpu()), all_gather_reference(xs)
        if got.size != want.size or not (got == want).all():
            bad.append(f"all_gather {elems} x {dname}")
    for case, (elems, dname) in enumerate(RS_CASES):
        dtype = _dtype(dname)
        if quick and elems > (1 << 19):
            continue
        xs = [make_input(100 + case, q, (W * elems,), dtype) for q in range(W)]
        want = reduce_scatter_reference(xs, r)
        y = c.comm.reduce_scatter(c.to(xs[r]))
        c.sync()
        n += 1
        if not (bits(y.cpu()) == want).all():
            bad.append(f"reduce_scatter {W} x {elems} x {dname}")
        # The same through the zero-copy input buffer.
        y = reduce_scatter_via_input(c.comm, c.to(xs[r]))
        c.sync()
        n += 1
        if not (bits(y.cpu()) == want).all():
            bad.append(f"reduce_scatter (zero-copy input) {W} x {elems} x {dname}")
    n += 1
    if not finalize_demo_case(c.comm, W, r, 7):
        bad.append("moe_finalize_reduce_scatter (bf16 and e4m3 cases)")
    return n, bad


def _bursts(c: _Ctx, bursts: int, per_burst: int = 100) -> tuple[int, list[str]]:
    from .exact_checks import BURST_SIZES, run_bursts
    return run_bursts(c.comm, c.world, c.rank, bursts=bursts, per_burst=per_burst,
                      op_seed=5000, input_seed=100_000, to=c.to, sync=c.sync,
                      sizes=(*BURST_SIZES, 1 << 18))


# ---- phase 2: bandwidth ----------------------------------------------------------------

def _timed(c: _Ctx, fn, iters: int) -> float:
    import torch
    fn()
    c.sync()
    c.dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    c.sync()
    t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    c.dist.all_reduce(t, op=c.dist.ReduceOp.MAX)  # a call ends when its slowest rank has it
    return float(t.item())


def _bandwidth(c: _Ctx, max_slice: int, iters: int, quick: bool) -> list[tuple]:
    import torch
    W = c.world
    rows = []
    sizes, s = [], 256 << 10
    while s <= max_slice:
        sizes.append(s)
        s *= 4 if not quick else 16
    if sizes and sizes[-1] != max_slice:
        sizes.append(max_slice // 16 * 16)
    for slice_bytes in sizes:
        n = slice_bytes // 2
        x_ag = c.to(torch.ones(n, dtype=torch.bfloat16))
        out_ag = c.to(torch.empty(W * n, dtype=torch.bfloat16))
        x_rs = c.to(torch.ones(W * n, dtype=torch.bfloat16))
        out_rs = c.to(torch.empty(n, dtype=torch.bfloat16))
        for name, fn in (("all_gather", lambda: c.comm.all_gather(x_ag, out=out_ag)),
                         ("reduce_scatter", lambda: c.comm.reduce_scatter(x_rs, out=out_rs))):
            t = _timed(c, fn, iters)
            gbps = (W - 1) * slice_bytes * 8 / t / 1e9
            rows.append((name, slice_bytes, t, gbps))
    return rows


# ---- driver ----------------------------------------------------------------------------

def lanes(comm) -> list[str]:
    """What selftest prints for a rank's lanes (Communicator.describe_lanes)."""
    return comm.describe_lanes() or [f"transport {comm.transport} (no RDMA lanes)"]


def port_rate(comm) -> float | None:
    """Link rate a rank can receive at: the port's rate (mesh), or both ports' (ring)."""
    lanes = comm.lanes()
    if not lanes:
        return None
    ports = {}
    for (ch, _), choice in lanes.items():
        g = rate_gbps(choice.rate)
        if g is not None:
            ports[ch] = max(ports.get(ch, 0.0), g)
    return sum(ports.values()) if ports else None


def selftest(topology: str = "mesh", transport: str = "verbs", device: str = "auto",
             slot_bytes=None, timeout_s: float = 60.0, iters: int = 20, bursts: int = 3,
             quick: bool = False, bandwidth: bool = True, out=None) -> int:
    import torch
    import torch.distributed as dist

    import sparkccl
    out = out or sys.stdout
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("selftest: run it under torchrun on every box, e.g.\n  torchrun --nnodes N "
              "--nproc-per-node 1 --node-rank R --master-addr HOST --master-port 29500 "
              "-m sparkccl.selftest --topology mesh", file=out)
        return 2
    if quick:
        iters, bursts = min(iters, 5), min(bursts, 1)
    own_pg = not dist.is_initialized()
    if own_pg:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(f"cuda:{local}") if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    report = {"rank": rank, "host": os.uname().nodename, "error": None, "checks": 0,
              "bad": [], "burst_total": 0, "burst_bad": [], "lanes": [], "rows": [],
              "port_gbps": None, "seconds": 0.0}
    t0 = time.monotonic()
    comm = None
    try:
        comm = sparkccl.Communicator(topology=topology, transport=transport, device=dev,
                                     slot_bytes=slot_bytes, timeout_s=timeout_s)
        c = _Ctx(comm, dist, dev)
        report["lanes"] = lanes(comm)
        report["port_gbps"] = port_rate(comm)
        max_slice = comm.max_slice
        report["checks"], report["bad"] = _exact(c, max_slice, quick)
        report["burst_total"], report["burst_bad"] = _bursts(c, bursts)
        if bandwidth and not report["bad"] and not report["burst_bad"]:
            report["rows"] = _bandwidth(c, max_slice, iters, quick)
    except Exception as e:  # noqa: BLE001 - every failure ends in the verdict
        report["error"] = f"{type(e).__name__}: {e}"
        if config.get("SPARKCCL_SELFTEST_TRACEBACK"):
            report["error"] += "\n" + traceback.format_exc()
    finally:
        if comm is not None:
            try:
                comm.close()
            except Exception as e:  # noqa: BLE001
                report["error"] = report["error"] or f"close: {e}"
    report["seconds"] = time.monotonic() - t0
    reports = [None] * world
    dist.all_gather_object(reports, report)
    code = 0
    if rank == 0:
        code = _print(reports, topology, transport, dev.type, out)
    codes = torch.tensor([code])
    dist.broadcast(codes, 0)
    if own_pg:
        dist.destroy_process_group()
    return int(codes.item())


def _print(reports: list[dict], topology: str, transport: str, device: str, out) -> int:
    W = len(reports)
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"sparkccl selftest: {W} ranks, {topology}, transport {transport}, device {device}")
    for rep in reports:
        p(f"  rank {rep['rank']} ({rep['host']}): " + ("; ".join(rep["lanes"]) or "-"))
    problems = []
    errors: dict[str, list[int]] = {}  # the same text from several ranks is shown once
    for rep in reports:
        if rep["error"]:
            errors.setdefault(rep["error"], []).append(rep["rank"])
    for text, ranks in errors.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        problems.append(f"{who}: {text}")
    for rep in reports:
        problems += [f"rank {rep['rank']}: MISMATCH {b}" for b in rep["bad"] + rep["burst_bad"]]
    checks = reports[0]["checks"]
    burst = reports[0]["burst_total"]
    if not any(rep["error"] for rep in reports):
        p(f"\nbit-exact: {checks} collective checks and {burst} burst calls on every rank: "
          + ("all exact" if not problems else f"{len(problems)} MISMATCHES"))
    rows = reports[0]["rows"]
    best = {}
    if rows:
        port = reports[0]["port_gbps"]
        p(f"\nbandwidth (bf16; Gb/s received per rank = (world-1) x slice x 8 / time of the "
          f"slowest rank){'; link ' + format(port, 'g') + ' Gb/s' if port else ''}")
        p(f"{'collective':<15} {'slice':>10} {'time (us)':>11} {'Gb/s':>8}")
        for name, size, t, gbps in rows:
            p(f"{name:<15} {format_bytes(size):>10} {t * 1e6:>11.1f} {gbps:>8.1f}")
            if gbps > best.get(name, (0, 0))[0]:
                best[name] = (gbps, size)
    summary = ", ".join(f"{k} {v[0]:.1f} Gb/s ({format_bytes(v[1])} per rank)" for k, v in best.items())
    if problems:
        p("\nproblems:\n  " + "\n  ".join(problems[:20]))
        if len(problems) > 20:
            p(f"  ... and {len(problems) - 20} more")
        first = " ".join(line.strip() for line in problems[0].splitlines()[:2])
        p(f"selftest: FAIL on {W} ranks ({topology}/{transport}): {first}")
        return 1
    note = ""
    port = reports[0]["port_gbps"]
    if best and port and max(v[0] for v in best.values()) < 0.5 * port:
        note = (f"; below half the link rate ({port:g} Gb/s): check MTU, PFC/ECN, "
                "SPARKCCL_IB_ORDERING, CPU load")
    p(f"selftest: PASS on {W} ranks ({topology}/{transport}): every collective bit-exact"
      + (f"; {summary}" if summary else "") + note)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparkccl.selftest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
