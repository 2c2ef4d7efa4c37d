"""Async scheduling changes no output: the same workload with
``async_scheduling=True`` (``step_with_batch_queue``, ``AsyncScheduler``, the
runner's device-side input ids) and ``False`` (the serial ``step``) gives the
same token ids, finish and stop reasons, and logprobs.

Each run builds an in-process ``LLMEngine`` (so the tests can look inside
EngineCore) over a tiny random Llama / Qwen2 / Qwen3 checkpoint saved by
transformers, with a word-level tokenizer added so stop strings can be
tested. Every run also checks:

* that the loop asked for really ran: the batch queue and
  ``step_with_batch_queue`` with two steps in flight at some point, or the
  plain ``step`` with never more than one;
* that no output reaches the front end, and no token leaves EngineCore, for a
  request after it finished or after it was aborted (by the user or by a stop
  string found in the front end) -- with a step for it still in flight;
* that afterwards every KV block is free again and the scheduler's
  statistics (EngineCore's own and the front end's gauges) are back to zero.

Logprobs are compared to ``LOGPROB_ATOL``, not bit for bit: the two loops
batch rows differently (the async loop schedules a step for a request that
the step in flight is about to finish, and staggered arrivals join at other
steps), and a float32 matmul over a different number of rows may sum in
another order. Tokens, seeded samples included, must be identical.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from engine.engine.arg_utils import EngineArgs
from engine.outputs import CompletionOutput
from engine.sampling_params import SamplingParams
from engine.v1.core.sched.async_scheduler import AsyncScheduler
from engine.v1.core.sched.scheduler import Scheduler
from engine.v1.engine.core import EngineCore
from engine.v1.engine.llm_engine import LLMEngine
from tests.helpers.hf_checkpoints import (
    TINY_ARCHS,
    TINY_CONFIG,
    default_model_path,
    save_tiny_checkpoint,
)
from tests.helpers.tiny_model import ROLES, make_tiny_model_dir

VOCAB_SIZE = TINY_CONFIG["vocab_size"]
BLOCK_SIZE = 16
# float32 logprobs of a few units in magnitude (one ulp: ~2.4e-7 at 2), from
# sums over 64-128 terms in 2 layers (576 in 30 for the default model):
# another summation order moves each op's result by a few ulps, and through 30
# layers the default model's logprobs move by up to ~1.3e-5 (an AMD EPYC, whose
# GEMM kernels block rows differently from the Intel parts that saw 7e-7).
# 1e-4 covers that and stays far below what a wrong input token or position
# changes (tenths or more).
LOGPROB_ATOL = 1e-4

# Plenty of KV cache (127 usable blocks of 16) and the default budget.
PLAIN = dict(block_size=BLOCK_SIZE, max_model_len=320, num_gpu_blocks_override=128)


# ---------------------------------------------------------------------------
# Checkpoints: one tiny random model per architecture, with a tokenizer
# ---------------------------------------------------------------------------
def add_word_tokenizer(model_dir: Path, scratch: Path) -> None:
    """Give a tiny checkpoint a word-level tokenizer over its whole vocabulary
    (ids 4.. are "w0", "w1", ...; </s> = 2 is the checkpoint's EOS), so the
    engine detokenizes and stop strings can be tested."""
    num_words = VOCAB_SIZE - 4 - len(ROLES)
    make_tiny_model_dir(scratch, num_words=num_words)
    for f in scratch.iterdir():
        if f.name not in ("config.json", "generation_config.json"):
            shutil.copy(f, model_dir / f.name)


@pytest.fixture(scope="module", params=sorted(TINY_ARCHS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    arch = request.param
    path = tmp_path_factory.mktemp(f"async_{arch}")
    save_tiny_checkpoint(arch, path, seed=0)
    add_word_tokenizer(path, tmp_path_factory.mktemp(f"tok_{arch}"))
    return str(path)


def prompter(seed: int) -> Callable[[int], list[int]]:
    """``prompt(n)``: n random word ids (no specials, so the text is plain),
    from a generator of the test's own, so a test's prompts do not depend on
    which other tests ran."""
    rng = random.Random(seed)
    return lambda n: [rng.randrange(4, VOCAB_SIZE - len(ROLES)) for _ in range(n)]


def greedy(max_tokens: int = 10, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def seeded(seed: int, max_tokens: int = 10, **kwargs: Any) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True, **kwargs
    )


# ---------------------------------------------------------------------------
# One run, with every check that must hold whatever the workload
# ---------------------------------------------------------------------------
# (request id, prompt text or token ids, params)
Req = tuple[str, str | list[int], SamplingParams]


@dataclass
class Sample:
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    text: str
    # Per generated token: [(token id, logprob)] in the order reported.
    logprobs: list[list[tuple[int, float]]] | None


@dataclass
class Run:
    # Request id -> its samples (n of them), from its final output.
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    num_cached_tokens: dict[str, int | None] = field(default_factory=dict)
    # Aborted request id -> the token ids it had received before the abort.
    before_abort: dict[str, list[list[int]]] = field(default_factory=dict)
    num_preemptions: int = 0
    max_in_flight: int = 0
    # Tokens scheduled over the run (the work the model did).
    num_scheduled_tokens: int = 0


def _sample(completion: Any) -> Sample:
    logprobs = None
    if completion.logprobs is not None:
        logprobs = [[(t, lp.logprob) for t, lp in pos.items()] for pos in completion.logprobs]
    return Sample(
        list(completion.token_ids),
        completion.finish_reason,
        completion.stop_reason,
        completion.text,
        logprobs,
    )


def _metric(engine: LLMEngine, name: str) -> float:
    (value,) = [m.value for m in engine.get_metrics() if m.name == name]
    return value


class Recorder:
    """Wraps the engine-core client. Fails on any token EngineCore sends for
    a request after it said the request finished, or -- in-process, where an
    abort reaches the scheduler before the next output is made -- after the
    request was aborted (by the user, or by the front end on a stop string).
    Over ZMQ an output made before the core read the abort may still come;
    the front end drops it (``run`` checks that)."""

    def __init__(self, engine: LLMEngine, check_aborts: bool) -> None:
        self.closed: dict[str, str] = {}  # internal id -> why no more tokens may come
        self.violations: list[str] = []
        # An abort after the last scheduler stats the front end saw: its
        # gauges still count that request (they change at the next step).
        self.aborted_after_stats = False
        self.aborted = False  # any abort at all
        client = engine.engine_core
        get_output, abort_requests = client.get_output, client.abort_requests

        def recording_get_output() -> Any:
            outputs = get_output()
            if outputs.scheduler_stats is not None:
                self.aborted_after_stats = False
            for out in outputs.outputs:
                if out.request_id in self.closed:
                    self.violations.append(
                        f"{out.request_id}: {out.new_token_ids} after {self.closed[out.request_id]}"
                    )
                if out.finished:
                    self.closed[out.request_id] = "its finish"
            return outputs

        def recording_abort(request_ids: list[str]) -> None:
            if request_ids:
                self.aborted_after_stats = self.aborted = True
            if check_aborts:
                for rid in request_ids:
                    self.closed.setdefault(rid, "its abort")
            abort_requests(request_ids)

        client.get_output = recording_get_output  # type: ignore[method-assign]
        client.abort_requests = recording_abort  # type: ignore[method-assign]


def count_in_flight(core: EngineCore, run: Run) -> None:
    """Keep ``run.max_in_flight`` (steps scheduled whose output is not yet
    back in the scheduler) and ``run.num_scheduled_tokens``."""
    scheduler = core.scheduler
    schedule, update = scheduler.schedule, scheduler.update_from_output
    in_flight = 0

    def counting_schedule() -> Any:
        nonlocal in_flight
        out = schedule()
        run.num_scheduled_tokens += out.total_num_scheduled_tokens
        if out.total_num_scheduled_tokens > 0:
            in_flight += 1
            run.max_in_flight = max(run.max_in_flight, in_flight)
        return out

    def counting_update(scheduler_output: Any, model_output: Any) -> Any:
        nonlocal in_flight
        if scheduler_output.total_num_scheduled_tokens > 0:
            in_flight -= 1
        return update(scheduler_output, model_output)

    scheduler.schedule = counting_schedule  # type: ignore[method-assign]
    scheduler.update_from_output = counting_update  # type: ignore[method-assign]


def assert_loop(core: EngineCore, async_scheduling: bool) -> None:
    if async_scheduling:
        assert type(core.scheduler) is AsyncScheduler
        assert core.batch_queue is not None and core.batch_queue_size == 2
        assert core.step_fn == core.step_with_batch_queue
    else:
        assert type(core.scheduler) is Scheduler
        assert core.batch_queue is None
        assert core.step_fn == core.step


def assert_idle(engine: LLMEngine, core: EngineCore | None, gauges: bool) -> None:
    """Nothing left anywhere; every usable KV block free; stats back to zero.
    ``core`` is None when EngineCore runs in its own process: then only the
    front end's view is checked. ``gauges``: whether the front end's gauges
    (the last scheduler stats it received) are up to date -- not when the
    last request to end was aborted, or stopped by a stop string, which
    EngineCore hears of only after its last output."""
    assert not engine.has_unfinished_requests()
    assert engine.output_processor.request_states == {}
    if gauges:
        assert _metric(engine, "glassbox:num_requests_running") == 0
        assert _metric(engine, "glassbox:num_requests_waiting") == 0
        assert _metric(engine, "glassbox:kv_cache_usage_perc") == 0
    if core is None:
        assert gauges
        return
    scheduler = core.scheduler
    assert scheduler.requests == {}
    assert len(scheduler.waiting) == 0 and scheduler.running == []
    num_blocks = engine.glassbox_config.cache_config.num_gpu_blocks
    assert num_blocks is not None
    # Block 0 is the null block, never handed out.
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks - 1
    stats = scheduler.make_stats()
    assert stats is not None
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)


def run(
    model_dir: str,
    async_scheduling: bool | None,
    arrivals: dict[int, list[Req]],
    *,
    aborts: dict[int, list[str]] | None = None,
    at_abort: Callable[[EngineCore, list[str]], None] | None = None,
    enable_multiprocessing: bool = False,
    **engine_kwargs: Any,
) -> Run:
    """Add ``arrivals[k]`` and abort ``aborts[k]`` before the k-th
    ``engine.step()``; step until every request is done; check the engine is
    idle. ``at_abort(core, ids)`` runs just before each abort (in-process)."""
    aborts = aborts or {}
    args = EngineArgs(
        model=model_dir, async_scheduling=async_scheduling, seed=0, **{**PLAIN, **engine_kwargs}
    )
    engine = LLMEngine.from_engine_args(args, enable_multiprocessing=enable_multiprocessing)
    result = Run()
    core = None if enable_multiprocessing else engine.engine_core.engine_core
    try:
        if core is not None:
            assert_loop(core, bool(async_scheduling))
            count_in_flight(core, result)
        recorder = Recorder(engine, check_aborts=core is not None)
        done: set[str] = set()
        latest: dict[str, dict[int, CompletionOutput]] = {}
        step = 0
        while step <= max(arrivals) or engine.has_unfinished_requests():
            for rid, prompt_in, params in arrivals.get(step, []):
                text = isinstance(prompt_in, str)
                engine.add_request(
                    rid, {"prompt": prompt_in} if text else {"prompt_token_ids": prompt_in}, params
                )
            if aborts.get(step):
                if at_abort is not None and core is not None:
                    at_abort(core, aborts[step])
                for rid in aborts[step]:
                    so_far = latest.get(rid, {})
                    result.before_abort[rid] = [list(so_far[i].token_ids) for i in sorted(so_far)]
                engine.abort_request(aborts[step])
                done.update(aborts[step])
            if not engine.has_unfinished_requests():
                step += 1  # waiting for the next arrival
                continue
            for out in engine.step():
                rid = out.request_id
                assert rid not in done, f"output for {rid} after its end"
                # Cumulative outputs; with n > 1 each carries one sample.
                latest.setdefault(rid, {}).update((c.index, c) for c in out.outputs)
                if out.finished:
                    done.add(rid)
                    so_far = latest[rid]
                    result.samples[rid] = [_sample(so_far[i]) for i in sorted(so_far)]
                    result.num_cached_tokens[rid] = out.num_cached_tokens
            step += 1
            assert step < 2000, "the engine did not finish"
        assert recorder.violations == []
        if core is None and recorder.aborted:
            # Over ZMQ the core may read the last abort after its last step: the stats the
            # front end holds then came before the abort (a slow front end, a busy machine).
            # One more request makes a step whose stats follow every abort (the core reads
            # its input in order), so the gauges can be checked all the same.
            engine.add_request("flush", {"prompt_token_ids": [1, 2, 3]}, greedy(1))
            while engine.has_unfinished_requests():
                engine.step()
        assert_idle(engine, core, gauges=core is None or not recorder.aborted_after_stats)
        result.num_preemptions = int(_metric(engine, "glassbox:num_preemptions"))
    finally:
        engine.shutdown()
    if core is not None:
        assert result.max_in_flight == (2 if async_scheduling else 1)
    return result


def run_both(model_dir: str, arrivals: dict[int, list[Req]], **kwargs: Any) -> tuple[Run, Run]:
    return (
        run(model_dir, True, arrivals, **kwargs),
        run(model_dir, False, arrivals, **kwargs),
    )


def assert_same(overlapped: Run, serial: Run, same_work: bool = False) -> None:
    """Same samples. ``same_work``: also the same prefix hits, preemptions
    and number of tokens computed -- for workloads whose every request ends
    at max_tokens, which the scheduler sees coming, with no cache pressure:
    then the two loops must schedule the same steps (the async loop must not
    schedule a step past a request's last token). Otherwise the schedules
    may differ: the async loop cannot see a stop coming (one step more), and
    a request keeps its blocks until its last token arrives (other
    preemptions)."""
    assert overlapped.samples.keys() == serial.samples.keys()
    for rid, want in serial.samples.items():
        got = overlapped.samples[rid]
        assert len(got) == len(want), rid
        for g, w in zip(got, want, strict=True):
            assert (g.token_ids, g.finish_reason, g.stop_reason, g.text) == (
                w.token_ids,
                w.finish_reason,
                w.stop_reason,
                w.text,
            ), rid
            assert (g.logprobs is None) == (w.logprobs is None), rid
            if w.logprobs is None:
                continue
            assert len(g.logprobs) == len(w.logprobs), rid
            for g_pos, w_pos in zip(g.logprobs, w.logprobs, strict=True):
                assert [t for t, _ in g_pos] == [t for t, _ in w_pos], rid
                assert [lp for _, lp in g_pos] == pytest.approx(
                    [lp for _, lp in w_pos], abs=LOGPROB_ATOL
                ), rid
    if same_work:
        assert overlapped.num_cached_tokens == serial.num_cached_tokens
        assert overlapped.num_preemptions == serial.num_preemptions
        assert overlapped.num_scheduled_tokens == serial.num_scheduled_tokens


# ---------------------------------------------------------------------------
# Workloads, each on every tiny architecture
# ---------------------------------------------------------------------------
def test_mixed_batch_and_max_tokens(model: str) -> None:
    """Prompts of 3..150 tokens, max_tokens 1 (the step in flight samples the
    last token: the next must not be scheduled), 2, 7 and 12, with and
    without top-5 logprobs; two more requests join while others decode, and
    one after the engine went idle."""
    prompt = prompter(1)
    reqs = [
        ("a", prompt(3), greedy(12, logprobs=5)),
        ("b", prompt(17), greedy(1, logprobs=5)),
        ("c", prompt(64), greedy(2)),
        ("d", prompt(150), greedy(7, logprobs=2)),
    ]
    late = [("e", prompt(20), greedy(5, logprobs=1)), ("f", prompt(5), greedy(1))]
    # After the engine went idle (the async loop still holds an empty step).
    after_idle = [("g", prompt(9), greedy(3, logprobs=2))]
    overlapped, serial = run_both(model, {0: reqs, 4: late, 40: after_idle})
    assert_same(overlapped, serial, same_work=True)
    lengths = {rid: len(s[0].token_ids) for rid, s in serial.samples.items()}
    assert lengths == {"a": 12, "b": 1, "c": 2, "d": 7, "e": 5, "f": 1, "g": 3}
    assert all(s[0].finish_reason == "length" for s in serial.samples.values())


def test_chunked_prefill(model: str) -> None:
    """A budget of 32 tokens a step: prompts up to 150 tokens are prefilled
    in chunks next to other requests' decodes (a chunk samples nothing, so it
    gets no placeholder)."""
    prompt = prompter(2)
    budget = 32
    reqs = [
        ("a", prompt(40), greedy(8, logprobs=3)),
        ("b", prompt(150), greedy(6, logprobs=3)),
        ("c", prompt(9), greedy(12)),
    ]
    later = [("d", prompt(100), greedy(5, logprobs=3)), ("e", prompt(33), greedy(4))]
    assert max(len(p) for _, p, _ in reqs + later) > budget
    overlapped, serial = run_both(model, {0: reqs, 3: later}, max_num_batched_tokens=budget)
    assert_same(overlapped, serial, same_work=True)


def test_prefix_cache_hits(model: str) -> None:
    """Requests that arrive after a 64-token prefix (4 full blocks) was
    computed find it in the prefix cache; one prompt is repeated whole."""
    prompt = prompter(3)
    prefix = prompt(4 * BLOCK_SIZE)
    first = ("first", prefix + prompt(10), greedy(8, logprobs=2))
    later = [
        ("x", prefix + prompt(25), greedy(8, logprobs=2)),
        ("y", prefix + prompt(3), greedy(6)),
        ("same", list(first[1]), greedy(8, logprobs=2)),
    ]
    overlapped, serial = run_both(model, {0: [first], 3: later})
    assert_same(overlapped, serial, same_work=True)
    for r in (overlapped, serial):
        assert r.num_cached_tokens["first"] == 0
        assert all(r.num_cached_tokens[rid] >= len(prefix) for rid, _, _ in later)


def test_preemption_with_chunks_sampling_and_penalties(model: str) -> None:
    """23 usable blocks for a batch that needs ~40 once decoding: requests
    are preempted (with steps in flight) and recomputed, under a 48-token
    budget, with greedy, seeded and penalised sampling mixed."""
    prompt = prompter(4)
    reqs = [
        ("g1", prompt(150), greedy(30, logprobs=2)),
        ("g2", prompt(90), greedy(40)),
        ("s1", prompt(120), seeded(7, 35, top_k=50)),
        ("s2", prompt(60), seeded(8, 40, top_p=0.9)),
        ("p1", prompt(100), greedy(40, repetition_penalty=1.3, frequency_penalty=0.4)),
        ("p2", prompt(70), seeded(9, 40, presence_penalty=0.8, repetition_penalty=0.9)),
    ]
    tight = dict(
        max_num_batched_tokens=48,
        num_gpu_blocks_override=24,
        # Admit by first chunk, so more requests start than can finish together.
        scheduler_reserve_full_isl=False,
    )
    overlapped, serial = run_both(model, {0: reqs}, **tight)
    # Not the same work: besides other preemptions, a block that a step in
    # flight completes is cached only if its request is still running when
    # the token arrives (as in vLLM): one preempted meanwhile recomputes it.
    assert_same(overlapped, serial)
    assert overlapped.num_preemptions > 0 and serial.num_preemptions > 0


def test_preempted_while_its_last_token_is_in_flight(model: str) -> None:
    """7 usable blocks. "a" (31 tokens, 2 blocks) decodes; "r" (70 tokens,
    5 blocks, max_tokens 1) joins and is prefilled next to a's position 31.
    The serial loop frees r's blocks before the next step; the async loop
    schedules that step first, with r's only token still in flight, and a's
    position 32 needs a block: r, the newest, is preempted. Its token then
    arrives for a preempted request and finishes it: it must leave the
    waiting queue and give nothing back twice."""
    prompt = prompter(11)
    a = ("a", prompt(31), greedy(20, logprobs=2))
    r = ("r", prompt(70), greedy(1, logprobs=2))
    small = dict(num_gpu_blocks_override=8, max_model_len=112, scheduler_reserve_full_isl=False)
    overlapped, serial = run_both(model, {0: [a], 1: [r]}, **small)
    assert_same(overlapped, serial)
    assert (overlapped.num_preemptions, serial.num_preemptions) == (1, 0)
    assert serial.samples["r"][0].finish_reason == "length"


def test_seeded_sampling_n_and_penalties(model: str) -> None:
    """Seeded random samples (temperature 1, with top-k / top-p / min-p),
    n = 3 and n = 2 (this one may stop at EOS), and the three penalties,
    which read the output ids -- with async scheduling the last of them is a
    placeholder until the sampled id replaces it before sampling."""
    prompt = prompter(5)
    p = prompt(12)
    reqs = [
        ("s1", prompt(8), seeded(1, 16)),
        ("s2", prompt(30), seeded(2, 16, top_k=20, logprobs=3)),
        ("s3", prompt(5), seeded(3, 16, top_p=0.8, min_p=0.02)),
        ("n3", p, seeded(4, 12, n=3, logprobs=1)),
        ("n2", prompt(7), SamplingParams(n=2, temperature=0.7, seed=6, max_tokens=9)),
        ("rep", p, greedy(24, repetition_penalty=1.5)),
        ("freq", p, greedy(24, frequency_penalty=2.0)),
        ("pres", p, greedy(24, presence_penalty=2.0, logprobs=2)),
        (
            "all",
            p,
            seeded(5, 24, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5),
        ),
    ]
    overlapped, serial = run_both(model, {0: reqs[:5], 2: reqs[5:]})
    assert_same(overlapped, serial)
    # The seeds matter (different seeds, different samples) and so do the penalties.
    samples = serial.samples
    assert len({tuple(s.token_ids) for s in samples["n3"]}) > 1
    plain = run(model, False, {0: [("plain", p, greedy(24))]}).samples["plain"][0].token_ids
    assert all(samples[rid][0].token_ids != plain for rid in ("rep", "freq", "pres"))


def test_stop_token_ids_and_stop_strings(model: str) -> None:
    """Stops taken from the greedy continuation itself, so they are sure to
    hit: a stop token id, a stop string (with and without it in the
    output), a stop at the first token and at max_tokens. With async
    scheduling a step for the request is in flight when the stop is seen."""
    prompt = prompter(6)
    prompts = {rid: prompt(n) for rid, n in (("t", 11), ("t0", 20), ("s", 14), ("si", 9))}
    ref = run(model, False, {0: [(rid, p, greedy(12)) for rid, p in prompts.items()]}).samples
    cont = {rid: s[0] for rid, s in ref.items()}

    def stop_text(rid: str) -> str:
        # 4 characters from the first third of the text: the stop is found
        # (there or earlier) well before the last token.
        text = cont[rid].text
        return text[len(text) // 3 :][:4]

    reqs = [
        ("t", prompts["t"], greedy(12, stop_token_ids=[cont["t"].token_ids[4]])),
        ("t0", prompts["t0"], greedy(12, stop_token_ids=[cont["t0"].token_ids[0]])),
        ("tmax", prompts["t"], greedy(5, stop_token_ids=[cont["t"].token_ids[4]])),
        ("s", prompts["s"], greedy(12, stop=[stop_text("s")])),
        ("si", prompts["si"], greedy(12, stop=stop_text("si"), include_stop_str_in_output=True)),
    ]
    overlapped, serial = run_both(model, {0: reqs})
    assert_same(overlapped, serial)
    got = {rid: s[0] for rid, s in serial.samples.items()}
    for rid in ("t", "t0", "s", "si"):
        assert got[rid].finish_reason == "stop", rid
        assert len(got[rid].token_ids) < 12, rid
    assert got["t0"].token_ids == cont["t0"].token_ids[:1]
    assert isinstance(got["s"].stop_reason, str) and got["s"].stop_reason not in got["s"].text
    assert got["si"].text.endswith(got["si"].stop_reason)
    assert len(got["tmax"].token_ids) <= 5


# ---------------------------------------------------------------------------
# Aborts while a step is in flight
# ---------------------------------------------------------------------------
def test_aborts_mid_flight(model: str) -> None:
    """Aborts between steps: with async scheduling a step that includes the
    aborted request is always in flight then, and its token must be dropped.
    Aborted: a decoding request, one in the middle of its chunked prefill, an
    n = 2 request, and one still waiting; the rest must be unaffected and
    every block of the aborted ones freed."""
    prompt = prompter(7)
    reqs = [
        ("dec", prompt(10), greedy(30, logprobs=2)),
        ("chunked", prompt(200), greedy(30)),
        ("n2", prompt(12), seeded(3, 30, n=2)),
        ("keep1", prompt(25), greedy(20, logprobs=2)),
        ("keep2", prompt(40), seeded(4, 20, repetition_penalty=1.2)),
    ]
    arrivals = {0: reqs, 2: [("waiting", prompt(120), greedy(10))]}
    aborts = {2: ["chunked"], 4: ["dec", "n2", "waiting"]}
    in_flight_at_abort: list[tuple[list[str], list[str]]] = []

    def look(core: EngineCore, ids: list[str]) -> None:
        # (ids aborted, user ids of the requests in the step in flight)
        queue = core.batch_queue
        if queue is not None:
            assert len(queue) == 1
            _, scheduled = queue[0]
            in_step = [r.split("-")[0].split("_")[-1] for r in scheduled.num_scheduled_tokens]
            in_flight_at_abort.append((ids, in_step))

    budget = dict(max_num_batched_tokens=64)
    overlapped = run(model, True, arrivals, aborts=aborts, at_abort=look, **budget)
    serial = run(model, False, arrivals, aborts=aborts, **budget)
    full = run(model, False, {0: reqs}, **budget)

    # The async run really aborted requests that a step in flight was computing.
    assert in_flight_at_abort and all(
        set(ids) - {"waiting"} <= set(in_step) for ids, in_step in in_flight_at_abort
    )
    for r in (overlapped, serial):
        assert set(r.samples) == {"keep1", "keep2"}
        assert set(r.before_abort) == {"chunked", "dec", "n2", "waiting"}
        # What arrived before the abort is the start of the unaborted run.
        for rid, tokens in r.before_abort.items():
            for i, got in enumerate(tokens):
                assert got == full.samples[rid][i].token_ids[: len(got)], rid
        assert r.before_abort["waiting"] == [] and r.before_abort["chunked"] in ([], [[]])
    assert any(r.before_abort["dec"][0] for r in (overlapped, serial))
    assert_same(overlapped, serial)
    for rid in ("keep1", "keep2"):
        assert serial.samples[rid][0].token_ids == full.samples[rid][0].token_ids


def test_multiprocess_default_loop(model: str) -> None:
    """The default engine: EngineCore in its own (forked) process, async
    scheduling left to resolve (on), an abort mid-run. Requests reach that
    process one by one, so the batches differ from run to run: same tokens,
    logprobs to the tolerance."""
    prompt = prompter(8)
    reqs = [
        ("a", prompt(30), greedy(12, logprobs=3)),
        ("b", prompt(70), greedy(10)),
        ("c", prompt(5), seeded(11, 12, n=2)),
        ("gone", prompt(20), greedy(40)),
    ]
    default = run(model, None, {0: reqs}, aborts={4: ["gone"]}, enable_multiprocessing=True)
    serial = run(model, False, {0: reqs})
    full_gone = serial.samples.pop("gone")[0].token_ids
    del serial.num_cached_tokens["gone"]
    assert "gone" not in default.samples
    # Whatever it had received by the abort (over ZMQ, maybe nothing yet).
    assert all(t == full_gone[: len(t)] for t in default.before_abort["gone"])
    assert_same(default, serial)


def test_resolved_default_is_async(model: str) -> None:
    args = EngineArgs(model=model, **PLAIN)
    engine = LLMEngine.from_engine_args(args, enable_multiprocessing=False)
    try:
        assert engine.glassbox_config.scheduler_config.async_scheduling is True
        assert_loop(engine.engine_core.engine_core, True)
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------------
# The default model (SmolLM2-135M, float32), once: ~6 s per load on 2 cores
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_model() -> str:
    return default_model_path()


def test_default_model(default_model: str) -> None:
    """Real text through the real tokenizer: prompts prefilled in chunks of
    16 tokens, a stop string, a seeded sample, logprobs, and a long shared
    system prompt found in the prefix cache by a later request."""
    system = (
        "You are a helpful assistant. Answer every question in one short sentence, "
        "and never use more words than you need to. Be precise, be friendly, and "
        "say so when you do not know the answer to a question. "
    )
    reqs = [
        ("capital", system + "The capital of France is", greedy(10, logprobs=3)),
        ("primes", "The first five prime numbers are", greedy(16, stop=[","])),
        ("story", "Once upon a time", seeded(3, 10, top_p=0.9)),
    ]
    later = [("again", system + "The largest planet is", greedy(8, logprobs=3))]
    overlapped, serial = run_both(
        default_model, {0: reqs, 6: later}, max_num_batched_tokens=16, max_model_len=256
    )
    assert_same(overlapped, serial)
    primes = serial.samples["primes"][0]
    assert (primes.finish_reason, primes.stop_reason) == ("stop", ",")
    assert len(primes.token_ids) < 16
    assert serial.num_cached_tokens["again"] >= 32
