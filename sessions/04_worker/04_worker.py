# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Session 04 — The worker
#
# **Goal.** Follow one `SchedulerOutput` into the worker and out again as a
# `ModelRunnerOutput`: how `GPUModelRunner` keeps a persistent batch, how
# `_prepare_inputs` flattens a step that mixes decodes and a chunk of prefill
# into one token list (positions, slot mapping, `query_start_loc`,
# `seq_lens`, block tables), and how CUDA graphs fit in: captured for a fixed
# set of batch sizes, with a runtime batch padded up to the next one.
# Scheduling is asynchronous, the default in vLLM and here: the runner hands
# back an `AsyncGPUModelRunnerOutput` without waiting for the sampled ids, the
# engine reads it one loop turn later, after it has launched the next step,
# and that next step takes those ids as inputs on the device.
#
# The lab:
#
# 1. the files to read — vLLM at `52a31cc` beside the Glassbox twin, lines
#    computed from data;
# 2. one engine, in-process, tracing at `full`, with a small token budget so
#    that a long prompt is chunked and shares steps with two decodes;
# 3. the mixed step taken apart, from the trace's `runner.batch` event and from
#    the live runner's own tensors (the notebook wraps `_prepare_inputs` to
#    keep a copy of what it built), and recomputed by hand; then which input
#    ids were not on the host at all, but taken on the device from the
#    previous step's samples; the `ModelRunnerOutput` the step handed back;
#    and what happened before the first step: the profiling run,
#    `_dummy_run`, and how many KV blocks fit in this machine's memory;
# 4. CUDA graphs: the dispatcher's decision for a range of batch sizes (the
#    same code the runner calls), the H200 numbers committed in
#    `benchmarks/results/`, and — when this notebook runs on a GPU — a live
#    measurement;
# 5. the exercise — *why is padding to a captured size cheaper than launching
#    the kernels eagerly?* — answered with numbers;
# 6. self-checks.
#
# Where a cell says **Predict, then run**, write your answer down first: the
# cell after it shows what happened.
#
# It runs on CUDA when torch sees a GPU and on the CPU otherwise; the code is
# the same. The model is the default one, SmolLM2-135M-Instruct.

# %% [markdown]
# ## 1. What to read
#
# | vLLM file | read it for |
# |---|---|
# | [`vllm/v1/worker/gpu_worker.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_worker.py#L109) | `Worker`: one device, one runner; `determine_available_memory` sizes the KV cache, `initialize_from_config` allocates it, `compile_or_warm_up_model` captures graphs |
# | [`vllm/v1/worker/gpu_model_runner.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_model_runner.py#L415) | `GPUModelRunner`: `_update_states` → `_prepare_inputs` → `execute_model` → `sample_tokens`; `_determine_batch_execution_and_padding`, `_dummy_run`, `capture_model`; async scheduling: `_prepare_input_ids` and `AsyncGPUModelRunnerOutput` |
# | [`vllm/v1/worker/gpu_input_batch.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_input_batch.py#L91) | the persistent batch (`InputBatch`) and per-request state (`CachedRequestState`); rows are added, removed, swapped and condensed, and every change is passed on to the logits processors; `prev_sampled_token_ids` / `prev_req_id_to_index`: the last step's samples, still on the device |
# | [`vllm/v1/worker/block_table.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/block_table.py#L18) | block ids per row, and positions → slots |
# | [`vllm/v1/attention/backend.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/attention/backend.py#L353) | `CommonAttentionMetadata`: what every attention backend gets |
# | [`vllm/v1/outputs.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/outputs.py#L233) | `ModelRunnerOutput`: what a step hands back to the scheduler; `AsyncModelRunnerOutput`, its async wrapper |
# | [`vllm/v1/engine/core.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/core.py#L235), [`vllm/v1/core/kv_cache_utils.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/kv_cache_utils.py#L1945), [`vllm/v1/kv_cache_interface.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/kv_cache_interface.py#L152) | `_initialize_kv_caches`: memory → blocks at start-up; `get_kv_cache_configs`, `get_num_blocks`; a block's bytes per layer (`page_size_bytes`) |
# | [`vllm/v1/cudagraph_dispatcher.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/cudagraph_dispatcher.py#L15), [`vllm/config/compilation.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/config/compilation.py#L390) | which graph runs a batch; the graph modes and capture sizes |
#
# At `52a31cc` vLLM has two GPU model runners. `Worker.init_device`
# ([gpu_worker.py#L313](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_worker.py#L313)) builds model
# runner V2 ([`vllm/v1/worker/gpu/model_runner.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu/model_runner.py#L110))
# when [`use_v2_model_runner`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/config/vllm.py#L493) holds: unless
# `VLLM_USE_V2_MODEL_RUNNER` says otherwise, only for `Qwen3ForCausalLM`
# without MoE or quantisation ([`vllm/config/vllm.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/config/vllm.py#L69)).
# Every other model runs on `gpu_model_runner.py`, the runner this session
# reads; SmolLM2 is a `LlamaForCausalLM`, so that is the file to compare
# with. Glassbox has only this runner, for every model (the Qwen3-0.6B
# benchmark of section 4a included).

# %%
import json
import os
import sys
from pathlib import Path

from IPython.display import Markdown, display

# One process: the runner lives in this kernel, so we can open it, and the
# trace is one file with one layout on every run.
os.environ["GLASSBOX_ENABLE_MULTIPROCESSING"] = "0"

import engine  # noqa: E402

REPO = Path(engine.__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "sessions"))  # sessions/lab.py: helpers shared by the notebooks
from lab import reading_table, show_vllm, vllm_line  # noqa: E402


SESSION_FILES = {
    "vllm/v1/worker/gpu_worker.py": [
        "Worker", "Worker.determine_available_memory", "Worker.initialize_from_config",
        "Worker.compile_or_warm_up_model", "Worker.execute_model", "Worker.sample_tokens",
    ],
    "vllm/v1/worker/gpu_model_runner.py": [
        "GPUModelRunner", "GPUModelRunner._update_states", "GPUModelRunner._may_reorder_batch",
        "GPUModelRunner._prepare_inputs", "GPUModelRunner._prepare_input_ids",
        "GPUModelRunner.execute_model", "GPUModelRunner.sample_tokens",
        "GPUModelRunner._determine_batch_execution_and_padding", "GPUModelRunner._dummy_run",
        "GPUModelRunner.profile_run", "GPUModelRunner.capture_model", "GPUModelRunner.initialize_kv_cache",
        "AsyncGPUModelRunnerOutput", "AsyncGPUModelRunnerOutput.get_output",
    ],
    "vllm/v1/worker/gpu_input_batch.py": [
        "CachedRequestState", "InputBatch", "InputBatch.add_request", "InputBatch.remove_request",
        "InputBatch.swap_states", "InputBatch.condense", "InputBatch.refresh_metadata",
    ],
    "vllm/v1/worker/block_table.py": ["BlockTable", "BlockTable.compute_slot_mapping", "BlockTable.commit_block_table"],
    "vllm/v1/attention/backend.py": ["CommonAttentionMetadata", "AttentionMetadataBuilder.build"],
    "vllm/v1/outputs.py": ["ModelRunnerOutput", "AsyncModelRunnerOutput"],
    "vllm/v1/engine/core.py": ["EngineCore._initialize_kv_caches"],
    "vllm/v1/core/kv_cache_utils.py": ["get_kv_cache_configs", "get_num_blocks"],
    "vllm/v1/kv_cache_interface.py": ["AttentionSpec.page_size_bytes"],
    "vllm/v1/cudagraph_dispatcher.py": ["CudagraphDispatcher", "CudagraphDispatcher.dispatch"],
    "vllm/config/compilation.py": ["CUDAGraphMode", "CompilationConfig"],
}
display(Markdown(reading_table(SESSION_FILES)))

# %% [markdown]
# ### Where the reading plan is out of date
#
# From the source map's table of stale paths (`scripts/gen_source_map.py`,
# checked by `tests/test_source_map.py`):

# %%
# NBVAL_CHECK_OUTPUT
sys.path.insert(0, str(REPO / "scripts"))
import gen_source_map  # noqa: E402

