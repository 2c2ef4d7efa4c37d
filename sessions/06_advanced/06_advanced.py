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
# # Session 06 — Advanced topics: speculation, grammars, graphs, adapters, quantized weights
#
# **Goal.** Sessions 01–05 followed one plain request through the engine.
# This one switches on, one at a time, the features that bend that path, and
# asks of each the same three questions: *where does it hook into the step,
# what does it change in the scheduler's bookkeeping, and what does the trace
# show?* By the end you should be able to say, for speculative decoding, when
# drafts are proposed, how one forward pass verifies them and what a rejected
# draft costs (and does not cost) in KV blocks; for structured outputs, why a
# request can wait before its first step and how many tokens the grammar
# leaves the sampler at each step; which CUDA graph a batch of drafts gets;
# how one batch serves several LoRA adapters; and what a quantized layer
# holds instead of a float matrix.
#
# The lab, each part short and run live on this machine:
#
# 1. the files to read — vLLM at `52a31cc` beside the Glassbox twins;
# 2. async scheduling, the default loop, in one table (session 01 has the
#    long version);
# 3. speculative decoding with n-gram drafts, step by step from the trace,
#    and where the KV blocks of rejected drafts go;
# 4. structured outputs: the grammar wait and the mask per token;
# 5. compilation and CUDA-graph modes: the dispatcher on verification
#    batches, and the committed H200 figures per mode;
# 6. LoRA: two adapters and the base model in one batch, then one slot;
# 7. quantization: GGUF and FP8, Config → Method → Kernel for one layer,
#    weight bytes and the error against float32;
# 8. what Glassbox does not have yet (P/D disaggregation, data parallelism,
#    dual batch overlap) and where to read it in vLLM;
# 9. the exercise, answered from this run's traces; 10. self-checks.
#
# Everything runs on the CPU (the outputs stored here were recorded on one)
# with the default model, SmolLM2-135M-Instruct, or a tiny random Llama for
# LoRA. Every engine runs in this process, so requests join at the steps the
# notebook chooses, and each is shut down when its part is done.

# %% [markdown]
# ## 1. What to read
#
# | vLLM file | read it for |
# |---|---|
# | [`vllm/v1/spec_decode/ngram_proposer.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/spec_decode/ngram_proposer.py#L12) | the cheapest drafter: find the last few tokens earlier in the sequence, propose what followed them |
# | [`vllm/v1/spec_decode/eagle.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/spec_decode/eagle.py#L10), [`llm_base_proposer.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/spec_decode/llm_base_proposer.py#L427) | model drafters (EAGLE, a draft model): `EagleProposer` is a thin subclass, the drafting loop is `SpecDecodeBaseProposer.propose` |
# | [`vllm/v1/sample/rejection_sampler.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/sample/rejection_sampler.py#L87) | verification: the target's tokens at every draft position, the longest agreeing prefix, one token of the target's own |
# | [`vllm/v1/core/sched/scheduler.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/sched/scheduler.py#L1283) | `update_from_output`: the cursor steps back over rejected drafts; `get_grammar_bitmask`; the skipped-waiting queue |
# | [`vllm/v1/structured_output/__init__.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/structured_output/__init__.py#L36), [`utils.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/structured_output/utils.py#L44) | the grammar compiled on a thread pool, the bitmask built per step, and applied to the logits in the runner |
# | [`vllm/v1/cudagraph_dispatcher.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/cudagraph_dispatcher.py#L239) | which graph runs a batch (session 04), here for verification batches |
# | [`vllm/lora/worker_manager.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/lora/worker_manager.py#L231), [`vllm/lora/model_manager.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/lora/model_manager.py#L1163) | adapters on disk → host cache → device slots, least recently used out |
# | [`vllm/model_executor/layers/quantization/gguf.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/model_executor/layers/quantization/gguf.py#L49), [`fp8.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/model_executor/layers/quantization/fp8.py#L100) | Config → Method → Kernel for two formats |
#
# The table below is computed (`reading_table` in `sessions/lab.py`): vLLM's
# lines from `docs/data/vllm_twins_52a31cc.json`, ours from the Glassbox
# source as it is now; `—` means no twin of that name.

# %%
import os
import sys
import time
from pathlib import Path

from IPython.display import Markdown, display

# Every engine in this kernel: requests join at the steps we choose and each trace is one file.
os.environ["GLASSBOX_ENABLE_MULTIPROCESSING"] = "0"
# Idle OpenMP threads sleep instead of spinning (set before torch is imported; results unchanged).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import engine  # noqa: E402

REPO = Path(engine.__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "sessions"))  # sessions/lab.py: helpers shared by the notebooks
sys.path.insert(0, str(REPO))  # tests/helpers: the tiny checkpoints and LoRA adapters
from lab import reading_table, show_vllm, vllm_line  # noqa: E402

