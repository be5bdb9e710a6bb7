#!/usr/bin/env bash
# Issue 32's GPU fault campaign on one GPU (ranks sharing it), 40 cases of the extended draw
# (benchmarks/fault_campaign.py --device cuda --extended --seed 32 --max-world 4: kill,
# stop, pyexit, and slow-but-alive slowstop / starve, in every collective), in two calls of
# at most ~9 min:
#   bash benchmarks/fault_campaign_gpu.sh stop     # cases 0..19, SPARKCCL_ON_FAILURE=stop,
#                                                  # under MPS (a time-sliced GPU can wedge
#                                                  # when two processes trap at once:
#                                                  # benchmarks/fault_campaign_cuda_h200.txt;
#                                                  # under MPS a stopped rank holds the others
#                                                  # after their traps instead:
#                                                  # benchmarks/fault_campaign_gpu_h200.txt)
#   bash benchmarks/fault_campaign_gpu.sh poison   # cases 20..39, SPARKCCL_ON_FAILURE=poison
# The record goes to ${OUT:-.}/fault_campaign_gpu_<mode>.txt as each case ends (a call cut
# short still leaves it); this script's output to ${OUT:-.}/fault_campaign_gpu_<mode>.log.
# SPAWN=1: start every rank as a fresh interpreter (if forking from the warm server fails).
set -u
cd "$(dirname "$0")/.."
MODE=${1:-stop}
case "$MODE" in
  stop) FIRST=0 ;;
  poison) FIRST=20 ;;
  *) echo "usage: $0 stop|poison" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
BUDGET_S=${BUDGET_S:-500}
T0=$(date +%s)
exec > >(tee "${OUT:-.}/fault_campaign_gpu_$MODE.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader || true
git log -1 --format='tree %h %s' 2>/dev/null || true
nproc; date -u
# A fresh machine has no kernel cache: compile once here, not in every rank at once.
timeout 150 "$PY" -c "from sparkccl.dataplane import cuda_runtime as r; print(len(r.kernels_for(0)), 'kernels')"
if [ "$MODE" = stop ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p /tmp/mps /tmp/mpslog
  nvidia-cuda-mps-control -d 2>/dev/null || true
fi
LEFT=$((BUDGET_S - ($(date +%s) - T0)))
echo "== campaign ($MODE, cases $FIRST..$((FIRST + 19)), limit ${LEFT} s) $(date -u +%T)"
timeout "$LEFT" "$PY" benchmarks/fault_campaign.py --device cuda --extended --seed 32 \
  --max-world 4 --first "$FIRST" --cases 20 --on-failure "$MODE" --rank-timeout 60 \
  ${SPAWN:+--spawn} --out "${OUT:-.}/fault_campaign_gpu_$MODE.txt"
rc=$?
[ "$MODE" = stop ] && { echo quit | nvidia-cuda-mps-control 2>/dev/null || true; }
echo "== done rc=$rc after $(( $(date +%s) - T0 )) s"; date -u
exit $rc
