"""The `sparkccl` command line.

commands:
  demo      run every collective on local ranks and check every bit (start here)
  bench     bandwidth table (nccl-tests columns) with torch.distributed baselines in the same run
  plan      print a collective's per-port load against its lower bound and the verifier's verdict
  doctor    effective settings, shared memory and memlock, RDMA devices, what sparkccl would use
  selftest  on a real cluster, under torchrun on every box: bit-exact checks, bandwidth, verdict

Transports: shm (ranks on one host), tcp (any IP network), verbs (RDMA: RoCE v2 /
InfiniBand), auto (shm on one host, else verbs where RDMA devices are usable, else tcp).
Every argument, every SPARKCCL_* setting and (--device cuda) the GPU are checked before
any rank starts; a problem exits with status 2.
"""
from __future__ import annotations

import argparse
import sys

# Building the parser imports nothing heavy (no torch): `sparkccl --help` stays instant.

TRANSPORTS = ("auto", "shm", "tcp", "verbs")
TOPOLOGIES = ("mesh", "ring")


def _world(text: str) -> int:
    from .plan.build import MAX_WORLD
    try:
        world = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of ranks") from None
    if not 2 <= world <= MAX_WORLD:
        raise argparse.ArgumentTypeError(
            f"{world}: sparkccl's plans cover 2 to {MAX_WORLD} ranks")
    return world


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: must be at least 1")
    return n


def _token_counts(text: str) -> tuple:
    try:
        counts = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected token counts, e.g. 128,1024"
                                         ) from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every count must be at least 1")
    return counts


def _bytes(text: str) -> int:
    from .config import parse_bytes
    try:
        n = parse_bytes(text, "size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("size=")) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1 byte")
    return n


def _cmd_plan(args: argparse.Namespace) -> int:
    from .plan.report import plan_summary

    text, ok = plan_summary(args.collective, args.topology, args.world, args.roots)
    print(text)
    return 0 if ok else 1


