#!/usr/bin/env bash
# One call on the nvidia-h200-x2 machine: install, GPU tests, CUDA demos, and the benchmarks
# committed under benchmarks/. Results land in $OUT (or ./h200_out when run by hand).
# SKIP_TESTS=1 / SKIP_BENCH=1 leave out the pytest stage / the bandwidth bench.
set -u
OUT=${OUT:-h200_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/install.log" 2>&1 \
  || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi -L | tee "$OUT/gpus.txt"
stage() { echo "== $*"; }
demo() {
  stage "demo --device cuda --world $1 --topology $2"
  timeout 150 sparkccl demo --device cuda --world "$1" --topology "$2" --quick 2>&1 | tail -5
}
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  stage "GPU tests"
  timeout 480 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_dataplane.py \
    tests/test_finalize.py -m cuda 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
fi
{ demo 2 mesh; demo 2 ring; } | tee "$OUT/demo_cuda.txt"
stage "finalize bench"
timeout 300 python3 benchmarks/finalize_bench.py --out "$OUT/finalize_bench.txt" 2>&1 | tail -25
{ demo 4 mesh; demo 4 ring; } | tee -a "$OUT/demo_cuda.txt"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  stage "link duplex (GPU 0)"
  timeout 120 python3 benchmarks/pcie_duplex.py 2>&1 | tee "$OUT/pcie_duplex.txt"
  stage "bench (default engine: SPARKCCL_DIRECT_MODE=fused)"
  timeout 300 sparkccl bench --device cuda --world 2 --min-bytes 1M --max-bytes 256M --iters 5 \
    2>&1 | tee "$OUT/bench_cuda_x2.txt"
  stage "bench, copy engines from 32 MiB per rank (SPARKCCL_DIRECT_MODE=auto), same machine"
  SPARKCCL_DIRECT_MODE=auto SPARKCCL_TIMEOUT_S=30 timeout 150 sparkccl bench --device cuda \
    --world 2 --min-bytes 64M --max-bytes 256M --iters 5 --no-baseline 2>&1 | tee "$OUT/bench_cuda_x2_auto.txt"
fi
