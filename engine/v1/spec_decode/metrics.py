"""SpecDecodingStats: how many drafts one step verified, and how many it kept.

vLLM twin: ``vllm/v1/spec_decode/metrics.py`` (``SpecDecodingStats``; its
``SpecDecodingLogging`` and ``SpecDecodingProm`` turn them into a log line and
Prometheus counters). Read it for the numbers that say whether speculation
pays: drafts verified, draft tokens, accepted tokens, and acceptances per
draft position (position 0 is accepted most often: a later draft counts only
if every earlier one was accepted). The mean acceptance length is
``1 + accepted / drafts`` -- tokens per verification step, the bonus
token included.

The scheduler fills one per step in ``update_from_output`` and sends it in
``SchedulerStats.spec_decoding_stats``; the front end's ``StatLogger`` adds
them up (``add``) into the ``glassbox:spec_decode_*`` counters.
Sessions: 06 (speculative decoding).

Simpler than vLLM: the counters live in ``StatLogger`` (no separate
Prometheus class, no per-engine labels, no periodic log line).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int  # k: the most drafts one request verifies per step
    num_drafts: int = 0  # requests that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [k]: how often the draft at position i was accepted.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        return cls(num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request verified ``num_draft_tokens`` drafts and kept the first
        ``num_accepted_tokens``."""
        if not 0 <= num_accepted_tokens <= min(num_draft_tokens, self.num_spec_tokens):
            raise ValueError(
                f"num_accepted_tokens={num_accepted_tokens} outside 0..{num_draft_tokens} "
                f"(num_spec_tokens={self.num_spec_tokens})"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def add(self, other: SpecDecodingStats) -> None:
        """Add another step's counts (the front end's running totals)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[i] += n