SESSION_FILES = {
    "vllm/v1/spec_decode/ngram_proposer.py": ["NgramProposer", "NgramProposer.propose"],
    "vllm/v1/sample/rejection_sampler.py": ["RejectionSampler", "RejectionSampler.forward"],
    "vllm/v1/worker/gpu_model_runner.py": ["GPUModelRunner.propose_draft_token_ids"],
    "vllm/v1/core/sched/scheduler.py": ["Scheduler.schedule", "Scheduler.update_from_output",
                                        "Scheduler.get_grammar_bitmask"],
    "vllm/v1/core/kv_cache_manager.py": ["KVCacheManager.allocate_slots"],
    "vllm/v1/structured_output/__init__.py": ["StructuredOutputManager", "StructuredOutputManager.grammar_init",
                                              "StructuredOutputManager.grammar_bitmask"],
    "vllm/v1/structured_output/backend_xgrammar.py": ["XgrammarBackend.compile_grammar", "XgrammarGrammar"],
    "vllm/v1/structured_output/utils.py": ["apply_grammar_bitmask"],
    "vllm/v1/cudagraph_dispatcher.py": ["CudagraphDispatcher", "CudagraphDispatcher.dispatch"],
    "vllm/lora/worker_manager.py": ["LRUCacheWorkerLoRAManager"],
    "vllm/lora/model_manager.py": ["LRUCacheLoRAModelManager", "LRUCacheLoRAModelManager.activate_adapter"],
    "vllm/model_executor/layers/quantization/gguf.py": ["GGUFConfig", "GGUFLinearMethod", "GGUFLinearMethod.apply"],
    "vllm/model_executor/layers/quantization/fp8.py": ["Fp8Config", "Fp8OnlineLinearMethod", "Fp8LinearMethod"],
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
    if not item["seed"].startswith("001 · 6"):
        continue
    path, name, approx = item["old"]
    said = f"{path}" + (f" {name}" if name else "")
    now = "\n               ".join(f"{p}:{vllm_line(p, q)} {q}" for p, q in item["now"])
    print(f"plan says  {said}\n  {item['status']:>9}: {now}")

# %% [markdown]
# So `propose_draft_tokens` is gone (EAGLE's drafting now lives in a base
# class shared with draft models), and there is no class called `Grammar`:
# the per-request object is a `StructuredOutputGrammar`, and the
# `masked_fill_(-inf)` the plan mentions is `apply_grammar_bitmask`, which
# hands the packed bitmask to xgrammar's kernel. The plan also says that
# rolling back rejected drafts frees their KV blocks; section 3 shows from
# the trace that it does not.
#
# Here is the one function this session is about more than any other, the
# verification step's sampler (the lines themselves appear when
# `GLASSBOX_VLLM_SRC` points at a vLLM checkout, see `sessions/README.md`):

# %%
show_vllm("vllm/v1/sample/rejection_sampler.py", "RejectionSampler.forward", 40)

# %% [markdown]
# ## 2. Async scheduling, in one table
#
# vLLM's default loop launches step N+1 before it has read step N's tokens
# ([`step_with_batch_queue`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/core.py#L469));
# each token still on its way is a *placeholder* in the scheduler
# ([`AsyncScheduler`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/sched/async_scheduler.py#L12)).
# Session 01 (§4, [`01_engine_loop`](../01_engine_loop/01_engine_loop.ipynb))
# times it and draws it; session 02 (§6, [`02_scheduler`](../02_scheduler/02_scheduler.ipynb))
# follows the placeholders. Here only the facts the later sections lean
# on: three requests, 5 tokens each, once with `async_scheduling=False` and
# once with the default, reading `engine.step_launched`'s `num_in_flight`
# and, after every `schedule()`, each request's `num_output_placeholders`.
#
# **Predict, then run.** How many steps does each loop take for 3 requests ×
# 5 tokens (one prefill step, then decodes)? At most how many steps in
# flight, and how many placeholders can one request hold?

# %%
import tempfile

import numpy as np
import torch

from engine import LLM, SamplingParams
from engine.tracing import load_trace

TMP = Path(tempfile.mkdtemp(prefix="glassbox-session06-"))
print(f"traces under {TMP}")
PROMPTS = ["The capital of France is", "Paged attention stores keys in", "One, two, three,"]
FIVE = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

loops = {}
t0 = time.perf_counter()
for name, settings in (("serial", {"async_scheduling": False}), ("async", {})):
    trace = TMP / f"loop_{name}.jsonl"
    llm = LLM(trace_path=str(trace), num_gpu_blocks_override=32, max_model_len=256, disable_log_stats=True,
              **settings)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    placeholders = []  # after each schedule(): {request index: num_output_placeholders}
    _schedule = scheduler.schedule

    def recording_schedule(_schedule=_schedule, scheduler=scheduler, placeholders=placeholders):
        out = _schedule()
        placeholders.append({r.split("-")[0]: q.num_output_placeholders for r, q in scheduler.requests.items()})
        return out

    scheduler.schedule = recording_schedule
    outs = llm.generate(PROMPTS, FIVE, use_tqdm=False)
    llm.llm_engine.tracer.flush()
    loops[name] = {"events": load_trace(str(trace)), "placeholders": placeholders,
                   "tokens": [o.outputs[0].token_ids for o in outs]}
    llm.shutdown()
print(f"two engines, 3 requests each: {time.perf_counter() - t0:.1f} s")

# %%
# NBVAL_CHECK_OUTPUT
for name, run in loops.items():
    launched = [e.num_in_flight for e in run["events"] if e.kind == "engine.step_launched"]
    config = next(e for e in run["events"] if e.kind == "engine.config")
    most = max(max(p.values(), default=0) for p in run["placeholders"])
    print(f"{name:>6}: async_scheduling={config.async_scheduling}, {len(launched)} steps launched, "
          f"steps in flight after each launch {launched}, most placeholders on one request {most}")
print("same tokens on both loops:", loops["serial"]["tokens"] == loops["async"]["tokens"])

# %% [markdown]
# The serial loop always has one step in flight and never a placeholder:
# it reads each step's tokens before scheduling the next. The async loop
# has two in flight from the second launch on, and right after a
# `schedule()` a running request holds a placeholder for each of them: the
# token of the step still out and the one just scheduled. Its sixth launch
# is an empty step — counting placeholders, every request already had its 5
# tokens scheduled, so `schedule()` gave nobody anything — launched while
# step 5's tokens were still to be read. The tokens are the same. Two consequences matter below: n-gram speculation
# turns async scheduling *off* by default (the drafter needs the tokens it
# matches against, and they are placeholders), and the structured-output
# mask for a step can be built only after the previous step's token has
# advanced the grammar.

# %% [markdown]
# ## 3. Speculative decoding: n-gram drafts
#
# A decode step computes one token per request and is limited by reading
# the weights, not by arithmetic, so a forward pass over 1 + k tokens costs
# little more than over one. Speculative decoding uses that: a cheap
# *drafter* guesses k tokens; the next step runs the request's last token
# and the k guesses through the target model in one pass; the rejection
# sampler keeps the longest prefix of guesses the target agrees with, plus
# one token of the target's own (the correction at the first disagreement,
# or a bonus token when all k were right). Greedy output is unchanged; only
# the number of steps drops.
#
# The n-gram drafter needs no model: it looks for the sequence's last 1–3
# tokens earlier in the prompt or output and proposes the (up to) 3 tokens
# that followed. Two requests: **days** repeats a list, so the drafts should
# be right; **code** asks the model to continue Python, where its output
# soon wanders away from the prompt.
#
# **Predict, then run.** In which step is a request's first draft verified —
# the step after its prefill, or later? When all three drafts of a step are
# rejected, what happens to `num_computed_tokens`, and does the request give
# back any KV block?

# %%
from engine.tracing import TraceReplay  # noqa: E402

SPEC_TRACE = TMP / "spec.jsonl"
K = 3
BLOCK = 16
SPEC_PROMPTS = {
    "days": "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday, Wednesday, Thursday, Friday. "
            "Monday, Tuesday,",
    "code": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
}
t0 = time.perf_counter()
llm = LLM(trace_path=str(SPEC_TRACE), trace_level="full", num_gpu_blocks_override=64, max_model_len=512,
          block_size=BLOCK, disable_log_stats=True,
          speculative_config={"method": "ngram", "num_speculative_tokens": K,
                              "prompt_lookup_min": 1, "prompt_lookup_max": 3})
spec_outs = llm.generate(list(SPEC_PROMPTS.values()), SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
                         use_tqdm=False)
llm.llm_engine.tracer.flush()
llm.shutdown()
print(f"ngram run: {time.perf_counter() - t0:.1f} s")
spec_events = load_trace(str(SPEC_TRACE))
SPEC_NAME = {e.request_id: list(SPEC_PROMPTS)[int(e.external_req_id)] for e in spec_events
             if e.kind == "request.added"}
for name, out in zip(SPEC_PROMPTS, spec_outs):
    print(f"{name}: {out.outputs[0].text[:90]!r}...")

# %%
# NBVAL_CHECK_OUTPUT
config = next(e for e in spec_events if e.kind == "engine.config")
print(f"async_scheduling: {config.async_scheduling}")
proposed = {(SPEC_NAME[e.request_id], e.step): e.draft_token_ids for e in spec_events if e.kind == "spec.proposed"}
verified = [e for e in spec_events if e.kind == "spec.verified"]
print(" step  request  drafts (proposed at step)  accepted  rejected  appended  cursor after")
for e in verified:
    name = SPEC_NAME[e.request_id]
    at = max(s for (n, s) in proposed if n == name and s < e.step)
    print(f"{e.step:>5}  {name:<7}  {str(e.draft_token_ids):<18} ({at:>2})  {e.num_accepted:>8}  "
          f"{e.num_rejected:>8}  {len(e.token_ids):>8}  {e.num_computed_tokens:>12}")
steps = {SPEC_NAME[r]: max(e.step for e in spec_events if e.kind == "sched.step" and r in e.num_scheduled_tokens)
         for r in SPEC_NAME}
print("steps to 48 tokens:", steps)

# %% [markdown]
# Read a row from left to right. The drafts were proposed at the end of the
# previous step (`spec.proposed`, right after its tokens were sampled), the
# scheduler put them in this step's batch (`sched.step`'s
# `scheduled_spec_decode_tokens`: 1 + 3 tokens for the request), the runner
# verified them in the same forward pass, and `update_from_output`
# appended the accepted drafts plus one token (`appended` = accepted + 1)
# and stepped the cursor back over the rejected ones. **days** accepts
# every draft and gains 4 tokens per step; **code** gets its drafts
# rejected for a long stretch (1 token per step, like plain decoding, but
# each step computed 4 positions) and then, once its output starts
# repeating itself, accepts them too.
#
# The same numbers per step, drawn:

# %%
import matplotlib

matplotlib.use("Agg")  # draw off-screen; show() (sessions/lab.py) hands the PNG to the notebook
import matplotlib.pyplot as plt  # noqa: E402
from lab import show  # noqa: E402

fig, axes = plt.subplots(1, 2, figsize=(10, 3), sharey=True)
for ax, name in zip(axes, SPEC_PROMPTS):
    rows = [e for e in verified if SPEC_NAME[e.request_id] == name]
    x = [e.step for e in rows]
    acc = [e.num_accepted for e in rows]
    ax.bar(x, acc, color="#2a9d8f", label="accepted drafts")
    ax.bar(x, [1] * len(rows), bottom=acc, color="#264653", label="target's own token")
    ax.bar(x, [e.num_rejected for e in rows], bottom=[a + 1 for a in acc], color="#e76f51",
           label="rejected drafts")
    ax.set_title(f"{name}: steps that verified drafts", fontsize=10)
    ax.set_xlabel("engine step")
axes[0].set_ylabel("positions computed for the request")
axes[0].legend(fontsize=8)
fig.tight_layout()
show(fig)

# %% [markdown]
# ### Rejected drafts give back no blocks
#
# The reading plan says the rollback frees the rejected tokens' KV blocks.
# It does not, in vLLM or here: `update_from_output` only moves the cursor
# (`num_computed_tokens -= num_rejected`,
# [scheduler.py L1283](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/sched/scheduler.py#L1283));
# the block table is untouched. The rejected drafts' K/V stay in their slots
# until the next tokens overwrite them. The trace shows it: look for a step
# in which the scheduler allocated a new block for a request *only because
# of its drafts* — after the rollback, no computed position of the request
# lies in that block — and follow the block until it is freed.

# %%
# NBVAL_CHECK_OUTPUT
lookahead = []
for e in verified:
    if not e.num_rejected:
        continue
    for a in spec_events:
        if a.kind == "kv.allocated" and a.request_id == e.request_id and a.step == e.step:
            first_position = (a.num_blocks - 1) * BLOCK  # the new block's first position
            if first_position >= e.num_computed_tokens:
                lookahead.append((e, a))
for e, a in lookahead:
    first_position = (a.num_blocks - 1) * BLOCK
    name = SPEC_NAME[e.request_id]
    freed = [f for f in spec_events if f.kind == "kv.freed" and f.request_id == e.request_id]
    print(f"step {e.step}: {name} scheduled 1 + {len(e.draft_token_ids)} tokens, needed block {a.block_ids} "
          f"(positions {first_position}..{first_position + BLOCK - 1}) for its drafts;")
    print(f"    all {e.num_rejected} rejected, cursor back to {e.num_computed_tokens} "
          f"(< {first_position}): the block now holds nothing the request keeps")
    print(f"    kv.freed events for {name} after that: "
          + ", ".join(f"step {f.step} {f.block_ids}" for f in freed if f.step > e.step))
print("kv.freed events in the whole run:", [(f.step, SPEC_NAME[f.request_id]) for f in spec_events
                                           if f.kind == "kv.freed"])

# %% [markdown]
# The block stays in the request's table: the only `kv.freed` for the
# request is the one at its end, which returns *all* its blocks. Freeing
# it would be wasted work — the request's next tokens land in it a step or
# two later — and the prefix cache hashes a block only from the request's
# own tokens, among which a draft appears only once accepted, so a rejected
# draft never becomes a cache hit for somebody else. (A model drafter,
# EAGLE or a draft model, even reserves `num_lookahead_tokens` extra slots
# per step for its own K/V:
# [`allocate_slots`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/kv_cache_manager.py#L236).)
#
# What it buys, measured by `benchmarks/spec_decode.py` on a 2-core CPU
# (committed as `benchmarks/results/spec_decode_cpu.json`; copy-heavy
# prompts, so acceptance is high):

# %%
import json  # noqa: E402

spec_bench = json.loads((REPO / "benchmarks/results/spec_decode_cpu.json").read_text())
print(f"{spec_bench['model']}; {spec_bench['date'][:10]}, commit {spec_bench['commit']}; "
      f"{spec_bench['workload']['num_prompts']} prompts, {spec_bench['workload']['max_tokens']} tokens max")
for mode in ("ngram_k3", "ngram_k5"):
    for shape in ("batch", "batch1"):
        s = spec_bench["summary"][mode][shape]
        print(f"{mode} {shape:>6}: acceptance {s['acceptance_rate']:.0%} (per position "
              f"{', '.join(f'{p:.0%}' for p in s['acceptance_per_position'])}), "
              f"{s['mean_acceptance_length']:.2f} tokens per verify step, {s['speedup']:.2f}x tokens/s vs off")
print("outputs identical to no speculation:", spec_bench["identical_outputs"])

# %% [markdown]
# One request at a time the step is dominated by reading weights, and three
# drafts nearly double the throughput; in a batch of 16 the steps are
# already fuller and the gain is about a fifth.

# %% [markdown]
# ## 4. Structured outputs: the grammar wait and the mask
#
# A request with `structured_outputs=StructuredOutputsParams(json=schema)`
# needs a compiled grammar before it can sample its first token. The
# compile runs on a thread pool
# ([`grammar_init`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/structured_output/__init__.py#L115));
# until it is done the request sits in `WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`
# in the scheduler's second queue, `skipped_waiting`, and other requests
# run past it. Once it runs, every step the scheduler asks each grammar for
# a bitmask row of the allowed next tokens, and the runner sets every other
# logit to −∞ before sampling.
#
# A compile takes milliseconds to a few hundred (the first one in a process
# is the slowest; the run prints its own), so to make the wait visible
# whatever this machine's speed, the notebook holds the compile behind a gate
# for three steps. One JSON request and one free request, same prompt, both
# greedy.
#
# **Predict, then run.** While the gate is shut, does the free request
# run? When the grammar is ready, how many tokens out of 49,152 does it
# allow for the first token of a JSON object? And in the middle of the
# `"city"` string?

# %%
import threading  # noqa: E402

from engine.sampling_params import StructuredOutputsParams  # noqa: E402
from engine.v1.structured_output.backend_xgrammar import XgrammarBackend  # noqa: E402

SO_TRACE = TMP / "structured.jsonl"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}
SO_PROMPT = "Give the largest city of France and its population as JSON."
gate = threading.Event()
_compile = XgrammarBackend.compile_grammar


