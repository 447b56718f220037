#!/usr/bin/env bash
# The Pallas sampling kernel on one GPU, in under 5 minutes on an H100/H200:
#   1. versions and devices;
#   2. correctness against the XLA path at several shapes (scripts/bench_gpu_sampler.py);
#   3. the compiled kernel test class, when pytest is installed;
#   4. the timing table (batch 1/8/64/256, V 128256), JSON to $1 (default
#      bench_out/gpu_sampler.json).
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

if $PY -c "import pytest" 2>/dev/null; then
  echo "== pytest: compiled kernel tests"
  timeout 120 $PY -m pytest -q -p no:cacheprovider tests/ops/test_sampling_kernel.py \
    -k "not Interpret" || status=1
else
  echo "== pytest not installed: skipping tests/ops (step 2 covered correctness)"
fi

echo "== timings"
timeout 120 $PY scripts/bench_gpu_sampler.py --skip-check --out "$OUT" || status=1

[ $status -eq 0 ] && echo "gpu_check: ok" || echo "gpu_check: FAILED"
exit $status
