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
# # Session 07 — The executor: one scheduler, several workers
#
# **Goal.** Sessions 01–05 ran the model in the scheduler's own process.
# Here the model is split across ranks with tensor parallelism (TP), each rank
# a process of its own holding a slice of every weight matrix, while the
# scheduler stays where it was, alone, in EngineCore. Between the two sits the
# executor. By the end you should be able to say what travels from the
# scheduler to the workers each step and by which route, what the ranks say
# to each other inside one forward pass (and how many times), what comes
# back, and which rank it comes from; and how many bytes of the weights each
# rank keeps.
#
# The lab:
#
# 1. the files to read — vLLM at `52a31cc` beside the Glassbox twin, lines
#    computed from data — and what happened to the Ray file the reading plan
#    names;
# 2. one tiny Llama run at TP=1 and at TP=2 with the `mp` executor: the same
#    tokens?
# 3. the processes of the TP=2 run, drawn from it;
# 4. one step in the trace: when each rank took the call, how long it ran,
#    and the collectives of each forward (counted before they are shown);
# 5. the weights on each rank, asked of the live workers with
#    `collective_rpc`, against the checkpoint;
# 6. the default model (30 layers, 9 heads) at TP=3;
# 7. the same TP=2 run on a local Ray cluster;
# 8. the exercise — *where does `SchedulerOutput` go, and what comes back?* —
#    answered from the trace, and the failure path;
# 9. self-checks.
#
# Everything runs on the CPU, where the ranks talk over gloo (on CUDA they
# would use NCCL; the code is the same). The stored outputs were recorded on
# a 2-core machine. There the whole notebook takes 20–30 s when the cores
# are idle, about a third of it starting Ray; with other jobs on the cores,
# Ray's start-up alone can take 25 s.

# %% [markdown]
# ## 1. What to read
#
# | vLLM file | read it for |
# |---|---|
# | [`vllm/v1/executor/abstract.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/executor/abstract.py#L48) | `Executor`: what EngineCore asks of the model side, and `get_class`, which turns `distributed_executor_backend` (`uni`, `mp`, `ray`) into a class |
# | [`vllm/v1/executor/multiproc_executor.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/executor/multiproc_executor.py#L109) | `MultiprocExecutor`: one worker process per rank, started by `_init_executor`; `collective_rpc` (one message on a ring, answers from one rank or all); `WorkerProc.worker_busy_loop` ([L944](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/executor/multiproc_executor.py#L944)), the loop each worker runs; the monitor thread that notices a dead worker |
# | [`vllm/distributed/device_communicators/shm_broadcast.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/distributed/device_communicators/shm_broadcast.py#L358) | `MessageQueue` over a `ShmRingBuffer`: one writer, many readers, a chunk per message and a read flag per reader per chunk |
# | [`vllm/distributed/parallel_state.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/distributed/parallel_state.py#L290) | `GroupCoordinator` (a process group and its collectives), `init_distributed_environment`, `initialize_model_parallel`, `get_tp_group` |
# | [`vllm/distributed/communication_op.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/distributed/communication_op.py#L12) | the collectives a layer calls: all-reduce, all-gather (and gather, reduce-scatter) on the TP group |
# | [`vllm/model_executor/layers/linear.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/model_executor/layers/linear.py#L410) | where the matrices are cut: `ColumnParallelLinear` (output rows split, output stays split), `QKVParallelLinear` (its heads per rank), `RowParallelLinear` (input columns split, partial sums all-reduced) |
# | [`vllm/model_executor/layers/vocab_parallel_embedding.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/model_executor/layers/vocab_parallel_embedding.py#L192) | `VocabParallelEmbedding`: each rank looks up its own range of the vocabulary and writes zeros for the rest; an all-reduce fills in the gaps |
# | [`vllm/model_executor/layers/logits_processor.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/model_executor/layers/logits_processor.py#L75) | `_gather_logits`: the LM head's vocabulary slices put back together |
# | [`vllm/v1/executor/ray_executor.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/executor/ray_executor.py#L64), [`ray_utils.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/executor/ray_utils.py#L56) | `RayDistributedExecutor`: one Ray actor per rank, on any node of a cluster; the actor class `RayWorkerWrapper` |
#
# The table below is computed as in the other sessions: vLLM's lines from
# `docs/data/vllm_twins_52a31cc.json`, ours by parsing the Glassbox source
# as it is now. A `—` means that side has no such name: Glassbox has no
# `_compiled_ray_dag`, its Ray executor calls the actors directly (section 7).

# %%
import os
import sys
import time
from pathlib import Path

from IPython.display import Markdown, display

T_NOTEBOOK = time.perf_counter()
# EngineCore in this process: the executor, and through it the workers, are
# reachable from the notebook (collective_rpc), and the workers are its children.
os.environ["GLASSBOX_ENABLE_MULTIPROCESSING"] = "0"
# Idle OpenMP threads sleep instead of spinning (set before torch is imported;
# the workers inherit it). The results do not depend on it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import engine  # noqa: E402

REPO = Path(engine.__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "sessions"))  # sessions/lab.py: helpers shared by the notebooks
sys.path.insert(0, str(REPO / "sessions" / "07_executor"))  # executor_lab.py: this session's probes
sys.path.insert(0, str(REPO))  # tests.helpers: the tiny checkpoint
from lab import reading_table, show_vllm, vllm_line, vllm_url  # noqa: E402

