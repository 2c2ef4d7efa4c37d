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
# # Session 05 — Attention backends and sampling
#
# **Goal.** Two short pieces of code sit at the two ends of every forward
# pass, and this session takes both apart. At the start of each layer's
# attention, the backend writes the step's new keys and values into the
# paged KV cache and then reads each request's context back *through its
# block table*, block by block, wherever the blocks happen to lie. At the
# end of the step, the sampler turns one row of logits per request into one
# token per request, although every row may ask for something different:
# greedy, a temperature, top-k, top-p, min-p, penalties, its own seed,
# logprobs. By the end you should be able to compute one step of paged
# attention yourself, name the sampler's stages in order and say what each
# did to a given request, and explain why a seeded request gives the same
# tokens whatever else shares its batch.
#
# The lab:
#
# 1. the files to read — vLLM at `52a31cc` beside the Glassbox twin, lines
#    computed from data;
# 2. one engine, in-process, tracing at `full`, with a small KV pool;
# 3. paged attention: a workload that leaves the block tables deliberately
#    scattered (and two requests sharing a block), one step of layer 0
#    recomputed by hand in plain torch, and the same inputs run through
#    every attention backend this machine has;
# 4. the sampler: one engine step in which eight requests with eight
#    different sampling settings start from the *same* distribution, each row
#    followed through the sampler's stages from the trace's
#    `sampler.sampled` events, then every row's token reproduced by hand;
# 5. what top-k and top-p cost, measured here;
# 6. the exercise — *why does a seed survive batching, and what did each
#    stage do to the followed request?* — answered from this run;
# 7. self-checks.
#
# It runs on CUDA when torch sees a GPU and on the CPU otherwise; the
# outputs stored in this notebook were recorded on a CPU. The model is the
# default one, SmolLM2-135M-Instruct (30 layers; 9 query heads and 3 KV heads
# of 64 dims; a vocabulary of 49,152 tokens).

# %% [markdown]
# ## 1. What to read
#
# | vLLM file | read it for |
# |---|---|
# | [`vllm/v1/attention/backends/flash_attn.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/attention/backends/flash_attn.py) | the default GPU backend in vLLM: `FlashAttentionBackend` (a bundle of static methods: its name, its KV cache shape, which builder and impl go with it), `FlashAttentionMetadataBuilder.build` (once per step), `FlashAttentionImpl.forward` (per layer: one `flash_attn_varlen_func` call that takes the block table); the K/V write is `do_kv_cache_update`. No Glassbox twin |
# | [`vllm/v1/attention/backends/triton_attn.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/attention/backends/triton_attn.py) | the readable GPU reference: the same three roles, kernels written in Triton |
# | [`vllm/v1/attention/backends/flashinfer.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/attention/backends/flashinfer.py) | FlashInfer: the block table becomes a CSR page list, `plan()` once per step on the host, `run()` per layer |
# | [`vllm/v1/attention/backends/cpu_attn.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/attention/backends/cpu_attn.py) | vLLM's CPU backend (C++ kernels). Ours, under the same name, is plain torch plus one C++ decode kernel, and is the oracle the other backends are tested against |
# | [`vllm/v1/attention/backend.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/attention/backend.py), [`vllm/v1/attention/selector.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/attention/selector.py) | the contract (`CommonAttentionMetadata`, builder, impl) and which backend a layer gets |
# | [`vllm/v1/sample/sampler.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/sample/sampler.py) | `Sampler.forward`: the fixed order of stages (its class docstring lists them) |
# | [`vllm/v1/sample/ops/topk_topp_sampler.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/sample/ops/topk_topp_sampler.py), [`vllm/v1/sample/ops/penalties.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/sample/ops/penalties.py) | top-k / top-p and the random draw, one implementation per platform; the three penalties |
# | [`vllm/v1/sample/logits_processor/interface.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/sample/logits_processor/interface.py), [`builtin.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/sample/logits_processor/builtin.py), [`state.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/sample/logits_processor/state.py), [`__init__.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/sample/logits_processor/__init__.py) | logits processors, now a package: the interface (`apply`, `is_argmax_invariant`, `update_state` with a `BatchUpdate`), the three built-ins (min-tokens, logit bias, min-p), and `build_logitsprocs` |
# | [`vllm/v1/sample/metadata.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/sample/metadata.py) | `SamplingMetadata`: per-request settings as per-row tensors, plus the flags that let the sampler skip work |
#
# The table below is computed: vLLM's lines from
# `docs/data/vllm_twins_52a31cc.json`, ours from parsing the Glassbox source
# as it is now (`reading_table` in `sessions/lab.py`). A `—` means the name
# has no twin: Glassbox's `TopKTopPSampler` has no CPU-only `forward_cpu`
# and no top-k-only shortcut (section 5 measures what that shortcut buys).

# %%
import os
import sys
from pathlib import Path

from IPython.display import Markdown, display

# One process: the runner, its attention layers and its sampler live in this
# kernel, so we can wrap them, and the trace is one file.
os.environ["GLASSBOX_ENABLE_MULTIPROCESSING"] = "0"
# Idle OpenMP threads sleep instead of spinning: on a CPU other jobs keep
# busy, spinning makes every step slower. Set before torch is imported; the
# results do not depend on it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import engine  # noqa: E402

REPO = Path(engine.__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "sessions"))  # sessions/lab.py: helpers shared by the notebooks
from lab import reading_table, show_vllm, vllm_line, vllm_url  # noqa: E402


SESSION_FILES = {
    "vllm/v1/attention/backend.py": ["CommonAttentionMetadata", "AttentionMetadataBuilder.build", "AttentionImpl.forward"],
    "vllm/v1/attention/selector.py": ["get_attn_backend"],
    "vllm/v1/attention/backends/cpu_attn.py": [
        "CPUAttentionBackend", "CPUAttentionMetadataBuilder.build", "CPUAttentionBackendImpl.forward",
    ],
    "vllm/v1/attention/backends/triton_attn.py": [
        "TritonAttentionBackend", "TritonAttentionMetadataBuilder.build", "TritonAttentionImpl.forward",
    ],
    "vllm/v1/attention/backends/flashinfer.py": [
        "FlashInferBackend", "FlashInferMetadataBuilder.build", "FlashInferImpl.forward",
    ],
    "vllm/v1/sample/sampler.py": [
        "Sampler", "Sampler.forward", "Sampler.apply_logits_processors", "Sampler.apply_penalties",
        "Sampler.sample", "Sampler.greedy_sample", "Sampler.apply_temperature", "Sampler.gather_logprobs",
    ],
    "vllm/v1/sample/ops/topk_topp_sampler.py": [
        "TopKTopPSampler", "TopKTopPSampler.forward_native", "TopKTopPSampler.forward_cuda",
        "TopKTopPSampler.forward_cpu", "apply_top_k_top_p", "apply_top_k_top_p_pytorch", "apply_top_k_only",
        "random_sample", "flashinfer_sample",
    ],
    "vllm/v1/sample/ops/penalties.py": ["apply_all_penalties"],
    "vllm/v1/sample/metadata.py": ["SamplingMetadata"],
    "vllm/v1/sample/logits_processor/interface.py": [
        "BatchUpdate", "LogitsProcessor", "LogitsProcessor.apply", "LogitsProcessor.is_argmax_invariant",
        "LogitsProcessor.update_state",
    ],
    "vllm/v1/sample/logits_processor/builtin.py": [
        "MinPLogitsProcessor.apply", "LogitBiasLogitsProcessor.apply", "MinTokensLogitsProcessor.apply",
    ],
    "vllm/v1/sample/logits_processor/state.py": ["LogitsProcessors"],
    "vllm/v1/sample/logits_processor/__init__.py": ["build_logitsprocs"],
}
display(Markdown(reading_table(SESSION_FILES)))

# %% [markdown]
# vLLM's FlashAttention backend has no Glassbox twin (our selector starts at
# FlashInfer on CUDA), so it is not in the table above. Its lines, from the
# same data:

# %%
FLASH = "vllm/v1/attention/backends/flash_attn.py"
rows = ["| vLLM name | line at 52a31cc |", "|---|--:|"]
for name in ["FlashAttentionBackend", "FlashAttentionBackend.get_kv_cache_shape", "FlashAttentionMetadataBuilder.build",
             "FlashAttentionImpl", "FlashAttentionImpl.forward", "FlashAttentionImpl.do_kv_cache_update"]:
    line = vllm_line(FLASH, name)
    rows.append(f"| `{name}` | [{line}]({vllm_url(FLASH, line)}) |")
display(Markdown("\n".join(rows)))

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
    if not item["seed"].startswith("001 · 5"):
        continue
    path, name, approx = item["old"]
    said = f"{path}" + (f" {name}" if name else "")
    now = "\n               ".join(f"{p}:{vllm_line(p, q)} {q}" for p, q in item["now"])
    print(f"plan says  {said}\n  {item['status']:>9}: {now}")