def gated_compile(self, request_type, grammar_spec):
    assert gate.wait(timeout=60)
    return _compile(self, request_type, grammar_spec)


XgrammarBackend.compile_grammar = gated_compile
t0 = time.perf_counter()
llm = LLM(trace_path=str(SO_TRACE), trace_level="full", num_gpu_blocks_override=32, max_model_len=256,
          disable_log_stats=True)
llm_engine = llm.llm_engine
llm_engine.add_request("json", SO_PROMPT, SamplingParams(temperature=0.0, max_tokens=40,
                       structured_outputs=StructuredOutputsParams(json=SCHEMA)))
llm_engine.add_request("free", SO_PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
so_outputs = {}
GATED_STEPS = 3
for _ in range(GATED_STEPS):  # the gate is shut: the grammar cannot be ready
    for out in llm_engine.step():
        so_outputs[out.request_id] = out
gate.set()
deadline = time.monotonic() + 60
while llm_engine.has_unfinished_requests() and time.monotonic() < deadline:
    for out in llm_engine.step():
        so_outputs[out.request_id] = out
XgrammarBackend.compile_grammar = _compile
so_tokenizer = llm.get_tokenizer()
llm_engine.tracer.flush()
llm.shutdown()
print(f"structured-output run: {time.perf_counter() - t0:.1f} s")
so_events = load_trace(str(SO_TRACE))
SO_NAME = {e.request_id: e.external_req_id for e in so_events if e.kind == "request.added"}
compiled = next(e for e in so_events if e.kind == "so.compiled")
print(f"compile: {compiled.compile_s * 1e3:.1f} ms in xgrammar once the gate opened")
for rid in ("json", "free"):
    print(f"{rid}: {so_outputs[rid].outputs[0].text!r} ({so_outputs[rid].outputs[0].finish_reason})")

# %%
# NBVAL_CHECK_OUTPUT
sched_steps = [e for e in so_events if e.kind == "sched.step"]
for e in sched_steps[:GATED_STEPS]:
    ran = sorted(SO_NAME[r] for r in e.num_scheduled_tokens)
    print(f"step {e.step}: scheduled {ran}, waiting for a grammar (skipped_waiting): {e.num_skipped_waiting}")
kinds = [e.kind for e in so_events if e.kind.startswith("so.") and e.kind in
         ("so.compile_started", "so.compiled", "so.ready")]
print("grammar events in order:", kinds)
ready = next(e for e in so_events if e.kind == "so.ready")
admitted = next(e for e in so_events if e.kind == "sched.admitted" and SO_NAME[e.request_id] == "json")
print("json admitted in the step its grammar became ready:", admitted.step == ready.step,
      "| after the gated steps:", admitted.step > GATED_STEPS)
masked = [e for e in so_events if e.kind == "so.masked"]
json_tokens = so_outputs["json"].outputs[0].token_ids
print(f"json: {len(json_tokens)} tokens, {len(masked)} masked rows (one per token)")
print("    #   token  text          allowed  the model's favourite masked?")
for i, e in enumerate(masked):
    print(f"{i:>5}  {json_tokens[i]:>6}  {so_tokenizer.decode([json_tokens[i]])!r:<12} {e.num_allowed:>8,}  "
          f"{'yes: ' + repr(so_tokenizer.decode([e.top_token_id_before])) if e.top_token_id_before != e.top_token_id_after else 'no'}")

# %% [markdown]
# While the gate was shut the free request ran alone and the JSON request
# waited in `skipped_waiting`, not in the ordinary waiting queue (which
# would have blocked everything behind it under FCFS). The step after the
# compile finished, the scheduler saw the grammar ready and admitted the
# request in that same step.
#
# The mask is tight where JSON syntax and the schema leave little choice —
# the opening of the object (2 tokens), the key names, `":` — and wide
# open inside the `"city"` string (almost the whole vocabulary: any token
# that does not break the string). Digits of an integer allow a few hundred
# tokens (those made of digits, and the ones that end the number). Where the
# favourite was masked the grammar changed the output: at the first token
# the model wanted to stop at once (`<|im_end|>`), and after `Paris` it
# wanted to close the object, which the schema forbids without a
# `population`. The last row allows exactly one token, end of sequence, once
# the object is closed. Per allowed-token count:

# %%
fig, ax = plt.subplots(figsize=(9, 2.8))
ax.bar(range(len(masked)), [e.num_allowed for e in masked],
       color=["#e76f51" if e.top_token_id_before != e.top_token_id_after else "#2a9d8f" for e in masked])
ax.set_yscale("log")
ax.axhline(49152, color="grey", lw=0.8, ls="--")
ax.set_xlabel("json's output token")
ax.set_ylabel("tokens allowed (log)")
ax.set_title("the grammar's mask per token (red: the model's favourite was masked; dashed: the vocabulary)",
             fontsize=9)
fig.tight_layout()
show(fig)

# %% [markdown]
# On an H200 (`benchmarks/results/structured_output_cost_h200.json`,
# Glassbox's own benchmark) the costs split the same way:

# %%
so_bench = json.loads((REPO / "benchmarks/results/structured_output_cost_h200.json").read_text())
print(f"committed H200 run, {so_bench['date'][:10]}, commit {so_bench['commit'][:7]}: {so_bench['model']}")
for name, c in so_bench["compile"].items():
    print(f"  compile {name:>11}: cold {c['cold_s'] * 1e3:.1f} ms, from xgrammar's cache {c['cached_s'] * 1e6:.0f} us")
for r in so_bench["results"]:
    if r.get("batch") in (1,):
        print(f"  {r['mode']:>24}, batch {r['batch']}: {r['ms_per_step']:.2f} ms per step")

# %% [markdown]
# ## 5. Compilation and CUDA-graph modes
#
# Session 04 (§4, [`04_worker`](../04_worker/04_worker.ipynb)) built the
# dispatcher for one-token decodes and read the eager-vs-graphs H200
# numbers. Speculation adds a second kind of uniform batch: every request
# runs 1 + k tokens. The runner builds its dispatcher with
# `uniform_decode_query_len = 1 + k`, and when the attention backend can
# replay such batches it captures verification graphs of their own, at
# capture sizes rounded up to multiples of 1 + k.
#
# **Predict, then run.** With k = 3 under `FULL_AND_PIECEWISE`, what runs a
# verification batch of 5 requests (20 tokens)? One of 5 requests where
# only some verify drafts (say 14 tokens)? 5 plain decodes?

# %%
# NBVAL_CHECK_OUTPUT
from engine.config.compilation import CompilationConfig, CUDAGraphMode  # noqa: E402
from engine.v1.cudagraph_dispatcher import CudagraphDispatcher  # noqa: E402


def captured_dispatcher(cudagraph_mode: str, mode: int, query_len: int):
    """The dispatcher for max_num_seqs=64 and k = query_len - 1, everything capture_model() would capture."""
    config = CompilationConfig(mode=mode, cudagraph_mode=cudagraph_mode)
    config.finalize(max_num_seqs=64, enforce_eager=False, uniform_decode_query_len=query_len,
                    max_num_batched_tokens=256)
    dispatcher = CudagraphDispatcher(config, uniform_decode_query_len=query_len, max_num_tokens=256, max_num_reqs=64)
    dispatcher.captured.update(dispatcher.decode_keys() + dispatcher.piecewise_keys())
    return dispatcher


graph_modes = {"FULL_DECODE_ONLY": 0, "FULL_AND_PIECEWISE": 3}
dispatchers = {name: captured_dispatcher(name, mode, 1 + K) for name, mode in graph_modes.items()}
for name, d in dispatchers.items():
    print(f"{name}: verification graph sizes (k = 3) {d.spec_capture_sizes[:6]} ... {d.spec_capture_sizes[-2:]}")
print("batch                          tokens  " + "  ".join(f"{n:>22}" for n in graph_modes))
for label, n, uniform, q in [("5 decodes", 5, True, 1), ("5 verifying 3 drafts each", 20, True, 4),
                             ("17 verifying 3 drafts each", 68, True, 4),
                             ("5, some without drafts", 14, False, 1), ("a prefill of 40 tokens", 40, False, 1)]:
    cells = []
    for name, d in dispatchers.items():
        mode, desc = d.dispatch(n, uniform_decode=uniform, query_len=q)
        cells.append(f"{mode.name} -> {n if mode == CUDAGraphMode.NONE else desc.num_tokens}")
    print(f"{label:<29} {n:>7}  " + "  ".join(f"{c:>22}" for c in cells))

# %% [markdown]
# A batch where every request verifies k drafts gets a FULL graph, padded to
# the next verification size (a multiple of 4); the sizes, printed above, go
# up to what 64 requests with 3 drafts each fill (256 tokens, here also the
# step's budget), in both modes. A batch that mixes
# requests with and without drafts is not uniform and takes the piecewise
# graphs (or runs eagerly under `FULL_DECODE_ONLY`). On a CPU none of it
# runs: there are no graphs, and Glassbox's CPU default is `-O0` (no
# compilation) because a cold Inductor build of the default model takes about a
# minute on 2 cores and the result is slower than Glassbox's own CPU
# kernels (`docs/compilation.md` has those CPU figures). Section 5b measures
# what this machine can. First, what the modes are worth on a GPU, from the
# committed run of `benchmarks/gpu_throughput.py`:

# %%
modes = json.loads((REPO / "benchmarks/results/gpu_throughput_modes_h200.json").read_text())
print(f"COMMITTED H200 RESULTS (not run here): {modes['gpu']}, {modes['date'][:10]}, commit {modes['commit']}, "
      f"torch {modes['torch']}")
print(f"  {modes['model']}; workload: {modes['workload']}")
rows = {f"O{modes['engine']['optimization_level']} {modes['engine']['cudagraph_mode']} (default)":
        modes["throughput_cudagraphs"], **modes["throughput_compiled"]}
print("  level / graphs                    output tok/s   engine start-up s")
for name, r in rows.items():
    print(f"  {name:<32} {r['output_tokens_per_second']:>12,.0f}   {r['engine_startup_seconds']:>17.1f}")

# %%
fig, ax = plt.subplots(figsize=(7, 2.8))
names = list(rows)
ax.barh(names, [rows[n]["output_tokens_per_second"] for n in names], color="#2a9d8f")
ax.set_xlabel("output tokens / s")
ax.set_title(f"committed H200 results ({modes['date'][:10]}, {modes['commit']}): Glassbox, {modes['model']}",
             fontsize=9)
fig.tight_layout()
show(fig)

# %% [markdown]
# Full decode graphs are what matters for this workload: the three
# configurations that replay them are within 6% of each other,
# while piecewise graphs alone (decode steps replayed in pieces, attention
# eager between them) reach about half. Compilation costs start-up time
# instead (the `O0` run compiles nothing and starts fastest).
#
# What did compilation fuse? The committed profile of one batch-1 decode step
# (`benchmarks/gpu_profile_modes.py`) counts the GPU kernels a step runs. The
# eager engine runs 360 (`docs/gpu.md` has every mode): its own fused Triton
# kernels for the norms, the rotary and SiLU-and-mul. Compiled, vLLM's
# `custom_ops=["none"]` hands those layers' plain torch code to Inductor, which
# fuses it its own way; Inductor's combo kernels (vLLM's GPU default, and
# Glassbox's) then run kernels of different shapes, such as q's and k's
# norm-and-rotary, as one launch.

# %%
profile = json.loads((REPO / "benchmarks/results/gpu_profile_modes_b1_h200.json").read_text())
print(f"COMMITTED H200 RESULTS (not run here): {profile['gpu']}, {profile['date'][:10]}, "
      f"commit {profile['commit'][:7]}; {profile['model']}; batch {profile['batch']}")
print("  mode                               kernels / step   GPU busy ms   step ms")
for name, m in profile["modes"].items():
    print(f"  {name:<34} {m['gpu_kernels_per_step']:>14.0f}   {m['gpu_busy_ms_per_step']:>11.2f}"
          f"   {m['wall_ms_per_step']:>7.2f}")

# %% [markdown]
# In that run (before combo kernels became the default) the compiled step ran
# 443 kernels, 83 more than eager: Inductor splits Qwen3's q/k norm + rotary,
# one kernel of Glassbox's, into four, and combo kernels join them back into
# two. Fewer kernels, less GPU time, a shorter step, yet still no shorter than
# eager with full graphs: at batch 1 the step is many small kernels, and each
# costs its launch and ramp-up whatever it computes.

# %% [markdown]
# ### 5b. Live, on this machine
#
# On a GPU: the default model under the four settings of the committed run —
# eager (`-O0`), `-O0` with `FULL_DECODE_ONLY` graphs, `-O1` (`PIECEWISE`)
# and the default `-O2` (`FULL_AND_PIECEWISE`) — 8 requests decoding
# together. On a CPU, where no graphs exist: the compiled model (`-O2`:
# Dynamo, the split at attention, Inductor's C++ code) against eager, on a
# tiny random Llama (2 layers) so that the cold compile takes seconds rather
# than a minute. Each run's trace says how the model was compiled
# (`runner.compiled`: pieces, Inductor builds against cache hits, seconds)
# and which graph ran each step (`runner.batch.cudagraph_mode`);
# `runner.forward` times each step's forward.
#
# **Predict, then run.** Compiled against eager: the same greedy tokens? On
# a CPU, is the compiled decode step faster? How many pieces does the
# split make of a 2-layer model?

# %%
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cuda":
    LIVE_MODEL, LIVE_SETTINGS = "default", {
        "eager (-O0)": dict(optimization_level=0),
        "-O0, FULL_DECODE_ONLY": dict(optimization_level=0,
                                      compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}),
        "-O1, PIECEWISE": dict(optimization_level=1),
        "-O2, FULL_AND_PIECEWISE": dict(optimization_level=2),
    }
