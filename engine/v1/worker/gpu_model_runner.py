"""GPUModelRunner: one SchedulerOutput in, one ModelRunnerOutput out.

vLLM twin: ``vllm/v1/worker/gpu_model_runner.py`` (``GPUModelRunner``:
``_update_states``, ``_prepare_inputs``, ``execute_model``, ``sample_tokens``,
``initialize_kv_cache``). Device-agnostic despite the name, as in vLLM's CPU
runner which subclasses it.

Read it for one step of the worker:
  1. ``_update_states`` -- apply the scheduler's deltas to the persistent
     batch: drop finished and unscheduled (e.g. preempted) requests, append
     new block ids (or replace them for a request resumed after preemption),
     add new and returning requests into the freed rows, condense, let the
     attention backend reorder the rows (``_may_reorder_batch``: decodes
     first when its builder sets ``reorder_batch_threshold``), and hand the
     step's row changes to the logits processors (``refresh_metadata``);
  2. ``_prepare_inputs`` -- with numpy, flatten every scheduled token of every
     request into one batch: ``input_ids``, ``positions``, ``query_start_loc``,
     ``seq_lens``, ``slot_mapping``, then one copy each to the device;
  3. ``execute_model`` -- build attention metadata, run the model under the
     forward context, keep only the hidden state of each request's last
     scheduled token and turn it into logits;
  4. ``sample_tokens`` -- the sampler picks one token per request; requests
     still in the middle of their prompt (a chunked prefill) throw theirs away.
     Requests that asked for ``prompt_logprobs`` get the logprobs of the prompt
     tokens this step ran (``_get_prompt_logprobs_dict``), sent with their first token.
     Structured outputs (session 06): first ``apply_grammar_bitmask`` sets the
     logits of every token a request's grammar forbids to -inf, in the
     runner and not in a logits processor, as in vLLM.
Sessions: 04 (worker).

Async scheduling (vLLM's default): ``sample_tokens`` does not wait for the
sampled ids. It returns an ``AsyncGPUModelRunnerOutput`` whose host copy
runs on a side stream, leaves a -1 placeholder in each row's token list, and
keeps the ids on the device (``input_batch.prev_sampled_token_ids``); the
next step's ``_prepare_input_ids`` copies them into ``input_ids`` on the
device. The same code runs on the CPU, where the "copy" is free.

Tracing: the runner receives a ``RunnerTrace`` (``engine/tracing/
worker_trace.py``) and calls it at a few points -- the batch laid out, the
forward launched and finished, the tokens sampled; its ``sampler`` part goes
to the ``Sampler``.

CUDA graphs (``capture_model``; ``_prepare_inputs`` asks the
``CudagraphDispatcher`` each step): on CUDA with a
backend that supports them, uniform batches (pure decodes, and with
speculation batches of 1 + k tokens per request) replay a FULL graph captured
at the next capture size; the inputs and the attention
metadata live in persistent buffers whose *contents* change each step, and
padding rows get slot -1 and zero-length requests. Under the default
FULL_AND_PIECEWISE a mixed batch replays the compiled model's piecewise graphs
(attention runs eagerly between them); without compilation it runs eagerly.

The logits processors (``build_logitsprocs``) are built once here and live
in the ``InputBatch``.

Speculative decoding (session 06): a request's drafts follow its last token
in the step's inputs (``_update_spec_token_ids``), the model's head runs on
its last 1 + num_drafts positions (``_calc_spec_decode_metadata``), the
``RejectionSampler`` keeps the accepted drafts plus one token, and the
drafter proposes for the next step (``propose_draft_token_ids``;
``EngineCore`` collects them with ``take_draft_token_ids``): the
``NgramProposer`` from each request's history, or a model
(``DraftModelProposer``, ``EagleProposer``) whose attention layers join the
KV cache here (``get_kv_cache_spec``, ``initialize_kv_cache``). A step where
every request verifies k drafts replays a graph of its own when the attention
builder allows it (``AttentionCGSupport.UNIFORM_BATCH``: Triton, not
FlashInfer); other steps with drafts run eagerly.

Async scheduling with a model drafter (``use_async_spec_decode``): the
drafter runs on this step's device tensors (``_propose_draft_token_ids_
padded``) and its drafts stay there; the next step's ``_update_states``
waits for this step's verified tokens (``_apply_pending_draft_step``),
appends them and corrects the cursor the scheduler sent, which still counts
the rejected drafts, and ``_scatter_draft_token_ids`` copies the drafts into
the inputs on the device.

Simpler than vLLM: no multimodal inputs, pooling or pipeline parallelism; no
CUDA graphs or compilation with LoRA; one attention builder, so
``reorder_batch_threshold`` is its threshold (vLLM takes the smallest over
its attention groups).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from engine.compilation.cuda_graph import new_global_graph_pool
from engine.config import GlassboxConfig
from engine.config.compilation import CompilationMode, CUDAGraphMode
from engine.forward_context import set_forward_context
from engine.model_executor.layers.attention.attention import Attention
from engine.model_executor.model_loader import get_model
from engine.tracing.worker_trace import RunnerTrace
from engine.utils.torch_utils import resolve_dtype
from engine.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from engine.v1.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills
from engine.v1.core.sched.output import GrammarOutput, SchedulerOutput
from engine.v1.cudagraph_dispatcher import BatchDescriptor, CudagraphDispatcher
from engine.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from engine.v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    AsyncModelRunnerOutput,
    DraftTokenIds,
    LogprobsLists,
    LogprobsTensors,
    ModelRunnerOutput,
    SamplerOutput,
)
from engine.v1.sample.logits_processor import LogitsProcessors, build_logitsprocs
from engine.v1.sample.metadata import SamplingMetadata
from engine.v1.sample.rejection_sampler import RejectionSampler
from engine.v1.sample.sampler import Sampler
from engine.v1.spec_decode.draft_model import DraftModelProposer
from engine.v1.spec_decode.eagle import EagleProposer
from engine.v1.spec_decode.llm_base_proposer import (
    DraftInputs,
    PaddedDraftInputs,
    SpecDecodeBaseProposer,
)
from engine.v1.spec_decode.metadata import SpecDecodeMetadata
from engine.v1.spec_decode.ngram_proposer import NgramProposer
from engine.v1.structured_output.utils import apply_grammar_bitmask
from engine.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from engine.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

logger = logging.getLogger(__name__)


@dataclass
class ExecuteModelState:
    """What execute_model hands to sample_tokens (vLLM's two-phase step)."""

    scheduler_output: SchedulerOutput
    logits: torch.Tensor  # [num_reqs, vocab]; with drafts [num_drafts + num_reqs, vocab]
    req_ids: list[str]
    # Rows whose sample is thrown away: their prompt is not fully computed yet.
    discard_rows: list[int]
    spec_decode_metadata: SpecDecodeMetadata | None = None
    # [num_tokens, hidden]: the step's last-layer states, which an EAGLE drafter reads.
    hidden_states: torch.Tensor | None = None
    # [num_reqs] tokens each row ran (from _prepare_inputs), which a model drafter reads.
    num_scheduled_tokens: np.ndarray | None = None


@dataclass
class PreparedInputs:
    """What ``_prepare_inputs`` built for one step (Glassbox's own: vLLM's
    returns the logits indices and spec-decode metadata and keeps the rest
    on the runner). The device buffers hold the inputs; the numpy arrays
    they were copied from stay here for the trace (same values)."""

    common_attn_metadata: CommonAttentionMetadata
    num_tokens: int  # scheduled tokens, before any CUDA-graph padding
    num_scheduled_tokens: np.ndarray  # [num_reqs] per row
    # On the device, [num_reqs]: each request's last token; with drafts, each
    # request's last 1 + num_drafts tokens ([num_drafts + num_reqs]).
    logits_indices: torch.Tensor
    # Rows whose sample is thrown away: their prompt is not fully computed yet.
    discard_rows: list[int]
    cudagraph_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor
    input_ids_np: np.ndarray  # [num_tokens (+ padding)]
    positions_np: np.ndarray
    slot_mapping_np: np.ndarray
    logits_indices_np: np.ndarray  # as logits_indices, on the host
    spec_decode_metadata: SpecDecodeMetadata | None = None


@dataclass
class PendingDraftStep:
    """Async scheduling with a model drafter: the step whose verdict the
    next ``_update_states`` reads (Glassbox's own; vLLM keeps these as
    runner fields: ``prev_num_draft_len``, ``valid_sampled_token_count_cpu``,
    ``_draft_token_ids``)."""

    output: AsyncGPUModelRunnerOutput
    req_ids: list[str]  # the step's rows
    num_computed_tokens: np.ndarray  # [num_reqs] where the step began
    num_scheduled_tokens: np.ndarray  # [num_reqs]
    num_draft_tokens: np.ndarray  # [num_reqs] drafts it verified
    draft_token_ids: torch.Tensor  # [num_reqs, k] on the device: the next step's drafts
    # Their host copy, queued only when sampling reads drafts (penalties).
    draft_token_ids_cpu: torch.Tensor | None = None
    draft_copy_event: torch.cuda.Event | None = None
    applied: bool = False  # its tokens are in the rows (one _update_states did it)

    def __post_init__(self) -> None:
        self.row_of = {req_id: i for i, req_id in enumerate(self.req_ids)}  # its row per request


@dataclass
class DraftCorrection:
    """A row's verdict from the previous step: its true cursor, and how many
    drafts the scheduler may still count as computed (an optimistic cursor
    scheduled before it saw the verdict)."""

    num_computed_tokens: int
    num_rejected: int


class AsyncGPUModelRunnerOutput(AsyncModelRunnerOutput):
    """One step's output while its sampled ids travel to the host.

    Built right after sampling: on CUDA it queues the device->host copies on
    ``async_output_copy_stream`` (after the sampler's kernels, without making
    the host wait) and records ``async_copy_ready_event``; on the CPU the
    tensors already are on the host. ``get_output()`` waits for the event and
    fills in the ``ModelRunnerOutput``: the ids per request, [] for the rows
    whose sample is thrown away (``invalid_req_indices``), and the logprob
    rows of the tokens kept. It also writes each id over the -1 placeholder
    the runner left in that request's output list (``placeholders``: row,
    list, index), so the lists hold real ids again one step later -- what
    penalties read when a request that needs them joins the batch.
    """

    def __init__(
        self,
        model_runner_output: ModelRunnerOutput,
        sampler_output: SamplerOutput,
        invalid_req_indices: list[int],
        async_output_copy_stream: torch.cuda.Stream | None,
        step: int,
        trace: RunnerTrace,
        placeholders: list[tuple[int, list[int], int]],
        vocab_size: int | None = None,
    ) -> None:
        # vocab_size: set when the output is the rejection sampler's ([N, drafts + 1]).
        self._vocab_size = vocab_size
        self._model_runner_output = model_runner_output
        self._invalid_req_indices = invalid_req_indices
        self._placeholders = placeholders
        self._step = step
        self._trace = trace
        # Held until the copy is done, so the device memory is not reused under it.
        self._sampled_token_ids = sampler_output.sampled_token_ids
        self._logprobs_tensors = sampler_output.logprobs_tensors
        self.async_copy_ready_event: torch.cuda.Event | None = None
        self._output: ModelRunnerOutput | None = None
        if async_output_copy_stream is None:
            self.sampled_token_ids_cpu = self._sampled_token_ids
            self._logprobs_tensors_cpu = self._logprobs_tensors
            return
        self.async_copy_ready_event = torch.cuda.Event()
        default_stream = torch.cuda.current_stream()
        with torch.cuda.stream(async_output_copy_stream):
            # The copies start once the sampler's kernels are done.
            async_output_copy_stream.wait_stream(default_stream)
            self.sampled_token_ids_cpu = self._sampled_token_ids.to("cpu", non_blocking=True)
            self._logprobs_tensors_cpu = (
                _logprobs_to_cpu_nonblocking(self._logprobs_tensors)
                if self._logprobs_tensors is not None
                else None
            )
            self.async_copy_ready_event.record()

    def get_output(self) -> ModelRunnerOutput:
        # Built once: with a model drafter under async scheduling the runner
        # reads it first (the next step's _update_states), then EngineCore.
        if self._output is None:
            self._output = self._build_output()
        return self._output

    def _build_output(self) -> ModelRunnerOutput:
        if self.async_copy_ready_event is not None:
            self.async_copy_ready_event.synchronize()
        if self._vocab_size is not None:
            return self._get_spec_decode_output()
        sampled = self.sampled_token_ids_cpu.squeeze(-1).tolist()  # CPU: waits for nothing
        del self._sampled_token_ids, self._logprobs_tensors
        self._trace.sampled(self._step, sampled)
        for row, output_token_ids, index in self._placeholders:
            if index < len(output_token_ids) and output_token_ids[index] == -1:
                output_token_ids[index] = sampled[row]
        invalid = set(self._invalid_req_indices)
        kept_rows = [i for i in range(len(sampled)) if i not in invalid]
        output = self._model_runner_output
        output.sampled_token_ids = [
            [] if i in invalid else [sampled[i]] for i in range(len(sampled))
        ]
        if self._logprobs_tensors_cpu is not None:
            lists = self._logprobs_tensors_cpu.tolists()
            # One logprob row per token actually returned, in request order.
            output.logprobs = LogprobsLists(
                [lists.logprob_token_ids[i] for i in kept_rows],
                [lists.logprobs[i] for i in kept_rows],
                [lists.sampled_token_ranks[i] for i in kept_rows],
            )
        return output

    def _get_spec_decode_output(self) -> ModelRunnerOutput:
        """Speculative decoding: each row holds its accepted drafts and one
        token of the target's own, then -1s."""
        assert self._vocab_size is not None
        del self._sampled_token_ids, self._logprobs_tensors
        # sampler.sampled records what the sampler itself drew (the bonus rows).
        self._trace.sampled(self._step, None)
        parsed = RejectionSampler.parse_output(
            self.sampled_token_ids_cpu,
            self._vocab_size,
            self._invalid_req_indices,
            self._logprobs_tensors_cpu,
        )
        output = self._model_runner_output
        output.sampled_token_ids = parsed.sampled_token_ids
        output.logprobs = parsed.logprobs
        return output


def _logprobs_to_cpu_nonblocking(t: LogprobsTensors) -> LogprobsTensors:
    return LogprobsTensors(*(x.to("cpu", non_blocking=True) for x in t))


class GPUModelRunner(LoRAModelRunnerMixin):
    def __init__(
        self,
        glassbox_config: GlassboxConfig,
        device: torch.device,
        trace: RunnerTrace = RunnerTrace.NULL,
    ) -> None:
        self.glassbox_config = glassbox_config
        self.trace = trace
        self.model_config = glassbox_config.model_config
        self.cache_config = glassbox_config.cache_config
        self.scheduler_config = glassbox_config.scheduler_config
        self.device = device
        self.dtype = resolve_dtype(self.model_config.dtype, device, self.model_config.config_dtype)
        self.block_size = self.cache_config.block_size
        self.max_model_len = self.model_config.max_model_len
        self.max_num_reqs = self.scheduler_config.max_num_seqs
        self.max_num_tokens = self.scheduler_config.max_num_batched_tokens

        # Pinned host staging makes the host->device copies asynchronous.
        self.pin_memory = device.type == "cuda"
        self.requests: dict[str, CachedRequestState] = {}
        # Requests that asked for prompt logprobs and have not finished their
        # prefill: req_id -> top-k width (-1, the whole vocabulary, resolved).
        self.num_prompt_logprobs: dict[str, int] = {}
        self.input_batch = InputBatch(
            max_num_reqs=self.max_num_reqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_tokens,
            device=device,
            pin_memory=self.pin_memory,
            vocab_size=self.model_config.vocab_size,
            block_sizes=[self.block_size],
            kernel_block_sizes=[self.block_size],
            # Built once; the batch keeps them in step with its rows.
            logitsprocs=build_logitsprocs(
                glassbox_config,
                device,
                self.pin_memory,
                custom_logitsprocs=tuple(self.model_config.logits_processors or ()),
            ),
        )
        self.sampler = Sampler(logprobs_mode=self.model_config.logprobs_mode, trace=trace.sampler)
        # Speculative decoding: after each step the drafter proposes tokens
        # for the next; the rejection sampler verifies them there.
        self.speculative_config = glassbox_config.speculative_config
        self.drafter: NgramProposer | SpecDecodeBaseProposer | None = None
        self.rejection_sampler: RejectionSampler | None = None
        if self.speculative_config is not None:
            method = self.speculative_config.method
            if method == "ngram":
                self.drafter = NgramProposer(glassbox_config)
            elif method == "draft_model":
                self.drafter = DraftModelProposer(glassbox_config, device)
            else:
                self.drafter = EagleProposer(glassbox_config, device)
            self.rejection_sampler = RejectionSampler(self.sampler)
        self._draft_token_ids: list[list[int]] | None = None
        # Async scheduling: sampled ids stay on the device for the next step,
        # and their host copy runs on a stream of its own (CUDA only).
        self.use_async_scheduling = bool(self.scheduler_config.async_scheduling)
        # ... and with a model drafter, drafts stay on the device too
        # (GlassboxConfig allows async scheduling with no other drafter).
        self.use_async_spec_decode = self.use_async_scheduling and self.drafter is not None
        self._pending_draft_step: PendingDraftStep | None = None
        self.async_output_copy_stream: torch.cuda.Stream | None = None
        # Recorded after a step's host->device input copies; the next step
        # waits for it before rewriting the pinned buffers they read from.
        self.prepare_inputs_event: torch.cuda.Event | None = None
        if device.type == "cuda" and self.use_async_scheduling:
            self.async_output_copy_stream = torch.cuda.Stream(device)
            self.prepare_inputs_event = torch.cuda.Event()
        self.execute_model_state: ExecuteModelState | None = None
        self.attn_layers: dict[str, Attention] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.attn_metadata_builder = None
        # Set from the builder by initialize_kv_cache; None: never reorder.
        self.reorder_batch_threshold: int | None = None
        self.model: torch.nn.Module | None = None

        # Host staging buffers, reused every step (vLLM keeps pinned CPU
        # tensors plus device twins; numpy views keep the maths readable).
        self.arange_np = np.arange(max(self.max_num_reqs, self.max_num_tokens) + 1, dtype=np.int64)
        # Device buffers with fixed addresses: CUDA graphs replay reads from
        # them, so each step copies its values in rather than making new tensors.
        n = max(self.max_num_tokens, self.max_num_reqs)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(self.max_num_reqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=device)
        self._pinned: dict[int, torch.Tensor] = {}

        compilation_config = glassbox_config.compilation_config
        # A verification step runs 1 + k tokens per request: uniform too.
        self.cudagraph_dispatcher = CudagraphDispatcher(
            compilation_config,
            uniform_decode_query_len=1 + glassbox_config.num_speculative_tokens,
            max_num_tokens=self.max_num_tokens,
            max_num_reqs=self.max_num_reqs,
        )
        # key -> (graph, its output hidden states), filled by capture_model().
        self.cudagraphs: dict[BatchDescriptor, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # The memory pool this engine's graphs share (the compiled pieces' too: the
        # backend reads it while load_model compiles); a new one per engine.
        self.graph_pool = new_global_graph_pool() if device.type == "cuda" else None

    # ------------------------------------------------------------------
    # Set-up
    # ------------------------------------------------------------------
    def load_model(self) -> None:
        start = time.perf_counter()
        self.model = get_model(self.glassbox_config, device=self.device, dtype=self.dtype)
        # Post-load weight preparation, e.g. oneDNN-prepacked linear weights
        # on CPU (vLLM runs this inside its model loader).
        for module in self.model.modules():
            quant_method = getattr(module, "quant_method", None)
            if hasattr(quant_method, "process_weights_after_loading"):
                quant_method.process_weights_after_loading(module)
        if (lora_config := self.glassbox_config.lora_config) is not None:
            self.model = self.load_lora_model(
                self.model, lora_config, self.max_num_tokens, self.device, self.dtype
            )
        self.attn_layers = {
            m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)
        }
        if not self.attn_layers:
            raise ValueError("the model has no Attention layers; nothing to build a KV cache for")
        if isinstance(self.drafter, SpecDecodeBaseProposer):
            self.drafter.load_model(self.model, self.dtype)
        logger.info("model loaded in %.2fs", time.perf_counter() - start)

    def _kv_cache_layers(self) -> dict[str, Attention]:
        """Every attention layer with a KV cache: the target's, then a model
        drafter's (they share one block table)."""
        if isinstance(self.drafter, SpecDecodeBaseProposer):
            return {**self.attn_layers, **self.drafter.attn_layers}
        return self.attn_layers

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return {
            name: layer.get_kv_cache_spec(self.glassbox_config)
            for name, layer in self._kv_cache_layers().items()
        }

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate one KV tensor per attention layer and bind it to the layer."""
        self.kv_caches = []
        layers = self._kv_cache_layers()
        for tensor_spec in kv_cache_config.kv_cache_tensors:
            (layer_name,) = tensor_spec.shared_by
            layer = layers[layer_name]
            shape = layer.attn_backend.get_kv_cache_shape(
                kv_cache_config.num_blocks, self.block_size, layer.num_kv_heads, layer.head_size
            )
            kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.kv_cache = kv_cache
            self.kv_caches.append(kv_cache)
        backend = next(iter(self.attn_layers.values())).attn_backend
        self.attn_backend = backend
        self.attn_metadata_builder = backend.get_builder_cls()(self.block_size, self.device)
        self.calculate_reorder_batch_threshold()
        if isinstance(self.drafter, SpecDecodeBaseProposer):
            self.drafter.initialize_attn_backend()
        support = self.attn_metadata_builder.cudagraph_support
        if support.value < AttentionCGSupport.UNIFORM_BATCH.value:
            # E.g. FlashInfer's graphs replay one-token decodes only.
            self.cudagraph_dispatcher.disable_spec_graphs()
        if self.device.type != "cuda" or not backend.supports_cudagraph:
            # Graphs need CUDA and a backend that never syncs with the host.
            self.cudagraph_dispatcher.mode = CUDAGraphMode.NONE
        else:
            compilation_config = self.glassbox_config.compilation_config
            self.cudagraph_dispatcher.mode = compilation_config.resolve_cudagraph_mode(
                support, backend.get_name()
            )
        if hasattr(self.attn_metadata_builder, "bind_layers"):
            # FlashInfer plans once per step for all layers: it needs their
            # shapes, and one fixed-size wrapper per decode size graphs replay.
            self.attn_metadata_builder.bind_layers(
                self.attn_layers.values(),
                self.dtype,
                [k.num_tokens for k in self.cudagraph_dispatcher.decode_keys()],
            )
        self.trace.initialized(self, kv_cache_config)

    def calculate_reorder_batch_threshold(self) -> None:
        """Take the builder's ``reorder_batch_threshold`` (with one builder,
        the smallest of all that vLLM takes)."""
        assert self.attn_metadata_builder is not None
        self.reorder_batch_threshold = self.attn_metadata_builder.reorder_batch_threshold

    # ------------------------------------------------------------------
    # 1. Apply the scheduler's deltas
    # ------------------------------------------------------------------
    def _update_states(
        self,
        scheduler_output: SchedulerOutput,
        corrections: dict[str, DraftCorrection] | None = None,
    ) -> None:
        """``corrections``: the true cursors of the previous step's rows
        (``_apply_pending_draft_step``; async scheduling with a model drafter)."""
        batch = self.input_batch
        corrections = corrections or {}
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.num_prompt_logprobs.pop(req_id, None)
            batch.remove_request(req_id)
        # Requests not scheduled this step (preempted ones included) leave the
        # batch but keep their state (and seeded generator) in self.requests,
        # so rows 0..n-1 are exactly this step's requests. A request resumed
        # from preemption is re-added below with a fresh block table.
        cached = scheduler_output.scheduled_cached_reqs
        scheduled = scheduler_output.num_scheduled_tokens.keys() - cached.resumed_req_ids
        for req_id in batch.req_id_to_index.keys() - scheduled:
            batch.remove_request(req_id)

        # Every removal comes before the first add: adds refill the freed rows.
        reqs_to_add: list[CachedRequestState] = []
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                mm_features=[],
                sampling_params=params,
                generator=generator,
                block_ids=tuple(list(ids) for ids in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=[],
                lora_request=new.lora_request,
            )
            self.requests[new.req_id] = state
            if params.prompt_logprobs is not None:
                vocab_size = self.model_config.vocab_size
                k = vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs
                self.num_prompt_logprobs[new.req_id] = k
            reqs_to_add.append(state)

        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            fix = corrections.get(req_id)
            if (
                fix is not None
                and req_id not in cached.resumed_req_ids
                and (state.num_computed_tokens == fix.num_computed_tokens + fix.num_rejected)
            ):
                # Scheduled before the scheduler saw the last verdict: its
                # cursor still counts the rejected drafts (vLLM corrects it
                # the same way, in _update_states).
                state.num_computed_tokens = fix.num_computed_tokens
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Recompute from scratch: the old blocks are gone.
                state.block_ids = tuple(list(ids) for ids in new_block_ids or ([],))
            elif new_block_ids:
                for block_ids, new_ids in zip(state.block_ids, new_block_ids):
                    block_ids.extend(new_ids)
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                # Resumed, or not scheduled last step: back into the batch.
                num_output_tokens = cached.num_output_tokens[i]
                if self.use_async_scheduling and num_output_tokens > 0:
                    # Our list may still end in -1 placeholders: take the
                    # scheduler's tokens, which are all known by now.
                    state.output_token_ids = cached.all_token_ids[req_id][-num_output_tokens:]
                reqs_to_add.append(state)
                continue
            if new_block_ids:
                batch.block_table.append_row(new_block_ids[0], row)
            batch.num_computed_tokens_cpu[row] = state.num_computed_tokens

        for state in reqs_to_add:
            batch.add_request(state)
        batch.condense()
        self._may_reorder_batch(scheduler_output)
        if self.drafter is not None:  # no per-row pass on the step without speculation
            self._update_spec_token_ids(scheduler_output.scheduled_spec_decode_tokens)
        # The logits processors follow the rows (swaps included); the sampling
        # metadata is rebuilt (asynchronously) only if the batch changed.
        batch.refresh_metadata()

    def _apply_pending_draft_step(self) -> dict[str, DraftCorrection]:
        """Async scheduling with a model drafter: wait for the previous
        step's verified tokens to reach the host (the device has finished its
        rejection sampling; its drafter may still run), append them to their
        rows, and return each row's true cursor for ``_update_states``. vLLM
        waits at the same point, for the counts only (``_get_valid_sampled_
        token_count``); Glassbox takes the ids too, so no -1 placeholders."""
        pending = self._pending_draft_step
        if pending is None or pending.applied:
            return {}
        pending.applied = True
        batch = self.input_batch
        sampled = pending.output.get_output().sampled_token_ids
        corrections: dict[str, DraftCorrection] = {}
        for i, req_id in enumerate(pending.req_ids):
            tokens = sampled[i]
            if not tokens:  # a prompt chunk
                continue
            row = batch.req_id_to_index[req_id]  # rows are as sample_tokens left them
            for token in tokens:
                self.requests[req_id].output_token_ids.append(token)
                batch.append_token(row, token)
            num_rejected = int(pending.num_draft_tokens[i]) - (len(tokens) - 1)
            computed = int(pending.num_computed_tokens[i] + pending.num_scheduled_tokens[i])
            corrections[req_id] = DraftCorrection(computed - num_rejected, num_rejected)
        return corrections

    def _update_spec_token_ids(self, scheduled_spec_decode_tokens: dict[str, list[int]]) -> None:
        """Put this step's drafts after each row's known tokens (in
        ``token_ids_cpu``, where ``_prepare_inputs`` reads the inputs, and in
        ``spec_token_ids``, which penalties read); rows without drafts drop
        last step's. Differs from vLLM (``InputBatch.update_req_spec_token_ids``,
        called per request before ``condense``): one pass over the final rows,
        after condense and reorder, so no move can carry a stale draft.

        Under async scheduling the drafts are -1 placeholders: the ids are on
        the device (``_scatter_draft_token_ids``); 0 holds their place here,
        and stands in for a draft the drafter never made (a request absent
        from the previous step) -- the target verifies it like any other."""
        batch = self.input_batch
        for row, req_id in enumerate(batch.req_ids):
            drafts = batch.spec_token_ids[row]
            drafts.clear()
            new = scheduled_spec_decode_tokens.get(req_id)
            if new:
                new = [max(token, 0) for token in new]
                drafts.extend(new)
                start = int(batch.num_tokens_no_spec[row])
                batch.token_ids_cpu[row, start : start + len(new)] = new

    def _may_reorder_batch(self, scheduler_output: SchedulerOutput) -> None:
        """Put decodes before prefills if the attention builder asks for it."""
        if self.reorder_batch_threshold is not None:
            reorder_batch_to_split_decodes_and_prefills(
                self.input_batch, scheduler_output, decode_threshold=self.reorder_batch_threshold
            )

    # ------------------------------------------------------------------
    # 2. Flatten the step into device tensors
    # ------------------------------------------------------------------
    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> PreparedInputs:
        batch = self.input_batch
        req_ids = batch.req_ids
        num_reqs = len(req_ids)
        num_scheduled = np.array(
            [scheduler_output.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64
        )
        total = int(num_scheduled.sum())
        # Example: num_scheduled [2, 5, 3] -> req_indices [0 0 1 1 1 1 1 2 2 2]
        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled)
        cu_num_tokens = np.cumsum(num_scheduled)
        # Offset of each token inside its request's chunk: [0 1 0 1 2 3 4 0 1 2]
        offsets = self.arange_np[:total] - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
        num_computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        positions_np = num_computed[req_indices] + offsets
        input_ids_np = batch.token_ids_cpu[req_indices, positions_np]

        query_start_loc_np = np.zeros(num_reqs + 1, dtype=np.int32)
        query_start_loc_np[1:] = cu_num_tokens
        seq_lens_np = (num_computed + num_scheduled).astype(np.int32)
        slot_mapping_np = batch.block_table.compute_slot_mapping(req_indices, positions_np)

        max_query_len = int(num_scheduled.max())
        # CUDA graph choice: a uniform batch (every request one token, or with
        # drafts 1 + k) may be padded to a captured size.
        cudagraph_mode, batch_desc = self.cudagraph_dispatcher.dispatch(
            total, uniform_decode=(total == num_reqs * max_query_len), query_len=max_query_len
        )
        padded, num_rows = batch_desc.num_tokens, num_reqs
        if cudagraph_mode == CUDAGraphMode.FULL:
            assert batch_desc.num_reqs is not None
            num_rows = batch_desc.num_reqs
        # The tokens attention reads: a FULL graph replays attention over its
        # padding rows too; between piecewise graphs attention runs eagerly on
        # the real tokens only.
        num_attn_tokens = padded if cudagraph_mode == CUDAGraphMode.FULL else total
        if padded > total:
            # Padding tokens: id 0 at position 0, written nowhere (slot -1);
            # FULL graphs add padding requests: zero query tokens, zero context.
            pad, pad_rows = padded - total, num_rows - num_reqs
            input_ids_np = np.concatenate([input_ids_np, np.zeros(pad, dtype=input_ids_np.dtype)])
            positions_np = np.concatenate([positions_np, np.zeros(pad, dtype=positions_np.dtype)])
            slot_mapping_np = np.concatenate([slot_mapping_np, np.full(pad, -1, dtype=np.int64)])
            query_start_loc_np = np.concatenate(
                [query_start_loc_np, np.full(pad_rows, total, dtype=np.int32)]
            )
            seq_lens_np = np.concatenate([seq_lens_np, np.zeros(pad_rows, dtype=np.int32)])

        self._copy_to_device(self.input_ids, input_ids_np)
        self._prepare_input_ids(cu_num_tokens)
        self._scatter_draft_token_ids(cu_num_tokens, scheduler_output.scheduled_spec_decode_tokens)
        self._copy_to_device(self.positions, positions_np)
        self._copy_to_device(self.query_start_loc, query_start_loc_np)
        self._copy_to_device(self.seq_lens, seq_lens_np)
        self._copy_to_device(self.slot_mapping, slot_mapping_np)
        batch.block_table.commit_block_table(num_reqs)
        if self.prepare_inputs_event is not None:
            self.prepare_inputs_event.record()
        common = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: num_rows + 1],
            query_start_loc_cpu=torch.from_numpy(query_start_loc_np[: num_reqs + 1]),
            seq_lens=self.seq_lens[:num_rows],
            _seq_lens_cpu=torch.from_numpy(seq_lens_np[:num_reqs]),
            num_reqs=num_rows,
            num_actual_tokens=num_attn_tokens,
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens_np.max()),
            block_table_tensor=batch.block_table.block_table[:num_rows],
            slot_mapping=self.slot_mapping[:num_attn_tokens],
        )
        spec_decode_metadata = None
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        if spec_tokens:
            # Drafts: the logits of each request's last 1 + num_drafts tokens.
            num_draft_tokens = np.array([len(spec_tokens.get(r, ())) for r in req_ids])
            spec_decode_metadata, logits_indices_np = self._calc_spec_decode_metadata(
                num_draft_tokens, cu_num_tokens
            )
            logits_indices = spec_decode_metadata.logits_indices
        else:
            # The logits we need: each request's last scheduled token.
            logits_indices_np = cu_num_tokens - 1
            logits_indices = torch.from_numpy(logits_indices_np).to(self.device, non_blocking=True)
        # A request whose context still stops short of its known tokens is in
        # the middle of its prompt: whatever it samples is discarded.
        discard_rows = [i for i in range(num_reqs) if seq_lens_np[i] < batch.num_tokens_no_spec[i]]
        return PreparedInputs(
            common_attn_metadata=common,
            num_tokens=total,
            num_scheduled_tokens=num_scheduled,
            logits_indices=logits_indices,
            discard_rows=discard_rows,
            cudagraph_mode=cudagraph_mode,
            batch_descriptor=batch_desc,
            input_ids_np=input_ids_np,
            positions_np=positions_np,
            slot_mapping_np=slot_mapping_np,
            logits_indices_np=logits_indices_np,
            spec_decode_metadata=spec_decode_metadata,
        )

    def _calc_spec_decode_metadata(
        self, num_draft_tokens: np.ndarray, cu_num_scheduled_tokens: np.ndarray
    ) -> tuple[SpecDecodeMetadata, np.ndarray]:
        """Where the drafts and their logits rows are (and the logits indices
        on the host, for the trace). Example:
            cu_num_scheduled_tokens [4, 104, 107]   (3 drafts, a prefill, 2 drafts)
            num_draft_tokens        [3, 0, 2]
            logits_indices          [0 1 2 3 | 103 | 104 105 106]
            target_logits_indices   [0 1 2 5 6]   (rows that judge a draft)
            bonus_logits_indices    [3 4 7]       (each request's last row)
        """
        num_sampled_tokens = num_draft_tokens + 1
        cu_num_sampled_tokens = np.cumsum(num_sampled_tokens)
        # Each request's last num_sampled positions: [0 1 2 3 | 103 | 104 105 106].
        first_sampled = np.repeat(cu_num_scheduled_tokens - num_sampled_tokens, num_sampled_tokens)
        offsets = self.arange_np[: cu_num_sampled_tokens[-1]] - np.repeat(
            cu_num_sampled_tokens - num_sampled_tokens, num_sampled_tokens
        )
        logits_indices_np = first_sampled + offsets
        bonus_logits_indices = cu_num_sampled_tokens - 1
        # Target rows: each request's rows but its last.
        cu_num_draft_tokens = np.cumsum(num_draft_tokens)
        target_logits_indices = np.repeat(
            cu_num_sampled_tokens - num_sampled_tokens, num_draft_tokens
        ) + (
            self.arange_np[: cu_num_draft_tokens[-1]]
            - np.repeat(cu_num_draft_tokens - num_draft_tokens, num_draft_tokens)
        )

        def to_device(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a.astype(np.int32)).to(self.device, non_blocking=True)

        logits_indices = to_device(logits_indices_np)
        target = to_device(target_logits_indices)
        # The draft ids as the model read them: the input after each target row's position.
        draft_token_ids = self.input_ids[logits_indices.long()][target.long() + 1]
        metadata = SpecDecodeMetadata(
            draft_token_ids=draft_token_ids.to(torch.int32),
            num_draft_tokens=num_draft_tokens.tolist(),
            cu_num_draft_tokens=to_device(cu_num_draft_tokens),
            cu_num_sampled_tokens=to_device(cu_num_sampled_tokens),
            target_logits_indices=target,
            bonus_logits_indices=to_device(bonus_logits_indices),
            logits_indices=logits_indices,
        )
        return metadata, logits_indices_np

    def _prepare_input_ids(self, cu_num_tokens: np.ndarray) -> None:
        """Async scheduling: the last token of each request that sampled in the
        previous step is a -1 placeholder on the host; take its id from that
        step's sampled ids, still on the device (no wait for the host copy).

        Example: rows [A, B] with cu_num_tokens [1, 6] (A decodes; B is a new
        prompt of 5), A was row 3 of the last step: input_ids[0] =
        prev_sampled_token_ids[3].
        """
        batch = self.input_batch
        prev_sampled = batch.prev_sampled_token_ids
        if prev_sampled is None or not batch.prev_req_id_to_index:
            return
        cur_indices: list[int] = []  # flat index of the request's last token
        prev_indices: list[int] = []  # its row in the previous step
        for row, req_id in enumerate(batch.req_ids):
            prev_row = batch.prev_req_id_to_index.get(req_id)
            if prev_row is not None:
                cur_indices.append(int(cu_num_tokens[row]) - 1)
                prev_indices.append(prev_row)
        if not cur_indices:
            return
        n = len(cur_indices)
        if cur_indices == prev_indices == list(range(n)):
            # The steady decode batch: same rows, same order -- one slice copy.
            self.input_ids[:n].copy_(prev_sampled[:n, 0], non_blocking=True)
            return
        cur = torch.tensor(cur_indices, dtype=torch.long).to(self.device, non_blocking=True)
        prev = torch.tensor(prev_indices, dtype=torch.long).to(self.device, non_blocking=True)
        self.input_ids.index_copy_(0, cur, prev_sampled[prev, 0].to(self.input_ids.dtype))

    def _scatter_draft_token_ids(
        self, cu_num_tokens: np.ndarray, scheduled_spec_decode_tokens: dict[str, list[int]]
    ) -> None:
        """Async scheduling with a model drafter: each request's drafts are
        the previous step's proposals, still on the device; copy them into
        the positions after its last token (vLLM does it at the end of its
        ``_prepare_input_ids``).

        Example: rows [A, B], A has 2 drafts, cu_num_tokens [3, 5], A was row
        1 of the previous step: input_ids[1:3] = draft_token_ids[1, :2].
        """
        pending = self._pending_draft_step
        if pending is None or not scheduled_spec_decode_tokens:
            return
        prev_rows = pending.row_of
        k = pending.draft_token_ids.shape[1]
        dst: list[int] = []  # flat input positions
        src: list[int] = []  # flat index into draft_token_ids
        for row, req_id in enumerate(self.input_batch.req_ids):
            n = len(scheduled_spec_decode_tokens.get(req_id, ()))
            prev = prev_rows.get(req_id)
            if n == 0 or prev is None:
                continue
            last = int(cu_num_tokens[row]) - 1
            dst.extend(range(last - n + 1, last + 1))
            src.extend(range(prev * k, prev * k + n))
        if not dst:
            return
        dst_t = torch.tensor(dst, dtype=torch.long).to(self.device, non_blocking=True)
        src_t = torch.tensor(src, dtype=torch.long).to(self.device, non_blocking=True)
        drafts = pending.draft_token_ids.flatten()[src_t]
        self.input_ids.index_copy_(0, dst_t, drafts.to(self.input_ids.dtype))

    def _copy_to_device(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """numpy -> persistent device buffer. On CUDA through a persistent
        pinned host twin, so the copy is asynchronous (the previous step's
        copy has finished: sampling synchronised, or with async scheduling
        ``prepare_inputs_event`` was waited for)."""
        host = torch.from_numpy(src)
        if self.pin_memory:
            pinned = self._pinned.get(id(dst))
            if pinned is None:
                pinned = self._pinned[id(dst)] = torch.empty(
                    dst.shape, dtype=dst.dtype, pin_memory=True
                )
            pinned[: len(src)].copy_(host)
            host = pinned[: len(src)]
        dst[: len(src)].copy_(host, non_blocking=True)

    # ------------------------------------------------------------------
    # 3. Forward
    # ------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        # Before any row moves: the previous step's verified tokens into its
        # rows (its trace events are that step's, so before step_started).
        corrections = self._apply_pending_draft_step()
        self.trace.step_started(scheduler_output.step)
        if self.prepare_inputs_event is not None:
            # The last step's input copies must be done before their pinned
            # sources are rewritten (they usually are long done).
            self.prepare_inputs_event.synchronize()
        self._update_states(scheduler_output, corrections)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        assert self.model is not None and self.attn_metadata_builder is not None
        inputs = self._prepare_inputs(scheduler_output)
        if self.lora_manager is not None:
            lora_requests = [self.requests[r].lora_request for r in self.input_batch.req_ids]
            self.set_active_loras(lora_requests, inputs.num_scheduled_tokens)
        num_tokens = inputs.num_tokens
        metadata = self.attn_metadata_builder.build(inputs.common_attn_metadata)
        self.trace.forward_started(self.device)
        if inputs.cudagraph_mode == CUDAGraphMode.FULL:
            # Replay: the graph reads this step's values from the buffers.
            graph, graph_hidden = self.cudagraphs[inputs.batch_descriptor]
            graph.replay()
            hidden_states = graph_hidden[:num_tokens]
        else:
            # Every layer reads the same metadata (one KV cache group).
            attn_metadata = {name: metadata for name in self.attn_layers}
            # PIECEWISE: the pieces' graphs replay on the padded token count.
            n = inputs.batch_descriptor.num_tokens
            with set_forward_context(
                attn_metadata,
                self.glassbox_config,
                cudagraph_runtime_mode=inputs.cudagraph_mode,
                batch_descriptor=inputs.batch_descriptor,
                step=scheduler_output.step,
            ):
                hidden_states = self.model(self.input_ids[:n], self.positions[:n])[:num_tokens]
        logits = self.model.compute_logits(hidden_states[inputs.logits_indices])
        self.trace.forward_done(scheduler_output.step, num_tokens, logits)
        # After the launch: on a GPU the host describes the batch while the device runs it.
        self.trace.batch(self, scheduler_output, inputs)
        self.execute_model_state = ExecuteModelState(
            scheduler_output,
            logits,
            list(self.input_batch.req_ids),
            inputs.discard_rows,
            inputs.spec_decode_metadata,
            hidden_states,
            inputs.num_scheduled_tokens,
        )
        return None

    # ------------------------------------------------------------------
    # 4. Sample
    # ------------------------------------------------------------------
    @torch.inference_mode()
    def sample_tokens(
        self, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput | AsyncGPUModelRunnerOutput:
        """Sample one token per row. Synchronous: wait for the ids and return
        the ``ModelRunnerOutput``. Async scheduling: return at once with an
        ``AsyncGPUModelRunnerOutput``; the ids stay on the device for the next
        step and each row that sampled gets a -1 placeholder. Structured
        outputs: ``grammar_output``'s bitmask masks the constrained rows first."""
        state = self.execute_model_state
        if state is None:
            raise RuntimeError("sample_tokens() called without a preceding execute_model()")
        self.execute_model_state = None
        batch = self.input_batch
        reqs = [self.requests[r] for r in state.req_ids]
        if self.use_async_scheduling and self._sampling_reads_output_token_ids():
            batch.update_async_output_token_ids()
            self._update_async_spec_token_ids()
        self.trace.sampling(state.req_ids, state.discard_rows)
        if grammar_output is not None:
            num_drafts = {
                r: len(t) for r, t in state.scheduler_output.scheduled_spec_decode_tokens.items()
            }
            self.trace.grammar_mask_started(state.logits, state.req_ids, grammar_output, num_drafts)
            apply_grammar_bitmask(grammar_output, state.req_ids, num_drafts, state.logits)
            self.trace.grammar_masked(state.logits)
        # A thrown-away sample must not advance its row's seeded generator
        # (vLLM rewinds it): a seed gives the same tokens however the prompt
        # was chunked, and with async scheduling on or off.
        saved_generators = {
            row: gen.get_state()
            for row in state.discard_rows
            if (gen := batch.generators.get(row)) is not None
        }
        spec_decode_metadata = state.spec_decode_metadata
        if spec_decode_metadata is None:
            sampler_output = self.sampler(state.logits, batch.sampling_metadata)
        else:
            assert self.rejection_sampler is not None
            # draft_probs None: the n-gram drafts are certain (a point mass each).
            sampler_output = self.rejection_sampler(
                spec_decode_metadata, None, state.logits, batch.sampling_metadata
            )
        for row, generator_state in saved_generators.items():
            batch.generators[row].set_state(generator_state)
        discard = set(state.discard_rows)
        kept_rows = [i for i in range(len(reqs)) if i not in discard]
        # Where each kept row's -1 placeholder goes (async scheduling).
        placeholders = [
            (i, reqs[i].output_token_ids, len(reqs[i].output_token_ids)) for i in kept_rows
        ]
        output = AsyncGPUModelRunnerOutput(
            ModelRunnerOutput(
                req_ids=state.req_ids,
                req_id_to_index={r: i for i, r in enumerate(state.req_ids)},
                prompt_logprobs_dict=self._get_prompt_logprobs_dict(state),
            ),
            sampler_output,
            invalid_req_indices=state.discard_rows,
            async_output_copy_stream=self.async_output_copy_stream,
            step=state.scheduler_output.step,
            trace=self.trace,
            # With a model drafter the next step appends the real ids instead.
            placeholders=placeholders if self.use_async_scheduling else [],
            vocab_size=self.model_config.vocab_size if spec_decode_metadata else None,
        )
        if self.use_async_spec_decode:
            # Drafts for the next step, from device tensors only.
            self._pending_draft_step = self._propose_draft_token_ids_padded(
                state, output, sampler_output.sampled_token_ids
            )
            return output
        if not self.use_async_scheduling:
            result = output.get_output()  # waits for the device
            for i in kept_rows:
                # One token, or with drafts the accepted ones plus one.
                for token in result.sampled_token_ids[i]:
                    reqs[i].output_token_ids.append(token)
                    batch.append_token(i, token)
            if self.drafter is not None:
                self._draft_token_ids = self.propose_draft_token_ids(
                    result.sampled_token_ids, state
                )
                self.trace.drafts_proposed(state.req_ids, self._draft_token_ids)
            return result
        for i in kept_rows:
            reqs[i].output_token_ids.append(-1)
            batch.append_token(i, -1)
        batch.prev_sampled_token_ids = sampler_output.sampled_token_ids
        batch.prev_req_id_to_index = {state.req_ids[i]: i for i in kept_rows}
        batch.set_async_sampled_token_ids(
            output.sampled_token_ids_cpu, output.async_copy_ready_event
        )
        return output

    def _get_prompt_logprobs_dict(
        self, state: ExecuteModelState
    ) -> dict[str, LogprobsLists | None]:
        """Logprobs of the prompt tokens this step ran, for the requests that
        asked (``num_prompt_logprobs``). The hidden state at prompt position i
        predicts token i + 1, so a prompt of P tokens has P - 1 rows, filled
        chunk by chunk into host tensors; a request's rows are returned in the
        step that ends its prefill, beside its first sampled token. They are
        the model's raw distribution: no temperature, penalty or mask."""
        if not self.num_prompt_logprobs:
            return {}
        assert state.hidden_states is not None and state.num_scheduled_tokens is not None
        # Where each row's tokens start in the step's flattened batch.
        row_starts = np.concatenate(([0], np.cumsum(state.num_scheduled_tokens)[:-1]))
        row_of = {req_id: i for i, req_id in enumerate(state.req_ids)}
        completed: dict[str, LogprobsLists | None] = {}
        # A copy: requests whose prefill ends here leave the dict in the loop.
        for req_id, num_prompt_logprobs in list(self.num_prompt_logprobs.items()):
            row = row_of.get(req_id)
            if row is None:
                continue  # not scheduled this step (e.g. preempted)
            request = self.requests[req_id]
            num_prompt_tokens = request.num_prompt_tokens
            if request.in_progress_prompt_logprobs_cpu is None:
                request.in_progress_prompt_logprobs_cpu = LogprobsTensors.empty_cpu(
                    num_prompt_tokens - 1, num_prompt_logprobs + 1
                )
            rows = request.in_progress_prompt_logprobs_cpu
            start = request.num_computed_tokens  # first position this step ran
            num_tokens = int(state.num_scheduled_tokens[row])
            # Positions start .. P - 2 have a prompt token after them.
            num_logits = min(num_tokens, num_prompt_tokens - 1 - start)
            done = start + num_tokens >= num_prompt_tokens
            self.trace.prompt_logprobs(req_id, start, num_logits, num_prompt_logprobs, done)
            if num_logits > 0:
                offset = int(row_starts[row])
                logits = self.model.compute_logits(
                    state.hidden_states[offset : offset + num_logits]
                )
                targets = torch.tensor(
                    request.prompt_token_ids[start + 1 : start + 1 + num_logits],
                    device=logits.device,
                )
                logprobs = self.sampler.compute_logprobs(logits)
                chunk = self.sampler.gather_logprobs(logprobs, num_prompt_logprobs, targets)
                rows_now = slice(start, start + num_logits)
                rows.logprob_token_ids[rows_now].copy_(chunk.logprob_token_ids)
                rows.logprobs[rows_now].copy_(chunk.logprobs)
                rows.selected_token_ranks[rows_now].copy_(chunk.selected_token_ranks)
            if done:  # the rows go out with the first sampled token
                completed[req_id] = rows.tolists()
                request.in_progress_prompt_logprobs_cpu = None
                del self.num_prompt_logprobs[req_id]
        return completed

    # ------------------------------------------------------------------
    # 5. Speculative decoding: drafts for the next step
    # ------------------------------------------------------------------
    def propose_draft_token_ids(
        self, sampled_token_ids: list[list[int]], state: ExecuteModelState
    ) -> list[list[int]]:
        """Drafts per row ([] for rows that sampled nothing): n-gram from each
        request's history, now ending in this step's tokens; a model from the
        tokens this step verified (and, for EAGLE, the target's hidden states)."""
        assert self.drafter is not None
        batch = self.input_batch
        if isinstance(self.drafter, NgramProposer):
            return self.drafter.propose(
                sampled_token_ids, batch.num_tokens_no_spec, batch.token_ids_cpu
            )
        num_scheduled = state.num_scheduled_tokens
        assert num_scheduled is not None
        return self.drafter.propose(
            DraftInputs(
                sampled_token_ids,
                batch.token_ids_cpu,
                batch.num_tokens_no_spec,
                batch.num_computed_tokens_cpu,
                num_scheduled,
                np.cumsum(num_scheduled),
                batch.block_table,
                state.hidden_states,
            )
        )

    def _propose_draft_token_ids_padded(
        self,
        state: ExecuteModelState,
        output: AsyncGPUModelRunnerOutput,
        sampled_token_ids: torch.Tensor,
    ) -> PendingDraftStep:
        """Async scheduling: the drafter runs on this step's device tensors
        (``SpecDecodeBaseProposer.propose_padded``) while the host moves on;
        the next step reads the verdict and the drafts from what this returns."""
        assert isinstance(self.drafter, SpecDecodeBaseProposer)
        batch = self.input_batch
        sched = state.scheduler_output
        num_reqs = len(state.req_ids)
        num_scheduled = state.num_scheduled_tokens
        assert num_scheduled is not None
        num_computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        num_drafts = np.array(
            [len(sched.scheduled_spec_decode_tokens.get(r, ())) for r in state.req_ids],
            dtype=np.int64,
        )
        discard = np.zeros(num_reqs, dtype=bool)
        discard[state.discard_rows] = True
        # A prompt chunk's next token is the prompt's own (0 for other rows).
        seq_lens = num_computed + num_scheduled
        next_prompt_token = batch.token_ids_cpu[
            np.arange(num_reqs), np.minimum(seq_lens, self.max_model_len - 1)
        ]
        backup = np.where(discard, next_prompt_token, 0)
        drafts = self.drafter.propose_padded(
            PaddedDraftInputs(
                target_token_ids=self.input_ids[: int(num_scheduled.sum())],
                sampled_token_ids=sampled_token_ids,
                num_computed_tokens=num_computed,
                num_scheduled_tokens=num_scheduled,
                num_draft_tokens=num_drafts,
                discard_mask=discard,
                backup_next_token_ids=backup,
                block_table=batch.block_table,
                vocab_size=self.model_config.vocab_size,
                target_hidden_states=state.hidden_states,
            )
        )
        pending = PendingDraftStep(
            output, list(state.req_ids), num_computed, num_scheduled, num_drafts, drafts
        )
        if self._sampling_reads_output_token_ids():
            # Penalties read the drafts as if generated: queue their host copy now.
            pending.draft_token_ids_cpu, pending.draft_copy_event = self._copy_to_host_async(drafts)
        self.trace.drafts_proposed(state.req_ids, drafts, np.flatnonzero(~discard).tolist())
        return pending

    def _copy_to_host_async(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A device->host copy on the output copy stream, and its event (None on the CPU)."""
        stream = self.async_output_copy_stream
        if stream is None:
            return t, None
        event = torch.cuda.Event()
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream())
            cpu = t.to("cpu", non_blocking=True)
            event.record()
        return cpu, event

    def _update_async_spec_token_ids(self) -> None:
        """The rows' drafts as ids, for penalties (vLLM's
        ``InputBatch.update_async_spec_token_ids``): wait for the host copy of
        the previous step's proposals."""
        pending = self._pending_draft_step
        if pending is None or pending.draft_token_ids_cpu is None:
            return
        if pending.draft_copy_event is not None:
            pending.draft_copy_event.synchronize()
        proposals = pending.draft_token_ids_cpu.tolist()
        prev_rows = pending.row_of
        batch = self.input_batch
        for row, req_id in enumerate(batch.req_ids):
            drafts = batch.spec_token_ids[row]
            prev = prev_rows.get(req_id)
            if drafts and prev is not None:
                drafts[:] = proposals[prev][: len(drafts)]

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts of the last step, once (EngineCore.post_step asks)."""
        if self._draft_token_ids is None:
            return None
        draft_token_ids, self._draft_token_ids = self._draft_token_ids, None
        return DraftTokenIds(list(self.input_batch.req_ids), draft_token_ids)

    def _sampling_reads_output_token_ids(self) -> bool:
        """Whether sampling reads the values of output tokens (penalties, bad
        words, custom processors) -- min-tokens needs only their number."""
        batch = self.input_batch
        return (
            not batch.no_penalties
            or bool(batch.bad_words_token_ids)
            or bool(self.model_config.logits_processors)
        )

    # ------------------------------------------------------------------
    # CUDA graphs
    # ------------------------------------------------------------------
    @torch.inference_mode()
    def capture_model(self) -> int:
        """Capture the dispatcher's graphs, largest first (smaller graphs reuse
        the memory of larger ones in the shared pool). Returns how many keys
        were captured.

        FULL keys: the model runs on a dummy uniform batch: every row is a
        request of q query tokens (1, or 1 + k with drafts) at positions
        0 .. q-1 whose slots are -1 (nothing written) and whose q-token
        context is the null block, block 0. A warm-up eager run first makes
        any lazily allocated workspace exist, so the graph records no
        allocation.
        PIECEWISE keys: the compiled model runs n dummy tokens with the
        runtime mode PIECEWISE; each piece's CUDAGraphWrapper captures its
        graph, and attention (no metadata: it writes zeros) runs between them.
        """
        keys = self.cudagraph_dispatcher.decode_keys()
        piecewise = self.cudagraph_dispatcher.piecewise_keys()
        if not (keys or piecewise) or self.device.type != "cuda" or self.model is None:
            return 0
        assert self.attn_metadata_builder is not None
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = self.graph_pool
        self.input_batch.block_table.block_table.zero_()
        # One bar over both kinds of key, as vLLM shows its capture.
        progress = tqdm(total=len(keys) + len(piecewise), desc="Capturing CUDA graphs")
        for key in sorted(keys, key=lambda k: (-k.num_tokens, -(k.num_reqs or 0))):
            n, r = key.num_tokens, key.num_reqs or key.num_tokens
            q = n // r  # query tokens per request
            self.input_ids[:n].zero_()
            self.positions[:n].copy_(torch.arange(q).repeat(r))
            self.slot_mapping[:n].fill_(-1)
            query_start_loc = torch.arange(r + 1, dtype=torch.int32) * q
            self.query_start_loc[: r + 1].copy_(query_start_loc)
            self.seq_lens[:r].fill_(q)
            common = CommonAttentionMetadata(
                query_start_loc=self.query_start_loc[: r + 1],
                query_start_loc_cpu=query_start_loc,
                seq_lens=self.seq_lens[:r],
                _seq_lens_cpu=torch.full((r,), q, dtype=torch.int32),
                num_reqs=r,
                num_actual_tokens=n,
                max_query_len=q,
                max_seq_len=q,
                block_table_tensor=self.input_batch.block_table.block_table[:r],
                slot_mapping=self.slot_mapping[:n],
            )
            metadata = self.attn_metadata_builder.build(common)
            attn_metadata = {name: metadata for name in self.attn_layers}
            with set_forward_context(
                attn_metadata, self.glassbox_config, cudagraph_runtime_mode=CUDAGraphMode.FULL
            ):
                self.model(self.input_ids[:n], self.positions[:n])  # warm-up
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self.model(self.input_ids[:n], self.positions[:n])
            self.cudagraphs[key] = (graph, hidden)
            self.cudagraph_dispatcher.captured.add(key)
            progress.update()
        self.input_ids.zero_()
        self.positions.zero_()
        for key in sorted(piecewise, key=lambda k: -k.num_tokens):
            n = key.num_tokens
            self._dummy_run(n)  # warm-up, eager
            torch.cuda.synchronize(self.device)
            with set_forward_context(
                None,
                self.glassbox_config,
                cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
                batch_descriptor=key,
            ):
                self.model(self.input_ids[:n], self.positions[:n])
            self.cudagraph_dispatcher.captured.add(key)
            progress.update()
        progress.close()
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        memory = free_before - torch.cuda.mem_get_info(self.device)[0]
        # Tokens per key; verification graphs hold 1 + k per request.
        sizes = [k.num_tokens for k in keys + piecewise]
        logger.info(
            "captured %d CUDA graphs (sizes %s) in %.1fs, %.2f GiB",
            len(sizes),
            sizes,
            seconds,
            memory / 2**30,
        )
        mode = self.cudagraph_dispatcher.mode.name
        self.trace.cudagraphs_captured(mode, sizes, seconds, memory)
        return len(sizes)

    # ------------------------------------------------------------------
    # Profiling and warm-up
    # ------------------------------------------------------------------
    def _dummy_run(self, num_tokens: int) -> torch.Tensor:
        """The model on ``num_tokens`` dummy tokens with no attention metadata
        (attention writes no KV and returns zeros)."""
        assert self.model is not None
        with set_forward_context(None, self.glassbox_config):
            return self.model(self.input_ids[:num_tokens], self.positions[:num_tokens])

    @torch.inference_mode()
    def warm_up_model(self) -> None:
        """Compile before the first request: a dummy batch of the largest size
        (Dynamo traces there, with the token count symbolic; on CUDA the
        profiling run already did), then each ``compile_sizes`` entry (each
        gets code of its own). Nothing to do for an eager model."""
        compilation_config = self.glassbox_config.compilation_config
        if compilation_config.mode == CompilationMode.NONE:
            return
        start = time.perf_counter()
        for n in [self.max_num_tokens, *(compilation_config.compile_sizes or [])]:
            if n <= self.max_num_tokens:
                self._dummy_run(n)
        seconds = time.perf_counter() - start
        logger.info("model compiled and warmed up in %.1fs", seconds)
        self.trace.model_compiled(self.model, compilation_config, seconds)

    def _dummy_sampler_run(self, hidden_states: torch.Tensor) -> None:
        """The sampler at its most expensive on one row per possible request:
        temperature, top-k and top-p on every row ([N, V] float32 logits,
        probabilities and top-p's sort), then again with a seeded row (the
        torch path FlashInfer's sampler falls back to); with drafts, the
        rejection sampler on k drafts a request (vLLM's gives each one draft,
        less than a real step). Random hidden states, so no row is all-inf or
        NaN."""
        assert self.model is not None
        k = self.glassbox_config.num_speculative_tokens
        # [R * (1 + k), V]: with drafts a request scores 1 + k positions, not 1.
        logits = self.model.compute_logits(torch.rand_like(hidden_states))
        num_reqs, vocab_size = max(1, logits.shape[0] // (1 + k)), logits.shape[1]

        def per_row(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.full((num_reqs,), value, dtype=dtype, device=self.device)

        metadata = SamplingMetadata(
            temperature=per_row(0.5),
            all_greedy=False,
            all_random=False,  # the greedy argmax runs too
            top_p=per_row(0.9),
            top_k=per_row(vocab_size - 1, torch.int32),
            generators={},
            max_num_logprobs=None,
            no_penalties=True,
            prompt_token_ids=None,
            frequency_penalties=per_row(0.1),
            presence_penalties=per_row(0.1),
            repetition_penalties=per_row(0.1),
            output_token_ids=[[] for _ in range(num_reqs)],
            allowed_token_ids_mask=None,
            bad_words_token_ids={},
            logitsprocs=LogitsProcessors(),
            spec_token_ids=[[] for _ in range(num_reqs)],
        )
        try:
            self.sampler(logits[:num_reqs], metadata)
            if self.sampler.logprobs_mode not in ("processed_logits", "processed_logprobs"):
                seeded = {0: torch.Generator(device=self.device).manual_seed(0)}
                self.sampler(logits[:num_reqs], dataclasses.replace(metadata, generators=seeded))
            if self.rejection_sampler is not None and logits.shape[0] >= num_reqs * (1 + k):
                drafts = SpecDecodeMetadata.make_dummy([[0] * k] * num_reqs, self.device)
                target_logits = logits[: num_reqs * (1 + k)]
                self.rejection_sampler(drafts, None, target_logits, metadata)
        except torch.OutOfMemoryError as exc:
            raise RuntimeError(
                f"out of memory warming up the sampler with {num_reqs} dummy requests; "
                "lower max_num_seqs or gpu_memory_utilization"
            ) from exc

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward over max_num_batched_tokens dummy tokens, no KV cache, then
        the LM head and the sampler on a row per possible request, to measure
        peak memory before sizing the KV cache."""
        assert self.model is not None
        n = self.max_num_tokens
        hidden = self._dummy_run(n)
        num_logits = self.max_num_reqs * (1 + self.glassbox_config.num_speculative_tokens)
        self._dummy_sampler_run(hidden[: min(n, num_logits)])
        if isinstance(self.drafter, SpecDecodeBaseProposer):
            self.drafter.dummy_run(n)