# %% [markdown]
# Two corrections, then. The reading plan's `FlashAttentionBackend.forward`
# does not exist: a backend class at `52a31cc` is a namespace of static
# methods, and the method that runs per layer is `FlashAttentionImpl.forward`
# ([L667](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/attention/backends/flash_attn.py#L667)).
# Read it for what it does *not* do: it writes nothing into the cache (that
# is `do_kv_cache_update`, a separate call the attention layer makes first,
# [L850](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/attention/backends/flash_attn.py#L850)),
# splits the cache into its K and V halves
# ([L734](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/attention/backends/flash_attn.py#L734)),
# and hands the whole batch — query start offsets, context lengths, the
# block table — to one varlen kernel call
# ([L796](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/attention/backends/flash_attn.py#L796)).
# The gather through the block table happens inside that kernel. Glassbox's
# backends do the write and the attention in one `forward` and store the
# cache as `[2, num_blocks, block_size, H_kv, D]` (K/V first); vLLM's
# FlashAttention cache is `[num_blocks, 2, …]` (block first). Neither changes
# the arithmetic.
#
# And the plan's single `logits_processor.py` is now a package of four
# files; the sampler itself does not care, it only sees the processors
# sorted into two lists on `SamplingMetadata.logitsprocs`: those that may
# change the argmax (applied to every row) and those that cannot (applied
# only to rows that sample at random).
#
# ## 2. The engine
#
# One `LLM`, in-process, `trace_level="full"`: at that level every
# `sampler.sampled` event carries the five most likely tokens after each
# stage of the sampler. The KV pool is 40 blocks of 16 tokens (block 0 is the
# null block, so 39 usable), small on purpose for section 3.
#
# Before the first step the notebook wraps three things of the live runner,
# none of which changes what they compute:
#
# * the attention metadata builder's `build`, to keep each step's
#   `CommonAttentionMetadata` (what every backend receives);
# * layer 0's attention `impl.forward`, to keep its query, key, value, the
#   cache before and after, and its output;
# * the sampler's `forward`, to keep its logits and what it needs to repeat
#   the draw: the RNG state of every seeded row and of torch's global RNG.
#
# Each capture is filed under the step it belongs to, read from the tracer
# (the runner sets it before the forward and again before sampling).

# %%
import tempfile
import time

import numpy as np
import torch

from engine import LLM, SamplingParams
from engine.model_executor.layers.attention.attention import Attention
from engine.tracing import TraceReplay, load_trace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRACE = Path(tempfile.mkdtemp(prefix="glassbox-session05-")) / "attention_sampling.jsonl"
BLOCK_SIZE = 16
NUM_BLOCKS = 40
t0 = time.perf_counter()
llm = LLM(
    trace_path=str(TRACE),
    trace_level="full",
    num_gpu_blocks_override=NUM_BLOCKS,
    max_model_len=(NUM_BLOCKS - 1) * BLOCK_SIZE,
    block_size=BLOCK_SIZE,
    max_num_seqs=16,
    disable_log_stats=True,
    # The notebook records layer 0's attention call from Python (below). A CUDA graph
    # replays its kernels without running any Python, so on a GPU the engine runs
    # eagerly; on the CPU it does anyway (the CPU default is -O0).
    enforce_eager=True,
)
llm_engine = llm.llm_engine
core = llm_engine.engine_core.engine_core  # EngineCore (in this process)
runner = core.model_executor.driver_worker.model_runner  # GPUModelRunner
tokenizer = llm.get_tokenizer()
layer0 = next(m for m in runner.model.modules() if isinstance(m, Attention))
H, H_KV, D = layer0.num_heads, layer0.num_kv_heads, layer0.head_size
GROUP, SCALE = H // H_KV, layer0.impl.scale
print(f"engine ready in {time.perf_counter() - t0:.1f} s on {DEVICE}; attention backend "
      f"{runner.attn_backend.get_name()}; layer 0: {layer0.layer_name}, {H} query heads, {H_KV} KV heads, "
      f"head size {D}, scale {SCALE}")
print(f"trace: {TRACE}")

# %%
LABEL: dict[str, str] = {}  # internal request id -> the id we passed to add_request
common_md = {}  # step -> the step's CommonAttentionMetadata (host copies) and its rows
attn_calls = {}  # step -> layer 0's attention call: inputs, cache before/after, output
sampler_calls = {}  # step -> the sampler's logits and RNG states


def traced_step() -> int:
    return runner.trace.tracer.step


_build = runner.attn_metadata_builder.build


def recording_build(common):
    n = common.num_reqs
    common_md[traced_step()] = {
        "rows": [LABEL.get(r, r) for r in runner.input_batch.req_ids[:n]],
        "query_start_loc": common.query_start_loc_cpu[: n + 1].clone(),
        "seq_lens": common.seq_lens_cpu[:n].clone(),
        "block_table": common.block_table_tensor[:n].cpu().clone(),
        "slot_mapping": common.slot_mapping[: common.num_actual_tokens].cpu().clone(),
        "max_query_len": common.max_query_len,
        "max_seq_len": common.max_seq_len,
    }
    return _build(common)


runner.attn_metadata_builder.build = recording_build

_attn_forward = layer0.impl.forward


def recording_attention(layer, query, key, value, kv_cache, attn_metadata, output):
    if attn_metadata is None:  # a dummy run: nothing to keep
        return _attn_forward(layer, query, key, value, kv_cache, attn_metadata, output)
    before = kv_cache.detach().cpu().clone()
    result = _attn_forward(layer, query, key, value, kv_cache, attn_metadata, output)
    attn_calls[traced_step()] = {
        "q": query.detach().cpu().float().clone(), "k": key.detach().cpu().float().clone(),
        "v": value.detach().cpu().float().clone(), "before": before.float(),
        "after": kv_cache.detach().cpu().float().clone(), "out": output.detach().cpu().float().clone(),
    }
    return result


layer0.impl.forward = recording_attention  # an instance attribute shadows the method

_sampler_forward = runner.sampler.forward


def recording_sampler(logits, sampling_metadata, *args, **kwargs):
    md = sampling_metadata
    sampler_calls[traced_step()] = {
        "rows": [LABEL.get(r, r) for r in runner.input_batch.req_ids[: logits.shape[0]]],
        "logits": logits.detach().float().cpu().clone(),
        "device": logits.device.type,
        "global_rng": torch.get_rng_state() if logits.device.type == "cpu" else torch.cuda.get_rng_state(),
        "generators": {row: g.get_state() for row, g in md.generators.items()},
    }
    return _sampler_forward(logits, sampling_metadata, *args, **kwargs)


runner.sampler.forward = recording_sampler


def add(request_id, prompt, sampling_params):
    LABEL[llm_engine.add_request(request_id, prompt, sampling_params)] = request_id

# %% [markdown]
# ## 3. Paged attention
#
# ### 3a. A deliberately scattered block table
#
# A fresh pool hands out blocks 1, 2, 3, … in order, and a lone request's
# block table would be contiguous — which would hide the one thing a paged
# kernel must get right. So the workload scatters it on purpose:
#
# * **W**, a 620-token prompt, takes 39 blocks, the whole pool, generates one
#   token and finishes. Session 03 showed where its blocks go: back to the
#   free queue's tail, *last block first*, so the queue now counts down.
# * **A** (24 prompt tokens) and **B** (26) then arrive together and decode
#   20 tokens each. Every time one of them fills a block it takes the next
#   one off the queue, so their blocks interleave in the order they grow.
# * **C** arrives a few steps later. Its first 16 tokens are A's first 16,
#   so the prefix cache hands it A's first block (a hit on a block A is
#   still using), and it computes only its other 14 tokens — a prefill whose
#   queries sit at positions 16–29 and must attend to keys of A's block.
#
# **Predict, then run.** The free queue after W is 39, 38, 37, …, 1. Which
# blocks will A, B and C hold when C's prefill runs? Which physical block
# holds token 20 of C?

# %%
W_TEXT = " ".join(f"{i} times {i} is {i * i}." for i in range(1, 120))
A_TEXT = ("A paged KV cache keeps every sequence in fixed-size blocks, and a block table "
          "maps each sequence's logical blocks to physical ones.")
B_TEXT = ("The sampler sees one row of logits per request and must honour each request's own "
          "temperature, filters, penalties and seed in a single batched call.")
C_TAIL = " So a kernel that assumed contiguous memory would read somebody else's keys."
W_IDS = tokenizer.encode(W_TEXT)[:620]  # ceil(620 / 16) = 39 blocks: the whole pool
A_IDS = tokenizer.encode(A_TEXT)[:24]
B_IDS = tokenizer.encode(B_TEXT)[:26]
C_IDS = A_IDS[:16] + tokenizer.encode(C_TAIL)[:14]  # one full block in common with A
assert len(W_IDS) == 620 and len(A_IDS) == 24 and len(B_IDS) == 26 and len(C_IDS) == 30

t0 = time.perf_counter()
add("W", {"prompt_token_ids": W_IDS}, SamplingParams(temperature=0.0, max_tokens=1))
while llm_engine.has_unfinished_requests():
    llm_engine.step()
