"""get_model / DefaultModelLoader / DummyModelLoader / ModelRegistry.

Checkpoints are tiny random Llama models written with transformers'
``save_pretrained``; the error tests then damage them on disk.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from engine.config import LoadConfig
from engine.engine.arg_utils import EngineArgs
from engine.model_executor.layers.attention import Attention
from engine.model_executor.model_loader import (
    DefaultModelLoader,
    DummyModelLoader,
    get_model,
    get_model_loader,
)
from engine.model_executor.models import ModelRegistry
from engine.model_executor.models.llama import LlamaForCausalLM as GlassboxLlama

TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


@pytest.fixture
def checkpoint(tmp_path, hf_model):
    """A single-file checkpoint folder (copy per test: tests damage it)."""
    path = tmp_path / "ckpt"
    hf_model.save_pretrained(path)
    assert os.listdir(path).count("model.safetensors") == 1
    return path


def _config(path, **kwargs):
    kwargs = {"device": "cpu", "dtype": "float32", **kwargs}
    return EngineArgs(model=str(path), **kwargs).create_engine_config()


def _load(path, **kwargs):
    return get_model(_config(path, **kwargs), device=torch.device("cpu"), dtype=torch.float32)


def _rewrite(path, edit):
    """Apply ``edit`` to the tensors of path/model.safetensors and save them back."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_loads_every_parameter_from_hf_names(checkpoint, hf_model):
    model = _load(checkpoint)
    assert isinstance(model, GlassboxLlama) and not model.training
    params = dict(model.named_parameters())
    hf = dict(hf_model.named_parameters())
    layer = "model.layers.1"
    torch.testing.assert_close(
        params[f"{layer}.self_attn.qkv_proj.weight"],
        torch.cat([hf[f"{layer}.self_attn.{x}_proj.weight"] for x in "qkv"]),
    )
    torch.testing.assert_close(
        params[f"{layer}.mlp.gate_up_proj.weight"],
        torch.cat([hf[f"{layer}.mlp.gate_proj.weight"], hf[f"{layer}.mlp.up_proj.weight"]]),
    )
    torch.testing.assert_close(
        params["model.embed_tokens.weight"][:96], hf["model.embed_tokens.weight"]
    )
    torch.testing.assert_close(params["lm_head.weight"][:96], hf["lm_head.weight"])
    attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert len(attn_layers) == 2 and all(m.kv_cache is None for m in attn_layers)


def test_sharded_checkpoint_with_index_loads_the_same_weights(tmp_path, hf_model, checkpoint):
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="20KB")
    files = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
    assert len(files) > 2 and "model.safetensors.index.json" in os.listdir(sharded)
    # A stray file the index does not list is ignored (e.g. a consolidated copy).
    save_file({"junk": torch.zeros(1)}, sharded / "consolidated.safetensors")
    single = dict(_load(checkpoint).named_parameters())
    for name, param in _load(sharded, load_format="safetensors").named_parameters():
        torch.testing.assert_close(param, single[name], msg=name)

    os.remove(sharded / files[1])
    with pytest.raises(ValueError, match=rf"lists weight files that do not exist.*{files[1]}"):
        _load(sharded)


def test_missing_weights_are_listed(checkpoint):
    def drop(tensors):
        del tensors["model.norm.weight"]
        del tensors["model.layers.1.self_attn.k_proj.weight"]  # one shard of a fused param

    _rewrite(checkpoint, drop)
    with pytest.raises(ValueError, match="missing weights") as err:
        _load(checkpoint)
    msg = str(err.value)
    assert "'model.norm.weight'" in msg and "'model.layers.1.self_attn.qkv_proj.weight'" in msg
    assert "layers.0" not in msg


@pytest.mark.parametrize(
    "extra_name",
    [
        "model.layers.0.self_attn.extra_proj.weight",
        "model.layers.0.mlp.up_proj.scale",
        "vision_tower.weight",
    ],
)
def test_unexpected_tensor_is_named(checkpoint, extra_name):
    _rewrite(checkpoint, lambda t: t.__setitem__(extra_name, torch.zeros(2)))
    with pytest.raises(ValueError, match=f"unexpected checkpoint tensor '{extra_name}'"):
        _load(checkpoint)


def test_rotary_inv_freq_buffers_in_checkpoint_are_skipped(checkpoint):
    _rewrite(
        checkpoint,
        lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4)),
    )
    _load(checkpoint)


def test_wrong_shape_names_tensor_and_parameter(checkpoint):
    def reshape(tensors):
        tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(32, 40)

    _rewrite(checkpoint, reshape)
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*expects shape \(32, 48\)"
    ):
        _load(checkpoint)


def test_corrupt_safetensors_file_is_named(checkpoint):
    file = checkpoint / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"could not read safetensors file .*model\.safetensors"):
        _load(checkpoint)


def test_folder_without_weights(checkpoint):
    os.remove(checkpoint / "model.safetensors")
    with pytest.raises(ValueError, match=r"no \*\.safetensors weight files"):
        _load(checkpoint)


def test_unknown_architecture_lists_supported(checkpoint):
    config_path = checkpoint / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = ["MambaForCausalLM"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"\['MambaForCausalLM'\] are not supported") as err:
        _load(checkpoint)
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(err.value)
    with pytest.raises(ValueError, match="lists no 'architectures'"):
        ModelRegistry.resolve_model_cls([])


def test_registry_register_model():
    registry = type(ModelRegistry)({})
    registry.register_model("MyLlama", "engine.model_executor.models.llama:LlamaForCausalLM")
    registry.register_model("Direct", GlassboxLlama)
    assert registry.resolve_model_cls(["Unknown", "MyLlama"]) is GlassboxLlama
    assert registry.resolve_model_cls("Direct") is GlassboxLlama
    with pytest.raises(ValueError, match="module:ClassName"):
        registry.register_model("Bad", "no_colon")


def test_hub_id_offline_and_not_cached_is_a_clear_error(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    loader = DefaultModelLoader(LoadConfig())
    with pytest.raises(
        ValueError, match=r"'glassbox-test/not-a-model' is not a local folder.*offline"
    ):
        loader.download_model(SimpleNamespace(model="glassbox-test/not-a-model"))


def test_dummy_weights_are_deterministic_per_seed_and_small(checkpoint):
    os.remove(checkpoint / "model.safetensors")  # dummy needs config.json only
    a = dict(_load(checkpoint, load_format="dummy", seed=3).named_parameters())
    b = dict(_load(checkpoint, load_format="dummy", seed=3).named_parameters())
    c = dict(_load(checkpoint, load_format="dummy", seed=4).named_parameters())
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert not torch.equal(a[name], c[name]), name
        assert a[name].abs().max() <= 1e-3 and a[name].std() > 0, name
    assert isinstance(get_model_loader(LoadConfig(load_format="dummy")), DummyModelLoader)


def test_bf16_model_and_kv_spec_dtype(checkpoint):
    config = _config(checkpoint, dtype="bfloat16")
    model = get_model(config, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    layer = next(m for m in model.modules() if isinstance(m, Attention))
    assert layer.get_kv_cache_spec(config).dtype == "bfloat16"
    assert torch.get_default_dtype() == torch.float32  # restored after loading
