"""Tensor operations the Sampler calls.

vLLM twin: ``vllm/v1/sample/ops/`` (its ``__init__.py`` is empty).
Read it for: which step of sampling lives in which file --
``penalties.py`` (repetition / frequency / presence), ``bad_words.py``
(banned token sequences), ``topk_topp_sampler.py`` (top-k / top-p masking and
the random draw). vLLM also has ``logprobs.py`` (a compiled rank counter) and
``topk_topp_triton.py`` (a Triton kernel); Glassbox does both in plain torch
inside ``sampler.py`` / ``topk_topp_sampler.py``.
Sessions: 05.
"""
