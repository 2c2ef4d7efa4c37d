"""Which attention backend the selector picks (engine/v1/attention/selector.py).

CPU-only: "FlashInfer importable" is simulated by putting a stand-in module
under the backend's import path in ``sys.modules`` (and "not importable" by
putting None there, which makes the import fail), so the rules are checked
whether or not flashinfer is installed here. The configs are built with
``EngineArgs`` on a tiny checkpoint folder, so dtype and head size come from
the same code path the engine uses.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from engine.engine.arg_utils import EngineArgs
from engine.v1.attention import selector
from engine.v1.attention.backends.cpu_attn import CPUAttentionBackend
from engine.v1.attention.selector import ATTENTION_BACKEND_ENV, get_attn_backend

FLASHINFER_MODULE = "engine.v1.attention.backends.flashinfer"


def _model_dir(tmp_path, head_dim: int):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 2 * head_dim,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "max_position_embeddings": 128,
        "intermediate_size": 32,
    }
    path = tmp_path / f"tiny_head{head_dim}"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _config(tmp_path, device: str, dtype: str = "auto", head_dim: int = 128):
    args = EngineArgs(
        model=_model_dir(tmp_path, head_dim), skip_tokenizer_init=True, device=device, dtype=dtype
    )
    return args.create_engine_config()


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return monkeypatch


@pytest.fixture
def fake_flashinfer(env):
    """Make the FlashInfer backend 'importable' (a stand-in class)."""
    backend = type("FlashInferBackend", (), {"get_name": staticmethod(lambda: "FLASHINFER")})
    env.setitem(sys.modules, FLASHINFER_MODULE, SimpleNamespace(FlashInferBackend=backend))
    return backend


@pytest.fixture
def fake_triton(env):
    """A stand-in for the Triton backend, so these tests never import triton."""
    backend = type("TritonAttentionBackend", (), {"get_name": staticmethod(lambda: "TRITON_ATTN")})
    env.setitem(
        sys.modules,
        "engine.v1.attention.backends.triton_attn",
        SimpleNamespace(TritonAttentionBackend=backend),
    )
    return backend


def test_cpu_gets_cpu_attn_even_with_flashinfer(tmp_path, fake_flashinfer):
    assert get_attn_backend(None) is CPUAttentionBackend
    assert get_attn_backend(_config(tmp_path, "cpu")) is CPUAttentionBackend


def test_cuda_prefers_flashinfer_when_importable(tmp_path, fake_flashinfer, fake_triton):
    assert selector.is_flashinfer_available()
    # bf16 (the CUDA default) with 128-wide heads: FlashInfer can run it.
    assert get_attn_backend(_config(tmp_path, "cuda")) is fake_flashinfer
    assert (
        get_attn_backend(_config(tmp_path, "cuda", dtype="float16", head_dim=64)) is fake_flashinfer
    )


def test_cuda_without_flashinfer_gets_triton(tmp_path, env, fake_triton):
    env.setitem(sys.modules, FLASHINFER_MODULE, None)  # import fails
    assert not selector.is_flashinfer_available()
    assert get_attn_backend(_config(tmp_path, "cuda")) is fake_triton


def test_cuda_falls_back_to_triton_where_flashinfer_cannot_run(
    tmp_path, fake_flashinfer, fake_triton
):
    assert get_attn_backend(_config(tmp_path, "cuda", dtype="float32")) is fake_triton
    assert get_attn_backend(_config(tmp_path, "cuda", head_dim=32)) is fake_triton


def test_env_override_wins(tmp_path, env, fake_flashinfer, fake_triton):
    cuda = _config(tmp_path, "cuda")
    env.setenv(ATTENTION_BACKEND_ENV, "CPU_ATTN")
    assert get_attn_backend(cuda) is CPUAttentionBackend
    env.setenv(ATTENTION_BACKEND_ENV, " TRITON_ATTN ")  # surrounding spaces are ignored
    assert get_attn_backend(cuda) is fake_triton
    env.setenv(ATTENTION_BACKEND_ENV, "FLASHINFER")
    assert get_attn_backend(cuda) is fake_flashinfer


def test_env_flashinfer_errors_say_why(tmp_path, env, fake_flashinfer):
    env.setenv(ATTENTION_BACKEND_ENV, "FLASHINFER")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_attn_backend(_config(tmp_path, "cpu"))
    with pytest.raises(
        ValueError, match=r"dtype float32 \(FLASHINFER supports \['float16', 'bfloat16'\]\)"
    ):
        get_attn_backend(_config(tmp_path, "cuda", dtype="float32"))
    with pytest.raises(ValueError, match=r"head size 32 \(FLASHINFER supports \[64, 128, 256\]\)"):
        get_attn_backend(_config(tmp_path, "cuda", head_dim=32))
    # Asked for by name but not importable: an ImportError, not a silent fallback.
    env.setitem(sys.modules, FLASHINFER_MODULE, None)
    with pytest.raises(ImportError):
        get_attn_backend(_config(tmp_path, "cuda"))


def test_unknown_backend_name_lists_the_choices(tmp_path, env):
    env.setenv(ATTENTION_BACKEND_ENV, "FLASH_ATTN")
    with pytest.raises(ValueError) as e:
        get_attn_backend(_config(tmp_path, "cpu"))
    message = str(e.value)
    assert ATTENTION_BACKEND_ENV in message and "'FLASH_ATTN'" in message
    assert "['CPU_ATTN', 'FLASHINFER', 'TRITON_ATTN']" in message


def test_triton_on_cpu_needs_the_interpreter(tmp_path, env, fake_triton):
    env.setenv(ATTENTION_BACKEND_ENV, "TRITON_ATTN")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_attn_backend(_config(tmp_path, "cpu"))
    env.setenv("TRITON_INTERPRET", "1")
    assert get_attn_backend(_config(tmp_path, "cpu")) is fake_triton