add("A", {"prompt_token_ids": A_IDS}, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
add("B", {"prompt_token_ids": B_IDS}, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
for _ in range(12):  # A and B prefill, then decode until both have a third block
    llm_engine.step()
add("C", {"prompt_token_ids": C_IDS}, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
attention_outputs = {}
while llm_engine.has_unfinished_requests():
    for out in llm_engine.step():
        if out.finished:
            attention_outputs[out.request_id] = out.outputs[0].token_ids
print(f"W, then A, B and C: {time.perf_counter() - t0:.1f} s")

# %% [markdown]
# The trace gives the free queue after W left (`TraceReplay.state_at`), and
# the captured metadata gives the block tables the backend received. Two
# steps matter below: **MIXED**, the step of C's prefill (A and B decode one
# token each beside it), and **DECODE**, the next step in which all three
# decode.

# %%
# NBVAL_CHECK_OUTPUT
llm_engine.tracer.flush()
events = load_trace(str(TRACE))
replay = TraceReplay(events)
INTERNAL = {e.external_req_id: e.request_id for e in events if e.kind == "request.added"}
a_admitted = next(e.step for e in events if e.kind == "sched.admitted" and e.request_id == INTERNAL["A"])
free_after_w = replay.state_at(a_admitted - 1).free_queue
print(f"free queue when A and B arrive (step {a_admitted}), head first: {free_after_w[:6]} ... "
      f"{free_after_w[-3:]} ({len(free_after_w)} blocks)")
hit = next(e for e in events if e.kind == "kv.cache_hit" and e.request_id == INTERNAL["C"])
print(f"C's prefix-cache lookup: {hit.num_cached_tokens} tokens cached, in block(s) {hit.block_ids}")


def used_blocks(md: dict, row: int) -> list[int]:
    n = -(-int(md["seq_lens"][row]) // BLOCK_SIZE)
    return md["block_table"][row, :n].tolist()


def query_lens(md: dict) -> list[int]:
    return np.diff(md["query_start_loc"].numpy()).tolist()


MIXED = next(s for s, md in sorted(common_md.items()) if "C" in md["rows"] and max(query_lens(md)) > 1)
DECODE = next(s for s, md in sorted(common_md.items())
              if s > MIXED and len(md["rows"]) == 3 and max(query_lens(md)) == 1)
for name, step in (("MIXED", MIXED), ("DECODE", DECODE)):
    md = common_md[step]
    print(f"{name} = step {step}: rows {md['rows']}, query_lens {query_lens(md)}, "
          f"seq_lens {md['seq_lens'].tolist()}")
    for row, rid in enumerate(md["rows"]):
        print(f"    {rid}: blocks {used_blocks(md, row)}")
md = common_md[MIXED]
print("MIXED slot_mapping:", md["slot_mapping"].tolist())

# %% [markdown]
# Read the tables as the kernel does. Logical block *j* of a request is
# tokens `16j … 16j+15`; the block table says which physical block holds
# them. A's three blocks are neither in order nor adjacent, and C's
# logical block 0 is A's physical block: one set of keys and values, two
# sequences reading it. The slot mapping is the write side of the same
# table: token *t* at position *p* writes to
# `block_table[p // 16] * 16 + p % 16`. A's decode token (position 35)
# goes to slot `block_table[2] * 16 + 3`; C's fourteen new tokens, positions
# 16–29, fill offsets 0–13 of its second block. Nothing is written to the
# shared block: C only reads it.
#
# The same step as a picture: each request's logical blocks (top) and the
# physical pool (bottom), drawn from the captured block tables.

# %%
import matplotlib

matplotlib.use("Agg")  # draw off-screen; show() (sessions/lab.py) hands the PNG to the notebook
import matplotlib.pyplot as plt  # noqa: E402
from lab import show  # noqa: E402

COLOURS = {"A": "#e9c46a", "B": "#a8dadc", "C": "#f4a261"}


def draw_block_tables(step: int) -> None:
    md = common_md[step]
    owners: dict[int, list[str]] = {}
    for row, rid in enumerate(md["rows"]):
        for blk in used_blocks(md, row):
            owners.setdefault(blk, []).append(rid)
    first = max(1, min(owners) - 4)  # draw the pool from a little below the lowest block in use
    x_of = {blk: 2 + i for i, blk in enumerate(range(first, NUM_BLOCKS))}
    fig, ax = plt.subplots(figsize=(9, 3.4))
    ax.add_patch(plt.Rectangle((0.05, 0), 1.4, 0.9, facecolor="#eeeeee", edgecolor="grey"))
    ax.text(0.75, 0.45, f"1–{first - 1}", ha="center", va="center", fontsize=7)
    for blk, x in x_of.items():  # the physical pool (block 0, the null block, is not drawn)
        who = owners.get(blk, [])
        ax.add_patch(plt.Rectangle((x - 0.45, 0), 0.9, 0.9, facecolor=COLOURS[who[0]] if who else "#eeeeee",
                                   edgecolor="grey", hatch="//" if len(who) > 1 else None))
        ax.text(x, 0.45, str(blk), ha="center", va="center", fontsize=8)
    x = 0.6  # the logical blocks: one group per request, side by side
    for row, rid in enumerate(md["rows"]):
        blocks = used_blocks(md, row)
        ax.text(x + 0.55 * (len(blocks) - 1), 3.35, f"{rid}\nseq_len {int(md['seq_lens'][row])}",
                ha="center", va="bottom", fontsize=9)
        for j, blk in enumerate(blocks):
            ax.add_patch(plt.Rectangle((x - 0.45, 2.4), 0.9, 0.8, facecolor=COLOURS[rid], edgecolor="black"))
            ax.text(x, 2.8, f"[{j}]", ha="center", va="center", fontsize=8)
            ax.annotate("", xy=(x_of[blk], 0.92), xytext=(x, 2.38),
                        arrowprops=dict(arrowstyle="->", lw=1.0, color="#555555"))
            x += 1.1
        x += 0.9
    ax.text(-0.2, 0.45, "pool", ha="right", va="center", fontsize=9)
    ax.text(-0.2, 2.8, "logical\nblocks", ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.6, max(max(x_of.values()), x) + 0.6)
    ax.set_ylim(-0.2, 4.1)
    ax.axis("off")
    ax.set_title(f"step {step}: each request's block table row → physical blocks\n"
                 "(hatched: one block, two requests; grey: free)", fontsize=10)
    fig.tight_layout()
    show(fig)


draw_block_tables(MIXED)

# %% [markdown]
# ### 3b. One step of layer 0, by hand
#
# Everything any paged-attention kernel computes, in plain torch, from the
# inputs layer 0 received at step MIXED:
#
# 1. **write**: put this step's K and V rows into the cache at their slots
#    (view the cache as one row per slot: slot `s` is row `s`);
# 2. **gather**: for each request, take its blocks *in block-table order*,
#    flatten them into one `[seq_len, H_kv, D]` run of keys and values;
# 3. **attend**: each query head `h` uses KV head `h // 3` (grouped-query
#    attention, 9 query heads over 3 KV heads); scores are
#    `q·k / sqrt(64)`; query *j* of a request with `n` new tokens sits at
#    position `seq_len - n + j` and may see keys up to that position (the
#    causal mask, shifted by what was cached before); softmax; weighted sum of
#    the values.

# %%
def write_kv_by_hand(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [2, num_blocks, 16, H_kv, D] -> a copy with k, v [T, H_kv, D] written at their slots."""
    cache = cache.clone()
    per_slot = cache.view(2, -1, H_KV, D)  # row s = slot s = block s // 16, offset s % 16
    per_slot[0, slots] = k
    per_slot[1, slots] = v
    return cache


def attend_by_hand(q: torch.Tensor, cache: torch.Tensor, blocks: list[int], seq_len: int) -> torch.Tensor:
    """q [n, H, D]: the last n positions of a sequence whose seq_len keys/values lie in
    `blocks` (in order). Returns [n, H, D]."""
    n = q.shape[0]
    idx = torch.tensor(blocks)
    keys = cache[0, idx].reshape(-1, H_KV, D)[:seq_len]  # [seq_len, H_kv, D], in sequence order
    values = cache[1, idx].reshape(-1, H_KV, D)[:seq_len]
    keys = keys.repeat_interleave(GROUP, dim=1)  # query head h reads KV head h // GROUP
    values = values.repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * SCALE  # [H, n, seq_len]
    q_pos = torch.arange(seq_len - n, seq_len)
    visible = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # [n, seq_len]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, values)


def step_by_hand(step: int, block_order=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [T, H, D], cache after the write) of layer 0 at `step`, by hand.
    block_order(blocks) may reorder a request's blocks (to see what goes wrong)."""
    call, md = attn_calls[step], common_md[step]
    cache = write_kv_by_hand(call["before"], call["k"], call["v"], md["slot_mapping"])
    out = torch.empty_like(call["q"])
    qsl = md["query_start_loc"].tolist()
    for row in range(len(md["rows"])):
        blocks = used_blocks(md, row)
        if block_order is not None:
            blocks = block_order(blocks)
        out[qsl[row]:qsl[row + 1]] = attend_by_hand(call["q"][qsl[row]:qsl[row + 1]], cache, blocks,
                                                    int(md["seq_lens"][row]))
    return out, cache


by_hand = {step: step_by_hand(step) for step in (MIXED, DECODE)}
for step in (MIXED, DECODE):
    out, cache = by_hand[step]
    live = attn_calls[step]
    print(f"step {step}: max |by hand - live backend| = {(out - live['out']).abs().max().item():.2e}; "
          f"cache after the write identical: {torch.equal(cache, live['after'])}")

# %% [markdown]
# **Predict, then run.** Suppose a kernel ignored the table's order and read
# each request's blocks sorted by physical id. How far off would each
# request's output be — rounding noise, or garbage? And if it swapped only
# A's two *full* blocks (39 and 38) and kept the partly filled one last?

# %%
md = common_md[MIXED]
qsl = md["query_start_loc"].tolist()
live_out = attn_calls[MIXED]["out"]
magnitude = live_out.abs().max().item()


def error_of(output: torch.Tensor, rid: str) -> float:
    row = md["rows"].index(rid)
    return (output[qsl[row]:qsl[row + 1]] - live_out[qsl[row]:qsl[row + 1]]).abs().max().item()


wrong, _ = step_by_hand(MIXED, block_order=sorted)
print(f"(the outputs themselves are at most {magnitude:.2f} in absolute value)")
for row, rid in enumerate(md["rows"]):
    kind = "decode" if qsl[row + 1] - qsl[row] == 1 else f"prefill of {qsl[row + 1] - qsl[row]}"
    print(f"{rid} ({kind}): blocks {used_blocks(md, row)} read as {sorted(used_blocks(md, row))}: "
          f"max error {error_of(wrong, rid):.3f}")
a_blocks = used_blocks(md, md["rows"].index("A"))
swapped, _ = step_by_hand(MIXED, block_order=lambda b: [b[1], b[0], *b[2:]] if b == a_blocks else b)
print(f"A (decode): blocks read as {[a_blocks[1], a_blocks[0], *a_blocks[2:]]}: max error {error_of(swapped, 'A'):.1e}")

# %% [markdown]
# Sorting the blocks breaks every request, and not by rounding. The swap
# does not break A at all — and that says what the order is for. A decode
# query sees every key of its context, and attention is a weighted sum over
# a *set* of keys: the keys carry their positions already (RoPE was applied
# before they were cached), so their order in memory does not enter the
# sum. What the order decides is *which slots* are in the set. The context
# is cut at `seq_len`, which assumes the partly filled block comes last:
# read in another order, the cut keeps stale slots of that block (whatever
# an earlier request left there) and drops real keys of another. And for a
# prefill, the causal mask is by position: C's query at position 20 must see
# keys 0–20, which are only the right keys if position *p* is read from
# `block_table[p // 16]`. So every backend walks the table in order —
# inside FlashAttention's and FlashInfer's kernels, in Triton's
# `kernel_unified_attention`, in our CPU backend's `_gather_context`.
#
# ### 3c. The same inputs through every backend on this machine
#
# Glassbox has three backends (`engine/v1/attention/backends/`):
#
# * `cpu_attn.py` — `CPU_ATTN`, the one this engine runs on a CPU. Its decode
#   rows go through a C++ kernel (`csrc/cpu/cpu_attn.cpp`) when it is built;
#   with `use_cpu_kernels=False` everything is plain torch (SDPA).
# * `triton_attn.py` — `TRITON_ATTN`, Triton kernels. On a CPU they run only
#   in Triton's interpreter (`TRITON_INTERPRET=1`, NumPy underneath), which
#   must be set before Triton is first imported; the tests run it in a fresh
#   process (`tests/helpers/triton_interpret.py`) and so does this notebook.
#   The interpreter is slow, but one layer at these sizes takes a few
#   seconds, the new process included. On a GPU they are compiled, and run
#   here in this process. A mixed batch goes to the unified
#   kernel; a small decode-only batch to the split-KV decode kernel.
# * `flashinfer.py` — `FLASHINFER`: needs CUDA and the `flashinfer` package.
#
# Each one gets the captured `CommonAttentionMetadata`, a copy of the cache
# as it was before the step, and the step's q, k, v.

# %%
import importlib.util
import subprocess

from engine.v1.attention.backend import CommonAttentionMetadata
from engine.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadataBuilder

STEPS_FILE = TRACE.with_name("attention_steps.pt")
TRITON_OUT = TRACE.with_name("triton_out.pt")


def common_of(step: int, device: str = "cpu") -> CommonAttentionMetadata:
    md = common_md[step]
    qsl = md["query_start_loc"].to(torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl,
        seq_lens=md["seq_lens"].to(torch.int32).to(device), _seq_lens_cpu=md["seq_lens"].to(torch.int32),
        num_reqs=len(md["rows"]), num_actual_tokens=len(md["slot_mapping"]),
        max_query_len=md["max_query_len"], max_seq_len=md["max_seq_len"],
        block_table_tensor=md["block_table"].to(torch.int32).to(device),
        slot_mapping=md["slot_mapping"].to(torch.int64).to(device),
    )


def run_cpu_torch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    call = attn_calls[step]
    cache, out = call["before"].clone(), torch.empty_like(call["q"])
    metadata = CPUAttentionMetadataBuilder(BLOCK_SIZE, torch.device("cpu"), use_cpu_kernels=False).build(common_of(step))
    CPUAttentionBackendImpl(H, D, SCALE, H_KV).forward(None, call["q"], call["k"], call["v"], cache, metadata, out)
    return out, cache


def run_triton_cuda(step: int) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Triton's kernels compiled for this GPU, on float32 copies of the step's inputs."""
    from engine.v1.attention.backends.triton_attn import TritonAttentionImpl, TritonAttentionMetadataBuilder

    call, cuda = attn_calls[step], torch.device("cuda")
    impl = TritonAttentionImpl(H, D, SCALE, H_KV)
    metadata = TritonAttentionMetadataBuilder(BLOCK_SIZE, cuda).build(common_of(step, "cuda"))
    cache, out = call["before"].to(cuda), torch.full_like(call["q"], float("nan"), device=cuda)
    impl.forward(None, call["q"].to(cuda), call["k"].to(cuda), call["v"].to(cuda), cache, metadata, out)
    path = "split-KV decode" if impl.use_split_kv(metadata) else "unified"
    return path, out.cpu(), cache.cpu()


# The Triton run, as a script for a fresh process (TRITON_INTERPRET must be set before triton is imported).
TRITON_SCRIPT = """
import sys, torch
from engine.v1.attention.backend import CommonAttentionMetadata
from engine.v1.attention.backends.triton_attn import TritonAttentionImpl, TritonAttentionMetadataBuilder
from engine.v1.attention.ops import triton_unified_attention
from triton.runtime.interpreter import InterpretedFunction
steps = torch.load(sys.argv[1])
interpreted = isinstance(triton_unified_attention.kernel_unified_attention, InterpretedFunction)
results = {"interpreted": interpreted}
for step, s in steps.items():
    impl = TritonAttentionImpl(s["H"], s["D"], s["scale"], s["H_KV"])
    md = TritonAttentionMetadataBuilder(s["block_size"], torch.device("cpu")).build(CommonAttentionMetadata(**s["common"]))
    cache, out = s["before"].clone(), torch.full_like(s["q"], float("nan"))
    impl.forward(None, s["q"], s["k"], s["v"], cache, md, out)
    results[step] = {"out": out, "cache": cache, "path": "split-KV decode" if impl.use_split_kv(md) else "unified"}
torch.save(results, sys.argv[2])
"""


def run_triton_interpreted(steps: list[int]) -> dict:
    payload = {}
    for step in steps:
        c, call = common_of(step), attn_calls[step]
        payload[step] = {
            "H": H, "H_KV": H_KV, "D": D, "scale": SCALE, "block_size": BLOCK_SIZE,
            "q": call["q"], "k": call["k"], "v": call["v"], "before": call["before"],
            "common": {f: getattr(c, f) for f in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "num_reqs",
                                                  "num_actual_tokens", "max_query_len", "max_seq_len",
                                                  "block_table_tensor", "slot_mapping", "_seq_lens_cpu")},
        }
    torch.save(payload, STEPS_FILE)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(STEPS_FILE), str(TRITON_OUT)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"the Triton run failed:\n{proc.stderr[-2000:]}")
    return torch.load(TRITON_OUT)


results = {}  # (backend, step) -> (path, output, cache after)
live_name = runner.attn_backend.get_name()
for step in (MIXED, DECODE):
    live = attn_calls[step]
    path = "C++ decode kernel + SDPA" if live_name == "CPU_ATTN" and DEVICE == "cpu" else "as configured"
    results[f"{live_name} (the engine's own call)", step] = (path, live["out"], live["after"])
    results["CPU_ATTN, use_cpu_kernels=False", step] = ("plain torch", *run_cpu_torch(step))

skipped = []
if importlib.util.find_spec("triton") is None:
    skipped.append("TRITON_ATTN: triton is not installed here")
elif DEVICE == "cpu":
    t0 = time.perf_counter()
    triton = run_triton_interpreted([MIXED, DECODE])
    triton_seconds = time.perf_counter() - t0
    assert triton["interpreted"], "the Triton kernels did not run in the interpreter"
    for step in (MIXED, DECODE):
        results["TRITON_ATTN, TRITON_INTERPRET=1", step] = (triton[step]["path"], triton[step]["out"], triton[step]["cache"])
    print(f"Triton under the interpreter, both steps, in a fresh process: {triton_seconds:.1f} s")
elif live_name != "TRITON_ATTN":
    for step in (MIXED, DECODE):
        results["TRITON_ATTN (compiled, CUDA, fp32)", step] = run_triton_cuda(step)
if live_name != "FLASHINFER":
    why = "no CUDA device" if DEVICE == "cpu" else "not the engine's backend here"
    if importlib.util.find_spec("flashinfer") is None:
        why += " and the flashinfer package is not installed"
    skipped.append(f"FLASHINFER: {why}")

# %% [markdown]
# **Predict, then run.** Will the four computations agree bit for bit, or
# only to rounding? (They add up the same products in different orders.)

# %%
# NBVAL_CHECK_OUTPUT
TOL = 1e-4 if DEVICE == "cpu" else 2e-2  # float32 here; a GPU model runs in bf16
agree = {}
print(f"{'backend':<38} {'step':>4}  {'path':<26} output within {TOL:g} of by-hand   cache after == by-hand")
for (backend, step), (path, out, cache) in results.items():
    close = (out - by_hand[step][0]).abs().max().item() <= TOL
    same_cache = torch.equal(cache.float(), by_hand[step][1])
    agree[backend, step] = close and same_cache
    print(f"{backend:<38} {step:>4}  {path:<26} {str(close):<33} {same_cache}")
for line in skipped:
    print("skipped:", line)

# %%
print("largest difference from the by-hand result, per backend and step:")
for (backend, step), (path, out, cache) in results.items():
    print(f"  {backend:<38} step {step:>2}: {(out - by_hand[step][0]).abs().max().item():.2e}")

# %% [markdown]
# Every backend wrote the same cache, bit for bit (a copy is a copy), and
# produced the same attention output up to float32 rounding: the kernels
# differ in how they tile the work (the C++ kernel walks each request's
# blocks where they lie, the Triton unified kernel walks them in tiles of
# keys with an online softmax, the split-KV kernel cuts each context into
# slices and merges them with their log-sum-exps), not in what they compute.
#
# ## 4. The sampler
#
# ### 4a. The order of stages
#
# `Sampler.forward` runs a fixed sequence; Glassbox's twin follows vLLM's
# order, and the `full` trace snapshots the distribution after the stages in
# bold (the five most likely tokens and their probabilities):
#
# 1. logprobs of the **raw** logits, if any row asked for them (by default
#    these are what the API returns: `logprobs_mode="raw_logprobs"`);
# 2. a float32 copy;
# 3. whatever can change the argmax, for every row, greedy ones included:
#    allowed-token mask, bad words, min-tokens, logit bias, then the
#    repetition, frequency and presence penalties → **processed**;
# 4. if any row is greedy, its token is the argmax now; if all are, stop;
# 5. divide each random row by its temperature (greedy rows by 1) →
#    **temperature**;
# 6. the processors that cannot change the argmax: min-p → **min_p** (only
#    recorded when some row uses it);
# 7. top-k, then top-p over what top-k kept → **top_k_top_p** (only when some
#    row uses them); then one random draw per row;
# 8. each row keeps its greedy or its random token; then the requested
#    logprobs are gathered (from step 1's raw ones).
#
# Every stage runs on the whole `[rows, vocab]` tensor at once; a row that
# does not use a knob gets a neutral value (temperature 1, `top_k` = vocab
# size, `top_p` = 1, `min_p` = 0, penalties 1/0/0), so it passes through
# unchanged.
#
# The first 32 lines of vLLM's `Sampler.forward` are steps 1–3 and the call
# to `sample`, which does 4–7 (`show_vllm` prints them from
# `$GLASSBOX_VLLM_SRC` when that points at a vLLM checkout, the permalink
# otherwise):

# %%
show_vllm("vllm/v1/sample/sampler.py", "Sampler.forward", 32)

# %% [markdown]
# ### 4b. Eight requests, one prompt, eight settings
#
# All eight share one prompt of 9 tokens, so in the first step every row
# starts from the same raw distribution and any difference between them is
# the sampler's doing. `ignore_eos=True` and `max_tokens=12` fix the
# schedule: one prefill step for all eight, then eleven decode steps.

# %%
PROMPT = "The best way to spend a rainy afternoon is"
SAMPLING = {
    "greedy": dict(temperature=0.0),
    "penalized": dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5),
    "temp": dict(temperature=0.7, seed=11),
    "top_k": dict(temperature=1.0, top_k=5, seed=12),
    "top_p": dict(temperature=1.0, top_p=0.8, seed=13),
    "min_p": dict(temperature=1.0, min_p=0.1, seed=14),
    "followed": dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                     frequency_penalty=0.3, seed=1234, logprobs=5),
    "unseeded": dict(temperature=1.0),
}


def params(**knobs) -> SamplingParams:
    return SamplingParams(max_tokens=12, ignore_eos=True, **knobs)


t0 = time.perf_counter()
for rid, knobs in SAMPLING.items():
    add(rid, PROMPT, params(**knobs))
batched = {}
while llm_engine.has_unfinished_requests():
    for out in llm_engine.step():
        if out.finished:
            batched[out.request_id] = out
print(f"eight requests, 12 tokens each: {time.perf_counter() - t0:.1f} s")
for rid in SAMPLING:
    print(f"{rid:>9}: {batched[rid].outputs[0].text!r}")

# %% [markdown]
# **Predict, then run.** In the first step the model's favourite next token
# is " to" (about two chances in three). Which rows will pick it? Which
# stage will take it away from the rows that do not?

# %%
llm_engine.tracer.flush()
events = load_trace(str(TRACE))
INTERNAL = {e.external_req_id: e.request_id for e in events if e.kind == "request.added"}
ROLE = {internal: rid for rid, internal in INTERNAL.items()}
sampled = {(e.step, ROLE[e.request_id]): e for e in events if e.kind == "sampler.sampled"}
STEP1 = min(s for s, rid in sampled if rid == "followed")
PROMPT_IDS = next(e.prompt_token_ids for e in events
                  if e.kind == "request.added" and e.request_id == INTERNAL["followed"])
STAGES = ["raw", "processed", "temperature", "min_p", "top_k_top_p"]


def stage_probs(e) -> dict[str, dict[int, float]]:
    """stage -> {token id: probability} for the (at most five) candidates the trace kept, zeros dropped."""
    return {s.stage: {t: p for t, p in zip(s.token_ids, s.probs) if p > 0} for s in e.stages}


def word(token_id: int) -> str:
    return repr(tokenizer.decode([token_id]))


# %%
# NBVAL_CHECK_OUTPUT
print(f"step {STEP1}: {len([k for k in sampled if k[0] == STEP1])} rows; stages recorded: "
      f"{[s.stage for s in sampled[STEP1, 'followed'].stages]}")
raw_top = {rid: max(stage_probs(sampled[STEP1, rid])['raw'].items(), key=lambda kv: kv[1])[0] for rid in SAMPLING}
print(f"same raw favourite on every row: {len(set(raw_top.values())) == 1} ({word(raw_top['greedy'])})")
print()
print(f"{'request':>9}  {'greedy':<6}  stages that changed its candidates        picked the raw favourite")
for rid, knobs in SAMPLING.items():
    e = sampled[STEP1, rid]
    probs = stage_probs(e)
    changed = [b for a, b in zip(STAGES, STAGES[1:])
               if probs[b].keys() != probs[a].keys()
               or any(abs(probs[b][t] - probs[a][t]) > 1e-4 for t in probs[a])]
    if e.greedy:  # a greedy row takes the argmax of `processed`: later stages do not touch it
        changed = [s for s in changed if s == "processed"]
    # a seeded draw is reproducible; an unseeded one depends on the global RNG's history
    favourite = "n/a (global RNG)" if "seed" not in knobs and not e.greedy else e.token_id == raw_top[rid]
    print(f"{rid:>9}  {str(e.greedy):<6}  {', '.join(changed) or '-':<42} {favourite}")
print()
for rid in ("greedy", "penalized"):
    print(f"{rid} token at step {STEP1}: {word(sampled[STEP1, rid].token_id)}")

# %% [markdown]
# Row by row:
#
# * **greedy** takes the raw argmax; nothing after `processed` touches a
#   greedy row (its temperature counts as 1 and it keeps the argmax).
# * **penalized** is greedy too, but the repetition penalty counts the
#   *prompt's* tokens as well as the output's: " to" is in the prompt ("way
#   to spend"), its positive logit is divided by 1.3, and the argmax moves.
#   Frequency and presence penalties count generated tokens only, so in the
#   first step they do nothing.
# * **temp** (0.7) sharpens the distribution — the favourite gains, the tail
#   loses — but removes nothing.
# * **top_k** (5) and **top_p** (0.8) cut the tail and renormalise what
#   is left; **min_p** (0.1) keeps only tokens at least a tenth as likely as
#   the favourite (4c counts how many tokens each row had left).
# * **followed** goes through every stage (next section); **unseeded** has
#   only a temperature of 1, which changes nothing: it draws from the raw
#   distribution with torch's global RNG.
#
# A row whose stages left the favourite on top can still draw something
# else: that is what sampling means. The table's last column says which
# seeded rows did; the unseeded row's draw is left out of a table that must
# read the same on every run.

# %% [markdown]
# ### 4c. The followed request, stage by stage, by hand
#
# The trace keeps five candidates per stage. To see the whole distribution,
# redo the sampler's work for every row from the captured logits, in plain
# torch, following the order of 4a — and then repeat the draw itself with
# the RNG states captured just before the sampler ran: the global RNG fills
# one `Exp(1)` number per token for every row, each seeded row then draws its
# own row from its own generator, and the token is the argmax of
# `probability / noise` (the "exponential race": token *i* wins with
# probability exactly *pᵢ*).

# %%
call = sampler_calls[STEP1]
ROWS = call["rows"]
V = call["logits"].shape[1]
NEUTRAL = dict(temperature=1.0, top_k=V, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
               frequency_penalty=0.0, presence_penalty=0.0)


def knob(rid: str, name: str):
    return SAMPLING[rid].get(name, NEUTRAL[name])


def sample_by_hand(call: dict, outputs_so_far: dict[str, list[int]]) -> dict:
    """Every row of one sampler call redone by hand: per row, the logits after each
    stage and the token. `outputs_so_far`: each row's generated ids before this step."""
    logits = call["logits"].clone()  # [rows, V]
    n = logits.shape[0]
    stages = {"raw": logits.clone()}
    for r, rid in enumerate(call["rows"]):  # penalties, one row at a time
        seen = torch.zeros(V, dtype=torch.bool)
        seen[PROMPT_IDS] = True
        counts = torch.zeros(V)
        for t in outputs_so_far[rid]:
            counts[t] += 1
        seen |= counts > 0
        rep = knob(rid, "repetition_penalty")
        row = logits[r]
        row[seen] = torch.where(row[seen] > 0, row[seen] / rep, row[seen] * rep)
        row -= knob(rid, "frequency_penalty") * counts + knob(rid, "presence_penalty") * (counts > 0)
    stages["processed"] = logits.clone()
    greedy = [knob(rid, "temperature") < 1e-5 for rid in call["rows"]]
    greedy_token = logits.argmax(dim=-1)
    temps = torch.tensor([1.0 if g else knob(rid, "temperature") for rid, g in zip(call["rows"], greedy)])
    logits = logits / temps[:, None]
    stages["temperature"] = logits.clone()
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([knob(rid, "min_p") for rid in call["rows"]])[:, None]
    logits = logits.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * min_p, float("-inf"))
    stages["min_p"] = logits.clone()
    edge_flipped = logits.clone()  # the same filter with the tokens at p's edge flipped
    for r, rid in enumerate(call["rows"]):  # top-k, then top-p over what top-k kept
        row = logits[r]
        k, p = knob(rid, "top_k"), knob(rid, "top_p")
        kth_largest = row.topk(k).values[-1]
        row[row < kth_largest] = float("-inf")
        edge_flipped[r] = row
        if p < 1.0:
            sorted_row = row.sort(descending=True).values
            probs = sorted_row.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            keep = mass_before < p  # keep tokens until the mass reaches p
            # A token whose mass before it is within float32 rounding of p can land on
            # either side, depending on the order the sums ran in (the engine's on a GPU).
            keep_flipped = keep ^ ((mass_before - p).abs() < 1e-5)
            # The engine keeps logit *values*: all >= the smallest kept one, so tokens tied
            # with it stay as well (bfloat16 logits, a GPU's, tie often).
            lowest, lowest_flipped = sorted_row[keep].min(), sorted_row[keep_flipped].min()
            edge_flipped[r, edge_flipped[r] < lowest_flipped] = float("-inf")
            row[row < lowest] = float("-inf")
    stages["top_k_top_p"] = logits.clone()
    stages["top_k_top_p, edge flipped"] = edge_flipped
    # The draw: global RNG for the whole tensor, then each seeded row from its own generator,
    # on the engine's device (a CUDA generator's numbers are not a CPU generator's). Copies of
    # the states recorded at the call: the notebook's own RNG is left where it was.
    device = call["device"]
    noise = torch.empty(n, V, device=device)
    if len(call["generators"]) != n:
        global_rng = torch.Generator(device=device)
        global_rng.set_state(call["global_rng"])
        noise.exponential_(generator=global_rng)
    for r, state in call["generators"].items():
        generator = torch.Generator(device=device)
        generator.set_state(state)
        noise[r].exponential_(generator=generator)
    noise = noise.cpu().clamp_min_(torch.finfo(noise.dtype).tiny)
    final_probs = logits.softmax(dim=-1)
    random_token = (final_probs / noise).argmax(dim=-1)
    tokens = torch.where(torch.tensor(greedy), greedy_token, random_token)
    return {"stages": stages, "tokens": tokens.tolist(), "noise": noise, "final_probs": final_probs}


mine = sample_by_hand(call, {rid: [] for rid in ROWS})  # step 1: nothing generated yet
print("tokens by hand: ", dict(zip(ROWS, mine["tokens"])))
print("tokens (trace): ", {rid: sampled[STEP1, rid].token_id for rid in ROWS})
left = {rid: int(torch.isfinite(mine["stages"]["top_k_top_p"][r]).sum()) for r, rid in enumerate(ROWS)
        if knob(rid, "temperature") >= 1e-5}
print("tokens each random row could draw from (after min-p, top-k, top-p):", left)

# %% [markdown]
# The eight tokens by hand are the engine's, the unseeded row included (its
# noise came from the global RNG state saved just before the call). Now the
# followed request's distribution after each stage — the whole vocabulary,
# not just five candidates:

# %%
F = ROWS.index("followed")


def entropy_bits(p: torch.Tensor) -> float:
    p = p[p > 0]
    return float(-(p * p.log2()).sum())


walk = []
for stage in STAGES:
    p = mine["stages"][stage][F].softmax(dim=-1)
    top = p.topk(5)
    walk.append({"stage": stage, "alive": int(torch.isfinite(mine["stages"][stage][F]).sum()), "entropy": entropy_bits(p),
                 "top": list(zip(top.indices.tolist(), top.values.tolist()))})
knobs = SAMPLING["followed"]
print("followed:", ", ".join(f"{k}={v}" for k, v in knobs.items()))
print(f"{'stage':<12} {'tokens left':>11} {'entropy (bits)':>15}   top 5 (probability)")
for w in walk:
    top = ", ".join(f"{word(t)} {p:.3f}" for t, p in w["top"] if p > 0)
    print(f"{w['stage']:<12} {w['alive']:>11,} {w['entropy']:>15.2f}   {top}")
# the trace's five candidates per stage, against the by-hand distribution
E_FOLLOWED = sampled[STEP1, "followed"]
worst = max(abs(mine["stages"][s.stage][F].softmax(dim=-1)[t].item() - p)
            for s in E_FOLLOWED.stages for t, p in zip(s.token_ids, s.probs))
print(f"trace's candidates vs by-hand, worst difference over all stages: {worst:.1e}")

# %% [markdown]
# The draw itself, for the followed row: the kept tokens' probabilities,
# the noise its own generator drew for them, and the ratio whose argmax
# wins.

# %%
p_f, q_f = mine["final_probs"][F], mine["noise"][F]
ratio = p_f / q_f
contenders = ratio.topk(5).indices.tolist()
print(f"{'token':<14} {'p':>7} {'Exp(1) noise':>13} {'p / noise':>10}")
for t in contenders:
    print(f"{word(t):<14} {p_f[t].item():>7.3f} {q_f[t].item():>13.3f} {ratio[t].item():>10.3f}")
chosen = E_FOLLOWED.token_id
print(f"winner: {word(chosen)}, raw rank {E_FOLLOWED.rank}, raw logprob {E_FOLLOWED.logprob:.3f}; "
      f"probability in the distribution it was drawn from: {p_f[chosen].item():.3f}")

# %% [markdown]
# A diagram of the same walk, from the trace's own candidates (the five most
# likely tokens after each stage, and how many tokens the stage left
# alive):

# %%
fig, axes = plt.subplots(1, len(STAGES), figsize=(13, 2.8), sharex=True)
for ax, s, w in zip(axes, E_FOLLOWED.stages, walk):
    pairs = [(t, p) for t, p in zip(s.token_ids, s.probs) if p > 0]
    labels = [tokenizer.decode([t]).strip() or repr(tokenizer.decode([t])) for t, _ in pairs]
    ax.barh(range(len(pairs)), [p for _, p in pairs],
            color=["#e76f51" if t == chosen else "#2a9d8f" for t, _ in pairs])
    ax.set_yticks(range(len(pairs)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_title(f"{s.stage}\n{w['alive']:,} tokens left", fontsize=9)
    ax.set_xlim(0, 1)
    ax.tick_params(axis="x", labelsize=7)
axes[0].set_xlabel("probability", fontsize=8)
fig.suptitle(f"'followed', step {STEP1}: the five most likely tokens after each stage "
             f"(red: the token drawn)", fontsize=10)
fig.tight_layout()
show(fig)

# %% [markdown]
# ### 4d. Logprobs come from the raw distribution
#
# The followed request asked for `logprobs=5`. Which distribution are they
# taken from — the one it sampled from, or the model's? Compare the first
# token's returned logprobs with the trace's `raw` stage:

# %%
# NBVAL_CHECK_OUTPUT
returned = batched["followed"].outputs[0].logprobs[0]  # {token id: Logprob} for the first token
raw = stage_probs(sampled[STEP1, "followed"])["raw"]
print(f"returned {len(returned)} entries: the sampled token and the top 5 "
      f"(the sampled token {'is' if chosen in raw else 'is not'} among the raw top 5)")
print("each returned logprob == log(raw probability) from the trace:",
      all(abs(lp.logprob - np.log(raw[t])) < 1e-4 for t, lp in returned.items() if t in raw))
print("sampled token's returned logprob and rank == the trace's raw ones:",
      abs(returned[chosen].logprob - E_FOLLOWED.logprob) < 1e-4 and returned[chosen].rank == E_FOLLOWED.rank)

# %% [markdown]
# They are the model's (the default `logprobs_mode="raw_logprobs"`, taken
# in the sampler's first stage): the penalties, the temperature and the
# filters that shaped the draw are not in them. An engine started with
# `logprobs_mode="processed_logprobs"` (an engine setting, in vLLM as here)
# returns those of the distribution the token was drawn from instead; on
# CUDA that also turns FlashInfer's sampler off, since it never
# materialises the filtered distribution.
#
# ### 4e. The prompt's own logprobs
#
# `logprobs` describes the tokens the model chose. `prompt_logprobs=k` asks
# the same about the tokens it was given: for every prompt token after the
# first, its log-probability given the tokens before it, its rank in the
# vocabulary, and the `k` likeliest alternatives at that position. It costs
# no extra forward pass. The prefill already computed a hidden state at every
# prompt position; normally only the last one reaches the LM head. For such a
# request the runner sends the others through it too, one prefill chunk at a
# time, and returns the rows with the first sampled token (vLLM:
# `GPUModelRunner._get_prompt_logprobs_dict`,
# [gpu_model_runner.py#L5338](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_model_runner.py#L5338);
# the front end's `LogprobsProcessor._update_prompt_logprobs`,
# [logprobs.py#L121](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/logprobs.py#L121)).
# A block served from the prefix cache would skip its tokens' forward, so such
# a request does not read the cache (`skip_reading_prefix_cache`).
#
# **Predict, then run.** Score "The capital of France is Paris." Which
# token will the model find least likely? And is the number it gives
# " Paris" here the one a request that *generates* after "The capital of
# France is" reports for " Paris"?

# %%
from engine.utils.torch_utils import resolve_dtype

assert vllm_line("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner._get_prompt_logprobs_dict") == 5338
assert vllm_line("vllm/v1/engine/logprobs.py", "LogprobsProcessor._update_prompt_logprobs") == 121
SCORED, ASKED = "The capital of France is Paris.", "The capital of France is"
add("scored", SCORED, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
add("asked", ASKED, SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))
scoring = {}
while llm_engine.has_unfinished_requests():
    for out in llm_engine.step():
        if out.finished:
            scoring[out.request_id] = out
scored = scoring["scored"]
print("position  token        logprob  rank  the model's first choice there")
for pos, (token_id, position) in enumerate(zip(scored.prompt_token_ids, scored.prompt_logprobs)):
    if position is None:
        print(f"{pos:>8}  {word(token_id):<11}  (first token: nothing before it to predict it)")
        continue
    entry = position[token_id]
    best = min(position.items(), key=lambda item: item[1].rank)
    print(f"{pos:>8}  {word(token_id):<11} {entry.logprob:8.2f}  {entry.rank:>4}  {word(best[0])}")

# %% [markdown]
# The first row has no number: nothing comes before the first token. The
# rows come from the same forward pass as the prefill; the trace's
# `runner.prompt_logprobs` event says which positions each step scored and
# when the rows left (with the first sampled token):

# %%
# NBVAL_CHECK_OUTPUT
llm_engine.tracer.flush()
scoring_events = load_trace(str(TRACE))
scored_id = next(e.request_id for e in scoring_events
                 if e.kind == "request.added" and e.external_req_id == "scored")
for e in scoring_events:
    if e.kind == "runner.prompt_logprobs" and e.request_id == scored_id:
        print(f"positions {e.first_position}..{e.first_position + e.num_positions - 1} scored, "
              f"top-{e.num_logprobs}, rows sent: {e.done}")
asked = scoring["asked"]
paris = scored.prompt_token_ids[len(asked.prompt_token_ids)]
print("the scored prompt starts with the asked one:",
      scored.prompt_token_ids[: len(asked.prompt_token_ids)] == asked.prompt_token_ids)
print(f"the next token there is {word(paris)}; the generating request's top 5 has it:",
      paris in asked.outputs[0].logprobs[0])
# fp32 on the CPU: the same sums in another batch shape agree to ~1e-6. bf16 on
# a GPU keeps 8 bits of mantissa, and the two requests run different kernel shapes.
mc = llm_engine.model_config
TOLERANCE = 1e-4 if resolve_dtype(mc.dtype, DEVICE, mc.config_dtype) == torch.float32 else 0.1
print("the same logprob both ways, within the dtype's tolerance:",
      abs(scored.prompt_logprobs[len(asked.prompt_token_ids)][paris].logprob
          - asked.outputs[0].logprobs[0][paris].logprob) < TOLERANCE)

# %% [markdown]
# A prompt logprob is what the model would have reported had it been asked
# to generate at that position: the raw distribution, before any penalty,
# temperature or filter (there is no sampling at prompt positions). Summed,
# the rows give the prompt's log-likelihood, which is how a served model is
# used to score text rather than write it.
#
# ## 5. What top-k and top-p cost
#
# Top-p needs the tokens in probability order, which means sorting the
# vocabulary — 49,152 entries per row here, 128k to 152k on Llama 3 or
# Qwen3. There are several ways to do the same filtering:
#
# * **sort + scatter** — vLLM's torch path: sort each row with its indices,
#   mask in sorted order, scatter the row back;
# * **sort + threshold** — Glassbox's `apply_top_k_top_p_pytorch`: sort the
#   values only, turn k and p into one threshold per row, mask the row in
#   place (no scatter). It keeps the same tokens as sort + scatter except at
#   a tie: where equal logits straddle p's edge, the threshold keeps them
#   all, the scatter those its sort happened to put first. A GPU's bfloat16
#   logits tie often, which is why 4c's by-hand filter keeps tied values;
# * **top-k alone** — `torch.topk(k)`, a partial selection: vLLM's CPU path
#   takes it when no row asks for top-p (`apply_top_k_only`; it needs the
#   largest k on the host, a sync Glassbox avoids);
# * **min-p** — no order needed at all: a softmax, a row max, a compare;
# * and, for scale, **the draw alone** (softmax + one `Exp(1)` per token +
#   argmax) that every random row pays anyway.
#
# On GPUs vLLM avoids the full sort where it can: FlashInfer's rejection
# sampling draws from the filtered distribution without sorting (vLLM and
# Glassbox both use it on CUDA when no row is seeded), and vLLM has a Triton
# top-k/top-p kernel it picks for batches of 8 rows or more
# ([`apply_top_k_top_p`, L321](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/sample/ops/topk_topp_sampler.py#L321)).
#
# **Predict, then run.** Per row, on one CPU core: is the draw alone cheap
# next to top-p? How much faster is top-k alone than top-k + top-p?
#
# Measured on this machine, one thread (so the figures do not depend on how
# many cores are free), random logits of the model's vocabulary size,
# `k = 50`, `p = 0.9`, `min_p = 0.05`; the median of several calls:

# %%
import statistics

from engine.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch, random_sample


def sort_and_scatter(logits, k, p):
    """Top-k then top-p on a sorted copy of each row, scattered back (vLLM's torch approach)."""
    values, order = logits.sort(dim=-1)  # ascending: the largest last
    vocab = values.shape[-1]
    values.masked_fill_(values < values.gather(1, (vocab - k).unsqueeze(1)), float("-inf"))
    mass_up_to = values.softmax(dim=-1).cumsum(dim=-1)
    drop = mass_up_to <= (1 - p).unsqueeze(1)
    drop[:, -1] = False  # the favourite always survives
    values.masked_fill_(drop, float("-inf"))
    return logits.scatter_(-1, order, values)


def top_k_alone(logits, k):
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    return logits.masked_fill_(logits < kth, float("-inf"))


def min_p_filter(logits, m):
    probs = logits.softmax(dim=-1)
    return logits.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * m, float("-inf"))


def median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


threads = torch.get_num_threads()
torch.set_num_threads(1)
t_all = time.perf_counter()
gen = torch.Generator().manual_seed(0)
timings = {}
for rows in (1, 8, 32):
    x = torch.randn(rows, V, generator=gen) * 3
    k, p, m = torch.full((rows,), 50), torch.full((rows,), 0.9), torch.full((rows, 1), 0.05)
    reps = 9 if rows < 32 else 5
    timings[rows] = {
        "draw alone": median_ms(lambda: random_sample(x.softmax(dim=-1), {}), reps),
        "min-p": median_ms(lambda: min_p_filter(x.clone(), m), reps),
        "top-k alone (topk)": median_ms(lambda: top_k_alone(x.clone(), k), reps),
        "top-k+top-p, sort + scatter": median_ms(lambda: sort_and_scatter(x.clone(), k, p), reps),
        "top-k+top-p, sort + threshold": median_ms(lambda: apply_top_k_top_p_pytorch(x.clone(), k, p), reps),
    }
torch.set_num_threads(threads)
print(f"ms per call (and per row), vocab {V:,}, 1 thread; measured in {time.perf_counter() - t_all:.1f} s")
print(f"{'':<31}" + "".join(f"{f'{r} rows':>20}" for r in timings))
for method in timings[1]:
    print(f"{method:<31}" + "".join(f"{timings[r][method]:>9.2f} ({timings[r][method] / r:5.2f})   "
                                    for r in timings))
# the two top-k+top-p variants keep the same tokens (float32 random logits: no ties)
y = torch.randn(4, V, generator=gen) * 3
kk, pp = torch.full((4,), 50), torch.full((4,), 0.9)
same = torch.equal(torch.isinf(sort_and_scatter(y.clone(), kk, pp)), torch.isinf(apply_top_k_top_p_pytorch(y.clone(), kk, pp)))
print("sort + scatter and sort + threshold keep the same tokens:", same)

# %% [markdown]
# What the figures say (read them above; they are this run's): the two
# sort-based variants cost about the same — the sort dominates, and skipping
# the scatter saves little on a CPU. Top-k alone, a partial selection, and
# min-p, which needs no order at all, cost a small fraction of a sort. The
# draw is not free either: one exponential random number per vocabulary
# entry per row. With one thread the per-row costs stay flat as the batch
# grows: the same work is simply repeated for each row. On a GPU the
# picture is different — a batch of rows sorts in parallel, and the
# question becomes the extra kernel launches and memory passes — which is
# why vLLM reaches for FlashInfer's sort-free sampler and its Triton kernel
# there.
#
# ## 6. Exercise: the seed and the batch
#
# *Why does the same prompt give the same tokens under a seed, whatever else
# is in its batch? And what did each of the sampler's stages do to the
# followed request's distribution?*
#
# **Predict, then run.** Run `followed` again alone, same prompt and
# settings, seed 1234: the same 12 tokens? `unseeded` alone: the same as in
# the batch? And `followed` alone with seed 4321?

# %%
t0 = time.perf_counter()
alone = {}
for rid, knobs in [("followed-alone", SAMPLING["followed"]), ("unseeded-alone", SAMPLING["unseeded"]),
                   ("followed-seed-4321", {**SAMPLING["followed"], "seed": 4321})]:
    add(rid, PROMPT, params(**knobs))
    while llm_engine.has_unfinished_requests():  # one at a time: each runs alone in its batch
        for out in llm_engine.step():
            if out.finished:
                alone[out.request_id] = out
print(f"three lone runs: {time.perf_counter() - t0:.1f} s")
for rid, out in [("followed (batch of 8)", batched["followed"]), *alone.items(),
                 ("unseeded (batch of 8)", batched["unseeded"])]:
    print(f"{rid:>22}: {out.outputs[0].token_ids}")

# %%
# NBVAL_CHECK_OUTPUT
llm_engine.tracer.flush()
events = load_trace(str(TRACE))
INTERNAL = {e.external_req_id: e.request_id for e in events if e.kind == "request.added"}
ROLE = {internal: rid for rid, internal in INTERNAL.items()}
sampled = {(e.step, ROLE[e.request_id]): e for e in events if e.kind == "sampler.sampled"}


def run_of(rid: str) -> list:
    return [e for (s, r), e in sorted(sampled.items()) if r == rid]


batch_sizes = {e.step: e.num_logits for e in events if e.kind == "runner.forward"}
for rid in ("followed", "followed-alone"):
    print(f"{rid}: rows in its batch per step {sorted({batch_sizes[e.step] for e in run_of(rid)})}, "
          f"its row {sorted({e.row for e in run_of(rid)})}")
same_seeded = batched["followed"].outputs[0].token_ids == alone["followed-alone"].outputs[0].token_ids
print("followed, batch of 8 vs alone, seed 1234: same 12 tokens:", same_seeded)
print("followed alone, seed 1234 vs seed 4321: same 12 tokens:",
      alone["followed-alone"].outputs[0].token_ids == alone["followed-seed-4321"].outputs[0].token_ids)

# %%
drift = max(abs(a.logprob - b.logprob) for a, b in zip(run_of("followed"), run_of("followed-alone")))
print(f"largest difference in the chosen tokens' raw logprobs, batch vs alone: {drift:.1e}")
# Where such a drift comes from: the same row through the model's LM head, alone and among 8 rows.
hidden = torch.randn(8, runner.model.lm_head.weight.shape[1], generator=torch.Generator().manual_seed(0))
one_row = torch.nn.functional.linear(hidden[:1], runner.model.lm_head.weight.cpu().float())
in_batch = torch.nn.functional.linear(hidden, runner.model.lm_head.weight.cpu().float())[:1]
print(f"LM head, one row alone vs the same row among 8: max difference {(one_row - in_batch).abs().max().item():.1e}")
print("unseeded, batch vs alone: same 12 tokens:",
      batched["unseeded"].outputs[0].token_ids == alone["unseeded-alone"].outputs[0].token_ids, "(this run)")

# %% [markdown]
# The mechanism, isolated: `random_sample` (our twin of vLLM's) with one
# seeded row placed at different rows of batches of different sizes, every
# other row unseeded. The seeded row's winner never changes, because its
# noise comes only from its own generator:

# %%
# NBVAL_CHECK_OUTPUT
probs = torch.softmax(torch.linspace(0, 3, 1000), dim=0)  # one fixed distribution
picks = []
for batch, row in [(1, 0), (4, 0), (4, 3), (16, 9), (64, 41)]:
    batch_probs = probs.repeat(batch, 1)
    token = random_sample(batch_probs, {row: torch.Generator().manual_seed(1234)})[row].item()
    picks.append(token)
    print(f"batch of {batch:>2}, seeded row at {row:>2}: token {token}")
print("same token every time:", len(set(picks)) == 1)

# %% [markdown]
# **Answer, part 1: the seed.** A seeded request carries its own
# `torch.Generator`, created once when the runner first sees it
# (`generator.manual_seed(seed)` in `_update_states`; vLLM's
# [gpu_model_runner.py#L1199](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_model_runner.py#L1199)),
# and kept by the persistent batch, which moves it with the row
# (`InputBatch.generators`; vLLM's
# [gpu_input_batch.py#L413](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/worker/gpu_input_batch.py#L413)).
# Every step the draw fills the batch's noise from the global RNG and then
# *overwrites* each seeded row with numbers from that row's own generator
# ([`random_sample`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/sample/ops/topk_topp_sampler.py#L395)).
# So the noise a seeded request sees at its n-th token is the n-th draw of
# its generator, whatever row it sits in, however many rows there are, and
# whoever else drew from the global RNG. The runner even rewinds the
# generator after a sample it throws away (a prefill chunk), so chunking
# does not shift the sequence either. The other half is the logits: the
# row's own numbers must not depend on its neighbours. On this CPU they are
# not bit-identical — a matrix multiplication is blocked differently for 1
# row than for 8, so the same row comes out different in the last bits (the
# LM head alone shows it above) — but a token changes only if two
# candidates' `p / noise` ratios lie closer together than such a drift
# moves them, which did not happen here. vLLM has a batch-invariant mode for exact
# equality (`VLLM_BATCH_INVARIANT`, read for instance by
# `FlashAttentionImpl.__init__`,
# [L641](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/attention/backends/flash_attn.py#L641)).
# Without a seed the row's noise comes from the global RNG, whose position
# depends on everything drawn before — different alone and in a batch.
#
# Two places where this guarantee has conditions, in vLLM at `52a31cc`:
#
# * on CUDA, FlashInfer's sampler has no per-row generators, so any seeded
#   row sends the whole batch down the torch path
#   ([`forward_cuda`, L143](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/sample/ops/topk_topp_sampler.py#L143));
#   Glassbox does the same;
# * on a CPU, vLLM's `forward_cpu` uses the generators only when *every* row
#   of the batch has one; otherwise the whole batch is drawn by
#   `compiled_random_sample` from the global RNG
#   ([L178](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/sample/ops/topk_topp_sampler.py#L178)),
#   so there a seeded request mixed with unseeded ones is not reproducible
#   as the code reads. Glassbox has no CPU-only path: the run above mixed a
#   seeded row with unseeded and greedy ones on a CPU and kept its tokens.
#
# **Answer, part 2: the stages**, from this run's followed request at its
# first step (the numbers are printed by the next cell, from the by-hand
# walk of 4c, checked against the trace's candidates):

# %%
by_stage = {w["stage"]: w for w in walk}


def top1(stage: str) -> str:
    t, p = by_stage[stage]["top"][0]
    return f"{word(t)} at {p:.3f}"


raw_p = dict(by_stage["raw"]["top"])
fav = raw_top["followed"]
fav_processed = mine["stages"]["processed"][F].softmax(dim=-1)[fav].item()
print(f"raw:         the model's distribution; favourite {top1('raw')}, entropy {by_stage['raw']['entropy']:.2f} bits")
print(f"processed:   repetition 1.1 on the 9 prompt tokens (no output yet, so frequency 0.3 did nothing): "
      f"{word(fav)} fell from {raw_p[fav]:.3f} to {fav_processed:.3f}; favourite now {top1('processed')}; "
      f"entropy {by_stage['processed']['entropy']:.2f} bits")
print(f"temperature: divided by 0.8: sharper, favourite {top1('temperature')}, entropy "
      f"{by_stage['temperature']['entropy']:.2f} bits; nothing removed ({by_stage['temperature']['alive']:,} tokens)")
print(f"min_p:       0.05 x the favourite's probability as a floor: {by_stage['min_p']['alive']:,} tokens left, "
      f"favourite {top1('min_p')}")
print(f"top_k_top_p: 40, then 0.9 of the mass: {by_stage['top_k_top_p']['alive']:,} tokens left, "
      f"favourite {top1('top_k_top_p')}, entropy {by_stage['top_k_top_p']['entropy']:.2f} bits")
print(f"draw:        {word(chosen)} won the exponential race (p = {p_f[chosen].item():.3f} in the final "
      f"distribution; raw rank {sampled[STEP1, 'followed'].rank})")

# %% [markdown]
# In short: the penalties reshape (and may reorder) the candidates, the
# temperature reshapes without removing anything, min-p, top-k and top-p
# only remove tokens and renormalise what is left — in that order, so top-p
# measures its 0.9 of mass over what min-p and top-k kept — and the draw
# picks from what remains. Here the penalties and the temperature changed
# how likely each token was without ruling any out, and min-p, top-k and
# top-p ruled tokens out. (The other edits of the `processed` stage — bad
# words, allowed-token lists, min-tokens — rule tokens out too, for greedy
# rows as well.)
#
# ## 7. Self-checks

# %%
# Paged attention: by hand == every backend that ran, for both steps; the write path is exact.
assert all(agree.values()), agree
assert {step for _, step in results} == {MIXED, DECODE}
# C shares A's first physical block, and A's table is not in ascending order.
md = common_md[MIXED]
blocks = {rid: used_blocks(md, row) for row, rid in enumerate(md["rows"])}
assert blocks["C"][0] == blocks["A"][0] and hit.block_ids == [blocks["A"][0]]
assert blocks["A"] != sorted(blocks["A"])
print("paged attention by hand == backends; C reads A's block; tables are scattered: ok")

# %%
# Slot mapping = block_table[pos // 16] * 16 + pos % 16, for every token of the mixed step.
qsl, seq_lens = md["query_start_loc"].tolist(), md["seq_lens"].tolist()
expected = []
for row in range(len(md["rows"])):
    n = qsl[row + 1] - qsl[row]
    for pos in range(seq_lens[row] - n, seq_lens[row]):
        expected.append(int(md["block_table"][row, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
assert expected == md["slot_mapping"].tolist()
print("slot mapping recomputed from the block table: ok")

# %%
# The sampler by hand reproduces every row's token, and the trace's candidates, at every step.
outputs_so_far = {rid: [] for rid in SAMPLING}
edge_cases = []
for step in sorted(s for s in sampler_calls if s >= STEP1 and sampler_calls[s]["rows"] == ROWS):
    c = sampler_calls[step]
    by_hand_step = sample_by_hand(c, outputs_so_far)
    for r, rid in enumerate(c["rows"]):
        e = sampled[step, rid]
        assert by_hand_step["tokens"][r] == e.token_id, (step, rid)
        for s in e.stages:
            p = by_hand_step["stages"][s.stage][r].softmax(dim=-1)
            if not all(abs(p[t].item() - q) < 1e-4 for t, q in zip(s.token_ids, s.probs)):
                # Only top-p may differ, and only by tokens at p's edge (see sample_by_hand).
                assert s.stage == "top_k_top_p", (step, rid, s.stage)
                p = by_hand_step["stages"]["top_k_top_p, edge flipped"][r].softmax(dim=-1)
                assert all(abs(p[t].item() - q) < 1e-4 for t, q in zip(s.token_ids, s.probs)), (step, rid)
                edge_cases.append((step, rid))
        outputs_so_far[rid].append(e.token_id)
print(f"sampler redone by hand at {len(outputs_so_far['followed'])} steps, 8 rows each: tokens and stages match")
print(f"rows where a token at top-p's edge fell on the other side on this machine: {edge_cases or 'none'}")

# %%
# Greedy rows take the argmax of `processed`; every logprob the trace reports is raw.
for (step, rid), e in sampled.items():
    if e.greedy:
        top_processed = max(e.stages[1].probs)
        assert e.stages[1].stage == "processed" and e.stages[1].probs[e.stages[1].token_ids.index(e.token_id)] == top_processed
        assert not SAMPLING.get(rid, {}).get("temperature", 0.0)
# A seed gives the same tokens alone and in a batch; a different seed does not.
assert same_seeded
assert alone["followed-alone"].outputs[0].token_ids != alone["followed-seed-4321"].outputs[0].token_ids
print("greedy rows, seeds: ok")
llm.shutdown()
