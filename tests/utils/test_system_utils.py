"""How EngineCore's process is started (``engine/utils/system_utils.py``;
vLLM twin: ``get_mp_context`` in ``vllm/utils/system_utils.py`` and
``VLLM_WORKER_MULTIPROC_METHOD``): ``fork`` by default,
``GLASSBOX_WORKER_MULTIPROC_METHOD=spawn`` respected, a bad value a clear
error naming the variable, and ``spawn`` forced (with a warning, and the
variable set for children) once CUDA is initialised.

And why it matters to a learner: a script that builds ``LLM`` at top level,
without an ``if __name__ == "__main__":`` guard, runs with ``fork`` (the
child is a copy of the parent and never re-imports the script); with
``spawn`` the child re-imports it, builds one more engine and dies, and the
error says what to do.
"""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.utils import system_utils
from engine.utils.system_utils import (
    MULTIPROC_METHOD_ENV,
    cuda_is_initialized,
    get_mp_context,
    get_mp_method,
)
from tests.helpers.tiny_model import make_tiny_model_dir

GUARD = 'if __name__ == "__main__":'


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No method asked for, CUDA not initialised (whatever the machine);
    monkeypatch restores the environment afterwards."""
    monkeypatch.delenv(MULTIPROC_METHOD_ENV, raising=False)
    monkeypatch.setattr(system_utils, "cuda_is_initialized", lambda: False)
    return monkeypatch


def test_default_is_fork(no_cuda):
    assert get_mp_method() == "fork"
    assert get_mp_context().get_start_method() == "fork"
    assert MULTIPROC_METHOD_ENV not in os.environ  # nothing forced


@pytest.mark.parametrize("value", ["spawn", " Spawn "])
def test_spawn_is_respected(no_cuda, value):
    no_cuda.setenv(MULTIPROC_METHOD_ENV, value)
    assert get_mp_method() == "spawn"
    assert get_mp_context().get_start_method() == "spawn"


def test_fork_can_be_asked_for(no_cuda):
    no_cuda.setenv(MULTIPROC_METHOD_ENV, "fork")
    assert get_mp_context().get_start_method() == "fork"


@pytest.mark.parametrize("value", ["forkserver", "threads"])
def test_bad_value_names_the_variable(no_cuda, value):
    no_cuda.setenv(MULTIPROC_METHOD_ENV, value)
    with pytest.raises(ValueError, match=MULTIPROC_METHOD_ENV) as info:
        get_mp_context()
    assert repr(value) in str(info.value) and "fork" in str(info.value)


@pytest.mark.parametrize("asked", [None, "fork"])
def test_initialised_cuda_forces_spawn(monkeypatch, caplog, asked):
    # setenv first, so monkeypatch restores the variable's absence too: get_mp_context
    # writes "spawn" into os.environ, which would otherwise outlive this test.
    monkeypatch.setenv(MULTIPROC_METHOD_ENV, asked or "")
    if asked is None:
        monkeypatch.delenv(MULTIPROC_METHOD_ENV)
    monkeypatch.setattr(system_utils, "cuda_is_initialized", lambda: True)
    with caplog.at_level(logging.WARNING, logger=system_utils.__name__):
        context = get_mp_context()
    assert context.get_start_method() == "spawn"
    # Set in the environment, so processes started from here spawn too.
    assert os.environ[MULTIPROC_METHOD_ENV] == "spawn"
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "CUDA is initialized" in record.getMessage()
    assert MULTIPROC_METHOD_ENV in record.getMessage() and GUARD in record.getMessage()


def test_spawn_already_asked_for_needs_no_warning(monkeypatch, caplog):
    monkeypatch.setenv(MULTIPROC_METHOD_ENV, "spawn")
    monkeypatch.setattr(system_utils, "cuda_is_initialized", lambda: True)
    with caplog.at_level(logging.WARNING, logger=system_utils.__name__):
        assert get_mp_context().get_start_method() == "spawn"
    assert caplog.records == []


def test_device_guess_and_cuda_check_leave_the_driver_alone(monkeypatch):
    """Neither the front end's device guess nor the start-method check may
    ask the CUDA runtime (``torch.cuda.is_available()`` initialises the
    driver, and a child forked after that cannot use CUDA): they ask NVML's
    device count and torch's own flag."""
    import torch

    from engine.config.device import DeviceConfig

    def poisons_fork() -> bool:
        raise AssertionError("torch.cuda.is_available() called in the front end")

    monkeypatch.setattr(torch.cuda, "is_available", poisons_fork)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert DeviceConfig().resolve() == "cuda"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert DeviceConfig().resolve() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert cuda_is_initialized() is True


