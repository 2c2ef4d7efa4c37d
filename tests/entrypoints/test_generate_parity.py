"""``LLM.generate`` produces exactly what transformers produces, end to end, on CPU.

Each tiny random checkpoint (Llama; Qwen2, whose q/k/v carry a bias; Qwen3,
which RMS-normalises q and k) is built with transformers, written with
``save_pretrained`` and loaded by ``LLM(path)`` through our own loader, CPU
paged-attention backend, V1 scheduler and sampler. The reference is
``model.generate(do_sample=False)`` run on one prompt at a time.

What must hold:
* a batch of prompts of 3 to 300 tokens decodes greedily to the reference ids;
* the same when the prompts are cut into chunks (``max_num_batched_tokens``
  48), when the KV cache is so small that requests are preempted and
  recomputed, and when prompts share a 200-token prefix that is served from
  the prefix cache;
* ``logprobs=5`` reports the sampled token's and the top-5 log-probabilities
  of transformers' logits to 1e-4, and ``prompt_logprobs`` each prompt
  token's, with chunks and preemption too;
* bad input fails with a clear ValueError, and a bad request leaves the same
  ``LLM`` serving correct results.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.outputs import RequestOutput
from tests.helpers.hf_checkpoints import (
    TINY_ARCHS,
    TINY_CONFIG,
    HFGreedy,
    hf_greedy,
    save_tiny_checkpoint,
)

MAX_TOKENS = 12
BLOCK_SIZE = 16
VOCAB_SIZE = TINY_CONFIG["vocab_size"]
LOGPROB_ATOL = 1e-4
NUM_LOGPROBS = 5


def _random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


_rng = random.Random(20260527)
# Mixed lengths: shorter than a block, a block and a bit, whole blocks, long.
MIXED_PROMPTS = [_random_ids(_rng, n) for n in (3, 17, 64, 150, 300)]
# Three prompts that share their first 200 tokens (12 full blocks of 16).
SHARED_PREFIX_LEN = 200
_prefix = _random_ids(_rng, SHARED_PREFIX_LEN)
SHARED_PREFIX_PROMPTS = [_prefix + _random_ids(_rng, n) for n in (40, 13, 77)]
ALL_PROMPTS = MIXED_PROMPTS + SHARED_PREFIX_PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(
    temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=NUM_LOGPROBS
)

# Plenty of room: no chunking (the default budget, 2048 tokens per step, covers
# the whole batch) and no preemption.
PLAIN_ARGS = {
    "skip_tokenizer_init": True,
    "block_size": BLOCK_SIZE,
    "max_model_len": 400,
    "num_gpu_blocks_override": 128,
}
# Budget of 48 tokens per step: every prompt over 48 tokens is prefilled in
# chunks. 24 blocks (23 usable, 368 token slots) cannot hold the 594 tokens the
# mixed batch needs at the end, so the scheduler has to preempt.
TIGHT_ARGS = {
    "skip_tokenizer_init": True,
    "block_size": BLOCK_SIZE,
    "max_model_len": 320,
    "max_num_batched_tokens": 48,
    "num_gpu_blocks_override": 24,
    # Admit by first chunk (vLLM's default checks the whole prompt), so more
    # requests start than can finish together and decoding must preempt.
    "scheduler_reserve_full_isl": False,
}


@dataclass
class TinyModel:
    arch: str
    path: Path
    hf_model: torch.nn.Module
    # tuple(prompt ids) -> transformers' greedy continuation
    reference: dict[tuple[int, ...], HFGreedy]

    def ref(self, prompt: list[int]) -> HFGreedy:
        return self.reference[tuple(prompt)]


def _token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def _generated(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _metric(llm: LLM, name: str) -> float:
    values = [m.value for m in llm.get_metrics() if m.name == name]
    assert len(values) == 1, f"metric {name} missing from {[m.name for m in llm.get_metrics()]}"
    return values[0]


def _assert_idle(llm: LLM) -> None:
    """Nothing unfinished, and the last engine step left no request running or
    waiting and no KV block in use (public API only, so it holds whether
    EngineCore runs in this process or in its own)."""
    assert not llm.llm_engine.has_unfinished_requests()
    assert _metric(llm, "glassbox:num_requests_running") == 0
    assert _metric(llm, "glassbox:num_requests_waiting") == 0
    assert _metric(llm, "glassbox:kv_cache_usage_perc") == 0


# ---------------------------------------------------------------------------
# Fixtures: one checkpoint (and its transformers references) per architecture,
# one LLM per (architecture, engine-argument set).
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(TINY_ARCHS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    arch = request.param
    path = tmp_path_factory.mktemp(f"tiny_{arch}")
    hf_model = save_tiny_checkpoint(arch, path, seed=0)
    reference = {tuple(p): hf_greedy(hf_model, p, MAX_TOKENS) for p in ALL_PROMPTS}
    # Sanity check of the fixture itself: the continuations are not one token
    # repeated, so matching them means something.
    assert all(len(set(r.token_ids)) > 3 for r in reference.values()), arch
    return TinyModel(arch, path, hf_model, reference)


def _in_process_llm(path: str, **kwargs) -> LLM:
    """An LLM whose EngineCore runs in this process. With its own process the
    core receives requests one by one over ZMQ, so the first steps' batch
    layout (and so the last bits of fp32 sums) changes from run to run; here
    every request is queued before the first step, so each run is the same.
    Multi-process parity is tested in tests/entrypoints/openai/test_real_model.py."""
    old = os.environ.get("GLASSBOX_ENABLE_MULTIPROCESSING")
    os.environ["GLASSBOX_ENABLE_MULTIPROCESSING"] = "0"
    try:
        return LLM(path, disable_log_stats=False, **kwargs)  # the tests read metrics
    finally:
        if old is None:
            del os.environ["GLASSBOX_ENABLE_MULTIPROCESSING"]
        else:
            os.environ["GLASSBOX_ENABLE_MULTIPROCESSING"] = old


@pytest.fixture(scope="module")
def plain_llm(tiny: TinyModel) -> Iterator[LLM]:
    llm = _in_process_llm(str(tiny.path), **PLAIN_ARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def plain_outputs(tiny: TinyModel, plain_llm: LLM) -> list[RequestOutput]:
    """The unconstrained run of MIXED_PROMPTS, with top-5 logprobs."""
    return plain_llm.generate(_token_prompts(MIXED_PROMPTS), GREEDY_LOGPROBS, use_tqdm=False)


@pytest.fixture(scope="module")
def tight_llm(tiny: TinyModel) -> Iterator[LLM]:
    llm = _in_process_llm(str(tiny.path), **TIGHT_ARGS)
    yield llm
    llm.shutdown()


# ---------------------------------------------------------------------------
# Greedy token parity
# ---------------------------------------------------------------------------
def test_mixed_length_batch_matches_transformers(
    tiny: TinyModel, plain_outputs: list[RequestOutput], plain_llm: LLM
) -> None:
    assert [o.prompt_token_ids for o in plain_outputs] == MIXED_PROMPTS
    assert _generated(plain_outputs) == [tiny.ref(p).token_ids for p in MIXED_PROMPTS]
    for out in plain_outputs:
        assert out.finished
        assert out.outputs[0].finish_reason == "length"
        assert out.num_cached_tokens == 0  # first sight of every prompt
    # Plenty of KV cache: nothing had to be preempted.
    assert _metric(plain_llm, "glassbox:num_preemptions") == 0
    _assert_idle(plain_llm)


def test_chunked_prefill_with_preemption_matches(
    tiny: TinyModel, tight_llm: LLM, plain_outputs: list[RequestOutput]
) -> None:
    preemptions_before = _metric(tight_llm, "glassbox:num_preemptions")
    # Longest first: the 300-token prompt holds 19 of the 23 blocks while the
    # others are admitted behind it, so decoding runs out of blocks.
    prompts = MIXED_PROMPTS[::-1]
    outputs = tight_llm.generate(_token_prompts(prompts), GREEDY_LOGPROBS, use_tqdm=False)

    assert _metric(tight_llm, "glassbox:num_preemptions") > preemptions_before
    got = _generated(outputs)
    assert got == [tiny.ref(p).token_ids for p in prompts]
    # Identical to the unconstrained run, logprobs included: a preempted
    # request recomputes its KV from scratch and must land on the same numbers.
    # Ids and ranks must match the unconstrained run exactly; the values are
    # held to transformers' log-softmax (the oracle), since fp32 sums differ in
    # their last bits with the batch layout (chunks, and in multi-process mode
    # the order requests reach the core), so two engine runs can differ by up
    # to twice the tolerance each has against the oracle.
    unconstrained = plain_outputs[::-1]
    assert got == _generated(unconstrained)
    for prompt, tight, plain in zip(prompts, outputs, unconstrained):
        tight_lps, plain_lps = tight.outputs[0].logprobs, plain.outputs[0].logprobs
        assert tight_lps is not None and plain_lps is not None
        ref_rows = tiny.ref(prompt).logprobs
        for pos, (tight_pos, plain_pos) in enumerate(zip(tight_lps, plain_lps, strict=True)):
            assert list(tight_pos) == list(plain_pos)
            for token_id, entry in tight_pos.items():
                assert entry.rank == plain_pos[token_id].rank
                assert entry.logprob == pytest.approx(
                    ref_rows[pos, token_id].item(), abs=LOGPROB_ATOL
                )
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * len(prompts)
    _assert_idle(tight_llm)


def test_shared_prefix_is_served_from_cache_and_matches(
    tiny: TinyModel, tight_llm: LLM, plain_llm: LLM
) -> None:
    hits_before = _metric(tight_llm, "glassbox:prefix_cache_hits")
    outputs = tight_llm.generate(_token_prompts(SHARED_PREFIX_PROMPTS), GREEDY, use_tqdm=False)

    assert _metric(tight_llm, "glassbox:prefix_cache_hits") > hits_before
    # The first request computes the prefix; the later ones find (part of) its
    # 12 full blocks in the cache. Only whole blocks are ever shared. As in
    # vLLM (PrefillStats), a request preempted before its first token reports
    # the lookup it resumed with, which can also find its own blocks cached
    # before the preemption (more than the shared prefix; here the third one).
    cached = [o.num_cached_tokens for o in outputs]
    assert cached[0] == 0, cached
    for prompt, n in zip(SHARED_PREFIX_PROMPTS[1:], cached[1:], strict=True):
        assert 0 < n < len(prompt) and n % BLOCK_SIZE == 0, cached

    expected = [tiny.ref(p).token_ids for p in SHARED_PREFIX_PROMPTS]
    assert _generated(outputs) == expected
    # The unconstrained engine agrees too.
    plain = plain_llm.generate(_token_prompts(SHARED_PREFIX_PROMPTS), GREEDY, use_tqdm=False)
    assert _generated(plain) == expected
    _assert_idle(tight_llm)


# ---------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------
def test_logprobs_match_transformers_log_softmax(
    tiny: TinyModel, plain_outputs: list[RequestOutput]
) -> None:
    for prompt, out in zip(MIXED_PROMPTS, plain_outputs):
        completion = out.outputs[0]
        ref = tiny.ref(prompt)
        assert completion.logprobs is not None
        assert len(completion.logprobs) == len(completion.token_ids) == MAX_TOKENS
        for pos, (token, position_logprobs) in enumerate(
            zip(completion.token_ids, completion.logprobs)
        ):
            ref_row = ref.logprobs[pos]
            where = f"{tiny.arch}, prompt of {len(prompt)} tokens, generated token {pos}"
            # The sampled token (greedy: the argmax, so rank 1) is always reported.
            assert token in position_logprobs, where
            assert position_logprobs[token].rank == 1, where
            assert position_logprobs[token].logprob == pytest.approx(
                ref_row[token].item(), abs=LOGPROB_ATOL
            ), where
            # Greedy: the sampled token is one of the top 5, so exactly 5 entries.
            ref_top = torch.topk(ref_row, NUM_LOGPROBS)
            ref_ids = ref_top.indices.tolist()
            assert sorted(position_logprobs) == sorted(ref_ids), where
            for rank, (token_id, ref_value) in enumerate(zip(ref_ids, ref_top.values.tolist()), 1):
                entry = position_logprobs[token_id]
                assert entry.rank == rank, where
                assert entry.logprob == pytest.approx(ref_value, abs=LOGPROB_ATOL), where
                assert entry.decoded_token is None  # skip_tokenizer_init: no text
        expected_cumulative = sum(
            ref.logprobs[i, t].item() for i, t in enumerate(completion.token_ids)
        )
        assert completion.cumulative_logprob == pytest.approx(
            expected_cumulative, abs=MAX_TOKENS * LOGPROB_ATOL
        )


def _assert_prompt_logprobs_match(
    tiny: TinyModel, prompt: list[int], prompt_logprobs: list | None, k: int
) -> None:
    """One entry per prompt token: None for the first, then the actual token
    and the top ``k`` under transformers' log-softmax of the previous position.
    Ranks and top-k membership are compared with ties closer than the
    tolerance allowed to fall either way (fp32 sums in another order)."""
    with torch.no_grad():
        ref = tiny.hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    where = f"{tiny.arch}, prompt of {len(prompt)} tokens"
    assert prompt_logprobs is not None, where
    assert len(prompt_logprobs) == len(prompt), where
    assert prompt_logprobs[0] is None, where
    for pos in range(1, len(prompt)):
        position, ref_row, token = prompt_logprobs[pos], ref[pos - 1], prompt[pos]
        value = ref_row[token].item()
        assert token in position, f"{where}, position {pos}"
        entry = position[token]
        assert entry.logprob == pytest.approx(value, abs=LOGPROB_ATOL), f"{where}, position {pos}"
        best = int((ref_row > value + LOGPROB_ATOL).sum()) + 1
        worst = int((ref_row >= value - LOGPROB_ATOL).sum())
        assert best <= entry.rank <= worst, f"{where}, position {pos}"
        # The actual token plus k others, or k if it is one of the top k.
        assert len(position) in (k, k + 1), f"{where}, position {pos}"
        top_values = sorted((e.logprob for t, e in position.items() if e.rank <= k), reverse=True)
        ref_top = torch.topk(ref_row, k).values.tolist()
        assert top_values == pytest.approx(ref_top, abs=LOGPROB_ATOL), f"{where}, position {pos}"
        for token_id, e in position.items():
            assert e.logprob == pytest.approx(ref_row[token_id].item(), abs=LOGPROB_ATOL)


def test_prompt_logprobs_match_transformers(tiny: TinyModel, plain_llm: LLM) -> None:
    """Beside requests that ask for none (their sampling must not change), and
    with different widths in one batch."""
    widths = [NUM_LOGPROBS, None, 0, 2, NUM_LOGPROBS]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=k)
        for k in widths
    ]
    outputs = plain_llm.generate(_token_prompts(MIXED_PROMPTS), params, use_tqdm=False)
    assert _generated(outputs) == [tiny.ref(p).token_ids for p in MIXED_PROMPTS]
    for prompt, k, out in zip(MIXED_PROMPTS, widths, outputs):
        if k is None:
            assert out.prompt_logprobs is None
            assert out.num_cached_tokens >= 0
        else:
            _assert_prompt_logprobs_match(tiny, prompt, out.prompt_logprobs, k)
            # prompt_logprobs skips reading the prefix cache: every token ran.
            assert out.num_cached_tokens == 0
    _assert_idle(plain_llm)


def test_prompt_logprobs_with_chunked_prefill_and_preemption(
    tiny: TinyModel, tight_llm: LLM
) -> None:
    """48-token chunks: a prompt's rows come from several steps (the 3-, 17-
    and 64-token prompts also end a chunk one token before their end, or
    share a step with others), and preempted requests recompute theirs."""
    preemptions_before = _metric(tight_llm, "glassbox:num_preemptions")
    prompts = MIXED_PROMPTS[::-1]
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=NUM_LOGPROBS
    )
    outputs = tight_llm.generate(_token_prompts(prompts), params, use_tqdm=False)
    assert _metric(tight_llm, "glassbox:num_preemptions") > preemptions_before
    assert _generated(outputs) == [tiny.ref(p).token_ids for p in prompts]
    for prompt, out in zip(prompts, outputs):
        _assert_prompt_logprobs_match(tiny, prompt, out.prompt_logprobs, NUM_LOGPROBS)
    _assert_idle(tight_llm)


def test_prompt_logprobs_chunk_ending_one_token_short(tiny: TinyModel) -> None:
    """Serial loop, 16-token budget, a 17-token prompt: the first chunk runs
    positions 0..15, whose logits cover every prompt token after the first, so
    the last chunk (one token) adds no row but is the step that sends them."""
    llm = _in_process_llm(
        str(tiny.path),
        **{**PLAIN_ARGS, "max_num_batched_tokens": 16, "async_scheduling": False},
    )
    try:
        prompt = MIXED_PROMPTS[1]
        assert len(prompt) == 17
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
        [out] = llm.generate(_token_prompts([prompt]), params, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == tiny.ref(prompt).token_ids[:3]
        _assert_prompt_logprobs_match(tiny, prompt, out.prompt_logprobs, 1)
        _assert_idle(llm)
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.2}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def _assert_still_serves(llm: LLM, tiny: TinyModel) -> None:
    prompts = MIXED_PROMPTS[:3]
    outputs = llm.generate(_token_prompts(prompts), GREEDY, use_tqdm=False)
    assert _generated(outputs) == [tiny.ref(p).token_ids for p in prompts]
    _assert_idle(llm)


@pytest.mark.parametrize(
    "bad_prompt, message",
    [
        # 400 = max_model_len: no position left to generate into.
        (list(range(200)) * 2, "max_model_len"),
        ([5] * 450, "max_model_len"),
        ([5, VOCAB_SIZE, 7], "out of vocabulary"),
        ([], "empty"),
    ],
    ids=["len_eq_max_model_len", "len_over_max_model_len", "out_of_vocab", "empty"],
)
def test_bad_prompt_is_rejected_and_llm_keeps_serving(
    tiny: TinyModel, plain_llm: LLM, bad_prompt: list[int], message: str
) -> None:
    # A bad prompt among good ones rejects the whole batch ...
    batch = _token_prompts([MIXED_PROMPTS[0], bad_prompt, MIXED_PROMPTS[1]])
    with pytest.raises(ValueError, match=message):
        plain_llm.generate(batch, GREEDY, use_tqdm=False)
    # ... leaves nothing queued in the front end ...
    assert not plain_llm.llm_engine.has_unfinished_requests()
    # ... and the same LLM still generates the reference tokens, after which
    # no request (e.g. an orphaned MIXED_PROMPTS[0]) still runs or holds blocks.
    _assert_still_serves(plain_llm, tiny)


def test_bad_sampling_params_leave_llm_serving(tiny: TinyModel, plain_llm: LLM) -> None:
    with pytest.raises(ValueError, match="temperature"):
        plain_llm.generate(_token_prompts(MIXED_PROMPTS[:1]), SamplingParams(temperature=-1.0))
    # logprobs below -1 is a per-request error too.
    with pytest.raises(ValueError, match="logprobs"):
        plain_llm.generate(_token_prompts(MIXED_PROMPTS[:1]), SamplingParams(logprobs=-2))
    _assert_still_serves(plain_llm, tiny)


# EngineCore runs in its own process by default (as in vLLM);
# GLASSBOX_ENABLE_MULTIPROCESSING=0 keeps it in this one. A broken checkpoint
# must be reported clearly either way.
MULTIPROCESSING_ENV = "GLASSBOX_ENABLE_MULTIPROCESSING"
ENGINE_PROCESS_MODES = pytest.mark.parametrize(
    "multiprocessing", ["1", "0"], ids=["engine_core_own_process", "engine_core_in_process"]
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama checkpoint for the tests that break one (not parametrized by arch)."""
    path = tmp_path_factory.mktemp("llama_to_break")
    save_tiny_checkpoint("llama", path, seed=0)
    return path


