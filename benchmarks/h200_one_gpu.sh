#!/usr/bin/env bash
# Device calls on nvidia-h200 (one GPU; ranks share it): build this tree (and BASE, an
# earlier tree checked out beside it, for the A/B), then the stages named in STAGES, each
# under its own time limit. Results land in $OUT (or ./h200_out by hand), one file per stage.
#   tests  the GPU tests (pytest -m cuda) of the whole suite (more than one call's limit:
#          tests1 and tests2 split it, the data plane's and all-reduce's files, then the rest)
#   demos  sparkccl demo --device cuda, world 2 and 4, mesh and ring (DEMOS="2:mesh 4:ring" picks)
#   torch  the torch.distributed backend's GPU tests (tests/test_torch_backend.py -m cuda)
#   eplat  expert parallelism: its GPU tests (EP_TESTS_ONLY=1: only they), then benchmarks/ep_latency.py under MPS for EP_CASES
#          (world[:combine_rows|:torch], default "2 4 2:640 4:384 2:torch"; torch: the torch-op dispatch)
#   ab     sparkccl bench, BASE against this tree, interleaved B T B T under MPS (host time
#          per call and GPU time per collective, default engines)
#   ar     benchmarks/allreduce_regimes.py, world 2 and 4, eager and replayed, under MPS
#   ep_ab  benchmarks/ep_latency.py, BASE against this tree, interleaved under MPS (EP_AB_WORLDS,
#          AB_ROUNDS; EP_AB_ENV=SPARKCCL_GPU_DIRECT=0 for the proxy path)
#   epsized  benchmarks/ep_latency.py: the dispatch blocks' all-to-all sized, unsized, sized-empty,
#          both paths, EPSIZED_WORLDS (default "2 4"), with and without the GPU step timeline
#   epht   benchmarks/ep_bench.py high-throughput at prefill sizes (4096 tokens x 7168, top-8 of 64
#          experts per rank, world 4), the fused and the torch-op dispatch in the same run
#   ep     benchmarks/ep_bench.py low-latency (128 tokens x 7168, top-8 of 64 experts per rank)
#   epbench  sparkccl bench --collective ep, world 2, x 7168, top-8 of 64 experts per rank:
#          high-throughput 128 and 4096 tokens, low-latency 128 (EPBENCH_ARGS, default --no-baseline:
#          NCCL takes no two ranks on one GPU; on nvidia-h200-x2 pass --baseline nccl)
#   decode the one-shot all-reduce (issue 30): its GPU tests, then benchmarks/decode_latency.py
#          world 2 and 4 (DECODE_WORLDS; DECODE_ARGS: more arguments) under MPS (GPU-direct and proxy path beside their floors), and the
#          proxy's publish -> post figures at 8 and 64 KiB (SPARKCCL_GPU_STAMPS)
#   decode_ab  the one-shot all-reduce, BASE against this tree in one call (kernels compiled
#          first, then interleaved runs of decode_latency.py, world 2, 8 KiB: DECODE_AB_MAX,
#          DECODE_AB_PATHS; AB_ROUNDS)
#   decode_roots  the proxy path at 8 KiB alone (so the proxy's stats are of that size), world 2,
#          the default roots against SPARKCCL_ROOTS=1, interleaved (AB_ROUNDS), each with its
#          GPU step timeline (decode_latency_h200.txt section 11: what one root saves)
# DECODE_TESTS=0: the decode stage without its tests (tests2 holds them); DECODE_PROXY_SIZES="":
# without the proxy's figures; AB_ROUNDS, AB_MAX: the
# A/B's rounds (2) and largest size (64M).
# e.g. STAGES="tests demos" bash benchmarks/h200_one_gpu.sh
#      STAGES="ab ar ep" BASE=.base bash benchmarks/h200_one_gpu.sh
set -u
OUT=${OUT:-h200_out}
STAGES=${STAGES:-tests demos}
BASE=${BASE:-}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
build() {  # the native module in place, so PYTHONPATH=<tree> selects the tree
  (cd "$1" && cmake -S . -B "/tmp/build-$2" -DPython_EXECUTABLE="$(which python3)" \
     -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build "/tmp/build-$2" -j16 >/dev/null \
     && cp /tmp/build-"$2"/_native*.so sparkccl/) || { echo "build of $1 failed"; exit 1; }
}
build . tree
python3 -m pip install -q --no-build-isolation --no-deps . >"$OUT/install.log" 2>&1 \
  || { tail -30 "$OUT/install.log"; exit 1; }
