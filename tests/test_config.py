"""Tests for engine/config/*.py, engine/engine/arg_utils.py (EngineArgs), the
KV-cache sizing errors raised while an engine starts, and the ``glassbox`` CLI
entry point (twins of vllm/config/, vllm/engine/arg_utils.py and
vllm/entrypoints/cli/main.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import engine
import engine.config.device as device_module
from engine.config import (
    CacheConfig,
    DeviceConfig,
    GlassboxConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from engine.engine.arg_utils import EngineArgs
from engine.entrypoints.cli.main import main
from engine.sampling_params import SamplingParams
from engine.usage.usage_lib import UsageContext
from engine.v1.executor.abstract import Executor
from tests.helpers.counting_executor import CountingExecutor
from tests.helpers.engine_fixtures import EOS, VOCAB_SIZE, get_executor, ids, make_llm
from tests.helpers.tiny_model import make_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("cfg") / "tiny")


def engine_config(model_dir, **kwargs) -> GlassboxConfig:
    return EngineArgs(model=str(model_dir), **kwargs).create_engine_config()


# ---------------------------------------------------------------------------
# Each bad value names its field
# ---------------------------------------------------------------------------
BAD_ENGINE_ARGS = {
    "block_size 0": ({"block_size": 0}, "block_size"),
    "block_size negative": ({"block_size": -16}, "block_size"),
    "block_size float": ({"block_size": 16.0}, "block_size"),
    "gpu_memory_utilization 1.5": ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    "gpu_memory_utilization 0": ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
    "num_gpu_blocks_override 1": ({"num_gpu_blocks_override": 1}, "num_gpu_blocks_override"),
    "kv_cache_memory_bytes 0": ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
    "scheduling_policy lifo": ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    "tensor_parallel_size 0": ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    "device tpu": ({"device": "tpu"}, "device"),
    "load_format bin": ({"load_format": "bin"}, "load_format"),
    "dtype int4": ({"dtype": "int4"}, "dtype"),
    "max_model_len too large": ({"max_model_len": 257}, "max_model_len=257"),
    "max_model_len 0": ({"max_model_len": 0}, "max_model_len"),
    "no chunked prefill, small budget": (
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 255},
        "max_num_batched_tokens",
    ),
    "max_num_batched_tokens 0": ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    "max_num_seqs -1": ({"max_num_seqs": -1}, "max_num_seqs"),
    # 0 must be rejected like -1, not silently replaced by the default of 128.
    "max_num_seqs 0": ({"max_num_seqs": 0}, "max_num_seqs"),
    "long_prefill_token_threshold -1": (
        {"long_prefill_token_threshold": -1},
        "long_prefill_token_threshold",
    ),
    "executor backend threads": (
        {"distributed_executor_backend": "threads"},
        "distributed_executor_backend",
    ),
}


@pytest.mark.parametrize("kwargs,field", list(BAD_ENGINE_ARGS.values()), ids=list(BAD_ENGINE_ARGS))
def test_bad_engine_args_name_the_field(model_dir, kwargs, field):
    with pytest.raises(ValueError, match=field):
        engine_config(model_dir, **kwargs)


def test_bad_value_through_llm(model_dir):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        make_llm(model_dir, gpu_memory_utilization=1.5)


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: CacheConfig(block_size=0), "block_size"),
        (lambda: CacheConfig(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (lambda: CacheConfig(prefix_caching_hash_algo="md5"), "prefix_caching_hash_algo"),
        (lambda: SchedulerConfig(policy="lifo"), "scheduling_policy"),
        (lambda: SchedulerConfig(max_model_len=0), "max_model_len"),
        (
            lambda: SchedulerConfig(
                max_model_len=4096, max_num_batched_tokens=2048, enable_chunked_prefill=False
            ),
            "max_num_batched_tokens",
        ),
        (lambda: ParallelConfig(tensor_parallel_size=0), "tensor_parallel_size"),
        (
            lambda: ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni"),
            "tensor_parallel_size=2",
        ),
        (lambda: DeviceConfig(device="tpu"), "device"),
        (lambda: LoadConfig(load_format="bin"), "load_format"),
    ],
)
def test_config_dataclasses_validate(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_valid_edge_values(model_dir):
    config = engine_config(
        model_dir,
        gpu_memory_utilization=1.0,
        max_model_len=256,
        enable_chunked_prefill=False,
        max_num_batched_tokens=256,
        num_gpu_blocks_override=2,
    )
    assert config.cache_config.gpu_memory_utilization == 1.0
    assert config.scheduler_config.max_num_batched_tokens == 256
    assert config.cache_config.num_gpu_blocks_override == 2


# ---------------------------------------------------------------------------
# Model folder and HF config
# ---------------------------------------------------------------------------
def test_model_must_be_a_local_folder(tmp_path):
    with pytest.raises(ValueError, match="not a local folder"):
        ModelConfig(model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig(model=str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig(model=str(tmp_path))


def test_model_config_takes_a_path_and_keeps_strings(model_dir):
    # A pathlib.Path model once reached the trace writer, which cannot encode it.
    config = ModelConfig(model=model_dir, tokenizer=model_dir)
    assert config.model == config.tokenizer == config.served_model_name == str(model_dir)


def test_model_config_fields(model_dir):
    config = ModelConfig(model=str(model_dir))
    assert config.tokenizer == str(model_dir)
    assert config.max_model_len == 256
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.vocab_size == VOCAB_SIZE
    assert config.get_num_layers() == 2
    assert config.get_num_kv_heads() == 1
    assert config.get_head_size() == 16 // 2
    assert config.eos_token_id == EOS


def test_model_config_hf_overrides(model_dir):
    config = ModelConfig(
        model=str(model_dir),
        hf_overrides={"max_position_embeddings": 64, "head_dim": 32, "eos_token_id": [7, 2]},
    )
    assert config.max_model_len == 64
    assert config.get_head_size() == 32
    assert config.eos_token_id == 7
    with pytest.raises(ValueError, match="max_model_len=65"):
        ModelConfig(
            model=str(model_dir), max_model_len=65, hf_overrides={"max_position_embeddings": 64}
        )


@pytest.mark.parametrize(
    "hf_config,expected",
    [
        ({"max_position_embeddings": 100, "n_positions": 50}, 100),
        ({"n_positions": 50, "max_seq_len": 40}, 50),
        ({"seq_length": 30}, 30),
        ({"model_max_length": 20}, 20),
        ({}, 2048),
    ],
)
def test_derived_max_model_len(tmp_path, hf_config, expected):
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    assert ModelConfig(model=str(tmp_path)).max_model_len == expected


# ---------------------------------------------------------------------------
# EngineArgs -> GlassboxConfig
# ---------------------------------------------------------------------------
def test_engine_args_defaults(model_dir):
    config = engine_config(model_dir)
    assert config.model_config.max_model_len == 256
    assert config.cache_config.block_size == 16
    assert config.cache_config.enable_prefix_caching is True
    assert config.cache_config.num_gpu_blocks is None  # filled in by EngineCore
    assert config.scheduler_config.max_model_len == 256
    assert config.scheduler_config.max_num_batched_tokens == 2048
    assert config.scheduler_config.max_num_seqs == 128
    assert config.scheduler_config.enable_chunked_prefill is True
    assert config.scheduler_config.policy == "fcfs"
    assert config.load_config.load_format == "auto"
    assert config.parallel_config.tensor_parallel_size == 1
    assert config.parallel_config.distributed_executor_backend == "uni"  # one rank
    assert config.device_config.device == "auto"


def test_without_chunked_prefill_the_budget_covers_max_model_len(tmp_path):
    model = make_tiny_model_dir(tmp_path / "m", max_position_embeddings=4096)
    assert (
        engine_config(model, enable_chunked_prefill=False).scheduler_config.max_num_batched_tokens
        == 4096
    )
    assert engine_config(model).scheduler_config.max_num_batched_tokens == 2048
    explicit = engine_config(model, enable_chunked_prefill=False, max_num_batched_tokens=5000)
    assert explicit.scheduler_config.max_num_batched_tokens == 5000


GiB = 1 << 30


@pytest.mark.parametrize(
    "usage_context, tokens, seqs",
    [
        (None, 2048, 128),  # SchedulerConfig's own defaults
        (UsageContext.ENGINE_CONTEXT, 2048, 128),
        (UsageContext.LLM_CLASS, 4096, 256),
        (UsageContext.OPENAI_API_SERVER, 2048, 128),
    ],
)
def test_cpu_batch_defaults_follow_the_usage_context(model_dir, usage_context, tokens, seqs):
    config = EngineArgs(model=str(model_dir), device="cpu").create_engine_config(usage_context)
    s = config.scheduler_config
    assert (s.max_num_batched_tokens, s.max_num_seqs) == (tokens, seqs)


@pytest.mark.parametrize(
    "gpu, llm, server",
    [
        ((141 * GiB, "NVIDIA H200"), (16384, 1024), (8192, 1024)),
        ((80 * GiB, "NVIDIA H100 80GB HBM3"), (16384, 1024), (8192, 1024)),
        # vLLM keeps A100s on the small budgets whatever their memory.
        ((80 * GiB, "NVIDIA A100-SXM4-80GB"), (8192, 256), (2048, 256)),
        ((24 * GiB, "NVIDIA L4"), (8192, 256), (2048, 256)),
        (None, (8192, 256), (2048, 256)),  # NVML absent and CUDA not initialised
    ],
)
def test_gpu_batch_defaults_follow_memory_and_name(monkeypatch, gpu, llm, server):
    monkeypatch.setattr(device_module, "_nvml_device_info", lambda: gpu)
    tokens, seqs = EngineArgs.get_batch_defaults(1, DeviceConfig(device="cuda"))
    ctx = UsageContext
    assert (tokens[ctx.LLM_CLASS], seqs[ctx.LLM_CLASS]) == llm
    assert (tokens[ctx.OPENAI_API_SERVER], seqs[ctx.OPENAI_API_SERVER]) == server
    assert ctx.ENGINE_CONTEXT not in tokens and ctx.ENGINE_CONTEXT not in seqs


def test_gpu_memory_and_name_come_from_nvml_for_the_first_visible_gpu(monkeypatch):
    import sys
    import types

    calls = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByIndex=lambda i: ("index", i),
        nvmlDeviceGetHandleByUUID=lambda u: ("uuid", u),
        nvmlDeviceGetName=lambda h: f"GPU {h}".encode(),  # older bindings return bytes
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=141 * GiB),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    cuda = DeviceConfig(device="cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert (cuda.get_device_total_memory(), cuda.get_device_name()) == (
        141 * GiB,
        "GPU ('index', 3)",
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5f2e")
    assert cuda.get_device_name() == "GPU ('uuid', 'GPU-5f2e')"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cuda.get_device_name() == "GPU ('index', 0)"
    assert calls == ["init", "shutdown"] * 4  # NVML is shut down again each time
    assert DeviceConfig(device="cpu").get_device_total_memory() == 0


def test_cpu_batch_defaults_scale_with_the_tensor_parallel_size():
    tokens, seqs = EngineArgs.get_batch_defaults(2, DeviceConfig(device="cpu"))
    assert (tokens[UsageContext.LLM_CLASS], seqs[UsageContext.LLM_CLASS]) == (8192, 512)
    server = UsageContext.OPENAI_API_SERVER
    assert (tokens[server], seqs[server]) == (4096, 256)


def test_batch_defaults_leave_explicit_values_and_respect_the_model(tmp_path):
    model = str(make_tiny_model_dir(tmp_path / "m", max_position_embeddings=8192))
    llm_class = UsageContext.LLM_CLASS

    def scheduler(**kwargs):
        args = EngineArgs(model=model, device="cpu", **kwargs)
        s = args.create_engine_config(llm_class).scheduler_config
        # vLLM writes the defaults back into the EngineArgs it was given.
        assert (args.max_num_batched_tokens, args.max_num_seqs) == (
            s.max_num_batched_tokens,
            s.max_num_seqs,
        )
        return s.max_num_batched_tokens, s.max_num_seqs

    assert scheduler(max_num_seqs=8, max_num_batched_tokens=100) == (100, 8)
    assert scheduler(max_num_seqs=8) == (4096, 8)
    assert scheduler(max_num_batched_tokens=100) == (100, 256)
    # A default budget never exceeds what every sequence could use at once ...
    assert scheduler(max_num_seqs=1, max_model_len=512) == (512, 1)
    # ... and without chunked prefill covers one whole prompt.
    assert scheduler(enable_chunked_prefill=False, max_num_seqs=2) == (8192, 2)


def test_performance_mode_throughput_doubles_only_the_unset_batch_defaults(model_dir):
    def scheduler(**kwargs):
        args = EngineArgs(
            model=str(model_dir), device="cpu", performance_mode="throughput", **kwargs
        )
        config = args.create_engine_config(UsageContext.LLM_CLASS)
        assert config.performance_mode == "throughput"
        s = config.scheduler_config
        return s.max_num_batched_tokens, s.max_num_seqs

    assert scheduler() == (8192, 512)
    assert scheduler(max_num_seqs=3, max_num_batched_tokens=100) == (100, 3)
    assert scheduler(max_num_seqs=3) == (3 * 256, 3)  # doubled, then capped by 3 x max_model_len


def test_performance_mode_interactivity_captures_every_small_batch_size():
    from engine.config.compilation import CompilationConfig

    def sizes(mode):
        config = CompilationConfig(mode=3, cudagraph_mode="FULL_AND_PIECEWISE")
        config.finalize(64, False, max_num_batched_tokens=2048, performance_mode=mode)
        return config.cudagraph_capture_sizes

    assert sizes("interactivity") == list(range(1, 33)) + list(range(40, 129, 8))
    assert sizes("balanced") == [1, 2, 4] + list(range(8, 129, 8))


def test_performance_mode_is_checked_and_on_the_cli(model_dir):
    with pytest.raises(ValueError, match="performance_mode must be one of balanced, interactivity"):
        engine_config(model_dir, performance_mode="fast")
    import argparse

    from engine.entrypoints.openai.cli_args import make_arg_parser

    args = make_arg_parser(argparse.ArgumentParser()).parse_args(
        [str(model_dir), "--performance-mode", "interactivity"]
    )
    assert args.performance_mode == "interactivity"


def test_each_entry_point_names_its_usage_context(model_dir, monkeypatch):
    """LLM -> LLM_CLASS, glassbox serve -> OPENAI_API_SERVER: vLLM's pairs."""
    import argparse
    import asyncio

    from engine.entrypoints.openai import api_server
    from engine.entrypoints.openai.cli_args import make_arg_parser
    from engine.v1.engine.async_llm import AsyncLLM
    from engine.v1.engine.llm_engine import LLMEngine

    seen = []

    class Stop(Exception):
        pass

    def record(engine_args, usage_context=UsageContext.ENGINE_CONTEXT, **kwargs):
        seen.append(usage_context)
        raise Stop

    monkeypatch.setattr(LLMEngine, "from_engine_args", record)
    monkeypatch.setattr(AsyncLLM, "from_engine_args", record)
    with pytest.raises(Stop):
        engine.LLM(str(model_dir))
    args = make_arg_parser(argparse.ArgumentParser()).parse_args([str(model_dir)])

    async def serve():
        async with api_server.build_async_engine_client(args):
            pass

    with pytest.raises(Stop):
        asyncio.run(serve())
    assert seen == [UsageContext.LLM_CLASS, UsageContext.OPENAI_API_SERVER]


