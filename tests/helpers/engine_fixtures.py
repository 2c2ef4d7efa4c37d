"""Factories shared by the engine-loop tests (``LLM``, ``LLMEngine``,
``EngineCore``, the input/output processors and the configs).

Import from a test file with::

    from tests.helpers.engine_fixtures import make_llm, assert_engine_idle

Conventions:
  * Models are the tiny checkpoint of ``tests.helpers.tiny_model`` (words
    ``w0..w59`` are ids 4..63, then ``system``/``user``/``assistant`` = 64..66,
    ``<unk>``=0, ``<s>``=1, ``</s>``=2 is EOS, vocab size 67) and the model
    side is ``CountingExecutor`` (next token = last token + 1, mod 67).
  * ``ids("w5 w6")`` spells token ids with the tiny vocabulary, so expected
    values in the tests read like the text they stand for.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from engine.config import GlassboxConfig
from engine.engine.arg_utils import EngineArgs
from engine.entrypoints.llm import LLM
from engine.sampling_params import SamplingParams
from engine.v1.core.block_pool import BlockPool
from engine.v1.core.sched.scheduler import Scheduler
from engine.v1.engine import EngineCoreRequest
from engine.v1.engine.utils import ENABLE_MULTIPROCESSING_ENV
from engine.v1.metrics.reader import Metric
from tests.helpers.counting_executor import CountingExecutor
from tests.helpers.tiny_model import ROLES

NUM_WORDS = 60
# Ids of the tiny vocabulary (see tests/helpers/tiny_model.py).
UNK, BOS, EOS, PAD = 0, 1, 2, 3
SYSTEM, USER, ASSISTANT = (4 + NUM_WORDS + i for i in range(len(ROLES)))
VOCAB_SIZE = 4 + NUM_WORDS + len(ROLES)


def ids(text: str) -> list[int]:
    """Token ids of a whitespace-separated string of tiny-vocab words."""
    special = {"<unk>": UNK, "<s>": BOS, "</s>": EOS, "<pad>": PAD}
    special.update({role: 4 + NUM_WORDS + i for i, role in enumerate(ROLES)})
    out = []
    for w in text.split():
        if w in special:
            out.append(special[w])
        else:
            assert w.startswith("w"), w
            out.append(4 + int(w[1:]))
    return out


def make_llm(model_dir: str | Path, executor: type = CountingExecutor, **kwargs: Any) -> LLM:
    """An ``LLM`` over the tiny model, run by ``executor``, with EngineCore in
    this process (GLASSBOX_ENABLE_MULTIPROCESSING=0, as vLLM's own tests do
    with VLLM_ENABLE_V1_MULTIPROCESSING=0): the tests using it look inside the
    scheduler and executor objects, and build executor classes on the fly
    that could not be sent to another process. The multi-process engine is
    tested in tests/v1/engine/test_core_proc.py."""
    previous = os.environ.get(ENABLE_MULTIPROCESSING_ENV)
    os.environ[ENABLE_MULTIPROCESSING_ENV] = "0"
    try:
        # The tests read metrics; LLM's own default (as vLLM's) is no statistics.
        kwargs.setdefault("disable_log_stats", False)
        return LLM(str(model_dir), distributed_executor_backend=executor, **kwargs)
    finally:
        if previous is None:
            del os.environ[ENABLE_MULTIPROCESSING_ENV]
        else:
            os.environ[ENABLE_MULTIPROCESSING_ENV] = previous


def make_config(model_dir: str | Path, **kwargs: Any) -> GlassboxConfig:
    kwargs.setdefault("distributed_executor_backend", CountingExecutor)
    return EngineArgs(model=str(model_dir), **kwargs).create_engine_config()


def get_scheduler(llm: LLM) -> Scheduler:
    return llm.llm_engine.engine_core.engine_core.scheduler


def get_executor(llm: LLM) -> CountingExecutor:
    return llm.llm_engine.engine_core.engine_core.model_executor


def get_block_pool(llm: LLM) -> BlockPool:
    return get_scheduler(llm).kv_cache_manager.block_pool


def num_gpu_blocks(llm: LLM) -> int:
    n = llm.llm_engine.glassbox_config.cache_config.num_gpu_blocks
    assert n is not None
    return n


def assert_engine_idle(llm: LLM) -> None:
    """Nothing queued anywhere and every usable KV block back in the free pool."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.output_processor.request_states == {}
    assert engine.output_processor.parent_requests == {}
    scheduler = get_scheduler(llm)
    assert scheduler.requests == {}
    assert len(scheduler.waiting) == 0
    assert scheduler.running == []
    assert get_block_pool(llm).get_num_free_blocks() == num_gpu_blocks(llm) - 1


def metrics_by_name(llm: LLM) -> dict[str, Metric]:
    return {m.name: m for m in llm.get_metrics()}


def scheduled_new_req_order(executor: CountingExecutor) -> list[str]:
    """Request ids in the order the scheduler first sent them to the worker."""
    return [new.req_id for step in executor.steps for new in step.scheduled_new_reqs]


def make_engine_core_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams | None = None,
    *,
    eos_token_id: int | None = EOS,
    priority: int = 0,
    arrival_time: float | None = None,
) -> EngineCoreRequest:
    """An ``EngineCoreRequest`` as the input processor would build it: params
    cloned, ``max_tokens`` resolved, the EOS id set."""
    params = (params or SamplingParams(temperature=0.0)).clone()
    if params.max_tokens is None:
        params.max_tokens = 16
    params.update_from_generation_config({}, eos_token_id)
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params,
        arrival_time=time.time() if arrival_time is None else arrival_time,
        priority=priority,
    )
