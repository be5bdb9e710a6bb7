"""``PYTHONPATH=tests python -m emunic DIR [rate_gbps=R] [reorder_ms=D]``: make a GB10 host
behind the emulated RoCE NIC under DIR and print the shell exports that select it, e.g.

    eval "$(PYTHONPATH=tests python -m emunic /tmp/gb10)"
    sparkccl demo --transport verbs
    torchrun --nproc-per-node 2 -m sparkccl.cli selftest --transport verbs
"""
import shlex
import sys

import emunic

if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
    print(__doc__)
    sys.exit(0 if len(sys.argv) >= 2 else 2)
opts = dict(a.split("=", 1) for a in sys.argv[2:])
env = emunic.host_env(sys.argv[1], **{k: float(v) for k, v in opts.items()})
for k, v in env.items():
    print(f"export {k}={shlex.quote(v)}")
