"""The trace events: one typed struct per event kind.

vLLM twin: none (vLLM exports OpenTelemetry spans per request; Glassbox
records every scheduling decision, KV block move and sampling step so that a
run can be replayed). Read it for what a trace holds: each class below is one
``kind`` of line in a trace file, with its fields, their units and what the
replay model does with it. The writer (``tracer.py``), the reader
(``reader.py``), the replay model, the Perfetto export and the TUI all use
these classes; ``docs/trace_format.md`` is generated from them.

Every event carries ``ts`` (wall-clock ns), ``pid``, ``seq`` (the writer's
order within its process) and, where one is known, ``step``. In the file the
``kind`` comes first: ``{"kind": "sched.queued", "ts": ..., "pid": ..., ...}``.
Fields whose value is their default (``None``, ``False``, an empty list) are
left out of the line and filled in again when it is read.

Adding a kind: write the class here with a docstring (who writes it, what the
replay does) and a ``doc`` on every field whose name does not explain it (the
rule is in ``scripts/gen_trace_format.py``), add it to its section of
``EVENT_SECTIONS``, build it in a trace object (``core_trace.py``, ...), then
run ``python scripts/gen_trace_format.py`` (a test fails while the page differs).

Sessions: all (every notebook and the TUI read these).
"""

from typing import Annotated, Any, ClassVar

import msgspec

# Version of the format: "major.minor". A reader refuses a trace of a newer
# major version (a field renamed or re-defined, a kind whose meaning changed);
# a newer minor version only adds kinds or fields, which an older reader skips.
TRACE_FORMAT_VERSION = "1.13"


def doc(text: str) -> msgspec.Meta:
    """A field's description, shown in docs/trace_format.md."""
    return msgspec.Meta(description=text)


class TraceEvent(msgspec.Struct, tag_field="kind", omit_defaults=True, gc=False):
    """The base of every event class: the fields every line has. ``gc=False``:
    an event refers to no other event (no cycles), so the garbage collector
    need not track the thousands a trace holds (it still tracks their lists
    and dicts)."""

    kind: ClassVar[str] = ""  # the tag, e.g. "sched.queued" (set below for every class)
    # Which process section of docs/trace_format.md lists it (set below).
    section: ClassVar[str] = ""
    ts: Annotated[
        int, doc("wall-clock time, ns (`time.time_ns()`), comparable across processes")
    ] = 0
    pid: Annotated[int, doc("the process that wrote it")] = 0
    seq: Annotated[
        int,
        doc("the writer's sequence number, from 1 (the header is 0): exact order within a process"),
    ] = 0
    step: Annotated[
        int | None,
        doc(
            "the engine step it belongs to; absent before the first step, and in a process "
            "that never saw one"
        ),
    ] = None
    tp_rank: Annotated[
        int | None,
        doc(
            "the tensor-parallel rank of the worker process that wrote it (from 1.10); absent "
            "in the front end, in EngineCore and in a single-rank run's in-process worker"
        ),
    ] = None


# ---------------------------------------------------------------------------
# The file
# ---------------------------------------------------------------------------
class TraceHeader(TraceEvent, kw_only=True, tag="trace.header"):
    """The first line of every file a tracer writes (``seq`` 0, ``ts`` when the
    tracer opened the file); a merged trace holds one per process, the
    earliest first. ``load_trace`` checks the version and leaves the header
    out of the events it returns."""

    trace_format_version: Annotated[
        str | int, doc('`"major.minor"`, now `"1.11"`; the first headers wrote the integer 1 (1.0)')
    ]
    glassbox_version: Annotated[str, doc("`engine.__version__` of the writer")]
    trace_level: Annotated[str, doc("`lifecycle` or `full`")]
    role: Annotated[
        str,
        doc(
            "the process of a multi-process run that wrote this part (`core`, `frontend`: "
            "the `<role>` of its part file); empty for a single-process trace and before 1.3"
        ),
    ] = ""


class TraceEnd(TraceEvent, kw_only=True, tag="trace.end"):
    """The last line of every file a tracer writes, written when the tracer is
    closed (``Tracer.close``, or by its finalizer when a process exits without
    closing it): the writer finished. A merged trace holds one per process.
    A process that was killed (SIGKILL, ``os._exit``, a crash) leaves none,
    and a file cut short loses the last; from format 1.3 on, a header
    without its ``trace.end`` (same ``pid``) means the trace is truncated
    (``find_truncation``). ``load_trace`` leaves it out of the events it
    returns, like the header."""

    num_events: Annotated[
        int,
        doc("events the writer wrote between its header and this line: a reader checks it has all"),
    ]


# ---------------------------------------------------------------------------
# Engine set-up (engine-core process)
# ---------------------------------------------------------------------------
class EngineConfig(TraceEvent, kw_only=True, tag="engine.config"):
    """Written by ``Scheduler.__init__``, once: the settings a replay needs.
    Replay: ``policy`` decides how the waiting queue is ordered;
    ``async_scheduling`` whether scheduled requests get placeholders."""

    max_num_seqs: Annotated[int, doc("running requests at most")]
    max_num_batched_tokens: Annotated[int, doc("token budget of one step")]
    max_model_len: Annotated[int, doc("tokens per sequence at most")]
    enable_chunked_prefill: Annotated[bool, doc("a prompt may be split over several steps")]
    long_prefill_token_threshold: Annotated[int, doc("0 = off")]
    policy: Annotated[str, doc("`fcfs` or `priority`")]
    block_size: Annotated[int, doc("tokens per KV block")]
    enable_prefix_caching: Annotated[
        bool, doc("full blocks are hashed and shared between requests")
    ]
    num_gpu_blocks: Annotated[int, doc("KV blocks, the null block included")]
    async_scheduling: Annotated[
        bool,
        doc(
            "steps overlap: step N+1 is scheduled and launched before step N's tokens are read "
            "(absent, i.e. false, before 1.4)"
        ),
    ] = False


