"""The embedded default model (SmolLM2-135M-Instruct) end to end on CPU.

``LLM()`` with no model must pick it (every test here uses that ``LLM``, as a
user who names no model would); ``LLM.chat`` must answer a simple question
correctly and stop on its own EOS; its greedy tokens must be exactly
transformers' ``generate`` on the same converted folder; and batching chat
requests together must not change any request's greedy tokens.

The GGUF -> HF conversion runs at most once (``tests.helpers.hf_checkpoints.
default_model_path``), into the cache ``LLM()`` uses: ``$GLASSBOX_CACHE``, else
``~/.cache/glassbox``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.outputs import RequestOutput
from tests.helpers.hf_checkpoints import (
    default_model_path,
    hf_greedy,
)

pytestmark = pytest.mark.slow

CAPITAL_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
OTHER_QUESTIONS = [
    [{"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What color is the sky on a clear day?"},
    ],
]
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
# Shorter for the batch-invariance check (8 chat replies on a 135M model on CPU).
BATCH_GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
EOS_TOKEN_ID = 2  # <|im_end|>, which closes every chat turn
# SmolLM2's max_position_embeddings is 8192; a shorter max_model_len keeps the
# KV cache small (a few MiB) and start-up quick.
ENGINE_ARGS = {"max_model_len": 512, "num_gpu_blocks_override": 96}


@pytest.fixture(scope="module")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def llm(model_path: str) -> Iterator[LLM]:
    """``LLM()`` with no model: what a user who names none gets. It finds the
    folder ``model_path`` converted in the default cache."""
    llm = LLM(**ENGINE_ARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def capital_output(llm: LLM) -> RequestOutput:
    (output,) = llm.chat(CAPITAL_QUESTION, GREEDY, use_tqdm=False)
    return output


@pytest.fixture(scope="module")
def hf_model(model_path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def test_llm_without_model_uses_the_default_model(model_path: str, llm: LLM) -> None:
    assert Path(llm.llm_engine.model_config.model).resolve() == Path(model_path).resolve()
    assert llm.llm_engine.model_config.architectures == ["LlamaForCausalLM"]
    # The default model comes with its tokenizer (and chat template).
    assert llm.get_tokenizer().eos_token_id == EOS_TOKEN_ID


def test_chat_answers_paris_and_stops_on_eos(capital_output: RequestOutput) -> None:
    completion = capital_output.outputs[0]
    assert "Paris" in completion.text, completion.text
    assert completion.finish_reason == "stop", completion
    # Stopped by the model's own EOS: no stop string / stop token is reported,
    # the EOS id ends token_ids, and its text is not in the reply.
    assert completion.stop_reason is None
    assert completion.token_ids[-1] == EOS_TOKEN_ID
    assert len(completion.token_ids) < MAX_TOKENS
    assert "<|im_end|>" not in completion.text


def test_chat_tokens_match_transformers_generate(
    model_path: str, llm: LLM, capital_output: RequestOutput, hf_model: torch.nn.Module
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompt_ids = tokenizer.apply_chat_template(
        CAPITAL_QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    # LLM.chat built the same prompt ids from the same chat template.
    assert capital_output.prompt_token_ids == list(prompt_ids)

    reference = hf_greedy(hf_model, list(prompt_ids), MAX_TOKENS, stop_at_eos=True)
    assert reference.token_ids[-1] == EOS_TOKEN_ID  # transformers stopped on EOS too
    assert list(capital_output.outputs[0].token_ids) == reference.token_ids
    assert capital_output.outputs[0].text == tokenizer.decode(
        reference.token_ids, skip_special_tokens=True
    )


def test_batched_chat_equals_one_at_a_time(llm: LLM) -> None:
    conversations = [CAPITAL_QUESTION, *OTHER_QUESTIONS]
    batched = llm.chat(conversations, BATCH_GREEDY, use_tqdm=False)
    assert len(batched) == len(conversations)
    singles = [
        llm.chat(conversation, BATCH_GREEDY, use_tqdm=False)[0] for conversation in conversations
    ]

    for conversation, together, alone in zip(conversations, batched, singles):
        assert together.prompt_token_ids == alone.prompt_token_ids
        assert list(together.outputs[0].token_ids) == list(alone.outputs[0].token_ids), conversation
        assert together.outputs[0].text == alone.outputs[0].text
        assert together.outputs[0].finish_reason == alone.outputs[0].finish_reason
    # Four different questions get four different answers, and the batch
    # changes shape as it runs: the capital answer (8 tokens) ends on EOS
    # while the others run to max_tokens.
    assert len({tuple(o.outputs[0].token_ids) for o in batched}) == len(conversations)
    assert {o.outputs[0].finish_reason for o in batched} == {"stop", "length"}
