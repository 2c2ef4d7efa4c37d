"""Tests for engine/v1/engine/output_processor.py, detokenizer.py and
parallel_sampling.py (twins of the same files under vllm/v1/engine/).

EngineCore is played by hand: each test feeds ``EngineCoreOutput`` deltas to a
real ``OutputProcessor`` that detokenizes with the tiny word-level tokenizer
(ids 9, 10, 11 ... are "w5", "w6", "w7" ...).
"""

from __future__ import annotations

import asyncio

import pytest

from engine.logprobs import Logprob
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.transformers_utils.tokenizer import get_tokenizer
from engine.v1.engine import EngineCoreOutput, FinishReason
from engine.v1.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from engine.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
from engine.v1.engine.parallel_sampling import ParentRequest
from engine.v1.metrics.stats import PrefillStats
from engine.v1.outputs import LogprobsLists
from tests.helpers.engine_fixtures import BOS, EOS, ids, make_engine_core_request
from tests.helpers.tiny_model import make_tiny_model_dir

DELTA = RequestOutputKind.DELTA
CUMULATIVE = RequestOutputKind.CUMULATIVE
FINAL_ONLY = RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    model = make_tiny_model_dir(tmp_path_factory.mktemp("op") / "tiny")
    return get_tokenizer(str(model))


@pytest.fixture
def processor(tokenizer):
    return OutputProcessor(tokenizer, log_stats=True)


def params(kind=CUMULATIVE, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, output_kind=kind, **kwargs)


def out(request_id, words, finish=None, stop_reason=None, **kwargs) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id=request_id,
        new_token_ids=ids(words) if isinstance(words, str) else list(words),
        finish_reason=finish,
        stop_reason=stop_reason,
        **kwargs,
    )


def request_for(request_id, prompt="w5", sp=None, external_req_id=None):
    """A request after ``assign_request_id``; the internal id is
    ``request_id`` (the user's id too, unless ``external_req_id`` is given)."""
    request = make_engine_core_request(request_id, ids(prompt), sp or params())
    request.external_req_id = external_req_id or request_id
    return request


def add(processor, request_id="r", prompt="w5", sp=None, prompt_text="w5", **kwargs):
    request = request_for(request_id, prompt, sp, **kwargs)
    processor.add_request(request, prompt_text)
    return request


def texts(request_outputs):
    return [o.outputs[0].text for o in request_outputs]


# ---------------------------------------------------------------------------
# Output kinds over several steps
# ---------------------------------------------------------------------------
STEPS = [out("r", "w6"), out("r", "w7 w8"), out("r", "w9", FinishReason.LENGTH)]


def run_steps(processor, steps):
    per_step = []
    for step in steps:
        result = processor.process_outputs([step])
        assert result.reqs_to_abort == []
        per_step.append(result.request_outputs)
    return per_step


def test_cumulative_outputs(processor):
    add(processor, sp=params(CUMULATIVE))
    per_step = run_steps(processor, STEPS)
    assert [len(s) for s in per_step] == [1, 1, 1]
    outs = [s[0] for s in per_step]
    assert texts(outs) == [" w6", " w6 w7 w8", " w6 w7 w8 w9"]
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        ids("w6"),
        ids("w6 w7 w8"),
        ids("w6 w7 w8 w9"),
    ]
    assert [o.finished for o in outs] == [False, False, True]
    assert [o.outputs[0].finish_reason for o in outs] == [None, None, "length"]
    assert all(o.request_id == "r" and o.prompt == "w5" for o in outs)
    assert all(o.prompt_token_ids == ids("w5") for o in outs)
    assert not processor.has_unfinished_requests()


def test_delta_outputs(processor):
    add(processor, sp=params(DELTA))
    outs = [s[0] for s in run_steps(processor, STEPS)]
    assert texts(outs) == [" w6", " w7 w8", " w9"]
    assert [list(o.outputs[0].token_ids) for o in outs] == [ids("w6"), ids("w7 w8"), ids("w9")]
    assert [o.finished for o in outs] == [False, False, True]
    assert "".join(texts(outs)) == " w6 w7 w8 w9"


