"""Incremental detokenization and stop strings.

vLLM twin: ``vllm/v1/engine/detokenizer.py`` (``IncrementalDetokenizer``,
``check_stop_strings``).
Read it for two front-end jobs that EngineCore never sees:
  * turning one new token id at a time into a text delta. Decoding a token on
    its own loses the leading space and splits multi-byte characters, so we
    decode a short window (``prefix_offset:``) and emit only the text past
    what the window already produced (``read_offset``); a trailing U+FFFD
    means "incomplete character, wait for the next token".
  * stop strings: they are text, so they can only be found here. When one
    appears the text is cut and the request is aborted in the core.
Sessions: 01 (engine loop).

Simpler than vLLM: one implementation (no fast ``DecodeStream`` path).
"""

from __future__ import annotations

from typing import Any

from engine.sampling_params import SamplingParams
from engine.v1.engine import EngineCoreRequest

# How many prompt tokens seed the decoding window, so the first generated
# token is decoded with the context it follows (spaces, merges).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string that ends inside the newest ``new_char_count`` chars.

    Returns (stop string, length to truncate the text to; -1 = keep all) or None.
    """
    if not new_char_count or not stop:
        return None
    for stop_str in stop:
        # A match must overlap the new text; start the search just before it.
        start = max(len(output_text) - new_char_count - len(stop_str) + 1, 0)
        idx = output_text.find(stop_str, start)
        if idx == -1:
            continue
        if include_in_output:
            end = idx + len(stop_str)
            return stop_str, (end if end < len(output_text) else -1)
        return stop_str, idx
    return None


class IncrementalDetokenizer:
    """Detokenization state of one request. With no tokenizer (or
    ``detokenize=False``) it only tracks token ids and the text stays empty."""

    def __init__(self, tokenizer: Any | None, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer if params.detokenize else None
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # Characters held back while streaming deltas, since they may turn out
        # to be the start of a stop string.
        self.stop_buffer_length = (
            max((len(s) for s in self.stop), default=1) - 1
            if self.stop and not self.include_stop_str_in_output
            else 0
        )
        self.output_text = ""
        self.token_ids: list[int] = []
        self.num_prompt_tokens = len(prompt_token_ids)
        # Decoding window over prompt tail + outputs.
        self._window_ids: list[int] = list(
            prompt_token_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:]
        )
        self._prefix_offset = 0
        self._read_offset = len(self._window_ids)
        self._last_output_text_offset = 0

    @classmethod
    def from_new_request(
        cls, tokenizer: Any | None, request: EngineCoreRequest
    ) -> IncrementalDetokenizer:
        return cls(tokenizer, request.prompt_token_ids, request.sampling_params)

    @property
    def output_token_ids(self) -> list[int]:
        """All generated token ids so far (including a stop token)."""
        return self.token_ids

    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append tokens; returns the stop string if one was hit.

        ``stop_terminated``: the core already stopped on the last token (EOS or
        a stop token id); its text is left out unless
        ``include_stop_str_in_output``.
        Stop strings are only searched in text produced by output tokens past
        ``min_tokens``, the same grace period the core gives EOS.
        """
        self.token_ids.extend(new_token_ids)
        if self.tokenizer is None:
            return None
        to_decode = new_token_ids
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            to_decode = new_token_ids[:-1]
        num_outputs_before = len(self.token_ids) - len(new_token_ids)
        text_len_before = len(self.output_text)
        # Text length once min_tokens outputs have been decoded: the search
        # starts after it.
        search_from = text_len_before if num_outputs_before >= self.min_tokens else None
        for k, token_id in enumerate(to_decode, start=1):
            self._window_ids.append(token_id)
            prefix_text = self._decode(self._window_ids[self._prefix_offset : self._read_offset])
            full_text = self._decode(self._window_ids[self._prefix_offset :])
            if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                self.output_text += full_text[len(prefix_text) :]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._window_ids)
            if search_from is None and num_outputs_before + k >= self.min_tokens:
                search_from = len(self.output_text)
        if search_from is None:
            return None
        found = check_stop_strings(
            self.output_text,
            len(self.output_text) - search_from,
            self.stop,
            self.include_stop_str_in_output,
        )
        if found is None:
            return None
        stop_str, truncate_to = found
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The whole text so far, or only what is new since the last call."""
        held_back = 0 if finished else self.stop_buffer_length
        end = max(len(self.output_text) - held_back, 0)
        if not delta:
            return self.output_text[:end]
        start = self._last_output_text_offset
        if end <= start:
            return ""
        self._last_output_text_offset = end
        return self.output_text[start:end]