for item in gen_source_map.STALE:
    if not item["seed"].startswith("001 · 4"):
        continue
    path, name, approx = item["old"]
    said = f"{path}" + (f" {name}" if name else "")
    now = "\n               ".join(f"{p}:{vllm_line(p, q)} {q}" for p, q in item["now"])
    print(f"plan says  {said}\n  {item['status']:>9}: {now}")

# %% [markdown]
# One more: the reading plan says graphs are captured for "1, 2, 4, 8, …,
# max_num_seqs". Close, not exact. The list is `cudagraph_capture_sizes` in
# `CompilationConfig`; by default at `52a31cc` it is 1, 2, 4, then every 8 up
# to 256 and every 16 above that, up to `max_cudagraph_capture_size`, which
# defaults to twice `max_num_seqs` (at most 512). Which graphs are captured
# (`FULL_DECODE_ONLY`, `FULL_AND_PIECEWISE`, …) is `cudagraph_mode`.
# Glassbox follows the same list and the same modes; its default on CUDA is
# vLLM's `-O2` (`FULL_AND_PIECEWISE` over the compiled model), on the CPU
# `-O0` (no compiler, no graphs).
#
# ## 2. The engine and a staged workload
#
# `max_num_batched_tokens=32` is the step's token budget. Two short prompts
# start first; once both are decoding, a 64-token prompt arrives. The
# scheduler serves running requests first (one token each), then gives the
# newcomer what is left of the budget — 30 tokens — so its prefill is cut
# into chunks of 30, 30 and 4, each sharing a step with the two decodes.
# Those are the *mixed* batches this session is about.
#
# We drive `LLMEngine` by hand (`add_request`, `step`) to control when each
# request arrives. Under async scheduling one `step()` schedules and launches
# a step, then reads the output of the step before it (the first call has
# none to read): after the two calls below, step 1's tokens are on the host
# and step 2 is still in flight when `r2` is added; `r2` joins at step 3.
# `add_request("r0", ...)` returns the request's internal id
# (`r0-` and eight random hex digits, as in vLLM; session 02 explains why),
# and that is the only id the scheduler, the worker and the trace see.
# `LABEL` maps it back to `r0`, so the tables below read the same on every
# run. Before the first step we wrap the live runner's
# `_prepare_inputs` so that every step leaves a copy of the tensors it built.
# Ours returns a `PreparedInputs`, a dataclass of Glassbox's own (vLLM's
# returns the logits indices and the spec-decode metadata and leaves the rest
# in the runner's buffers); the wrapper takes the attention metadata and the
# logits indices from it, the token ids and positions from the buffers. It
# also keeps the token ids as the host had them (`input_ids_np`) and the
# batch's `prev_req_id_to_index`, for section 3d.

# %%
import tempfile
import time

import numpy as np
import torch

from engine import LLM, SamplingParams
from engine.tracing import RunnerBatch, TraceReplay, load_trace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRACE = Path(tempfile.mkdtemp(prefix="glassbox-session04-")) / "worker.jsonl"
BLOCK_SIZE = 16
t0 = time.perf_counter()
llm = LLM(
    trace_path=str(TRACE),
    trace_level="full",
    max_num_batched_tokens=32,
    max_num_seqs=16,
    num_gpu_blocks_override=64,
    max_model_len=512,
    block_size=BLOCK_SIZE,
    disable_log_stats=True,
)
core = llm.llm_engine.engine_core.engine_core  # EngineCore (in this process)
worker = core.model_executor.driver_worker  # Worker
runner = worker.model_runner  # GPUModelRunner
print(f"engine ready in {time.perf_counter() - t0:.1f} s on {DEVICE}; "
      f"runner: {type(runner).__name__}, attention backend: {runner.attn_backend.get_name()}, "
      f"reorder_batch_threshold: {runner.reorder_batch_threshold}")

# %%
captured = {}  # step -> what _prepare_inputs built (host copies), requests by our names
LABEL: dict[str, str] = {}  # internal request id -> the id we passed to add_request
_original_prepare_inputs = runner._prepare_inputs


def recording_prepare_inputs(scheduler_output):
    inputs = _original_prepare_inputs(scheduler_output)  # a PreparedInputs
    common, num_tokens = inputs.common_attn_metadata, inputs.num_tokens
    rows = common.num_reqs
    captured[scheduler_output.step] = {
        "req_ids": [LABEL[r] for r in runner.input_batch.req_ids],
        "new_reqs": {LABEL[r.req_id]: (list(r.block_ids[0]), r.num_computed_tokens)
                     for r in scheduler_output.scheduled_new_reqs},
        "cached_reqs": {LABEL[rid]: (list(nb[0]) if nb else [], n) for rid, nb, n in zip(
            scheduler_output.scheduled_cached_reqs.req_ids,
            scheduler_output.scheduled_cached_reqs.new_block_ids,
            scheduler_output.scheduled_cached_reqs.num_computed_tokens)},
        "num_scheduled_tokens": {LABEL[r]: n for r, n in scheduler_output.num_scheduled_tokens.items()},
        "input_ids": runner.input_ids[:num_tokens].cpu().tolist(),  # what the model reads
        "host_input_ids": inputs.input_ids_np[:num_tokens].tolist(),  # gathered from the host's token lists
        # request -> its row in the previous step, for each request whose sample
        # the runner kept on the device there (None before the first sample)
        "prev_rows": {LABEL[r]: i for r, i in (runner.input_batch.prev_req_id_to_index or {}).items()},
        "positions": runner.positions[:num_tokens].cpu().tolist(),
        "query_start_loc": common.query_start_loc.cpu().tolist(),
        "seq_lens": common.seq_lens.cpu().tolist(),
        "slot_mapping": common.slot_mapping.cpu().tolist(),
        "block_table": common.block_table_tensor[:rows].cpu().tolist(),
        "logits_indices": inputs.logits_indices.cpu().tolist(),
        "max_query_len": common.max_query_len,
        # A FULL CUDA graph (GPU only) runs a fixed size: the runner pads the
        # step with tokens at slot -1 and rows of zero query tokens.
        "graph": inputs.cudagraph_mode.name,
        "padded_tokens": inputs.batch_descriptor.num_tokens,
        "padded_rows": rows,
    }
    return inputs


runner._prepare_inputs = recording_prepare_inputs  # an instance attribute shadows the method

# What each step handed back: sample_tokens' return value (the engine keeps it
# until the next loop turn), and the ModelRunnerOutput update_from_output reads.
runner_outputs = {}  # step -> the fields of its ModelRunnerOutput, requests by our names
returned = set()  # type names sample_tokens returned
_sample_tokens, _update_from_output = runner.sample_tokens, core.scheduler.update_from_output


def recording_sample_tokens(*args, **kwargs):
    out = _sample_tokens(*args, **kwargs)
    returned.add(type(out).__name__)
    return out


def recording_update_from_output(scheduler_output, model_runner_output):
    mro = model_runner_output
    runner_outputs[scheduler_output.step] = {
        "type": type(mro).__name__,
        "req_ids": [LABEL[r] for r in mro.req_ids],
        "req_id_to_index": {LABEL[r]: i for r, i in mro.req_id_to_index.items()},
        "sampled_token_ids": [list(t) for t in mro.sampled_token_ids],
        "logprobs": mro.logprobs,
        "prompt_logprobs_dict": dict(mro.prompt_logprobs_dict),
    }
    return _update_from_output(scheduler_output, model_runner_output)


runner.sample_tokens = recording_sample_tokens
core.scheduler.update_from_output = recording_update_from_output

# %%
PROMPTS = {
    "r0": "The three primary colours of light are",
    "r1": "A haiku about autumn rain:",
    "r2": ("In a paged KV cache, each sequence owns a list of fixed-size blocks rather than one "
           "contiguous buffer. The scheduler hands out block ids; the worker turns every token "
           "position into a slot inside one of those blocks, and the attention kernel gathers keys "
           "and values through the same table. Summary in one sentence:"),
}
params = {
    "r0": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    "r1": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    "r2": SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
}
llm_engine = llm.llm_engine


def add(request_id, prompt, sampling_params):
    LABEL[llm_engine.add_request(request_id, prompt, sampling_params)] = request_id