else:
    from tests.helpers.hf_checkpoints import save_tiny_checkpoint  # noqa: E402

    LIVE_MODEL = str(TMP / "tiny-llama")
    save_tiny_checkpoint("llama", Path(LIVE_MODEL), seed=2)
    LIVE_SETTINGS = {"eager (-O0)": dict(optimization_level=0), "compiled (-O2)": dict(optimization_level=2)}
LIVE_PROMPTS = [{"prompt_token_ids": [(11 * i + 7 * j) % 200 + 1 for j in range(12 + i)]} for i in range(8)]
LIVE_PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)

live_modes = {}
for name, settings in LIVE_SETTINGS.items():
    trace = TMP / f"modes_{len(live_modes)}.jsonl"
    t0 = time.perf_counter()
    llm = LLM(LIVE_MODEL, skip_tokenizer_init=True, max_model_len=128, num_gpu_blocks_override=64,
              max_num_seqs=8, trace_path=str(trace), trace_level="lifecycle", disable_log_stats=True,
              **settings)
    startup = time.perf_counter() - t0
    outs = llm.generate(LIVE_PROMPTS, LIVE_PARAMS, use_tqdm=False)
    llm.shutdown()
    evs = load_trace(str(trace))
    batch = {e.step: e for e in evs if e.kind == "runner.batch"}
    decode_ms = [e.duration_ns / 1e6 for e in evs if e.kind == "runner.forward"
                 and e.step in batch and max(batch[e.step].query_lens) == 1 and batch[e.step].num_reqs == 8]
    live_modes[name] = {
        "startup_s": startup,
        "compiled": next((e for e in evs if e.kind == "runner.compiled"), None),
        "modes": sorted({(("decode" if max(b.query_lens) == 1 else "prefill"), b.cudagraph_mode)
                         for b in batch.values()}),
        "decode_ms": float(np.median(decode_ms)),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs],
    }
