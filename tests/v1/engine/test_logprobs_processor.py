"""Tests for engine/v1/engine/logprobs.py (twin of vllm/v1/engine/logprobs.py):
each row cut to the request's own width, and ``decoded_token`` repaired for
byte tokens that are only part of a character."""

from __future__ import annotations

import numpy as np
import pytest

from engine.logprobs import Logprob
from engine.sampling_params import SamplingParams
from engine.v1.engine import EngineCoreOutput
from engine.v1.engine.logprobs import LogprobsProcessor
from engine.v1.outputs import LogprobsLists
from tests.helpers.engine_fixtures import make_engine_core_request


@pytest.fixture(scope="module")
def byte_tokenizer():
    """Byte-level BPE without merges: one token per UTF-8 byte, so "ö" is two
    tokens and "€" three, and each of those bytes decodes alone to U+FFFD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def processor_for(num_logprobs: int | None, tokenizer=None) -> LogprobsProcessor:
    request = make_engine_core_request("r", [5], SamplingParams(logprobs=num_logprobs))
    return LogprobsProcessor.from_new_request(tokenizer, request)


def test_from_new_request_without_logprobs():
    processor = processor_for(None)
    assert processor.logprobs is None and processor.cumulative_logprob is None
    # A row that arrives anyway is ignored.
    rows = LogprobsLists([[7]], [[-0.5]], [1])
    processor.update_from_output(EngineCoreOutput("r", [7], new_logprobs=rows))
    assert processor.logprobs is None
    assert processor.pop_prompt_logprobs() is None


def test_row_wider_than_the_request_is_cut():
    """The batch asked for 4 top tokens; this request for 2. Filler columns
    (id 0, -inf) stand for what the wider request needed."""
    processor = processor_for(2)
    rows = LogprobsLists(
        np.array([[31, 8, 9, 10, 0]]),
        np.array([[-3.0, -0.25, -1.5, -2.0, -np.inf]], dtype=np.float32),
        np.array([6]),
    )
    processor.update_from_output(EngineCoreOutput("r", [31], new_logprobs=rows))
    assert processor.logprobs == [
        {31: Logprob(-3.0, 6, None), 8: Logprob(-0.25, 1, None), 9: Logprob(-1.5, 2, None)}
    ]
    assert processor.cumulative_logprob == -3.0


def test_sampled_token_inside_the_top_k_appears_once():
    processor = processor_for(3)
    # Two tokens in one step (two rows); the second was the 2nd most likely.
    rows = LogprobsLists(
        [[8, 8, 9, 10, 11], [9, 12, 9, 13, 14]],
        [[-0.25, -0.25, -1.5, -2.0, -2.5], [-0.75, -0.5, -0.75, -3.0, -4.0]],
        [1, 2],
    )
    processor.update_from_output(EngineCoreOutput("r", [8, 9], new_logprobs=rows))
    first, second = processor.logprobs
    assert list(first) == [8, 9, 10] and first[8].rank == 1
    # The sampled token stays the first key (the repair reads it from there).
    assert list(second) == [9, 12, 13] and second[9] == Logprob(-0.75, 2, None)
    assert processor.cumulative_logprob == pytest.approx(-1.0)


def test_zero_and_full_vocabulary_widths():
    zero = processor_for(0)
    zero.update_from_output(
        EngineCoreOutput("r", [4], new_logprobs=LogprobsLists([[4, 5, 6]], [[-2, -1, -2]], [2]))
    )
    assert zero.logprobs == [{4: Logprob(-2, 2, None)}]
    full = processor_for(-1)
    full.update_from_output(
        EngineCoreOutput(
            "r", [6], new_logprobs=LogprobsLists([[6, 5, 4, 6]], [[-2, -1, -1.5, -2]], [3])
        )
    )
    assert {t: lp.rank for t, lp in full.logprobs[0].items()} == {6: 3, 5: 1, 4: 2}


def _byte_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_decoded_tokens_of_split_characters_are_repaired(byte_tokenizer):
    """Sampled text "aö€": "ö" is 2 bytes, "€" 3. The bytes that do not finish
    a character show "", the byte that does shows the whole character."""
    tok = byte_tokenizer
    token_ids = _byte_ids(tok, "aö€")
    assert len(token_ids) == 6
    assert tok.decode([token_ids[1]]) == "\ufffd"  # the bug: what decoding alone shows
    processor = processor_for(0, tokenizer=tok)
    for token_id in token_ids:
        rows = LogprobsLists([[token_id]], [[-0.5]], [1])
        processor.update_from_output(EngineCoreOutput("r", [token_id], new_logprobs=rows))
    shown = [pos[t].decoded_token for pos, t in zip(processor.logprobs, token_ids)]
    assert shown == ["a", "", "ö", "", "", "€"]
    assert "".join(shown) == "aö€"


def test_each_alternative_is_repaired_against_the_sampled_context(byte_tokenizer):
    """At the position that finishes "ö" (bytes C3 B6), the top-k holds other
    continuation bytes: each is read after the same sampled C3."""
    tok = byte_tokenizer
    c3, b6 = _byte_ids(tok, "ö")
    (a4,) = [t for t in _byte_ids(tok, "ä") if t != c3]  # "ä" is C3 A4
    (x,) = _byte_ids(tok, "x")
    processor = processor_for(2, tokenizer=tok)
    processor.update_from_output(
        EngineCoreOutput("r", [c3], new_logprobs=LogprobsLists([[c3, c3, x]], [[-1, -1, -2]], [1]))
    )
    processor.update_from_output(
        EngineCoreOutput(
            "r", [b6], new_logprobs=LogprobsLists([[b6, a4, b6]], [[-1, -0.5, -1]], [2])
        )
    )
    first, second = processor.logprobs
    assert {t: lp.decoded_token for t, lp in first.items()} == {c3: "", x: "x"}
    assert {t: lp.decoded_token for t, lp in second.items()} == {b6: "ö", a4: "ä"}


def test_repair_keeps_text_before_the_split_character(byte_tokenizer):
    tok = byte_tokenizer
    processor = processor_for(0, tokenizer=tok)
    ids = _byte_ids(tok, "ok ö")
    context, last = ids[:-1], ids[-1]
    # "ok " are clean tokens; only the unfinished C3 before the last byte counts.
    assert processor._correct_decoded_token(last, context) == "ö"
    # Not enough context to finish the character: nothing to show yet.
    assert processor._correct_decoded_token(last, []) == ""
    assert processor._verify_tokens(["x", "\ufffd"], [ids[0], last], context) == ["x", "ö"]
