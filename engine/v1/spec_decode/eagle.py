"""EagleProposer: an EAGLE head drafts from the target's own hidden states.

vLLM twin: ``vllm/v1/spec_decode/eagle.py`` (``EagleProposer``), with the
sharing in ``llm_base_proposer.py`` (``_maybe_share_embeddings``,
``_maybe_share_lm_head``).
Read it for how EAGLE differs from a draft model. The head
(``engine/model_executor/models/llama_eagle.py``) is one decoder layer, not a
model: at position p it reads the target's last hidden state at p and the
token at p + 1 (``first_pass_shift`` 1), so the first pass runs the positions
the target ran this step, minus the rejected drafts and minus the last (whose
next token is not known yet), and each later pass feeds the head's own output
back in with the draft it scored. It scores with the target's LM head and, when
its checkpoint has none, embeds with the target's embedding.
The runner keeps the target's hidden states of the step for it
(``ExecuteModelState.hidden_states``). An EAGLE cache entry at a block's last
position depends on the next block's first token, so a prefix-cache hit gives
up its last block (``use_eagle`` in ``KVCacheManager``), as in vLLM.
Sessions: 06 (speculative decoding).

Simpler than vLLM: EAGLE-1 Llama-style heads only, without EAGLE-3, MTP,
DFlash or tree drafting, and the head drafts eagerly (no CUDA graphs).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer


class EagleProposer(SpecDecodeBaseProposer):
    first_pass_shift = 1
    pass_hidden_states_to_model = True

    def _get_model(self, dtype: torch.dtype) -> nn.Module:
        target_hidden = self.glassbox_config.model_config.hf_config.get("hidden_size")
        head_hidden = self.draft_model_config.hf_config.get("hidden_size")
        if target_hidden != head_hidden:
            raise ValueError(
                f"speculative_config.model={self.speculative_config.model!r}: the EAGLE head's "
                f"hidden_size={head_hidden} differs from the target's hidden_size={target_hidden}"
            )
        return super()._get_model(dtype)

    def _maybe_share_embeddings(self, target_model: nn.Module) -> None:
        assert self.model is not None
        if not self.model.has_own_embed_tokens:
            self.model.model.embed_tokens = target_model.model.embed_tokens

    def _maybe_share_lm_head(self, target_model: nn.Module) -> None:
        assert self.model is not None
        self.model.lm_head = target_model.lm_head