SESSION_FILES = {
    "vllm/v1/executor/abstract.py": ["Executor", "Executor.get_class", "Executor.execute_model",
                                     "Executor.sample_tokens", "Executor.max_concurrent_batches"],
    "vllm/v1/executor/multiproc_executor.py": [
        "MultiprocExecutor._init_executor", "MultiprocExecutor.collective_rpc", "MultiprocExecutor.execute_model",
        "MultiprocExecutor.start_worker_monitor", "FutureWrapper.result", "WorkerProc.worker_main",
        "WorkerProc.worker_busy_loop", "WorkerProc.async_output_busy_loop",
    ],
    "vllm/distributed/device_communicators/shm_broadcast.py": [
        "ShmRingBuffer", "MessageQueue", "MessageQueue.create_from_handle", "MessageQueue.acquire_write",
        "MessageQueue.acquire_read", "MessageQueue.enqueue", "MessageQueue.dequeue",
    ],
    "vllm/distributed/parallel_state.py": [
        "GroupCoordinator", "GroupCoordinator.all_reduce", "GroupCoordinator.all_gather",
        "init_distributed_environment", "initialize_model_parallel", "get_tp_group",
    ],
    "vllm/distributed/communication_op.py": ["tensor_model_parallel_all_reduce", "tensor_model_parallel_all_gather"],
    "vllm/model_executor/layers/linear.py": [
        "ColumnParallelLinear", "ColumnParallelLinear.weight_loader", "QKVParallelLinear",
        "QKVParallelLinear.weight_loader", "RowParallelLinear", "RowParallelLinear.forward",
    ],
    "vllm/model_executor/layers/vocab_parallel_embedding.py": ["VocabParallelEmbedding", "VocabParallelEmbedding.forward"],
    "vllm/model_executor/layers/logits_processor.py": ["LogitsProcessor._gather_logits"],
    "vllm/v1/executor/ray_executor.py": [
        "RayDistributedExecutor", "RayDistributedExecutor._init_executor", "RayDistributedExecutor.collective_rpc",
        "RayDistributedExecutor.execute_model", "RayDistributedExecutor._compiled_ray_dag",
    ],
    "vllm/v1/executor/ray_utils.py": ["initialize_ray_cluster", "ray_is_available"],
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
    if not item["seed"].startswith("001 · 7"):
        continue
    path, name, approx = item["old"]
    now = "\n               ".join(f"{p}:{vllm_line(p, q)} {q}" for p, q in item["now"])
    print(f"plan says  {path}\n  {item['status']:>9}: {now}")

# %% [markdown]
# The plan's `ray_distributed_executor.py` under `vllm/v1/executor/` is not
# in vLLM at `52a31cc` (`git show 52a31cc:<path>` fails, and `git ls-tree`
# lists `abstract.py`, `multiproc_executor.py`, `ray_executor.py`,
# `ray_executor_v2.py`, `ray_env_utils.py`, `ray_utils.py`,
# `uniproc_executor.py` there). Its history, from vLLM's git log: when V0's
# executors were removed (#27142, 2025-10-21), V0's file of the same name in
# `vllm/executor/` was moved to `vllm/v1/executor/` as `ray_executor.py`, and
# the plan's file shrank to an eight-line alias that re-exported
# `RayDistributedExecutor` from there "for backwards compatibility"; commit
# `4ae218c` (#38842, 2026-04-06) deleted the alias. So the class the plan
# means is read in
# [`ray_executor.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/executor/ray_executor.py#L64),
# with its actor in
# [`ray_utils.py`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/executor/ray_utils.py#L56).
# Since April 2026 there is also a second Ray executor,
# [`RayExecutorV2`](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/executor/ray_executor_v2.py#L205),
# a subclass of `MultiprocExecutor` that places `WorkerProc`s in Ray actors
# and keeps the shared-memory ring; `get_class` picks it only when
# `VLLM_USE_RAY_V2_EXECUTOR_BACKEND` is set
# ([abstract.py#L61](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/executor/abstract.py#L61)).
# Glassbox has only the first.
#
# The heart of this session is the worker's loop. vLLM's, at `52a31cc`
# (`show_vllm` prints the lines from your own checkout when
# `GLASSBOX_VLLM_SRC` points at one, the link otherwise):

# %%
show_vllm("vllm/v1/executor/multiproc_executor.py", "WorkerProc.worker_busy_loop", 27)

# %% [markdown]
# Read it for three things. Every worker takes every message off the same
# ring (`dequeue`), in the order it was written. The method travels as a
# name, looked up on the worker, or as a function pickled *by value*
# (`cloudpickle`). And a worker answers only when the message names it as
# the output rank, or names none (`output_rank is None or self.rank ==
# output_rank`). Glassbox's `WorkerProc.worker_busy_loop`
# (`engine/v1/executor/multiproc_executor.py`) has the same shape; it takes
# a fixed table of `Worker` methods or a function pickled *by name*, and
# writes two trace events per call, `worker.rpc_received` and
# `worker.rpc_done`, which section 4 reads.
#
# ## 2. The same prompts at TP=1 and at TP=2
#
# The model is a tiny Llama with random weights (the test suite's,
# `tests/helpers/hf_checkpoints.py`): 2 layers, hidden size 64, 4 query heads
# and 2 KV heads of 16 dims, an MLP of 128, a vocabulary of 256, float32. No
# tokenizer: the prompts are token ids. Three prompts of 20, 24 and 28
# tokens, 8 greedy tokens each.
#
# * TP=1: the default backend for one rank is `uni`, the worker inside
#   EngineCore's process (this one).
# * TP=2 with `distributed_executor_backend="mp"`: `MultiprocExecutor` forks
#   two worker processes, which join a gloo process group, load half of
#   the model each and wait on the ring. Traced at `lifecycle`: every
#   process writes its own part of the trace.
#
# **Predict, then run.** Will the two runs give the same 8 tokens for every
# prompt? And the same log-probabilities, to the last bit?

# %%
import tempfile

import torch
import transformers

from engine import LLM, SamplingParams
from tests.helpers.hf_checkpoints import TINY_CONFIG, save_tiny_checkpoint

transformers.utils.logging.disable_progress_bar()  # save_pretrained's bar
WORK = Path(tempfile.mkdtemp(prefix="glassbox-session07-"))
TINY = WORK / "tiny-llama"
save_tiny_checkpoint("llama", TINY, seed=3)
VOCAB = TINY_CONFIG["vocab_size"]
PROMPTS = [[(7 * j + 3 * i) % VOCAB for j in range(20 + 4 * i)] for i in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
# A small KV cache (4 MiB per rank) instead of the CPU default of 1 GiB: quicker to allocate.
# device="cpu": gloo between CPU processes, also on a machine with one GPU.
ENGINE = dict(device="cpu", skip_tokenizer_init=True, dtype="float32", max_model_len=128, block_size=16,
              kv_cache_memory_bytes=4 << 20, disable_log_stats=True)
TRACE = str(WORK / "tp2.jsonl")
timings = {}

t0 = time.perf_counter()
llm1 = LLM(str(TINY), **ENGINE)
tp1 = [o.outputs[0] for o in llm1.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
executor1 = llm1.llm_engine.engine_core.engine_core.model_executor
llm1.shutdown()
timings["TP=1 (uni)"] = time.perf_counter() - t0

t0 = time.perf_counter()
llm2 = LLM(str(TINY), tensor_parallel_size=2, distributed_executor_backend="mp",
           trace_path=TRACE, trace_level="lifecycle", **ENGINE)
timings["TP=2 (mp) start-up"] = time.perf_counter() - t0
t0 = time.perf_counter()
tp2 = [o.outputs[0] for o in llm2.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
timings["TP=2 (mp) generate"] = time.perf_counter() - t0
executor2 = llm2.llm_engine.engine_core.engine_core.model_executor
print(f"executors: {type(executor1).__name__} (TP=1), {type(executor2).__name__} (TP=2)")
print(f"trace: {TRACE}")

# %%
# NBVAL_CHECK_OUTPUT
for i, (a, b) in enumerate(zip(tp1, tp2)):
    print(f"prompt {i} ({len(PROMPTS[i])} tokens): TP=1 {list(a.token_ids)}  TP=2 {list(b.token_ids)}  "
          f"same: {list(a.token_ids) == list(b.token_ids)}")
same_tokens = all(list(a.token_ids) == list(b.token_ids) for a, b in zip(tp1, tp2))
assert same_tokens

# %%
diffs = [abs(la[t].logprob - lb[t].logprob)
         for a, b in zip(tp1, tp2) for la, lb in zip(a.logprobs, b.logprobs) for t in la]
bitwise = sum(d == 0.0 for d in diffs)
print(f"{len(diffs)} log-probabilities compared: {bitwise} identical to the bit; "
      f"largest difference {max(diffs):.1e}, mean {sum(diffs) / len(diffs):.1e}")

# %% [markdown]
# The tokens are the same; the log-probabilities differ in the last few
# bits (how many, and by how much, depends on the machine — the line above is
# this run's). The reason is arithmetic, not a bug: at TP=2 `o_proj` and
# `down_proj` each compute two partial products over half of their input
# columns, and the all-reduce adds the halves. That is the same sum as one
# rank's matrix product, grouped differently, and float addition is not
# associative. Greedy tokens survive such a difference unless two candidates
# are tied to within it. (The test suite asks for logprobs within `1e-4`:
# `tests/distributed/test_tensor_parallel.py`.)
#
# ## 3. The processes
#
# The TP=2 engine is still running. `collective_rpc` sends a function to
# every worker and returns what each one answered; `executor_lab.py`, beside
# this notebook, holds the functions. They must live in a module the workers
# can import: Glassbox pickles a function by its name, and a worker forked
# before the function was defined in a notebook cell does not have it, and
# the call fails with an error naming the function (the workers go on).
# vLLM sends the function's code instead (`cloudpickle`), so there it works.

# %%
import executor_lab  # noqa: E402

ranks = executor2.collective_rpc(executor_lab.rank_summary)
ENGINE_CORE_PID = os.getpid()
for r in ranks:
    print(f"rank {r['rank']} of {r['world_size']}: pid {r['pid']}, {r['num_params']:,} parameters, "
          f"{r['param_bytes']:,} bytes")
print(f"EngineCore (and this notebook): pid {ENGINE_CORE_PID}")

# %% [markdown]
# Now the process picture, drawn from this run. Message counts come from the
# trace, which we read once the engine is shut down: each worker writes a
# part file of its own, and shutdown merges them into the trace by time.

# %%
shapes = executor2.collective_rpc(executor_lab.layer_shapes, ("model.layers.0",))
LAYER0 = "model.layers.0"
CHECK_NAMES = [f"{LAYER0}.self_attn.qkv_proj.weight", f"{LAYER0}.self_attn.o_proj.weight",
               f"{LAYER0}.mlp.gate_up_proj.weight", f"{LAYER0}.mlp.down_proj.weight",
               "model.embed_tokens.weight", "lm_head.weight"]
rank_params = executor2.collective_rpc(executor_lab.rank_tensors, (CHECK_NAMES,))
t0 = time.perf_counter()
llm2.shutdown()
timings["TP=2 (mp) shutdown"] = time.perf_counter() - t0

from engine.tracing import EngineStepLaunched, SchedStep, WorkerRpcDone, WorkerRpcReceived, load_trace  # noqa: E402

events = load_trace(TRACE)
received = [e for e in events if isinstance(e, WorkerRpcReceived)]
done = [e for e in events if isinstance(e, WorkerRpcDone)]
print(f"{len(events)} events; worker.rpc_received per rank: "
      f"{ {r: sum(e.tp_rank == r for e in received) for r in (0, 1)} }")

# %%
import graphviz  # noqa: E402
from IPython.display import SVG  # noqa: E402

answers = {r: sum(e.replied for e in done if e.tp_rank == r) for r in (0, 1)}
calls = sum(e.tp_rank == 0 for e in received)
forwards = [e for e in done if e.method == "execute_model" and e.all_reduce_count]
ar = forwards[0].all_reduce_count
ag = forwards[0].all_gather_count

g = graphviz.Digraph(
    "executor",
    graph_attr={"rankdir": "LR", "fontsize": "11", "nodesep": "0.4", "ranksep": "0.6"},
    node_attr={"shape": "box", "style": "rounded,filled", "fontsize": "10"},
    edge_attr={"fontsize": "9"},
)
g.node("core", f"EngineCore  (pid {ENGINE_CORE_PID})\nscheduler → MultiprocExecutor\n"
       "execute_model / sample_tokens\n/ collective_rpc", fillcolor="lightblue")
g.node("ring", f"rpc_broadcast_mq\nshared-memory ring\n1 writer, 2 readers\n{calls} messages",
       shape="cylinder", fillcolor="white")
for r in (0, 1):
    g.node(f"tp{r}", f"WorkerProc TP{r}  (pid {ranks[r]['pid']})\nWorker + runner\n"
           f"{ranks[r]['param_bytes'] / 1024:.0f} KiB of weights", fillcolor="lightyellow")
    g.node(f"resp{r}", f"worker_response_mq TP{r}\n1 writer, 1 reader\n{answers[r]} answers",
           shape="cylinder", fillcolor="white")
    g.edge("ring", f"tp{r}", label="dequeue\n(every message)")
    g.edge(f"tp{r}", f"resp{r}", label="every call" if r == 0 else "start-up and\ncollective_rpc only",
           style="solid" if r == 0 else "dashed")
    g.edge(f"resp{r}", "core", style="solid" if r == 0 else "dashed")
g.edge("core", "ring", label="enqueue\n(one message per call)", color="red", fontcolor="red")
g.edge("tp0", "tp1", label=f"gloo, per forward:\n{ar} all-reduces\n{ag} all-gather", dir="both",
       color="purple", fontcolor="purple", constraint="false")
display(SVG(g.pipe(format="svg")))

# %% [markdown]
# One ring carries every call to both ranks; each rank has its own answer
# queue, but in the steady state only TP0's is used. The two workers talk to
# each other directly, over gloo, in the middle of each forward pass — never
# through EngineCore.
#
# ## 4. One step, from the trace
#
# A forward pass of this model at TP=2 meets the other rank at every place
# where a rank holds only part of a result:
#
# * the embedding: each rank holds half of the vocabulary's rows and writes
#   zeros for the tokens it does not own, so the two halves are summed;
# * in each layer, `o_proj` (a row-parallel layer: each rank has the
#   attention output of its own heads only) and `down_proj` (same, for its
#   half of the MLP) produce partial sums that must be added;
# * the LM head: each rank computes the logits of its half of the
#   vocabulary, which are concatenated.
#
# `qkv_proj` and `gate_up_proj` need nothing: they are column-parallel, and
# each rank keeps its own columns of the output for the attention heads and
# MLP units it owns.
#
# **Predict, then run.** How many all-reduces and all-gathers does one
# forward of this 2-layer model run on each rank? And how many bytes does
# each rank put into them in a decode step of 3 tokens (float32,
# hidden size 64, half of a vocabulary of 256 per rank)? In the prefill step
# of 72 tokens?

# %%
# NBVAL_CHECK_OUTPUT
steps = {e.step: e for e in events if isinstance(e, SchedStep)}
HIDDEN = TINY_CONFIG["hidden_size"]
LAYERS = TINY_CONFIG["num_hidden_layers"]
exec_done = {(e.step, e.tp_rank): e for e in done if e.method == "execute_model"}
forward_steps = sorted(s for s in steps if steps[s].total_num_scheduled_tokens > 0)
print(f"predicted: {2 * LAYERS} + 1 = {2 * LAYERS + 1} all-reduces, 1 all-gather per forward")
print("step  tokens  rows | all-reduces  all-gathers  bytes (rank 0 / rank 1) | predicted bytes")
for s in forward_steps:
    tokens, rows = steps[s].total_num_scheduled_tokens, len(steps[s].num_scheduled_tokens)
    d0, d1 = exec_done[s, 0], exec_done[s, 1]
    predicted = (2 * LAYERS + 1) * tokens * HIDDEN * 4 + rows * (VOCAB // 2) * 4
    print(f"{s:>4}  {tokens:>6}  {rows:>4} | {d0.all_reduce_count:>5} / {d1.all_reduce_count:<5}"
          f"{d0.all_gather_count:>5} / {d1.all_gather_count:<5}  "
          f"{d0.collective_bytes:>7,} / {d1.collective_bytes:<7,}  | {predicted:>7,}")

# %% [markdown]
# Five all-reduces (two per layer, one for the embedding) and one
# all-gather, every step and on both ranks, and the bytes are exactly the
# hidden states of every token of the step, five times, plus one row of
# half-vocabulary logits per request. All of them run inside
# `execute_model`: the all-gather comes at the end of the forward, in the
# LM head, and every rank then holds all of the logits. `sample_tokens`
# runs no collective at all (next cell) — yet every rank runs it: each rank
# samples the same tokens from the same logits, so that its own copy of the
# batch (the sampled ids it feeds into the next step, on the device)
# matches rank 0's without one more message.
#
# In vLLM these calls are `tensor_model_parallel_all_reduce` in
# `RowParallelLinear.forward` (next cell) and in
# `VocabParallelEmbedding.forward`
# ([L477](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/model_executor/layers/vocab_parallel_embedding.py#L477)),
# and `tensor_model_parallel_all_gather` in `LogitsProcessor._gather_logits`
# ([L75](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/model_executor/layers/logits_processor.py#L75);
# a platform may ask for a gather to one rank instead, and then only that
# rank has logits).

# %%
show_vllm("vllm/model_executor/layers/linear.py", "RowParallelLinear.forward", 28)

# %% [markdown]
# Now the time. For each step: when each rank took `execute_model` off the
# ring (its `worker.rpc_received`), counted from EngineCore's
# `engine.step_launched` for that step; how long the call took on each rank
# (`worker.rpc_done.seconds`); and how much of that each rank spent inside
# gloo's collectives (`collective_seconds`). A `sample_tokens` message
# carries no `SchedulerOutput`; its events have the step of the rank's last
# `execute_model`, the step it samples (a rank takes messages off the ring in
# order).

# %%
launched = {e.step: e.ts for e in events if isinstance(e, EngineStepLaunched)}
exec_recv = {(e.step, e.tp_rank): e.ts for e in received if e.method == "execute_model"}
sample_done = {(e.step, e.tp_rank): e for e in done if e.method == "sample_tokens"}


def ms(ns: float) -> str:
    return f"{ns / 1e6:+7.2f}"


print("        took execute_model (ms after launch) | execute_model ms (in collectives) | sample_tokens ms")
print("step    rank 0   rank 1   spread            |  rank 0          rank 1           | rank 0  rank 1")
for s in forward_steps:
    d0, d1 = exec_done[s, 0], exec_done[s, 1]
    spread = abs(exec_recv[s, 0] - exec_recv[s, 1]) / 1e6
    print(f"{s:>4}   {ms(exec_recv[s, 0] - launched[s])}  {ms(exec_recv[s, 1] - launched[s])}   {spread:6.2f}"
          f"            | {d0.seconds * 1e3:6.2f} ({d0.collective_seconds * 1e3:5.2f})  "
          f"{d1.seconds * 1e3:6.2f} ({d1.collective_seconds * 1e3:5.2f})  | "
          f"{sample_done[s, 0].seconds * 1e3:5.2f}  {sample_done[s, 1].seconds * 1e3:5.2f}")
share = sum(exec_done[s, r].collective_seconds for s in forward_steps for r in (0, 1)) / sum(
    exec_done[s, r].seconds for s in forward_steps for r in (0, 1))
print(f"share of execute_model's time spent inside collectives, both ranks: {share:.0%}")
print("collectives in sample_tokens, all steps, both ranks:",
      sum(e.all_reduce_count + e.all_gather_count for e in sample_done.values()))

# %% [markdown]
# What to read in this run's table (the figures vary between runs and
# machines; the pattern does not):
#
# * **Step 1** is taken off the ring right after its launch: both workers
#   were idle, waiting on the ring.
# * **Later steps** are taken milliseconds *after* their launch, often many.
#   With async scheduling EngineCore keeps two steps in flight: it schedules
#   and launches step N+1 while the workers still run step N, and the message
#   simply waits in the ring (up to ten of them fit) until each worker comes
#   back to `dequeue`. The gap is what was left of step N, its forward and
#   its sampling.
# * **The spread** between the two ranks taking the same message is a
#   millisecond or so: both read the same chunk, each when it is next free
#   and on a core. The rank that starts first does not get ahead for long:
#   it waits for the other in the very first all-reduce, the embedding's.
# * **Most of `execute_model` is spent inside the collectives.** On this
#   tiny model the matrix products take microseconds; a gloo all-reduce
#   returns only when *both* ranks have contributed, so its time is mostly
#   waiting for the other rank — and with EngineCore and two workers on two
#   cores, the other rank is often not on a core at that moment. On GPUs with
#   NCCL over NVLink the same calls cost microseconds each, but there are
#   2 × layers + 1 of them per step, which is why vLLM carries its own
#   all-reduce kernels for small messages.
#
# ## 5. The weights on each rank
#
# Each rank built the model with its share of the heads and loaded only its
# slice of each checkpoint tensor (the weight loaders narrow the tensor
# before copying it).
#
# **Predict, then run.** The checkpoint's `q_proj` is 64 × 64, `k_proj` and
# `v_proj` 32 × 64 (2 KV heads of 16), `o_proj` 64 × 64, `gate_proj` and
# `up_proj` 128 × 64, `down_proj` 64 × 128, the embedding and the LM head
# 256 × 64. What shapes does rank 0 hold for the fused `qkv_proj`, for
# `o_proj`, `gate_up_proj`, `down_proj`, the embedding? And is a rank's share
# of the weight bytes exactly one half?

# %%
# NBVAL_CHECK_OUTPUT
from safetensors.torch import load_file  # noqa: E402

full = load_file(str(TINY / "model.safetensors"))
print("checkpoint:", {n.removeprefix(f"{LAYER0}."): tuple(full[n].shape) for n in full if n.startswith(LAYER0)
                      and n.endswith("proj.weight")})
for s in shapes:
    print(f"rank {s['rank']}: {s['num_heads']} query heads, {s['num_kv_heads']} KV head;",
          {n: v for n, v in s["shapes"].items() if n.endswith("proj.weight")})
total = sum(t.numel() * t.element_size() for t in full.values())
for r in ranks:
    print(f"rank {r['rank']}: {r['param_bytes']:,} of the checkpoint's {total:,} bytes = "
          f"{r['param_bytes'] / total:.4f}")

# %% [markdown]
# Rank 0's fused `qkv_proj` is 64 × 64: rows 0–31 of `q_proj` (its two
# heads), then rows 0–15 of `k_proj` and of `v_proj` (its one KV head),
# stacked; rank 1's holds the other halves. `o_proj` is cut the other way,
# 64 × 32: the *columns* that read its own heads' output. Likewise `gate_up_proj` stacks half of the
# rows of `gate_proj` and of `up_proj` (64 + 64), and `down_proj` keeps half
# of the columns. Not quite half of the bytes: the RMSNorm weights (64
# numbers each, five of them) are on every rank whole.
#
# Shapes are not enough: the next cell checks each rank's tensors, value by
# value, against the matching slice of the checkpoint.

# %%
# NBVAL_CHECK_OUTPUT
HEAD = HIDDEN // TINY_CONFIG["num_attention_heads"]
INTER = TINY_CONFIG["intermediate_size"] // 2


def expected_slice(name: str, r: int) -> torch.Tensor:
    q, kv = slice(2 * HEAD * r, 2 * HEAD * (r + 1)), slice(HEAD * r, HEAD * (r + 1))  # 2 q heads, 1 KV head
    rows, vocab = slice(INTER * r, INTER * (r + 1)), slice(VOCAB // 2 * r, VOCAB // 2 * (r + 1))
    attn, mlp = f"{LAYER0}.self_attn", f"{LAYER0}.mlp"
    return {
        f"{attn}.qkv_proj.weight": lambda: torch.cat([full[f"{attn}.q_proj.weight"][q],
                                                      full[f"{attn}.k_proj.weight"][kv],
                                                      full[f"{attn}.v_proj.weight"][kv]]),
        f"{attn}.o_proj.weight": lambda: full[f"{attn}.o_proj.weight"][:, q],
        f"{mlp}.gate_up_proj.weight": lambda: torch.cat([full[f"{mlp}.gate_proj.weight"][rows],
                                                         full[f"{mlp}.up_proj.weight"][rows]]),
        f"{mlp}.down_proj.weight": lambda: full[f"{mlp}.down_proj.weight"][:, rows],
        "model.embed_tokens.weight": lambda: full["model.embed_tokens.weight"][vocab],
        "lm_head.weight": lambda: full["lm_head.weight"][vocab],
    }[name]()


slices_match = {}
for got in rank_params:
    r = got["rank"]
    for name, tensor in got["tensors"].items():
        slices_match[r, name] = torch.equal(tensor, expected_slice(name, r))
    print(f"rank {r}: every checked tensor equals its slice of the checkpoint:",
          all(v for (rr, _), v in slices_match.items() if rr == r))
assert all(slices_match.values())

# %% [markdown]
# ## 6. The default model at TP=3
#
# SmolLM2-135M has 9 query heads and 3 KV heads: it splits by 3, not by 2
# (`docs/parallelism.md` shows the error TP=2 gives). Each rank gets 3 query
# heads and 1 KV head, a third of the MLP and of the 49,152-token
# vocabulary.
#
# **Predict, then run.** It has 30 layers. How many all-reduces per forward
# on each rank? How many all-gathers? And what share of the model's bytes
# does each rank hold — a little over a third, as before, or something else?
# (Its LM head is tied to the embedding: one matrix, used twice.)

# %%
DEFAULT_TRACE = str(WORK / "default_tp3.jsonl")
PROMPT = "The capital of France is"
SHORT = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
DEFAULT = dict(device="cpu", max_model_len=128, kv_cache_memory_bytes=16 << 20, disable_log_stats=True)

t0 = time.perf_counter()
llm = LLM("default", **DEFAULT)
one_rank = llm.generate([PROMPT], SHORT, use_tqdm=False)[0].outputs[0]
full_default = executor_lab.rank_summary(llm.llm_engine.engine_core.engine_core.model_executor.driver_worker)
llm.shutdown()
timings["default model, TP=1"] = time.perf_counter() - t0

t0 = time.perf_counter()
llm = LLM("default", tensor_parallel_size=3, trace_path=DEFAULT_TRACE, trace_level="lifecycle", **DEFAULT)
three_ranks = llm.generate([PROMPT], SHORT, use_tqdm=False)[0].outputs[0]
executor3 = llm.llm_engine.engine_core.engine_core.model_executor
ranks3 = executor3.collective_rpc(executor_lab.rank_summary)
print(f"backend for TP=3 when none is given: {type(executor3).__name__}")
llm.shutdown()
timings["default model, TP=3"] = time.perf_counter() - t0
events3 = load_trace(DEFAULT_TRACE)
print(f"{PROMPT!r} → TP=1 {one_rank.text!r}, TP=3 {three_ranks.text!r}")
print(f"largest log-probability difference: "
      f"{max(abs(a[t].logprob - b[t].logprob) for a, b in zip(one_rank.logprobs, three_ranks.logprobs) for t in a):.1e}")

# %%
# NBVAL_CHECK_OUTPUT
print("TP=1 tokens:", list(one_rank.token_ids))
print("TP=3 tokens:", list(three_ranks.token_ids), " same:", list(one_rank.token_ids) == list(three_ranks.token_ids))
counts3 = sorted({(e.tp_rank, e.all_reduce_count, e.all_gather_count) for e in events3
                  if isinstance(e, WorkerRpcDone) and e.method == "execute_model" and e.all_reduce_count})
for rank, n_ar, n_ag in counts3:
    print(f"rank {rank}: {n_ar} all-reduces and {n_ag} all-gather in every forward")
for r in ranks3:
    print(f"rank {r['rank']}: {r['param_bytes']:,} of {full_default['param_bytes']:,} bytes = "
          f"{r['param_bytes'] / full_default['param_bytes']:.4f}")

# %% [markdown]
# 2 × 30 + 1 = 61 all-reduces and one all-gather per forward, on each of the
# three ranks. And each rank holds a little *more* than a third, for the same
# reason as before (norms are whole on every rank), but not by much: the
# norms are a tiny part of a 135M-parameter model.
#
# ## 7. The Ray backend
#
# `distributed_executor_backend="ray"` runs each rank in a Ray actor instead
# of a forked process. The executor uses the Ray cluster its process is in,
# else the one at `RAY_ADDRESS` — on which the ranks may be on other machines
# (`docs/parallelism.md` shows the two-machine commands; only a local cluster
# was checked here) — else it calls `ray.init()` to start a local one, and
# stops it at shutdown. Here the notebook starts the local cluster itself,
# with `address="local"`: a bare `ray.init()` *joins* any Ray cluster already
# running on the machine, and the executor, which asks for a cluster of its
# own size, then fails (and a joined cluster that someone stops takes this
# kernel down with it). Starting Ray is most of the cell's time. A call is
# sent to every actor as an actor method call, and only rank 0's result is
# fetched. vLLM instead compiles the step into a Ray DAG once
# (`_compiled_ray_dag`,
# [ray_executor.py#L544](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/executor/ray_executor.py#L544))
# and feeds it each step's `SchedulerOutput`
# ([L461](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/executor/ray_executor.py#L461)).
#
# **Predict, then run.** The same 8 tokens for every prompt as with `mp`?

# %%
import ray  # noqa: E402

# A local Ray cluster of our own, for the executor to use (it joins the one
# this process is in). See the note below for why not leave this to it.
t0 = time.perf_counter()
ray.init(address="local", num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False, log_to_driver=False)
timings["Ray start-up"] = time.perf_counter() - t0
t0 = time.perf_counter()
llm_ray = LLM(str(TINY), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
timings["TP=2 (ray) start-up"] = time.perf_counter() - t0
t0 = time.perf_counter()
tp2_ray = [o.outputs[0] for o in llm_ray.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
timings["TP=2 (ray) generate"] = time.perf_counter() - t0
executor_ray = llm_ray.llm_engine.engine_core.engine_core.model_executor
print(f"{type(executor_ray).__name__}: actors in pids {executor_ray.pids}")
t0 = time.perf_counter()
llm_ray.shutdown()
timings["TP=2 (ray) shutdown"] = time.perf_counter() - t0
ray.shutdown()  # stops the cluster ray.init started
print(f"Ray cluster start-up: {timings['Ray start-up']:.1f} s")
for what in ("start-up", "generate", "shutdown"):
    print(f"engine {what}: ray {timings[f'TP=2 (ray) {what}']:.2f} s, mp {timings[f'TP=2 (mp) {what}']:.2f} s")

# %%
# NBVAL_CHECK_OUTPUT
for i, (a, b) in enumerate(zip(tp2, tp2_ray)):
    print(f"prompt {i}: mp {list(a.token_ids)}  ray {list(b.token_ids)}  same: {list(a.token_ids) == list(b.token_ids)}")
print("Ray stopped:", not ray.is_initialized())

# %% [markdown]
# ## 8. Exercise: where does `SchedulerOutput` go, and what comes back?
#
# The reading plan describes the step as a broadcast of the scheduler's
# output to every worker, every worker executing, and the sampled tokens
# gathered. Check each part against the TP=2 run's trace: per kind of call,
# how many messages went out on the ring, how many each rank took off it,
# and which ranks answered.

# %%
# NBVAL_CHECK_OUTPUT
by_method = {}
for e in received:
    by_method.setdefault(e.method, {0: 0, 1: 0})[e.tp_rank] += 1
answered = {}
for e in done:
    answered.setdefault(e.method, {0: 0, 1: 0})[e.tp_rank] += e.replied
step_calls = ("execute_model", "sample_tokens")
print("call                        taken off the ring (rank 0 / 1)   answered by rank 0 / 1")
for method, n in by_method.items():
    if method in step_calls:
        continue  # their counts include an empty last step, which timing could change: below
    print(f"{method:<28}{n[0]:>6} / {n[1]:<6}                     {answered[method][0]:>4} / {answered[method][1]}")
for method in step_calls:
    n, a = by_method[method], answered[method]
    print(f"{method:<28}  every call on both ranks: {n[0] == n[1]};  answered: rank 0 all of them: "
          f"{a[0] == n[0]}, rank 1: {a[1]}")
forward_on_both = all((s, r) in exec_done for s in forward_steps for r in (0, 1))
print(f"steps with tokens: {len(forward_steps)}; each one's execute_model ran on both ranks: {forward_on_both}")

# %%
print(f"this run: {by_method['execute_model'][0]} execute_model messages ({len(forward_steps)} steps with tokens, "
      f"then an empty one, scheduled while the last tokens were in flight), "
      f"{by_method['sample_tokens'][0]} sample_tokens messages")

# %% [markdown]
# **Answer.** The `SchedulerOutput` goes **once** onto the ring:
# `MultiprocExecutor.execute_model` pickles `(method, args, output rank)`
# into the next chunk of the shared-memory ring (`MessageQueue.enqueue`),
# and both workers read that same chunk — the table shows every
# `execute_model` and `sample_tokens` message taken off the ring by rank 0
# and by rank 1 alike. "Broadcast" here is one write and N reads of shared
# memory, not N sends; nothing about the step goes through gloo. Every rank
# then **runs the whole step** on its slice: the forward with its 5
# collectives, and the sampler, which gives every rank the same tokens.
#
# **What comes back** is one answer from **one** rank: the message names rank
# 0 as the output rank, so only rank 0 puts its `ModelRunnerOutput` on its
# answer queue, and `collective_rpc` reads only that queue. Rank 1 answered
# *no* step call; it answered only the calls that asked every rank: sizing
# the KV cache (`determine_available_memory`, where the executor takes the
# smallest answer), allocating it (`initialize_from_config`), and this
# notebook's probes. So the plan's last part is not what happens: **nothing
# is gathered from the workers** at the end of a step. The only gathering
# is the all-gather of the logits *between* the ranks, inside the forward,
# and that is what lets rank 0 alone speak for all of them.
#
# **When a rank fails.** An exception inside a call is caught by the
# worker's loop: the answering rank sends it back as a `FAILURE`, which
# `collective_rpc` raises in EngineCore; another rank can only log it. A
# rank that *dies* cannot answer at all, and the others would wait forever
# in their next all-reduce; so the executor does not wait for answers to
# notice. A thread
# (`start_worker_monitor`; vLLM's at
# [L267](https://github.com/vllm-project/vllm/blob/52a31ccecca203effd490a5b496dc5f8d9496654/vllm/v1/executor/multiproc_executor.py#L267))
# waits on the worker processes' sentinels; when one exits, it marks the
# executor failed, wakes every call waiting on an answer queue so that it
# raises, and calls EngineCore back (`register_failure_callback`), which
# fails; the front end then reports the engine dead, and a server answers
# 503 on every route, `/health` included. In the other direction, each worker watches a
# pipe from its parent and exits if the parent is gone, so a killed
# EngineCore leaves no orphans; at shutdown, workers get SIGTERM, then
# SIGKILL after 4 s, and the shared-memory segments are unlinked, a dead
# worker's included. `tests/distributed/test_tensor_parallel.py` checks it:
# `test_worker_death_fails_fast_and_shutdown_leaves_nothing` kills rank 1
# with SIGKILL and expects the next `generate` to fail within 5 s naming a
# dead worker, no process left and no `/dev/shm/glassbox_*` segment leaked.
#
# ## 9. Self-checks

# %%
# TP=2 and Ray give TP=1's greedy tokens; the default model at TP=3 too.
assert same_tokens and all(list(a.token_ids) == list(b.token_ids) for a, b in zip(tp2, tp2_ray))
assert list(one_rank.token_ids) == list(three_ranks.token_ids)
assert max(diffs) < 1e-4
assert not ray.is_initialized()
print("tokens: ok")

# %%
# Collectives per forward: 2 per layer + 1 (embedding) all-reduces, 1 all-gather (logits),
# none in sampling; bytes as predicted.
for s in forward_steps:
    tokens, rows = steps[s].total_num_scheduled_tokens, len(steps[s].num_scheduled_tokens)
    for r in (0, 1):
        d = exec_done[s, r]
        assert (d.all_reduce_count, d.all_gather_count) == (2 * LAYERS + 1, 1), (s, r)
        assert d.collective_bytes == (2 * LAYERS + 1) * tokens * HIDDEN * 4 + rows * (VOCAB // 2) * 4
        assert sample_done[s, r].all_reduce_count == sample_done[s, r].all_gather_count == 0
assert counts3 == [(r, 61, 1) for r in range(3)]
print("collectives: ok")

# %%
# One message per call reaches every rank; only rank 0 answers step calls.
for method, n in by_method.items():
    assert n[0] == n[1], method
for method in step_calls:
    assert answered[method] == {0: by_method[method][0], 1: 0}
assert answered["determine_available_memory"] == {0: 1, 1: 1}
# Each rank holds its slice: half of qkv/o_proj/MLP/vocabulary, and a bit over half the bytes.
assert all(slices_match.values()) and len(slices_match) == 2 * len(CHECK_NAMES)
assert all(0.5 < r["param_bytes"] / total < 0.51 for r in ranks)
assert all(1 / 3 < r["param_bytes"] / full_default["param_bytes"] < 0.34 for r in ranks3)
print(f"messages, answers, shards: ok; notebook ran in {time.perf_counter() - T_NOTEBOOK:.0f} s")
