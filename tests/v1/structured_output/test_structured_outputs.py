"""Structured outputs end to end on a tiny word-level model (vLLM twin tests:
tests/v1/structured_output/ and tests/v1/entrypoints/llm/test_struct_output_generate.py).

The model is a random 2-layer Llama over the tiny word vocabulary of
``tests/helpers/tiny_model.py`` (``<unk> <s> </s> <pad>`` = 0..3, ``w0..w59`` =
4..63, EOS 2), with an embedding of 128 rows: ids 67..127 exist in the model
but not in the tokenizer, so the mask must never allow them. Its tokens carry
no spaces, so a regex over words reads as their concatenation: ``w1(w2|w3)w5``
allows exactly ``w1``, then ``w2`` or ``w3``, then ``w5``, then EOS.
"""

from __future__ import annotations

import gc
import math
import re
import threading
import time
import weakref
from pathlib import Path

import pytest

from engine.config import StructuredOutputsConfig
from engine.entrypoints.llm import LLM
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.v1.request import RequestStatus
from engine.v1.structured_output.backend_xgrammar import XgrammarBackend
from tests.helpers.engine_fixtures import assert_engine_idle, get_scheduler
from tests.helpers.hf_checkpoints import save_tiny_checkpoint
from tests.helpers.tiny_model import make_tiny_model_dir

EOS = 2
MODEL_VOCAB = 128  # > the tokenizer's 67: padding rows the mask must forbid
REGEX = "w1(w2|w3)w5"
W = {f"w{i}": 4 + i for i in range(60)}
PROMPT = {"prompt_token_ids": [W["w7"], W["w8"], W["w9"]]}


def regex_params(seed: int, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 10)
    return SamplingParams(
        temperature=kwargs.pop("temperature", 1.0),
        seed=seed,
        structured_outputs=StructuredOutputsParams(regex=kwargs.pop("regex", REGEX)),
        **kwargs,
    )


def words(token_ids: list[int]) -> str:
    """The concatenated token strings (what the grammar matches), EOS dropped."""
    inv = {v: k for k, v in W.items()}
    return "".join(inv[t] for t in token_ids if t != EOS)


@pytest.fixture(scope="module")
def word_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("so") / "word_llama"
    make_tiny_model_dir(path)  # config + tokenizer; the weights overwrite config.json
    save_tiny_checkpoint("llama", path, vocab_size=MODEL_VOCAB)
    return path


@pytest.fixture(scope="module")
def llm(word_model: Path) -> LLM:
    return LLM(str(word_model), max_model_len=256, async_scheduling=False, max_logprobs=-1)


