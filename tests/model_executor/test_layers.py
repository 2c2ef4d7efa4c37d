"""Unit tests for the model building blocks in engine/model_executor/layers/.

Where transformers has the same operation (RMSNorm, RoPE, llama3 frequency
scaling) it is the reference; the fused-weight loaders are checked against
plain concatenation of the separate tensors.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama import modeling_llama as hf_llama

from engine.config import CacheConfig, GlassboxConfig, ModelConfig
from engine.forward_context import set_forward_context
from engine.model_executor.layers.activation import SiluAndMul
from engine.model_executor.layers.attention import Attention
from engine.model_executor.layers.layernorm import RMSNorm
from engine.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from engine.model_executor.layers.logits_processor import LogitsProcessor
from engine.model_executor.layers.rotary_embedding import (
    Llama3RotaryEmbedding,
    RotaryEmbedding,
    get_rope,
)
from engine.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
    pad_vocab_size,
)
from engine.model_executor.models.utils import get_rope_parameters
from engine.v1.attention.backends.cpu_attn import CPUAttentionBackend
from engine.v1.kv_cache_interface import FullAttentionSpec

torch.manual_seed(0)


# ---------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_transformers(dtype):
    x = torch.randn(7, 32).to(dtype)
    ours = RMSNorm(32, eps=1e-5, dtype=dtype)
    ref = hf_llama.LlamaRMSNorm(32, eps=1e-5).to(dtype)
    with torch.no_grad():
        w = 1 + 0.3 * torch.randn(32)
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    out = ours(x)
    assert out.dtype == dtype
    if dtype == torch.float32:
        # forward_cpu (csrc/cpu) sums the squares in an order set by the
        # machine's SIMD width, transformers in torch's: a few float32 ulps apart.
        ulps = 8 * torch.finfo(torch.float32).eps
        torch.testing.assert_close(out, ref(x), atol=ulps, rtol=ulps)
    else:
        # Other dtypes run forward_native: transformers' torch ops in its order.
        torch.testing.assert_close(out, ref(x), atol=0, rtol=0)


def test_rmsnorm_fused_residual_returns_normed_sum_and_sum():
    norm = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16) + 0.5)
    x, residual = torch.randn(5, 16), torch.randn(5, 16)
    # On CPU/CUDA the fused paths work in place (vLLM's contract): pass copies.
    out, new_residual = norm(x.clone(), residual.clone())
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, norm(x + residual))
    # Per-head use (Qwen3 q/k norm): normalises over the last dim only.
    heads = torch.randn(5, 3, 16)
    torch.testing.assert_close(norm(heads)[:, 1], norm(heads[:, 1]))


def test_silu_and_mul():
    x = torch.randn(4, 10)
    torch.testing.assert_close(SiluAndMul()(x), torch.nn.functional.silu(x[:, :5]) * x[:, 5:])
    with pytest.raises(ValueError, match="even"):
        SiluAndMul()(torch.randn(2, 3))


# ---------------------------------------------------------------- RoPE
def _hf_rope(config: LlamaConfig, q, k, positions):
    """transformers' rotary path on [T, heads, D] tensors."""
    rotary = hf_llama.LlamaRotaryEmbedding(config)
    cos, sin = rotary(q, positions[None])  # [1, T, D]
    q_hf, k_hf = hf_llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    return q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ],
)
def test_rope_matches_transformers(rope_scaling):
    head_dim, heads, kv_heads = 16, 4, 2
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        rope_scaling=rope_scaling,
        rope_theta=500.0,
    )
    rope = get_rope(
        head_dim,
        max_position=128,
        rope_parameters=get_rope_parameters(config.to_dict()),
        dtype=torch.float32,
    )
    assert isinstance(rope, Llama3RotaryEmbedding if rope_scaling else RotaryEmbedding)
    positions = torch.tensor([0, 1, 2, 50, 3, 127, 9])  # several requests, flattened
    q, k = torch.randn(7, heads, head_dim), torch.randn(7, kv_heads, head_dim)
    q_ours, k_ours = rope(positions, q.reshape(7, -1).clone(), k.reshape(7, -1).clone())  # in place
    q_ref, k_ref = _hf_rope(config, q, k, positions)
    torch.testing.assert_close(q_ours.view(7, heads, head_dim), q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_ours.view(7, kv_heads, head_dim), k_ref, atol=1e-5, rtol=1e-5)


