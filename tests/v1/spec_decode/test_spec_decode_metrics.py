"""The spec-decoding counters: ``SpecDecodingStats`` per step (scheduler),
summed by ``StatLogger`` into ``glassbox:spec_decode_*`` (vLLM's
``vllm:spec_decode_*``), and the numbers of a real n-gram run agree with its
trace's ``spec.verified`` events."""

from __future__ import annotations

import pytest

from engine.v1.metrics.loggers import StatLogger
from engine.v1.metrics.stats import SchedulerStats
from engine.v1.spec_decode.metrics import SpecDecodingStats


def test_observe_draft_counts_per_position():
    stats = SpecDecodingStats.new(num_spec_tokens=3)
    stats.observe_draft(num_draft_tokens=3, num_accepted_tokens=2)
    stats.observe_draft(num_draft_tokens=2, num_accepted_tokens=0)
    stats.observe_draft(num_draft_tokens=3, num_accepted_tokens=3)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 5)
    # A later position is accepted only with every earlier one.
    assert stats.num_accepted_tokens_per_pos == [2, 2, 1]


@pytest.mark.parametrize("drafts,accepted", [(2, 3), (4, 4), (1, -1)])
def test_observe_draft_refuses_impossible_counts(drafts, accepted):
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        SpecDecodingStats.new(3).observe_draft(drafts, accepted)


def test_stat_logger_sums_steps_and_renders_one_family_header():
    logger = StatLogger("m", num_spec_tokens=2)
    for accepted in (2, 1, 0):
        step = SpecDecodingStats.new(2)
        step.observe_draft(2, accepted)
        logger.record_scheduler_stats(SchedulerStats(spec_decoding_stats=step))
    logger.record_scheduler_stats(SchedulerStats())  # a step without drafts
    values = {
        (m.name, m.labels.get("position")): m.value
        for m in logger.get_metrics()
        if m.name.startswith("glassbox:spec_decode")
    }
    assert values == {
        ("glassbox:spec_decode_num_drafts", None): 3,
        ("glassbox:spec_decode_num_draft_tokens", None): 6,
        ("glassbox:spec_decode_num_accepted_tokens", None): 3,
        ("glassbox:spec_decode_num_accepted_tokens_per_pos", "0"): 2,
        ("glassbox:spec_decode_num_accepted_tokens_per_pos", "1"): 1,
    }
    text = logger.render_prometheus()
    family = "glassbox:spec_decode_num_accepted_tokens_per_pos_total"
    assert text.count(f"# TYPE {family} counter") == 1
    assert f'{family}{{model_name="m",position="1"}} 1.0' in text
    # Every family is declared once (Prometheus rejects a repeated TYPE line).
    types = [line for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))


def test_no_spec_counters_without_speculative_decoding():
    names = {m.name for m in StatLogger("m").get_metrics()}
    assert not any(n.startswith("glassbox:spec_decode") for n in names)
    assert "spec_decode" not in StatLogger("m").render_prometheus()


def test_engine_counters_match_the_trace(tmp_path, monkeypatch):
    from engine import LLM, SamplingParams
    from engine.tracing import load_trace
    from tests.helpers.tiny_model import make_tiny_model_dir

    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    trace = str(tmp_path / "t.jsonl")
    llm = LLM(
        str(make_tiny_model_dir(tmp_path / "tiny")),
        disable_log_stats=False,
        load_format="dummy",
        device="cpu",
        dtype="float32",
        hf_overrides={"intermediate_size": 32},
        trace_path=trace,
        trace_level="lifecycle",
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate(["w1 w2 w3 w1 w2 w3 w1", "w4 w5 w4 w5 w4"], params, use_tqdm=False)
    metrics = {
        (m.name, m.labels.get("position")): m.value
        for m in llm.get_metrics()
        if m.name.startswith("glassbox:spec_decode")
    }
    del llm
    verified = [e for e in load_trace(trace) if e.kind == "spec.verified"]
    accepted = sum(e.num_accepted for e in verified)
    assert accepted > 0  # the repetitive prompts must get drafts accepted
    assert metrics[("glassbox:spec_decode_num_drafts", None)] == len(verified)
    assert metrics[("glassbox:spec_decode_num_draft_tokens", None)] == sum(
        len(e.draft_token_ids) for e in verified
    )
    assert metrics[("glassbox:spec_decode_num_accepted_tokens", None)] == accepted
    for pos in range(3):
        expected = sum(e.num_accepted > pos for e in verified)
        assert metrics[("glassbox:spec_decode_num_accepted_tokens_per_pos", str(pos))] == expected