print(f"{DEVICE}: {LIVE_MODEL if DEVICE == 'cuda' else 'tiny Llama, 2 layers'}; 8 requests, 24 tokens each")
print(f"{'setting':<25} {'start-up s':>10}  {'compiled: pieces, built/cached, s':<34} "
      f"{'decode step ms':>14}")
for name, r in live_modes.items():
    c = r["compiled"]
    what = (f"{c.num_pieces} pieces, {c.inductor_compiles}/{c.cache_hits}, {c.seconds:.1f}"
            if c is not None and c.num_pieces else "not compiled")
    print(f"{name:<25} {r['startup_s']:>10.1f}  {what:<34} {r['decode_ms']:>14.3f}")

# %%
# NBVAL_CHECK_OUTPUT
eager = live_modes["eager (-O0)"]
for name, r in live_modes.items():
    c = r["compiled"]
    pieces = c.num_pieces if c is not None else 0
    diff = max(abs(a - b) for la, lb in zip(r["logprobs"], eager["logprobs"]) for a, b in zip(la, lb))
    print(f"{name:<25} pieces {pieces}; graph per step kind {r['modes']}")
    print(f"{'':<25} tokens == eager's: {r['tokens'] == eager['tokens']}; "
          f"max |logprob - eager's| {'<' if diff < 1e-4 else '>='} 1e-4")

