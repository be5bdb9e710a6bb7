"""`sparkccl bench` on the network-namespace harness: ranks in separate "boxes".

Builds a switch or ring fabric (tests/netns.py), optionally shaped with ``tc`` (``--rate``
per link and root, e.g. 1gbit: a scaled-down pair of ~100 Gb/s roots), and runs the
same table as ``sparkccl bench --transport tcp`` with every rank in its own box. The gloo
baseline runs in the same invocation on the same boxes: on a switch over root 0's links
(``rt0``: gloo uses one interface, sparkccl both roots); on a ring over the management
bridge (``mg``: gloo needs every pair of ranks connected, which a ring fabric has not).

Needs root and iproute2. From the repository root::

    python benchmarks/netns_bench.py --fabric switch --world 4 --rate 1gbit
    python benchmarks/netns_bench.py --fabric ring --world 4 --max-bytes 16M
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import netns  # noqa: E402


def main(argv=None) -> int:
    from sparkccl.bench import run_bench
    from sparkccl.config import parse_bytes

    def _size(text: str) -> int:
        return parse_bytes(text, "a size")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fabric", choices=["switch", "ring"], default="switch")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--roots", type=int, choices=[1, 2], default=2)
    ap.add_argument("--rate", default=None, help="tc rate per link, e.g. 1gbit")
    ap.add_argument("--delay", default=None, help="tc netem delay per link, e.g. 100us")
    ap.add_argument("--min-bytes", type=_size, default=1 << 20)
    ap.add_argument("--max-bytes", type=_size, default=16 << 20)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--congestion", default=None,
                    help="TCP congestion control in the boxes, e.g. cubic (default: the host's)")
    a = ap.parse_args(argv)
    why = netns.unavailable_reason()
    if why:
        print(f"netns_bench: {why}")
        return 2
    topology = "mesh" if a.fabric == "switch" else "ring"
    gloo_if = "rt0" if a.fabric == "switch" else "mg"
    with netns.Fabric(a.fabric, a.world, a.roots, rate=a.rate, delay=a.delay,
                      congestion=a.congestion) as fab:
        print(f"netns harness: {a.fabric} fabric of {a.world} boxes, {a.roots} root link(s) per "
              f"port" + (f", {a.rate} per link" if a.rate else ", unshaped")
              + (f", {a.delay} delay" if a.delay else "")
              + (f", TCP {a.congestion}" if a.congestion else "")
              + f"; gloo over {gloo_if}")

        def runner(fn, args, env):
            e = dict(env or {})
            e.setdefault("GLOO_SOCKET_IFNAME", gloo_if)
            e.setdefault("SPARKCCL_ROOTS", str(a.roots))
            return fab.run(fn, args, env=e, timeout_s=1800)

        out = io.StringIO()
        with contextlib.redirect_stdout(_Tee(out, sys.stdout)):
            rc = run_bench(world=a.world, topology=topology, transport="tcp", device="cpu",
                           min_bytes=a.min_bytes, max_bytes=a.max_bytes, iters=a.iters,
                           baseline=not a.no_baseline, runner=runner)
        if rc == 0 and a.rate:
            _against_line_rate(out.getvalue(), topology, a.world, a.roots, a.rate)
        return rc


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self):
        for s in self.streams:
            s.flush()


def _rate_gbps(rate: str) -> float:
    """tc's rate ("1gbit", "200mbit", "500kbit") in Gb/s."""
    units = {"gbit": 1.0, "mbit": 1e-3, "kbit": 1e-6, "bit": 1e-9}
    for u, f in units.items():
        if rate.lower().endswith(u):
            return float(rate[:-len(u)]) * f
    raise ValueError(f"--rate {rate!r}: expected e.g. 1gbit, 200mbit")


def _against_line_rate(table: str, topology: str, world: int, roots: int, rate: str) -> None:
    """Gb/s each rank received (busbw x 8) next to the plan's line-rate bound: the tc rate
    per root link x roots / the plan's max port load (slices per call through the busiest
    port) x (world - 1)."""
    sys.path.insert(0, HERE)
    from emunic_efficiency import max_port_load
    print(f"\nagainst the line rate ({rate} per root link, {roots} root(s)):")
    print(f"{'collective':<15} {'size':>10} {'Gb/s/rank':>9} {'bound':>7} {'of bound':>8}")
    section = None
    for line in table.splitlines():
        words = line.split()
        if words in (["all_gather"], ["reduce_scatter"]):
            section = words[0]
            bound = (world - 1) * _rate_gbps(rate) * roots / max_port_load(topology, world,
                                                                            roots, section)
        elif section and words and words[0].isdigit():
            # what each rank received, from the time column (us; the busbw column's 3
            # decimals of GB/s would round the result in steps of 2% of the bound)
            got = (world - 1) / world * int(words[0]) * 8 / (float(words[1]) * 1e3)
            print(f"{section:<15} {int(words[0]):>10} {got:>9.3f} {bound:>7.3f} "
                  f"{got / bound:>7.0%}")


if __name__ == "__main__":
    sys.exit(main())