def test_final_only_outputs(processor):
    add(processor, sp=params(FINAL_ONLY))
    per_step = run_steps(processor, STEPS)
    assert per_step[0] == [] and per_step[1] == []
    (final,) = per_step[2]
    assert final.finished
    assert final.outputs[0].text == " w6 w7 w8 w9"
    assert list(final.outputs[0].token_ids) == ids("w6 w7 w8 w9")
    assert final.outputs[0].finish_reason == "length"


def test_outputs_of_several_requests_in_one_batch(processor):
    add(processor, "a", "w5", params(DELTA))
    add(processor, "b", "w20", params(CUMULATIVE))
    result = processor.process_outputs([out("a", "w6"), out("b", "w21")])
    assert [o.request_id for o in result.request_outputs] == ["a", "b"]
    result = processor.process_outputs([out("b", "w22", FinishReason.LENGTH), out("a", "w7")])
    assert [(o.request_id, o.outputs[0].text, o.finished) for o in result.request_outputs] == [
        ("b", " w21 w22", True),
        ("a", " w7", False),
    ]
    assert processor.get_num_unfinished_requests() == 1
    assert list(processor.request_states) == ["a"]


def test_num_cached_tokens_comes_from_the_first_outputs_prefill_stats(processor):
    add(processor, prompt="w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18")
    stats = PrefillStats()
    stats.set(num_prompt_tokens=18, num_local_cached_tokens=16, num_external_cached_tokens=0)
    result = processor.process_outputs([out("r", "w6", prefill_stats=stats)])
    assert result.request_outputs[0].num_cached_tokens == 16
    # Later outputs carry no PrefillStats; the request keeps its number.
    result = processor.process_outputs([out("r", "w7", FinishReason.LENGTH)])
    assert result.request_outputs[0].num_cached_tokens == 16


def test_num_cached_tokens_is_zero_without_prefill_stats(processor):
    add(processor)
    result = processor.process_outputs([out("r", "w6", FinishReason.LENGTH)])
    assert result.request_outputs[0].num_cached_tokens == 0


def test_token_counts_for_metrics(processor):
    add(processor, "a", "w1 w2 w3")
    add(processor, "b", "w10")
    # A chunked-prefill step of "a" produces no token yet.
    first = processor.process_outputs([out("a", []), out("b", "w11")])
    assert (first.num_prompt_tokens, first.num_generation_tokens) == (1, 1)
    second = processor.process_outputs([out("a", "w4"), out("b", "w12")])
    # Prompt tokens count once, when a request produces its first token.
    assert (second.num_prompt_tokens, second.num_generation_tokens) == (3, 2)
    third = processor.process_outputs([out("a", "w5 w6"), out("b", "w13")])
    assert (third.num_prompt_tokens, third.num_generation_tokens) == (0, 3)


def test_outputs_for_unknown_requests_are_ignored(processor):
    result = processor.process_outputs([out("ghost", "w1")])
    assert result.request_outputs == [] and result.reqs_to_abort == []


def test_duplicate_request_id_is_rejected(processor):
    add(processor, "r")
    with pytest.raises(ValueError, match="already in use"):
        add(processor, "r")


def test_detokenize_false_and_no_tokenizer(processor):
    add(processor, "plain", sp=params(detokenize=False))
    result = processor.process_outputs([out("plain", "w6 w7", FinishReason.LENGTH)])
    c = result.request_outputs[0].outputs[0]
    assert c.text == "" and list(c.token_ids) == ids("w6 w7")
    # Logprobs carry no decoded text either.
    no_tok = OutputProcessor(None, log_stats=False)
    no_tok.add_request(request_for("x", sp=params(logprobs=0)), None)
    lp = LogprobsLists([[10]], [[-0.25]], [1])
    result = no_tok.process_outputs([out("x", "w6", FinishReason.LENGTH, new_logprobs=lp)])
    c = result.request_outputs[0].outputs[0]
    assert c.text == ""
    assert c.logprobs == [{10: Logprob(-0.25, 1, None)}]


# ---------------------------------------------------------------------------
# EOS / stop tokens (stop_terminated)
# ---------------------------------------------------------------------------
def test_eos_token_is_kept_in_ids_but_not_in_text(processor):
    add(processor, sp=params(CUMULATIVE))
    result = processor.process_outputs([out("r", [10, EOS], FinishReason.STOP)])
    c = result.request_outputs[0].outputs[0]
    assert list(c.token_ids) == [10, EOS]
    assert c.text == " w6"
    assert (c.finish_reason, c.stop_reason) == ("stop", None)
    # EngineCore already finished it: nothing to abort.
    assert result.reqs_to_abort == []


