"""``glassbox bench latency`` drives EngineCore the way its busy loop does:
after each step ``post_step`` hands a speculative run's drafts to the
scheduler. Without it the proposer would run every step and no draft would
ever be verified, so a "speculative" latency would be plain decoding."""

from __future__ import annotations

from engine.benchmarks.latency import run_decode_latency
from engine.engine.arg_utils import EngineArgs
from engine.v1.core.sched.scheduler import Scheduler
from tests.helpers.tiny_model import make_tiny_model_dir


def test_speculative_latency_run_verifies_drafts(tmp_path, monkeypatch):
    verified: list[int] = []
    original = Scheduler.update_from_output

    def counting(self, scheduler_output, model_runner_output):
        verified.append(len(scheduler_output.scheduled_spec_decode_tokens))
        return original(self, scheduler_output, model_runner_output)

    monkeypatch.setattr(Scheduler, "update_from_output", counting)
    args = EngineArgs(
        model=str(make_tiny_model_dir(tmp_path / "tiny")),
        load_format="dummy",
        device="cpu",
        dtype="float32",
        hf_overrides={"intermediate_size": 32},
        max_model_len=128,
        enable_prefix_caching=False,  # as the CLI builds it: its requests carry no hashes
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1},
    )
    results = run_decode_latency(args, [2], input_len=64, num_iters=6, num_iters_warmup=1)
    assert results["2"]["batch_size"] == 2
    # The prompts are random ids from a 32-token vocabulary: 1-grams recur, so drafts exist.
    assert sum(verified) > 0
