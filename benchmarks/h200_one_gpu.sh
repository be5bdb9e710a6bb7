#!/usr/bin/env bash
# One device call on nvidia-h200 (one GPU, ranks sharing it): install this tree, then the
# stages named in STAGES (default: all, in this order), each under its own time limit.
# Results land in $OUT (or ./h200_out by hand), one file per stage.
#   tests  the GPU tests (pytest -m cuda) of the whole suite
#   ab     host and GPU time per collective, the tree against BASE (a checkout of an earlier
#          tree with its native module built in place), interleaved A B A B under MPS
#   demos  sparkccl demo --device cuda, world 2 and 4, mesh and ring
#   ar     benchmarks/allreduce_latency.py (decode all-reduce, eager and replayed, under MPS)
# e.g. STAGES="tests ab" BASE=.base bash benchmarks/h200_one_gpu.sh
set -u
OUT=${OUT:-h200_out}
STAGES=${STAGES:-tests ab demos ar}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/install.log" 2>&1 \
  || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi -L
stage() { echo "== $* ($(date +%T))"; }
mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d 2>/dev/null || true
}
mps_off() { echo quit | nvidia-cuda-mps-control 2>/dev/null; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
bench() {  # $1: tree root (PYTHONPATH) ; the rest: extra args
  local root=$1; shift
  PYTHONPATH=$root SPARKCCL_TIMEOUT_S=20 timeout 200 python3 -m sparkccl.cli bench --device cuda \
    --world 2 --no-baseline --iters 30 "$@" 2>&1 | grep -v -E "^\s*$"
}
for s in $STAGES; do
  case $s in
    tests)
      stage "GPU tests"
      timeout 480 python3 -m pytest -q -rs -p no:cacheprovider -m cuda tests 2>&1 \
        | tail -25 | tee "$OUT/gpu_tests.txt" ;;
    ab)
      BASE=${BASE:-.base}
      ( cd "$BASE" && cmake -S . -B /tmp/build-base -DPython_EXECUTABLE=$(which python3) \
          -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build /tmp/build-base -j8 >/dev/null \
          && cp /tmp/build-base/_native*.so sparkccl/ ) || { echo "base build failed"; continue; }
      mps_on
      for round in 1 2; do
        for t in base tree; do
          root=$PWD; [ $t = base ] && root=$PWD/$BASE
          stage "bench $t round $round"
          bench "$root" --min-bytes 64K --max-bytes 64M
        done
      done 2>&1 | tee "$OUT/ab.txt"
      mps_off ;;
    demos)
      for w in 2 4; do for t in mesh ring; do
        stage "demo --device cuda --world $w --topology $t"
        timeout 150 sparkccl demo --device cuda --world $w --topology $t --quick 2>&1 | tail -4
      done; done | tee "$OUT/demo_cuda.txt" ;;
    ar)
      [ -f benchmarks/allreduce_latency.py ] || { echo "no allreduce_latency.py"; continue; }
      mps_on
      stage "all-reduce latency"
      timeout 240 python3 benchmarks/allreduce_latency.py 2>&1 | tee "$OUT/allreduce_latency.txt"
      mps_off ;;
  esac
done
