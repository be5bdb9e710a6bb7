"""Generated bad input, at scale (issue 32): hypothesis draws bad calls and cross-rank
mismatches (tests/badinput.py) and each is checked; the summary is the record.

* a bad call (x / out of a wrong type, shape, dtype, stride, device; reduce_scatter_input;
  fused finalize with indices out of range, wrong sizes): refused with ValueError /
  TypeError, with a message, before anything is sent (seq and the proxy's ring unchanged);
  a world of two threads, and after all of them one all-gather and one reduce-scatter on
  both ranks, bit-exact;
* a cross-rank mismatch (sizes, sizes that pad to the same 16 bytes, collectives, dtypes of
  one width or not; all-gather, reduce-scatter, all-reduce): CollectiveError on every rank
  within the timeout + 1 s, naming both calls (exact bytes and dtype) where the collective
  is the same.

Before the publish entries carried the call word (issue 32), seed 1 found per-rank sizes
that round up to the same multiple of 16 bytes passing the size check with a wrong sum, and
dtypes of one width not told apart; the call word (docs/PROTOCOL.md "Publish ring") carries
the exact bytes, dtype and collective now. The mismatches run over each transport of
``--transports`` (default shm; tcp over loopback, verbs through the emulated NIC of
tests/emunic): the proxies deliver the call entries on every transport (docs/PROTOCOL.md
"Call words"); before that, tcp and verbs compared nothing.

::

    python benchmarks/bad_input.py --calls 400 --mismatches 60 --seed 1 --out benchmarks/bad_input_cpu.txt
    python benchmarks/bad_input.py --calls 40 --mismatches 60 --seed 1 --transports shm,tcp,verbs --out benchmarks/bad_input_transports.txt
"""
from __future__ import annotations

import argparse
import collections
import re
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--mismatches", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--transports", default="shm",
                    help="comma-separated: the mismatches run over each (shm, tcp, verbs)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    transports = a.transports.split(",")
    if "verbs" in transports:  # this process's verbs calls go to an emulated NIC
        import tempfile
        import emunic
        os.environ.update(emunic.host_env(tempfile.mkdtemp(prefix="bad-input-emunic-")))
    from hypothesis import HealthCheck, given, seed, settings
    import badinput as B
    from bench_record import emit

    conf = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
    lines = [f"generated bad input: seed {a.seed}; python benchmarks/bad_input.py "
             f"--calls {a.calls} --mismatches {a.mismatches} --seed {a.seed}"
             + (f" --transports {a.transports}" if a.transports != "shm" else "")]
    t0 = time.monotonic()
    comms = B.world()
    calls, problems = collections.Counter(), []

    @seed(a.seed)
    @settings(max_examples=a.calls, **conf)
    @given(data=B.st.data())
    def one_call(data):
        label, call, expected = data.draw(B.local_bad_calls(comms[0]))
        calls[re.sub(r"\d+", "N", label.split(" (")[0])] += 1
        p = B.refused(comms[0], label, call, expected)
        if p:
            problems.append(p)
    one_call()
    after = B.healthy(comms, 7)
    B.on_threads([c.close for c in comms])
    n_calls = sum(calls.values())
    lines.append(f"bad calls: {n_calls} drawn, {n_calls - len(problems)} refused before "
                 f"sending, {len(problems)} problems; collectives afterwards: "
                 f"{'exact' if after is None else after} ({time.monotonic() - t0:.1f} s)")
    for k, v in sorted(calls.items()):
        lines.append(f"  {v:5} {k}")
    lines += [f"  PROBLEM {p}" for p in problems]

    n_m, mism_problems = 0, []
    for transport in transports:
        t1 = time.monotonic()
        kinds = collections.Counter()
        outcomes = collections.Counter()
        problems_here = []

        @seed(a.seed)
        @settings(max_examples=a.mismatches, **conf)
        @given(case=B.mismatches())
        def one_mismatch(case):
            sub, specs = case
            kinds[sub] += 1
            p = B.run_mismatch(sub, specs, seed=len(kinds), transport=transport)
            if p is None:
                outcomes[sub + ": failed on every rank, naming both calls"] += 1
            else:
                outcomes[sub + ": PROBLEM"] += 1
                problems_here.append(f"{specs}: {p}")
        one_mismatch()
        n = sum(kinds.values())
        n_m += n
        lines.append(f"cross-rank mismatches over {transport}: {n} drawn "
                     f"({time.monotonic() - t1:.1f} s)")
        for k, v in sorted(outcomes.items()):
            lines.append(f"  {v:5} {k}")
        lines += [f"  PROBLEM {p}" for p in problems_here]
        mism_problems += problems_here
    lines.append(f"total generated: {n_calls + n_m}; problems: "
                 f"{len(problems) + len(mism_problems)}")
    emit(lines, a.out)
    return 0 if not problems and not mism_problems and after is None else 1


if __name__ == "__main__":
    sys.exit(main())
