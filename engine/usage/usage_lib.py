"""UsageContext: which entry point built the engine.

vLLM twin: ``vllm/usage/usage_lib.py`` (``UsageContext``).
Read it for: the enum ``EngineArgs.create_engine_config`` receives. It is more
than a label: ``max_num_batched_tokens`` and ``max_num_seqs`` left unset get
defaults that depend on it (``EngineArgs.get_batch_defaults``), so ``LLM(...)``
and ``glassbox serve`` start with different budgets on the same machine.
Sessions: 02 (scheduler).

Simpler than vLLM: only the enum. vLLM's module also collects platform facts
and, unless told not to, reports them to its usage-stats server; Glassbox
sends nothing anywhere.
"""

from __future__ import annotations

from enum import Enum


class UsageContext(str, Enum):
    UNKNOWN_CONTEXT = "UNKNOWN_CONTEXT"
    LLM_CLASS = "LLM_CLASS"  # LLM(...), offline batches
    API_SERVER = "API_SERVER"
    OPENAI_API_SERVER = "OPENAI_API_SERVER"  # glassbox serve
    OPENAI_BATCH_RUNNER = "OPENAI_BATCH_RUNNER"
    ENGINE_CONTEXT = "ENGINE_CONTEXT"  # LLMEngine / AsyncLLM.from_engine_args
