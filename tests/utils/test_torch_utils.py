"""engine/utils/torch_utils.resolve_dtype: what dtype="auto" means (vLLM's
_resolve_auto_dtype on CUDA; float32 on the CPU by Glassbox's choice), and the
checkpoint dtype ModelConfig reads from config.json."""

from __future__ import annotations

import json

import pytest
import torch

from engine.engine.arg_utils import EngineArgs
from engine.utils.torch_utils import resolve_dtype
from tests.helpers.tiny_model import make_tiny_model_dir


@pytest.mark.parametrize(
    "config_dtype, expected",
    [
        ("float16", torch.float16),  # a float16 checkpoint stays float16, as in vLLM
        ("bfloat16", torch.bfloat16),
        ("float32", torch.bfloat16),  # float32 checkpoints are cast down
        (None, torch.bfloat16),
    ],
)
def test_auto_on_cuda_follows_the_checkpoint(config_dtype, expected):
    assert resolve_dtype("auto", "cuda", config_dtype) == expected


def test_auto_on_the_cpu_is_float32_and_explicit_dtypes_win():
    assert resolve_dtype("auto", "cpu", "bfloat16") == torch.float32
    assert resolve_dtype("float16", "cuda", "bfloat16") == torch.float16
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        resolve_dtype("int8", "cpu")


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])  # transformers 5, and before
def test_model_config_reads_the_checkpoint_dtype(tmp_path, key):
    model = make_tiny_model_dir(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (model / "config.json").write_text(json.dumps(config))
    assert EngineArgs(model=str(model)).create_engine_config().model_config.config_dtype is None
    (model / "config.json").write_text(json.dumps({**config, key: "float16"}))
    model_config = EngineArgs(model=str(model)).create_engine_config().model_config
    assert model_config.config_dtype == "float16"
