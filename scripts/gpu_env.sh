# Source this on the GPU machine (from the repo root) to make the carried packages
# importable: .whl/ (msgspec, pyzmq wheels) and .gpu_carry/fi_site.tar.xz (flashinfer +
# tvm-ffi, unpacked), both built by scripts/pack_gpu_wheels.sh, land in /tmp/site.
# Also records the GPU and the versions under $OUT.
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
# CPU reference runs in the GPU tests keep the plain-torch CPU paths: compiling
# csrc/cpu here would spend device time on a CPU build.
export GLASSBOX_CPU_KERNELS=0
wheels=$(ls .whl/*.whl 2>/dev/null || true)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
    && export PYTHONPATH=/tmp/site:$PWD
fi
if [ -f .gpu_carry/fi_site.tar.xz ]; then
  mkdir -p /tmp/site && tar -xJf .gpu_carry/fi_site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD
fi
# FlashInfer's JIT builds (~45-90 s per kernel family on a fresh machine) from an
# earlier call: gpu_run.sh leaves them in $OUT/fi_jit_cache.tgz; copied to
# .gpu_carry/, they travel back and ninja finds the kernels up to date.
# Over 16 MB it comes back split (fi_jit_cache.tgz.part-aa, -ab, ...): joined here.
if ls .gpu_carry/fi_jit_cache.tgz.part-* >/dev/null 2>&1; then
  mkdir -p "$HOME/.cache" && cat .gpu_carry/fi_jit_cache.tgz.part-* | tar -xzf - -C "$HOME/.cache"
elif [ -f .gpu_carry/fi_jit_cache.tgz ]; then
  mkdir -p "$HOME/.cache" && tar -xzf .gpu_carry/fi_jit_cache.tgz -C "$HOME/.cache"
fi
# The same for Triton's compiled kernels (our attention and custom-op kernels).
if [ -f .gpu_carry/triton_cache.tgz ]; then
  mkdir -p "$HOME/.triton" && tar -xzf .gpu_carry/triton_cache.tgz -C "$HOME/.triton"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee "$OUT/versions.txt"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1 | tee -a "$OUT/versions.txt"