class EngineStepLaunched(TraceEvent, kw_only=True, tag="engine.step_launched"):
    """Written by ``EngineCore`` once a step's forward (and, with async
    scheduling, its sampling) is queued on the device; the host goes on at
    once. With ``sched.step`` (the end of ``schedule()``) and
    ``engine.output_ready`` it bounds the step's three phases: scheduled,
    in flight, consumed. Replay: ``StepView.phases`` (``launched_ts``) and
    ``StepView.in_flight`` (the steps in flight right after it)."""

    num_in_flight: Annotated[
        int,
        doc("steps launched whose tokens the host has not read yet, this one included (1 or 2)"),
    ]


class EngineOutputReady(TraceEvent, kw_only=True, tag="engine.output_ready"):
    """Written by ``EngineCore`` when a step's sampled tokens are on the host,
    right before ``update_from_output``. With async scheduling the next step
    was launched in between. Replay: the step leaves the steps in flight
    (``StepPhases.output_ready_ts``)."""

    wait_ns: Annotated[
        int,
        doc(
            "how long the host blocked for the tokens (synchronous loop: sampling included, "
            "as it runs inside the wait)"
        ),
    ]


class EngineProfile(TraceEvent, kw_only=True, tag="engine.profile"):
    """Written by ``EngineCore`` once a ``start_profile`` or ``stop_profile``
    call has reached every worker (1.13): the steps after a start, less
    ``delay_iterations``, are in the profiler traces of
    ``profiler_config.torch_profiler_dir``, each labelled with its prompt and
    generation work. Perfetto export: an instant on the scheduler's thread."""

    is_start: Annotated[bool, doc("true for start_profile, false for stop_profile")]
    profile_prefix: Annotated[
        str | None, doc("the start's name for the traces (absent: none, or a stop)")
    ] = None


class KVInit(TraceEvent, kw_only=True, tag="kv.init"):
    """Written by ``BlockPool.__init__``, once. Replay: creates the pool; the
    free queue is every id in order except the null block (the
    ``FreeKVCacheBlockQueue`` start-up order). A trace without it cannot be
    replayed."""

    num_blocks: Annotated[int, doc("blocks in the pool, the null block included")]
    block_size: Annotated[int, doc("tokens per block")]
    null_block_id: Annotated[int, doc("always 0: taken out of the free queue at start-up")]
    enable_caching: Annotated[bool, doc("prefix caching on")] = False


class RunnerInit(TraceEvent, kw_only=True, tag="runner.init"):
    """Written by ``GPUModelRunner.initialize_kv_cache`` (worker), once."""

    model: Annotated[str, doc("checkpoint path")]
    architecture: Annotated[str, doc("model class, e.g. `LlamaForCausalLM`")]
    dtype: Annotated[str, doc("e.g. `float32`")]
    device: Annotated[str, doc("e.g. `cpu`, `cuda:0`")]
    attn_backend: Annotated[str, doc("`AttentionBackend.get_name()`, e.g. `CPU_ATTN`")]
    num_layers: Annotated[int, doc("KV cache tensors (one per attention layer)")]
    num_blocks: Annotated[int, doc("blocks in each layer's KV tensor")]
    block_size: int
    kv_cache_shape: Annotated[
        list[int],
        doc("one layer's KV tensor: `[2, num_blocks, block_size, num_kv_heads, head_size]`"),
    ] = []
    quantization: Annotated[
        str, doc("`quantization=` (e.g. `gguf`); empty: none (and before 1.9)")
    ] = ""
    quant_methods: Annotated[
        dict[str, str],
        doc("layer class -> its quant method, e.g. `QKVParallelLinear: GGUFLinearMethod` (1.9)"),
    ] = {}
    weight_bytes: Annotated[
        int, doc("bytes of the model's parameters as stored (0 before 1.9)")
    ] = 0


class RunnerCudagraphs(TraceEvent, kw_only=True, tag="runner.cudagraphs"):
    """Written by ``GPUModelRunner.capture_model`` once the CUDA graphs are
    captured (CUDA only)."""

    mode: Annotated[str, doc("the dispatcher's mode, e.g. `FULL_DECODE_ONLY`")]
    sizes: Annotated[list[int], doc("the captured batch sizes (tokens; one request per token)")]
    seconds: Annotated[float, doc("time the capture took, s")]
    memory_bytes: Annotated[
        int, doc("device memory the graphs took (free memory before minus after; 0 before 1.8)")
    ] = 0


class RunnerCompiled(TraceEvent, kw_only=True, tag="runner.compiled"):
    """Written by ``GPUModelRunner.warm_up_model`` once a compiled model ran its
    warm-up batches (compilation on; absent before 1.8)."""

    mode: Annotated[str, doc("`CompilationMode`, e.g. `VLLM_COMPILE`")]
    backend: Annotated[str, doc("`inductor` or `eager`")]
    num_pieces: Annotated[
        int, doc("compiled pieces after the split at attention (L + 1 for L layers; 0 unsplit)")
    ] = 0
    num_splits: Annotated[int, doc("attention calls between the pieces, run eagerly")] = 0
    compile_sizes: Annotated[list[int], doc("token counts compiled on their own")] = []
    inductor_compiles: Annotated[int, doc("pieces Inductor generated code for")] = 0
    cache_hits: Annotated[int, doc("pieces found in the on-disk cache instead")] = 0
    backend_seconds: Annotated[
        float, doc("time in the split-and-compile backend (any token count), s")
    ] = 0.0
    size_seconds: Annotated[
        dict[str, float], doc("compile size -> time its own code took, all pieces, s")
    ] = {}
    seconds: Annotated[float, doc("whole warm-up (trace, compile, dummy runs), s")]
    cache_dir: Annotated[str, doc("this model's compile cache folder")] = ""
    inductor_options: Annotated[
        dict[str, Any],
        doc("`compilation_config.inductor_compile_config` (a value JSON cannot hold: repr; 1.11)"),
    ] = {}