# %% [markdown]
# Two layers make three pieces: the split at the two attention calls leaves
# a piece before the first, one between them and one after the second; the
# attention calls run eagerly between them. On a CPU the compiled model
# gives the same tokens with logprobs within float32 rounding, and its
# start-up pays for the compile (a second start finds the pieces in the
# on-disk cache, `~/.cache/glassbox/torch_compile_cache`). Its decode step
# can be the faster one here: a 2-layer model with a hidden size of 64 is
# almost all per-op overhead, which Inductor's fused code trims. With the
# default model the matrix work dominates, and Glassbox's own CPU kernels,
# which a compiled graph cannot call, win (`docs/compilation.md`: 4.84 s
# compiled against 3.93 s eager for the same 128 tokens) — the reason the
# CPU default is `-O0`. On a GPU in bf16, compiled and eager may part ways
# at a near-tie between two tokens: Inductor keeps fused intermediates in
# float32 where eager rounds each op to bf16.

# %% [markdown]
# ## 6. LoRA: several adapters in one batch
#
# A LoRA adapter adds `B·A·x` (rank r, a few MB) to chosen projections. vLLM
# keeps a few adapters in *device slots* (`max_loras`), more in host memory
# (`max_cpu_loras`), and serves requests with different adapters in the same
# batch: every token carries the index of its adapter's slot (−1: base
# model), and the LoRA kernels (Punica's shrink/expand) gather each token's
# A and B by that index. The runner sets this up each step
# ([`LoRAModelRunnerMixin._set_active_loras`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/lora_model_runner_mixin.py#L48)).
#
# A tiny random Llama (2 layers, vocabulary 256) and two PEFT adapters made
# by `peft` itself (`tests/helpers/lora_adapters.py`); three requests —
# adapter **a**, adapter **b**, the **base** model — first with 2 slots,
# then with one.
#
# **Predict, then run.** With `max_loras=1`, can **a** and **b** share a
# step? Do **a**'s tokens change when it ran alone with an eviction before
# its adapter was loaded again?

# %%
from engine.lora.request import LoRARequest  # noqa: E402
from tests.helpers.hf_checkpoints import TINY_CONFIG, save_tiny_checkpoint  # noqa: E402
from tests.helpers.lora_adapters import save_peft_adapter  # noqa: E402

t0 = time.perf_counter()
LORA_DIR = TMP / "lora"
save_tiny_checkpoint("llama", LORA_DIR / "base", seed=1)
save_peft_adapter(LORA_DIR / "base", LORA_DIR / "a", seed=1, r=8)
save_peft_adapter(LORA_DIR / "base", LORA_DIR / "b", seed=2, r=4)
ADAPTERS = {"a": LoRARequest("a", 1, str(LORA_DIR / "a")), "b": LoRARequest("b", 2, str(LORA_DIR / "b")),
            "base": None}
VOCAB = TINY_CONFIG["vocab_size"]
LORA_PROMPTS = [{"prompt_token_ids": [(7 * j + 3 + k) % VOCAB for j in range(12)]} for k in range(3)]
lora_runs = {}
for slots in (2, 1):
    trace = TMP / f"lora_{slots}.jsonl"
    llm = LLM(str(LORA_DIR / "base"), enable_lora=True, max_loras=slots, max_cpu_loras=slots, max_lora_rank=8,
              skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks_override=32, trace_path=str(trace),
              trace_level="full")
    outs = llm.generate(LORA_PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                        lora_request=list(ADAPTERS.values()), use_tqdm=False)
    llm.llm_engine.tracer.flush()
    llm.shutdown()
    lora_runs[slots] = {"events": load_trace(str(trace)), "tokens": [o.outputs[0].token_ids for o in outs]}
print(f"tiny Llama, 2 adapters, two engines: {time.perf_counter() - t0:.1f} s")

# %%
# NBVAL_CHECK_OUTPUT
for slots, run in lora_runs.items():
    ev = run["events"]
    name_of = {e.request_id: e.lora_name or "base" for e in ev if e.kind == "request.added"}
    batches = {e.step: e for e in ev if e.kind == "runner.batch"}
    print(f"max_loras={slots}:")
    for e in (e for e in ev if e.kind == "lora.slots"):
        b = batches[e.step]
        per_token = [e.token_slots[r] for r, n in zip(b.req_ids, b.query_lens) for _ in range(n)]
        print(f"  step {e.step}: slots (adapter id per slot) {e.slots}, loaded {e.loaded}, "
              f"evicted from slots {e.evicted_from_slots}, from host memory {e.evicted_from_cpu}")
        print(f"           rows {[name_of[r] for r in b.req_ids]} -> slot per row "
              f"{[e.token_slots[r] for r in b.req_ids]}; per token: {per_token}")
    steps_of = {}
    for e in ev:
        if e.kind == "sched.step":
            for r in e.num_scheduled_tokens:
                steps_of.setdefault(name_of[r], []).append(e.step)
    print("  steps per request:", {n: f"{s[0]}..{s[-1]}" for n, s in steps_of.items()})