def test_stop_token_id_text_left_out(processor):
    add(processor, sp=params(stop_token_ids=ids("w7")))
    result = processor.process_outputs([out("r", "w6 w7", FinishReason.STOP, stop_reason=11)])
    c = result.request_outputs[0].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (" w6", "stop", 11)


def test_special_tokens_in_text(processor):
    add(processor, "skip", sp=params())
    add(processor, "keep", sp=params(skip_special_tokens=False))
    result = processor.process_outputs(
        [
            out("skip", [10, BOS, 11], FinishReason.LENGTH),
            out("keep", [10, BOS, 11], FinishReason.LENGTH),
        ]
    )
    assert texts(result.request_outputs) == [" w6 w7", " w6 <s> w7"]


# ---------------------------------------------------------------------------
# Stop strings
# ---------------------------------------------------------------------------
def test_stop_string_is_cut_and_request_aborted(processor):
    add(processor, sp=params(stop=["w8"]))
    first = processor.process_outputs([out("r", "w6 w7")])
    assert first.reqs_to_abort == []
    second = processor.process_outputs([out("r", "w8")])
    assert second.reqs_to_abort == ["r"]
    (o,) = second.request_outputs
    assert o.finished
    c = o.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (" w6 w7 ", "stop", "w8")
    assert list(c.token_ids) == ids("w6 w7 w8")
    assert not processor.has_unfinished_requests()
    # A late output for the aborted request (the step that was already
    # running) is dropped.
    assert processor.process_outputs([out("r", "w9")]).request_outputs == []


def test_stop_string_spanning_two_tokens(processor):
    add(processor, sp=params(stop=["6 w7"]))
    assert processor.process_outputs([out("r", "w6")]).reqs_to_abort == []
    result = processor.process_outputs([out("r", "w7")])
    assert result.reqs_to_abort == ["r"]
    c = result.request_outputs[0].outputs[0]
    assert (c.text, c.stop_reason) == (" w", "6 w7")


def test_stop_string_inside_a_multi_token_step(processor):
    add(processor, sp=params(stop=["w7"], include_stop_str_in_output=True))
    result = processor.process_outputs([out("r", "w6 w7 w8")])
    c = result.request_outputs[0].outputs[0]
    # Text after the stop string is dropped; the stop string itself is kept.
    assert c.text == " w6 w7"
    assert list(c.token_ids) == ids("w6 w7 w8")
    assert result.reqs_to_abort == ["r"]


def test_stop_string_held_back_in_delta_mode(processor):
    # A 2-character stop string: the last character of each delta is held
    # back until it is known not to start "w9".
    add(processor, sp=params(DELTA, stop=["w9"]))
    deltas = []
    for words in ["w6", "w7", "w8"]:
        (o,) = processor.process_outputs([out("r", words)]).request_outputs
        assert not o.finished
        deltas.append(o.outputs[0].text)
        assert list(o.outputs[0].token_ids) == ids(words)  # ids are never held back
    assert deltas == [" w", "6 w", "7 w"]
    result = processor.process_outputs([out("r", "w9")])
    (o,) = result.request_outputs
    assert o.finished and o.outputs[0].text == "8 "
    assert "".join(deltas) + o.outputs[0].text == " w6 w7 w8 "
    assert result.reqs_to_abort == ["r"]


def test_stop_string_held_back_in_cumulative_mode(processor):
    add(processor, sp=params(CUMULATIVE, stop=["w9"]))
    seen = [
        texts(processor.process_outputs([out("r", w)]).request_outputs)[0] for w in ["w6", "w7"]
    ]
    assert seen == [" w", " w6 w"]
    # Finishing for another reason releases the held-back text.
    final = processor.process_outputs([out("r", "w8", FinishReason.LENGTH)]).request_outputs
    assert texts(final) == [" w6 w7 w8"]


def test_no_hold_back_when_stop_string_is_included(processor):
    add(processor, sp=params(DELTA, stop=["w9"], include_stop_str_in_output=True))
    (o,) = processor.process_outputs([out("r", "w6")]).request_outputs
    assert o.outputs[0].text == " w6"


