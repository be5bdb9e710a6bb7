"""The `sparkccl` command line: plan, demo, bench."""
from __future__ import annotations

import argparse
import sys


def _cmd_plan(args: argparse.Namespace) -> int:
    from .plan.report import plan_summary

    text, ok = plan_summary(args.collective, args.topology, args.world, args.roots)
    print(text)
    return 0 if ok else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(world=args.world, topology=args.topology, transport=args.transport,
                    device=args.device, quick=args.quick)


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import baselines_for, run_bench

    try:
        baselines_for(args.device, not args.no_baseline, args.baseline)
    except ValueError as e:
        print(f"sparkccl bench: {e}", file=sys.stderr)
        return 2
    return run_bench(world=args.world, topology=args.topology, transport=args.transport,
                     device=args.device, min_bytes=args.min_bytes, max_bytes=args.max_bytes,
                     iters=args.iters, baseline=not args.no_baseline,
                     only=args.baseline or None, api=args.api)


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sparkccl", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="show a collective's schedule and verify it")
    p.add_argument("--collective", choices=["all_gather", "reduce_scatter"], required=True)
    p.add_argument("--topology", choices=["mesh", "ring"], default="mesh")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--roots", type=int, choices=[1, 2], default=2)
    p.set_defaults(func=_cmd_plan)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--world", type=int, default=4)
    common.add_argument("--topology", choices=["mesh", "ring"], default="mesh")
    common.add_argument("--transport", choices=["auto", "shm", "tcp"], default="shm")
    common.add_argument("--device", choices=["cpu", "cuda"], default="cpu")

    d = sub.add_parser("demo", parents=[common],
                       help="run every collective on local ranks and check every bit")
    d.add_argument("--quick", action="store_true", help="fewer sizes and shorter bursts")
    d.set_defaults(func=_cmd_demo)

    b = sub.add_parser("bench", parents=[common],
                       help="bandwidth table (nccl-tests columns) with a baseline from the same run")
    b.add_argument("--min-bytes", type=_size, default=1 << 20)
    b.add_argument("--max-bytes", type=_size, default=64 << 20)
    b.add_argument("--iters", type=int, default=5)
    b.add_argument("--no-baseline", action="store_true",
                   help="skip torch.distributed (gloo on CPU, NCCL three ways on CUDA)")
    b.add_argument("--baseline", action="append", metavar="NAME",
                   help="only this baseline (repeatable): gloo, nccl, nccl-p2p-off, nccl-sockets")
    b.add_argument("--api", choices=["direct", "torch"], default="direct",
                   help="torch: also time the calls through torch.distributed (backend "
                        "\"sparkccl\") and print the overhead against the direct API")
    b.set_defaults(func=_cmd_bench)

    from . import doctor, selftest
    doctor.add_parser(sub)
    selftest.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
