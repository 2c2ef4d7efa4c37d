"""Llama / Qwen2 / Qwen3 logits match transformers on tiny random checkpoints.

Each variant is a 2-layer model (hidden 64, 4 query heads, 2 KV heads, vocab
128) saved with ``save_pretrained`` and loaded through ``get_model``. Our
model runs on a flattened batch of prompts of mixed lengths; transformers runs
each prompt on its own. Two attention paths are checked:

* ``RefImpl``: plain causal SDPA per request (no KV cache) installed on every
  ``Attention`` layer -- tests the model code alone;
* the real ``CPUAttentionBackend`` with a paged KV cache, over a prefill, a
  decode step and a mixed chunk -- tests the model with the engine's
  attention contract (forward context, ``layer.kv_cache``, metadata builder).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import transformers

from engine.engine.arg_utils import EngineArgs
from engine.forward_context import set_forward_context
from engine.model_executor.layers.attention import Attention
from engine.model_executor.model_loader import get_model
from engine.v1.attention.backend import CommonAttentionMetadata

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# name -> (HF config class, HF model class, our class name, extra config fields)
VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama_llama3_rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": LLAMA3_ROPE}),
    "llama_bias": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    # head_dim 32: q is [T, 4 * 32] while hidden is 64.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "qwen3_tied": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"head_dim": 16, "tie_word_embeddings": True},
    ),
}

PROMPT_LENS = (5, 1, 9, 3)
ATOL = 1e-4


def _randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that every layer matters (HF's init is ~0.02)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """variant -> (checkpoint dir, HF model in eval mode), built on first use."""
    cache: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(variant: str):
        if variant not in cache:
            cfg_name, model_name, extra = VARIANTS[variant]
            config = getattr(transformers, cfg_name)(**TINY, **extra)
            torch.manual_seed(0)
            hf_model = getattr(transformers, model_name)(config).eval()
            _randomize_(hf_model, seed=len(cache) + 1)
            path = tmp_path_factory.mktemp(variant)
            hf_model.save_pretrained(path)
            cache[variant] = (str(path), hf_model)
        return cache[variant]

    return get


def _load_ours(path: str):
    glassbox_config = EngineArgs(model=path, device="cpu", dtype="float32").create_engine_config()
    model = get_model(glassbox_config, device=torch.device("cpu"), dtype=torch.float32)
    return glassbox_config, model


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def _hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    return hf_model(input_ids=torch.tensor([token_ids])).logits[0]  # [len, vocab]


# --------------------------------------------------------------------------
# Path 1: reference attention, full sequences, no KV cache
# --------------------------------------------------------------------------
@dataclass
class RefMetadata:
    query_start_loc: list[int]  # [num_reqs + 1]


class RefImpl:
    """Causal SDPA over each request's rows; ignores the KV cache."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        self.scale = scale
        self.group = num_heads // num_kv_heads

    def forward(self, layer, query, key, value, kv_cache, attn_metadata: RefMetadata, output):
        qsl = attn_metadata.query_start_loc
        for start, end in zip(qsl[:-1], qsl[1:]):
            q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))  # [heads, L, D]
            k = k.repeat_interleave(self.group, dim=0)
            v = v.repeat_interleave(self.group, dim=0)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            output[start:end] = out.transpose(0, 1)
        return output


