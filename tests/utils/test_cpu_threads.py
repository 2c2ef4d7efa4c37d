"""Thread sizing on the CPU (``engine/utils/cpu_resource_utils.py``; vLLM twin:
``vllm/utils/ompmultiprocessing.py``): EngineCore gets one torch thread per
physical core it may use, minus one for the front end; settings override it;
a bad setting is a one-line error naming it; the CLI's front ends keep one
thread; the EngineCore process really runs with the count it chose, and the
user's own process is left alone when EngineCore runs in another.
"""

from __future__ import annotations

import sys

import pytest
import torch

from engine.entrypoints.cli import main as cli_main
from engine.entrypoints.llm import LLM
from engine.sampling_params import SamplingParams
from engine.utils import cpu_resource_utils as cru
from engine.utils.cpu_resource_utils import (
    CpuThreadPlan,
    init_cpu_threads_env,
    limit_frontend_threads,
    one_cpu_per_core,
    parse_id_list,
    plan_cpu_threads,
)
from tests.helpers.tiny_model import make_tiny_model_dir

BIND = "GLASSBOX_CPU_OMP_THREADS_BIND"
RESERVED = "GLASSBOX_CPU_NUM_OF_RESERVED_CPU"


def no_smt(cpu: int) -> tuple[int, int]:
    return (0, cpu)


def smt2(cpu: int) -> tuple[int, int]:
    """Siblings 0/1, 2/3, ... share a core."""
    return (0, cpu // 2)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "allowed, core_of, env, threads",
    [
        (range(8), no_smt, {}, 7),  # one core left to the front end
        (range(8), smt2, {}, 3),  # 4 physical cores, one reserved
        ([0, 1], no_smt, {}, 1),  # the 2-core machine of issue 17
        ([3], no_smt, {}, 1),  # a single core: nothing to reserve
        (range(8), no_smt, {RESERVED: "0"}, 8),
        (range(8), no_smt, {RESERVED: "3"}, 5),
        (range(8), no_smt, {RESERVED: "8"}, 8),  # would leave none: reserve none
        (range(8), no_smt, {"OMP_NUM_THREADS": "3"}, 3),
        (range(8), no_smt, {"OMP_NUM_THREADS": "4,2"}, 4),
        (range(8), no_smt, {BIND: "auto", "OMP_NUM_THREADS": ""}, 7),
    ],
)
def test_auto_sizes_threads_to_the_allowed_cores(allowed, core_of, env, threads):
    plan = plan_cpu_threads(env, allowed=list(allowed), core_of=core_of)
    assert plan.num_threads == threads
    assert plan.cpus is None  # auto sizes, it does not confine


def test_nobind_and_cpu_lists():
    assert (
        plan_cpu_threads({BIND: "nobind", "OMP_NUM_THREADS": "1"}, allowed=[0, 1]).num_threads
        is None
    )
    plan = plan_cpu_threads({BIND: "1-2,5"}, allowed=list(range(8)), core_of=no_smt)
    assert (plan.num_threads, plan.cpus) == (3, (1, 2, 5))
    assert parse_id_list("0-2,4", BIND) == [0, 1, 2, 4]
    assert one_cpu_per_core([0, 1, 2, 3, 4], smt2) == [0, 2, 4]


@pytest.mark.parametrize(
    "env, message",
    [
        ({BIND: "all"}, "GLASSBOX_CPU_OMP_THREADS_BIND must be 'auto', 'nobind' or a CPU list"),
        ({BIND: "3-1"}, "GLASSBOX_CPU_OMP_THREADS_BIND must be 'auto', 'nobind' or a CPU list"),
        ({BIND: "0-9"}, "GLASSBOX_CPU_OMP_THREADS_BIND='0-9' names CPUs [2, 3, 4, 5, 6, 7, 8, 9]"),
        ({RESERVED: "-1"}, "GLASSBOX_CPU_NUM_OF_RESERVED_CPU must be an integer >= 0, got '-1'"),
        ({RESERVED: "one"}, "GLASSBOX_CPU_NUM_OF_RESERVED_CPU must be an integer >= 0"),
        ({BIND: "nobind", RESERVED: "x"}, "GLASSBOX_CPU_NUM_OF_RESERVED_CPU must be"),
        ({"OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS must be an integer >= 1"),
        ({"OMP_NUM_THREADS": "many"}, "OMP_NUM_THREADS must be an integer >= 1"),
    ],
)
def test_bad_settings_are_one_line_errors_naming_them(env, message):
    with pytest.raises(ValueError) as info:
        plan_cpu_threads(env, allowed=[0, 1], core_of=no_smt)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_init_cpu_threads_env_applies_and_logs_once(restore_threads, caplog, monkeypatch):
    monkeypatch.setattr(cru, "_logged_plan", None)
    plan = CpuThreadPlan(2, None, "test")
    with caplog.at_level("INFO", logger=cru.__name__):
        assert init_cpu_threads_env(plan) == plan
        init_cpu_threads_env(plan)
    assert torch.get_num_threads() == 2
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["CPU threads: torch uses 2 thread(s) (test)"]


def test_front_end_keeps_one_thread_unless_nobind(restore_threads):
    torch.set_num_threads(2)
    assert limit_frontend_threads({}) is True
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    assert limit_frontend_threads({BIND: "nobind"}) is False
    assert torch.get_num_threads() == 2


def test_cli_engine_commands_limit_their_threads(monkeypatch, capsys, restore_threads):
    ran: list[int] = []

    def fake_run(args) -> int:
        ran.append(torch.get_num_threads())
        return 0

    for name in ("serve", "tui"):
        help_text, _, add_arguments = cli_main.COMMANDS[name]
        monkeypatch.setitem(cli_main.COMMANDS, name, (help_text, fake_run, add_arguments))
    torch.set_num_threads(2)
    assert cli_main.main(["tui", "x.jsonl"]) == 0  # no engine: threads untouched
    assert cli_main.main(["serve"]) == 0
    assert ran == [2, 1]
    monkeypatch.setenv(BIND, "bogus")
    assert cli_main.main(["serve"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("glassbox serve: error: GLASSBOX_CPU_OMP_THREADS_BIND must be")
    assert len(err.splitlines()) == 1 and len(ran) == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="spawned EngineCore logs")
def test_engine_core_process_runs_with_its_own_count(tmp_path, monkeypatch, capfd, restore_threads):
    """EngineCore in its own process sets the count it chose (the log line reads
    it back with torch.get_num_threads() there); this process keeps its own."""
    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(1)
    llm = LLM(
        str(model_dir),
        load_format="dummy",
        device="cpu",
        dtype="float32",
        hf_overrides={"intermediate_size": 32},
        block_size=4,
    )
    try:
        out = llm.generate(["w1 w2"], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
    err = capfd.readouterr().err
    assert "CPU threads: torch uses 3 thread(s) (OMP_NUM_THREADS=3)" in err
    assert torch.get_num_threads() == 1  # the user's process: untouched
