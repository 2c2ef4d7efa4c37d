"""EAGLE-1 head for Llama-family targets: one decoder layer over the target's features.

vLLM twin: ``vllm/model_executor/models/llama_eagle.py``
(``EagleLlamaForCausalLM``, its inner ``LlamaModel``), with the architecture
renaming of ``vllm/transformers_utils/configs/eagle.py`` (``EAGLEConfig``:
``LlamaForCausalLM`` -> ``EagleLlamaForCausalLM``, done here by
``GlassboxConfig._create_draft_model_config``).
Read it for what an EAGLE head computes. At position p it takes the target's
last hidden state there (``hidden_states``, [T, hidden]) and the embedding of
the token at p + 1, joins them (``fc``: [T, 2 * hidden] -> [T, hidden]) and
runs Llama decoder layers on the result -- the first one without its input
norm, as the EAGLE paper's head has none -- and no final norm. What comes out
is the head's guess of the target's *next* hidden state: scored by the
target's own LM head it gives a draft token, and fed back in with that token
it gives the next one. ``forward`` returns it twice (vLLM's shape: one copy to
score, one to feed back).
Sessions: 06 (speculative decoding).

Checkpoints (e.g. ``yuhuili/EAGLE-LLaMA3-Instruct-8B``) store ``fc.weight``,
``layers.N.*`` and sometimes ``embed_tokens.weight``, without the ``model.``
prefix; ``load_weights`` adds it. Without an embedding of its own the head
uses the target's (``has_own_embed_tokens`` False; ``EagleProposer`` shares
it). The LM head is always the target's.

Simpler than vLLM: no EAGLE-3 (auxiliary hidden states of several target
layers, a draft vocabulary of its own), no quantized heads, no torch.compile;
an ``lm_head.weight`` in the checkpoint is ignored (vLLM keeps it when
present). The layers are named under the caller's prefix (``draft_model``),
so they need no renumbering after the target's (vLLM's ``start_layer_id``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.model_executor.layers.linear import ReplicatedLinear
from engine.model_executor.layers.logits_processor import LogitsProcessor
from engine.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from engine.model_executor.models.llama import LlamaDecoderLayer, LlamaModel
from engine.model_executor.models.utils import load_stacked_weights, maybe_prefix

if TYPE_CHECKING:
    from engine.config import GlassboxConfig


class EagleLlamaModel(nn.Module):
    def __init__(self, *, glassbox_config: GlassboxConfig, prefix: str = "") -> None:
        super().__init__()
        config = glassbox_config.model_config.hf_config
        self.prefix = prefix
        hidden = config["hidden_size"]
        self.embed_tokens = VocabParallelEmbedding(
            config["vocab_size"], hidden, prefix=maybe_prefix(prefix, "embed_tokens")
        )
        # [embedding of token p+1 ; target hidden state at p] -> hidden
        self.fc = ReplicatedLinear(
            2 * hidden, hidden, bias=False, prefix=maybe_prefix(prefix, "fc"), return_bias=False
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(glassbox_config, prefix=maybe_prefix(prefix, f"layers.{i}"))
            for i in range(config["num_hidden_layers"])
        )
        # EAGLE's head normalises nothing on the way in: fc's output is the input.
        self.layers[0].input_layernorm = nn.Identity()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]: the token at p + 1 for each position p
        positions: torch.Tensor,  # [T]
        hidden_states: torch.Tensor,  # [T, hidden]: the target's (or our last) state at p
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat((self.embed_tokens(input_ids), hidden_states), dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x = x + residual  # no final norm
        return x, x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_stacked_weights(self, weights, LlamaModel.stacked_params_mapping, self.prefix)


class EagleLlamaForCausalLM(nn.Module):
    def __init__(self, *, glassbox_config: GlassboxConfig, prefix: str = "") -> None:
        super().__init__()
        config = glassbox_config.model_config.hf_config
        self.config = config
        self.model = EagleLlamaModel(
            glassbox_config=glassbox_config, prefix=maybe_prefix(prefix, "model")
        )
        self.logits_processor = LogitsProcessor(
            config["vocab_size"], scale=config.get("logit_scale", 1.0)
        )
        # The target's LM head, set by EagleProposer.load_model.
        self.lm_head: nn.Module | None = None
        # False once loaded from a checkpoint without an embedding: use the target's.
        self.has_own_embed_tokens = True

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, positions, hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "EagleProposer shares the target's LM head"
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def inner_names() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("lm_head."):
                    continue  # scored with the target's head
                yield name.removeprefix("model."), tensor

        loaded = {f"model.{name}" for name in self.model.load_weights(inner_names())}
        embed = "model.embed_tokens.weight"
        if embed not in loaded:
            # Counted as loaded: EagleProposer replaces it with the target's.
            self.has_own_embed_tokens = False
            loaded.add(embed)
        return loaded
