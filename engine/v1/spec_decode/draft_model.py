"""DraftModelProposer: a smaller causal LM of the same vocabulary drafts k tokens.

vLLM twin: ``vllm/v1/spec_decode/draft_model.py`` (``DraftModelProposer``:
``_create_draft_vllm_config``, ``_get_model``, the vocabulary check).
Read it for what makes a draft model different from EAGLE: it is a whole model
of its own (any architecture the registry knows), built from the draft's
``ModelConfig`` under the name prefix ``"draft_model"`` so that its attention
layers get cache tensors of their own, and it shares nothing with the target.
Its first pass reads the token at each position (``first_pass_shift`` 0),
so it runs one position more per request than an EAGLE head: the token the
target just sampled. The drafting itself is ``SpecDecodeBaseProposer``'s.
Sessions: 06 (speculative decoding).

Simpler than vLLM: the draft runs with the target's tensor-parallel size of 1
and without quantization of its own (vLLM carries a draft parallel config and
drops the target's quantization for the draft).
"""

from __future__ import annotations

from engine.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer


class DraftModelProposer(SpecDecodeBaseProposer):
    # Reads the token at each position; builds its model with the base class's
    # _get_model (the draft's config, prefix "draft_model") and shares nothing.
    first_pass_shift = 0
    pass_hidden_states_to_model = False
