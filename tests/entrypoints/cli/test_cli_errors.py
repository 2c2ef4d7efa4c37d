"""The ``glassbox`` command line for a new user: a wrong model name, ``--help``, its own hints.

* A model name that is neither a folder nor in the Hugging Face cache fails at
  once with one line, the same from ``LLM``, ``glassbox serve``, ``glassbox
  trace`` and ``glassbox bench``, and without touching the network:
  ``HF_ENDPOINT`` points at an address that never answers, so a single hub
  call would take tens of seconds. A name that *is* cached resolves to its
  snapshot folder.
* ``glassbox serve --help`` and ``glassbox bench ... --help`` give every flag a
  one-line help and its default, as ``vllm serve --help`` does.
* The hints the CLI prints (``replay it with: glassbox tui ...``) and the
  README's commands work as written after ``make setup``, whose ``glassbox``
  sits in ``.venv/bin``, not on the PATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.config.model import model_not_found_message
from engine.entrypoints.cli.main import main
from tests.helpers.tiny_model import make_tiny_model_dir

REPO_ROOT = Path(__file__).resolve().parents[3]
MISSING = "glassbox-test/no-such-model"
NOT_FOUND = f"model={MISSING!r} is not a local folder and is not in the Hugging Face cache"
# Start-up (imports) included; a hub lookup alone would take longer than this.
FAST_S = 15.0


def _hub_env(tmp_path: Path, offline: bool) -> dict[str, str]:
    """An empty HF cache and a hub that never answers (10.255.255.1 is not routed)."""
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO_ROOT),
        HF_HUB_CACHE=str(tmp_path / "hub"),
        HF_ENDPOINT="http://10.255.255.1",
        HF_HUB_ETAG_TIMEOUT="30",
        HF_HUB_DOWNLOAD_TIMEOUT="30",
    )
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


CLI_CASES = {
    "serve": ["serve", MISSING, "--port", "0"],
    "trace": ["trace", "Hi", "--model", MISSING, "--headless"],
    "bench throughput": ["bench", "throughput", "--model", MISSING],
    "bench latency": ["bench", "latency", "--model", MISSING],
}


@pytest.mark.parametrize(
    "command, offline",
    [(command, True) for command in CLI_CASES]
    # Without HF_HUB_OFFLINE: the two paths that reach the model name differently.
    + [("serve", False), ("trace", False)],
    ids=lambda v: {True: "HF_HUB_OFFLINE=1", False: "no-network"}.get(v, v),
)
def test_unknown_model_fails_at_once_in_one_line(tmp_path, command, offline):
    argv = CLI_CASES[command]
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli.main", *argv],
        cwd=tmp_path,
        env=_hub_env(tmp_path, offline),
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0] == f"glassbox {command}: error: {model_not_found_message(MISSING)}"
    assert model_not_found_message(MISSING).startswith(NOT_FOUND)
    assert elapsed < FAST_S, f"{elapsed:.1f} s"


def test_llm_gives_the_same_line(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from engine import LLM

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        LLM(MISSING)
    assert time.monotonic() - start < 2.0
    message = str(info.value)
    assert message == model_not_found_message(MISSING)  # what the CLI prints after its prefix
    assert message.startswith(NOT_FOUND) and "\n" not in message
    assert f"hf download {MISSING}" in message


def test_a_tokenizer_name_is_resolved_the_same_way(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from engine.engine.arg_utils import EngineArgs

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model = make_tiny_model_dir(tmp_path / "tiny")
    with pytest.raises(ValueError) as info:
        EngineArgs(model=str(model), tokenizer=MISSING).create_engine_config()
    assert str(info.value) == model_not_found_message(MISSING, "tokenizer")
    assert str(info.value).startswith(f"tokenizer={MISSING!r} is not a local folder and")
    config = EngineArgs(model=str(model), tokenizer=str(model)).create_engine_config()
    assert config.model_config.tokenizer == str(model)


def test_a_path_that_is_not_there_is_not_looked_up_in_the_hub_cache(tmp_path):
    from engine.config import ModelConfig

    missing = str(tmp_path / "no-such-folder")
    with pytest.raises(ValueError) as info:
        ModelConfig(model=missing)
    assert str(info.value) == f"model={missing!r} is not a local folder"


def test_a_cached_hub_name_resolves_to_its_snapshot(tmp_path, monkeypatch):
    import huggingface_hub.constants

    from engine.config import ModelConfig
    from engine.config.model import resolve_model_path

    hub = tmp_path / "hub"
    repo = hub / "models--glassbox-test--tiny"
    snapshot = make_tiny_model_dir(repo / "snapshots" / ("ab" * 20))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("ab" * 20)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    config = ModelConfig(model="glassbox-test/tiny")
    assert config.model == str(snapshot) and config.tokenizer == str(snapshot)
    assert config.vocab_size > 0
    assert resolve_model_path("glassbox-test/tiny") == str(snapshot)


# ---------------------------------------------------------------------------
# --help: every flag has a one-line help and its default
# ---------------------------------------------------------------------------
def _help(monkeypatch, capsys, *argv: str) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def _flag_lines(text: str) -> dict[str, list[str]]:
    """``--flag`` -> the lines of its help, for every option but -h."""
    flags: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("  --"):
            invocation, _, help_text = line.strip().partition("  ")
            current = flags[invocation.split()[0].rstrip(",")] = []
            if help_text.strip():
                current.append(help_text.strip())
        elif current is not None and line.startswith("    ") and line.strip():
            current.append(line.strip())
        else:
            current = None
    return flags


@pytest.mark.parametrize(
    "argv",
    [("serve",), ("bench", "throughput"), ("bench", "latency"), ("trace",)],
    ids=" ".join,
)
def test_every_flag_has_help_and_its_default(monkeypatch, capsys, argv):
    from engine.engine.arg_utils import EngineArgs

    flags = _flag_lines(_help(monkeypatch, capsys, *argv))
    engine_flags = {"--" + f.replace("_", "-") for f in EngineArgs.field_names() if f != "model"}
    if argv[0] != "trace":  # trace takes a few engine options of its own
        assert engine_flags <= set(flags), sorted(engine_flags - set(flags))
    for flag, lines in flags.items():
        assert len(lines) == 1, f"{flag}: {lines or 'no help'}"
        assert "(default" in lines[0], f"{flag}: {lines[0]}"
        if flag in engine_flags:
            assert re.search(r"\(default: [^)]*\)$", lines[0]), f"{flag}: {lines[0]}"


def test_help_shows_the_defaults_each_command_uses(monkeypatch, capsys):
    serve = _flag_lines(_help(monkeypatch, capsys, "serve"))
    assert serve["--port"][0].endswith("(default: 8000)")
    assert serve["--host"][0].endswith("(default: 127.0.0.1)")
    assert serve["--block-size"][0].endswith("(default: 16)")
    assert serve["--max-num-seqs"][0].endswith("(default: None)")
    # bench throughput overrides engine defaults with nano-vllm's budget.
    bench = _flag_lines(_help(monkeypatch, capsys, "bench", "throughput"))
    assert bench["--max-num-seqs"][0].endswith("(default: 256)")
    assert bench["--max-num-batched-tokens"][0].endswith("(default: 16384)")


# ---------------------------------------------------------------------------
# Commands that work as written
# ---------------------------------------------------------------------------
def test_hints_name_the_command_as_it_was_started(tmp_path, monkeypatch):
    from engine.entrypoints.cli.main import command_name

    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    script = venv_bin / "glassbox"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), "trace"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # make setup does not activate the venv
    assert command_name() == os.path.join(".venv", "bin", "glassbox")
    monkeypatch.setenv("PATH", f"{venv_bin}:/usr/bin:/bin")  # source .venv/bin/activate
    assert command_name() == "glassbox"
    monkeypatch.setattr(sys, "argv", ["-m", "trace"])  # python -m engine.entrypoints.cli.main
    assert command_name() == "glassbox"


def test_readme_puts_glassbox_on_the_path_before_using_it():
    """Every shell block of the README that runs a bare ``glassbox`` activates
    the venv first (``make setup`` does not put it on the PATH)."""
    readme = (REPO_ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    using = [b for b in blocks if re.search(r"^glassbox ", b, flags=re.M)]
    assert using, "the README shows no glassbox command"
    for block in using:
        first = block.index("\nglassbox ") if not block.startswith("glassbox ") else 0
        assert "source .venv/bin/activate" in block[:first], block


# ---------------------------------------------------------------------------
# make setup's kernel build (python -m engine._cpu_ops) says how long and shows progress
# ---------------------------------------------------------------------------
def test_a_kernel_build_announces_itself_and_each_file(tmp_path, monkeypatch, capsys):
    import types

    from torch.utils import cpp_extension

    from engine import _cpu_ops

    monkeypatch.setenv("GLASSBOX_CACHE", str(tmp_path))
    monkeypatch.setattr(_cpu_ops, "PROGRESS_POLL_S", 0.01)
    monkeypatch.setattr(_cpu_ops, "PROGRESS_HEARTBEAT_S", 0.1)

    def fake_build(name, sources, build_directory, **kwargs):
        """A build with a slow start: the object files appear one by one, the
        last one just before the build returns."""
        time.sleep(0.3)
        for source in sources:
            time.sleep(0.05)
            Path(build_directory, Path(source).stem + ".o").write_bytes(b"")
        return types.SimpleNamespace(__file__=str(Path(build_directory, name + ".so")))

    monkeypatch.setattr(cpp_extension, "load", fake_build)
    _cpu_ops.load()
    err = capsys.readouterr().err
    assert _cpu_ops.BUILD_TIME_HINT in err.splitlines()[0]
    assert "still compiling (0/5 files done" in err
    for i, source in enumerate(_cpu_ops.SOURCES, 1):
        assert f"compiled {Path(source).name} ({i}/5, " in err, err
    assert err.splitlines()[-1].startswith("glassbox: CPU kernels built in ")