def test_stop_string_found_with_eos_in_the_same_step(processor):
    # The core stopped on EOS; the detokenizer still finds "w7" in the text
    # before it, which becomes the reported reason (vLLM does the same).
    add(processor, sp=params(stop=["w7"]))
    result = processor.process_outputs([out("r", [10, 11, 12, EOS], FinishReason.STOP)])
    c = result.request_outputs[0].outputs[0]
    assert c.text == " w6 "
    assert (c.finish_reason, c.stop_reason) == ("stop", "w7")
    # EngineCore already finished it: no abort needed.
    assert result.reqs_to_abort == []


@pytest.mark.parametrize(
    "text,new_chars,stop,include,expected",
    [
        ("hello world", 5, ["world"], False, ("world", 6)),
        ("hello world", 5, ["world"], True, ("world", -1)),
        # A match ending before the new characters was already checked.
        ("abc stop xyz", 3, ["stop"], False, None),
        # A match that starts in old text and ends in the new characters.
        ("abc stop", 2, ["stop"], False, ("stop", 4)),
        # Included stop string with text after it: cut just past it.
        ("ab stop cd", 4, ["stop"], True, ("stop", 7)),
        # List order decides, not position in the text.
        ("a b c", 5, ["c", "a"], False, ("c", 4)),
        ("a b c", 5, ["x", "b"], False, ("b", 2)),
        ("hello", 0, ["hello"], False, None),
        ("hello", 5, [], False, None),
        ("hello", 5, ["bye"], False, None),
    ],
)
def test_check_stop_strings(text, new_chars, stop, include, expected):
    assert check_stop_strings(text, new_chars, stop, include) == expected


# ---------------------------------------------------------------------------
# IncrementalDetokenizer on its own
# ---------------------------------------------------------------------------
def test_detokenizer_uses_prompt_context_for_leading_space(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, ids("w1 w2 w3 w4 w5 w6 w7"), params())
    assert detok.update(ids("w8"), stop_terminated=False) is None
    assert detok.output_text == " w8"
    detok.update(ids("w9 w10"), stop_terminated=False)
    assert detok.output_text == " w8 w9 w10"
    assert detok.token_ids == ids("w8 w9 w10")


def test_detokenizer_delta_text_is_never_repeated(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, ids("w5"), params())
    detok.update(ids("w6 w7"), stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=True) == " w6 w7"
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    detok.update(ids("w8"), stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=True) == " w8"
    assert detok.get_next_output_text(finished=True, delta=False) == " w6 w7 w8"


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: one token per UTF-8 byte,
    so a CJK character takes three tokens and "é" two."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_detokenizer_waits_for_complete_characters(byte_tokenizer):
    text = "héllo 世界!"
    token_ids = byte_tokenizer.encode(text)
    assert len(token_ids) == 14
    detok = IncrementalDetokenizer(byte_tokenizer, byte_tokenizer.encode("ok: "), params())
    deltas = []
    for token_id in token_ids:
        detok.update([token_id], stop_terminated=False)
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    # Nothing is emitted for the first bytes of a multi-byte character, and no
    # U+FFFD ever reaches the user.
    assert deltas == ["h", "", "é", "l", "l", "o", " ", "", "", "世", "", "", "界", "!"]
    assert detok.output_text == text


def test_stop_string_made_of_multi_byte_characters(byte_tokenizer):
    processor = OutputProcessor(byte_tokenizer, log_stats=False)
    request = make_engine_core_request(
        "r", byte_tokenizer.encode("ok: "), params(DELTA, stop=["界"])
    )
    request.external_req_id = "r"
    processor.add_request(request, "ok: ")
    token_ids = byte_tokenizer.encode("héllo 世界!")
    texts_seen, aborted = [], []
    for token_id in token_ids[:13]:
        result = processor.process_outputs([out("r", [token_id])])
        texts_seen += [o.outputs[0].text for o in result.request_outputs]
        aborted += result.reqs_to_abort
    assert "".join(texts_seen) == "héllo 世"
    assert aborted == ["r"]
    assert not processor.has_unfinished_requests()