def test_engine_args_land_in_the_right_config(model_dir, tmp_path):
    other_tokenizer = make_tiny_model_dir(tmp_path / "tok")
    config = engine_config(
        model_dir,
        tokenizer=str(other_tokenizer),
        skip_tokenizer_init=True,
        dtype="float16",
        seed=7,
        max_model_len=128,
        block_size=8,
        enable_prefix_caching=False,
        num_gpu_blocks_override=50,
        gpu_memory_utilization=0.5,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        long_prefill_token_threshold=16,
        scheduling_policy="priority",
        load_format="dummy",
        hf_overrides={"num_hidden_layers": 4},
        enforce_eager=True,
        distributed_executor_backend=CountingExecutor,
        device="cpu",
    )
    m = config.model_config
    assert (m.tokenizer, m.skip_tokenizer_init, m.dtype, m.seed) == (
        str(other_tokenizer),
        True,
        "float16",
        7,
    )
    assert (m.max_model_len, m.get_num_layers(), m.enforce_eager) == (128, 4, True)
    c = config.cache_config
    assert (c.block_size, c.enable_prefix_caching, c.num_gpu_blocks_override) == (8, False, 50)
    assert c.gpu_memory_utilization == 0.5
    s = config.scheduler_config
    assert (s.max_model_len, s.max_num_batched_tokens, s.max_num_seqs) == (128, 64, 4)
    assert (s.long_prefill_token_threshold, s.policy) == (16, "priority")
    assert config.load_config.load_format == "dummy"
    assert config.parallel_config.distributed_executor_backend is CountingExecutor
    assert config.device_config.device == "cpu"
    assert config.device_config.resolve() == "cpu"


