"""A scripted n-gram speculative-decoding run for the tracing and TUI tests.

The tiny checkpoint with random weights (``REAL_MODEL_ARGS``), greedy,
``ignore_eos``: its outputs soon repeat a short cycle, so the n-gram
proposer (k = 3, lookup 1..3) finds matches in the prompts (built with
repetition) and in the outputs. The run is built so that every path of the
trace happens at least once:

  * drafts all rejected, partly accepted and all accepted (plus a bonus token);
  * a 10-token step budget with four requests decoding: the budget cuts a
    request's drafts short (``scheduled_spec_decode_tokens`` shorter than
    its ``spec.proposed``);
  * a 22-token prompt added mid-run: chunked prefill next to drafting requests;
  * a pool of 14 blocks of 4 tokens: a preemption (drafts dropped, recompute);
  * ``max_tokens`` ends a request inside a step's accepted drafts (the step
    produced more tokens than the request keeps).

Without ``speculative`` the same requests run without drafts: the outputs
must be the same (greedy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.v1.engine.llm_engine import LLMEngine
from tests.helpers.engine_fixtures import ids
from tests.tracing.scenario import make_engine, params

SPEC_CONFIG: dict[str, Any] = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
SPEC_ENGINE_ARGS: dict[str, Any] = dict(max_num_batched_tokens=10, num_gpu_blocks_override=14)
MAX_TOKENS = 16
# Sent id -> prompt; "long" is added after the second step.
SPEC_PROMPTS = {
    "partial": "w7 w21 w9 w8 w7 w8 w7",
    "mixed": "w1 w57 w2 w40 w41 w42 w43 w40 w41",
    "loop": "w27 w2 w1 w2 w3 w1 w2 w3 w1 w2",
    "long": " ".join(f"w{i}" for i in range(10, 30)) + " w10 w11",
}
LATE = "long"


def make_spec_engine(
    model_dir, trace_path: str | None, trace_level: str = "lifecycle", speculative: bool = True
) -> LLMEngine:
    """An in-process ``LLMEngine`` over the tiny model's shapes (random
    weights), with n-gram speculation unless ``speculative`` is False."""
    kwargs: dict[str, Any] = dict(SPEC_ENGINE_ARGS)
    if speculative:
        kwargs["speculative_config"] = dict(SPEC_CONFIG)
    return make_engine(model_dir, trace_path, trace_level, real_model=True, **kwargs)


def run_spec_scenario(
    engine: LLMEngine, after_each_step: Callable[[int], None] | None = None
) -> dict[str, list[int]]:
    """Drive ``engine`` through the run; returns each request's output token
    ids by the id it was sent under. ``after_each_step(n)`` runs after step n."""
    check = after_each_step or (lambda n: None)
    outputs: dict[str, list[int]] = {}

    def add(rid: str) -> None:
        engine.add_request(
            rid, {"prompt_token_ids": ids(SPEC_PROMPTS[rid])}, params(MAX_TOKENS, True)
        )

    for rid in SPEC_PROMPTS:
        if rid != LATE:
            add(rid)
    n = 0
    while engine.has_unfinished_requests() and n < 80:
        n += 1
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        check(n)
        if n == 2:
            add(LATE)
    # One last step tells the worker which requests finished.
    engine.step()
    check(n + 1)
    return outputs


def record_spec_scenario(
    model_dir, trace_path: str, trace_level: str = "lifecycle", speculative: bool = True
) -> dict[str, list[int]]:
    """Run the scenario on a fresh engine tracing to ``trace_path``; returns
    ``run_spec_scenario``'s outputs (the engine is shut down either way)."""
    engine = make_spec_engine(model_dir, trace_path, trace_level, speculative)
    try:
        return run_spec_scenario(engine)
    finally:
        engine.shutdown()