def test_llama3_inv_freq_matches_transformers_in_all_three_bands():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, rope_scaling=scaling)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    rope = Llama3RotaryEmbedding(32, 32, 64, 10000.0, True, torch.float32, 8.0, 1.0, 4.0, 32)
    inv_freq = rope._compute_inv_freq(10000.0)
    plain = RotaryEmbedding(32, 32, 64, 10000.0, True, torch.float32)._compute_inv_freq(10000.0)
    torch.testing.assert_close(inv_freq, expected.float())
    # Kept, slowed by the factor, and blended frequencies all occur.
    assert (inv_freq == plain).any() and torch.isclose(inv_freq, plain / 8).any()
    assert ((inv_freq < plain) & ~torch.isclose(inv_freq, plain / 8)).any()


def test_rope_gptj_style_and_partial_rotary_dim():
    rope = RotaryEmbedding(
        head_size=8,
        rotary_dim=4,
        max_position_embeddings=16,
        base=100.0,
        is_neox_style=False,
        dtype=torch.float32,
    )
    q = torch.randn(3, 2 * 8)
    positions = torch.tensor([0, 5, 9])
    q_out, k_out = rope(positions, q.clone())  # rotates in place
    assert k_out is None
    q3, q_out3 = q.view(3, 2, 8), q_out.view(3, 2, 8)
    torch.testing.assert_close(q_out3[..., 4:], q3[..., 4:])  # beyond rotary_dim: untouched
    torch.testing.assert_close(q_out3[0], q3[0])  # position 0: identity
    # GPT-J style rotates neighbouring pairs (0,1) and (2,3) by pos * inv_freq.
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, 4, 2).float() / 4))
    for t, pos in enumerate(positions.tolist()):
        for pair, f in enumerate(inv_freq.tolist()):
            a, b = q3[t, :, 2 * pair], q3[t, :, 2 * pair + 1]
            c, s = torch.cos(torch.tensor(pos * f)), torch.sin(torch.tensor(pos * f))
            torch.testing.assert_close(q_out3[t, :, 2 * pair], a * c - b * s)
            torch.testing.assert_close(q_out3[t, :, 2 * pair + 1], b * c + a * s)