def test_cuda_check_does_not_import_torch(monkeypatch):
    # Without torch in the process there is no CUDA context to worry about.
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert cuda_is_initialized() is False
    assert "torch" not in sys.modules


# ---------------------------------------------------------------------------
# A learner's script without the __main__ guard
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("start_method") / "tiny")


def script(model_dir: Path, guarded: bool, device: str = "cpu") -> str:
    body = f"""\
        llm = LLM(
            {str(model_dir)!r},
            load_format="dummy",
            device={device!r},
            dtype="float32",
            hf_overrides={{"intermediate_size": 32}},
        )
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        (out,) = llm.generate(["w1 w2 w3"], params, use_tqdm=False)
        print("TOKENS", list(out.outputs[0].token_ids))
        """
    if guarded:
        body = GUARD + "\n" + textwrap.indent(textwrap.dedent(body), "    ")
    return "from engine import LLM, SamplingParams\n\n" + textwrap.dedent(body)


def run_script(tmp_path: Path, text: str, method: str | None) -> subprocess.CompletedProcess:
    path = tmp_path / "learner.py"
    path.write_text(text)
    env = {k: v for k, v in os.environ.items() if k != MULTIPROC_METHOD_ENV}
    env["GLASSBOX_ENABLE_MULTIPROCESSING"] = "1"  # the default: EngineCore in its own process
    if method is not None:
        env[MULTIPROC_METHOD_ENV] = method
    # sys.executable: the venv's python running this test.
    return subprocess.run(
        [sys.executable, str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_unguarded_script_runs_with_the_default_fork(model_dir, tmp_path):
    result = run_script(tmp_path, script(model_dir, guarded=False), method=None)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("TOKENS")]
    assert len(ast.literal_eval(line.removeprefix("TOKENS "))) == 3


def test_unguarded_script_fails_with_spawn_and_says_why(model_dir, tmp_path):
    result = run_script(tmp_path, script(model_dir, guarded=False), method="spawn")
    assert result.returncode != 0
    assert "TOKENS" not in result.stdout
    assert "EngineCore initialization failed" in result.stderr
    assert "started with 'spawn'" in result.stderr and GUARD in result.stderr


def test_guarded_script_runs_with_spawn(model_dir, tmp_path):
    """What the error asks for is enough."""
    result = run_script(tmp_path, script(model_dir, guarded=True), method="spawn")
    assert result.returncode == 0, result.stderr[-3000:]
    assert any(x.startswith("TOKENS") for x in result.stdout.splitlines())


FORK_AFTER_OPENMP = """
import torch
from engine.utils.system_utils import get_mp_context

def child():
    torch.set_num_threads(2)
    torch.arange(4_000_000.0).cos().sum()

if __name__ == "__main__":
    torch.set_num_threads(2)
    torch.arange(4_000_000.0).cos().sum()  # the parent's OpenMP pool now has a worker thread
    process = get_mp_context().Process(target=child)
    process.start()
    process.join(30)
    if process.is_alive():
        process.kill()
        print("child hung")
    else:
        print("child exit", process.exitcode)
"""


def test_a_forked_child_runs_openmp_after_its_parent_did(tmp_path):
    """A parent whose torch ops ran on two threads, then a forked child on two
    threads: without the pool released before the fork (``_loaded_libgomps``
    made to return nothing), the child waits in libgomp until it is killed."""
    script = tmp_path / "fork_after_openmp.py"
    script.write_text(FORK_AFTER_OPENMP)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    env.pop(MULTIPROC_METHOD_ENV, None)
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "child exit 0", out.stderr[-2000:]