# ---------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------
def test_logprobs_are_built_per_position(processor):
    add(processor, sp=params(DELTA, logprobs=2))
    # Row layout: [sampled, top-1, top-2]; here the sampled token (w8) is
    # only the 3rd most likely, so it keeps its true rank.
    lp = LogprobsLists([[12, 10, 11]], [[-2.0, -0.1, -1.0]], [3])
    (o,) = processor.process_outputs([out("r", "w8", new_logprobs=lp)]).request_outputs
    c = o.outputs[0]
    assert c.logprobs == [
        {12: Logprob(-2.0, 3, "w8"), 10: Logprob(-0.1, 1, "w6"), 11: Logprob(-1.0, 2, "w7")}
    ]
    assert c.cumulative_logprob == pytest.approx(-2.0)
    # Sampled token also in the top-k: one entry, rank 1.
    lp = LogprobsLists([[13, 13, 14]], [[-0.3, -0.3, -1.3]], [1])
    (o,) = processor.process_outputs(
        [out("r", "w9", FinishReason.LENGTH, new_logprobs=lp)]
    ).request_outputs
    c = o.outputs[0]
    # DELTA: only the new position.
    assert c.logprobs == [{13: Logprob(-0.3, 1, "w9"), 14: Logprob(-1.3, 2, "w10")}]
    assert c.cumulative_logprob == pytest.approx(-2.3)


def test_cumulative_logprobs_accumulate(processor):
    add(processor, sp=params(CUMULATIVE, logprobs=0))
    lp = LogprobsLists([[10], [11]], [[-0.5], [-0.25]], [1, 4])
    (o,) = processor.process_outputs([out("r", "w6 w7", new_logprobs=lp)]).request_outputs
    assert o.outputs[0].logprobs == [{10: Logprob(-0.5, 1, "w6")}, {11: Logprob(-0.25, 4, "w7")}]
    assert o.outputs[0].cumulative_logprob == pytest.approx(-0.75)


def test_no_logprobs_when_not_requested(processor):
    add(processor)
    lp = LogprobsLists([[10]], [[-0.5]], [1])
    (o,) = processor.process_outputs([out("r", "w6", new_logprobs=lp)]).request_outputs
    assert o.outputs[0].logprobs is None
    assert o.outputs[0].cumulative_logprob is None


# ---------------------------------------------------------------------------
# Parallel sampling
# ---------------------------------------------------------------------------
def add_parent(processor, parent_id="p", n=3, kind=FINAL_ONLY, seed=None):
    sp = SamplingParams(n=n, temperature=0.7, seed=seed, output_kind=kind, max_tokens=4)
    parent_request = request_for(parent_id, sp=sp)
    parent = ParentRequest(parent_request)
    for index in range(n):
        child_id, child_params = parent.get_child_info(index)
        child = parent_request.__copy__()
        child.request_id = child_id
        child.sampling_params = child_params
        processor.add_request(child, "w5", parent, index)
    return parent


def test_parent_request_child_info():
    sp = SamplingParams(n=3, temperature=0.7, seed=10)
    parent = ParentRequest(request_for("p", sp=sp))
    sp = parent.sampling_params
    infos = [parent.get_child_info(i) for i in range(3)]
    assert [cid for cid, _ in infos] == ["0_p", "1_p", "2_p"]
    assert [cp.seed for _, cp in infos] == [10, 11, 12]
    assert all(cp.n == 1 for _, cp in infos)
    assert parent.child_requests == {"0_p", "1_p", "2_p"}
    # The parent's own params are untouched.
    assert (sp.n, sp.seed) == (3, 10)
    unseeded = ParentRequest(request_for("q", sp=SamplingParams(n=2, temperature=0.7)))
    assert unseeded.get_child_info(1)[1].seed is None


def test_parallel_sampling_final_only(processor):
    add_parent(processor, n=3)
    assert processor.get_num_unfinished_requests() == 3
    r1 = processor.process_outputs([out("0_p", "w6"), out("1_p", "w6"), out("2_p", "w6")])
    assert r1.request_outputs == []
    # Children finish out of order; nothing is reported until all have.
    r2 = processor.process_outputs([out("2_p", "w7", FinishReason.LENGTH), out("0_p", "w7")])
    assert r2.request_outputs == []
    r3 = processor.process_outputs(
        [out("0_p", "w8", FinishReason.LENGTH), out("1_p", "w7", FinishReason.LENGTH)]
    )
    (o,) = r3.request_outputs
    assert o.request_id == "p" and o.finished
    assert [c.index for c in o.outputs] == [0, 1, 2]
    assert [c.text for c in o.outputs] == [" w6 w7 w8", " w6 w7", " w6 w7"]
    assert not processor.has_unfinished_requests()
    assert processor.parent_requests == {}