texts = {}
add("r0", PROMPTS["r0"], params["r0"])
add("r1", PROMPTS["r1"], params["r1"])
step_log = []
for _ in range(2):  # launch step 1 (both prefills), then step 2 (one decode) and read step 1
    step_log += llm_engine.step()
add("r2", PROMPTS["r2"], params["r2"])  # arrives while r0 and r1 decode
while llm_engine.has_unfinished_requests():
    step_log += llm_engine.step()
for out in step_log:
    if out.finished:
        texts[out.request_id] = out.outputs[0].text
print({rid: t for rid, t in sorted(texts.items())})

# %% [markdown]
# ## 3. The steps, from the trace
#
# `runner.batch` is written by the runner once per step, after it has laid
# the batch out: rows (one per request), tokens per row (`query_lens`), the
# context before (`num_computed_tokens`) and after (`seq_lens`) the step, the
# KV slots written (`slot_mapping`, as runs of `[block, first offset, count]`),
# rows whose sample is thrown away (mid-prompt chunks), and the CUDA graph
# decision.

# %%
# NBVAL_CHECK_OUTPUT
llm.llm_engine.tracer.flush()
events = load_trace(str(TRACE))
replay = TraceReplay(events)
batches = {e.step: e for e in events if e.kind == "runner.batch"}


def kind_of(batch: RunnerBatch) -> str:
    prefill = any(q > 1 or c == 0 for q, c in zip(batch.query_lens, batch.num_computed_tokens))
    decode = any(q == 1 and c > 0 for q, c in zip(batch.query_lens, batch.num_computed_tokens))
    return "mixed" if prefill and decode else ("prefill" if prefill else "decode")


print("step  kind     tokens  rows (request:query_len)            discarded  graph")
for step, b in sorted(batches.items()):
    rows = ", ".join(f"{LABEL[r]}:{q}" for r, q in zip(b.req_ids, b.query_lens))
    discarded = ",".join(LABEL[r] for r in b.discard_req_ids) or "-"
    print(f"{step:>4}  {kind_of(b):<8} {b.num_tokens:>6}  {rows:<36} {discarded:<10} "
          f"{b.cudagraph_mode}")

# %% [markdown]
# ### 3a. The first mixed step, taken apart
#
# Step 3: `r0` and `r1` decode one token each, `r2` computes the first 30 of
# its 64 prompt tokens. The runner flattens all 32 tokens into one list. Per
# token it needs:
#
# * `input_ids` — the token to embed: gathered from the host's token lists,
#   except the last token of each request that sampled in the previous step,
#   which is not on the host yet (section 3d);
# * `positions` — its position in its own sequence (for RoPE):
#   `num_computed_tokens[row] + offset within the row's chunk`;
# * `slot_mapping` — the flat KV-cache slot its key and value are written to:
#   `block_table[row, pos // 16] * 16 + pos % 16`;
#
# and per row:
#
# * `query_start_loc` — where each row's tokens start in the flat list (a
#   prefix sum of `query_lens`, `num_reqs + 1` entries);
# * `seq_lens` — how many tokens of context the row attends to after the step;
# * the row's block table (padded with zeros; block 0 is the null block);
# * `logits_indices` — the last token of each row, the only ones whose hidden
#   state goes through the LM head.
#
# **Predict, then run.** In step 3, `r0` (7 prompt tokens, 2 sampled so far,
# the second still in flight) feeds one token. At which position, and into
# which KV slot, if `r0`'s only block is block 1? What is `query_start_loc`?

# %%
# NBVAL_CHECK_OUTPUT
MIXED = next(s for s, b in sorted(batches.items()) if kind_of(b) == "mixed")
b, live = batches[MIXED], captured[MIXED]
print(f"step {MIXED}: rows {[LABEL[r] for r in b.req_ids]}, query_lens {b.query_lens}, "
      f"num_computed_tokens {b.num_computed_tokens}, seq_lens {b.seq_lens}")
print("new requests this step (id: block ids, computed):", live["new_reqs"])
print("cached requests (id: new block ids, computed):   ", live["cached_reqs"])
print("query_start_loc:", live["query_start_loc"])
print("seq_lens:       ", live["seq_lens"])
print("positions:      ", live["positions"])
print("slot_mapping:   ", live["slot_mapping"])
print("logits_indices: ", live["logits_indices"], "  max_query_len:", live["max_query_len"])
print("block table rows (first 5 columns):")
for rid, row in zip(live["req_ids"], live["block_table"]):
    print(f"  {rid}: {row[:5]}")
print("trace slot runs [block, offset, count]:", b.slot_mapping)
print("discarded samples (mid-prompt):", [LABEL[r] for r in b.discard_req_ids])

# %% [markdown]
# Read it row by row. `r0` has 7 prompt tokens and has sampled 2: step 1's
# token, read by the host, and step 2's, whose output the engine has not read
# yet. It feeds in that second one now, at position 8, so its key and value
# go to slot `1 * 16 + 8 = 24` (block 1 is its only block). `r2` is new:
# positions 0–29, slots 48–63 (all of block 3) and 64–77 (most of block 4). `query_start_loc = [0, 1, 2, 32]` says rows 0 and 1 are one token
# each and row 2 is thirty. Only three hidden states (indices 0, 1, 31) reach
# the LM head, and `r2`'s sample is discarded: it is in the middle of its
# prompt.
#
# The same step as a picture, drawn from the captured tensors: one column per
# token of the flattened batch.

# %%
import subprocess

from IPython.display import SVG

ROW_COLOURS = ["#e9c46a", "#a8dadc", "#f4a261", "#cdb4db", "#b7e4c7"]


def dot_svg(source: str) -> SVG:
    """Render Graphviz source with the `dot` binary (apt: graphviz)."""
    result = subprocess.run(["dot", "-Tsvg"], input=source, capture_output=True, text=True, check=True)
    return SVG(result.stdout)


