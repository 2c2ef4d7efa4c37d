"""Tests for engine/v1/engine/core.py and core_client.py (twins of
vllm/v1/engine/core.py and core_client.py): EngineCore sizes the KV cache at
start-up, then each ``step()`` is schedule -> execute -> update and nothing
else. ``CountingExecutor`` plays the model (next token = last token + 1)."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from engine.v1.engine import EngineCoreOutputs, FinishReason
from engine.v1.engine.core import EngineCore
from engine.v1.engine.core_client import EngineCoreClient, InprocClient
from engine.v1.kv_cache_interface import FullAttentionSpec
from engine.v1.metrics.stats import SchedulerStats
from tests.helpers.counting_executor import CountingExecutor, non_blocking
from tests.helpers.engine_fixtures import ids, make_config, make_engine_core_request
from tests.helpers.tiny_model import make_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("core") / "tiny")


def make_core(model_dir, executor=CountingExecutor, log_stats=True, **kwargs) -> EngineCore:
    kwargs.setdefault("block_size", 4)
    return EngineCore(make_config(model_dir, **kwargs), executor, log_stats=log_stats)


def req(request_id, words, max_tokens=3, **kwargs):
    return make_engine_core_request(
        request_id, ids(words), SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)
    )


def free_blocks(core: EngineCore) -> int:
    return core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


# ---------------------------------------------------------------------------
# step()
# ---------------------------------------------------------------------------
def test_step_without_requests(model_dir):
    core = make_core(model_dir)
    assert core.step() == ({}, False)
    assert core.model_executor.steps == []


def test_step_outputs(model_dir):
    core = make_core(model_dir)
    core.add_request(req("a", "w5 w6", max_tokens=2))

    outputs, model_ran = core.step()
    assert model_ran is True
    assert list(outputs) == [0]
    batch = outputs[0]
    assert isinstance(batch, EngineCoreOutputs)
    (a,) = batch.outputs
    assert (a.request_id, a.new_token_ids, a.finish_reason) == ("a", ids("w7"), None)
    assert isinstance(batch.scheduler_stats, SchedulerStats)
    assert batch.scheduler_stats.num_running_reqs == 1

    outputs, model_ran = core.step()
    (a,) = outputs[0].outputs
    assert (a.new_token_ids, a.finish_reason, a.stop_reason) == (
        ids("w8"),
        FinishReason.LENGTH,
        None,
    )
    assert outputs[0].scheduler_stats.num_running_reqs == 0

    # One more step tells the worker which requests finished; the model runs
    # no tokens in it (vLLM's has_requests() / empty-batch step).
    assert core.scheduler.has_unfinished_requests() is False
    assert core.scheduler.has_requests() is True
    outputs, model_ran = core.step()
    assert model_ran is False
    assert outputs[0].outputs == []
    flush = core.model_executor.steps[-1]
    assert flush.finished_req_ids == {"a"}
    assert flush.total_num_scheduled_tokens == 0

    assert core.step() == ({}, False)
    assert len(core.model_executor.steps) == 3
    assert free_blocks(core) == core.glassbox_config.cache_config.num_gpu_blocks - 1


def test_step_is_schedule_execute_update(model_dir):
    core = make_core(model_dir)
    calls: list[tuple[str, object]] = []
    scheduler, executor = core.scheduler, core.model_executor
    real_schedule = scheduler.schedule
    real_execute = executor.execute_model
    real_update = scheduler.update_from_output

    def schedule():
        so = real_schedule()
        calls.append(("schedule", so))
        return so

    def execute_model(so, non_block=False):
        calls.append(("execute_model", so))
        return real_execute(so, non_block=non_block)

    def update_from_output(so, mro):
        calls.append(("update_from_output", so))
        return real_update(so, mro)

    scheduler.schedule = schedule
    executor.execute_model = execute_model
    scheduler.update_from_output = update_from_output

    core.add_request(req("a", "w1", max_tokens=3))
    core.add_request(req("b", "w10 w11", max_tokens=2))
    num_steps = 0
    while core.scheduler.has_unfinished_requests():
        core.step()
        num_steps += 1
    assert num_steps == 3
    assert [name for name, _ in calls] == ["schedule", "execute_model", "update_from_output"] * 3
    # Within a step the three calls see the same SchedulerOutput object, and
    # it is what the executor recorded.
    for i in range(3):
        step_objects = {id(obj) for _, obj in calls[3 * i : 3 * i + 3]}
        assert step_objects == {id(executor.steps[i])}
    assert [s.num_scheduled_tokens for s in executor.steps] == [
        {"a": 1, "b": 2},
        {"a": 1, "b": 1},
        {"a": 1},
    ]


def test_two_phase_executor_uses_sample_tokens(model_dir):
    class TwoPhaseExecutor(CountingExecutor):
        """execute_model runs the forward; sample_tokens hands back the tokens."""

        @non_blocking
        def execute_model(self, scheduler_output):
            self._pending = super().execute_model(scheduler_output)
            return None

        @non_blocking
        def sample_tokens(self, grammar_output=None):
            output, self._pending = self._pending, None
            return output

    core = make_core(model_dir, executor=TwoPhaseExecutor)
    core.add_request(req("a", "w5", max_tokens=2))
    tokens = []
    while core.scheduler.has_unfinished_requests():
        outputs, _ = core.step()
        tokens += outputs[0].outputs[0].new_token_ids
    assert tokens == ids("w6 w7")


def test_no_scheduler_stats_without_log_stats(model_dir):
    core = make_core(model_dir, log_stats=False)
    core.add_request(req("a", "w5", max_tokens=1))
    outputs, _ = core.step()
    assert outputs[0].scheduler_stats is None
    assert outputs[0].outputs[0].events is None


def test_execute_model_errors_propagate(model_dir, caplog):
    class BrokenExecutor(CountingExecutor):
        @non_blocking
        def execute_model(self, scheduler_output):
            raise RuntimeError("device fell over")

    core = make_core(model_dir, executor=BrokenExecutor)
    core.add_request(req("a", "w5"))
    with pytest.raises(RuntimeError, match="device fell over"):
        core.step()
    assert "model execution failed at step 1" in caplog.text


# ---------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------
def test_abort_requests(model_dir):
    core = make_core(model_dir)
    num_usable = core.glassbox_config.cache_config.num_gpu_blocks - 1
    core.add_request(req("a", "w0 w1 w2 w3 w4", max_tokens=10))
    core.add_request(req("b", "w10", max_tokens=10))
    core.step()
    assert free_blocks(core) == num_usable - 3  # a: 2 blocks, b: 1 block

    core.abort_requests(["a", "never-added"])
    assert set(core.scheduler.requests) == {"b"}
    assert [r.request_id for r in core.scheduler.running] == ["b"]
    assert free_blocks(core) == num_usable - 1

    outputs, _ = core.step()
    # The worker hears about the abort in the next SchedulerOutput ...
    last = core.model_executor.steps[-1]
    assert last.finished_req_ids == {"a"}
    assert last.num_scheduled_tokens == {"b": 1}
    # ... and the aborted request produces no more output.
    assert [o.request_id for o in outputs[0].outputs] == ["b"]

    # Aborting a request that is still waiting.
    core.add_request(req("c", "w20"))
    core.abort_requests(["c"])
    assert "c" not in core.scheduler.requests
    assert len(core.scheduler.waiting) == 0
    core.abort_requests(["b"])
    assert not core.scheduler.has_unfinished_requests()
    core.step()  # reports the aborted ids to the worker
    assert core.model_executor.steps[-1].finished_req_ids == {"b", "c"}
    assert core.step() == ({}, False)
    assert free_blocks(core) == num_usable


def test_duplicate_request_id_is_rejected(model_dir):
    core = make_core(model_dir)
    core.add_request(req("a", "w5"))
    with pytest.raises(ValueError, match="already in the scheduler"):
        core.add_request(req("a", "w6"))


def test_prefix_caching_hashes_blocks_only_when_enabled(model_dir):
    on = make_core(model_dir)
    request = on.preprocess_add_request(req("a", "w0 w1 w2 w3 w4 w5 w6 w7 w8"))
    assert len(request.block_hashes) == 2  # two full blocks of 4
    off = make_core(model_dir, enable_prefix_caching=False)
    assert off.request_block_hasher is None
    request = off.preprocess_add_request(req("a", "w0 w1 w2 w3 w4 w5 w6 w7 w8"))
    assert request.block_hashes == []


def test_reset_prefix_cache(model_dir):
    def cached_tokens_of(core, request_id):
        core.add_request(req(request_id, "w0 w1 w2 w3 w4 w5", max_tokens=1))
        outputs, _ = core.step()
        (out,) = outputs[0].outputs
        return out.prefill_stats.num_cached_tokens

    core = make_core(model_dir)
    assert cached_tokens_of(core, "a") == 0
    assert cached_tokens_of(core, "b") == 4  # one full block of 4 is reused
    assert core.reset_prefix_cache() is True
    assert cached_tokens_of(core, "c") == 0


def test_reset_prefix_cache_with_running_requests(model_dir):
    core = make_core(model_dir)
    core.add_request(req("a", "w0 w1 w2 w3 w4 w5", max_tokens=4))
    core.step()
    assert core.reset_prefix_cache() is False  # "a" holds blocks
    assert core.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
    assert free_blocks(core) == core.kv_cache_config.num_blocks - 1  # all but the null block
    # "a" recomputes from scratch and still produces the same tokens.
    tokens = []
    while core.scheduler.has_unfinished_requests():
        outputs, _ = core.step()
        tokens += [t for o in outputs[0].outputs for t in o.new_token_ids]
    assert tokens == ids("w7 w8 w9")


# ---------------------------------------------------------------------------
# KV cache sizing (_initialize_kv_caches)
# ---------------------------------------------------------------------------
def test_num_gpu_blocks_override_sets_cache_config(model_dir):
    class NoProfiling(CountingExecutor):
        def determine_available_memory(self):
            raise AssertionError("an override must skip memory profiling")

    core = make_core(model_dir, executor=NoProfiling, num_gpu_blocks_override=70)
    assert core.glassbox_config.cache_config.num_gpu_blocks == 70
    assert core.kv_cache_config.num_blocks == 70
    # The executor was handed an equal config (the scheduler's is a copy, as in vLLM).
    assert core.model_executor.kv_cache_config == core.kv_cache_config
    assert core.scheduler.kv_cache_config is core.kv_cache_config
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.num_gpu_blocks == 70
    assert pool.get_num_free_blocks() == 69  # block 0 is the null block


@pytest.mark.parametrize("block_size,num_layers", [(4, 2), (4, 3), (16, 5)])
def test_block_count_from_available_memory(model_dir, block_size, num_layers):
    # page_size_bytes = 2 (K and V) * block_size * 1 KV head * 8 head size * 4 bytes
    page_size = 2 * block_size * 1 * 8 * 4
    expected_blocks = 37

    class Sized(CountingExecutor):
        pass

    Sized.num_layers = num_layers
    # A few spare bytes short of one more block must not round up.
    Sized.available_memory = expected_blocks * page_size * num_layers + page_size * num_layers - 1

    core = make_core(model_dir, executor=Sized, block_size=block_size, max_model_len=64)
    assert core.glassbox_config.cache_config.num_gpu_blocks == expected_blocks
    config = core.kv_cache_config
    assert config.num_blocks == expected_blocks
    layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    assert [t.shared_by for t in config.kv_cache_tensors] == [[n] for n in layer_names]
    assert all(t.size == expected_blocks * page_size for t in config.kv_cache_tensors)
    (group,) = config.kv_cache_groups
    assert group.layer_names == layer_names
    assert group.kv_cache_spec == FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype="float32"
    )
    assert group.kv_cache_spec.page_size_bytes == page_size


def test_default_counting_executor_pool(model_dir):
    # 131072 bytes / (256-byte pages * 2 layers) at block_size 4.
    core = make_core(model_dir)
    assert core.glassbox_config.cache_config.num_gpu_blocks == 256
    core16 = make_core(model_dir, block_size=16)
    assert core16.glassbox_config.cache_config.num_gpu_blocks == 64


class _Tracked(CountingExecutor):
    instances: list[CountingExecutor] = []

    def _init_executor(self) -> None:
        super()._init_executor()
        type(self).instances.append(self)


def test_too_small_kv_cache_raises_and_shuts_executor_down(model_dir):
    class TinyMemory(_Tracked):
        instances: list[CountingExecutor] = []
        available_memory = 10 * 256 * 2  # 10 blocks of 4 tokens; 64 are needed

    with pytest.raises(ValueError, match=r"max seq len \(256\)"):
        make_core(model_dir, executor=TinyMemory)
    (executor,) = TinyMemory.instances
    assert executor.is_shutdown
    assert executor.kv_cache_config is None  # never got as far as allocating


def test_failure_while_allocating_shuts_executor_down(model_dir):
    class FailingAlloc(_Tracked):
        instances: list[CountingExecutor] = []

        def initialize_from_config(self, kv_cache_config):
            raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        make_core(model_dir, executor=FailingAlloc)
    (executor,) = FailingAlloc.instances
    assert executor.is_shutdown


def test_shutdown(model_dir):
    core = make_core(model_dir)
    core.shutdown()
    assert core.model_executor.is_shutdown


# ---------------------------------------------------------------------------
# InprocClient
# ---------------------------------------------------------------------------
def test_inproc_client(model_dir):
    client = EngineCoreClient.make_client(
        make_config(model_dir, block_size=4), CountingExecutor, True
    )
    assert isinstance(client, InprocClient)
    empty = client.get_output()
    assert isinstance(empty, EngineCoreOutputs)
    assert empty.outputs == [] and empty.scheduler_stats is None

    client.add_request(req("a", "w5", max_tokens=2))
    first = client.get_output()
    assert [(o.request_id, o.new_token_ids) for o in first.outputs] == [("a", ids("w6"))]
    client.abort_requests([])  # a no-op
    assert client.engine_core.scheduler.has_unfinished_requests()
    client.abort_requests(["a"])
    assert not client.engine_core.scheduler.has_unfinished_requests()
    assert client.get_output().outputs == []
    client.shutdown()
    assert client.engine_core.model_executor.is_shutdown