def test_parallel_sampling_delta(processor):
    add_parent(processor, n=2, kind=DELTA)
    r1 = processor.process_outputs([out("0_p", "w6"), out("1_p", "w6")])
    assert [(o.request_id, o.outputs[0].index, o.finished) for o in r1.request_outputs] == [
        ("p", 0, False),
        ("p", 1, False),
    ]
    r2 = processor.process_outputs([out("1_p", "w7", FinishReason.LENGTH)])
    (o,) = r2.request_outputs
    # Sample 1 is done but the request as a whole is not.
    assert (o.outputs[0].index, o.outputs[0].finish_reason, o.finished) == (1, "length", False)
    r3 = processor.process_outputs([out("0_p", "w7", FinishReason.LENGTH)])
    (o,) = r3.request_outputs
    assert (o.outputs[0].index, o.outputs[0].text, o.finished) == (0, " w7", True)
    assert processor.parent_requests == {}


def test_abort_parent_request_aborts_all_children(processor):
    add_parent(processor, "p", n=3)
    add(processor, "solo")
    processor.process_outputs([out("0_p", "w6")])
    to_abort = processor.abort_requests(["p", "unknown"], internal=True)
    assert to_abort == ["0_p", "1_p", "2_p"]
    assert list(processor.request_states) == ["solo"]
    assert processor.parent_requests == {}
    # Late outputs of aborted children produce nothing.
    assert processor.process_outputs([out("1_p", "w6")]).request_outputs == []
    assert processor.abort_requests(["solo", "solo"], internal=True) == ["solo"]
    assert not processor.has_unfinished_requests()


def test_abort_parent_after_some_children_finished(processor):
    add_parent(processor, "p", n=3)
    processor.process_outputs([out("1_p", "w6", FinishReason.LENGTH)])
    assert processor.abort_requests(["p"], internal=True) == ["0_p", "2_p"]
    assert not processor.has_unfinished_requests()
    assert processor.parent_requests == {}


# ---------------------------------------------------------------------------
# Logprobs of a mixed batch: each request gets its own width
# ---------------------------------------------------------------------------
def test_each_request_gets_its_own_number_of_logprobs(processor):
    """The sampler gathers the widest top-k any request in the batch asked for
    (5 here), so the row of the logprobs=1 request has 1 + 5 columns too."""
    add(processor, "one", sp=params(logprobs=1))
    add(processor, "five", sp=params(logprobs=5))
    # Sampled w9 is 4th most likely; the top-5 are w6..w10.
    row = ([13, 10, 11, 12, 13, 14], [-1.4, -0.2, -0.6, -1.0, -1.4, -1.8], 4)
    batch = [
        out("one", "w9", FinishReason.LENGTH, new_logprobs=LogprobsLists(*([r] for r in row))),
        out("five", "w9", FinishReason.LENGTH, new_logprobs=LogprobsLists(*([r] for r in row))),
    ]
    one, five = processor.process_outputs(batch).request_outputs
    assert one.outputs[0].logprobs == [{13: Logprob(-1.4, 4, "w9"), 10: Logprob(-0.2, 1, "w6")}]
    (position,) = five.outputs[0].logprobs
    # The sampled token is also the 4th of the top-5: five entries, not six.
    assert list(position) == [13, 10, 11, 12, 14]
    assert position[13].rank == 4


# ---------------------------------------------------------------------------
# Two ids: the user's (external) and the core's (internal)
# ---------------------------------------------------------------------------
def test_outputs_carry_the_users_id(processor):
    add(processor, "job-1a2b3c4d", external_req_id="job")
    (o,) = processor.process_outputs([out("job-1a2b3c4d", "w6")]).request_outputs
    assert o.request_id == "job"
    assert processor.external_req_ids == {"job": ["job-1a2b3c4d"]}


