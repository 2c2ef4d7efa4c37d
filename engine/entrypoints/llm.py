"""LLM: the offline API -- a batch of prompts in, a batch of RequestOutputs out.

vLLM twin: ``vllm/entrypoints/llm.py`` (``LLM.generate``, ``LLM.chat``) and
``vllm/entrypoints/offline_utils.py`` (``_add_request``, ``_run_engine``).
Read it for: ``generate`` is only "add every prompt as a request, then call
``LLMEngine.step()`` until nothing is unfinished". All batching, chunking and
preemption happen underneath, in the scheduler; the outputs are put back in
input order at the end.
Sessions: 01 (engine loop).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from engine.engine.arg_utils import EngineArgs
from engine.entrypoints.utils import log_non_default_args
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.usage.usage_lib import UsageContext
from engine.v1.engine.input_processor import PromptType
from engine.v1.engine.llm_engine import LLMEngine
from engine.v1.metrics.reader import Metric


class LLM:
    """Offline inference over one model.

    ``model`` is an HF checkpoint folder (or hub id when online); left out, it
    is the embedded SmolLM2-135M-Instruct. Every keyword is an ``EngineArgs``
    field, under vLLM's name (``block_size``, ``enable_prefix_caching``,
    ``num_gpu_blocks_override``, ``max_num_batched_tokens``,
    ``scheduling_policy``, ...), plus ``device``.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(
                f"LLM() got unexpected keyword argument(s): {', '.join(sorted(unknown))}"
            )
        # As vLLM's LLM: no statistics unless asked (get_metrics() needs
        # disable_log_stats=False); the API server keeps them on.
        kwargs.setdefault("disable_log_stats", True)
        engine_args = EngineArgs(model=model, **kwargs)
        log_non_default_args(engine_args)
        self.llm_engine = LLMEngine.from_engine_args(
            engine_args, usage_context=UsageContext.LLM_CLASS
        )
        self.request_counter = itertools.count()
        self.default_sampling_params: dict[str, Any] | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """An ``LLM`` from every field of ``engine_args``, as given (so its
        ``disable_log_stats`` too, where ``LLM(...)`` defaults it to True)."""
        return cls(**vars(engine_args))

    # -- helpers ---------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_world_size(self, include_dp: bool = True) -> int:
        """Processes that run the model: the tensor-parallel size (Glassbox has
        no pipeline or data parallelism, so ``include_dp`` changes nothing)."""
        return self.llm_engine.glassbox_config.parallel_config.world_size

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() adjusted by the generation config in effect: the
        model's generation_config.json by default (``generation_config="auto"``),
        none with "vllm", then ``override_generation_config``."""
        if self.default_sampling_params is None:
            self.default_sampling_params = self.llm_engine.model_config.get_diff_sampling_param()
        return SamplingParams(**self.default_sampling_params)

    def get_metrics(self) -> list[Metric]:
        return self.llm_engine.get_metrics()

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run ``method(worker, *args, **kwargs)`` in every worker; one answer
        per rank. ``method`` is a top-level function (the workers import it by
        name) or a ``WorkerMethod`` name. With EngineCore in its own process
        (the default) the call and its answers travel pickled, which needs
        ``GLASSBOX_ALLOW_INSECURE_SERIALIZATION=1``, as vLLM's needs
        ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """``func(model)`` in every worker, e.g. to count or inspect weights;
        move tensors to the CPU before returning them."""
        return self.llm_engine.apply_model(func)

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Open the workers' profiling window (needs ``profiler_config``); with
        ``profile_prefix`` the traces are named ``<prefix>_tp<r>_rank<g>``."""
        self.llm_engine.start_profile(profile_prefix)

    def stop_profile(self) -> None:
        """Close the window: the traces and op tables are written now."""
        self.llm_engine.stop_profile()

    # -- generate ----------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for ``prompts``; outputs come back in input order.
        ``lora_request``: one adapter for every prompt, or one (or None) per prompt."""
        request_ids = self._add_completion_requests(
            prompts, sampling_params, lora_request, priority
        )
        return self._run_engine(len(request_ids), use_tqdm=use_tqdm)

    def enqueue(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[str]:
        """Queue ``prompts`` as ``generate`` would, without running a step;
        ``wait_for_completion`` runs them. Returns the engine's request ids.
        (``use_tqdm``: vLLM's argument; adding requests shows no bar here.)"""
        return self._add_completion_requests(prompts, sampling_params, lora_request, priority)

    def wait_for_completion(self, *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Step until every queued request is done; their outputs in the order
        they were added."""
        total = self.llm_engine.get_num_unfinished_requests()
        return self._run_engine(total, use_tqdm=use_tqdm)

    def _add_completion_requests(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        lora_request: LoRARequest | list[LoRARequest | None] | None,
        priority: list[int] | None,
    ) -> list[str]:
        prompt_list = self._normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = self._per_prompt(
            "sampling_params", sampling_params, len(prompt_list), SamplingParams
        )
        if priority is not None:
            if not isinstance(priority, (list, tuple)) or len(priority) != len(prompt_list):
                raise ValueError(
                    f"priority must be a list with one entry per prompt ({len(prompt_list)}), "
                    f"got {priority!r}"
                )
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != len(prompt_list):
                raise ValueError(
                    f"lora_request has {len(lora_request)} entries but there are "
                    f"{len(prompt_list)} prompts"
                )
            lora_list = list(lora_request)
        else:
            lora_list = [lora_request] * len(prompt_list)
        return self._validate_and_add_requests(prompt_list, params_list, priority, lora_list)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        conversations = messages if isinstance(messages[0], list) else [messages]
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            for message in conversation:
                if (
                    not isinstance(message, dict)
                    or "role" not in message
                    or "content" not in message
                ):
                    raise ValueError(f"each message needs 'role' and 'content', got {message!r}")
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
            # The template already wrote any BOS; don't let encode() add another.
            token_ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # -- internals -------------------------------------------------------------------
    @staticmethod
    def _normalize_prompts(prompts: Any) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if not prompts:
                raise ValueError("prompts is empty")
            return list(prompts)
        raise ValueError(
            "prompts must be a string, a {'prompt_token_ids': [...]} dict, or a list of those; "
            f"got {type(prompts).__name__}"
        )

    @staticmethod
    def _per_prompt(name: str, value: Any, n: int, kind: type) -> list[Any]:
        if isinstance(value, kind):
            return [value] * n
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries but there are {n} prompts")
            for v in value:
                if not isinstance(v, kind):
                    raise ValueError(
                        f"{name} entries must be {kind.__name__}, got {type(v).__name__}"
                    )
            return list(value)
        raise ValueError(
            f"{name} must be {kind.__name__} or a list of them, got {type(value).__name__}"
        )

    def _validate_and_add_requests(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        priority: list[int] | None,
        lora_requests: list[LoRARequest | None] | None = None,
    ) -> list[str]:
        added: list[str] = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                sp = sp.clone()
                # LLM returns each request once, when it is complete.
                sp.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = str(next(self.request_counter))
                internal_id = self.llm_engine.add_request(
                    request_id,
                    prompt,
                    sp,
                    priority=priority[i] if priority else 0,
                    lora_request=lora_requests[i] if lora_requests else None,
                )
                added.append(internal_id)
        except Exception:
            # One bad prompt rejects the whole batch; leave nothing queued.
            self.llm_engine.abort_request(added, internal=True)
            raise
        return added

    def _run_engine(self, total: int, use_tqdm: bool) -> list[RequestOutput]:
        pbar = tqdm(total=total, desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        finished: list[RequestOutput] = []
        try:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        finished.append(output)
                        pbar.update(1)
        except BaseException:
            # Interrupted (Ctrl-C, engine error): abort what is left so no
            # request keeps its KV blocks.
            remaining = list(self.llm_engine.output_processor.request_states)
            self.llm_engine.abort_request(remaining, internal=True)
            raise
        finally:
            pbar.close()
        return sorted(finished, key=lambda o: int(o.request_id))

    def shutdown(self) -> None:
        self.llm_engine.shutdown()