@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_full_sequence_logits_match_transformers(hf_checkpoints, variant):
    path, hf_model = hf_checkpoints(variant)
    glassbox_config, model = _load_ours(path)
    attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert [m.layer_name for m in attn_layers] == [
        f"model.layers.{i}.self_attn.attn" for i in range(TINY["num_hidden_layers"])
    ]
    for layer in attn_layers:
        layer.impl = RefImpl(layer.num_heads, layer.head_size, layer.scale, layer.num_kv_heads)

    prompts = _prompts(seed=7)
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    qsl = [0]
    for p in prompts:
        qsl.append(qsl[-1] + len(p))
    metadata = {layer.layer_name: RefMetadata(qsl) for layer in attn_layers}
    with set_forward_context(metadata, glassbox_config):
        hidden = model(input_ids, positions)
    assert hidden.shape == (len(input_ids), TINY["hidden_size"])
    logits = model.compute_logits(hidden)

    expected = torch.cat([_hf_logits(hf_model, p) for p in prompts])
    assert logits.shape == expected.shape == (len(input_ids), TINY["vocab_size"])
    assert expected.abs().max() > 0.5  # the comparison is not between near-zero tensors
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------
# Path 2: the engine's paged CPU attention backend, prefill then decode
# --------------------------------------------------------------------------
class PagedRunner:
    """A miniature model runner: block tables, slot mapping, KV tensors."""

    def __init__(
        self, model, glassbox_config, num_reqs: int, block_size: int = 4, num_blocks: int = 64
    ):
        self.model = model
        self.glassbox_config = glassbox_config
        self.block_size = block_size
        self.layers = {m.layer_name: m for m in model.modules() if isinstance(m, Attention)}
        backend = next(iter(self.layers.values())).attn_backend
        for layer in self.layers.values():
            shape = backend.get_kv_cache_shape(
                num_blocks, block_size, layer.num_kv_heads, layer.head_size
            )
            layer.kv_cache = torch.zeros(shape)
        self.builder = backend.get_builder_cls()(block_size, torch.device("cpu"))
        self.next_free_block = 1  # block 0 is the null block
        self.block_tables: list[list[int]] = [[] for _ in range(num_reqs)]
        self.num_computed = [0] * num_reqs

    def step(self, new_tokens: list[list[int]]) -> torch.Tensor:
        """Run one step with ``new_tokens[i]`` for request i; logits for every new token."""
        ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        for i, toks in enumerate(new_tokens):
            start = self.num_computed[i]
            end = start + len(toks)
            while len(self.block_tables[i]) * self.block_size < end:
                self.block_tables[i].append(self.next_free_block)
                self.next_free_block += 1
            for pos in range(start, end):
                block = self.block_tables[i][pos // self.block_size]
                slots.append(block * self.block_size + pos % self.block_size)
            ids += toks
            positions += range(start, end)
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
        max_blocks = max(len(bt) for bt in self.block_tables)
        block_table = torch.tensor(
            [bt + [0] * (max_blocks - len(bt)) for bt in self.block_tables], dtype=torch.int32
        )
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl_t,
            query_start_loc_cpu=qsl_t,
            seq_lens=seq_lens_t,
            _seq_lens_cpu=seq_lens_t,
            num_reqs=len(new_tokens),
            num_actual_tokens=len(ids),
            max_query_len=max(len(t) for t in new_tokens),
            max_seq_len=max(seq_lens),
            block_table_tensor=block_table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
        )
        metadata = self.builder.build(common)
        with set_forward_context({name: metadata for name in self.layers}, self.glassbox_config):
            hidden = self.model(torch.tensor(ids), torch.tensor(positions))
        for i, toks in enumerate(new_tokens):
            self.num_computed[i] += len(toks)
        return self.model.compute_logits(hidden)


@pytest.mark.parametrize("variant", ["llama", "llama_llama3_rope", "qwen2_tied", "qwen3"])
@torch.no_grad()
def test_paged_prefill_decode_and_chunk_match_transformers(hf_checkpoints, variant):
    path, hf_model = hf_checkpoints(variant)
    glassbox_config, model = _load_ours(path)
    prompts = _prompts(seed=11)
    gen = torch.Generator().manual_seed(3)
    more = lambda n: torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist()  # noqa: E731
    # Step 1: prefill every prompt (the 1-token prompt takes the decode path).
    # Step 2: one decode token each.  Step 3: a chunk of 3 for request 0,
    # decodes for the rest -- a mixed batch over a partly filled cache.
    steps = [prompts, [more(1) for _ in prompts], [more(3)] + [more(1) for _ in prompts[1:]]]
    runner = PagedRunner(model, glassbox_config, num_reqs=len(prompts))
    ours = [runner.step(step) for step in steps]

    full_sequences = [sum((step[i] for step in steps), []) for i in range(len(prompts))]
    hf_full = [_hf_logits(hf_model, seq) for seq in full_sequences]
    offsets = [0] * len(prompts)
    for step, logits in zip(steps, ours):
        expected = []
        for i, toks in enumerate(step):
            expected.append(hf_full[i][offsets[i] : offsets[i] + len(toks)])
            offsets[i] += len(toks)
        torch.testing.assert_close(logits, torch.cat(expected), atol=ATOL, rtol=0)


@torch.no_grad()
def test_profile_run_without_metadata_gives_finite_hidden_states(hf_checkpoints):
    """attn_metadata=None (the worker's profile run): attention outputs zeros."""
    path, _ = hf_checkpoints("qwen3")
    glassbox_config, model = _load_ours(path)
    with set_forward_context(None, glassbox_config):
        hidden = model(torch.arange(10), torch.arange(10))
    assert hidden.shape == (10, TINY["hidden_size"]) and torch.isfinite(hidden).all()
    assert model.compute_logits(hidden[:3]).shape == (3, TINY["vocab_size"])
