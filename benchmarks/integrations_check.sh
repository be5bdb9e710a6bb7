#!/usr/bin/env bash
# Run the vLLM / SGLang integration tests against the real packages (docs/VLLM_SGLANG.md).
# CI runs it after the test suite (.ci/run). Output as committed in
# benchmarks/integrations_cpu.txt:
#
#   bash benchmarks/integrations_check.sh 2>&1 | tee benchmarks/integrations_cpu.txt
#
# It makes a venv beside the checkout that sees the system torch (CPU is enough; the venv
# is reused when it exists), adds vLLM and SGLang WITHOUT their dependencies (they pin their
# own torch, triton, CUDA libraries: none of them is installed), then only the pure-Python /
# small packages their imports of the distributed layer need, and runs both test files with
# TEST_REQUIRE_ENGINES=1: a package that does not import fails the run instead of skipping.
#
# VENV=path picks another venv (default .venv-engines); VLLM= / SGLANG= pin versions.
# Arguments go to pytest (CI: -k "vllm_plugin_ or sglang_hook_ or vllm_ep_ or sglang_ep_", only the tests that need
# the real packages; the others ran in the suite before).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-engines}
VLLM=${VLLM:-vllm==0.33.0}
SGLANG=${SGLANG:-sglang==0.5.23}
# What `import vllm.distributed...` / `sglang.srt.distributed...` needs beyond torch and
# numpy, found by importing until nothing was missing, in a venv that has nothing else;
# (vLLM 0.33.0, SGLang 0.5.23; httpx2, httpcore2 and truststore since huggingface_hub's
# later releases import them). triton is not among them: the SGLang test puts a placeholder
# in its place (tests/test_sglang_hook.py). einops, dill, sentencepiece, compressed-tensors,
# loguru, gguf and triton (imported, never run: CPU only) for their fused-MoE layers, which
# the EP hook tests import (tests/test_vllm_ep.py, tests/test_sglang_ep.py).
DEPS="aiohappyeyeballs aiohttp aiosignal annotated-doc annotated_types anyio
apache-tvm-ffi==0.1.11 attrs blake3 cachetools cbor2 certifi charset_normalizer cloudpickle
fastapi frozenlist h11 httpcore2 httpx2 huggingface_hub idna IPython llguidance msgspec
multidict openai openai-harmony opentelemetry-api opentelemetry-sdk
opentelemetry-semantic-conventions orjson partial-json-parser pillow prometheus_client
propcache psutil py-cpuinfo pybase64 pydantic pydantic_core pyyaml pyzmq regex requests
safetensors>=0.8.0 sniffio starlette tokenizers>=0.23.2 tqdm traitlets
transformers>=5.16.1,<5.21.0 truststore typing_extensions>=4.16 typing_inspection urllib3
uvloop xgrammar yarl
einops dill sentencepiece compressed-tensors loguru gguf triton"

t0=$SECONDS
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$VENV"
fi
PIP="$VENV/bin/pip install -q --no-deps"
# This checkout, installed (its entry points are what the engines look for), unless the
# interpreter already has it installed from here (CI: `pip install -e .` ran before).
if ! "$VENV/bin/python" -I -c '
import importlib.metadata as md, os, sys
import sparkccl
here = os.path.realpath(sys.argv[1])
sys.exit(not (os.path.realpath(sparkccl.__file__).startswith(here + os.sep)
              and any(e.name == "sparkccl" for e in md.entry_points(group="vllm.general_plugins"))))
' "$PWD" 2>/dev/null; then
    $PIP --no-build-isolation -e .
fi
$PIP "$VLLM" "$SGLANG"
# shellcheck disable=SC2086
$PIP $DEPS
echo "# installed in $((SECONDS - t0)) s" >&2

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
TEST_REQUIRE_ENGINES=1 exec timeout 1800 "$PY" -m pytest -v -rs -p no:cacheprovider -m "" \
    tests/test_vllm_plugin.py tests/test_sglang_hook.py tests/test_vllm_ep.py \
    tests/test_sglang_ep.py "$@"
