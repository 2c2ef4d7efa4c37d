"""Optimization levels -O0 ... -O3: what each fills into the compilation config.

vLLM's table (``OPTIMIZATION_LEVEL_TO_CONFIG`` in ``vllm/config/vllm.py``),
reduced to the two settings Glassbox has: the compilation mode and the
CUDA-graph mode. What the user sets in ``compilation_config`` wins over the
level; ``enforce_eager`` wins over both. Configs only: no model runs (the
compiled runs are in test_compile_cpu.py), so ``device="cuda"`` is safe here.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.config.compilation import ATTENTION_OPS, CompilationMode, CUDAGraphMode
from engine.config.glassbox import GlassboxConfig, OptimizationLevel
from engine.engine.arg_utils import EngineArgs
from tests.helpers.hf_checkpoints import save_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("llama")
    save_tiny_checkpoint("llama", path, seed=0)
    return str(path)


def _config(model: str, **kwargs: object) -> GlassboxConfig:
    return EngineArgs(model=model, skip_tokenizer_init=True, **kwargs).create_engine_config()


@pytest.mark.parametrize(
    "level,mode,cudagraph_mode",
    [
        (0, CompilationMode.NONE, CUDAGraphMode.NONE),
        (1, CompilationMode.VLLM_COMPILE, CUDAGraphMode.PIECEWISE),
        (2, CompilationMode.VLLM_COMPILE, CUDAGraphMode.FULL_AND_PIECEWISE),
        (3, CompilationMode.VLLM_COMPILE, CUDAGraphMode.FULL_AND_PIECEWISE),
    ],
)
def test_each_level_sets_both_modes(model: str, level: int, mode, cudagraph_mode) -> None:
    config = _config(model, device="cuda", optimization_level=level)
    compilation = config.compilation_config
    assert config.optimization_level == OptimizationLevel(level)
    assert (compilation.mode, compilation.cudagraph_mode) == (mode, cudagraph_mode)
    compiled = mode == CompilationMode.VLLM_COMPILE
    assert compilation.splitting_ops == (ATTENTION_OPS if compiled else [])
    assert compilation.custom_ops == (["none"] if compiled else ["all"])  # Inductor fuses
    # Piecewise graphs serve mixed batches too: twice max_num_seqs (128) at most.
    largest = 256 if cudagraph_mode.has_piecewise_cudagraphs() else 0
    assert max(compilation.cudagraph_capture_sizes, default=0) == largest


def test_default_is_o2_on_cuda_and_o0_on_the_cpu(model: str) -> None:
    cuda = _config(model, device="cuda")
    assert cuda.optimization_level == OptimizationLevel.O2
    assert cuda.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    cpu = _config(model, device="cpu")
    assert cpu.optimization_level == OptimizationLevel.O0
    assert cpu.compilation_config.mode == CompilationMode.NONE


def test_compilation_config_wins_over_the_level(model: str) -> None:
    compilation = {"cudagraph_mode": "FULL_DECODE_ONLY"}
    config = _config(model, device="cuda", compilation_config=compilation)
    assert config.compilation_config.mode == CompilationMode.VLLM_COMPILE  # from O2
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    # A graph mode O0 would not pick survives too (it needs no compilation).
    config = _config(model, device="cuda", optimization_level=0, compilation_config=compilation)
    assert config.compilation_config.mode == CompilationMode.NONE
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY


def test_piecewise_graphs_without_compilation_fall_back_to_none(
    model: str, caplog: pytest.LogCaptureFixture
) -> None:
    """O2's FULL_AND_PIECEWISE needs the split model; with mode 0 there is
    none, so no graphs at all (vLLM's rule), and the log says why."""
    with caplog.at_level(logging.WARNING, logger="engine.config.compilation"):
        config = _config(model, device="cuda", compilation_config={"mode": 0})
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert "needs compilation mode VLLM_COMPILE" in caplog.text


@pytest.mark.parametrize("level", [None, 1, 3])
def test_enforce_eager_is_o0(model: str, level: int | None, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="engine.config.compilation"):
        config = _config(model, device="cuda", optimization_level=level, enforce_eager=True)
    compilation = config.compilation_config
    assert (compilation.mode, compilation.cudagraph_mode) == (
        CompilationMode.NONE,
        CUDAGraphMode.NONE,
    )
    assert compilation.custom_ops == ["all"]  # no compiler to fuse the plain-torch ops
    assert "enforce_eager is set" in caplog.text


def test_draft_config_stays_eager(model: str) -> None:
    """Re-running __post_init__ (dataclasses.replace, as the drafter does) keeps
    what was settled: finalize is idempotent."""
    import dataclasses

    config = _config(model, device="cuda")
    sizes = list(config.compilation_config.cudagraph_capture_sizes)
    again = dataclasses.replace(config)
    assert again.compilation_config.cudagraph_capture_sizes == sizes
    assert again.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE


@pytest.mark.parametrize("level", [4, -1, "fast"])
def test_bad_level_names_the_field(model: str, level: object) -> None:
    with pytest.raises(ValueError, match="optimization_level must be 0, 1, 2 or 3"):
        _config(model, device="cpu", optimization_level=level)


def _serve_parser():
    import argparse

    from engine.entrypoints.openai.cli_args import make_arg_parser

    return make_arg_parser(argparse.ArgumentParser())


def _trace_parser():
    import argparse

    from engine.entrypoints.cli.trace import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


@pytest.mark.parametrize("make_parser,head", [(_serve_parser, []), (_trace_parser, ["hi"])])
@pytest.mark.parametrize(
    "argv,level",
    [
        (["-O3"], 3),
        (["-O", "1"], 1),
        (["-O=2"], 2),
        (["--optimization-level", "0"], 0),
        ([], None),
    ],
)
def test_cli_spellings(make_parser, head: list[str], argv: list[str], level) -> None:
    assert make_parser().parse_args(head + argv).optimization_level == level


@pytest.mark.parametrize("make_parser,head", [(_serve_parser, []), (_trace_parser, ["hi"])])
def test_cli_rejects_other_levels(make_parser, head: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        make_parser().parse_args(head + ["-O7"])
    assert "must be 0, 1, 2 or 3, got '7'" in capsys.readouterr().err


def test_level_travels_into_the_engine_on_the_cpu(tmp_path: Path, model: str) -> None:
    """-O2 on the CPU compiles (no graphs: they exist only on CUDA)."""
    import os

    from engine import LLM, SamplingParams
    from engine.tracing import RunnerCompiled, load_trace
    from engine.v1.engine.utils import ENABLE_MULTIPROCESSING_ENV

    trace = tmp_path / "trace.jsonl"
    os.environ[ENABLE_MULTIPROCESSING_ENV] = "0"
    try:
        llm = LLM(
            model,
            skip_tokenizer_init=True,
            optimization_level=2,
            compilation_config={"backend": "eager", "cache_dir": str(tmp_path)},
            max_model_len=64,
            num_gpu_blocks_override=16,
            trace_path=str(trace),
        )
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        (out,) = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params)
        llm.shutdown()
    finally:
        del os.environ[ENABLE_MULTIPROCESSING_ENV]
    assert len(out.outputs[0].token_ids) == 3
    (event,) = [e for e in load_trace(str(trace)) if isinstance(e, RunnerCompiled)]
    assert event.mode == "VLLM_COMPILE"


def test_combo_kernels_are_the_gpu_default_unless_set(model: str) -> None:
    """vLLM's Inductor defaults: horizontal fusion on a GPU, never on the CPU, and a
    user's choice of either option keeps both as the user left them."""
    combo = {"combo_kernels": True, "benchmark_combo_kernel": True}
    cuda = _config(model, device="cuda").compilation_config.inductor_compile_config
    assert cuda == {"enable_auto_functionalized_v2": False, **combo}
    cpu = _config(model, device="cpu", optimization_level=2).compilation_config
    assert cpu.inductor_compile_config == {"enable_auto_functionalized_v2": False}
    off = {"inductor_compile_config": {"combo_kernels": False}}
    mine = _config(model, device="cuda", compilation_config=off).compilation_config
    assert mine.inductor_compile_config == {
        "combo_kernels": False,
        "enable_auto_functionalized_v2": False,
    }
