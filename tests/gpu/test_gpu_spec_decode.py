"""n-gram speculative decoding on CUDA: greedy outputs equal the engine's
without speculation, with both attention backends, with CUDA graphs for the
plain decode steps (verification steps run eagerly: their query length is
1 + drafts), chunked prefill and preemption; and drafts really are accepted.

Marked ``gpu``: skipped where torch sees no CUDA device (CI), run by
``make test-gpu``. fp32 on the tiny random Qwen3 checkpoint of the CPU tests,
with random prompts and prompts that repeat a short pattern: its greedy text
continues the pattern, so n-gram drafts are accepted (the count is asserted).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.tracing import load_trace
from tests.helpers.gpu import decode_graphs
from tests.helpers.hf_checkpoints import TINY_CONFIG, save_tiny_checkpoint

pytestmark = pytest.mark.gpu

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
PARAMS = [
    SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0, repetition_penalty=1.2, max_tokens=32, ignore_eos=True),
]


# Random prompts (prompt lookup rarely matches) and repeated patterns (it does).
_g = torch.Generator().manual_seed(2)


def _ids(n: int) -> list[int]:
    return torch.randint(3, TINY_CONFIG["vocab_size"], (n,), generator=_g).tolist()


PROMPTS = [{"prompt_token_ids": _ids(n)} for n in (3, 17, 64, 150)] + [
    {"prompt_token_ids": _ids(n) * r} for n, r in ((6, 5), (4, 6), (8, 3), (5, 12))
]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_spec")
    save_tiny_checkpoint("qwen3", path)
    return path


def _run(model, speculative_config, trace_path=None, **kw):
    llm = LLM(
        model,
        skip_tokenizer_init=True,
        device="cuda",
        dtype="float32",
        max_model_len=512,
        speculative_config=speculative_config,
        trace_path=trace_path,
        trace_level="lifecycle" if trace_path else "off",
        **decode_graphs(**kw),
    )
    outs = llm.generate(PROMPTS, PARAMS + PARAMS, use_tqdm=False)
    llm.shutdown()
    return [
        (o.outputs[0].token_ids, [sorted(p) for p in (o.outputs[0].logprobs or [])]) for o in outs
    ]


@pytest.mark.parametrize("backend", ["TRITON_ATTN"])  # fp32; FlashInfer (bf16): below
@pytest.mark.parametrize(
    "engine_kw",
    [
        dict(num_gpu_blocks_override=256),
        dict(num_gpu_blocks_override=40, max_num_batched_tokens=64),
    ],
    ids=["graphs", "chunked-preempted"],
)
def test_ngram_greedy_equals_plain_decoding_on_cuda(
    tiny_qwen3, tmp_path, monkeypatch, backend, engine_kw
):
    monkeypatch.setenv("GLASSBOX_ATTENTION_BACKEND", backend)
    plain = _run(tiny_qwen3, None, async_scheduling=False, **engine_kw)
    trace = str(tmp_path / "spec.jsonl")
    spec = _run(tiny_qwen3, NGRAM, trace_path=trace, **engine_kw)
    assert [t for t, _ in spec] == [t for t, _ in plain]
    # fp32: each logprob row names the same candidates (its token ids, sorted).
    assert [lp for _, lp in spec] == [lp for _, lp in plain]
    verified = [e for e in load_trace(trace) if e.kind == "spec.verified"]
    assert sum(e.num_accepted for e in verified) > 0


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory):
    from tests.helpers.eagle_checkpoint import save_tiny_eagle_checkpoint

    return save_tiny_eagle_checkpoint(tmp_path_factory.mktemp("tiny_eagle"), TINY_CONFIG)


ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["serial", "async"])


@ASYNC
@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_model_drafters_on_cuda(
    tiny_qwen3, eagle_head, tmp_path, monkeypatch, method, async_scheduling
):
    """The draft-model proposer with the target as its own draft accepts every
    draft; an EAGLE head (random, on a Llama-shaped target) keeps the greedy
    output; both in the serial loop and under async scheduling (drafts on the
    device). CUDA graphs stay on: steps where every request verifies k drafts
    replay graphs of their own (Triton: UNIFORM_BATCH)."""
    backend = "TRITON_ATTN"  # fp32; FlashInfer runs bf16 only: the test below
    monkeypatch.setenv("GLASSBOX_ATTENTION_BACKEND", backend)
    target = tiny_qwen3
    if method == "eagle":
        target = tmp_path / "llama"
        save_tiny_checkpoint("llama", target)
    plain = _run(target, None, async_scheduling=False, num_gpu_blocks_override=256)
    draft = target if method == "draft_model" else eagle_head
    spec_config = {"method": method, "model": str(draft), "num_speculative_tokens": 3}
    trace = str(tmp_path / "spec.jsonl")
    spec = _run(
        target,
        spec_config,
        trace_path=trace,
        num_gpu_blocks_override=256,
        async_scheduling=async_scheduling,
    )
    assert [t for t, _ in spec] == [t for t, _ in plain]
    verified = [e for e in load_trace(trace) if e.kind == "spec.verified"]
    assert sum(len(e.draft_token_ids) for e in verified) > 0
    if method == "draft_model":
        # Every draft holds except under repetition_penalty (PARAMS[3]): the
        # draft proposes the raw argmax, the target samples the penalised one.
        unpenalised = [e for e in verified if int(e.request_id.split("-")[0]) % 4 != 3]
        drafted = sum(len(e.draft_token_ids) for e in unpenalised)
        assert drafted > 0 and sum(e.num_accepted for e in unpenalised) == drafted
    batches = [e for e in load_trace(trace) if e.kind == "runner.batch"]
    uniform = [e for e in batches if set(e.query_lens) == {4}]
    assert uniform and all(e.cudagraph_mode == "FULL" for e in uniform)


@pytest.mark.parametrize(
    "method, async_scheduling",
    # n-gram runs the serial loop only (vLLM's rule).
    [("ngram", False)] + [(m, a) for m in ("draft_model", "eagle") for a in (False, True)],
)
def test_drafters_on_flashinfer(tmp_path_factory, method, async_scheduling):
    """FlashInfer (bf16, head size 64): greedy output as without speculation,
    up to bf16 near ties (``assert_same_greedy``, whose tolerances
    tests/gpu/test_flashinfer.py justifies); the drafter's own passes plan
    FlashInfer too, and under async scheduling its lookahead passes read
    their context lengths from the device. With the target as its own draft
    nearly every draft holds: bf16 may flip a near tie between the draft's
    pass and the target's verification, not more."""
    pytest.importorskip("flashinfer")
    from tests.gpu.test_flashinfer import _generate, assert_same_greedy
    from tests.helpers.eagle_checkpoint import save_tiny_eagle_checkpoint
    from tests.helpers.hf_checkpoints import save_random_llama

    root = tmp_path_factory.mktemp("fi_spec")
    target = save_random_llama(root / "llama", hidden_size=256, intermediate_size=512)
    draft = target
    if method == "eagle":
        config = {
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 512,
            "vocab_size": 512,
            "max_position_embeddings": 1024,
        }
        draft = str(save_tiny_eagle_checkpoint(root / "eagle", config))
    _, plain = _generate(target, "FLASHINFER", async_scheduling=False)
    spec_config = {"method": method, "model": draft, "num_speculative_tokens": 3}
    if method == "ngram":
        spec_config = NGRAM
    trace = str(root / "spec.jsonl")
    used, spec = _generate(
        target,
        "FLASHINFER",
        speculative_config=spec_config,
        async_scheduling=async_scheduling,
        trace_path=trace,
        trace_level="lifecycle",
    )
    assert used == "FLASHINFER"
    assert_same_greedy(spec, plain)
    verified = [e for e in load_trace(trace) if e.kind == "spec.verified"]
    drafted = sum(len(e.draft_token_ids) for e in verified)
    assert drafted > 0
    if method == "draft_model":
        accepted = sum(e.num_accepted for e in verified)
        assert accepted >= 0.9 * drafted, f"{accepted} of {drafted} drafts accepted"