def test_same_user_id_twice_in_flight(processor):
    add(processor, "dup-1", external_req_id="dup", sp=params(DELTA))
    add(processor, "dup-2", external_req_id="dup", sp=params(DELTA))
    result = processor.process_outputs([out("dup-1", "w6"), out("dup-2", "w9")])
    assert [(o.request_id, o.outputs[0].text) for o in result.request_outputs] == [
        ("dup", " w6"),
        ("dup", " w9"),
    ]
    processor.process_outputs([out("dup-1", "w7", FinishReason.LENGTH)])
    assert processor.external_req_ids == {"dup": ["dup-2"]}
    # Abort by the user's id takes every request still running under it.
    assert processor.abort_requests(["dup"], internal=False) == ["dup-2"]
    assert processor.external_req_ids == {} and not processor.has_unfinished_requests()


def test_abort_by_internal_id_keeps_the_others_under_the_same_user_id(processor):
    add(processor, "x-1", external_req_id="x")
    add(processor, "x-2", external_req_id="x")
    assert processor.abort_requests(["x-1"], internal=True) == ["x-1"]
    assert processor.external_req_ids == {"x": ["x-2"]}
    # An internal id is not a user id, and the reverse.
    assert processor.abort_requests(["x-2"], internal=False) == []
    assert processor.abort_requests(["x"], internal=True) == []
    assert list(processor.request_states) == ["x-2"]


def test_abort_by_user_id_of_an_n_request_forgets_the_parent(processor):
    """Without a collector (LLMEngine) no abort output is built, yet the parent
    must go too (vLLM keeps it: a leak Glassbox does not copy)."""
    parent = add_parent(processor, "p", n=3, kind=DELTA)
    processor.process_outputs([out("1_p", "w6", FinishReason.LENGTH)])
    assert processor.abort_requests(["p"], internal=False) == ["0_p", "2_p"]
    assert processor.parent_requests == {} and processor.external_req_ids == {}
    assert parent.child_requests == set()


def test_abort_puts_a_last_output_in_the_collector(processor):
    request = request_for("c-int", sp=params(DELTA), external_req_id="c")
    queue = RequestOutputCollector(DELTA, "c-int")
    processor.add_request(request, "w5", queue=queue)
    assert processor.process_outputs([out("c-int", "w6")]).request_outputs == []
    processor.abort_requests(["c"], internal=False)
    o = queue.get_nowait()  # the " w6" delta and the abort, merged
    assert (o.request_id, o.finished, o.outputs[0].text) == ("c", True, " w6")
    assert o.outputs[0].finish_reason == "abort"


def test_abort_of_a_final_only_n_request_sends_all_samples_once(processor):
    sp = SamplingParams(n=2, temperature=0.7, output_kind=FINAL_ONLY, max_tokens=4)
    request = request_for("q-int", sp=sp, external_req_id="q")
    parent = ParentRequest(request)
    queue = RequestOutputCollector(FINAL_ONLY, "q-int")
    for index in range(2):
        child_id, child_params = parent.get_child_info(index)
        child = request.__copy__()
        child.request_id, child.sampling_params = child_id, child_params
        processor.add_request(child, "w5", parent, index, queue)
    processor.process_outputs([out("0_q-int", "w6", FinishReason.LENGTH), out("1_q-int", "w6")])
    assert queue.output is None  # FINAL_ONLY: waiting for sample 1
    assert processor.abort_requests(["q-int"], internal=True) == ["1_q-int"]
    o = queue.get_nowait()
    assert o.request_id == "q" and o.finished
    assert [(c.index, c.finish_reason) for c in o.outputs] == [(0, "length"), (1, "abort")]
    assert processor.parent_requests == {}


# ---------------------------------------------------------------------------
# stream_interval
# ---------------------------------------------------------------------------
def stream(processor, words, last_finishes=True):
    """One token per step; the outputs of each step."""
    word_list = words.split()
    per_step = []
    for k, w in enumerate(word_list):
        finish = FinishReason.LENGTH if last_finishes and k == len(word_list) - 1 else None
        per_step.append(processor.process_outputs([out("r", w, finish)]).request_outputs)
    return per_step