def test_field_names_are_the_llm_keywords():
    names = EngineArgs.field_names()
    assert names == {f.name for f in dataclasses.fields(EngineArgs)}
    assert {"model", "block_size", "enable_prefix_caching", "num_gpu_blocks_override"} <= names
    assert {"max_num_batched_tokens", "scheduling_policy", "device"} <= names


def test_executor_class_selection(model_dir):
    config = engine_config(model_dir, distributed_executor_backend=CountingExecutor)
    assert Executor.get_class(config) is CountingExecutor

    class NotAnExecutor:
        pass

    # The config resolves async scheduling from the executor class, so a bad
    # class fails when the config is built (as vLLM's VllmConfig does).
    with pytest.raises(TypeError, match="subclass of Executor"):
        engine_config(model_dir, distributed_executor_backend=NotAnExecutor)


# ---------------------------------------------------------------------------
# KV cache sizing errors at start-up
# ---------------------------------------------------------------------------
class _Tracked(CountingExecutor):
    instances: list[CountingExecutor] = []

    def _init_executor(self) -> None:
        super()._init_executor()
        type(self).instances.append(self)


def sized_executor(num_blocks: int, block_size: int = 16, num_layers: int = 2) -> type[_Tracked]:
    page_size = 2 * block_size * 1 * 8 * 4  # K+V, 1 KV head, head size 8, float32
    return type(
        "Sized",
        (_Tracked,),
        {
            "instances": [],
            "available_memory": num_blocks * page_size * num_layers,
            "num_layers": num_layers,
        },
    )