print("same tokens with 2 slots and with 1:", lora_runs[2]["tokens"] == lora_runs[1]["tokens"])
print("a, b and base differ:", len({tuple(t) for t in lora_runs[2]["tokens"]}) == 3)

# %% [markdown]
# With two slots the first step prefills all three prompts together (36
# tokens): twelve tokens use slot 0 (adapter **a**), twelve slot 1
# (**b**), twelve −1 (no adapter); the later decode steps change nothing
# about the slots, so no `lora.slots` event is written. With one slot the
# scheduler will not put a second adapter into a step: **a** and **base**
# run first; **b** waits until **a** has finished, then its step evicts
# **a** (from its slot, and from the host cache, which also has room for
# one) and loads **b** from disk. The tokens are the same either way: where
# an adapter sits changes only which slot index its tokens carry. (Session
# 03 shows why two adapters never share prefix-cache blocks: the LoRA name
# goes into the block hash.)

# %% [markdown]
# ## 7. Quantization: GGUF and FP8
#
# Three levels, the same in vLLM and Glassbox: a **Config** (from
# `quantization=` or the checkpoint) decides, layer by layer, which
# **Method** a linear layer gets; the method's `create_weights` decides what
# tensors the layer holds, and its `apply` calls the **Kernel**. The same
# prompt through the default model three times — float32, the Q4_1 GGUF file
# the model is shipped as (`quantization="gguf"`), and FP8 quantized as it
# loads (`quantization="fp8"`) — with the first step's logits kept from the
# sampler.
#
# **Predict, then run.** What does layer 0's fused QKV projection hold under
# GGUF instead of a `[960, 576]` float32 matrix? Which of the two quantized
# models has logits closer to float32's?

# %%
quant = {}
t0 = time.perf_counter()
for name, q in (("float32", None), ("gguf", "gguf"), ("fp8", "fp8")):
    trace = TMP / f"quant_{name}.jsonl"
    t1 = time.perf_counter()
    # float32 on any device (a GPU's default would be bfloat16): one base for all three.
    llm = LLM("default", quantization=q, dtype="float32", trace_path=str(trace), num_gpu_blocks_override=16,
              max_model_len=128, disable_log_stats=True)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner
    logits = []
    _sampler_forward = runner.sampler.forward

    def recording_sampler(x, md, *args, _f=_sampler_forward, _keep=logits, **kwargs):
        _keep.append(x.detach().float().cpu().clone())
        return _f(x, md, *args, **kwargs)

    runner.sampler.forward = recording_sampler
    load_s = time.perf_counter() - t1
    t1 = time.perf_counter()
    (out,) = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)
    gen_s = time.perf_counter() - t1
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    quant[name] = {"method": type(qkv.quant_method).__name__, "layer": type(qkv).__name__,
                   "params": [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in qkv.named_parameters()],
                   "logits": logits[0][0], "tokens": out.outputs[0].token_ids, "load_s": load_s, "gen_s": gen_s}
    llm.llm_engine.tracer.flush()
    llm.shutdown()
    quant[name]["init"] = next(e for e in load_trace(str(trace)) if e.kind == "runner.init")
    print(f"{name:>8}: load {load_s:.1f} s, 8 tokens {gen_s:.1f} s")
print(f"three engines: {time.perf_counter() - t0:.1f} s")

# %%
# NBVAL_CHECK_OUTPUT
base_bytes = quant["float32"]["init"].weight_bytes
for name, r in quant.items():
    init = r["init"]
    print(f"{name}: quantization={init.quantization or 'none'}; layer 0 {r['layer']} -> {r['method']}; "
          f"holds {r['params']}")
    print(f"    methods per layer class: {init.quant_methods}")
    print(f"    weight bytes {init.weight_bytes:,} ({init.weight_bytes / base_bytes:.0%} of float32); "
          f"greedy tokens {r['tokens']}")

# %%
for name in ("gguf", "fp8"):
    diff = (quant[name]["logits"] - quant["float32"]["logits"]).abs()
    same_top = quant[name]["logits"].argmax().item() == quant["float32"]["logits"].argmax().item()
    print(f"{name:>5} vs float32, first step's logits: max |diff| {diff.max().item():.2e}, "
          f"mean {diff.mean().item():.2e}; same favourite: {same_top}")
qb = json.loads((REPO / "benchmarks/results/quantization_cpu.json").read_text())
print(f"committed CPU run (quantization_cpu.json, {qb['date'][:10]}, {qb['commit']}, {qb['machine']['cpus']} cores):")
for name, v in qb["variants"].items():
    print(f"  {name:>10}: {v['weight_bytes'] / 1e6:.1f} MB of weights, {v['output_tokens_per_second']:.1f} "
          f"output tok/s, same tokens as float32: {v['tokens_equal_float32']}")

# %% [markdown]
# Read the three rows as the three levels. **GGUF**: `GGUFConfig` gave
# every linear layer and the embedding a GGUF method; the QKV layer holds
# `qweight`, the file's raw Q4_1 blocks as bytes (`[960, 360]`: each row of
# 576 weights is 18 blocks of 32, each block 20 bytes — two fp16 numbers,
# scale and minimum, and 32 four-bit values), plus its format code; the
# kernel dequantizes the blocks and then multiplies. 18% of float32's bytes.
# **FP8**: the layer holds an e4m3 matrix (transposed, the layout
# `torch._scaled_mm` wants) and one float32 scale; the embedding and LM
# head stay float32 (a third of this small model), hence 41%.
#
# The errors look upside down at first: GGUF's logits match float32's to
# about 1e-5, FP8's differ by whole units. The reason is where the float32
# model comes from: Glassbox builds it by *dequantizing this same Q4_1
# file*, so float32 and GGUF compute with identical weight values and differ
# only in the order of floating-point operations. FP8 rounds those weights
# again, to 3 mantissa bits, and its activations too, and the greedy text
# drifts after a few tokens. The activations' scale is the largest entry of
# the whole step's input on a CPU (per tensor), so here a request's FP8
# numbers depend on what it is batched with; on CUDA from sm89 on, vLLM --
# and Glassbox -- take one scale per token instead, and they do not.
# And FP8 on a CPU is slow: there is no fp8
# matrix unit, so `_scaled_mm` runs torch's reference path (the timing
# above); on a Hopper GPU the same call uses the tensor cores. GGUF is slow
# here for a different reason — every step dequantizes every weight before
# multiplying, where vLLM fuses the two (its MMVQ / MMQ kernels).
# `docs/quantization.md` lists what else is simpler than vLLM.

