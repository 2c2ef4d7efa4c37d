"""Per-request logprobs, built in the front end from the sampler's rows.

vLLM twin: ``vllm/v1/engine/logprobs.py`` (``LogprobsProcessor``).
Read it for two things the raw rows from EngineCore do not give a user:
  * the request's own width. The sampler gathers one top-k width for the
    whole batch (the largest ``logprobs`` any request in it asked for), so a
    request that asked for 1 may receive rows of 1 + 5 entries. Each row is
    cut to the request's ``num_logprobs + 1`` (sampled token + its top-k)
    when it is turned into a ``{token_id: Logprob}`` position
    (``append_logprobs_for_next_position``).
  * readable ``decoded_token`` text. A byte-fallback tokenizer spells a rare
    character as several byte tokens; decoded alone, each gives U+FFFD. Such
    a token is decoded again together with the tokens sampled just before
    it: the token that completes the character carries its text, the
    unfinished bytes before it carry "".
Sessions: 05 (sampling: where logprobs come from), 01 (what the user sees).

Prompt logprobs (``SamplingParams.prompt_logprobs``) arrive once, with the
request's first token: one row per prompt position after the first, turned
into ``{token_id: Logprob}`` positions after the ``None`` that stands for
the first prompt token (``_update_prompt_logprobs``).

Simpler than vLLM: the rows arrive as lists, not tensors; no
``FlatLogprobs``; no ``logprob_token_ids`` (``num_logprobs`` is
``SamplingParams.logprobs``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from engine.logprobs import (
    PromptLogprobs,
    SampleLogprobs,
    append_logprobs_for_next_position,
    create_prompt_logprobs,
    create_sample_logprobs,
)
from engine.v1.engine import EngineCoreOutput, EngineCoreRequest
from engine.v1.outputs import LogprobsLists

# A UTF-8 character is at most 4 bytes, so at most 3 byte tokens can come
# before the one that completes it.
MAX_CONTEXT_TOKENS = 4

REPLACEMENT_CHAR = "\ufffd"

# decoded_token for every entry when detokenization is off.
NONES = itertools.repeat(None)


def _as_list(values: Any) -> list:
    """A row as a Python list (rows may be lists or numpy arrays)."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