def test_block_override_too_small_for_max_model_len(model_dir):
    # max_model_len 256 at 16 tokens per block needs 16 blocks + the null block.
    with pytest.raises(ValueError, match=r"max seq len \(256\)") as info:
        make_llm(model_dir, num_gpu_blocks_override=16)
    # 15 usable blocks of 16 tokens: the longest sequence that fits is 240.
    assert "estimated maximum model length is 240" in str(info.value)
    assert "`num_gpu_blocks_override`" in str(info.value)
    llm = make_llm(model_dir, num_gpu_blocks_override=17)
    assert llm.llm_engine.glassbox_config.cache_config.num_gpu_blocks == 17
    # A shorter max_model_len fits in a smaller pool.
    make_llm(model_dir, num_gpu_blocks_override=4, max_model_len=48)
    with pytest.raises(ValueError, match=r"max seq len \(49\)"):
        make_llm(model_dir, num_gpu_blocks_override=4, max_model_len=49)


def test_available_memory_too_small_for_max_model_len(model_dir):
    too_small = sized_executor(num_blocks=16)
    with pytest.raises(ValueError, match=r"max seq len \(256\).*increasing `gpu_memory_util"):
        make_llm(model_dir, executor=too_small)
    # The executor (and its model) is released when EngineCore fails to start.
    (executor,) = too_small.instances
    assert executor.is_shutdown

    just_enough = sized_executor(num_blocks=17)
    llm = make_llm(model_dir, executor=just_enough)
    assert llm.llm_engine.glassbox_config.cache_config.num_gpu_blocks == 17
    assert not just_enough.instances[0].is_shutdown


