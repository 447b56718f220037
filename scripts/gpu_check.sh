#!/usr/bin/env bash
# The Pallas kernels on one GPU, in under 5 minutes on an H100/H200:
#   1. versions and devices;
#   2. correctness against the XLA path at several shapes (scripts/bench_gpu_sampler.py);
#   3. the tests that run nowhere else: the compiled sampling kernel test class, the
#      compile-only sm_90 build, and deterministic mode's tile kernel compiled and in
#      generation (needs pytest; a skip counts as a failure);
#   4. the timing table (batch 1/8/64/256, V 128256), JSON to $1 (default
#      bench_out/gpu_sampler.json), and deterministic decoding's cost (JSON beside it).
# Installs nothing except `pip install -e .` when logitloop is not importable and
# `jax[cuda12]` when nvidia-smi sees a GPU that jax does not; both give up when offline.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-bench_out/gpu_sampler.json}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

backend() { $PY -c "import jax; print(jax.default_backend())" 2>/dev/null; }
# Only on a machine with an NVIDIA GPU whose jax lacks the CUDA backend.
if nvidia-smi -L >/dev/null 2>&1 && [ "$(backend)" != "gpu" ]; then
  echo "== jax sees no GPU; trying pip install 'jax[cuda12]'"
  $PY -m pip install -q --retries 0 --timeout 10 "jax[cuda12]" || echo "   (install failed; using the jax that is installed)"
fi
if ! $PY -c "import logitloop" 2>/dev/null; then
  $PY -m pip install -q --retries 0 --timeout 10 -e . || echo "   (pip install -e . failed; using PYTHONPATH=$PWD)"
fi

echo "== versions"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
$PY - <<'EOF'
import sys, jax, jaxlib
print("python", sys.version.split()[0], "| jax", jax.__version__, "| jaxlib", jaxlib.__version__)
print("backend", jax.default_backend(), "|", jax.devices())
EOF
if [ "$(backend)" != "gpu" ]; then
  echo "FAILED: jax has no GPU backend here"; exit 2
fi

status=0
echo "== correctness: kernel vs XLA path"
timeout 150 $PY scripts/bench_gpu_sampler.py --check-only || status=1

# The tests the default suite skips without a GPU (their skip reasons point here): the
# compiled kernel test class and the compile-only sm_90 (H100/H200) build. A skip here is
# a failure: these tests run nowhere else.
GPU_TESTS=(
  "tests/ops/test_sampling_kernel.py::TestSamplingKernel"
  "tests/ops/test_sampling_kernel.py::test_kernel_compiles_for_h100_without_a_gpu"
  "tests/ops/test_tile_matmul.py::TestCompiledOnGPU"
)
if $PY -c "import pytest" 2>/dev/null; then
  echo "== pytest: compiled kernel tests"
  log=$(mktemp)
  timeout 240 $PY -m pytest -q -rs -p no:cacheprovider "${GPU_TESTS[@]}" 2>&1 | tee "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  if grep -qE "[0-9]+ skipped|no tests ran" "$log"; then
    echo "FAILED: GPU tests were skipped or not collected"; status=1
  fi
  rm -f "$log"
else
  echo "== pytest not installed: the GPU tests did not run"; status=1
fi

echo "== timings"
timeout 120 $PY scripts/bench_gpu_sampler.py --skip-check --out "$OUT" || status=1

echo "== deterministic=True (the tile kernel) against the default, tokens/s"
timeout 150 $PY scripts/bench_generate.py --skip-overhead --deterministic --new-tokens 64 \
  --repeats 3 --out "${OUT%.json}_deterministic.json" || status=1

[ $status -eq 0 ] && echo "gpu_check: ok" || echo "gpu_check: FAILED"
exit $status
