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
        **kw,
    )
    outs = llm.generate(PROMPTS, PARAMS + PARAMS, use_tqdm=False)
    llm.shutdown()
    return [
        (o.outputs[0].token_ids, [sorted(p) for p in (o.outputs[0].logprobs or [])]) for o in outs
    ]


@pytest.mark.parametrize("backend", ["FLASHINFER", "TRITON_ATTN"])
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


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_model_drafters_on_cuda(tiny_qwen3, eagle_head, tmp_path, monkeypatch, method):
    """The draft-model proposer with the target as its own draft accepts every
    draft; an EAGLE head (random, on a Llama-shaped target) keeps the greedy
    output. CUDA graphs stay on: steps where every request verifies k drafts
    replay graphs of their own."""
    monkeypatch.setenv("GLASSBOX_ATTENTION_BACKEND", "TRITON_ATTN")
    target = tiny_qwen3
    if method == "eagle":
        target = tmp_path / "llama"
        save_tiny_checkpoint("llama", target)
    plain = _run(target, None, async_scheduling=False, num_gpu_blocks_override=256)
    draft = target if method == "draft_model" else eagle_head
    spec_config = {"method": method, "model": str(draft), "num_speculative_tokens": 3}
    trace = str(tmp_path / "spec.jsonl")
    spec = _run(target, spec_config, trace_path=trace, num_gpu_blocks_override=256)
    assert [t for t, _ in spec] == [t for t, _ in plain]
    verified = [e for e in load_trace(trace) if e.kind == "spec.verified"]
    assert sum(len(e.draft_token_ids) for e in verified) > 0
    if method == "draft_model":
        # Every draft holds except under repetition_penalty (PARAMS[3]): the
        # draft proposes the raw argmax, the target samples the penalised one.
        unpenalised = [e for e in verified if int(e.request_id.split("-")[0]) % 4 != 3]
        drafted = sum(len(e.draft_token_ids) for e in unpenalised)
        assert drafted > 0 and sum(e.num_accepted for e in unpenalised) == drafted
    # Steps where every request verifies 3 drafts replay a graph (Triton: UNIFORM_BATCH).
    batches = [e for e in load_trace(trace) if e.kind == "runner.batch"]
    uniform = [e for e in batches if set(e.query_lens) == {4}]
    assert uniform and all(e.cudagraph_mode == "FULL" for e in uniform)