def test_stream_interval_coalesces_delta_outputs(tokenizer):
    processor = OutputProcessor(tokenizer, log_stats=False, stream_interval=3)
    add(processor, sp=params(DELTA))
    per_step = stream(processor, "w6 w7 w8 w9 w10 w11 w12 w13")
    # First token at once, then every 3 tokens, and whatever is left at the end.
    sent = [[list(o.outputs[0].token_ids) for o in step] for step in per_step]
    assert sent == [
        [ids("w6")],
        [],
        [],
        [ids("w7 w8 w9")],
        [],
        [],
        [ids("w10 w11 w12")],
        [ids("w13")],
    ]
    texts_sent = [o.outputs[0].text for step in per_step for o in step]
    assert "".join(texts_sent) == " w6 w7 w8 w9 w10 w11 w12 w13"


def test_stream_interval_sends_held_tokens_on_a_stop_string(tokenizer):
    processor = OutputProcessor(tokenizer, log_stats=False, stream_interval=4)
    add(processor, sp=params(DELTA, stop=["w9"], logprobs=0))
    lp = [LogprobsLists([[t]], [[-0.5]], [1]) for t in ids("w6 w7 w8 w9")]
    outs = []
    for word, rows in zip("w6 w7 w8 w9".split(), lp):
        result = processor.process_outputs([out("r", word, new_logprobs=rows)])
        outs += result.request_outputs
    assert [list(o.outputs[0].token_ids) for o in outs] == [ids("w6"), ids("w7 w8 w9")]
    assert [len(o.outputs[0].logprobs) for o in outs] == [1, 3]
    assert outs[-1].finished and outs[-1].outputs[0].stop_reason == "w9"
    assert "".join(o.outputs[0].text for o in outs) == " w6 w7 w8 "


@pytest.mark.parametrize("kind", [CUMULATIVE, FINAL_ONLY])
def test_stream_interval_leaves_other_kinds_alone(tokenizer, kind):
    """vLLM's rule: only DELTA outputs are held back; a CUMULATIVE output is
    sent every step, a FINAL_ONLY one at the end."""
    processor = OutputProcessor(tokenizer, log_stats=False, stream_interval=3)
    add(processor, sp=params(kind))
    counts = [len(step) for step in stream(processor, "w6 w7 w8 w9")]
    assert counts == ([1, 1, 1, 1] if kind == CUMULATIVE else [0, 0, 0, 1])


def test_stream_interval_must_be_positive(tokenizer):
    with pytest.raises(ValueError, match="stream_interval must be an integer >= 1, got 0"):
        OutputProcessor(tokenizer, log_stats=False, stream_interval=0)


# ---------------------------------------------------------------------------
# RequestOutputCollector
# ---------------------------------------------------------------------------
def _output(index, text, token_ids, finished=False):
    completion = CompletionOutput(
        index=index,
        text=text,
        token_ids=token_ids,
        cumulative_logprob=None,
        logprobs=None,
        finish_reason="length" if finished else None,
    )
    return RequestOutput("u", None, [1], None, [completion], finished)


def test_collector_merges_deltas_until_read():
    queue = RequestOutputCollector(DELTA, "u-int")
    queue.put(_output(0, " a", [5]))
    queue.put(_output(1, " x", [9]))
    queue.put(_output(0, " b", [6], finished=True))
    assert queue.ready.is_set()
    o = asyncio.run(queue.get())
    assert not queue.ready.is_set() and queue.get_nowait() is None
    assert [(c.index, c.text, list(c.token_ids)) for c in o.outputs] == [
        (0, " a b", [5, 6]),
        (1, " x", [9]),
    ]
    assert o.finished


def test_collector_keeps_only_the_newest_cumulative_output_per_sample():
    queue = RequestOutputCollector(CUMULATIVE, "u-int")
    queue.put(_output(0, " a", [5]))
    queue.put(_output(0, " a b", [5, 6]))
    assert [c.text for c in queue.get_nowait().outputs] == [" a b"]


def test_collector_raises_an_error_put_in_it():
    queue = RequestOutputCollector(DELTA, "u-int")
    queue.put(_output(0, " a", [5]))
    queue.put(RuntimeError("engine gone"))  # replaces what was waiting
    with pytest.raises(RuntimeError, match="engine gone"):
        queue.get_nowait()
