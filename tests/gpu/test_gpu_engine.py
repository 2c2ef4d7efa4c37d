"""The engine on CUDA against the engine on CPU and against transformers.

Marked ``gpu``: skipped where torch sees no CUDA device (CI), run by
``make test-gpu`` on the GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers.gpu import decode_graphs
from tests.helpers.hf_checkpoints import random_prompts, save_random_llama

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_random_llama(
        tmp_path_factory.mktemp("tiny_llama"), hidden_size=128, intermediate_size=256
    )


def _prompts(n=6, seed=1):
    return random_prompts([3, 17, 64, 150, 300, 5][:n], seed)


def _llm(model, device, dtype, **kw):
    return LLM(
        model,
        skip_tokenizer_init=True,
        device=device,
        dtype=dtype,
        max_model_len=512,
        num_gpu_blocks_override=256,
        **decode_graphs(**kw),
    )


def _greedy_tokens(llm):
    """Each prompt's 16 greedy tokens; shuts ``llm`` down."""
    outs = llm.generate(
        _prompts(), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def _generate(model, device, dtype, **kw):
    return _greedy_tokens(_llm(model, device, dtype, **kw))


def _runner(llm):
    """The model runner of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner


def test_cuda_fp32_greedy_equals_cpu_fp32(tiny_llama):
    cpu = _generate(tiny_llama, "cpu", "float32")
    gpu = _generate(tiny_llama, "cuda", "float32")
    assert gpu == cpu


def test_cuda_fp32_greedy_equals_cpu_with_chunking_and_preemption(tiny_llama):
    cpu = _generate(tiny_llama, "cpu", "float32")
    llm = LLM(
        tiny_llama,
        skip_tokenizer_init=True,
        device="cuda",
        dtype="float32",
        max_model_len=512,
        num_gpu_blocks_override=40,
        max_num_batched_tokens=64,
        disable_log_stats=False,  # the preemption count is read below
        **decode_graphs(),
    )
    outs = llm.generate(
        _prompts(), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    metrics = {m.name: m.value for m in llm.get_metrics()}
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == cpu
    assert metrics["glassbox:num_preemptions"] > 0


def test_bf16_logprobs_close_to_transformers_bf16(tiny_llama):
    from transformers import AutoModelForCausalLM

    prompt = _prompts(1)[0]["prompt_token_ids"]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
    ref = torch.log_softmax(logits, -1)
    llm = LLM(
        tiny_llama,
        skip_tokenizer_init=True,
        device="cuda",
        max_model_len=512,
        num_gpu_blocks_override=64,
        **decode_graphs(),
    )
    out = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0, max_tokens=1, logprobs=5),
        use_tqdm=False,
    )
    llm.shutdown()
    position = out[0].outputs[0].logprobs[0]
    for token_id, lp in position.items():
        assert abs(lp.logprob - ref[token_id].item()) < 5e-2, (token_id, lp.logprob, ref[token_id])


def test_cuda_graphs_match_eager(tiny_llama):
    """FULL_DECODE_ONLY replay gives the same greedy tokens as eager, and the
    graph path is really taken (the dispatcher captured and chose graphs)."""
    eager = _generate(tiny_llama, "cuda", "float32", enforce_eager=True)
    llm = LLM(
        tiny_llama,
        skip_tokenizer_init=True,
        device="cuda",
        dtype="float32",
        max_model_len=512,
        num_gpu_blocks_override=256,
        max_num_seqs=8,
        **decode_graphs(),
    )
    outs = llm.generate(
        _prompts(), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == eager


@pytest.mark.usefixtures("in_process_engine")
def test_engines_one_after_another_capture_graphs(tiny_llama):
    """Engines built one after another in one process (as a notebook does) each capture
    their graphs: after the first is shut down, and after the second is only dropped and
    garbage-collected, their graphs are gone; PyTorch then refuses a capture into their
    memory pool ("use_count > 0" assert), so the next engine must start its own."""
    import gc

    first = _generate(tiny_llama, "cuda", "float32")  # shut down
    llm = _llm(tiny_llama, "cuda", "float32")
    assert _runner(llm).cudagraphs, "the second engine captured no graphs"
    pool = _runner(llm).graph_pool
    del llm  # no shutdown: its graphs go with the garbage
    gc.collect()
    torch.cuda.synchronize()
    third = _llm(tiny_llama, "cuda", "float32")
    assert _runner(third).graph_pool != pool and _runner(third).cudagraphs
    assert _greedy_tokens(third) == first


def test_cuda_graphs_are_captured_and_replayed(tiny_llama):
    from engine.config.compilation import CUDAGraphMode
    from engine.engine.arg_utils import EngineArgs
    from engine.v1.engine.core import EngineCore
    from engine.v1.executor.abstract import Executor
    from engine.v1.request import Request

    args = EngineArgs(
        model=tiny_llama,
        skip_tokenizer_init=True,
        device="cuda",
        dtype="float32",
        max_model_len=512,
        num_gpu_blocks_override=64,
        max_num_seqs=4,
        **decode_graphs(),
    )
    config = args.create_engine_config()
    core = EngineCore(config, Executor.get_class(config))
    runner = core.model_executor.driver_worker.model_runner
    assert runner.cudagraph_dispatcher.mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert sorted(k.num_tokens for k in runner.cudagraph_dispatcher.captured) == [1, 2, 4]
    modes = []
    original = runner.cudagraph_dispatcher.dispatch

    def spy(num_tokens, uniform_decode, query_len=1):
        result = original(num_tokens, uniform_decode, query_len)
        modes.append((num_tokens, result[0], result[1].num_tokens))
        return result

    runner.cudagraph_dispatcher.dispatch = spy
    for i, p in enumerate(_prompts(3)):
        core.add_request(
            Request(
                f"r{i}",
                p["prompt_token_ids"],
                SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                block_hasher=core.request_block_hasher,
            )
        )
    while core.scheduler.has_requests():
        core.step()
    core.shutdown()
    # Three decodes are padded to the 4-graph.
    assert (3, CUDAGraphMode.FULL, 4) in modes


def test_host_lists_copy_of_cuda_tensors_equals_tolist():
    """The sampler's trace values reach the host through one queued,
    non-blocking copy into pinned memory; read back they are ``tolist``'s."""
    from engine.tracing.tensors import HostListsCopy

    tensors = [
        torch.randn(16, device="cuda"),
        torch.randint(0, 50_000, (2, 16, 5), device="cuda"),
        torch.rand(2, 16, 5, device="cuda", dtype=torch.bfloat16),
        torch.rand(16, device="cuda") < 0.5,
        torch.tensor([1.5, 2.5]),  # a CPU tensor is read as it is
    ]
    copy = HostListsCopy(*tensors)
    # One pinned host buffer per dtype among the CUDA tensors, nothing cast.
    assert sorted(map(str, copy.groups)) == [
        "torch.bfloat16",
        "torch.bool",
        "torch.float32",
        "torch.int64",
    ]
    assert all(host.is_pinned() for _, host in copy.groups.values())
    assert copy.lists() == [t.tolist() for t in tensors]  # waits for the stream itself
    after = HostListsCopy(*tensors)
    torch.cuda.current_stream().synchronize()
    assert after.lists(synchronized=True) == [t.tolist() for t in tensors]
    # Reused pinned buffers (the sampler's staging): each copy reads back its own values.
    staging: dict[torch.dtype, torch.Tensor] = {}
    for step in range(3):
        values = [torch.randn(16, device="cuda") + step, torch.randint(0, 9, (4,), device="cuda")]
        assert HostListsCopy(*values, staging=staging).lists() == [t.tolist() for t in values]
    assert all(buffer.is_pinned() for buffer in staging.values())
