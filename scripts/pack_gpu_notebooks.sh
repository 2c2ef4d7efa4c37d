#!/usr/bin/env bash
# Only for a GPU machine without network (the header of scripts/gpu_run.sh says how such a
# call works): what the session notebooks need there beyond scripts/pack_gpu_wheels.sh's
# packages. Run here, where pip and Graphviz work, before the calls:
#   .gpu_carry/nb_site.tar.xz   nbval and the Jupyter kernel stack (nbclient, ipykernel,
#                               ipython, jupyter_client, ...) and the graphviz package, at the
#                               versions of this checkout's .venv, unpacked and xz-compressed
#                               (8 MB; the wheels are 14 MB)
#   .gpu_carry/graphviz.tgz     Graphviz's `dot` with the libraries and the two plugins SVG
#                               output needs (core, dot_layout) and their config6a: the GPU
#                               image has no `dot`, and notebooks 01-04 draw with it
#   .gpu_ray/ray_site.tar.xz    Ray (notebook 07's Ray backend), unpacked, without the parts a
#                               local cluster of actors never loads (Java jars, RLlib, Serve,
#                               Data, Tune, Train): 30 MB, so it travels in a call of its own
# and then calls scripts/pack_gpu_model.sh (the default model, cut into parts that travel
# over two calls; see there). scripts/gpu_env.sh unpacks all of it on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
grep -qx '/.gpu_carry/' .git/info/exclude || echo '/.gpu_carry/' >> .git/info/exclude
mkdir -p .gpu_carry
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
specs=()
for p in nbval nbformat nbclient ipykernel jupyter_client jupyter_core traitlets ipython \
  ipython_pygments_lexers jedi parso matplotlib-inline prompt_toolkit wcwidth stack-data \
  asttokens executing pure_eval pexpect ptyprocess tornado comm debugpy nest-asyncio2 \
  fastjsonschema jsonschema referencing rpds-py jsonschema-specifications platformdirs graphviz; do
  specs+=("$p==$("$PY" -m pip show "$p" | awk '/^Version:/{print $2}')")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$tmp/wheels" "${specs[@]}"
mkdir -p "$tmp/site"
for w in "$tmp"/wheels/*.whl; do python3 scripts/unzip_wheel.py "$w" "$tmp/site"; done
tar -C "$tmp/site" -cf - . | xz -6 -T0 > .gpu_carry/nb_site.tar.xz
ray_version=$("$PY" -m pip show ray | awk '/^Version:/{print $2}')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp/ray" "ray==$ray_version"
mkdir -p "$tmp/ray_site" .gpu_ray
grep -qx '/.gpu_ray/' .git/info/exclude || echo '/.gpu_ray/' >> .git/info/exclude
python3 scripts/unzip_wheel.py "$tmp"/ray/ray-*.whl "$tmp/ray_site"
tar -C "$tmp/ray_site" -cf - --exclude=ray/jars --exclude=ray/rllib --exclude=ray/serve \
  --exclude=ray/data --exclude=ray/tune --exclude=ray/train . | xz -6 -T0 > .gpu_ray/ray_site.tar.xz
# A relocatable dot: the binary, its libraries (glibc's own stay behind) and the plugins.
# bin/dot is a wrapper that points the loader (LD_LIBRARY_PATH) and Graphviz (GVBINDIR) at
# them for dot alone, so no other program there loads these copies; `dot -c` writes the
# plugin list (config6a) for that folder.
gv="$tmp/graphviz"
mkdir -p "$gv/bin" "$gv/libexec" "$gv/lib/graphviz"
dot_bin=$(command -v dot)
plugins=$(dirname "$(readlink -f "$(ldd "$dot_bin" | awk '/libgvc/{print $3}')")")/graphviz
cp -L "$dot_bin" "$gv/libexec/dot"
cp -L "$plugins"/libgvplugin_core.so.6 "$plugins"/libgvplugin_dot_layout.so.6 "$gv/lib/graphviz/"
ldd "$dot_bin" "$gv"/lib/graphviz/*.so.6 | awk '$3 ~ /^\// {print $3}' | sort -u \
  | grep -v -E '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*)\.so' \
  | while read -r lib; do cp -L "$lib" "$gv/lib/"; done
cat > "$gv/bin/dot" <<'SH'
#!/bin/sh
here=$(dirname "$(readlink -f "$0")")/..
LD_LIBRARY_PATH="$here/lib" GVBINDIR="$here/lib/graphviz" exec "$here/libexec/dot" "$@"
SH
chmod +x "$gv/bin/dot"
"$gv/bin/dot" -c
echo 'digraph { a -> b }' | env -u GVBINDIR "$gv/bin/dot" -Tsvg | grep -q '<svg' \
  && echo "relocated dot renders SVG"
tar -C "$tmp" -czf .gpu_carry/graphviz.tgz graphviz
du -sh .gpu_carry/nb_site.tar.xz .gpu_carry/graphviz.tgz .gpu_ray/ray_site.tar.xz
bash scripts/pack_gpu_model.sh
