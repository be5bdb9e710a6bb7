#!/usr/bin/env bash
# Runs on the nvidia-h200-x2 machine in one device call: install, then the stages named in
# STAGES (default: all, in this order), each under its own time limit. Results land in $OUT
# (or ./h200_out when run by hand), one file per stage.
#   topo     where the GPUs sit (nvidia-smi topo, NUMA nodes, huge-page settings)
#   duplex   benchmarks/pcie_duplex.py on both GPUs at once, then on GPU 0 alone
#   backing  the same, both GPUs, copy engines and SM copies both ways, for each kind of host
#            memory (small pages, transparent huge pages, /dev/shm without and with huge
#            pages) at 64 and 128 MiB
#   ring     the same, both GPUs, each reading the host ring its neighbour writes, for ring
#            sizes RINGS (MiB; default 1 2 4 8 16 32 128): does cache-resident host memory
#            (Intel DDIO) lift the both-ways limit?
#   waits    the data movement of a world-2 ce collective at 64 and 256 MiB (each GPU writes
#            its slice in 16 units, each published by a value write, while reading the peer's)
#            with no waits, with cuStreamWaitValue64 and with a spin kernel per unit; and
#            the same bytes as single cold copies
#   cesmall  sparkccl bench 4-64 MiB, fused then ce forced (where ce starts to pay)
#   ce       sparkccl bench 64-256 MiB, copy-engine engine forced (SPARKCCL_DIRECT_MODE=ce)
#   ce32     the same with 32 hardware queues per process (CUDA_DEVICE_MAX_CONNECTIONS=32)
#   bench    sparkccl bench BENCH_MIN (1M) - 256 MiB, NCCL three ways in the same run, in the
#            engine SPARKCCL_DIRECT_MODE names (the default if unset)
#   tests    the GPU tests (pytest -m cuda)
#   demos    sparkccl demo --device cuda, world 2 and 4, mesh and ring
#   demosce  the same with the copy-engine engine at every size (SPARKCCL_CE_MIN_BYTES=0)
#   finalize benchmarks/finalize_bench.py
# e.g. STAGES="duplex ce" bash benchmarks/h200_x2.sh
set -u
OUT=${OUT:-h200_out}
STAGES=${STAGES:-duplex ce bench tests demos finalize}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/install.log" 2>&1 \
  || { tail -30 "$OUT/install.log"; exit 1; }