# ---------------------------------------------------------------------------
# Requests (front-end process)
# ---------------------------------------------------------------------------
class SamplingParamsSummary(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """The sampling settings of a request, as ``request.added`` records them."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = []
    stop_token_ids: list[int] = []
    logprobs: int | None = None
    ignore_eos: bool = False
    output_kind: Annotated[str, doc("the name of its `RequestOutputKind`")] = "CUMULATIVE"


class RequestAdded(TraceEvent, kw_only=True, tag="request.added"):
    """Written by ``OutputProcessor.add_request`` for every request (each child
    of an ``n > 1`` request separately). The one event that links the id the
    user gave (``external_req_id``) to the internal ``request_id`` every other
    event names the request by."""

    request_id: Annotated[
        str,
        doc(
            "the internal id: the user's id, `-` and 8 random hex digits (a child of "
            "`n > 1`: `<index>_<parent's internal id>`)"
        ),
    ]
    external_req_id: Annotated[
        str,
        doc(
            "the id the user gave (`RequestOutput.request_id`; a child: its parent's); "
            "empty in traces before 1.2"
        ),
    ] = ""
    parent_request_id: Annotated[
        str | None, doc("children of `n > 1`: the parent's internal id")
    ] = None
    index: Annotated[int, doc("child index")] = 0
    num_prompt_tokens: int
    prompt: Annotated[str | None, doc("prompt text, cut to 512 characters")] = None
    arrival_time: Annotated[float, doc("wall clock, s (`time.time()`)")] = 0.0
    priority: int = 0
    sampling_params: Annotated[SamplingParamsSummary, doc("its sampling settings")] = msgspec.field(
        default_factory=SamplingParamsSummary
    )
    prompt_token_ids: Annotated[list[int] | None, doc("`full` only")] = None
    lora_name: Annotated[
        str, doc("its LoRA adapter (`LoRARequest.lora_name`); empty: the base model (1.9)")
    ] = ""


class RequestOutputEvent(TraceEvent, kw_only=True, tag="request.output"):
    """Written by ``OutputProcessor.process_outputs``, once per
    ``EngineCoreOutput`` of a request."""

    request_id: str
    new_token_ids: Annotated[list[int], doc("tokens that arrived from the core")] = []
    text_delta: Annotated[
        str, doc("text this update added to the output (after a stop string is cut off)")
    ] = ""
    num_output_tokens: Annotated[int, doc("tokens received so far")] = 0
    finished: Annotated[bool, doc("the request's last output")] = False


class RequestFinished(TraceEvent, kw_only=True, tag="request.finished"):
    """Written when the front end finishes a request: the core said so, a stop
    string was found here, or it was aborted (``abort_requests``)."""

    request_id: str
    finish_reason: Annotated[str, doc("`stop`, `length`, `abort`")]
    stop_reason: Annotated[str | int | None, doc("the stop string or stop token id")] = None
    num_prompt_tokens: Annotated[int | None, doc("not on aborts")] = None
    num_output_tokens: Annotated[int | None, doc("not on aborts")] = None
    num_cached_tokens: Annotated[int | None, doc("not on aborts")] = None
    stop_string_in_front_end: Annotated[
        bool,
        doc(
            "the front end found the stop string (the core then gets an abort: `FINISHED_ABORTED`)"
        ),
    ] = False
    aborted_by: Annotated[str | None, doc("`front end`, on aborts")] = None


# ---------------------------------------------------------------------------
# Process hops (multi-process engine and API server)
# ---------------------------------------------------------------------------
class RequestSent(TraceEvent, kw_only=True, tag="request.sent"):
    """Written by the front end's client (``core_client.py``) before it sends
    a request to the engine core. The replay ignores it; the Perfetto export
    draws a flow arrow to the matching ``request.received``."""

    type: Annotated[str, doc("`add` (with `request_id`) or `abort` (with `request_ids`)")]
    request_id: Annotated[str | None, doc("`add`: the request")] = None
    request_ids: Annotated[list[str] | None, doc("`abort`: the requests aborted")] = None


class RequestReceived(TraceEvent, kw_only=True, tag="request.received"):
    """Written by the engine core's input thread (``core.py``) for each request
    it decoded: the same fields as ``request.sent``."""

    type: Annotated[str, doc("`add` or `abort`")]
    request_id: Annotated[str | None, doc("`add`: the request")] = None
    request_ids: Annotated[list[str] | None, doc("`abort`: the requests aborted")] = None


class OutputSent(TraceEvent, kw_only=True, tag="output.sent"):
    """Written by the engine core's busy loop as it queues a batch of outputs
    for the output thread. A step's outputs carry that step's number: with
    async scheduling one less than the step in flight (``sched.update``'s)."""

    request_ids: Annotated[list[str], doc("the requests in the `EngineCoreOutputs` batch")] = []


class OutputReceived(TraceEvent, kw_only=True, tag="output.received"):
    """Written by the front end's client when a batch of outputs arrives from
    the engine core (multi-process only). The Perfetto export pairs it with
    the oldest unmatched ``output.sent`` of the same ``request_ids``."""

    request_ids: Annotated[list[str], doc("the requests in the batch")] = []


class ApiRequest(TraceEvent, kw_only=True, tag="api.request"):
    """Written by the API server (``glassbox serve``) per HTTP request."""

    request_id: Annotated[
        str,
        doc(
            "the HTTP request's id: its engine requests were sent under it (chat) or under "
            "`<id>-<prompt index>` (completions), their `external_req_id`"
        ),
    ]
    endpoint: Annotated[str, doc("`/v1/completions` or `/v1/chat/completions`")]
    stream: Annotated[bool, doc("the client asked for server-sent events")] = False


class ApiChunk(TraceEvent, kw_only=True, tag="api.chunk"):
    """Written by the API server per streamed chunk."""

    request_id: Annotated[str, doc("the HTTP request's id, as in `api.request`")]
    num_bytes: Annotated[int, doc("size of the chunk as written")]


# ---------------------------------------------------------------------------
# Scheduler (engine-core process)
# ---------------------------------------------------------------------------
class SchedQueued(TraceEvent, kw_only=True, tag="sched.queued"):
    """``Scheduler.add_request``: the request joins the waiting queue. Replay:
    creates the request (``WAITING``) and queues it (priority policy: in
    ``(priority, arrival_time, request_id)`` order, the order the heap pops in)."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    priority: int = 0
    arrival_time: Annotated[float, doc("s; the priority queue's tie-break")] = 0.0
    num_block_hashes: Annotated[
        int, doc("full blocks of the prompt, hashed for the prefix cache")
    ] = 0


class SchedAdmitted(TraceEvent, kw_only=True, tag="sched.admitted"):
    """A waiting request got its blocks and moved to the running list. Replay:
    pops it from the head of the waiting queue (an error if it is not the
    head), appends it to the running list, sets its cursor."""

    request_id: str
    resumed: Annotated[bool, doc("it was preempted before")] = False
    num_computed_tokens: Annotated[
        int, doc("tokens already in the cache when admitted: the prefix hit")
    ] = 0
    num_new_tokens: Annotated[int, doc("tokens scheduled for it this step")]
    num_tokens: Annotated[int, doc("prompt + outputs so far")]


class SchedPreempted(TraceEvent, kw_only=True, tag="sched.preempted"):
    """The running list ran out of blocks and the scheduler preempted a
    request (``preempted_req``) to free its blocks, or
    ``reset_prefix_cache(reset_running_requests=True)`` preempted every
    running request (from the tail of the list). Replay: removes it from
    the running list, puts it at the front of the waiting queue
    (``PREEMPTED``, cursor 0). Its ``kv.freed`` comes just before."""

    request_id: Annotated[str, doc("the preempted request")]
    for_request_id: Annotated[
        str,
        doc(
            "the request that needed the blocks (may be the preempted one itself); empty "
            "when `reset_prefix_cache(reset_running_requests=True)` preempted it"
        ),
    ]
    num_tokens: Annotated[
        int,
        doc("tokens the host had: what it recomputes, plus tokens still in flight as they arrive"),
    ]
    num_output_tokens: int
    num_preemptions: Annotated[int, doc("times it was preempted so far")]


class SchedStep(TraceEvent, kw_only=True, tag="sched.step"):
    """The end of ``schedule()``: one step's decisions. Replay: advances each
    scheduled request's cursor by its tokens (the scheduler does this before
    the model runs); with async scheduling, each request the step samples a
    token for gets a placeholder (``num_output_placeholders``); checks the
    queue lengths."""

    token_budget: Annotated[int, doc("the step's budget (`max_num_batched_tokens`)")]
    token_budget_left: Annotated[int, doc("what nobody used")]
    num_scheduled_tokens: Annotated[
        dict[str, int], doc("tokens per request, in scheduling order (running first)")
    ] = {}
    total_num_scheduled_tokens: Annotated[int, doc("the sum of `num_scheduled_tokens`")] = 0
    new_req_ids: Annotated[list[str], doc("admitted this step, fresh")] = []
    resumed_req_ids: Annotated[list[str], doc("admitted this step after a preemption")] = []
    running_req_ids: Annotated[list[str], doc("already running requests that got tokens")] = []
    preempted_req_ids: Annotated[list[str], doc("preempted while this step was scheduled")] = []
    finished_req_ids: Annotated[
        list[str], doc("finished since the last step: the worker drops them now")
    ] = []
    num_running: Annotated[int, doc("queue length after scheduling")] = 0
    num_waiting: Annotated[int, doc("queue length after scheduling")] = 0
    num_skipped_waiting: Annotated[
        int,
        doc(
            "requests in the second waiting queue, `skipped_waiting`, after scheduling: "
            "blocked, e.g. waiting for their grammar; not in `num_waiting` (absent before 1.7)"
        ),
    ] = 0
    num_common_prefix_blocks: Annotated[
        list[int], doc("blocks every running request shares (cascade attention's input)")
    ] = []
    kv_cache_usage: Annotated[float, doc("used fraction of the usable blocks, 0..1")] = 0.0
    duration_ns: Annotated[int, doc("time spent in `schedule()`, ns")] = 0
    scheduled_spec_decode_tokens: Annotated[
        dict[str, list[int]],
        doc(
            "speculative decoding: the drafts each request verifies this step, counted in its "
            "`num_scheduled_tokens` (absent before 1.5)"
        ),
    ] = {}
    num_lookahead_tokens: Annotated[
        int,
        doc(
            "speculative decoding with a model drafter (draft model, EAGLE): slots reserved in "
            "each scheduled request's blocks beyond its scheduled tokens, where the drafter "
            "writes the K/V of its next drafts (absent: 0; before 1.6)"
        ),
    ] = 0


class SpecVerified(TraceEvent, kw_only=True, tag="spec.verified"):
    """Speculative decoding, in ``update_from_output()``: the runner's verdict
    on one request's drafts. The accepted drafts and one token of the target's
    own (the bonus token if every draft was accepted, else the one that
    replaced the first rejected draft) are appended; the cursor steps back
    over the rejected drafts. Written before the step's ``sched.update``,
    which holds what was appended (a stop or ``max_tokens`` may keep fewer
    than ``token_ids``). Replay: ``num_computed_tokens`` (and, with async
    scheduling, the placeholders) drop by ``num_rejected`` where above 0,
    and the cursor must then equal this event's; ``StepView.spec.verified``
    keeps the verdict."""

    request_id: str
    draft_token_ids: Annotated[list[int], doc("the drafts the step verified")]
    num_accepted: Annotated[int, doc("leading drafts the target agreed with")]
    token_ids: Annotated[list[int], doc("what the step produced: accepted drafts + one")]
    num_rejected: Annotated[int, doc("drafts thrown away; their KV is overwritten later")]
    num_computed_tokens: Annotated[int, doc("the request's cursor after the rollback")]


class SchedUpdate(TraceEvent, kw_only=True, tag="sched.update"):
    """The end of ``update_from_output()``. Replay: adds the tokens to each
    request (each retires a placeholder); checks the queue lengths. With
    async scheduling it comes after the next step's ``sched.step``."""

    new_token_ids: Annotated[
        dict[str, list[int]],
        doc("tokens appended this step (prefill chunks get none; a stop cuts the rest)"),
    ] = {}
    finished: Annotated[dict[str, str], doc("requests the core finished, with the reason")] = {}
    num_running: int = 0
    num_waiting: int = 0
    num_skipped_waiting: Annotated[
        int, doc("requests in `skipped_waiting` afterwards (absent before 1.7)")
    ] = 0
    duration_ns: Annotated[int, doc("time spent in `update_from_output()`, ns")] = 0


class SchedPause(TraceEvent, kw_only=True, tag="sched.pause"):
    """Written by ``Scheduler.set_pause_state`` when ``pause_generation`` or
    ``resume_generation`` reached it (1.13): until the next one, PAUSED_NEW
    steps admit no waiting request and PAUSED_ALL steps schedule nothing."""

    state: Annotated[str, doc("`UNPAUSED`, `PAUSED_NEW` or `PAUSED_ALL`")]


class SchedFinished(TraceEvent, kw_only=True, tag="sched.finished"):
    """``Scheduler._free_request``: stop, length, repetition or abort (including
    the aborts the front end sends after a stop string). Replay: removes it
    from its queue and marks it finished; its ``kv.freed`` follows."""

    request_id: str
    status: Annotated[
        str,
        doc(
            "`FINISHED_STOPPED`, `FINISHED_LENGTH_CAPPED`, `FINISHED_ABORTED`, "
            "`FINISHED_IGNORED`, `FINISHED_REPETITION` (1.13)"
        ),
    ]
    finish_reason: Annotated[str, doc("`stop`, `length`, `abort`, `repetition`")]
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0


# ---------------------------------------------------------------------------
# KV cache (engine-core process)
# ---------------------------------------------------------------------------
class KVCacheHit(TraceEvent, kw_only=True, tag="kv.cache_hit"):
    """``KVCacheManager.get_computed_blocks``: the prefix-cache lookup for a
    waiting request (repeated on later steps while it does not fit). Replay:
    nothing (``kv.touched`` adopts the blocks)."""

    request_id: str
    num_cached_tokens: Annotated[
        int,
        doc(
            "tokens found, a multiple of `block_size`; 0 is a miss (the last token is "
            "always computed)"
        ),
    ]
    block_ids: Annotated[list[int], doc("the hit blocks, in prefix order")] = []
    num_tokens: Annotated[int, doc("the request's tokens at the lookup (prompt + outputs)")] = 0
    num_block_hashes: Annotated[
        int, doc("its hashed full blocks: the most the lookup could find")
    ] = 0


class KVTouched(TraceEvent, kw_only=True, tag="kv.touched"):
    """``SingleTypeKVCacheManager.allocate_new_computed_blocks``: the request
    adopts its prefix hit. Replay: each block's ref count +1, the request
    joins its owners; a block that was free is unlinked from the free queue."""

    request_id: str
    block_ids: Annotated[list[int], doc("the hit blocks, now the start of its block table")]
    ref_cnts: Annotated[list[int], doc("their reference counts afterwards (> 1: shared)")]


class KVAllocated(TraceEvent, kw_only=True, tag="kv.allocated"):
    """``SingleTypeKVCacheManager.allocate_new_blocks``. Replay: pops that many
    blocks from the head of the free queue and checks they are these ids;
    ref count 1, one owner."""

    request_id: str
    block_ids: Annotated[list[int], doc("new blocks, appended to the block table")]
    num_blocks: Annotated[int, doc("length of the block table afterwards")]


class KVAllocationFailed(TraceEvent, kw_only=True, tag="kv.allocation_failed"):
    """``KVCacheManager.allocate_slots`` returned None: not enough free blocks.
    For a running request a preemption follows; for a waiting one, admission
    stops."""

    request_id: str
    num_new_tokens: Annotated[int, doc("tokens it tried to place")]
    num_blocks_needed: Annotated[
        int, doc("free blocks that needed (hit blocks in the free queue count)")
    ]
    num_free_blocks: Annotated[int, doc("free blocks there were")]


class KVCached(TraceEvent, kw_only=True, tag="kv.cached"):
    """``BlockPool.cache_full_blocks``, per block that just became full.
    Replay: sets the block's hash and adds it to the prefix-cache map."""

    block_id: int
    block_hash: Annotated[
        str, doc("hex sha256 of the block, chained over the prefix (no group id)")
    ]
    kv_cache_group_id: int = 0
    request_id: Annotated[str, doc("the request whose tokens filled it")]
    block_index: Annotated[int, doc("its place in that request's block table")]


class KVEvicted(TraceEvent, kw_only=True, tag="kv.evicted"):
    """``BlockPool._maybe_evict_cached_block``: a free block that still held a
    cached prefix is reused, so the prefix is forgotten. Comes right before
    the ``kv.allocated`` that takes the block. Replay: clears the hash."""

    block_id: int
    block_hash: Annotated[str, doc("the hash it loses")]
    kv_cache_group_id: int = 0


class KVFreed(TraceEvent, kw_only=True, tag="kv.freed"):
    """``SingleTypeKVCacheManager.free``: a finished or preempted request gives
    its blocks back. Replay: ref count -1 for each, the request leaves the
    owners, blocks at 0 go to the free queue's tail in order; hashes stay (a
    later request can still hit a free block until it is evicted)."""

    request_id: str
    block_ids: Annotated[
        list[int], doc("its block table reversed: the order they are released (tail first)")
    ]
    to_free_queue: Annotated[
        list[int], doc("those whose ref count reached 0, appended to the free queue in this order")
    ] = []


class KVCacheReset(TraceEvent, kw_only=True, tag="kv.cache_reset"):
    """``BlockPool.reset_prefix_cache`` succeeded. Replay: every hash is
    forgotten."""


# ---------------------------------------------------------------------------
# Model runner and sampler (worker)
# ---------------------------------------------------------------------------
class RunnerBatch(TraceEvent, kw_only=True, tag="runner.batch"):
    """``GPUModelRunner.execute_model``, once per step that runs the model
    (written after the forward's launch). Replay: the step's batch layout
    (``StepView.batch``); without it the replay derives the layout from
    ``sched.step`` and the block tables."""

    num_reqs: Annotated[int, doc("rows")]
    num_tokens: Annotated[int, doc("tokens in the flattened batch")]
    num_tokens_padded: Annotated[
        int, doc("after padding to a captured CUDA graph's size (`num_tokens` when eager)")
    ]
    attn_backend: Annotated[str, doc("e.g. `CPU_ATTN`")]
    cudagraph_mode: Annotated[
        str,
        doc("`NONE` (eager), `FULL` (the model's graph) or `PIECEWISE` (the pieces' graphs)"),
    ]
    req_ids: Annotated[list[str], doc("request of each row")]
    query_lens: Annotated[list[int], doc("tokens per row this step")]
    num_computed_tokens: Annotated[
        list[int],
        doc(
            "context before this step: row i's positions are "
            "`num_computed_tokens[i] ..< seq_lens[i]`"
        ),
    ]
    seq_lens: Annotated[list[int], doc("context after this step")]
    slot_mapping: Annotated[
        list[list[list[int]]],
        doc(
            "per row, runs of KV slots written: `[block_id, offset, count]` "
            "(slot = block_id * block_size + offset)"
        ),
    ]
    discard_req_ids: Annotated[
        list[str], doc("rows in the middle of their prompt: sample thrown away")
    ] = []
    max_query_len: Annotated[int, doc("the largest of `query_lens`")] = 0
    max_seq_len: Annotated[int, doc("the largest of `seq_lens`")] = 0


class SpecProposed(TraceEvent, kw_only=True, tag="spec.proposed"):
    """Speculative decoding: written by ``GPUModelRunner`` after sampling
    (``propose_draft_token_ids``), one per request the proposer drafted
    for; it follows the step's ``sampler.sampled``. The next step verifies
    these drafts: its ``sched.step`` lists them in
    ``scheduled_spec_decode_tokens``, cut short where the token budget or
    ``max_model_len`` leaves less room, and not at all for a request that
    finished or was not scheduled. Replay: ``StepView.spec.proposed``."""

    request_id: str
    draft_token_ids: Annotated[
        list[int], doc("the drafts, in order (at most `num_speculative_tokens`)")
    ]
    method: Annotated[str, doc("the proposer (`SpeculativeConfig.method`, e.g. `ngram`)")] = ""


class TensorSummary(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One input tensor in summary: all its values when short (a small 2-D
    tensor keeps its rows), else the first and last ``SUMMARY_VALUES``."""

    shape: Annotated[list[int], doc("the tensor's shape")]
    dtype: Annotated[str, doc("e.g. `int32`")]
    min: Annotated[int | float | None, doc("smallest value; absent when empty")] = None
    max: Annotated[int | float | None, doc("largest value; absent when empty")] = None
    values: Annotated[
        list[Any] | None, doc("every value, when short (a small 2-D tensor: a list of rows)")
    ] = None
    head: Annotated[list[Any] | None, doc("long: the first `SUMMARY_VALUES`, flattened")] = None
    tail: Annotated[list[Any] | None, doc("long: the last `SUMMARY_VALUES`, flattened")] = None


class RunnerInputs(TraceEvent, kw_only=True, tag="runner.inputs"):
    """``full`` only: the input tensors of a step, summarised from the host
    arrays the device buffers were filled from (no device work)."""

    input_ids: Annotated[TensorSummary, doc("token id of each scheduled token (flattened)")]
    positions: Annotated[TensorSummary, doc("position of each token in its sequence")]
    query_start_loc: Annotated[
        TensorSummary,
        doc("`[num_reqs + 1]`: row i's tokens are `query_start_loc[i] ..< query_start_loc[i + 1]`"),
    ]
    seq_lens: Annotated[TensorSummary, doc("context length of each row after this step")]
    slot_mapping: Annotated[
        TensorSummary,
        doc("KV slot of each token (`block_id * block_size + offset`); padding tokens get -1"),
    ]
    block_table: Annotated[TensorSummary, doc("`[num_reqs, max_blocks]`: each row's block ids")]
    logits_indices: Annotated[
        TensorSummary, doc("each row's last token in the flattened batch: the rows of logits")
    ]


class RunnerForward(TraceEvent, kw_only=True, tag="runner.forward"):
    """The model call and ``compute_logits``. On CPU written right after them;
    on CUDA after sampling has waited for the device (timed by a pair of CUDA
    events; with async scheduling after the next step's launch), so place it
    by ``start_ts``."""

    start_ts: Annotated[
        int | None,
        doc("wall clock, ns, when the forward was launched (absent in traces before 1.1)"),
    ] = None
    duration_ns: Annotated[int, doc("host time on CPU, GPU time between CUDA events on CUDA")]
    num_tokens: Annotated[int, doc("tokens in the batch, before CUDA-graph padding")]
    num_logits: Annotated[int, doc("rows of logits (one per request)")]


class SamplerStage(msgspec.Struct, kw_only=True, gc=False):
    """The most likely tokens as one stage of the sampler left the distribution."""

    stage: Annotated[str, doc("`raw`, `processed`, `temperature`, `min_p` or `top_k_top_p`")]
    token_ids: Annotated[list[int], doc("the most likely tokens, most likely first")]
    probs: Annotated[list[float], doc("their probabilities as the stage left them")]


class SamplerSampled(TraceEvent, kw_only=True, tag="sampler.sampled"):
    """One per request whose sample is kept (prefill-chunk rows are not
    traced), written after the runner's copy of the sampled tokens, so it
    follows the step's ``runner.forward`` (with async scheduling, the next
    step's launch too). ``stages`` (``full``), in order:
    ``raw`` (softmax of the model's logits), ``processed`` (after allowed-token
    masks, bad words, min-tokens, logit bias and penalties) and, when the batch
    has random rows, ``temperature``, ``min_p`` (only if it changed the logits)
    and ``top_k_top_p`` (likewise; renormalised over what is kept). A greedy
    row picks the argmax of ``processed``. Replay: ``StepView.sampler``."""

    request_id: str
    row: Annotated[int, doc("row in the batch")]
    token_id: Annotated[int, doc("the chosen token")]
    logprob: Annotated[float, doc("its log-probability under the raw model output")]
    greedy: Annotated[bool, doc("the row takes the argmax (temperature 0)")] = False
    rank: Annotated[int | None, doc("`full`: 1 + tokens at least as likely (raw)")] = None
    rank_before_mask: Annotated[
        int | None,
        doc(
            "`full`, structured outputs without drafts: the same rank in the logits before the "
            "grammar mask (`rank` is after it: the mask is applied before the sampler)"
        ),
    ] = None
    stages: Annotated[
        list[SamplerStage] | None, doc("`full`: per stage that ran, the 5 most likely tokens")
    ] = None


# ---------------------------------------------------------------------------
# Written by tools
# ---------------------------------------------------------------------------
class TraceCli(TraceEvent, kw_only=True, tag="trace.cli"):
    """Written by ``glassbox trace`` after the run's last step (the engine
    gives each request its internal id as it is added): which request is
    the user's. The TUI reads it; the replay and the export ignore it."""

    follow_request_id: Annotated[
        str,
        doc("the request holding the user's prompt (traces before 1.2: the id it was sent under)"),
    ]
    prompt: Annotated[str, doc("the prompt as typed")]
    model: Annotated[str, doc("model path or name")]
    background_request_ids: Annotated[list[str], doc("the other requests of the run")] = []
    arrival_steps: Annotated[
        dict[str, int], doc("engine steps run before each request is added (0: before the first)")
    ] = {}


class TraceTokenTexts(TraceEvent, kw_only=True, tag="trace.token_texts"):
    """Written by ``glassbox trace`` after the last step: the decoded text of
    every token id the trace mentions, so a viewer needs no tokenizer."""

    token_texts: Annotated[dict[str, str], doc("str(token_id) -> its text")] = {}


# ---------------------------------------------------------------------------
# Structured outputs (engine core; the mask itself in the worker)
# ---------------------------------------------------------------------------
class GrammarCompileStarted(TraceEvent, kw_only=True, tag="so.compile_started"):
    """``StructuredOutputManager.grammar_init`` (from ``EngineCore.add_request``,
    so before the request's ``sched.queued``): the request's grammar went to
    the compile thread pool. The request starts in
    ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` and is queued in the
    scheduler's second waiting queue, ``skipped_waiting``, until ``so.ready``.
    Replay: the request is constrained (``ReplayRequest.grammar_kind``) and
    waits for its grammar (``StepView.structured_output``)."""

    request_id: str
    grammar_kind: Annotated[str, doc("JSON, JSON_OBJECT, REGEX, GRAMMAR or CHOICE")]


class GrammarCompiled(TraceEvent, kw_only=True, tag="so.compiled"):
    """A compile thread finished the request's grammar, written from that
    thread (its ``step`` is the one the engine was in then; with a cache hit
    it may come before the request's ``sched.queued``). Replay: the compile's
    time and cache hit, on the request."""

    request_id: str
    grammar_kind: Annotated[str, doc("as `so.compile_started`'s")]
    compile_s: Annotated[float, doc("seconds in the compiler (cache hits take microseconds)")]
    cache_hit: Annotated[bool, doc("xgrammar's compiled-grammar cache already held it")]
    error: Annotated[str, doc("why the compile failed (the request then ends with an error)")] = ""


class GrammarReady(TraceEvent, kw_only=True, tag="so.ready"):
    """``schedule()`` found the request's grammar compiled and set it from
    ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` back to ``WAITING``; it stays
    at its place in ``skipped_waiting``, which FCFS serves first, and is
    usually admitted in the same step. Replay: the request no longer waits
    for its grammar."""

    request_id: str


class GrammarBitmask(TraceEvent, kw_only=True, tag="so.bitmask"):
    """``Scheduler.get_grammar_bitmask`` (``StructuredOutputManager.grammar_bitmask``):
    the bitmask rows sent to the runner for one step, one per constrained
    request that samples in it (1 + d rows for a request verifying d
    drafts). ``step`` is the step whose logits the rows mask: with async
    scheduling a step whose request still has a token in flight is sampled
    later (its mask is built after the previous step's ``sched.update``).
    Replay: ``StepView.structured_output``."""

    request_ids: Annotated[list[str], doc("the constrained requests, in bitmask order")]
    num_rows: Annotated[list[int], doc("rows per request (1 + its drafts)")]
    num_allowed: Annotated[
        list[int], doc("tokens each request's first row allows (`vocab_size`: none masked)")
    ]
    vocab_size: Annotated[int, doc("tokens a row covers: the model's vocabulary")] = 0


class GrammarAdvanced(TraceEvent, kw_only=True, tag="so.advanced"):
    """``update_from_output()``: the request's matcher accepted the tokens the
    step appended to it (written before the step's ``sched.update``).
    Replay: ``StepView.structured_output``."""

    request_id: str
    token_ids: Annotated[list[int], doc("the tokens the matcher was given")]
    num_processed_tokens: Annotated[int, doc("tokens the matcher has accepted in all")]
    terminated: Annotated[bool, doc("the grammar is complete (it accepted a stop token)")]


class GrammarRolledBack(TraceEvent, kw_only=True, tag="so.rollback"):
    """Speculative decoding, while the bitmask rows of a request's drafts are
    written: each draft is accepted to get the row after it, then the
    matcher steps back over all of them (``step``: as ``so.bitmask``'s)."""

    request_id: str
    num_tokens: Annotated[int, doc("drafts the matcher stepped back over")]


class GrammarMasked(TraceEvent, kw_only=True, tag="so.masked"):
    """Trace level ``full``, the runner's ``apply_grammar_bitmask``: what the
    mask did to the request's first row of logits (the one the sampler
    draws from without drafts), before the sampler's stages, whose ``raw``
    candidates are then the masked ones. Replay: ``StepView.structured_output``."""

    request_id: str
    num_allowed: Annotated[int, doc("tokens left with a finite logit")]
    masked_top_token_ids: Annotated[
        list[int], doc("of the row's 5 highest logits before masking, the ids the mask removed")
    ]
    top_token_id_before: Annotated[int, doc("the highest-logit token before masking")]
    top_token_id_after: Annotated[int, doc("the highest-logit token after masking")]


class LoRASlots(TraceEvent, kw_only=True, tag="lora.slots"):
    """Written by ``GPUModelRunner.set_active_loras`` (worker) when a step
    changed which adapters are loaded or sit in the device slots (1.9), and
    by ``add_lora`` when it loaded an adapter between steps (1.13; no
    ``token_slots``)."""

    slots: Annotated[list[int], doc("adapter id per device slot; 0: empty")]
    loaded: Annotated[list[int], doc("adapter ids read from disk for this step")] = []
    evicted_from_slots: Annotated[
        list[int], doc("adapter ids moved out of a slot (least recently used)")
    ] = []
    evicted_from_cpu: Annotated[
        list[int], doc("adapter ids dropped from host memory (beyond `max_cpu_loras`)")
    ] = []
    token_slots: Annotated[
        dict[str, int], doc("request id -> the slot its tokens used this step; -1: none")
    ] = {}


class RunnerPromptLogprobs(TraceEvent, kw_only=True, tag="runner.prompt_logprobs"):
    """Written by ``GPUModelRunner._get_prompt_logprobs_dict`` (worker) for each
    request that asked for ``prompt_logprobs`` and ran prompt tokens this step
    (1.12): which prompt positions got their logprobs, and whether the rows go
    back to the front end now (the step that ends the request's prefill)."""

    request_id: str
    first_position: Annotated[int, doc("the first prompt position whose logits ran this step")]
    num_positions: Annotated[
        int, doc("positions that got a logprob row (the prompt's last one has none)")
    ]
    num_logprobs: Annotated[int, doc("top-k width asked for (-1 resolved to the vocabulary)")]
    done: Annotated[bool, doc("the prefill ended: all P - 1 rows go out with the first token")]


class WorkerRpcReceived(TraceEvent, kw_only=True, tag="worker.rpc_received"):
    """A worker process of a multi-process executor took a call off the
    broadcast queue (1.10): ``ts`` is when this rank received it, so the
    ranks' lines of one step show the broadcast's spread. Every rank writes
    it (``tp_rank``)."""

    method: Annotated[str, doc("the `Worker` method, e.g. `execute_model`, `sample_tokens`")]


class WorkerRpcDone(TraceEvent, kw_only=True, tag="worker.rpc_done"):
    """The same call finished on this rank (1.10): its time and the
    collectives its forward ran on the tensor-parallel group."""

    method: Annotated[str, doc("the `Worker` method")]
    seconds: Annotated[float, doc("from taking the call to its result, this rank, host clock")]
    all_reduce_count: Annotated[int, doc("all-reduces on the TP group during the call")] = 0
    all_gather_count: Annotated[int, doc("all-gathers on the TP group during the call")] = 0
    collective_seconds: Annotated[
        float, doc("host time inside those collectives (gloo: their whole time; NCCL: launches)")
    ] = 0.0
    collective_bytes: Annotated[int, doc("bytes this rank contributed to them")] = 0
    replied: Annotated[bool, doc("this rank answered the executor (the output rank)")] = False


# Every kind, grouped by the section of docs/trace_format.md that lists it.
EVENT_SECTIONS: dict[str, tuple[type[TraceEvent], ...]] = {
    "The file": (TraceHeader, TraceEnd),
    "Engine set-up": (EngineConfig, KVInit, RunnerInit, RunnerCompiled, RunnerCudagraphs),
    "Engine loop (engine core)": (EngineStepLaunched, EngineOutputReady, EngineProfile),
    "Requests (front end)": (RequestAdded, RequestOutputEvent, RequestFinished),
    "Process hops": (
        RequestSent,
        RequestReceived,
        OutputSent,
        OutputReceived,
        ApiRequest,
        ApiChunk,
    ),
    "Scheduler (engine core)": (
        SchedQueued,
        SchedAdmitted,
        SchedPreempted,
        SchedStep,
        SchedUpdate,
        SpecVerified,
        SchedFinished,
        SchedPause,
    ),
    "KV cache (engine core)": (
        KVCacheHit,
        KVTouched,
        KVAllocated,
        KVAllocationFailed,
        KVCached,
        KVEvicted,
        KVFreed,
        KVCacheReset,
    ),
    "Model runner and sampler (worker)": (
        RunnerBatch,
        RunnerInputs,
        RunnerForward,
        SamplerSampled,
        SpecProposed,
        LoRASlots,
        RunnerPromptLogprobs,
    ),
    "Worker processes (tensor parallelism)": (WorkerRpcReceived, WorkerRpcDone),
    "Structured outputs": (
        GrammarCompileStarted,
        GrammarCompiled,
        GrammarReady,
        GrammarBitmask,
        GrammarAdvanced,
        GrammarRolledBack,
        GrammarMasked,
    ),
    "Written by tools": (TraceCli, TraceTokenTexts),
}
EVENT_TYPES: tuple[type[TraceEvent], ...] = tuple(
    cls for group in EVENT_SECTIONS.values() for cls in group
)
for _section, _group in EVENT_SECTIONS.items():
    for _cls in _group:
        _cls.kind = _cls.__struct_config__.tag
        _cls.section = _section
# kind -> class, e.g. EVENT_KINDS["sched.step"] is SchedStep.
EVENT_KINDS: dict[str, type[TraceEvent]] = {cls.kind: cls for cls in EVENT_TYPES}
HEADER_KIND = TraceHeader.kind
END_KIND = TraceEnd.kind

__all__ = [cls.__name__ for cls in EVENT_TYPES] + [
    "EVENT_KINDS",
    "EVENT_SECTIONS",
    "END_KIND",
    "EVENT_TYPES",
    "HEADER_KIND",
    "TRACE_FORMAT_VERSION",
    "SamplerStage",
    "SamplingParamsSummary",
    "TensorSummary",
    "TraceEvent",
]
