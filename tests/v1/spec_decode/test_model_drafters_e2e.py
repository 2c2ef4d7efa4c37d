"""Draft-model and EAGLE speculative decoding end to end (in-process, CPU, fp32).

* A draft that is the target itself proposes exactly the target's greedy
  tokens, so every draft is accepted: the sharpest check of the bookkeeping
  (first pass over the verified tokens only, lookahead slots, rollback).
* A smaller draft of another architecture (other head count, so its cache
  pages differ in size from the target's) leaves greedy output unchanged,
  with chunked prefill, preemption and prefix caching; nothing is left behind.
* Drafts never carry a request past ``max_model_len``.
* Bad configurations fail before the engine starts, naming the field.
* EAGLE: the head's drafts equal those of a reference built from
  transformers' Llama modules that recomputes the whole sequence for every
  draft (target features from the HF target, the head's own features after
  them): the shifted inputs, the feature hand-over and the head's cache across
  steps all have to be right. Greedy output is unchanged, with or without an
  embedding of the head's own, with chunking, preemption and prefix caching.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.tracing import TraceReplay
from engine.tracing.reader import load_trace
from engine.v1.engine.utils import ENABLE_MULTIPROCESSING_ENV
from tests.helpers.eagle_checkpoint import save_tiny_eagle_checkpoint
from tests.helpers.hf_checkpoints import TINY_CONFIG, save_tiny_checkpoint

K = 3
VOCAB_SIZE = TINY_CONFIG["vocab_size"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
BASE_ARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "block_size": 16,
    "max_model_len": 256,
    "num_gpu_blocks_override": 96,
}
_g = torch.Generator().manual_seed(20261204)


def _ids(n: int) -> list[int]:
    return torch.randint(3, VOCAB_SIZE, (n,), generator=_g).tolist()


PROMPTS = [_ids(n) for n in (5, 20, 40)] + [_ids(6) * 5, _ids(4) * 4 + _ids(3)]
LONG_PROMPTS = [_ids(70), _ids(5) * 10, _ids(33), _ids(3), _ids(8) * 3]
SHARED = _ids(8) * 6
PREFIX_PROMPTS = [SHARED + _ids(n) for n in (5, 9, 20)]
# Engine settings x prompts for the output-unchanged tests.
ENGINE_CASES = pytest.mark.parametrize(
    "engine_kw, prompts",
    [
        ({}, PROMPTS),
        # Chunked prefill (budget 32) and preemption (40 blocks for 5 long prompts).
        ({"max_num_batched_tokens": 32, "num_gpu_blocks_override": 40}, LONG_PROMPTS),
        ({"enable_prefix_caching": True}, PREFIX_PROMPTS + PREFIX_PROMPTS),
    ],
    ids=["plain", "chunked-preempted", "prefix-cached"],
)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft_model")
    paths = {"qwen3": root / "qwen3", "llama": root / "llama", "small": root / "small"}
    save_tiny_checkpoint("qwen3", paths["qwen3"])
    save_tiny_checkpoint("llama", paths["llama"])
    # A smaller draft: one layer, 2 query heads sharing 1 KV head of size 16,
    # so its cache page is half the target's (2 KV heads of 16).
    save_tiny_checkpoint(
        "llama",
        paths["small"],
        seed=1,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    paths["vocab300"] = root / "vocab300"
    save_tiny_checkpoint("llama", paths["vocab300"], vocab_size=300)
    paths["short"] = root / "short"
    save_tiny_checkpoint("llama", paths["short"], max_position_embeddings=128)
    paths["eagle"] = save_tiny_eagle_checkpoint(root / "eagle", TINY_CONFIG)
    paths["eagle_embed"] = save_tiny_eagle_checkpoint(
        root / "eagle_embed", TINY_CONFIG, seed=1, with_embed=True
    )
    paths["eagle_wide"] = save_tiny_eagle_checkpoint(
        root / "eagle_wide", {**TINY_CONFIG, "hidden_size": 128, "intermediate_size": 256}
    )
    return paths


@pytest.fixture
def engines() -> Iterator[Any]:
    made: list[LLM] = []

    def make(model: Path, draft: Path | None, method: str = "draft_model", **kwargs: Any) -> LLM:
        args = {**BASE_ARGS, **kwargs}
        if draft is not None:
            args["speculative_config"] = {
                "method": method,
                "model": str(draft),
                "num_speculative_tokens": kwargs.pop("k", K),
            }
            args.pop("k", None)
        else:
            args["async_scheduling"] = False
        previous = os.environ.get(ENABLE_MULTIPROCESSING_ENV)
        os.environ[ENABLE_MULTIPROCESSING_ENV] = "0"
        try:
            llm = LLM(model=str(model), disable_log_stats=False, **args)  # metrics are read
        finally:
            if previous is None:
                del os.environ[ENABLE_MULTIPROCESSING_ENV]
            else:
                os.environ[ENABLE_MULTIPROCESSING_ENV] = previous
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


def _generate(llm: LLM, prompts: list[list[int]], params: Any = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _metric(llm: LLM, name: str) -> float:
    (value,) = [m.value for m in llm.get_metrics() if m.name == name]
    return value


def _assert_idle(llm: LLM) -> None:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert scheduler.requests == {} and scheduler.running == []
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


# Async scheduling (drafts stay on the device, the runner corrects the
# scheduler's optimistic cursor) against the serial loop.
ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])


@ASYNC
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_draft_equal_to_target_accepts_every_draft(ckpts, engines, arch, async_scheduling):
    plain = _generate(engines(ckpts[arch], None), PROMPTS)
    spec_llm = engines(ckpts[arch], ckpts[arch], async_scheduling=async_scheduling)
    assert _generate(spec_llm, PROMPTS) == plain
    drafted = _metric(spec_llm, "glassbox:spec_decode_num_draft_tokens")
    accepted = _metric(spec_llm, "glassbox:spec_decode_num_accepted_tokens")
    # 5 requests x 40 tokens, k = 3: at most 4 tokens a step, so >= 10 steps each.
    assert drafted >= 5 * 9 * K
    assert accepted == drafted
    _assert_idle(spec_llm)


@ASYNC
@ENGINE_CASES
def test_smaller_draft_keeps_greedy_output(ckpts, engines, engine_kw, prompts, async_scheduling):
    plain = _generate(engines(ckpts["qwen3"], None, **engine_kw), prompts)
    spec_llm = engines(
        ckpts["qwen3"], ckpts["small"], async_scheduling=async_scheduling, **engine_kw
    )
    assert _generate(spec_llm, prompts) == plain
    assert _metric(spec_llm, "glassbox:spec_decode_num_draft_tokens") > 0
    _assert_idle(spec_llm)
    # The draft's layer has a cache tensor of its own, half the size.
    runner = spec_llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
    caches = runner.model_runner.kv_caches
    assert len(caches) == 2 + 1
    assert caches[2].numel() * 2 == caches[0].numel()


@ASYNC
def test_drafts_stop_at_max_model_len(ckpts, engines, tmp_path, async_scheduling):
    # 60-token prompts in a 64-token context: the last drafts must be cut.
    prompts = [_ids(60), _ids(3) * 20]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = _generate(engines(ckpts["qwen3"], None, max_model_len=64), prompts, params)
    trace = str(tmp_path / "t.jsonl")
    spec_llm = engines(
        ckpts["qwen3"],
        ckpts["qwen3"],
        k=5,
        max_model_len=64,
        trace_path=trace,
        trace_level="lifecycle",
        async_scheduling=async_scheduling,
    )
    out = _generate(spec_llm, prompts, params)
    assert out == plain and [len(t) for t in out] == [4, 4]
    _assert_idle(spec_llm)
    spec_llm.shutdown()
    events = load_trace(trace)
    proposed = [e for e in events if e.kind == "spec.proposed"]
    assert proposed and all(e.method == "draft_model" for e in proposed)
    # After the prompt (60) and one token, 3 positions are left: 3 drafts at most
    # are verified (under async scheduling the device proposes k, the scheduler cuts).
    verified = [e for e in events if e.kind == "spec.verified"]
    assert verified and max(len(e.draft_token_ids) for e in verified) <= 3
    if not async_scheduling:
        assert max(len(e.draft_token_ids) for e in proposed) <= 3


def test_async_scheduling_keeps_seeded_and_penalised_outputs(ckpts, engines):
    """Seeded sampling and a repetition penalty (which reads the drafts as if
    generated: under async scheduling their host copy is waited for) give
    the same tokens in the serial loop and under async scheduling."""
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, presence_penalty=0.5, max_tokens=24),
    ]
    prompts = PROMPTS[:3]
    runs = [
        _generate(
            engines(ckpts["qwen3"], ckpts["small"], async_scheduling=a), prompts * 3, params * 3
        )
        for a in (False, True)
    ]
    assert runs[0] == runs[1]


def test_seeded_sampling_repeats_run_to_run(ckpts, engines):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    first = _generate(engines(ckpts["qwen3"], ckpts["small"]), PROMPTS[:3], params)
    second = _generate(engines(ckpts["qwen3"], ckpts["small"]), PROMPTS[:3], params)
    assert first == second and all(len(t) == 24 for t in first)


@pytest.mark.parametrize(
    "draft, extra, match",
    [
        ("vocab300", {}, "vocab_size=300 differs from the target's vocab_size=256"),
        ("missing", {}, "speculative_config.model="),
        ("short", {}, "draft's max_model_len=128 is shorter"),
    ],
)
def test_bad_draft_configs_fail_before_start(ckpts, tmp_path, draft, extra, match):
    path = ckpts.get(draft, tmp_path / "no_such_checkpoint")
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": K}
    with pytest.raises(ValueError, match=match):
        LLM(
            model=str(ckpts["qwen3"]),
            speculative_config=spec,
            **BASE_ARGS,
            **extra,
        )


# ---------------------------------------------------------------------------
# EAGLE
# ---------------------------------------------------------------------------
def _eagle_reference_drafts(target_dir: Path, head_dir: Path, tokens: list[int], k: int):
    """k greedy drafts after ``tokens`` (all verified), recomputing everything:
    target features h_p (post-norm, transformers' LlamaModel), then the head
    over positions 0 .. n-2 fed (h_p, token p+1), and after that its own
    feature with each draft."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    target = LlamaForCausalLM.from_pretrained(str(target_dir), torch_dtype=torch.float32).eval()
    cfg = LlamaConfig.from_pretrained(str(head_dir))
    cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    weights = load_file(str(head_dir / "model.safetensors"))
    layer.load_state_dict(
        {n.removeprefix("layers.0."): w for n, w in weights.items() if n.startswith("layers.0.")},
        strict=False,
    )
    layer.input_layernorm = torch.nn.Identity()
    fc = weights["fc.weight"]
    embed = weights.get("embed_tokens.weight", target.model.embed_tokens.weight)
    rope = LlamaRotaryEmbedding(cfg)

    def head(feats: torch.Tensor, next_tokens: list[int]) -> torch.Tensor:
        n = feats.shape[0]
        x = torch.cat([embed[next_tokens], feats], dim=-1) @ fc.T
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(
            x[None], attention_mask=mask, position_ids=pos, position_embeddings=rope(x[None], pos)
        )
        out = out[0] if isinstance(out, tuple) else out
        return out[0]  # [n, hidden]: residual added inside, no final norm

    with torch.no_grad():
        h = target.model(torch.tensor([tokens])).last_hidden_state[0]
        feats = h[:-1]
        seq = list(tokens)
        drafts = []
        for _ in range(k):
            out = head(feats, seq[1:])
            draft = int(target.lm_head(out[-1]).argmax())
            drafts.append(draft)
            feats = torch.cat([feats, out[-1:]])
            seq.append(draft)
    return drafts


def test_eagle_drafts_equal_a_full_recompute_with_transformers(ckpts, engines, tmp_path):
    prompt = PROMPTS[2]
    trace = str(tmp_path / "eagle.jsonl")
    llm = engines(
        ckpts["llama"], ckpts["eagle"], method="eagle", trace_path=trace, trace_level="lifecycle"
    )
    (out,) = _generate(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=8))
    llm.shutdown()
    events = load_trace(trace)
    proposed = [e.draft_token_ids for e in events if e.kind == "spec.proposed"]
    # Tokens each step returned (the prefill's one, then the verifications').
    returned = [len(e.token_ids) for e in events if e.kind == "spec.verified"]
    assert len(proposed) >= 4 and all(
        e.method == "eagle" for e in events if e.kind == "spec.proposed"
    )
    known = len(prompt) + 1
    for i, drafts in enumerate(proposed[:4]):
        expected = _eagle_reference_drafts(
            ckpts["llama"], ckpts["eagle"], prompt + out[: known - len(prompt)], K
        )
        assert drafts == expected, f"proposal {i}"
        known += returned[i]


