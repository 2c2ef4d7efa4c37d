"""Speculative decoding: propose a few tokens cheaply, verify them in one target step.

vLLM twin: ``vllm/v1/spec_decode/`` (its ``__init__.py`` is empty).
Read it for: the layout of the proposing side. A proposer (n-gram prompt
lookup, a small draft model, an EAGLE head) guesses up to k next tokens per
request; the runner feeds them to the target model as extra query tokens, so
one forward pass yields the target's logits at every draft position plus one
more; the rejection sampler (``engine/v1/sample/rejection_sampler.py``) keeps
the longest acceptable prefix and adds one token of its own.

- ``metadata.py``: ``SpecDecodeMetadata``, where each request's drafts and
  their logits rows sit in the flattened batch.
- ``ngram_proposer.py``: ``NgramProposer``, drafts from the request's own
  history (prompt lookup).
- ``llm_base_proposer.py``: ``SpecDecodeBaseProposer``, drafting with a model
  of our own: a first pass over the verified tokens, then one pass per draft.
- ``draft_model.py``: ``DraftModelProposer``, a smaller model of the same
  vocabulary; ``eagle.py``: ``EagleProposer``, an EAGLE head over the
  target's hidden states.
- ``metrics.py``: ``SpecDecodingStats``, drafts and acceptances per step.

Sessions: 06 (speculative decoding).
"""
