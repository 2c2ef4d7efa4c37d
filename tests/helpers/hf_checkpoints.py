"""Real HF checkpoints for end-to-end tests, and transformers runs to compare against.

Used by ``tests/entrypoints/test_generate_parity.py`` and
``tests/entrypoints/test_default_model_e2e.py``:

* ``save_tiny_checkpoint`` builds a small random Llama / Qwen2 / Qwen3 model
  with transformers and writes it with ``save_pretrained`` (config.json,
  generation_config.json, model.safetensors), i.e. exactly the kind of folder
  ``LLM(path)`` loads.
* ``hf_greedy`` runs transformers' own ``generate(do_sample=False)`` on one
  prompt and returns the new token ids together with the log-softmax of the
  raw logits at every generated position -- the reference the engine must match.
* ``save_random_llama`` / ``random_prompts``: a random Llama (vocab 512, no
  tokenizer) and token-id prompts for ``tests/gpu/test_gpu_engine.py`` and
  ``tests/gpu/test_flashinfer.py``.
* ``default_model_path`` converts the embedded SmolLM2 at most once per test
  process, wherever several test modules ask for it.

Import with ``from tests.helpers.hf_checkpoints import ...``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Tiny but not trivial: 2 layers, grouped-query attention (4 query heads share
# 2 KV heads), vocab 256, room for prompts of a few hundred tokens.
TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    # transformers' default (0.02) gives nearly uniform logits, so greedy
    # decoding would mostly repeat one token. 0.2 makes every layer matter and
    # the greedy continuation varied.
    "initializer_range": 0.2,
    # Default Llama special ids; the saved generation_config.json therefore has
    # an EOS (2) that the engine must ignore under ignore_eos=True.
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# architecture key -> (transformers config class, model class, extra config fields)
TINY_ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # Qwen2 puts a bias on q/k/v.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # Qwen3 RMS-normalises q and k per head; head_dim 16 = hidden / heads.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


def save_tiny_checkpoint(arch: str, path: Path, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Build a random fp32 ``arch`` model, save it to ``path``; return it in eval
    mode. ``overrides`` replace fields of ``TINY_CONFIG`` (e.g. a smaller draft)."""
    import transformers

    config_cls_name, model_cls_name, extra = TINY_ARCHS[arch]
    config = getattr(transformers, config_cls_name)(**{**TINY_CONFIG, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(config).to(torch.float32).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    return model


def save_random_llama(path: Path, *, hidden_size: int, intermediate_size: int) -> str:
    """Save a random fp32 Llama for the GPU engine tests; return its folder.

    2 layers, 4 query heads sharing 2 KV heads (head size = hidden_size / 4),
    vocab 512 (no tokenizer: prompts are token ids), 1024 positions, weights
    from ``torch.manual_seed(0)`` with initializer_range 0.2. Used by
    ``tests/gpu/test_gpu_engine.py`` (hidden 128) and
    ``tests/gpu/test_flashinfer.py`` (hidden 256: head size 64).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=1024,
        initializer_range=0.2,
    )
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return str(path)


def random_prompts(lengths: list[int], seed: int = 1) -> list[dict[str, list[int]]]:
    """Token-id prompts of the given lengths, ids in [3, 512) (no specials),
    drawn in order from one generator: the first n prompts do not depend on
    how many follow."""
    g = torch.Generator().manual_seed(seed)
    return [
        {"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in lengths
    ]


@dataclass
class HFGreedy:
    """transformers' greedy continuation of one prompt."""

    token_ids: list[int]
    # [len(token_ids), vocab] log_softmax of the raw logits that chose each token.
    logprobs: torch.Tensor


def hf_greedy(
    model: torch.nn.Module,
    prompt_token_ids: list[int],
    max_new_tokens: int,
    *,
    stop_at_eos: bool = False,
) -> HFGreedy:
    """``model.generate(do_sample=False)`` on one prompt (no padding, no batching).

    With ``stop_at_eos=False`` EOS is disabled so exactly ``max_new_tokens``
    come back (the engine's ``ignore_eos=True``). With ``stop_at_eos=True`` the
    model's generation config decides, and the EOS token is included.
    """
    input_ids = torch.tensor([prompt_token_ids], dtype=torch.long)
    kwargs: dict[str, Any] = {
        "attention_mask": torch.ones_like(input_ids),
        "do_sample": False,
        "max_new_tokens": max_new_tokens,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    if not stop_at_eos:
        kwargs["eos_token_id"] = None
        kwargs["pad_token_id"] = 0
    # Greedy is greedy: don't let a generation_config.json add sampling knobs.
    kwargs.update(temperature=None, top_p=None, top_k=None)
    with torch.inference_mode():
        out = model.generate(input_ids, **kwargs)
    new_tokens = out.sequences[0, len(prompt_token_ids) :].tolist()
    if not stop_at_eos:
        assert len(new_tokens) == max_new_tokens, (
            f"transformers stopped after {len(new_tokens)} of {max_new_tokens} tokens"
        )
    logits = torch.cat([step_logits.float() for step_logits in out.logits], dim=0)
    assert logits.shape[0] == len(new_tokens)
    return HFGreedy(new_tokens, torch.log_softmax(logits, dim=-1))


# ---------------------------------------------------------------------------
# The embedded default model, converted once per test process
# ---------------------------------------------------------------------------
_default_model_path: str | None = None


def default_model_cache_root() -> str:
    """The cache ``LLM()`` itself uses: ``$GLASSBOX_CACHE``, else ``~/.cache/glassbox``.

    Not a temp dir: the notebooks, ``glassbox trace`` and an engine started by
    a test all look there, and pointing ``GLASSBOX_CACHE`` elsewhere would also
    move the compiled CPU kernels' cache (``engine/_cpu_ops.py``), so the
    engine process would compile them again (a minute or more on 2 cores).
    ``tests/model_executor/test_default_model.py`` times a conversion of its
    own in a temp dir."""
    from engine.model_executor.model_loader.default_model import DEFAULT_CACHE_ROOT

    return os.environ.get("GLASSBOX_CACHE") or os.path.expanduser(DEFAULT_CACHE_ROOT)


def default_model_path() -> str:
    """The converted SmolLM2 folder (in ``default_model_cache_root``); converts
    only when that cache does not hold it yet."""
    global _default_model_path
    if _default_model_path is None:
        from engine.model_executor.model_loader.default_model import (
            get_default_model_path,
        )

        _default_model_path = get_default_model_path(
            cache_dir=default_model_cache_root(), progress=False
        )
    return _default_model_path
