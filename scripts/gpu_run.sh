#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then the GPU benchmarks.
# Usage (on a CUDA machine, from the repo root):  OUT=/some/dir bash scripts/gpu_run.sh [tests|bench|all]
# Packages the GPU image lacks travel with the call (build them with
# scripts/pack_gpu_wheels.sh): .whl/ (msgspec, pyzmq wheels) and
# .gpu_carry/fi_site.tar.xz (flashinfer + tvm-ffi, unpacked); both land in /tmp/site.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
WHAT=${1:-all}
export PYTHONUNBUFFERED=1
wheels=$(ls .whl/*.whl 2>/dev/null || true)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
if [ -f .gpu_carry/fi_site.tar.xz ]; then
  mkdir -p /tmp/site && tar -xJf .gpu_carry/fi_site.tar.xz -C /tmp/site || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee "$OUT/versions.txt"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1 | tee -a "$OUT/versions.txt"
rc=0
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/gpu tests/v1/attention 2>&1 | tee "$OUT/gpu_tests.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  for b in benchmarks/gpu_*.py; do
    [ -f "$b" ] || continue
    python3 "$b" --out "$OUT" 2>&1 | tee -a "$OUT/bench.log" || rc=1
  done
fi
exit $rc
