#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then the GPU benchmarks.
# Usage (on a CUDA machine, from the repo root):  OUT=/some/dir bash scripts/gpu_run.sh [tests|bench|all]
# Packages the GPU image lacks travel with the call: see scripts/gpu_env.sh.
set -uo pipefail
OUT=${OUT:-out}
WHAT=${1:-all}
source "$(dirname "$0")/gpu_env.sh"
rc=0
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  python3 -m pytest -q -p no:cacheprovider -o addopts="" --durations=15 -m gpu tests/gpu tests/v1/attention 2>&1 | tee "$OUT/gpu_tests.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  for b in benchmarks/gpu_*.py; do
    [ -f "$b" ] || continue
    python3 "$b" --out "$OUT" 2>&1 | tee -a "$OUT/bench.log" || rc=1
  done
fi
# The FlashInfer kernels built in this call, for the next one (see gpu_env.sh).
[ -d "$HOME/.cache/flashinfer" ] && tar -czf "$OUT/fi_jit_cache.tgz" -C "$HOME/.cache" flashinfer
exit $rc