@dataclass
class LogprobsProcessor:
    """Logprobs state of one request: the positions so far and their sum."""

    # None when the request does not detokenize (decoded_token stays None).
    tokenizer: Any | None
    # None when the request did not ask for logprobs.
    logprobs: SampleLogprobs | None
    prompt_logprobs: PromptLogprobs | None
    # Sum of the sampled tokens' logprobs; None without logprobs.
    cumulative_logprob: float | None
    num_logprobs: int | None
    num_prompt_logprobs: int | None

    @classmethod
    def from_new_request(
        cls, tokenizer: Any | None, request: EngineCoreRequest
    ) -> LogprobsProcessor:
        num_logprobs = request.sampling_params.logprobs
        num_prompt_logprobs = request.sampling_params.prompt_logprobs
        wanted = num_logprobs is not None
        return cls(
            tokenizer=tokenizer,
            logprobs=create_sample_logprobs() if wanted else None,
            prompt_logprobs=(None if num_prompt_logprobs is None else create_prompt_logprobs()),
            cumulative_logprob=0.0 if wanted else None,
            num_logprobs=num_logprobs,
            num_prompt_logprobs=num_prompt_logprobs,
        )

    def update_from_output(self, output: EngineCoreOutput) -> None:
        """Add the positions of one step's new tokens (if logprobs were asked
        for), and the prompt's positions when they come."""
        if output.new_logprobs is not None and self.logprobs is not None:
            self._update_sample_logprobs(output.new_logprobs)
        if output.new_prompt_logprobs_tensors is not None and self.prompt_logprobs is not None:
            self._update_prompt_logprobs(output.new_prompt_logprobs_tensors)

    def _update_sample_logprobs(self, logprobs_lists: LogprobsLists) -> None:
        """One position per row; several rows when the step produced several tokens."""
        assert self.logprobs is not None and self.num_logprobs is not None
        assert self.cumulative_logprob is not None
        self._append_positions(self.logprobs, logprobs_lists, self.num_logprobs)
        for logprobs_row in logprobs_lists.logprobs:
            self.cumulative_logprob += float(logprobs_row[0])  # column 0: the sampled token

    def _update_prompt_logprobs(self, prompt_logprobs_lists: LogprobsLists) -> None:
        """One position per prompt token after the first: the actual prompt
        token (with its rank), then the top-k."""
        assert self.prompt_logprobs is not None and self.num_prompt_logprobs is not None
        self._append_positions(
            self.prompt_logprobs, prompt_logprobs_lists, self.num_prompt_logprobs
        )

    def _append_positions(
        self,
        positions: SampleLogprobs | PromptLogprobs,
        rows: LogprobsLists,
        num_logprobs: int,
    ) -> None:
        """A ``{token_id: Logprob}`` position per row, cut to ``num_logprobs``."""
        for token_ids_row, logprobs_row, rank in zip(
            rows.logprob_token_ids, rows.logprobs, rows.sampled_token_ranks
        ):
            token_ids = _as_list(token_ids_row)
            decoded: list[str] | itertools.repeat[None] = NONES
            if self.tokenizer is not None:
                # A split character's context: the tokens of the positions before.
                decoded = self._verify_tokens(
                    [self.tokenizer.decode([t]) or "" for t in token_ids],
                    token_ids,
                    self._get_sampled_context_ids(positions),
                )
            append_logprobs_for_next_position(
                positions, token_ids, _as_list(logprobs_row), decoded, int(rank), num_logprobs
            )

    def pop_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt logprobs not handed out yet (DELTA sends them once)."""
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs:
            self.prompt_logprobs = []
        return prompt_logprobs

    @staticmethod
    def _get_sampled_context_ids(
        logprobs_source: SampleLogprobs | PromptLogprobs | None,
        max_context: int = MAX_CONTEXT_TOKENS,
    ) -> list[int]:
        """The ids of the last ``max_context`` sampled tokens, oldest first.
        A position's first key is its sampled token (it is inserted first)."""
        if not logprobs_source:
            return []
        recent = logprobs_source[-max_context:]
        return [next(iter(position)) for position in recent if position]

    def _correct_decoded_token(self, token_id: int, context_token_ids: list[int]) -> str:
        """The text ``token_id`` adds after ``context_token_ids`` when decoded
        alone it is an unfinished character, or "" if the character is still
        unfinished with all the context available."""
        assert self.tokenizer is not None
        decode = self.tokenizer.decode
        for k in range(1, min(len(context_token_ids), MAX_CONTEXT_TOKENS) + 1):
            context = context_token_ids[-k:]
            full = decode([*context, token_id])
            if full.endswith(REPLACEMENT_CHAR):
                continue  # still unfinished: take one more token of context
            # Trailing context tokens that were unfinished bytes themselves
            # showed "" at their own position; their bytes belong to this text.
            keep = len(context)
            while keep > 0 and decode([context[keep - 1]]).endswith(REPLACEMENT_CHAR):
                keep -= 1
            before = decode(context[:keep]) if keep else ""
            if full.startswith(before):
                return full[len(before) :]
            # Decoding together may normalise the text differently (spaces):
            # drop only what the two strings share.
            shared = 0
            for a, b in zip(before, full):
                if a != b:
                    break
                shared += 1
            return full[shared:]
        return ""

    def _verify_tokens(
        self,
        decoded_tokens_list: list[str],
        tokens: list[int],
        context_token_ids: list[int] | None = None,
    ) -> list[str]:
        """Repair the entries of one position that end in U+FFFD.

        ``tokens`` are alternatives for the *same* position (sampled, top-1,
        ...), so each is repaired on its own against the same context: the
        tokens sampled at the positions before."""
        if context_token_ids is None:
            context_token_ids = self._get_sampled_context_ids(self.logprobs)
        for i, text in enumerate(decoded_tokens_list):
            if text.endswith(REPLACEMENT_CHAR):
                decoded_tokens_list[i] = self._correct_decoded_token(tokens[i], context_token_ids)
        return decoded_tokens_list
