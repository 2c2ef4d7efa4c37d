"""scripts/apt_retry.sh: ``make setup`` waits for another apt/dpkg, within bounds.

A fake ``apt-get`` on PATH fails with apt's lock message a given number of
times (counted in a file), then succeeds.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCKED = (
    "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 "
    "(unattended-upgr)\nE: Unable to acquire the dpkg frontend lock "
    "(/var/lib/dpkg/lock-frontend), is another process using it?"
)


def run_apt_get(tmp_path: Path, locked_times: int, timeout_s: int, args: list[str]):
    counter = tmp_path / "calls"
    counter.write_text("0")
    fake = tmp_path / "bin" / "apt-get"
    fake.parent.mkdir()
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f"n=$(cat {counter}); echo $((n + 1)) > {counter}\n"
        f'if [ "$n" -lt {locked_times} ]; then echo "{LOCKED}" >&2; exit 100; fi\n'
        'if [ "$1" = broken ]; then echo "E: Unable to locate package broken" >&2; exit 100; fi\n'
        'echo "ran: $*"\n'
    )
    fake.chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{fake.parent}:{os.environ['PATH']}",
        GLASSBOX_APT_LOCK_TIMEOUT_S=str(timeout_s),
        APT_LOCK_POLL_S="0.2",
    )
    script = f'set -euo pipefail; source {REPO_ROOT / "scripts/apt_retry.sh"}; apt_get "$@"'
    result = subprocess.run(
        ["bash", "-c", script, "bash", *args], env=env, capture_output=True, text=True, timeout=60
    )
    return result, int(counter.read_text())


def test_waits_for_the_lock_then_runs(tmp_path):
    result, calls = run_apt_get(tmp_path, 2, 60, ["install", "-y", "tmux"])
    assert result.returncode == 0, result.stderr
    assert calls == 3
    assert "ran: install -y tmux" in result.stdout
    assert result.stderr.count("apt/dpkg is busy") == 2


def test_gives_up_with_one_clear_line(tmp_path):
    result, calls = run_apt_get(tmp_path, 10**6, 1, ["update"])
    assert result.returncode == 1
    assert calls >= 2
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "still locked after 1s" in error
    assert "held by process 4242 (unattended-upgr)" in error
    assert "GLASSBOX_APT_LOCK_TIMEOUT_S" in error


def test_other_failures_are_not_retried(tmp_path):
    result, calls = run_apt_get(tmp_path, 0, 60, ["broken"])
    assert result.returncode == 100
    assert calls == 1
