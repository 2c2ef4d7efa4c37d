"""scripts/unzip_wheel.py keeps the permission bits that ``python -m zipfile -e`` drops."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "unzip_wheel.py"


def _add(z: zipfile.ZipFile, name: str, mode: int) -> None:
    info = zipfile.ZipInfo(name)
    info.external_attr = (stat.S_IFREG | mode) << 16
    z.writestr(info, b"data")


def test_executables_keep_their_execute_bit(tmp_path: Path) -> None:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        _add(z, "pkg/core/server", 0o755)
        _add(z, "pkg/__init__.py", 0o644)
        z.writestr("pkg/no_mode.txt", b"x")  # written without a Unix mode
    out = tmp_path / "site"
    subprocess.run([sys.executable, str(SCRIPT), str(wheel), str(out)], check=True)
    assert os.access(out / "pkg/core/server", os.X_OK)
    assert not os.access(out / "pkg/__init__.py", os.X_OK)
    assert (out / "pkg/no_mode.txt").read_bytes() == b"x"