def test_get_rope_shares_modules_and_rejects_unknown_types():
    a = get_rope(
        16, 64, rope_parameters={"rope_theta": 1e4, "rope_type": "default"}, dtype=torch.float32
    )
    b = get_rope(
        16, 64, rope_parameters={"rope_theta": 1e4, "rope_type": "default"}, dtype=torch.float32
    )
    c = get_rope(
        16, 64, rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, dtype=torch.float32
    )
    assert a is b and a is not c
    assert "cos_sin_cache" not in a.state_dict()  # derived, never in a checkpoint
    with pytest.raises(ValueError, match=r"rope_type 'yarn'.*\['default', 'llama3'\]"):
        get_rope(16, 64, rope_parameters={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        get_rope(16, 64, rope_parameters={"rope_type": "llama3", "factor": 8.0})


def test_get_rope_parameters_reads_old_and_new_config_styles():
    new = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}
    assert get_rope_parameters(new) == {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    old = {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 8.0}}
    assert get_rope_parameters(old) == {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    assert get_rope_parameters({}, default_theta=1e6) == {"rope_type": "default", "rope_theta": 1e6}


# ---------------------------------------------------------------- linear layers
def test_qkv_parallel_linear_loads_shards_and_fused_tensor():
    hidden, d, h, h_kv = 12, 4, 3, 1
    layer = QKVParallelLinear(hidden, d, h, h_kv, bias=True, prefix="layers.0.qkv_proj")
    assert layer.output_sizes == [12, 4, 4] and layer.weight.shape == (20, 12)
    wq, wk, wv = torch.randn(12, hidden), torch.randn(4, hidden), torch.randn(4, hidden)
    bq, bk, bv = torch.randn(12), torch.randn(4), torch.randn(4)
    # Any order: offsets, not arrival order, decide where each shard goes.
    for shard, w, b in (("v", wv, bv), ("q", wq, bq), ("k", wk, bk)):
        layer.weight.weight_loader(layer.weight, w, shard)
        layer.bias.weight_loader(layer.bias, b, shard)
    torch.testing.assert_close(layer.weight, torch.cat([wq, wk, wv]))
    x = torch.randn(5, hidden)
    out, out_bias = layer(x)
    assert out_bias is None
    torch.testing.assert_close(out, x @ torch.cat([wq, wk, wv]).T + torch.cat([bq, bk, bv]))

    fused = QKVParallelLinear(hidden, d, h, h_kv, bias=False)
    fused.weight.weight_loader(fused.weight, torch.cat([wq, wk, wv]), None)
    torch.testing.assert_close(fused.weight, layer.weight)
    assert fused.bias is None


def test_linear_loaders_reject_wrong_shapes_with_layer_name():
    layer = QKVParallelLinear(12, 4, 3, 1, bias=False, prefix="model.layers.0.self_attn.qkv_proj")
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.self_attn\.qkv_proj: shard 'k' expects shape \(4, 12\)",
    ):
        layer.weight.weight_loader(layer.weight, torch.randn(8, 12), "k")
    with pytest.raises(ValueError, match="shard id must be 'q', 'k' or 'v'"):
        layer.weight.weight_loader(layer.weight, torch.randn(4, 12), "x")
    with pytest.raises(ValueError, match="fused checkpoint tensor must have 20"):
        layer.weight.weight_loader(layer.weight, torch.randn(19, 12), None)
    merged = MergedColumnParallelLinear(6, [5, 5], bias=False, prefix="mlp.gate_up_proj")
    with pytest.raises(ValueError, match=r"shard id must be an int in \[0, 1\]"):
        merged.weight.weight_loader(merged.weight, torch.randn(5, 6), 2)
    row = RowParallelLinear(6, 3, bias=False, prefix="mlp.down_proj")
    with pytest.raises(ValueError, match=r"mlp\.down_proj: parameter expects shape \(3, 6\)"):
        row.weight.weight_loader(row.weight, torch.randn(6, 3))


def test_merged_column_parallel_linear_gate_up():
    layer = MergedColumnParallelLinear(6, [5, 5], bias=False)
    gate, up = torch.randn(5, 6), torch.randn(5, 6)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    x = torch.randn(2, 6)
    out, _ = layer(x)
    torch.testing.assert_close(out, torch.cat([x @ gate.T, x @ up.T], dim=-1))


def test_row_column_replicated_linear_and_bias_modes():
    x = torch.randn(3, 6)
    w, b = torch.randn(4, 6), torch.randn(4)
    for cls in (RowParallelLinear, ColumnParallelLinear, ReplicatedLinear):
        layer = cls(6, 4, bias=True)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        out, out_bias = layer(x)
        assert out_bias is None
        torch.testing.assert_close(out, x @ w.T + b)
    skip = RowParallelLinear(6, 4, bias=True, skip_bias_add=True)
    skip.weight.weight_loader(skip.weight, w)
    skip.bias.weight_loader(skip.bias, b)
    out, out_bias = skip(x)
    torch.testing.assert_close(out, x @ w.T)
    assert out_bias is skip.bias
    plain = ColumnParallelLinear(6, 4, bias=False, return_bias=False)
    plain.weight.weight_loader(plain.weight, w)
    torch.testing.assert_close(plain(x), x @ w.T)


# ---------------------------------------------------------------- embeddings / logits
def test_vocab_embedding_pads_rows_and_lm_head_ties():
    assert pad_vocab_size(100) == 128 and pad_vocab_size(128) == 128
    embed = VocabParallelEmbedding(100, 8, prefix="model.embed_tokens")
    assert embed.weight.shape == (128, 8)
    table = torch.randn(100, 8)
    with torch.no_grad():
        embed.weight.fill_(7.0)
    embed.weight.weight_loader(embed.weight, table)
    assert (embed.weight[100:] == 0).all()
    ids = torch.tensor([0, 99, 5])
    torch.testing.assert_close(embed(ids), table[ids])
    with pytest.raises(
        ValueError, match=r"model\.embed_tokens: expected a checkpoint tensor of shape \(100, 8\)"
    ):
        embed.weight.weight_loader(embed.weight, torch.randn(128, 8))

    head = ParallelLMHead(100, 8).tie_weights(embed)
    assert head.weight is embed.weight
    with pytest.raises(RuntimeError, match="LogitsProcessor"):
        head(ids)
    hidden = torch.randn(3, 8)
    logits = LogitsProcessor(100)(head, hidden)
    assert logits.shape == (3, 100)  # padding rows cut off
    torch.testing.assert_close(logits, hidden @ table.T)


def test_logits_processor_soft_cap_and_scale():
    head = ParallelLMHead(64, 4)
    with torch.no_grad():
        head.weight.copy_(torch.randn(64, 4) * 10)
    hidden = torch.randn(2, 4)
    raw = hidden @ head.weight.T
    capped = LogitsProcessor(64, soft_cap=5.0, scale=0.5)(head, hidden)
    torch.testing.assert_close(capped, 0.5 * 5.0 * torch.tanh(raw / 5.0))
    assert capped.abs().max() <= 2.5
    with pytest.raises(ValueError, match="soft_cap"):
        LogitsProcessor(64, soft_cap=0.0)


# ---------------------------------------------------------------- Attention layer
@pytest.fixture
def glassbox_config(tmp_path):
    model_config = ModelConfig(
        model=str(tmp_path),
        hf_config={"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 64},
    )
    return GlassboxConfig(model_config=model_config, cache_config=CacheConfig(block_size=8))


class RecordingImpl:
    def __init__(self, num_heads, head_size, scale, num_kv_heads):
        self.args = (num_heads, head_size, scale, num_kv_heads)
        self.calls = []

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
        self.calls.append(
            (layer, query.shape, key.shape, value.shape, kv_cache, attn_metadata, output.shape)
        )
        output.copy_(query * 2)
        return output


class RecordingBackend:
    @staticmethod
    def get_impl_cls():
        return RecordingImpl


def test_attention_uses_selector_backend_and_reports_kv_spec(glassbox_config):
    attn = Attention(
        4,
        16,
        0.25,
        num_kv_heads=2,
        glassbox_config=glassbox_config,
        prefix="model.layers.3.self_attn.attn",
    )
    assert (
        attn.attn_backend is CPUAttentionBackend and attn.get_attn_backend() is CPUAttentionBackend
    )
    assert (attn.impl.num_heads, attn.impl.head_size, attn.impl.scale, attn.impl.num_kv_heads) == (
        4,
        16,
        0.25,
        2,
    )
    assert attn.layer_name == "model.layers.3.self_attn.attn" and attn.kv_cache is None
    assert attn.get_kv_cache_spec(glassbox_config) == FullAttentionSpec(
        block_size=8, num_kv_heads=2, head_size=16, dtype="float32"
    )
    torch.set_default_dtype(torch.bfloat16)
    try:
        bf16 = Attention(4, 16, 0.25, 2, glassbox_config=glassbox_config, prefix="x.attn")
    finally:
        torch.set_default_dtype(torch.float32)
    assert bf16.get_kv_cache_spec(glassbox_config).dtype == "bfloat16"


def test_attention_forward_calls_impl_with_per_head_views(glassbox_config):
    attn = Attention(
        4,
        8,
        0.5,
        2,
        glassbox_config=glassbox_config,
        prefix="model.layers.0.self_attn.attn",
        attn_backend=RecordingBackend,
    )
    assert attn.impl.args == (4, 8, 0.5, 2)
    attn.kv_cache = torch.zeros(2, 3, 8, 2, 8)
    q, k, v = torch.randn(5, 32), torch.randn(5, 16), torch.randn(5, 16)
    md = object()
    with set_forward_context({"model.layers.0.self_attn.attn": md, "other": None}, glassbox_config):
        out = attn(q, k, v)
    ((layer, q_shape, k_shape, v_shape, kv_cache, got_md, out_shape),) = attn.impl.calls
    assert layer is attn and got_md is md and kv_cache is attn.kv_cache
    assert (q_shape, k_shape, v_shape, out_shape) == ((5, 4, 8), (5, 2, 8), (5, 2, 8), (5, 4, 8))
    torch.testing.assert_close(out, q * 2)  # the impl wrote into the returned buffer

    with set_forward_context(None, glassbox_config):  # profiling run
        zeros = attn(q, k, v)
    assert zeros.shape == (5, 32) and not zeros.any() and len(attn.impl.calls) == 1
    with set_forward_context({"model.layers.1.self_attn.attn": md}, glassbox_config):
        with pytest.raises(
            KeyError, match=r"no attention metadata for layer 'model\.layers\.0\.self_attn\.attn'"
        ):
            attn(q, k, v)


def test_attention_op_needs_the_layer_in_the_forward_context(glassbox_config):
    attn = Attention(
        4,
        8,
        0.5,
        2,
        glassbox_config=glassbox_config,
        prefix="m.attn",
        attn_backend=RecordingBackend,
    )
    q, k, v = torch.randn(5, 32), torch.randn(5, 16), torch.randn(5, 16)
    with set_forward_context({"m.attn": object()}):  # no config: no layers by name
        with pytest.raises(KeyError, match=r"attention layer 'm\.attn' is not in the forward"):
            attn(q, k, v)
    with pytest.raises(ValueError, match=r"duplicate attention layer name 'm\.attn'"):
        Attention(4, 8, 0.5, 2, glassbox_config=glassbox_config, prefix="m.attn")


def test_attention_rejects_bad_head_counts(glassbox_config):
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        Attention(4, 8, 0.5, 3, glassbox_config=glassbox_config, prefix="a.attn")
    with pytest.raises(ValueError, match="layer name"):
        Attention(4, 8, 0.5, 2, glassbox_config=glassbox_config, prefix="")
