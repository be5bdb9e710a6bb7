#!/usr/bin/env bash
# Run the vLLM / SGLang integration tests against the real packages (docs/VLLM_SGLANG.md).
#
# CI does not install vLLM (hundreds of MB); there these tests skip with the reason. This
# script makes a venv beside the checkout that sees the system torch (CPU is enough), adds
# vLLM and SGLang WITHOUT their dependencies (they pin their own torch, triton, CUDA
# libraries: none of them is installed), then only the pure-Python / small packages their
# imports of the distributed layer need, and runs the four test files. Output as committed in
# benchmarks/integrations_cpu.txt:
#
#   bash benchmarks/integrations_check.sh 2>&1 | tee benchmarks/integrations_cpu.txt
#
# VENV=path picks another venv (default .venv-engines); VLLM= / SGLANG= pin versions.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-engines}
VLLM=${VLLM:-vllm==0.33.0}
SGLANG=${SGLANG:-sglang==0.5.23}
# What `import vllm.distributed...` / `sglang.srt.distributed...` needs beyond torch and
# numpy, found by importing until nothing was missing (vLLM 0.33.0, SGLang 0.5.23; httpx2,
# httpcore2 and truststore since huggingface_hub's later releases import them; einops,
# dill, sentencepiece, compressed-tensors, loguru, gguf and triton (imported, never run:
# CPU only) for their fused-MoE layers, which the EP hook tests import).
DEPS="aiohappyeyeballs aiohttp aiosignal annotated-doc anyio apache-tvm-ffi==0.1.11 blake3
cachetools cbor2 fastapi frozenlist h11 httpcore2 httpx2 huggingface_hub llguidance msgspec multidict openai
openai-harmony opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
partial-json-parser pillow prometheus_client propcache psutil pybase64 pyzmq
safetensors>=0.8.0 starlette tokenizers>=0.23.2 tqdm transformers>=5.16.1,<5.21.0
truststore typing_extensions>=4.16 uvloop xgrammar yarl
einops dill sentencepiece compressed-tensors loguru gguf triton"

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$VENV"
fi
PIP="$VENV/bin/pip install -q --no-deps"
$PIP --no-build-isolation -e .
$PIP "$VLLM" "$SGLANG"
# shellcheck disable=SC2086
$PIP $DEPS

PY="$VENV/bin/python"
echo "# $(date -u +%Y-%m-%dT%H:%MZ) on $(uname -m), $(nproc) cores, no GPU"
$PY - <<'EOF'
import importlib.metadata as md, torch
print("# versions: " + ", ".join(f"{p} {md.version(p)}" for p in
      ("vllm", "sglang", "transformers", "sparkccl")) + f", torch {torch.__version__}")
print("# entry points: " + "; ".join(
      f"{g}: " + ", ".join(f"{e.name} -> {e.value}" for e in md.entry_points(group=g))
      for g in ("vllm.general_plugins", "sglang.srt.plugins")))
EOF
exec timeout 1800 "$PY" -m pytest -v -rs -p no:cacheprovider \
    tests/test_vllm_plugin.py tests/test_sglang_hook.py tests/test_vllm_ep.py \
    tests/test_sglang_ep.py