def batch_dot(step: int) -> str:
    live = captured[step]
    qsl = live["query_start_loc"]
    row_of = np.repeat(np.arange(len(live["req_ids"])), np.diff(qsl))
    logits = set(live["logits_indices"])

    def cell(text, colour, bold=False):
        text = f"<B>{text}</B>" if bold else text
        return f'<TD BGCOLOR="{colour}">{text}</TD>'

    header = "".join(cell(i, ROW_COLOURS[row_of[i]], i in logits) for i in range(len(row_of)))
    req = "".join(cell(live["req_ids"][row_of[i]], ROW_COLOURS[row_of[i]]) for i in range(len(row_of)))
    pos = "".join(cell(p, "white") for p in live["positions"])
    slot = "".join(cell(s, "white") for s in live["slot_mapping"])
    tokens = (f'<TR><TD>index</TD>{header}</TR><TR><TD>request</TD>{req}</TR>'
              f'<TR><TD>position</TD>{pos}</TR><TR><TD>slot</TD>{slot}</TR>')
    rows = []
    for r, (rid, table) in enumerate(zip(live["req_ids"], live["block_table"])):
        n_blocks = -(-live["seq_lens"][r] // BLOCK_SIZE)
        blocks = "".join(cell(x, ROW_COLOURS[r]) for x in table[:n_blocks])
        rows.append(f'<TR><TD>{rid}</TD><TD>qsl {qsl[r]}–{qsl[r + 1]}</TD><TD>seq_len {live["seq_lens"][r]}</TD>{blocks}</TR>')
    label = (f'<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="3">'
             f'<TR><TD COLSPAN="{len(row_of) + 1}"><B>step {step}: the flattened batch '
             f'(bold index = a logits row)</B></TD></TR>{tokens}</TABLE>>')
    table_label = ('<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="3">'
                   '<TR><TD COLSPAN="8"><B>block table rows (the blocks in use)</B></TD></TR>'
                   + "".join(rows) + "</TABLE>>")
    return ('digraph batch { rankdir=TB; node [shape=plaintext, fontname="sans-serif", fontsize=9]; '
            f"tokens [label={label}]; tables [label={table_label}]; tokens -> tables [style=invis]; }}")


dot_svg(batch_dot(MIXED))

# %% [markdown]
# ### 3b. Recompute it by hand
#
# The runner does this with a handful of numpy operations (see
# `GPUModelRunner._prepare_inputs`). Here is the same arithmetic, from
# nothing but what the scheduler sent (`num_scheduled_tokens`, each
# request's `num_computed_tokens`) and the block tables — and it must agree
# with the tensors the runner built.

# %%
# NBVAL_CHECK_OUTPUT
def recompute(live: dict) -> dict:
    req_ids = live["req_ids"]
    n = np.array([live["num_scheduled_tokens"][r] for r in req_ids])
    computed = np.array([live["new_reqs"].get(r, live["cached_reqs"].get(r, (None, 0)))[1] for r in req_ids])
    rows = np.repeat(np.arange(len(req_ids)), n)                   # row of every token
    offsets = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)  # offset inside its row's chunk
    positions = computed[rows] + offsets
    table = np.array(live["block_table"])
    slots = table[rows, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    mine = {
        "positions": positions.tolist(),
        "slot_mapping": slots.tolist(),
        "query_start_loc": [0, *np.cumsum(n).tolist()],
        "seq_lens": (computed + n).tolist(),
        "logits_indices": (np.cumsum(n) - 1).tolist(),
    }
    if live["graph"] == "FULL":  # padded to the graph's size
        pad_rows = live["padded_rows"] - len(req_ids)
        mine["slot_mapping"] += [-1] * (live["padded_tokens"] - n.sum())
        mine["query_start_loc"] += [int(n.sum())] * pad_rows
        mine["seq_lens"] += [0] * pad_rows
    return mine


for step in sorted(captured):
    mine, theirs = recompute(captured[step]), captured[step]
    same = all(mine[k] == theirs[k] for k in mine)
    padding = ""
    if theirs["padded_rows"] > len(theirs["req_ids"]):  # only a FULL graph adds rows
        padding = f" (FULL graph of {theirs['padded_tokens']}: padding included)"
    print(f"step {step:>2}: recomputed positions, slots, query_start_loc, seq_lens, logits_indices "
          f"== runner's: {same}{padding}")

# %% [markdown]
# ### 3c. The persistent batch
#
# The runner does not rebuild its state every step. `InputBatch` keeps one
# row per running request — token ids, computed-token count, block table row,
# sampling state — and `_update_states` applies only the scheduler's deltas:
# new requests get a row, finished ones leave and the rows are condensed,
# running ones get their new block ids appended. Then, if the attention
# backend asks for it (its builder's `reorder_batch_threshold`: 1 for
# FlashInfer, None for Triton and for the CPU backend on x86),
# `_may_reorder_batch` swaps rows (`InputBatch.swap_states`) so that decodes
# come before prefills. The logits processors (min-p, logit bias, min-tokens)
# are persistent too: built once when the runner starts, they are told of
# every row added, removed or moved as a `BatchUpdate` (`refresh_metadata`)
# instead of being rebuilt each step. Under async scheduling a sampled token
# enters the row's token ids (`token_ids_cpu`) as -1 and stays so: the one
# step that reads it as input takes it from the device (section 3d).
#
# The scheduler therefore sends full data only once per request
# (`NewRequestData`) and small deltas after that (`CachedRequestData`).
# Watch `r2` across its three prefill chunks:

# %%
# NBVAL_CHECK_OUTPUT
for step in sorted(captured):
    live = captured[step]
    if "r2" in live["new_reqs"]:
        print(f"step {step}: r2 arrives as NewRequestData, block ids {live['new_reqs']['r2'][0]}, computed {live['new_reqs']['r2'][1]}")
    elif "r2" in live["cached_reqs"]:
        new_blocks, computed = live["cached_reqs"]["r2"]
        print(f"step {step}: r2 as CachedRequestData, new block ids {new_blocks}, computed {computed}")
last = max(s for s, b in batches.items() if "r2" in captured[s]["req_ids"])
row = captured[last]["req_ids"].index("r2")
n_blocks = -(-captured[last]["seq_lens"][row] // BLOCK_SIZE)
print(f"r2's block table row at step {last}, its last step: {captured[last]['block_table'][row][:n_blocks]} "
      f"(the worker's copy, assembled from those deltas)")
print("logits processors kept by the input batch:",
      [type(proc).__name__ for proc in runner.input_batch.logitsprocs.all])

# %% [markdown]
# ### 3d. Input ids the host does not have yet
#
# Under async scheduling the runner does not wait for its samples.
# `sample_tokens` returns an `AsyncGPUModelRunnerOutput` at once (on CUDA its
# device→host copy is queued on a stream of its own), writes a -1 into the
# token list of each row whose sample is kept, and leaves the ids on the
# device:
# `input_batch.prev_sampled_token_ids`, with `prev_req_id_to_index` giving
# each request's row. The engine calls the output's `get_output()` one loop
# turn later, after it has scheduled and launched the next step. So when
# that step's `_prepare_inputs` gathers ids from the host, the last token of
# every request that sampled is the -1. `_prepare_input_ids` copies the
# host's ids to the device and then writes the previous step's samples over
# those positions, on the device: one slice copy when those decodes lead the
# batch in the rows they had, an indexed copy otherwise. The scheduler had counted each of those
# tokens as a placeholder (`Request.num_output_placeholders`) when it
# scheduled the step that samples it.
#
# In vLLM, `_prepare_inputs` gathers the host's ids
# ([L1923](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_model_runner.py#L1923)) and
# [`_prepare_input_ids`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_model_runner.py#L1691) fills in the rest: it uploads the host's
# ids only when not every token is one of those samples, then does a slice
# `copy_` or a `scatter_`, with each row's previous row from
# [`_compute_prev_positions`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_model_runner.py#L1676). `_bookkeeping_sync` keeps the
# samples on the device ([L3597](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_model_runner.py#L3597)) and writes the -1s
# ([L3612](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_model_runner.py#L3612)); `sample_tokens` wraps the output in an
# [`AsyncGPUModelRunnerOutput`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_model_runner.py#L236) ([L4569](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_model_runner.py#L4569)), whose
# [`get_output`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_model_runner.py#L279) waits for the copy.
#
# Per step of the run: the positions of `input_ids` the runner filled on the
# device (each request's row in the previous step in brackets), what the
# host had there, whether the id the model read is the one the trace's
# `sampler.sampled` event recorded for that request, at that row, one step
# earlier, and the replay's count of placeholder inputs per request
# (`TraceReplay.view(step).num_placeholder_inputs`, derived from the
# scheduler's events alone).

# %%
# NBVAL_CHECK_OUTPUT
sampled = {}  # (step, request) -> (row, token id), from the trace's sampler.sampled events
for e in events:
    if e.kind == "sampler.sampled":
        sampled[e.step, LABEL[e.request_id]] = (e.row, e.token_id)


def from_device(step: int) -> list[tuple[int, str, int]]:
    """(flat index, request, its row at step - 1) of each input id taken on the device."""
    live = captured[step]
    ends = live["query_start_loc"][1:]
    return [(ends[row] - 1, rid, live["prev_rows"][rid])
            for row, rid in enumerate(live["req_ids"]) if rid in live["prev_rows"]]


def matches_last_sample(step: int) -> bool:
    live = captured[step]
    return all(sampled[step - 1, rid] == (prev, live["input_ids"][i]) for i, rid, prev in from_device(step))


print(f"engine loop: {core.step_fn.__name__}, batch queue of {core.batch_queue_size}")
print("step  rows               on the device                host had  = sampled at step-1  trace: placeholder inputs")
for step in sorted(batches):
    live, dev = captured[step], from_device(step)
    rows = " ".join(f"{r}:{q}" for r, q in zip(live["req_ids"], np.diff(live["query_start_loc"])))
    took = ", ".join(f"{i}<-{rid}({prev})" for i, rid, prev in dev)
    host = ",".join(str(t) for t in sorted({live["host_input_ids"][i] for i, _, _ in dev}))
    trace = {LABEL[r]: n for r, n in replay.view(step).num_placeholder_inputs.items()}
    print(f"{step:>4}  {rows:<18} {took or '-':<28} {host or '-':<9} "
          f"{str(matches_last_sample(step)) if dev else '-':<18} {trace or '-'}")
n_inputs = sum(len(captured[s]["input_ids"]) for s in batches)
n_device = sum(len(from_device(s)) for s in batches)
n_minus_one = sum(captured[s]["host_input_ids"].count(-1) for s in batches)
print(f"input ids in steps 1-{max(batches)}: {n_inputs}; taken on the device: {n_device}; "
      f"-1 on the host: {n_minus_one}")

# %% [markdown]
# Every decode input of the run came from the device — 16 ids, one per
# decoding request per step, exactly where the host held its 16 -1s. `r2`
# shows the rule: at steps 4 and 5 it has no entry in
# `prev_req_id_to_index`, because its samples at steps 3 and 4 (mid-prompt)
# were thrown away, and all its inputs are prompt tokens from the host; its
# first decode, at step 6, reads the token sampled at step 5 in row 2. Here
# the decodes always lead the batch in the rows they had, so every step took
# the one-slice copy; when rows move (`condense` refilling a finished request's row, a reorder
# that puts decodes first) the same lookup feeds the indexed copy. With
# `async_scheduling=False` the host has every id before it prepares the
# step: no -1, and `prev_sampled_token_ids` stays `None`.

# %% [markdown]
# ### 3e. What the step hands back: `ModelRunnerOutput`
#
# `sample_tokens` ends the step on the worker's side. Under async scheduling
# it returns an `AsyncGPUModelRunnerOutput` at once; one loop turn later the
# engine calls its `get_output()`, which waits for the device→host copy of
# the sampled ids and gives the plain
# [`ModelRunnerOutput`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/outputs.py#L233) that `Scheduler.update_from_output`
# reads (session 02 follows it from there). The notebook wrapped both ends
# before the run.
#
# **Predict, then run.** In the mixed step, `r2` ran 30 prompt tokens and
# its sample was thrown away. What is `r2`'s entry in `sampled_token_ids`?

# %%
# NBVAL_CHECK_OUTPUT
import dataclasses

from engine.v1.outputs import ModelRunnerOutput

print("sample_tokens returned:", sorted(returned))
print("fields of ModelRunnerOutput:", [f.name for f in dataclasses.fields(ModelRunnerOutput)])
print(f"step {MIXED}, as update_from_output received it:")
for field, value in runner_outputs[MIXED].items():
    print(f"  {field}: {value}")
kept = [e for e in events if e.kind == "sampler.sampled" and e.request_id not in batches[e.step].discard_req_ids]
same = all(runner_outputs[e.step]["sampled_token_ids"][runner_outputs[e.step]["req_id_to_index"][LABEL[e.request_id]]]
           == [e.token_id] for e in kept)
print("every kept sample in the trace's sampler.sampled events is in its step's ModelRunnerOutput:", same)

# %% [markdown]
# One row per request of the batch, in the batch's order (`req_id_to_index`
# finds a request's row); one list of tokens per row: one token for a
# decode or a prompt's last chunk, none for `r2`'s mid-prompt chunk (the
# runner sampled the row with the others, then dropped it). With speculative
# decoding a row holds every accepted draft plus one. `logprobs` is `None`
# because no request asked for any. vLLM's dataclass has more fields
# (pooling outputs, KV-connector state, NaN counts, CUDA graph statistics,
# routed experts) for features Glassbox does not have.
#
# ### 3f. Before the first step: the profiling run, `_dummy_run`, and the KV cache's size
#
# Everything above ran on a KV cache of 64 blocks because the engine was told
# so (`num_gpu_blocks_override=64`). Without that, the number of blocks is
# decided once, at start-up, by
# [`EngineCore._initialize_kv_caches`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/core.py#L235):
#
# 1. **How many bytes may the KV cache have?**
#    [`Worker.determine_available_memory`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_worker.py#L358). On a GPU it runs the
#    model once on a dummy batch of `max_num_batched_tokens` tokens with no
#    KV cache (`profile_run`), reads the peak memory torch allocated (the
#    weights plus the largest activations), and returns
#    `total × gpu_memory_utilization − peak − memory others hold`. On a CPU
#    Glassbox does not profile: the answer is a setting,
#    `GLASSBOX_CPU_KVCACHE_SPACE` GiB (default 1). vLLM's CPU worker
#    ([cpu_worker.py#L169](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/cpu_worker.py#L169)) takes an explicit size when given one
#    (`VLLM_CPU_KVCACHE_SPACE`) and otherwise what its memory share leaves
#    after the process's own use.
# 2. **How many bytes does one block cost?** Per layer,
#    `page_size_bytes` = 2 (K and V) × `block_size` × KV heads × head size ×
#    bytes per element; a block id names one page in every layer.
# 3. **Divide** ([`get_num_blocks`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/kv_cache_utils.py#L935)): `available // page_size // num_layers`.
#
# Then the check that one `max_model_len` sequence fits. Asked for
# `max_model_len=-1` (`--max-model-len auto`), vLLM first cuts `max_model_len`
# to the longest sequence that does
# ([`_auto_fit_max_model_len`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/kv_cache_utils.py#L1839)),
# tells the workers and, in its ready message, the front end; Glassbox too.
#
# The profiling run, the compile warm-up and the capture of piecewise graphs
# (section 4) run the model through `_dummy_run`: a forward over the first
# `n` entries of the runner's input buffers with no attention metadata, so
# attention writes no KV and returns zeros. vLLM's `_dummy_run`
# ([L5538](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_model_runner.py#L5538)) does more (it can
# build attention metadata, pick a graph mode, pad). The sizing itself, in
# vLLM:

# %%
show_vllm("vllm/v1/worker/gpu_worker.py", "Worker.determine_available_memory", 40)

# %% [markdown]
# The same calls, on this notebook's live worker and runner. First the
# arithmetic (on CUDA `determine_available_memory` profiles this engine, which
# already holds its 64-block cache and its graphs, so the figure comes out a
# little smaller than at start-up):
#
# **Predict, then run.** SmolLM2 has 30 layers and 3 KV heads of 64 dims; on a
# CPU it runs in float32. How many 16-token blocks fit in 1 GiB? How many
# 512-token requests is that?

# %%
# NBVAL_CHECK_OUTPUT
spec = worker.get_kv_cache_spec()  # one spec per attention layer, all equal here
layer_spec = next(iter(spec.values()))
dtype_bytes = torch.tensor([], dtype=getattr(torch, layer_spec.dtype)).element_size()
page = layer_spec.page_size_bytes
print(f"{len(spec)} layers x {type(layer_spec).__name__}(block_size={layer_spec.block_size}, "
      f"num_kv_heads={layer_spec.num_kv_heads}, head_size={layer_spec.head_size}, dtype={layer_spec.dtype})")
print(f"one block, one layer:  2 x {layer_spec.block_size} x {layer_spec.num_kv_heads} x {layer_spec.head_size} "
      f"x {dtype_bytes} = {page:,} bytes")
print(f"one block, all layers: {page * len(spec):,} bytes")

# %%
import copy
import os

from engine.v1.core.kv_cache_utils import get_kv_cache_configs

t0 = time.perf_counter()
available = worker.determine_available_memory()
seconds = time.perf_counter() - t0
# The same config without the override, so the engine's own sizing answers.
config = copy.copy(llm.llm_engine.glassbox_config)
config.cache_config = copy.copy(config.cache_config)
config.cache_config.num_gpu_blocks_override = None
num_blocks = get_kv_cache_configs(config, [spec], [available])[0].num_blocks
space = os.environ.get("GLASSBOX_CPU_KVCACHE_SPACE")
source = (f"GLASSBOX_CPU_KVCACHE_SPACE={space or 'unset, so 1'} GiB, no profiling" if DEVICE == "cpu"
          else f"profiled in {seconds:.1f} s")
print(f"available for the KV cache on this {DEVICE}: {available:,} bytes ({available / 2**30:.2f} GiB; {source})")
print(f"num_blocks = {available:,} // {page:,} // {len(spec)} = {available // page // len(spec)}; "
      f"get_kv_cache_configs says {num_blocks}")
max_len = llm.llm_engine.model_config.max_model_len
print(f"= {num_blocks * BLOCK_SIZE:,} token slots; a {max_len}-token request needs {-(-max_len // BLOCK_SIZE)} blocks, "
      f"so {num_blocks / -(-max_len // BLOCK_SIZE):.1f} of them fit at once")
assert num_blocks == available // page // len(spec)

# %% [markdown]
# Then `_dummy_run`, the way `profile_run` calls it (it runs the whole dummy
# batch, then the LM head and the sampler, at its costliest settings: top-k,
# top-p, temperature, on one row per possible request, as vLLM's
# `_dummy_sampler_run` does). The wrapper
# counts its calls; the KV cache is compared before and after.

# %%
# NBVAL_CHECK_OUTPUT
dummy_calls = []
_dummy_run = runner._dummy_run


def counting_dummy_run(num_tokens):
    dummy_calls.append(num_tokens)
    return _dummy_run(num_tokens)


kv_before = [t.clone() for t in runner.kv_caches]
runner._dummy_run = counting_dummy_run
runner.profile_run()
hidden = runner._dummy_run(5)
runner._dummy_run = _dummy_run
print(f"profile_run called _dummy_run({dummy_calls[0]}): max_num_batched_tokens = {runner.max_num_tokens}")
print(f"_dummy_run(5) -> hidden states of shape {tuple(hidden.shape)} (tokens x hidden size)")
print("the KV cache is untouched by both:", all(torch.equal(a, b) for a, b in zip(kv_before, runner.kv_caches)))
del kv_before

# %% [markdown]
# ## 4. CUDA graphs: capture sizes and padding
#
# A CUDA graph records a sequence of kernel launches once and replays it
# with one call. It replays *fixed shapes at fixed addresses*: the graph for
# 16 tokens always reads 16 input ids from the same buffer. So the runner
# keeps persistent input buffers (`runner.input_ids`, `positions`,
# `slot_mapping`, …) and copies each step's values into them (the previous
# step's samples too: `_prepare_input_ids` writes them into the same
# `input_ids`, so a replayed graph reads them without a trip through the
# host); the engine
# captures one graph per size in `cudagraph_capture_sizes`; and each step the
# dispatcher picks the smallest captured size that fits, or says "eager".
# The rows added to reach that size are padding: token 0 at position 0, slot
# `-1` (nothing is written), a query of length 0 — work whose result nobody
# reads.
#
# On this machine:

# %%
print(f"device: {DEVICE}; dispatcher mode in the live runner: {runner.cudagraph_dispatcher.mode.name}; "
      f"graphs captured: {sorted(k.num_tokens for k in runner.cudagraph_dispatcher.captured)}")
print("graph mode the trace recorded per step:", sorted({b.cudagraph_mode for b in batches.values()}),
      "| padded tokens != tokens in any step:", any(b.num_tokens_padded != b.num_tokens for b in batches.values()))

# %% [markdown]
# On a CPU there are no graphs (the runner sets the mode to `NONE`). The
# decision itself is plain Python, though, and runs anywhere: below is the
# runner's own `CudagraphDispatcher`, built from a `CompilationConfig` as it
# would be for `max_num_seqs=64` on a GPU, with every decode size marked as
# captured the way `capture_model()` does.
#
# **Predict, then run.** Under `FULL_DECODE_ONLY`, what runs a step of 13
# decodes: which graph size, or eager? A mixed step of 13 tokens? And under
# `FULL_AND_PIECEWISE`?

# %%
# NBVAL_CHECK_OUTPUT
from engine.config.compilation import CompilationConfig, CUDAGraphMode
from engine.v1.cudagraph_dispatcher import CudagraphDispatcher

def captured_dispatcher(**settings):
    """The dispatcher for max_num_seqs=64, every key capture_model() would capture marked done."""
    config = CompilationConfig(**settings)
    config.finalize(max_num_seqs=64, enforce_eager=False, max_num_batched_tokens=128)
    dispatcher = CudagraphDispatcher(config, max_num_tokens=128, max_num_reqs=64)
    dispatcher.captured.update(dispatcher.decode_keys() + dispatcher.piecewise_keys())
    return config, dispatcher


levels = {  # what -O0 (with decode graphs asked for), -O1 and -O2 set
    "FULL_DECODE_ONLY": dict(mode=0, cudagraph_mode="FULL_DECODE_ONLY"),
    "PIECEWISE": dict(mode=3, cudagraph_mode="PIECEWISE"),
    "FULL_AND_PIECEWISE": dict(mode=3, cudagraph_mode="FULL_AND_PIECEWISE"),
}
dispatchers = {}
for name, settings in levels.items():
    config, dispatchers[name] = captured_dispatcher(**settings)
    print(f"{name:>18}: capture sizes {config.cudagraph_capture_sizes[:6]} ... "
          f"{config.cudagraph_capture_sizes[-2:]}")
print()
print(" tokens  uniform decode?  " + "  ".join(f"{name:>18}" for name in levels))
for n, uniform in [(1, True), (3, True), (13, True), (57, True), (64, True),
                   (13, False), (65, False), (100, False), (129, False)]:
    cells = []
    for name, dispatcher in dispatchers.items():
        mode, desc = dispatcher.dispatch(n, uniform_decode=uniform)
        padded = n if mode == CUDAGraphMode.NONE else desc.num_tokens
        cells.append(f"{mode.name:>9} -> {padded:>4}")
    print(f"{n:>7}  {str(uniform):<15}  " + "  ".join(f"{c:>18}" for c in cells))

# %% [markdown]
# Each cell is the runtime mode and the token count the step is padded to. A
# mixed batch (like step 3 above) never gets a FULL graph: its shape — how many
# prefill tokens, in how many rows — varies too much to capture, so under
# `FULL_DECODE_ONLY` it runs eagerly. The piecewise modes cover it: everything
# except attention is captured per token count, attention runs eagerly
# between the pieces, and padding adds tokens only, never requests. That needs
# the model compiled and split at its attention ops (`engine/compilation/`,
# `docs/compilation.md`). `FULL_AND_PIECEWISE` (vLLM's default, `-O2`) gives pure decodes
# the full graph and everything else the pieces; `PIECEWISE` (`-O1`) gives
# everyone the pieces. Past the largest size (128 here: twice `max_num_seqs`,
# capped by the token budget) every mode runs eagerly.
#
# ### 4a. What graphs buy: the committed H200 numbers
#
# These are **Glassbox's** numbers, not vLLM's: Glassbox's own engine and
# kernels, measured by its own benchmarks. `benchmarks/gpu_throughput.py` ran
# Glassbox on an H200 with the Qwen3-0.6B architecture (dummy weights,
# bf16): decode steps at a 512-token context,
# timed as whole `EngineCore.step()` calls — the serial loop, each step
# waiting for its own tokens — once with CUDA graphs and once with
# `enforce_eager=True`. That run is committed as
# `benchmarks/results/gpu_throughput_h200.json` (earlier runs are in
# `history.jsonl` beside it). `benchmarks/async_scheduling.py` timed the
# same decode steps with the serial loop and with the default async one
# (`benchmarks/results/async_scheduling_h200.json`), and
# `benchmarks/gpu_profile_step.py` profiled the async batch-1 step. These
# are their numbers.

# %%
gpu = json.loads((REPO / "benchmarks/results/gpu_throughput_h200.json").read_text())
graph_ms = {int(k): v["mean_ms"] for k, v in gpu["decode_latency_cudagraphs"].items()}
eager_ms = {int(k): v["mean_ms"] for k, v in gpu["decode_latency_eager"].items()}
floor_ms = {int(k): v["floor_ms"] for k, v in gpu["decode_latency_cudagraphs"].items()}
print(f"{gpu['gpu']}, {gpu['model']}, torch {gpu['torch']}, attention {gpu['engine']['attention_backend']}")
print(" batch   graphs ms   eager ms   eager/graphs   memory floor ms")
for n in sorted(graph_ms):
    print(f"{n:>6}  {graph_ms[n]:>10.2f}  {eager_ms[n]:>9.2f}  {eager_ms[n] / graph_ms[n]:>12.1f}x  {floor_ms[n]:>15.2f}")
print(f"throughput (nano-vllm workload): {gpu['throughput_cudagraphs']['output_tokens_per_second']:.0f} "
      "output tok/s with graphs")
# benchmarks/gpu_profile_step.py: one request, batch-1 decode steps, under torch.profiler and cProfile.
profile = json.loads((REPO / "benchmarks/results/gpu_profile_step_b1_h200.json").read_text())
host = profile["host_ms_per_step_under_cprofile"]
print(f"batch-1 step, {'async' if profile['async_scheduling'] else 'serial'} loop: "
      f"{profile['wall_ms_per_step']:.2f} ms wall, GPU busy {profile['gpu_ms_per_step']:.2f} ms "
      f"({profile['gpu_kernels_per_step']:.0f} kernels); host: _prepare_inputs "
      f"{host['GPUModelRunner._prepare_inputs']:.2f} ms, attention metadata "
      f"{host['AttentionMetadataBuilder.build']:.2f} ms")
# benchmarks/async_scheduling.py: decode step latency with graphs, serial vs async loop (median per round).
overlap = json.loads((REPO / "benchmarks/results/async_scheduling_h200.json").read_text())
for n in ("1", "16", "64"):
    medians = {loop: ", ".join(f"{r[n]['median_ms']:.2f}" for r in overlap["runs"][loop]["latency"])
               for loop in ("sync", "async")}
    print(f"batch {n:>2}, graphs: serial loop {medians['sync']} ms, async loop {medians['async']} ms")

# %%
import matplotlib

matplotlib.use("Agg")  # draw off-screen; show() (sessions/lab.py) hands the PNG to the notebook
import matplotlib.pyplot as plt  # noqa: E402
from lab import show  # noqa: E402


sizes = sorted(graph_ms)
x = np.arange(len(sizes))
fig, ax = plt.subplots(figsize=(7, 3.2))
ax.bar(x - 0.2, [eager_ms[n] for n in sizes], 0.4, label="eager", color="#e76f51")
ax.bar(x + 0.2, [graph_ms[n] for n in sizes], 0.4, label="CUDA graphs", color="#2a9d8f")
ax.plot(x, [floor_ms[n] for n in sizes], "k_", markersize=22, label="memory-bandwidth floor")
ax.set_xticks(x, [str(n) for n in sizes])
ax.set_xlabel("decode batch size (requests)")
ax.set_ylabel("ms per engine step")
ax.set_title("Glassbox (not vLLM) on an H200, Qwen3-0.6B shape: decode step time\n"
             "(benchmarks/results/gpu_throughput_h200.json)", fontsize=10)
ax.legend(fontsize=8)
fig.tight_layout()
show(fig)

# %% [markdown]
# Two things stand out. Eager steps cost 17–22 ms whatever the batch size:
# the time is not arithmetic or memory traffic (the floor is 0.3–3.8 ms) but
# the host launching kernels one by one from Python, and it barely depends on
# how much work each kernel does. Graphs remove most of that. What remains at
# batch 1 in the serial loop (~2.3 ms) is about 1.5 ms of GPU time (hundreds
# of small kernels, each far from the bandwidth limit) plus the Python part
# of the step — scheduling, input preparation, FlashInfer's `plan` — during
# which the GPU waits. The async loop, the default, overlaps the two: the
# host schedules and prepares step N+1 while the device runs step N, and the
# batch-1 step falls to about its GPU time (~1.6 ms). That works only with
# graphs: an eager step's host work, the launches themselves, is far longer
# than its GPU work, so there is nothing to hide it behind.
#
# ### 4b. How many launches is "one by one"?
#
# Count the torch operations one decode forward of *our* model issues
# (SmolLM2, 30 layers), with a dispatch mode that sees every aten call.
# Shape-only operations (views, reshapes, transposes) launch no kernel and are
# left out, and so are `to(dtype)` calls, which are no-ops in this float32
# model; what remains is roughly one GPU kernel launch each in eager mode.
# On a CPU, Glassbox runs the norms, RoPE, SiLU-and-mul and the decode
# attention as C++ calls (`csrc/cpu/`, see `engine/_cpu_ops.py`), which a
# dispatch mode cannot see, so this count switches them off and counts the
# plain-torch ops they replace.

# %%
from torch.utils._python_dispatch import TorchDispatchMode

NO_KERNEL = {"to", "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze",
             "slice", "select", "as_strided", "detach", "alias", "split", "split_with_sizes", "chunk",
             "unbind", "narrow", "lift_fresh", "_to_copy_noop", "empty", "empty_like", "new_empty",
             "empty_strided", "unflatten", "flatten", "view_as_real", "view_as_complex", "sym_size", "sym_stride"}


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


from engine._cpu_ops import kernels_disabled  # noqa: E402

counter = CountOps()
model = runner.model
_forward = model.forward


def counted_forward(*args, **kwargs):
    with counter:
        return _forward(*args, **kwargs)


model.forward = counted_forward
add("count", "Counting kernels", SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
llm_engine.step()          # launches the prefill
counter.counts.clear()
# On a GPU this engine runs compiled code and replays CUDA graphs, inside which a
# dispatch mode sees nothing: for the counted step the dispatcher answers NONE and
# the model runs its plain forward (the switch support_torch_compile reads).
# On a CPU both are so already.
settings = runner.cudagraph_dispatcher.mode, model.model.do_not_compile
runner.cudagraph_dispatcher.mode, model.model.do_not_compile = CUDAGraphMode.NONE, True
with kernels_disabled():   # the plain-torch CPU paths, visible to the dispatch mode
    llm_engine.step()      # launches one decode step (count this forward), then reads the prefill's output
runner.cudagraph_dispatcher.mode, model.model.do_not_compile = settings
model.forward = _forward
launching = {k: v for k, v in counter.counts.items() if k not in NO_KERNEL}
num_layers = llm.llm_engine.model_config.get_num_layers()
n_ops = sum(launching.values())
print(f"one decode forward: {n_ops} kernel-launching ops ({sum(counter.counts.values())} aten calls in all), "
      f"about {n_ops / num_layers:.0f} per layer")
print("most frequent:", sorted(launching.items(), key=lambda kv: -kv[1])[:8])

# %% [markdown]
# (These are the ops of the CPU attention backend; the Triton backend on a
# GPU issues a similar number per layer — a few fused kernels for attention
# instead of a few plain-torch ops. Qwen3-0.6B has 28 layers and adds a
# q- and k-norm to each.)
#
# ## 5. Exercise: why does padding beat an eager launch?
#
# *13 requests are decoding. The captured sizes are 1, 2, 4, 8, 16, …. The
# runner can replay the 16-graph with 3 padding rows, or run the 13 eagerly.
# Which is cheaper, by how much, and up to how much padding would that stay
# true?*
#
# From Glassbox's committed H200 numbers (linear interpolation between the measured
# batch sizes 1 and 16 — an assumption, stated):

# %%
def interp(table: dict[int, float], n: float) -> float:
    xs = sorted(table)
    lo = max(x for x in xs if x <= n)
    hi = min(x for x in xs if x >= n)
    return table[lo] if lo == hi else table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)


n_live = 13
mode, desc = dispatcher.dispatch(n_live, uniform_decode=True)
padded = desc.num_tokens
graph_cost = graph_ms[padded]
eager_cost = interp(eager_ms, n_live)
per_row = (graph_ms[16] - graph_ms[1]) / 15  # what one more decode row adds to a graph replay
padding_cost = per_row * (padded - n_live)
break_even_rows = (eager_cost - interp(graph_ms, n_live)) / per_row
print(f"dispatcher: {n_live} decodes -> {mode.name} graph of {padded} ({padded - n_live} padding rows)")
print(f"eager step at {n_live} (interpolated):     {eager_cost:6.2f} ms")
print(f"graph step at {padded} (measured):          {graph_cost:6.2f} ms")
print(f"one extra row in a graph replay:       {per_row * 1e3:6.1f} us  -> the {padded - n_live} padding rows cost ~{padding_cost * 1e3:.0f} us")
print(f"saving from padding instead of eager:  {eager_cost - graph_cost:6.2f} ms per step ({eager_cost / graph_cost:.1f}x)")
print(f"padding would have to waste ~{break_even_rows:.0f} rows before eager won")
print(f"eager minus graphs at batch 1, spread over our {n_ops} launches: ~{(eager_ms[1] - graph_ms[1]) / n_ops * 1e3:.0f} us "
      f"per launch (a rough figure: different model, and the step includes more than the forward)")

# %% [markdown]
# **Answer.** A decode row costs the GPU almost nothing at this size (the
# kernels are bound by reading the weights, which happens once per step
# however many rows there are), while every eager launch costs the host tens
# of microseconds, hundreds of times per step. Replaying the 16-graph for 13
# requests wastes 3 rows — tens of microseconds — and skips ~16 ms of
# launches. Padding only loses when the padded rows cost more than the
# launches saved, hundreds of rows away; vLLM's capture sizes are spaced
# (every 8, then every 16 at larger sizes) so the waste stays a small
# fraction of the batch.
#
# Where it happens: in vLLM, `GPUModelRunner._determine_batch_execution_and_padding`
# asks `CudagraphDispatcher.dispatch` for the runtime mode and the padded
# `BatchDescriptor` (lines in the table at the top); in Glassbox,
# `_prepare_inputs` calls `self.cudagraph_dispatcher.dispatch(...)` and, for a
# FULL graph, appends the padding tokens (slot `-1`, position 0) and
# zero-length padding rows before copying into the persistent buffers.
#
# ### 5a. Live, on this machine's GPU
#
# On CUDA the notebook measures the same thing with the default model: two
# engines (graphs; `enforce_eager=True`), pure decode steps of 1, 13 and 16
# requests, each step's `runner.forward` time from the trace (forward plus LM
# head, GPU time between CUDA events) — and the padding the runner actually applied
# (`num_tokens_padded`). On a CPU there is nothing to measure: no graphs.

# %%
def live_decode_latency(enforce_eager: bool, batch_sizes=(1, 13, 16), new_tokens=12, **engine_kwargs) -> dict:
    trace = TRACE.with_name(f"gpu-{'eager' if enforce_eager else 'graphs'}.jsonl")
    gpu_llm = LLM(trace_path=str(trace), trace_level="lifecycle", enforce_eager=enforce_eager,
                  max_num_seqs=16, num_gpu_blocks_override=512, max_model_len=512, disable_log_stats=True,
                  **engine_kwargs)
    for n in batch_sizes:
        prompts = [f"Request {i}: count slowly from one to twenty." for i in range(n)]
        gpu_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True),
                         use_tqdm=False)
    gpu_llm.llm_engine.tracer.flush()
    evs = load_trace(str(trace))
    forward_ms = {e.step: e.duration_ns / 1e6 for e in evs if e.kind == "runner.forward"}
    out = {}
    for e in evs:
        if e.kind == "runner.batch" and kind_of(e) == "decode":
            row = out.setdefault(e.num_tokens, {"ms": [], "padded": set(), "mode": set()})
            row["ms"].append(forward_ms[e.step])
            row["padded"].add(e.num_tokens_padded)
            row["mode"].add(e.cudagraph_mode)
    gpu_llm.shutdown()
    del gpu_llm
    torch.cuda.empty_cache()
    return out