nvidia-smi -L
git log -1 --format='tree: %h %s' 2>/dev/null
stage() { echo "== $* ($(date +%T))"; }
demo() {
  stage "demo --device cuda --world $1 --topology $2"
  timeout 150 sparkccl demo --device cuda --world "$1" --topology "$2" --quick 2>&1 | tail -5
}
for s in $STAGES; do
  case $s in
    topo)
      { nvidia-smi topo -m; lscpu | grep -i -E "numa|socket|model name"
        for d in /sys/bus/pci/devices/*; do
          [ "$(cat "$d/vendor")" = 0x10de ] && echo "$d numa_node $(cat "$d/numa_node")"; done
        grep -H . /sys/kernel/mm/transparent_hugepage/enabled \
          /sys/kernel/mm/transparent_hugepage/shmem_enabled; grep -i huge /proc/meminfo
      } 2>&1 | tee "$OUT/topo.txt" ;;
    backing)
      # (shmthp needs shmem huge pages allowed; this VM is ours alone for the call)
      echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null
      for b in anon thp shm shmthp; do for m in 64 128; do
        stage "link duplex, both GPUs, $b, $m MiB"
        timeout 60 python3 benchmarks/pcie_duplex.py --gpus 0 --backing $b --mib $m \
          --cases ce/ce,sm/sm,ce/-,-/ce 2>&1 | tee -a "$OUT/backing.txt"
      done; done ;;
    ring)
      for r in ${RINGS:-1 2 4 8 16 32 128}; do
        stage "link duplex, both GPUs, ring $r MiB"
        timeout 60 python3 benchmarks/pcie_duplex.py --gpus 0 --ring "$r" --chunk-kib "${CHUNK_KIB:-1024}" \
          --cases ce/ce,sm/smcv,ce/-,-/ce 2>&1 | tee -a "$OUT/ring.txt"
      done ;;
    waits)
      for m in 32 128; do
        for w in none value kernel; do
          stage "ce collective's movement, $m MiB per direction, waits: $w"
          timeout 60 python3 benchmarks/pcie_duplex.py --gpus 0 --mib $m --ring $m \
            --chunk-kib $((m * 64)) --wait $w --cases ce/ce 2>&1 | tee -a "$OUT/waits.txt"
        done
        stage "cold single copies, $m MiB per direction"
        timeout 60 python3 benchmarks/pcie_duplex.py --gpus 0 --mib $m --cases ce/ce,ce/-,-/ce \
          2>&1 | tee -a "$OUT/waits.txt"
      done ;;
    cesmall)
      for mode in fused ce; do
        stage "bench 4-64 MiB, SPARKCCL_DIRECT_MODE=$mode"
        SPARKCCL_DIRECT_MODE=$mode SPARKCCL_TIMEOUT_S=20 timeout 100 sparkccl bench --device cuda \
          --world 2 --min-bytes 4M --max-bytes 64M --iters 10 --no-baseline 2>&1 | tee -a "$OUT/cesmall.txt"
      done ;;
    duplex)
      stage "link duplex, both GPUs at once"
      timeout 120 python3 benchmarks/pcie_duplex.py --gpus 0 2>&1 | tee "$OUT/duplex.txt"
      stage "link duplex, GPU 0 alone"
      timeout 60 python3 benchmarks/pcie_duplex.py 2>&1 | tee -a "$OUT/duplex.txt" ;;
    ce)
      stage "bench, copy engines forced (SPARKCCL_DIRECT_MODE=ce)"
      SPARKCCL_DIRECT_MODE=ce SPARKCCL_TIMEOUT_S=20 timeout 150 sparkccl bench --device cuda \
        --world 2 --min-bytes 64M --max-bytes 256M --iters 5 --no-baseline 2>&1 | tee "$OUT/ce.txt" ;;
    ce32)
      stage "bench, copy engines forced, CUDA_DEVICE_MAX_CONNECTIONS=32"
      CUDA_DEVICE_MAX_CONNECTIONS=32 SPARKCCL_DIRECT_MODE=ce SPARKCCL_TIMEOUT_S=20 timeout 150 \
        sparkccl bench --device cuda --world 2 --min-bytes 64M --max-bytes 256M --iters 5 \
        --no-baseline 2>&1 | tee "$OUT/ce32.txt" ;;
    bench)
      stage "bench, engine ${SPARKCCL_DIRECT_MODE:-default}, NCCL three ways in the same run"
      timeout 400 sparkccl bench --device cuda --world 2 --min-bytes "${BENCH_MIN:-1M}" --max-bytes 256M \
        --iters 10 2>&1 | tee "$OUT/bench.txt" ;;
    tests)
      stage "GPU tests"
      timeout 420 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda_dataplane.py \
        tests/test_finalize.py -m cuda 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt" ;;
    demos)
      { demo 2 mesh; demo 2 ring; demo 4 mesh; demo 4 ring; } | tee "$OUT/demo_cuda.txt" ;;
    demosce)
      export SPARKCCL_CE_MIN_BYTES=0
      { demo 2 mesh; demo 2 ring; demo 4 mesh; demo 4 ring; } | tee "$OUT/demo_cuda_ce.txt"
      unset SPARKCCL_CE_MIN_BYTES ;;
    finalize)
      stage "finalize bench"
      timeout 300 python3 benchmarks/finalize_bench.py --out "$OUT/finalize_bench.txt" 2>&1 | tail -25 ;;
    *) echo "unknown stage $s" ;;
  esac
done
stage "done"
