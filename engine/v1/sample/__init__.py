"""The sampler: turns one row of logits per request into one next token.

vLLM twin: ``vllm/v1/sample/`` (its ``__init__.py`` is empty).
Read it for: the layout of the sampling code.

- ``metadata.py``: ``SamplingMetadata``, the per-step, per-row knobs
  (temperature, top-p/top-k, penalties, masks, generators) as tensors, and
  ``build_sampling_metadata`` that makes it from the batch's SamplingParams.
- ``sampler.py``: ``Sampler``, the fixed order of operations
  (raw logprobs -> masks -> penalties -> greedy / temperature -> min-p ->
  top-k/top-p -> random draw -> gathered logprobs).
- ``ops/``: the tensor operations it calls (penalties, bad words,
  top-k/top-p + random sampling).
- ``logits_processor/``: min-p, logit bias and min-tokens as persistent
  logits processors, built once and kept in step with the batch through
  ``BatchUpdate``; custom processors plug in the same way.

What the sampler returns (``SamplerOutput``, ``LogprobsTensors``) lives in
``engine/v1/outputs.py``, as in vLLM.

Sessions: 05 (attention + sampling).
"""