if DEVICE == "cuda":
    import statistics

    live = {"graphs": live_decode_latency(False), "eager": live_decode_latency(True)}
    print(" batch  graphs: mode, padded, median ms   eager: median ms")
    for n in (1, 13, 16):
        g, eg = live["graphs"][n], live["eager"][n]
        print(f"{n:>6}  {'/'.join(g['mode'])}, {sorted(g['padded'])}, {statistics.median(g['ms']):8.2f}   "
              f"{statistics.median(eg['ms']):8.2f}")
else:
    print("no CUDA device here: the live measurement does not run; section 4a's committed H200 numbers stand in")

# %% [markdown]
# ## 6. Self-checks

# %%
# Every step's runner tensors agree with the trace's runner.batch event.
# (A FULL graph's padding rows and tokens come after the live ones: zero query tokens, slot -1.)
for step, b in batches.items():
    live = captured[step]
    rows = len(live["req_ids"])
    assert live["req_ids"] == [LABEL[r] for r in b.req_ids]
    query_lens = np.diff(live["query_start_loc"]).tolist()
    assert query_lens[:rows] == b.query_lens and set(query_lens[rows:]) <= {0}
    assert live["seq_lens"][:rows] == b.seq_lens and set(live["seq_lens"][rows:]) <= {0}
    slots = [blk * BLOCK_SIZE + off + i for runs_ in b.slot_mapping for blk, off, cnt in runs_ for i in range(cnt)]
    assert slots == live["slot_mapping"][: len(slots)] and set(live["slot_mapping"][len(slots):]) <= {-1}
