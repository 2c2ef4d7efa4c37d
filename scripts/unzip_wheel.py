"""Unpack a wheel into a folder, keeping its files' permission bits.

    python3 scripts/unzip_wheel.py WHEEL FOLDER

``python3 -m zipfile -e`` drops them, so executables inside a wheel (Ray's
``gcs_server`` and ``raylet``) land without their execute bit and fail to start.
Used by scripts/pack_gpu_wheels.sh and scripts/pack_gpu_notebooks.sh.
"""

from __future__ import annotations

import os
import sys
import zipfile


def unzip(wheel: str, folder: str) -> None:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = z.extract(info, folder)
            mode = (info.external_attr >> 16) & 0o777  # the Unix mode, when recorded
            if mode and not info.is_dir():
                os.chmod(path, mode)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.splitlines()[2].strip())
    unzip(sys.argv[1], sys.argv[2])