def test_max_model_len_minus_one_fits_the_kv_cache(model_dir, monkeypatch):
    """vLLM's auto-fit: the model's 256 tokens need 16 blocks + the null block."""
    llm = make_llm(model_dir, num_gpu_blocks_override=10, max_model_len=-1)
    config = llm.llm_engine.glassbox_config
    # 9 usable blocks of 16 tokens: the longest sequence that fits is 144.
    assert config.model_config.original_max_model_len == -1
    assert (config.model_config.max_model_len, config.scheduler_config.max_model_len) == (144, 144)
    assert get_executor(llm).updated_max_model_len == 144  # the workers are told
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ids("w1") * 140}, params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4  # 140 + 4 = 144: the context is full
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": ids("w1") * 145}, params, use_tqdm=False)
    # When the whole context fits, it stays the model's own.
    roomy = make_llm(model_dir, num_gpu_blocks_override=17, max_model_len=-1)
    assert roomy.llm_engine.glassbox_config.model_config.max_model_len == 256
    assert get_executor(roomy).updated_max_model_len is None
    with pytest.raises(ValueError, match="Cannot auto-fit max_model_len"):
        make_llm(model_dir, executor=sized_executor(num_blocks=1), max_model_len=-1)
    # EngineCore in its own process: the front end learns the value at the handshake.
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    remote = engine.LLM(
        str(model_dir),
        distributed_executor_backend=CountingExecutor,
        num_gpu_blocks_override=10,
        max_model_len=-1,
    )
    try:
        assert remote.llm_engine.model_config.max_model_len == 144
    finally:
        remote.shutdown()


def test_no_memory_left_for_kv_cache(model_dir):
    none_left = sized_executor(num_blocks=0)
    with pytest.raises(ValueError, match="No available memory for the cache blocks"):
        make_llm(model_dir, executor=none_left)
    assert none_left.instances[0].is_shutdown


# ---------------------------------------------------------------------------
# The glassbox CLI
# ---------------------------------------------------------------------------
def test_cli_without_a_command(capsys):
    assert main([]) == 0
    assert "usage: glassbox" in capsys.readouterr().out


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"glassbox {engine.__version__}"


def test_cli_unknown_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["no-such-command"])
    assert info.value.code == 2
    assert "no-such-command" in capsys.readouterr().err
