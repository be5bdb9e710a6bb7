#!/usr/bin/env bash
# Issue 18 on the GPU machine (one GPU, ranks sharing it), in one call of at most ~8 min
# (typically 5); everything also goes to ${OUT:-.}/failstop_gpu.txt:
#   1. the CUDA fault campaign's hung case in small (tests/test_failstop.py "rs_split":
#      world 3 mesh, a peer killed inside a run of fused GPU-direct reduce-scatters split in
#      two per call; stop, poison, and the copy engines), and poison-mode recovery (a new
#      communicator in the same process);
#   2. that case itself, replayed (benchmarks/fault_campaign.py --case: world 6 mesh, rank 0
#      killed at call 4, 15.2 ms in; the collectives of seed 1 case 0);
#   3. the earlier fail-stop / poison scenarios (world 2 mesh, world 4 ring; kill and stall;
#      all-gather, reduce-scatter, finalize, ce engine, proxy path);
#   4. a few seeded random cases of the CUDA fault campaign;
#   5. the in-process data-plane failure tests on the real kernels (with the host releasing
#      stream value waits whose kernels never ran), and one healthy end-to-end run through
#      the Communicator (default mode stop), bit-exact.
# A rank that hangs prints its threads' stacks and GPU failure words (test_failstop after
# 30 s, the campaign after 30 s; both kill it later), so a hang is never a silent timeout.
# Each step's limit is cut to what is left of BUDGET_S, so the call ends in time.
# Usage: bash benchmarks/failstop_gpu.sh   (from the repository root)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
LOG="${OUT:-.}/failstop_gpu.txt"
BUDGET_S=${BUDGET_S:-470}
T0=$(date +%s)
exec > >(tee "$LOG") 2>&1
rc=0

# step NAME LIMIT_S COMMAND...: run with the smaller of LIMIT_S and the time left.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - ($(date +%s) - T0)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "== $name: SKIPPED (budget spent)"
    rc=1
    return
  fi
  echo "== $name (limit ${limit} s) $(date -u +%T)"
  timeout "$limit" "$@"
  local r=$?
  echo "== $name rc=$r ($(( $(date +%s) - T0 )) s in)"
  [ $r -ne 0 ] && rc=$r
}

nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader || true
git log -1 --format='tree %h %s' 2>/dev/null || true
date -u
# The kernels changed: compile them once here (cached on disk), not in every rank at once.
step "compile the kernels" 120 \
  "$PY" -c "from sparkccl.dataplane import cuda_runtime as r; print(len(r.kernels_for(0)), 'kernels')"
step "campaign case in small + poison recovery" 120 \
  "$PY" -m pytest -v -s -p no:cacheprovider -m cuda tests/test_failstop.py \
  -k "rs_split or recovers"
step "campaign replay: shm/mesh w6 kill rank 0 at call 4 mid-piece +15.2 ms" 100 \
  "$PY" benchmarks/fault_campaign.py --device cuda --seed 1 --index 0 --rank-timeout 75 \
  --case shm/mesh/6/kill/0/4/mid-piece/15.2
step "earlier fail-stop scenarios" 200 \
  "$PY" -m pytest -v -s -p no:cacheprovider -m cuda tests/test_failstop.py \
  -k "not rs_split and not recovers"
step "campaign, seeded cases" 110 \
  "$PY" benchmarks/fault_campaign.py --device cuda --cases 3 --seed 7 --rank-timeout 45
step "dataplane failure tests (and the host's release of stuck stream waits)" 50 \
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_dataplane.py \
  -m cuda -k "timeout_raises or abort_stops or close_while or stream_value_waits"
step "healthy end to end" 30 \
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_dataplane.py \
  -k "test_communicator_cuda and mesh-2-"
echo "== done rc=$rc after $(( $(date +%s) - T0 )) s"; date -u
exit $rc
