"""A real (random, tiny) Llama through the real executor, end to end.

The checkpoint is written by transformers and speaks the tiny word vocabulary
of ``tests.helpers.tiny_model``. Shown: offline ``LLM`` gives the same tokens
with EngineCore in its own process as in-process; through the server (also
multi-process, real ``openai`` client) streamed and non-streamed greedy text
equal each other and ``LLM.generate`` / ``LLM.chat`` offline.
"""

from __future__ import annotations

import pytest

from engine.entrypoints.llm import LLM
from engine.sampling_params import SamplingParams
from tests.entrypoints.openai.utils import RemoteOpenAIServer, make_tiny_llama_with_tokenizer
from tests.helpers.engine_fixtures import ids

ENGINE_KWARGS = dict(device="cpu", dtype="float32", block_size=4, num_gpu_blocks_override=80)
ENGINE_FLAGS = [
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--block-size",
    "4",
    "--num-gpu-blocks-override",
    "80",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("real") / "llama")


@pytest.fixture(scope="module")
def offline(model_dir):
    """In-process LLM: the reference."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(str(model_dir), **ENGINE_KWARGS)
    yield llm
    llm.shutdown()


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, **kwargs)


def test_offline_multiprocess_matches_in_process(model_dir, offline, monkeypatch):
    prompts = ["w1 w2 w3", "w7 w8 w9 w10 w11", {"prompt_token_ids": ids("w30 w31")}]
    params = [
        greedy(max_tokens=8, logprobs=3),
        greedy(max_tokens=5, prompt_logprobs=2),
        greedy(max_tokens=6),
    ]
    reference = offline.generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    llm = LLM(str(model_dir), **ENGINE_KWARGS)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for mp_out, ref in zip(outputs, reference):
        (a,), (b,) = mp_out.outputs, ref.outputs
        assert mp_out.prompt_token_ids == ref.prompt_token_ids
        assert (a.text, list(a.token_ids), a.finish_reason) == (
            b.text,
            list(b.token_ids),
            b.finish_reason,
        )
        assert len(a.token_ids) > 0
        # Prompt logprobs cross the process hop with the first token.
        assert (mp_out.prompt_logprobs is None) == (ref.prompt_logprobs is None)
        mp_prompt, ref_prompt = mp_out.prompt_logprobs or [], ref.prompt_logprobs or []
        assert len(mp_prompt) == len(ref_prompt)
        for pa, pb in zip(mp_prompt, ref_prompt):
            assert (pa is None) == (pb is None) and set(pa or {}) == set(pb or {})
            for token_id, lp in (pa or {}).items():
                assert lp.logprob == pytest.approx(pb[token_id].logprob, abs=1e-4)
        if a.logprobs is not None:
            # Requests reach the core one by one over ZMQ, so the first steps
            # can batch them differently; CPU matmuls then differ in the last
            # bits of float32.
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, rel=1e-4)
            for pa, pb in zip(a.logprobs, b.logprobs):
                assert set(pa) == set(pb)
                for token_id, lp in pa.items():
                    assert lp.logprob == pytest.approx(pb[token_id].logprob, abs=1e-4)
                    assert (lp.rank, lp.decoded_token) == (
                        pb[token_id].rank,
                        pb[token_id].decoded_token,
                    )


@pytest.fixture(scope="module")
def server(model_dir):
    with RemoteOpenAIServer(model_dir, ENGINE_FLAGS) as server:
        yield server


def test_completions_stream_equals_non_stream_equals_offline(server, offline, model_dir):
    client = server.get_client()
    prompt = "w40 w41 w42 w43 w44 w45"
    kwargs = dict(
        model=str(model_dir),
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kwargs)
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices
    )
    (reference,) = offline.generate(prompt, greedy(max_tokens=8), use_tqdm=False)
    assert full.choices[0].text == streamed == reference.outputs[0].text
    assert full.usage.completion_tokens == 8
    assert full.usage.prompt_tokens == len(reference.prompt_token_ids)


def test_completion_prompt_logprobs_match_offline(server, offline, model_dir):
    """vLLM's ``prompt_logprobs`` extension: per prompt token after the first,
    {token id: logprob, rank, decoded_token}; refused when streaming."""
    import openai

    client = server.get_client()
    prompt = "w12 w13 w14 w15"
    out = client.completions.create(
        model=str(model_dir),
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        extra_body={"ignore_eos": True, "prompt_logprobs": 1},
    )
    (reference,) = offline.generate(prompt, greedy(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    got = out.choices[0].model_extra["prompt_logprobs"]
    expected = reference.prompt_logprobs
    assert got[0] is None and len(got) == len(expected) == len(reference.prompt_token_ids)
    for position, ref_position in zip(got[1:], expected[1:]):
        assert {int(t) for t in position} == set(ref_position)
        for token_id, entry in position.items():
            ref_entry = ref_position[int(token_id)]
            assert entry["logprob"] == pytest.approx(ref_entry.logprob, abs=1e-4)
            assert (entry["rank"], entry["decoded_token"]) == (
                ref_entry.rank,
                ref_entry.decoded_token,
            )
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs are not available"):
        client.completions.create(
            model=str(model_dir), prompt=prompt, stream=True, extra_body={"prompt_logprobs": 1}
        )


def test_completion_echo_puts_the_prompt_first(server, offline, model_dir):
    """vLLM's echo: the prompt before the text; with logprobs the prompt's
    tokens first (the very first with a null logprob); max_tokens=0 gives the
    prompt alone, with its log-likelihood -- what evaluation harnesses send."""
    client = server.get_client()
    prompt = "w21 w22 w23"
    base = dict(model=str(model_dir), prompt=prompt, temperature=0, logprobs=1)
    (reference,) = offline.generate(
        prompt, greedy(max_tokens=2, logprobs=1, prompt_logprobs=1), use_tqdm=False
    )
    num_prompt = len(reference.prompt_token_ids)
    ref_prompt = [
        None if p is None else p[t].logprob
        for t, p in zip(reference.prompt_token_ids, reference.prompt_logprobs)
    ]

    full = client.completions.create(
        max_tokens=2, echo=True, extra_body={"ignore_eos": True}, **base
    )
    choice = full.choices[0]
    assert choice.text == prompt + reference.outputs[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == num_prompt + 2 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:num_prompt] == pytest.approx(ref_prompt[1:], abs=1e-4)
    assert lp.tokens[0] == "w21"  # the first token has no logprob but keeps its text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    only = client.completions.create(max_tokens=0, echo=True, **base)
    assert only.choices[0].text == prompt
    assert only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(ref_prompt[1:], abs=1e-4)

    streamed = list(client.completions.create(max_tokens=0, echo=True, stream=True, **base))
    chunks = [c for c in streamed if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == prompt
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens[:num_prompt]


def test_chat_prompt_logprobs_cover_the_rendered_prompt(server, offline, model_dir):
    client = server.get_client()
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    out = client.chat.completions.create(
        model=str(model_dir),
        messages=messages,
        max_tokens=2,
        temperature=0,
        extra_body={"ignore_eos": True, "prompt_logprobs": 0},
    )
    (reference,) = offline.chat(messages, greedy(max_tokens=2, prompt_logprobs=0), use_tqdm=False)
    got = out.model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(reference.prompt_token_ids)
    for token_id, position, ref_position in zip(
        reference.prompt_token_ids[1:], got[1:], reference.prompt_logprobs[1:]
    ):
        assert list(position) == [str(token_id)]  # width 0: the prompt token alone
        assert position[str(token_id)]["logprob"] == pytest.approx(
            ref_position[token_id].logprob, abs=1e-4
        )


def test_chat_echo_repeats_the_continued_assistant_turn(server, offline, model_dir):
    """vLLM's chat echo: the last message's content comes first when it is the
    assistant's (the turn ``continue_final_message`` extends); else nothing."""
    client = server.get_client()
    messages = [
        {"role": "user", "content": "w5 w6"},
        {"role": "assistant", "content": "w8 w9"},
    ]
    kwargs = dict(
        model=str(model_dir),
        messages=messages,
        max_tokens=3,
        temperature=0,
        extra_body={
            "ignore_eos": True,
            "echo": True,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    )
    (reference,) = offline.chat(
        messages,
        greedy(max_tokens=3),
        add_generation_prompt=False,
        continue_final_message=True,
        use_tqdm=False,
    )
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.content == "w8 w9" + reference.outputs[0].text
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kwargs)
        if c.choices
    )
    assert streamed == full.choices[0].message.content
    # A user turn last: nothing to echo.
    plain = client.chat.completions.create(
        model=str(model_dir),
        messages=messages[:1],
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True, "echo": True},
    )
    (alone,) = offline.chat(messages[:1], greedy(max_tokens=3), use_tqdm=False)
    assert plain.choices[0].message.content == alone.outputs[0].text


def test_chat_stream_equals_non_stream_equals_offline(server, offline, model_dir):
    client = server.get_client()
    messages = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w5 w6 w7"}]
    kwargs = dict(
        model=str(model_dir),
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (reference,) = offline.chat(messages, greedy(max_tokens=6), use_tqdm=False)
    assert full.choices[0].message.content == streamed == reference.outputs[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 6


def test_logprobs_match_offline(server, offline, model_dir):
    client = server.get_client()
    out = client.completions.create(
        model=str(model_dir),
        prompt="w9 w10",
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    (reference,) = offline.generate("w9 w10", greedy(max_tokens=4, logprobs=2), use_tqdm=False)
    expected = reference.outputs[0]
    got = out.choices[0].logprobs
    assert got.tokens == [
        expected.logprobs[i][t].decoded_token for i, t in enumerate(expected.token_ids)
    ]
    for i, token_id in enumerate(expected.token_ids):
        assert got.token_logprobs[i] == pytest.approx(
            expected.logprobs[i][token_id].logprob, abs=1e-4
        )
