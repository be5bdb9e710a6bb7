#!/usr/bin/env bash
# Issue 18 on the GPU machine (one GPU, ranks sharing it), in one call (at most 5 min,
# typically 3):
#   1. the fail-stop / poison scenarios (tests/test_failstop.py): world 2 mesh and world 4
#      ring, a peer killed or stalled in the middle of a run of all-gathers (and one
#      reduce-scatter, one finalize, the "ce" engine and the proxy path), survivors in
#      their own processes;
#   2. the in-process data-plane failure tests on the real kernels (timeout, abort, close),
#      now followed by the poison kernel;
#   3. one healthy end-to-end run through the Communicator (default mode stop), bit-exact.
# Usage: bash benchmarks/failstop_gpu.sh [extra pytest args]   (from the repository root)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader || true
date -u
rc=0
timeout 230 "$PY" -m pytest -v -s -p no:cacheprovider -m cuda tests/test_failstop.py "$@" || rc=$?
echo "== test_failstop rc=$rc"; date -u
timeout 40 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_dataplane.py \
  -m cuda -k "timeout_raises or abort_stops or close_while" "$@" || rc=$?
echo "== dataplane failure tests rc=$rc"; date -u
timeout 30 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_dataplane.py \
  -k "test_communicator_cuda and mesh-2-" "$@" || rc=$?
echo "== done rc=$rc"; date -u
exit $rc
