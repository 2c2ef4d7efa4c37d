"""Tensor parallelism on the CPU: worker processes joined by gloo (``mp`` executor).

* TP=2 and TP=4 give the greedy tokens of TP=1 and logprobs within 1e-4 (fp32:
  the split GEMMs sum their partial products in another order, ~1e-6 seen) on
  the tiny llama / qwen2 / qwen3 checkpoints, with chunked prefill, prefix
  caching and preemption in the same run; and on the default model at TP=3
  (its 9 heads split by 3, not by 2 or 4).
* Compiled (-O2, Inductor on the CPU) at TP=2: the same tokens as eager TP=1.
* Each rank holds exactly its slice of every checkpoint tensor (KV heads
  replicated when there are fewer than ranks) and about 1/N of the weights.
* Bad sizes and backends fail with one line naming the value.
* A worker that dies fails the engine within seconds; shutdown leaves no
  process and no shared-memory segment.
"""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers.hf_checkpoints import TINY_CONFIG, default_model_path, save_tiny_checkpoint
from tests.helpers.leaks import ipc_socket_files, stale_ipc_files

pytestmark = pytest.mark.usefixtures("in_process_engine")

VOCAB = TINY_CONFIG["vocab_size"]
PROMPTS = [[(7 * j + 3 * i) % VOCAB for j in range(20 + 4 * i)] for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
# Small blocks and a small step budget: prompts are chunked, four requests
# do not fit their blocks at once (preemption), PROMPTS[0] repeats (prefix hits).
ENGINE = {
    "skip_tokenizer_init": True,
    "max_model_len": 64,
    "block_size": 4,
    "num_gpu_blocks_override": 17,
    "max_num_batched_tokens": 16,
    "enable_prefix_caching": True,
    "dtype": "float32",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp")
    for arch in ("llama", "qwen2", "qwen3"):
        save_tiny_checkpoint(arch, root / arch, seed=3)
    return {arch: str(root / arch) for arch in ("llama", "qwen2", "qwen3")}


def _run(model: str, prompts: list, **kwargs) -> list:
    llm = LLM(model, **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        stats = llm.llm_engine.engine_core.engine_core.scheduler
        return [o.outputs[0] for o in outs], stats.num_preemptions_total
    finally:
        llm.shutdown()


def _assert_same(ref: list, got: list, atol: float = 1e-4) -> None:
    for a, b in zip(ref, got, strict=True):
        assert list(a.token_ids) == list(b.token_ids)
        for pa, pb in zip(a.logprobs, b.logprobs, strict=True):
            for token, lp in pa.items():
                assert abs(lp.logprob - pb[token].logprob) <= atol


@pytest.mark.parametrize(
    ("arch", "tp", "async_scheduling"),
    [("llama", 2, True), ("qwen2", 2, True), ("qwen3", 4, True), ("llama", 4, False)],
)
def test_tp_matches_one_rank(checkpoints, arch: str, tp: int, async_scheduling: bool) -> None:
    """Async scheduling (the default) keeps two steps in flight through the
    executor's ordered futures; the serial loop waits for each."""
    prompts = [*PROMPTS, PROMPTS[0]]
    ref, _ = _run(checkpoints[arch], prompts, **ENGINE)
    got, preemptions = _run(
        checkpoints[arch],
        prompts,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp",
        async_scheduling=async_scheduling,
        **ENGINE,
    )
    _assert_same(ref, got)
    assert preemptions > 0  # the block budget forced at least one


def test_default_model_tp3_matches_one_rank() -> None:
    path = default_model_path()
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
    outs = {}
    for tp in (1, 3):
        llm = LLM(path, tensor_parallel_size=tp, max_model_len=128)
        try:
            outs[tp] = [o.outputs[0] for o in llm.generate(["The capital of France is"], sp)]
        finally:
            llm.shutdown()
    _assert_same(outs[1], outs[3])


def test_compiled_tp2_matches_eager_one_rank(checkpoints, tmp_path) -> None:
    """-O2 on the CPU at TP=2: each rank compiles its shard (Dynamo, the split at
    attention, Inductor), and the all-reduces stay custom ops inside the pieces."""
    from engine.tracing import load_trace

    ref, _ = _run(checkpoints["llama"], PROMPTS, **ENGINE)
    trace = tmp_path / "tp2_compiled.jsonl"
    got, _ = _run(
        checkpoints["llama"],
        PROMPTS,
        tensor_parallel_size=2,
        optimization_level=2,
        trace_path=str(trace),
        trace_level="lifecycle",
        **ENGINE,
    )
    _assert_same(ref, got)
    compiled = [e for e in load_trace(str(trace)) if e.kind == "runner.compiled"]
    assert len(compiled) == 1 and compiled[0].tp_rank == 0  # only rank 0 records the runner
    layers = TINY_CONFIG["num_hidden_layers"]
    assert (compiled[0].backend, compiled[0].num_pieces) == ("inductor", layers + 1)


def _rank_params(worker, names: list[str]) -> dict:
    """Run in each worker (collective_rpc): its copy of some parameters."""
    from engine.distributed.parallel_state import get_tp_group

    model = worker.model_runner.model
    params = dict(model.named_parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    return {
        "rank": get_tp_group().rank_in_group,
        "params": {n: params[n].detach().clone() for n in names},
        "nbytes": nbytes,
    }


def _max_model_len_of(worker) -> tuple[int, int]:
    return worker.glassbox_config.model_config.max_model_len, worker.model_runner.max_model_len


def test_auto_fitted_max_model_len_reaches_every_rank(checkpoints) -> None:
    """max_model_len=-1: 17 blocks of 4 tokens, one the null block, hold 64."""
    engine = {**ENGINE, "max_model_len": -1}
    llm = LLM(
        checkpoints["llama"], tensor_parallel_size=2, distributed_executor_backend="mp", **engine
    )
    try:
        executor = llm.llm_engine.engine_core.engine_core.model_executor
        assert executor.collective_rpc(_max_model_len_of) == [(64, 64), (64, 64)]
        assert llm.llm_engine.model_config.max_model_len == 64
    finally:
        llm.shutdown()


def test_each_rank_loads_its_shard(checkpoints) -> None:
    from safetensors.torch import load_file

    path = checkpoints["qwen3"]  # 4 query heads, 2 KV heads: TP=4 replicates KV heads
    full = load_file(os.path.join(path, "model.safetensors"))
    head = TINY_CONFIG["hidden_size"] // 4
    names = [
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ]
    llm = LLM(path, tensor_parallel_size=4, distributed_executor_backend="mp", **ENGINE)
    try:
        executor = llm.llm_engine.engine_core.engine_core.model_executor
        ranks = executor.collective_rpc(_rank_params, (names,))
    finally:
        llm.shutdown()
    total = sum(t.numel() * t.element_size() for t in full.values())
    inter = TINY_CONFIG["intermediate_size"] // 4
    for r, got in enumerate(ranks):
        assert got["rank"] == r
        p = got["params"]
        layer = "model.layers.0"
        q = full[f"{layer}.self_attn.q_proj.weight"][r * head : (r + 1) * head]
        kv = slice((r // 2) * head, (r // 2 + 1) * head)  # KV head r // 2, shared by 2 ranks
        k = full[f"{layer}.self_attn.k_proj.weight"][kv]
        v = full[f"{layer}.self_attn.v_proj.weight"][kv]
        assert torch.equal(p[names[0]], torch.cat([q, k, v]))
        o = full[f"{layer}.self_attn.o_proj.weight"][:, r * head : (r + 1) * head]
        assert torch.equal(p[names[1]], o)
        rows = slice(r * inter, (r + 1) * inter)
        gate_up = torch.cat(
            [full[f"{layer}.mlp.gate_proj.weight"][rows], full[f"{layer}.mlp.up_proj.weight"][rows]]
        )
        assert torch.equal(p[names[2]], gate_up)
        assert torch.equal(p[names[3]], full[f"{layer}.mlp.down_proj.weight"][:, rows])
        vocab_rows = VOCAB // 4
        embed = full["model.embed_tokens.weight"][r * vocab_rows : (r + 1) * vocab_rows]
        assert torch.equal(p[names[4]], embed)
        # Norms are replicated and KV heads doubled up: a little over a quarter.
        assert total / 4 <= got["nbytes"] <= total * 0.35


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 3}, "4 attention heads are not divisible by"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1, got 0"),
        (
            {"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
            "'uni' runs one worker; tensor_parallel_size=2",
        ),
        (
            {"tensor_parallel_size": 2, "distributed_executor_backend": "threads"},
            "must be 'uni', 'mp', 'ray' or an Executor subclass, got 'threads'",
        ),
        (
            {"tensor_parallel_size": 2, "enable_lora": True},
            "LoRA with tensor_parallel_size > 1",
        ),
        (
            {
                "speculative_config": {
                    "method": "ngram",
                    "num_speculative_tokens": 2,
                    "draft_tensor_parallel_size": 2,
                }
            },
            "draft_tensor_parallel_size must equal tensor_parallel_size (1)",
        ),
    ],
)
def test_bad_parallel_settings_fail_clearly(checkpoints, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(checkpoints["llama"], **{**ENGINE, **kwargs})


def _pid(worker) -> int:
    return os.getpid()


def _glassbox_segments() -> set[str]:
    return set(glob.glob("/dev/shm/glassbox_*"))


def _leaked_since(before: set[str]) -> set[str]:
    """New segments whose creator (named in the segment) is this process or has exited:
    a segment of a live process elsewhere (another test worker's engine) is not ours."""
    import psutil

    def creator(path: str) -> int:
        return int(os.path.basename(path).split("_")[1])

    return {
        path
        for path in _glassbox_segments() - before
        if creator(path) == os.getpid() or not psutil.pid_exists(creator(path))
    }


def test_worker_death_fails_fast_and_shutdown_leaves_nothing(checkpoints) -> None:
    import psutil

    segments_before, sockets_before = _glassbox_segments(), ipc_socket_files()
    llm = LLM(checkpoints["llama"], tensor_parallel_size=2, **ENGINE)
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    pids = executor.collective_rpc(_pid)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert llm.generate([{"prompt_token_ids": PROMPTS[1]}], GREEDY)[0].outputs[0].token_ids
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker process died"):
        # Fails on the first step (or the call right after it, if the step won the race).
        for _ in range(3):
            llm.generate([{"prompt_token_ids": PROMPTS[2]}], GREEDY)
    assert time.monotonic() - start < 5
    llm.shutdown()
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    assert not _leaked_since(segments_before)
    assert not stale_ipc_files(sockets_before)  # the killed worker's answer queue's too


def test_an_error_caused_by_a_dead_peer_names_the_death(monkeypatch) -> None:
    """A rank in a collective with a killed peer fails too (gloo: connection
    reset), often before the executor's monitor has seen the death: the error
    names the death first. Without a death the rank's own error stands."""
    import multiprocessing
    import types

    from engine.v1.executor import multiproc_executor
    from engine.v1.executor.multiproc_executor import MultiprocExecutor

    monkeypatch.setattr(multiproc_executor, "WORKER_DEATH_GRACE_S", 0.2)
    ctx = multiprocessing.get_context("fork")
    alive, dead = (
        ctx.Process(target=time.sleep, args=(30,)),
        ctx.Process(target=os._exit, args=(3,)),
    )
    alive.start()
    dead.start()
    try:
        executor = MultiprocExecutor.__new__(MultiprocExecutor)  # only its workers
        executor.workers = [
            types.SimpleNamespace(proc=alive, rank=0),
            types.SimpleNamespace(proc=dead, rank=1),
        ]
        gloo = "RuntimeError: Connection reset by peer"
        message = executor._failure_message("sample_tokens", gloo)
        assert message == (
            "worker failed in sample_tokens: worker process died "
            f"(TP1, pid {dead.pid}, exit code 3); another rank then reported: {gloo}"
        )
        executor.workers.pop()
        assert executor._failure_message("execute_model", "ValueError: x") == (
            "worker failed in execute_model: ValueError: x"
        )
    finally:
        alive.kill()
        alive.join()
        dead.join()


def test_clean_shutdown_in_a_separate_engine_process(checkpoints, monkeypatch) -> None:
    import psutil

    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    segments_before, sockets_before = _glassbox_segments(), ipc_socket_files()
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}  # e.g. a resource tracker
    llm = LLM(checkpoints["qwen2"], tensor_parallel_size=2, **ENGINE)
    procs = [p for p in me.children(recursive=True) if p.pid not in before]
    procs = [p for p in procs if "resource_tracker" not in " ".join(p.cmdline())]
    names = {p.name() for p in procs}
    assert len(procs) >= 3, names  # EngineCore and two workers under it
    out = llm.generate([{"prompt_token_ids": PROMPTS[3]}], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == GREEDY.max_tokens
    llm.shutdown()
    psutil.wait_procs(procs, timeout=10)
    assert not [p for p in procs if p.is_running() and p.status() != "zombie"]
    assert not _leaked_since(segments_before)
    assert not stale_ipc_files(sockets_before)


def test_ray_tp2_matches_one_rank(checkpoints) -> None:
    """The Ray backend on a local cluster the executor starts (and stops)."""
    pytest.importorskip("ray", reason="Ray is a test dependency (pyproject's test extra)")
    import ray

    prompts = [*PROMPTS, PROMPTS[0]]
    ref, _ = _run(checkpoints["qwen3"], prompts, **ENGINE)
    got, preemptions = _run(
        checkpoints["qwen3"],
        prompts,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        **ENGINE,
    )
    _assert_same(ref, got)
    assert preemptions > 0
    assert not ray.is_initialized()  # the cluster it started is gone


def test_ray_workers_get_the_drivers_variables(checkpoints, monkeypatch) -> None:
    """A cluster started before the user set NCCL_NVLS_ENABLE=0 (here by the test,
    before the variable): its workers did not inherit it; the executor copies it,
    and names the user adds (ray_env.py), into every rank before building it."""
    pytest.importorskip("ray", reason="Ray is a test dependency (pyproject's test extra)")
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
        monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "1")
        monkeypatch.setenv("GLASSBOX_RAY_EXTRA_ENV_VARS_TO_COPY", "NVSHMEM_DISABLE_NVLS")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # worker-specific: never copied
        llm = LLM(
            checkpoints["qwen3"],
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            **ENGINE,
        )
        try:
            executor = llm.llm_engine.engine_core.engine_core.model_executor

            def probe(worker):  # sent by value (Ray pickles closures)
                import os

                names = ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS", "CUDA_VISIBLE_DEVICES")
                return worker.rank, worker.local_rank, [os.environ.get(n) for n in names]

            got = executor.collective_rpc(probe)
            assert got == [(0, 0, ["0", "1", None]), (1, 1, ["0", "1", None])]
            out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)[0].outputs[0]
            assert len(out.token_ids) == GREEDY.max_tokens
        finally:
            llm.shutdown()
        assert ray.is_initialized()  # not the executor's cluster: left running
    finally:
        ray.shutdown()


def test_ray_backend_without_ray_names_the_fix(checkpoints, monkeypatch) -> None:
    from engine.v1.executor import ray_utils

    monkeypatch.setattr(ray_utils, "ray_is_available", lambda: False)
    with pytest.raises(ValueError, match="needs Ray, which is not installed: pip install ray"):
        LLM(
            checkpoints["llama"],
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            **ENGINE,
        )


def test_a_function_the_workers_cannot_load_fails_the_call_not_the_worker(checkpoints) -> None:
    """collective_rpc pickles a function by reference: one defined after the
    workers started (a notebook cell, here a module made now) cannot be
    loaded there. That call fails, naming the function; the workers go on."""
    import sys
    import types

    llm = LLM(checkpoints["llama"], tensor_parallel_size=2, **ENGINE)
    try:
        executor = llm.llm_engine.engine_core.engine_core.model_executor
        late = types.ModuleType("made_after_the_workers_started")

        def probe(worker):
            return worker.rank

        with pytest.raises(ValueError, match="cannot send .*probe to the workers"):
            executor.collective_rpc(probe)  # a local function: not picklable at all
        probe.__module__, probe.__qualname__ = late.__name__, "probe"
        late.probe = probe
        sys.modules[late.__name__] = late
        try:
            with pytest.raises(RuntimeError, match="cannot load .*probe"):
                executor.collective_rpc(probe)
        finally:
            del sys.modules[late.__name__]
        assert executor.collective_rpc(_pid) and not executor.is_failed
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)[0].outputs[0]
        assert len(out.token_ids) == GREEDY.max_tokens
    finally:
        llm.shutdown()


def test_more_ranks_than_gpus_is_refused(checkpoints, monkeypatch) -> None:
    """mp places one rank per local GPU: asking for more fails before any
    process starts, naming both numbers (checked without a GPU: the count is
    faked; the config is only built, no engine)."""
    from engine.engine.arg_utils import EngineArgs

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = EngineArgs(
        model=checkpoints["llama"],
        skip_tokenizer_init=True,
        device="cuda",
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 GPUs .* it has 1"):
        args.create_engine_config()