print("trace and live runner agree on every step: ok")

# %%
# A mixed step: decodes first (the scheduler serves running requests first, and a backend
# that sets reorder_batch_threshold would have the runner put them first anyway), then the chunk.
b = batches[MIXED]
assert b.query_lens[:2] == [1, 1] and b.query_lens[2] == 32 - 2
assert [LABEL[r] for r in b.discard_req_ids] == ["r2"]  # its sample is thrown away until its prompt is done
assert sum(b.query_lens) <= 32  # max_num_batched_tokens
print("mixed step layout: ok")

# %%
# Slots are unique within a step (no two tokens write the same KV slot) and
# land inside the row's own blocks.
for step, live in captured.items():
    assert len(set(live["slot_mapping"])) == len(live["slot_mapping"])
    qsl = live["query_start_loc"]
    for r, table in enumerate(live["block_table"]):
        for s in live["slot_mapping"][qsl[r]:qsl[r + 1]]:
            assert s // BLOCK_SIZE in table
print("slot mapping: unique and inside each row's blocks: ok")

# %%
# Async input path: the host held -1 exactly where the runner took the id on the device; that id
# is the previous step's sample for the request, from the row the trace recorded; every other id
# is the host's; the replay counts the same placeholder inputs; and in this run every decode row
# (one token on top of a computed context) took its input that way.
assert replay.async_scheduling
for step, b in batches.items():
    live, dev = captured[step], from_device(step)
    on_device = {i for i, _, _ in dev}
    assert {i for i, t in enumerate(live["host_input_ids"]) if t == -1} == on_device
    assert all(t == live["input_ids"][i] for i, t in enumerate(live["host_input_ids"]) if i not in on_device)
    assert matches_last_sample(step)
    assert {LABEL[r]: n for r, n in replay.view(step).num_placeholder_inputs.items()} == {r: 1 for _, r, _ in dev}
    decodes = {LABEL[r] for r, q, c in zip(b.req_ids, b.query_lens, b.num_computed_tokens) if q == 1 and c > 0}
    assert decodes == {r for _, r, _ in dev}
