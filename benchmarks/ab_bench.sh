#!/usr/bin/env bash
# Host time per call and GPU time per collective, tree A against tree B, interleaved on one
# machine (run it under MPS when the ranks share a GPU): `sparkccl bench` of each tree in
# turn, for the default engine choice, mode ce forced at the sizes where auto takes it, the
# split engine, and the proxy path (GPU-direct off). Each tree needs its own built native
# module (sparkccl/_native*.so). Compare the time and host-time columns row by row.
#
#   benchmarks/ab_bench.sh /work/main /work/wt/dp [rounds]
set -euo pipefail
A=$(cd "$1" && pwd); B=$(cd "$2" && pwd); ROUNDS=${3:-3}
run() {  # tree, label, env..., -- bench args...
    local tree=$1 label=$2; shift 2
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    echo "== $label: $tree ($(git -C "$tree" rev-parse --short HEAD))"
    (cd "$tree" && env PYTHONPATH="$tree" SPARKCCL_TIMEOUT_S=20 ${envs[@]+"${envs[@]}"} timeout 300 \
        sparkccl bench --device cuda --world 2 --no-baseline --iters 20 "$@")
}
for round in $(seq "$ROUNDS"); do
    for tree in "$A" "$B"; do
        run "$tree" "round $round, default engines" --
        run "$tree" "round $round, mode ce" SPARKCCL_DIRECT_MODE=ce -- --min-bytes 32M --max-bytes 128M
        run "$tree" "round $round, mode split" SPARKCCL_DIRECT_MODE=split --
        run "$tree" "round $round, proxy path" SPARKCCL_GPU_DIRECT=0 --
    done
done