def _error_text(exc: BaseException) -> str:
    """The messages of ``exc`` and of the exceptions it was raised from."""
    parts = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts.append(f"{type(current).__name__}: {current}")
        current = current.__cause__ or current.__context__
    return "\n".join(parts)


def _checkpoint_without(source: Path, dest: Path, tensor_name: str) -> Path:
    """A copy of ``source`` whose model.safetensors lacks ``tensor_name``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    del tensors[tensor_name]
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@ENGINE_PROCESS_MODES
def test_unknown_architecture_lists_supported_ones(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, multiprocessing: str
) -> None:
    monkeypatch.setenv(MULTIPROCESSING_ENV, multiprocessing)
    path = tmp_path / "foo"
    shutil.copytree(llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    # As in vLLM, where ModelConfig checks the architecture against the model
    # registry in the calling process, this is a ValueError from LLM() itself.
    with pytest.raises(ValueError) as excinfo:
        LLM(str(path), **PLAIN_ARGS)
    message = str(excinfo.value)
    assert "FooForCausalLM" in message, message
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in message, message


# arch -> [(checkpoint tensor to delete, name the error must contain)]. Tensors
# that HF stores separately but we fuse (k_proj -> qkv_proj) are reported
# under the fused parameter's name.
MISSING_WEIGHTS = {
    "llama": [
        (
            "model.layers.1.post_attention_layernorm.weight",
            "model.layers.1.post_attention_layernorm.weight",
        ),
        ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.qkv_proj.weight"),
    ],
    "qwen2": [
        ("model.layers.0.self_attn.v_proj.bias", "model.layers.0.self_attn.qkv_proj.bias"),
        ("lm_head.weight", "lm_head.weight"),
    ],
    "qwen3": [
        ("model.layers.1.self_attn.k_norm.weight", "model.layers.1.self_attn.k_norm.weight"),
        ("model.norm.weight", "model.norm.weight"),
    ],
}


def test_missing_weight_is_named(
    tiny: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In-process, so the loader's own exception reaches the caller unchanged
    # (and no process is spawned per broken checkpoint).
    monkeypatch.setenv(MULTIPROCESSING_ENV, "0")
    for i, (deleted, expected_name) in enumerate(MISSING_WEIGHTS[tiny.arch]):
        path = _checkpoint_without(tiny.path, tmp_path / f"broken{i}", deleted)
        with pytest.raises(ValueError) as excinfo:
            LLM(str(path), **PLAIN_ARGS)
        message = str(excinfo.value)
        assert expected_name in message, (deleted, message)
        assert "missing" in message, message


def test_missing_weight_is_named_when_engine_core_has_its_own_process(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default set-up: the loader fails in the EngineCore process, and the
    exception LLM() raises must still say which weight is missing (vLLM only
    says "see the error above"; Glassbox's rule is a clear error)."""
    monkeypatch.setenv(MULTIPROCESSING_ENV, "1")
    missing = "model.layers.1.post_attention_layernorm.weight"
    path = _checkpoint_without(llama_dir, tmp_path / "broken", missing)
    with pytest.raises((ValueError, RuntimeError)) as excinfo:
        LLM(str(path), **PLAIN_ARGS)
    assert missing in _error_text(excinfo.value), _error_text(excinfo.value)