print("async input path: the device filled in the previous step's samples where the host had -1: ok")

# %%
# Every mode pads to the smallest captured size that fits; FULL_DECODE_ONLY never pads a mixed
# batch, the piecewise modes pad it in tokens (and FULL_AND_PIECEWISE keeps FULL for decodes).
full_only, piecewise, both = (dispatchers[m] for m in levels)
for n in range(1, 140):
    decode_fits = [s for s in full_only.capture_sizes if s >= n]
    mixed_fits = [s for s in piecewise.piecewise_capture_sizes if s >= n]
    mode, desc = full_only.dispatch(n, uniform_decode=True)
    assert (mode == CUDAGraphMode.FULL and desc.num_tokens == min(decode_fits)) if decode_fits else mode == CUDAGraphMode.NONE
    assert full_only.dispatch(n, uniform_decode=False)[0] == CUDAGraphMode.NONE
    for d in (piecewise, both):
        mode, desc = d.dispatch(n, uniform_decode=False)
        assert (mode == CUDAGraphMode.PIECEWISE and desc.num_tokens == min(mixed_fits)) if mixed_fits else mode == CUDAGraphMode.NONE
    if decode_fits:
        assert both.dispatch(n, uniform_decode=True)[0] == CUDAGraphMode.FULL
print("dispatcher: smallest captured size that fits, per mode: ok")
llm.shutdown()