def _check_before_start(args: argparse.Namespace) -> None:
    """What every rank would find wrong, found once here before any rank starts (exit 2):
    a setting that does not parse, ``--device cuda`` where the CUDA data plane cannot run
    (the same check and text as the Communicator's)."""
    from . import config
    bad = config.invalid()
    if bad:
        args.parser.error("; ".join(bad))
    if args.device == "cuda":
        from .errors import CudaUnavailable
        try:
            from .dataplane.cuda_runtime import check_available
            check_available()
        except CudaUnavailable as e:
            args.parser.error(f"--device cuda: CudaUnavailable: {e}")


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    _check_before_start(args)

    return run_demo(world=args.world, topology=args.topology, transport=args.transport,
                    device=args.device, quick=args.quick)


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import (DEFAULT_COLLECTIVES, PLOT_HINT, EpShape, baselines_for,
                        have_matplotlib, run_bench)

    try:
        baselines_for(args.device, not args.no_baseline, args.baseline)
    except ValueError as e:
        args.parser.error(str(e))
    if args.min_bytes > args.max_bytes:
        args.parser.error(f"--min-bytes {args.min_bytes} is larger than --max-bytes "
                          f"{args.max_bytes}")
    if args.plot and not have_matplotlib():
        args.parser.error(PLOT_HINT)
    _check_before_start(args)
    collectives = tuple(args.collective or DEFAULT_COLLECTIVES)
    if "ep" in collectives:
        from .expert_parallel import MAX_TOPK
        if not args.topk <= min(MAX_TOPK, args.experts_per_rank * args.world):
            args.parser.error(f"--topk {args.topk}: at most {MAX_TOPK} and at most the "
                              f"experts ({args.experts_per_rank} per rank x {args.world})")
        if args.hidden % 8:
            args.parser.error(f"--hidden {args.hidden}: must be a multiple of 8")
    if args.plot and collectives == ("ep",):
        args.parser.error("--plot draws the sized collectives' bus bandwidth; ep has none")
    return run_bench(world=args.world, topology=args.topology, transport=args.transport,
                     device=args.device, min_bytes=args.min_bytes, max_bytes=args.max_bytes,
                     iters=args.iters, baseline=not args.no_baseline,
                     only=args.baseline or None, plot=args.plot, api=args.api,
                     collectives=collectives,
                     ep=EpShape(tokens=args.tokens, hidden=args.hidden, topk=args.topk,
                                experts_per_rank=args.experts_per_rank, mode=args.ep_mode))


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown on every option that has one; descriptions keep their line breaks."""

    def _get_help_string(self, action):
        if action.default in (None, False):  # "(default: None)" says nothing
            return action.help
        return super()._get_help_string(action)


def _sub(sub, name: str, help: str, **kw) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=kw.pop("description", help),
                       formatter_class=_Formatter, **kw)
    p.set_defaults(parser=p)
    return p


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    ap = argparse.ArgumentParser(
        prog="sparkccl", formatter_class=_Formatter,
        description="Prefill-sized all-gather and reduce-scatter, bit-exact on every rank, "
                    "without NCCL. Start with `sparkccl demo`.\n\n" + __doc__.split("\n\n")[2],
        epilog="`sparkccl COMMAND --help` shows each command's options and defaults.")
    ap.add_argument("--version", action="version", version=f"sparkccl {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--world", type=_world, default=4, help="local ranks (processes), 2..8")
    common.add_argument("--topology", choices=TOPOLOGIES, default="mesh",
                        help="mesh (a switch: every rank to every rank) or ring (switchless)")
    common.add_argument("--transport", choices=TRANSPORTS, default="shm",
                        help="how the ranks' data travels (see `sparkccl --help`)")
    common.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the tensors live (cuda: one GPU per rank, shared when "
                             "there are fewer GPUs than ranks)")

    d = _sub(sub, "demo", "run every collective on local ranks and check every bit",
             parents=[common])
    d.add_argument("--quick", action="store_true", help="fewer sizes and shorter bursts")
    d.set_defaults(func=_cmd_demo)

    b = _sub(sub, "bench", "bandwidth table (nccl-tests columns) with torch.distributed "
             "baselines measured in the same run", parents=[common])
    b.add_argument("--min-bytes", type=_bytes, default="1M",
                   help="smallest size (the whole buffer), e.g. 65536, 64K, 1M")
    b.add_argument("--max-bytes", type=_bytes, default="64M", help="largest size")
    b.add_argument("--iters", type=_positive, default=5, help="timed calls per size")
    b.add_argument("--no-baseline", action="store_true",
                   help="skip torch.distributed (gloo on CPU, NCCL three ways on CUDA)")
    b.add_argument("--baseline", action="append", metavar="NAME",
                   help="only this baseline (repeatable): gloo on cpu; nccl, nccl-p2p-off, "
                        "nccl-sockets on cuda (default: all of the device's)")
    b.add_argument("--plot", metavar="FILE.png",
                   help="also draw bus bandwidth against size for sparkccl and each baseline "
                        "(needs matplotlib: pip install 'sparkccl[plot]')")
    b.add_argument("--api", choices=["direct", "torch"], default="direct",
                   help="torch: also time the calls through torch.distributed (backend "
                        "\"sparkccl\") and print the overhead against the direct API")
    from .bench import COLLECTIVES
    b.add_argument("--collective", action="append", choices=COLLECTIVES, metavar="NAME",
                   help="a table to print (repeatable): " + ", ".join(COLLECTIVES) +
                        " (ep: one MoE layer's dispatch + combine per token count, beside "
                        "the all-gather + reduce-scatter formulation and torch.distributed's "
                        "all-to-all of the same rows) (default: all_gather, reduce_scatter)")
    e = b.add_argument_group("--collective ep", "the MoE layer (every rank the same shape)")
    e.add_argument("--tokens", type=_token_counts, default="128,1024",
                   help="tokens per rank, one row each (comma-separated)")
    e.add_argument("--hidden", type=_positive, default=2048, help="hidden size (bf16)")
    e.add_argument("--topk", type=_positive, default=8, help="experts per token")
    e.add_argument("--experts-per-rank", type=_positive, default=8,
                   help="experts each rank holds")
    e.add_argument("--ep-mode", choices=["high_throughput", "low_latency"],
                   default="high_throughput", help="the ExpertParallel mode")
    b.set_defaults(func=_cmd_bench)

    p = _sub(sub, "plan", "print a collective's per-port load against its lower bound, and "
             "whether the verifier proves its schedule")
    p.add_argument("--collective", choices=["all_gather", "reduce_scatter", "all_reduce"],
                   required=True,
                   help="which collective")
    p.add_argument("--topology", choices=TOPOLOGIES, default="mesh", help="the topology")
    p.add_argument("--world", type=_world, default=4, help="ranks, 2..8")
    p.add_argument("--roots", type=int, choices=[1, 2], default=2,
                   help="PCIe functions (roots) per port that traffic is split over")
    p.set_defaults(func=_cmd_plan)

    from . import doctor, selftest
    for module in (doctor, selftest):
        p = module.add_parser(sub)
        p.formatter_class = _Formatter
        p.description = plain_text(p.description)  # (their module docstrings)
    return ap


def plain_text(doc: str) -> str:
    """A docstring as help text: reST roles and literals as plain `quoted` words."""
    import re
    doc = re.sub(r":(?:class|func|meth|mod|data|attr):`~?\.?([^`]+)`", r"`\1`", doc)
    doc = re.sub(r"\*\*([^*]+)\*\*", r"\1", doc)  # bold
    doc = re.sub(r"::$", ":", doc, flags=re.M)  # a literal block's marker
    return doc.replace("``", "`")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        # run_ranks has stopped the ranks by now; the traceback would say nothing more.
        print(f"sparkccl {args.command}: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
