"""``cache_salt``: a dict prompt's salt reaches the block hash, so only
requests with the same salt share cached prefix blocks (vLLM's field; the
front end dropped it before)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.helpers.hf_checkpoints import TINY_CONFIG, save_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("in_process_engine")

PROMPT = [(5 * j + 1) % TINY_CONFIG["vocab_size"] for j in range(40)]
ONE = SamplingParams(temperature=0.0, max_tokens=1)
# A hit leaves the prompt's last token to compute: the full 8-token blocks of 39 tokens.
FULL_HIT = (len(PROMPT) - 1) // 8 * 8


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("salt") / "llama"
    save_tiny_checkpoint("llama", path, seed=0)
    engine = LLM(
        str(path),
        skip_tokenizer_init=True,
        max_model_len=64,
        block_size=8,
        enable_prefix_caching=True,
    )
    yield engine
    engine.shutdown()


def _cached(llm: LLM, salt: str | None) -> int:
    prompt = {"prompt_token_ids": PROMPT}
    if salt is not None:
        prompt["cache_salt"] = salt
    return llm.generate([prompt], ONE)[0].num_cached_tokens


def test_only_the_same_salt_shares_blocks(llm) -> None:
    assert _cached(llm, "alice") == 0
    assert _cached(llm, "bob") == 0  # same tokens, another salt: no hit
    assert _cached(llm, "alice") == FULL_HIT
    assert _cached(llm, None) == 0  # unsalted requests never meet salted blocks
    assert _cached(llm, None) == FULL_HIT


@pytest.mark.parametrize("salt", ["", 7])
def test_a_bad_salt_is_refused(llm, salt) -> None:
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": salt}], ONE)
