#!/usr/bin/env bash
# Only for a GPU machine without network (the project's H200, reached through a device tool;
# the header of scripts/gpu_run.sh says how such a call works). Run here, with network,
# before the call. Build what a GPU call carries (the GPU image has no network and lacks these):
#   .whl/                     msgspec + pyzmq wheels (cp312, ~1 MB), and what `glassbox serve`
#                             and its clients need there (fastapi, starlette, pydantic,
#                             uvicorn, openai and their missing dependencies, ~6 MB): the CPU
#                             runs of the reliability soak and the thread benchmark
#                             (make reliability-device) start the real server
#   .gpu_carry/fi_site.tar.xz flashinfer-python 0.7.2.post1 + apache-tvm-ffi 0.1.11, unpacked
#                             and xz-compressed (19 MB; the wheels themselves are 62 MB and
#                             with the tree would pass the 64 MiB carry limit)
# Both folders are git-ignored through .git/info/exclude. Then:
#   device run, carry [".whl", ".gpu_carry"], command: OUT=$OUT bash scripts/gpu_run.sh all
# (scripts/gpu_env.sh, which gpu_run.sh sources, installs both into /tmp/site there.)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gpu_carry/' .git/info/exclude || echo '/.gpu_carry/' >> .git/info/exclude
dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "${@:2}"
}
dl .whl msgspec==0.23.0 pyzmq==27.1.0 xgrammar==0.2.9
dl .whl fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
  uvicorn==0.55.0 annotated-types==0.8.0 typing-inspection==0.4.5 openai==3.60.0 jiter==0.19.0 \
  sniffio==1.3.1 distro==1.9.0 opentelemetry-api==1.45.2
# tests/gpu/test_gpu_gguf.py writes its GGUF files with the gguf package (pure Python).
dl .whl gguf==0.19.0
tmp=$(mktemp -d)
dl "$tmp/wheels" flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.11
mkdir -p "$tmp/site" .gpu_carry
for w in "$tmp"/wheels/*.whl; do python3 scripts/unzip_wheel.py "$w" "$tmp/site"; done
tar -C "$tmp/site" -cf - . | xz -6 -T0 > .gpu_carry/fi_site.tar.xz
rm -rf "$tmp"
du -sh .whl .gpu_carry