@pytest.fixture(scope="module", autouse=True)
def in_process_engines():
    """EngineCore in this process, so tests can look inside it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
        yield mp


def make_llm(word_model: Path, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 256)
    return LLM(str(word_model), **{"disable_log_stats": False, **kwargs})  # metrics are read


# -- the mask ------------------------------------------------------------------
def test_mask_allows_exactly_what_the_matcher_allows(llm: LLM, word_model: Path) -> None:
    """logprobs=-1 shows every row's finite entries: the runner's allowed set.
    At temperature 5 (nearly uniform) each step must allow exactly the tokens
    xgrammar's matcher allows after the tokens so far -- by hand: {w1},
    {w2, w3}, {w5}, {EOS} -- and never a padding id."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(str(word_model)), vocab_size=MODEL_VOCAB
    )
    compiled = xgr.GrammarCompiler(info).compile_regex(REGEX)
    by_hand = [{W["w1"]}, {W["w2"], W["w3"]}, {W["w5"]}, {EOS}]
    params = [regex_params(seed, temperature=5.0, logprobs=-1) for seed in range(12)]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    seen_second = set()
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop" and len(c.token_ids) == 4
        assert re.fullmatch(REGEX, words(c.token_ids))
        seen_second.add(c.token_ids[1])
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, MODEL_VOCAB)
        for step, (token, logprobs) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            runner_allowed = {t for t, lp in logprobs.items() if lp.logprob > -math.inf}
            matcher.fill_next_token_bitmask(bitmask)
            bits = bitmask[0].tolist()
            matcher_allowed = {t for t in range(MODEL_VOCAB) if (bits[t // 32] >> (t % 32)) & 1}
            assert runner_allowed == matcher_allowed == by_hand[step], step
            assert matcher.accept_token(token)
    # Both branches of (w2|w3) are reachable: the mask is not a greedy pick.
    assert seen_second <= {W["w2"], W["w3"]}


def test_mixed_batch_free_requests_unchanged(llm: LLM) -> None:
    free = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True) for _ in range(2)]
    prompts = [PROMPT, {"prompt_token_ids": [W["w3"], W["w4"]]}]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    mixed = llm.generate(
        [PROMPT, prompts[0], PROMPT, prompts[1]],
        [regex_params(1), free[0], regex_params(2, temperature=0), free[1]],
        use_tqdm=False,
    )
    assert [mixed[1].outputs[0].token_ids, mixed[3].outputs[0].token_ids] == alone
    assert re.fullmatch(REGEX, words(mixed[0].outputs[0].token_ids))
    assert re.fullmatch(REGEX, words(mixed[2].outputs[0].token_ids))
    assert_engine_idle(llm)


# -- the engine loop -------------------------------------------------------------
def _seeded_batch() -> tuple[list, list[SamplingParams]]:
    regex = "w1(w2|w3|w4)+w5"  # open-ended: max_tokens may cut it
    params = [regex_params(s, regex=regex, max_tokens=12) for s in range(6)]
    params.append(SamplingParams(temperature=1.0, seed=9, max_tokens=12))
    longs = [{"prompt_token_ids": [W[f"w{(i * k) % 60}"] for i in range(70)]} for k in (1, 7, 11)]
    return [PROMPT, longs[0], PROMPT, longs[1], PROMPT, longs[2], PROMPT], params


def test_async_chunked_preempted_match_serial(word_model: Path, llm: LLM) -> None:
    """Seeded constrained requests give the same tokens with async
    scheduling (deferred sampling), chunked prefill and preemption (KV cache
    too small for all of them) as on the plain serial loop."""
    prompts, params = _seeded_batch()
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for text, out in zip(expected[:6], params[:6], strict=True):
        assert re.fullmatch("w1(w2|w3|w4)+w5", words(text)) or len(text) == out.max_tokens
    busy = make_llm(
        word_model,
        async_scheduling=True,
        max_model_len=128,
        max_num_batched_tokens=32,  # the 70-token prompts are chunked
        num_gpu_blocks_override=12,  # 16-token blocks: not all 7 requests fit
        scheduler_reserve_full_isl=False,  # admit on the first chunk: overcommit
        enable_prefix_caching=True,
    )
    try:
        outs = busy.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        preemptions = [m for m in busy.get_metrics() if m.name == "glassbox:num_preemptions"]
        assert preemptions and preemptions[0].value > 0
        assert_engine_idle(busy)
    finally:
        busy.llm_engine.shutdown()


def test_n_stop_and_max_tokens(llm: LLM) -> None:
    outs = llm.generate([PROMPT], [regex_params(3, n=3)], use_tqdm=False)
    assert len(outs[0].outputs) == 3
    assert all(re.fullmatch(REGEX, words(c.token_ids)) for c in outs[0].outputs)
    # max_tokens cuts the match short: finish_reason length, a valid prefix.
    cut = llm.generate([PROMPT], [regex_params(3, max_tokens=2)], use_tqdm=False)[0]
    assert cut.outputs[0].finish_reason == "length"
    assert words(cut.outputs[0].token_ids) in ("w1w2", "w1w3")
    # A stop string inside the match ends it there.
    stop = llm.generate([PROMPT], [regex_params(3, regex="w1w2w5", stop=["w2"])], use_tqdm=False)
    assert stop[0].outputs[0].finish_reason == "stop"
    assert stop[0].outputs[0].stop_reason == "w2"
    assert stop[0].outputs[0].text.strip() == "w1"
    assert_engine_idle(llm)


def test_ngram_drafts_are_cut_by_the_grammar(word_model: Path, llm: LLM) -> None:
    """Serial n-gram speculation: drafts the grammar forbids are cut before
    verification (``update_draft_token_ids``); greedy outputs equal those of
    the engine without speculation, and every output matches."""
    # The prompt repeats w7 w8 w9, so after w7 w8 the n-gram drafts w9 ...,
    # which this grammar forbids.
    regex = "(w7w8)+w5"
    prompt = {"prompt_token_ids": [W["w7"], W["w8"], W["w9"]] * 4}
    params = [regex_params(0, regex=regex, temperature=0, max_tokens=16) for _ in range(2)]
    expected = [o.outputs[0].token_ids for o in llm.generate([prompt] * 2, params, use_tqdm=False)]
    spec = make_llm(
        word_model,
        async_scheduling=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    )  # fmt: skip
    try:
        proposed_kept: list[tuple[list[int], list[int]]] = []
        scheduler = get_scheduler(spec)
        original = type(scheduler).update_draft_token_ids

        def spy(self, draft_token_ids):
            original(self, draft_token_ids)
            for req_id, drafts in zip(
                draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=True
            ):
                if req_id in self.requests:
                    proposed_kept.append((list(drafts), list(self.requests[req_id].spec_token_ids)))

        type(scheduler).update_draft_token_ids = spy
        try:
            outs = spec.generate([prompt] * 2, params, use_tqdm=False)
        finally:
            type(scheduler).update_draft_token_ids = original
        assert [o.outputs[0].token_ids for o in outs] == expected
        for o in outs:
            assert re.fullmatch(regex, words(o.outputs[0].token_ids))
        assert any(kept for _, kept in proposed_kept), "no draft survived"
        assert any(len(kept) < len(drafts) for drafts, kept in proposed_kept), "none was cut"
        for drafts, kept in proposed_kept:
            assert drafts[: len(kept)] == kept
        assert_engine_idle(spec)
    finally:
        spec.llm_engine.shutdown()


def test_grammar_wait_does_not_block_others(word_model: Path, monkeypatch) -> None:
    """A request whose grammar is still compiling waits in
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR (skipped_waiting) while a free one
    runs; once the compile finishes it is scheduled."""
    release = threading.Event()
    original = XgrammarBackend.compile_grammar

    def slow_compile(self, request_type, grammar_spec):
        assert release.wait(timeout=30)
        return original(self, request_type, grammar_spec)

    monkeypatch.setattr(XgrammarBackend, "compile_grammar", slow_compile)
    engine = make_llm(word_model, async_scheduling=False).llm_engine
    try:
        engine.add_request("so", PROMPT, regex_params(0))
        engine.add_request(
            "free", PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        )
        scheduler = engine.engine_core.engine_core.scheduler
        finished: set[str] = set()
        for _ in range(3):
            finished |= {o.request_id for o in engine.step() if o.finished}
        assert finished == {"free"}
        (waiting,) = scheduler.skipped_waiting
        assert waiting.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        release.set()
        # The compile finishes on the pool's thread while this one steps: wait
        # by the clock, not a step count (an idle step takes tens of microseconds).
        texts = {}
        deadline = time.monotonic() + 30
        while "so" not in texts and time.monotonic() < deadline:
            texts.update({o.request_id: o for o in engine.step() if o.finished})
        assert re.fullmatch(REGEX, words(texts["so"].outputs[0].token_ids))
    finally:
        release.set()
        engine.shutdown()


def test_finished_and_aborted_requests_free_their_matchers(llm: LLM) -> None:
    engine = llm.llm_engine
    scheduler = get_scheduler(llm)
    engine.add_request("a", PROMPT, regex_params(0, regex="w1(w2)+w5", max_tokens=50))
    (request,) = scheduler.requests.values()
    deadline = time.monotonic() + 30
    while request.num_output_tokens < 2 and time.monotonic() < deadline:
        engine.step()  # returns at once while the grammar compiles
    assert request.status == RequestStatus.RUNNING  # compiled, and decoding
    grammar = weakref.ref(request.structured_output_request.grammar)
    engine.abort_request(["a"])
    while engine.has_unfinished_requests():
        engine.step()
    del request
    gc.collect()
    assert grammar() is None
    assert_engine_idle(llm)


def test_more_than_128_constrained_requests_fill_in_parallel(word_model: Path, monkeypatch) -> None:
    """vLLM's threshold: above 128 constrained requests in a step, threads
    fill the rows, 16 requests each; the outputs still match."""
    from engine.v1.structured_output import StructuredOutputManager

    calls: list[int] = []
    original = StructuredOutputManager._fill_bitmasks

    def spy(self, grammars, first_row):
        calls.append(len(grammars))
        return original(self, grammars, first_row)

    monkeypatch.setattr(StructuredOutputManager, "_fill_bitmasks", spy)
    llm = make_llm(word_model, async_scheduling=False, max_num_seqs=160)
    try:
        params = [regex_params(s, temperature=5.0) for s in range(140)]
        outs = llm.generate([PROMPT] * 140, params, use_tqdm=False)
        assert all(re.fullmatch(REGEX, words(o.outputs[0].token_ids)) for o in outs)
        assert calls and max(calls) == 16  # the parallel path, 16 requests a task
    finally:
        llm.llm_engine.shutdown()


# -- bad input -----------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"regex": "w1(", "json": None}, "structured_outputs.regex"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": {"type": "integer", "multipleOf": 3}}, "multipleOf"),
        ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON schema object"),
        ({"json": {"type": "strin"}}, 'not a valid JSON schema: Unsupported type "strin"'),
        ({"json": {"type": "string", "format": ["x"]}}, "uses format=['x']"),
        ({"grammar": "root ::= "}, "structured_outputs.grammar"),
    ],
)
def test_bad_constraints_fail_before_the_engine(llm: LLM, kwargs, message) -> None:
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs))
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate([PROMPT], [params], use_tqdm=False)
    assert_engine_idle(llm)


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "structured_outputs needs one constraint"),
        ({"regex": "a", "choice": ["a"]}, "one kind of constraint, got 2: regex, choice"),
        ({"choice": []}, "structured_outputs.choice must not be an empty list"),
        ({"choice": ["a", 1]}, "structured_outputs.choice"),
        ({"grammar": "  "}, "structured_outputs.grammar must not be an empty string"),
        ({"regex": 5}, "structured_outputs.regex"),
        ({"json_object": True, "disable_any_whitespace": True}, "disable_any_whitespace"),
        ({"json_object": True, "whitespace_pattern": " "}, "whitespace_pattern"),
        ({"json_object": False}, "structured_outputs.json_object must be true"),
        ({"json": _deep(65)}, "nested more than 64 levels deep"),
    ],
)
def test_params_validation(kwargs, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_backend_config() -> None:
    assert StructuredOutputsConfig().backend == "auto"
    StructuredOutputsConfig(backend="xgrammar")
    with pytest.raises(ValueError, match="'guidance' is a vLLM backend Glassbox does not have"):
        StructuredOutputsConfig(backend="guidance")
    with pytest.raises(ValueError, match="backend='nope' is unknown"):
        StructuredOutputsConfig(backend="nope")
    with pytest.raises(ValueError, match="unknown field"):
        StructuredOutputsConfig.from_dict({"backnd": "auto"})


def test_async_speculation_is_refused(word_model: Path) -> None:
    spec = make_llm(
        word_model,
        async_scheduling=True,
        speculative_config={"model": str(word_model), "num_speculative_tokens": 2},
    )
    try:
        with pytest.raises(ValueError, match="needs async scheduling off"):
            spec.generate([PROMPT], [regex_params(0)], use_tqdm=False)
        assert_engine_idle(spec)
    finally:
        spec.llm_engine.shutdown()


def test_chat_is_constrained_too(llm: LLM) -> None:
    params = SamplingParams(
        temperature=1.0, seed=4, structured_outputs=StructuredOutputsParams(choice=["w5", "w9"])
    )
    out = llm.chat([{"role": "user", "content": "w1 w2"}], params, use_tqdm=False)
    assert out[0].outputs[0].text.strip() in ("w5", "w9")


def test_no_tokenizer_no_grammar(word_model: Path) -> None:
    bare = make_llm(word_model, skip_tokenizer_init=True, async_scheduling=False)
    try:
        with pytest.raises(ValueError, match="structured_outputs needs a tokenizer"):
            bare.generate([PROMPT], [regex_params(0)], use_tqdm=False)
        assert_engine_idle(bare)
    finally:
        bare.llm_engine.shutdown()