# %% [markdown]
# ## 8. Not in Glassbox yet
#
# Three of vLLM's large features have no twin here. Rather than fake them,
# where to read them:
#
# **Prefill/decode disaggregation.** One set of GPUs runs prefills, another
# decodes, and the KV cache of a prompt travels between them. vLLM puts the
# transfer behind a *KV connector* with two halves: a scheduler side that
# answers "how many of this request's tokens can be loaded from elsewhere"
# and a worker side that starts loads before the forward and waits for saves
# after it
# ([`KVConnectorBase_V1`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/distributed/kv_transfer/kv_connector/v1/base.py#L171)).
# A request whose KV is still in transit waits in `WAITING_FOR_REMOTE_KVS`
# ([scheduler.py L766](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/sched/scheduler.py#L766)),
# much as a structured-output request waits for its grammar (section 4).
# The production transport is NIXL
# ([`NixlConnector`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py#L57)).
# Glassbox has one KV pool per engine and no way to load blocks into it
# from outside.
#
# **Data parallelism.** Several engine cores, each with a full copy of the
# model, behind one front end. Independent replicas need nothing special;
# the interesting part is MoE models, whose expert layers are shared across
# the replicas, so every replica must step in lock-step, running dummy
# batches when it has no work
# ([`DPEngineCoreProc`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/core.py#L1661);
# the all-reduce that decides whether anyone still has work,
# [`_has_global_unfinished_reqs`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/core.py#L1887));
# a coordinator process balances requests and wakes idle replicas
# ([`DPCoordinator`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/coordinator.py#L23)).
# Glassbox runs one engine core; what it does have across several GPUs
# (executors, tensor parallelism) is session 07's subject.
#
# **Dual batch overlap (DBO).** With expert parallelism, a step spends much
# of its time in all-to-all communication. DBO splits the batch into two
# micro-batches and runs them on two threads that hand the GPU to each
# other, so one computes while the other communicates
# ([`maybe_create_ubatch_slices`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/ubatch_utils.py#L63),
# [`UBatchContext`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/ubatching.py#L20),
# [`UBatchWrapper`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_ubatch_wrapper.py#L113)).
# Glassbox has no MoE and no expert parallelism, so there is nothing to
# overlap.

# %% [markdown]
# ## 9. Exercise
#
# From the reading plan's session 06: *how does the drafter run inside the
# scheduler step — propose k tokens, verify them in one forward pass, accept
# the longest correct prefix, roll back the rest — and what happens to the
# rejected tokens' KV blocks?* Answer it for this run's **code** request, at
# its first step that verified drafts after its output started repeating
# itself, and at one where every draft was rejected.

# %%
code_rows = [e for e in verified if SPEC_NAME[e.request_id] == "code"]
rejected_all = next(e for e in code_rows if e.num_accepted == 0)
accepted_all = next(e for e in code_rows if e.num_accepted == K)
by_step = {}
for e in spec_events:
    if e.kind in ("sched.step", "runner.batch") and e.step is not None:
        by_step.setdefault(e.step, {})[e.kind] = e
code_id = next(r for r, n in SPEC_NAME.items() if n == "code")
for e in (rejected_all, accepted_all):
    sched = by_step[e.step]["sched.step"]
    batch = by_step[e.step]["runner.batch"]
    row = batch.req_ids.index(code_id)
    print(f"step {e.step}:")
    print(f"  proposed at the end of step {e.step - 1}: {proposed[('code', max(s for (n, s) in proposed if n == 'code' and s < e.step))]}")
    print(f"  scheduled: {sched.num_scheduled_tokens[code_id]} tokens (1 + {len(sched.scheduled_spec_decode_tokens[code_id])} "
          f"drafts); the runner's row: query_len {batch.query_lens[row]}, positions "
          f"{batch.num_computed_tokens[row]}..{batch.seq_lens[row] - 1}")
    print(f"  verified: {e.num_accepted} accepted, appended {e.token_ids}, {e.num_rejected} rejected; "
          f"cursor {e.num_computed_tokens}")

# %% [markdown]
# **Answer.** The drafter runs *after* sampling, at the end of a step: the
# runner's `propose_draft_token_ids` looks at each request's tokens,
# including the one just sampled, and returns up to k drafts, which go back
# to the scheduler with the step's output (`spec.proposed`). The next
# `schedule()` gives the request 1 + k tokens of budget — its last token and
# the drafts — and allocates blocks for all of them, so the runner's row
# has a query of 4 positions, as if it were a short prefill chunk. One
# forward pass produces logits at all four positions; the rejection sampler
# compares the target's choice at each position with the draft there and
# keeps the agreeing prefix plus one token of its own. At the first printed
# step that was 0 drafts and 1 token: the step cost four positions of
# compute and produced what a plain decode would have. At the second, 3
# drafts and a bonus: 4 tokens from one step. `update_from_output` then
# moves `num_computed_tokens` back by the number rejected, so the next step
# recomputes from the first position that was wrong. Nothing else is rolled
# back: no block is freed (section 3 found a block allocated only for drafts
# that stayed with the request until it finished), because the positions
# are reused by the next tokens, which overwrite the stale K/V in place.
# With a grammar the matcher is also rolled back
# (`so.rollback`), since it had to step through the drafts to build their
# mask rows.
#
# ## 10. Self-checks

# %%
# Async: one step in flight on the serial loop, two on the async one; same tokens.
assert {e.num_in_flight for e in loops["serial"]["events"] if e.kind == "engine.step_launched"} == {1}
assert max(e.num_in_flight for e in loops["async"]["events"] if e.kind == "engine.step_launched") == 2
assert loops["serial"]["tokens"] == loops["async"]["tokens"]
# Speculation: appended = accepted + 1 (or fewer at max_tokens); accepted + rejected = drafts.
for e in verified:
    assert e.num_accepted + e.num_rejected == len(e.draft_token_ids)
    assert len(e.token_ids) <= e.num_accepted + 1
assert all(len(o.outputs[0].token_ids) == 48 for o in spec_outs)
# A block allocated only for drafts that were all rejected, freed only when its request finished.
assert lookahead
for e, a in lookahead:
    frees = [f for f in spec_events if f.kind == "kv.freed" and f.request_id == e.request_id]
    assert len(frees) == 1 and a.block_ids[0] in frees[0].block_ids
print("async and speculation: ok")

# %%
# Structured output: waited while gated, output parses and fits the schema, one mask row per token.
assert all(e.num_skipped_waiting == 1 for e in sched_steps[:GATED_STEPS])
parsed = json.loads(so_outputs["json"].outputs[0].text)
assert set(parsed) == {"city", "population"} and isinstance(parsed["population"], int)
assert len(masked) == len(json_tokens) and masked[-1].num_allowed == 1
# LoRA: one adapter per step with one slot; b's load evicted a.
ev1 = lora_runs[1]["events"]
name1 = {e.request_id: e.lora_name for e in ev1 if e.kind == "request.added"}
assert all(len({name1[r] for r in e.num_scheduled_tokens} - {""}) <= 1 for e in ev1 if e.kind == "sched.step")
assert any(e.evicted_from_slots == [1] and e.loaded == [2] for e in ev1 if e.kind == "lora.slots")
# Quantization: GGUF bytes under a fifth of float32's, same greedy tokens; FP8 weights really e4m3.
assert quant["gguf"]["init"].weight_bytes < 0.2 * base_bytes
assert quant["gguf"]["tokens"] == quant["float32"]["tokens"]
assert ("weight", "float8_e4m3fn", [576, 960]) in quant["fp8"]["params"]
print("structured output, LoRA, quantization: ok")