@ASYNC
@pytest.mark.parametrize("head", ["eagle", "eagle_embed"])
@ENGINE_CASES
def test_eagle_keeps_greedy_output(ckpts, engines, head, engine_kw, prompts, async_scheduling):
    plain = _generate(engines(ckpts["llama"], None, **engine_kw), prompts)
    llm = engines(
        ckpts["llama"], ckpts[head], method="eagle", async_scheduling=async_scheduling, **engine_kw
    )
    assert _generate(llm, prompts) == plain
    assert _metric(llm, "glassbox:spec_decode_num_draft_tokens") > 0
    _assert_idle(llm)
    drafter = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    model = drafter.drafter.model
    target = drafter.model
    # The LM head is always the target's; the embedding only when the head has none.
    assert model.lm_head is target.lm_head
    shares_embedding = model.model.embed_tokens is target.model.embed_tokens
    assert shares_embedding == (head == "eagle")


def test_async_drafts_in_the_trace_and_the_replay(ckpts, engines, tmp_path):
    """Under async scheduling the scheduler verifies -1 placeholders; the
    replay names the drafts the runner proposed after the step before, and
    the replay's cursors follow the engine's (it raises otherwise)."""
    trace = str(tmp_path / "async.jsonl")
    llm = engines(
        ckpts["qwen3"],
        ckpts["qwen3"],
        async_scheduling=True,
        trace_path=trace,
        trace_level="lifecycle",
    )
    _generate(llm, PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    llm.shutdown()
    verified = [e for e in load_trace(trace) if e.kind == "spec.verified"]
    with_drafts = [e for e in verified if e.draft_token_ids]
    assert with_drafts and all(set(e.draft_token_ids) == {-1} for e in with_drafts)
    replay = TraceReplay(trace)
    rows = 0
    for step in replay.steps:
        spec = replay.view(step).spec
        if spec is None:
            continue
        proposed_before = replay.view(step - 1).spec if step > 0 else None
        for rid, row in spec.verified.items():
            if not row.draft_token_ids:
                continue
            rows += 1
            assert proposed_before is not None
            expected = proposed_before.proposed[rid][: len(row.draft_token_ids)]
            assert row.draft_token_ids == expected and min(expected) >= 0
            # Draft == target: every draft is the token the target then kept.
            assert row.token_ids[:-1] == row.draft_token_ids
    assert rows == len(with_drafts)


def test_eagle_head_of_another_width_is_refused(ckpts, engines):
    with pytest.raises(ValueError, match="hidden_size=128 differs from the target's"):
        engines(ckpts["llama"], ckpts["eagle_wide"], method="eagle")