[ -n "$BASE" ] && build "$BASE" base
export PYTHONPATH=$PWD
nvidia-smi -L
stage() { echo "== $* ($(date +%T))"; }
mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d 2>/dev/null || true
}
compile_both() {  # BASE's and this tree's kernels compiled first, side by side (for the A/Bs)
  for root in "$PWD/$BASE" "$PWD"; do
    (cd "$root" && PYTHONPATH=$root python3 -c "import torch; from sparkccl.dataplane import \
nvrtc as n; n.compile_cubin(n.arch_of(torch.cuda.get_device_capability(0)))" >/dev/null 2>&1) &
  done; wait
}
mps_off() { echo quit | nvidia-cuda-mps-control 2>/dev/null; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
for s in $STAGES; do
  case $s in
    tests|tests1|tests2)
      sel=(tests)
      [ $s = tests1 ] && sel=(tests/test_cuda_dataplane.py tests/test_allreduce.py)
      [ $s = tests2 ] && sel=(tests --ignore=tests/test_cuda_dataplane.py --ignore=tests/test_allreduce.py)
      stage "GPU tests ($s: ${sel[*]})"
      timeout ${TESTS_S:-420} python3 -m pytest -q -rs -p no:cacheprovider -m cuda "${sel[@]}" 2>&1 \
        | tail -40 | tee "$OUT/gpu_$s.txt" ;;
    demos)
      for wt in ${DEMOS:-2:mesh 2:ring 4:mesh 4:ring}; do
        w=${wt%%:*} t=${wt##*:}
        stage "demo --device cuda --world $w --topology $t"
        timeout 120 python3 -m sparkccl.cli demo --device cuda --world $w --topology $t --quick 2>&1 | tail -3
      done | tee "$OUT/demo_cuda.txt" ;;
    torch)
      stage "torch.distributed backend GPU tests"
      timeout ${TESTS_S:-300} python3 -m pytest -q -rs -p no:cacheprovider -m cuda \
        tests/test_torch_backend.py 2>&1 | tail -20 | tee "$OUT/gpu_torch.txt" ;;
    eplat)
      stage "EP GPU tests"
      timeout ${TESTS_S:-300} python3 -m pytest -q -rs -p no:cacheprovider -m cuda \
        tests/test_expert_parallel.py tests/test_ep_sized_combine.py 2>&1 | tail -20 \
        | tee "$OUT/gpu_ep.txt"
      [ "${EP_TESTS_ONLY:-0}" = 1 ] && continue
      mps_on
      for wc in ${EP_CASES:-2 4 2:640 4:384 2:torch}; do
        w=${wc%%:*} c=${wc#$w}; c=${c#:}; arg=()
        case $c in torch) arg=(--torch-dispatch) ;; ?*) arg=(--combine-rows $c) ;; esac
        stage "EP latency, world $w ${arg[*]}"
        timeout 150 python3 benchmarks/ep_latency.py --world $w "${arg[@]}" 2>&1
      done | tee "$OUT/ep_latency.txt"
      mps_off ;;
    ab)
      [ -n "$BASE" ] || { echo "ab needs BASE"; continue; }
      mps_on
      for round in $(seq ${AB_ROUNDS:-2}); do for t in base tree; do
        root=$PWD; [ $t = base ] && root=$PWD/$BASE
        stage "bench $t round $round ($root)"
        (cd "$root" && PYTHONPATH=$root SPARKCCL_TIMEOUT_S=20 timeout 150 python3 -m sparkccl.cli \
           bench --device cuda --world 2 --no-baseline --iters 30 --min-bytes 64K --max-bytes ${AB_MAX:-64M} 2>&1)
      done; done | tee "$OUT/ab.txt"
      mps_off ;;
    ar)
      mps_on
      for w in 2 4; do
        stage "all-reduce regimes, world $w"
        timeout 150 python3 benchmarks/allreduce_regimes.py --device cuda --world $w --graph 2>&1
      done | tee "$OUT/allreduce_regimes.txt"
      mps_off ;;
    decode)
      [ "${DECODE_TESTS:-1}" = 1 ] && stage "one-shot all-reduce GPU tests" &&
      { timeout ${TESTS_S:-420} python3 -m pytest -q -rs -p no:cacheprovider -m cuda \
          tests/test_cuda_allreduce.py tests/test_allreduce.py 2>&1 | tail -20
        timeout ${TESTS_S:-420} python3 -m pytest -q -rs -p no:cacheprovider -m "cuda and slow" \
          tests/test_failstop.py -k "kill-ar or stall-ar" 2>&1 | tail -20
      } | tee "$OUT/decode_tests.txt"
      mps_on
      for w in ${DECODE_WORLDS:-2 4}; do
        stage "decode latency, world $w"
        timeout 240 python3 benchmarks/decode_latency.py --world $w ${DECODE_ARGS:-} 2>&1
      done | tee "$OUT/decode_latency.txt"
      for n in ${DECODE_PROXY_SIZES-8192 65536}; do  # the proxy's own figures (benchmarks/proxy_latency_h200.txt)
        stage "proxy latency $n"
        SPARKCCL_GPU_STAMPS=1 SPARKCCL_GPU_DIRECT=0 timeout 120 python3 -m sparkccl.cli bench \
          --device cuda --world 2 --no-baseline --iters 200 --min-bytes $n --max-bytes $n 2>&1
      done | tee "$OUT/decode_proxy_latency.txt"
      mps_off ;;
    decode_roots)
      mps_on
      for round in $(seq ${AB_ROUNDS:-2}); do for roots in 2 1; do
        stage "decode roots $roots round $round"
        SPARKCCL_ROOTS=$roots timeout 90 python3 benchmarks/decode_latency.py \
          --world 2 --max-bytes 8192 --iters 200 --paths proxy 2>&1 | grep -v "^$"
        SPARKCCL_ROOTS=$roots timeout 90 python3 benchmarks/decode_latency.py --world 2 --timeline \
          --max-bytes 8192 --iters 100 --paths proxy 2>&1 | grep -A1 "GPU timeline"
      done; done | tee "$OUT/decode_roots.txt"
      mps_off ;;
    decode_ab)  # BASE against this tree, one device call (machines lent differ: an A/B only holds
      # within one): both trees' kernels compiled first, side by side, then interleaved runs
      [ -n "$BASE" ] || { echo "decode_ab needs BASE"; continue; }
      compile_both
      mps_on
      for round in $(seq ${AB_ROUNDS:-2}); do for t in base tree; do
        root=$PWD; [ $t = base ] && root=$PWD/$BASE
        stage "decode $t round $round"
        (cd "$root" && PYTHONPATH=$root timeout 60 python3 benchmarks/decode_latency.py --world 2 \
           --max-bytes ${DECODE_AB_MAX:-8192} --iters 200 --paths ${DECODE_AB_PATHS:-direct,proxy} 2>&1 \
           | grep -A2 "^# floor\|^bytes")
      done; done | tee "$OUT/decode_ab.txt"
      mps_off ;;
    ep_ab)  # BASE against this tree, one device call: benchmarks/ep_latency.py of each tree
      # (its own phases and blocks), interleaved under MPS, world EP_AB_WORLDS (default "2 4");
      # EP_AB_ENV: an environment setting for both (e.g. SPARKCCL_GPU_DIRECT=0, the proxy path)
      [ -n "$BASE" ] || { echo "ep_ab needs BASE"; continue; }
      compile_both
      mps_on
      for round in $(seq ${AB_ROUNDS:-2}); do for w in ${EP_AB_WORLDS:-2 4}; do for t in base tree; do
        root=$PWD; [ $t = base ] && root=$PWD/$BASE
        stage "ep_latency $t world $w round $round ${EP_AB_ENV:-}"
        (cd "$root" && env ${EP_AB_ENV:-} PYTHONPATH=$root timeout 150 \
           python3 benchmarks/ep_latency.py --world $w --iters 100 2>&1)
      done; done; done | tee "$OUT/ep_ab.txt"
      mps_off ;;
    epsized)  # the dispatch's blocks' all-to-all sized, unsized and sized-empty in one run,
      # each path (GPU-direct, proxy), worlds EPSIZED_WORLDS (default "2 4"), then with the GPU
      # step timeline (its kernels carry stamps: not the timed figures' build)
      mps_on
      for env in SPARKCCL_GPU_DIRECT=1 SPARKCCL_GPU_DIRECT=0; do for w in ${EPSIZED_WORLDS:-2 4}; do
        for tl in "" --timeline; do
          stage "ep_latency sized/unsized all-to-all, world $w $env $tl"
          env $env timeout 150 python3 benchmarks/ep_latency.py --world $w --iters 100 $tl \
            --phases "a2a dispatch,a2a dispatch unsized,a2a dispatch empty" 2>&1 | grep -v "^# \(floor\|fresh\|link\)"
        done
      done; done | tee "$OUT/epsized.txt"
      mps_off ;;
    epht)
      mps_on
      stage "EP high throughput (prefill), world 4, fused and torch-op dispatch"
      timeout 300 python3 benchmarks/ep_bench.py --device cuda --worlds 4 --tokens 4096 --hidden 7168 \
        --topk 8 --experts-per-rank 64 --slot-mib 256 --iters 5 --torch-dispatch 2>&1 | tee "$OUT/ep_bench_ht.txt"
      mps_off ;;
    epbench)
      mps_on
      for mode in high_throughput:128,4096 low_latency:128; do
        stage "sparkccl bench --collective ep, ${mode%%:*}"
        timeout 280 python3 -m sparkccl.cli bench --device cuda --world 2 --collective ep \
          --tokens ${mode##*:} --hidden 7168 --topk 8 --experts-per-rank 64 --ep-mode ${mode%%:*} \
          --iters 10 ${EPBENCH_ARGS:---no-baseline} 2>&1 | grep -v "^bench:"
      done | tee "$OUT/epbench.txt"
      mps_off ;;
    ep)
      mps_on
      stage "EP low latency"
      timeout 200 python3 benchmarks/ep_bench.py --device cuda --worlds 2 4 --tokens 128 --hidden 7168 \
        --topk 8 --experts-per-rank 64 --mode low_latency --slot-mib 256 2>&1 | tee "$OUT/ep_bench.txt"
      mps_off ;;
  esac
done
