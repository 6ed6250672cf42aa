#!/usr/bin/env bash
# The CUDA checks, on a machine with an NVIDIA GPU (CI has none, so they are not in CI):
#  1. tests/test_cuda.py: a CPU draft for a GPU target (sequential and overlapped) is
#     lossless, exact mode is batch-invariant on cuBLAS, dtype auto, the GPU's forward cost;
#  2. the model-level test suite with its models on the GPU (SPECDEC_TEST_DEVICE=cuda):
#     every drafter's conformance suite (greedy identity, chains and trees, native exact
#     fp32/bf16, batches, sampling against the exact law), engines, verifiers, KV caches;
#  3. the forward-cost report (`specdec bench --forward-cost`'s) on SmolLM2-135M's shapes
#     (random weights: the embedded GGUF need not be installed; a forward's time does not
#     depend on the weights' values).
# Usage: benchmarks/gpu_check.sh [OUT_DIR]  (default out/gpu_check). Runs from a source
# checkout (PYTHONPATH=src). PYTHON picks the interpreter (default: the Makefile's .venv,
# else python3), WORKERS the pytest-xdist workers (8), SUITE_TIMEOUT the suite's seconds
# (420), SUITE_FILES the test files (default: every model-level one).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-out/gpu_check}}
default_py=python3
[ -x .venv/bin/python ] && default_py=.venv/bin/python  # the Makefile's environment
py=${PYTHON:-$default_py}
if ! $py -c "import torch" 2>/dev/null; then
    echo "gpu_check: $py cannot import torch (PYTHON=... picks the interpreter)" >&2
    exit 2
fi
if ! $py -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check: torch $($py -c 'import torch; print(torch.__version__)') sees no CUDA GPU here" >&2
    exit 2
fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export SPECDEC_CACHE=${SPECDEC_CACHE:-$(mktemp -d)}
mkdir -p "$out"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $py -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', \
torch.version.cuda, '| transformers', transformers.__version__)"
    echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) x $(nproc)"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
status=0
pytest_args=(-p no:cacheprovider -o addopts= -rfE)

echo "== 1. tests/test_cuda.py"
$py -m pytest -q "${pytest_args[@]}" tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 2. the model-level suite on the GPU"
# Left out: files about the CPU only (its C++ kernels, quantized blocks, prefill plan,
# loading and CLI/bench processes on the embedded model) or needing the server's
# packages; -k leaves out CLI, command and head-training tests (CPU processes).
ignore=(test_cuda test_kernels test_quant test_prefill test_linear test_real_model
    test_bench test_bench_peers test_bench_serving test_cli test_cli_robustness
    test_contamination test_config test_registry_help test_replicas_cli test_tokenizer
    test_server test_server_requests test_server_structured test_structured test_plugins
    test_prediction test_typical test_vllm_integration test_forward_cost test_models_loading)
ignores=()
for name in "${ignore[@]}"; do ignores+=(--ignore "tests/$name.py"); done
rm -f "$out/suite_failures.txt"
# SUITE_FILES="tests/test_a.py ..." runs those files only.
# shellcheck disable=SC2086
GPU_CHECK_FAILURES="$out/suite_failures.txt" PYTHONPATH="benchmarks/gpu_check:$PYTHONPATH" \
SPECDEC_TEST_DEVICE=cuda timeout "${SUITE_TIMEOUT:-420}" $py -m pytest -v "${pytest_args[@]}" \
    -p failures -n "${WORKERS:-8}" -k "not cli and not train and not command" \
    "${ignores[@]}" ${SUITE_FILES:-tests} > "$out/suite_cuda.log" 2>&1 || status=1
grep -E "^(FAILED|ERROR)|passed|failed" "$out/suite_cuda.log" | tail -40

echo "== 3. forward cost on the GPU (SmolLM2-135M shapes, random weights)"
model=$(mktemp -d)/smollm2-135m-shapes
$py benchmarks/gpu_check/random_model.py "$model" 2>/dev/null || status=1
$py - "$model" "$out/forward_cost" <<'PY' 2>&1 | tee "$out/forward_cost.log"
import sys
from pathlib import Path

from specdec.bench.forward_cost import report_markdown, run_forward_cost, write_forward_cost

result = run_forward_cost(sys.argv[1], "cuda")
print(report_markdown(result))
env = {"model": "SmolLM2-135M-Instruct's shapes, random weights", "device": "cuda"}
write_forward_cost(Path(sys.argv[2]), result, env)
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== summary"
echo "tests/test_cuda.py: $(tail -n 1 "$out/test_cuda.log")"
echo "suite on the GPU: $(grep -c ' PASSED ' "$out/suite_cuda.log") passed," \
    "$(grep -cE ' (FAILED|ERROR) ' "$out/suite_cuda.log") failed (why: $out/suite_failures.txt)"
echo "forward cost: $out/forward_cost/forward_cost.md"
exit $status
