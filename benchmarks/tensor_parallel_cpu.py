"""What tensor parallelism costs on the CPU: gloo's collectives, the step time, each rank's memory.

Three parts (issue 23's CPU figures):

  1. **Collectives alone.** ``--allreduce-worlds`` processes (default 2, 3 and
     4), started here by ``multiprocessing`` and joined by ``torch.distributed``
     gloo over loopback, one torch thread each, time ``dist.all_reduce`` of one
     decode step's hidden states, fp32: ``[1, 64]``, ``[8, 64]`` (the tiny
     checkpoint, hidden size 64), ``[1, 576]``, ``[8, 576]``, ``[32, 576]``,
     ``[256, 576]`` (the default model, SmolLM2-135M, hidden size 576), and the
     all-gather of the logits' vocabulary slices (``[B, 49152 / N]``, as the LM
     head gathers them). Microseconds per call, back to back: median and p90 on
     rank 0, and the slowest rank's median, over ``--allreduce-iters`` calls.
     The floor under them: a one-byte TCP round trip between two processes.
  2. **Steps.** ``LLM(model, tensor_parallel_size=N, distributed_executor_backend="mp")``
     with the engine in this process's child (``GLASSBOX_ENABLE_MULTIPROCESSING=0``,
     so the executor is reachable) and a worker process per rank: the tiny
     llama checkpoint (``save_tiny_checkpoint("llama", seed=0)``) at TP 1, 2, 4
     and the default model at TP 1, 3 (its 9 heads split by 3, not 2 or 4).
     fp32; ``--num-prompts`` prompts of ``--input-len`` tokens, ``--output-len``
     greedy tokens each (EOS ignored), all in one batch. The loop of
     ``LLM.generate`` is run here (``llm_engine.step()`` until done) so that each
     step is timed: output tokens/s over the whole batch (prefill included) and
     the mean and median decode step (every ``step()`` call after the first
     two: with async scheduling the first launches the prefill and the second
     returns its tokens). Median over ``--repeats`` runs. TP=1 uses the
     ``mp`` backend too, so its one rank is a worker process like the others.
     A second engine of the same configuration writes a ``lifecycle`` trace;
     its ``worker.rpc_done`` events of ``execute_model`` give, per decode step
     and rank, the all-reduces and all-gathers and the host time inside them
     (gloo: the whole collective, waiting for the slowest rank included).
     Throughput is measured without the trace.
  3. **Memory per rank.** In every worker: its parameters' bytes (sum of
     ``numel * element_size``), the bytes of the oneDNN-packed copies the CPU
     linear layers keep beside them (``cpu_packed_weight``, layers/linear.py),
     its KV cache's bytes, and ``/proc/self/status`` (``VmRSS``, ``RssAnon``,
     ``RssFile``, ``VmHWM``) right before ``Worker.load_model`` (the process's
     baseline: a forked worker starts with the pages of the engine process,
     torch included), right after it (with the most of each kind sampled
     every 2 ms during it), and after the timed runs (KV cache and
     activations in). The first two come from a wrapper this script puts
     around ``Worker.load_model`` before the workers are forked; the last from
     ``collective_rpc``. Each rank's growth over its baseline is compared with
     the same model's TP=1 rank: private memory (``RssAnon``) after the runs,
     and the high-water mark (``VmHWM``), which also counts the checkpoint's
     pages a rank maps while loading (page cache, shared by the ranks). The KV
     cache has the same number of blocks (``--num-blocks``) at every TP, so
     each rank's share is 1/N of it, as for the weights.

On a machine with fewer cores than ranks (the 2-core project VM at TP 3 and 4,
and the engine's own process besides the workers at every TP) the ranks take
turns on the cores: those figures say what the communication and the
synchronisation cost, not what tensor parallelism would gain. The result says
which rows were oversubscribed. vLLM twin: none (vLLM benchmarks TP on GPUs).
Session 07.

Usage: python benchmarks/tensor_parallel_cpu.py [--out PATH|DIR/] [--record [DIR]] [--note TEXT]
Prints tables; ``--out`` writes the JSON (a directory: ``DIR/tensor_parallel_cpu.json``),
``--record`` stores it in benchmarks/results (``results_store.py``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import results_store  # noqa: E402

ALLREDUCE_SHAPES = ((1, 64), (8, 64), (1, 576), (8, 576), (32, 576), (256, 576))
DEFAULT_VOCAB = 49152  # SmolLM2's vocabulary: the logits the LM head all-gathers
ALLGATHER_BATCHES = (1, 8)
STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
MiB = 1 << 20


# --- helpers ----------------------------------------------------------------------------


def proc_status() -> dict[str, int]:
    """``STATUS_FIELDS`` of ``/proc/self/status``, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in STATUS_FIELDS:
                out[key] = int(value.split()[0]) * 1024  # kB
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[int(q * (len(sorted_values) - 1))]


# --- 1. collectives alone ---------------------------------------------------------------


def collective_worker(
    rank: int, world: int, port: int, iters: int, warmup: int, results: Any
) -> None:
    """One process of the collective benchmark: times every shape, sends its times."""
    import torch
    import torch.distributed as dist

    # torch 2.13 renamed all_gather_into_tensor (as engine/distributed/parallel_state.py).
    all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    cases: list[tuple[str, tuple[int, ...]]] = [("all_reduce", s) for s in ALLREDUCE_SHAPES]
    cases += [("all_gather", (b, DEFAULT_VOCAB // world)) for b in ALLGATHER_BATCHES]
    out = []
    for op, shape in cases:
        x = torch.randn(shape, dtype=torch.float32)
        gathered = x.new_empty((world * shape[0], *shape[1:]))
        times = []
        dist.barrier()
        for i in range(warmup + iters):
            y = x.clone()  # what the engine's all-reduce does (out of place); not timed
            start = time.perf_counter()
            if op == "all_reduce":
                dist.all_reduce(y)
            else:
                all_gather_single(gathered, y)
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times.append(elapsed)
        out.append((op, shape, times))
    dist.barrier()
    dist.destroy_process_group()
    results.put((rank, out))


def _echo(port: int, iters: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(iters):
            conn.sendall(conn.recv(1))


def tcp_round_trip_us(iters: int = 2000) -> float:
    """The floor under a gloo collective here: the median round trip of one
    byte between two processes over TCP on loopback, µs."""
    ctx = multiprocessing.get_context("fork")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        proc = ctx.Process(target=_echo, args=(server.getsockname()[1], iters))
        proc.start()
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                conn.sendall(b"x")
                conn.recv(1)
                times.append(time.perf_counter() - start)
        proc.join(30)
    return round(statistics.median(times[iters // 10 :]) * 1e6, 1)


def run_collectives(world: int, iters: int) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("fork")  # the parent has not touched torch yet
    results = ctx.Queue()
    port = free_port()
    warmup = max(10, iters // 10)
    procs = [
        ctx.Process(target=collective_worker, args=(r, world, port, iters, warmup, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    by_rank = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    rows = []
    for i, (op, shape, _) in enumerate(by_rank[0]):
        rank0 = sorted(by_rank[0][i][2])
        medians = [statistics.median(by_rank[r][i][2]) for r in range(world)]
        nbytes = 4 * shape[0] * shape[1]
        rows.append(
            {
                "op": op,
                "world": world,
                "shape": list(shape),
                "dtype": "float32",
                "bytes_per_rank": nbytes,
                "iters": iters,
                "median_us": round(statistics.median(rank0) * 1e6, 1),
                "p90_us": round(_percentile(rank0, 0.9) * 1e6, 1),
                "min_us": round(rank0[0] * 1e6, 1),
                "slowest_rank_median_us": round(max(medians) * 1e6, 1),
                "oversubscribed": world > usable_cpus(),
            }
        )
    return rows


# --- 2 and 3. the engine ----------------------------------------------------------------

# Filled in a worker by the wrapper around Worker.load_model (inherited by fork).
_LOAD_SNAPSHOTS: dict[str, dict[str, int]] = {}


def install_load_probe() -> bool:
    """Wrap ``Worker.load_model`` so that each worker records its memory right
    before and after loading. Forked workers inherit the wrapper; returns
    False (no before/after figures) when the workers would be spawned."""
    from engine.utils.system_utils import get_mp_context
    from engine.v1.worker.gpu_worker import Worker

    if get_mp_context().get_start_method() != "fork":
        return False
    original = Worker.load_model

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        _LOAD_SNAPSHOTS["before_load"] = proc_status()
        done = threading.Event()
        peaks: dict[str, int] = {}

        def sample() -> None:  # VmHWM has no split by kind: sample the kinds
            while not done.wait(0.002):
                for key, value in proc_status().items():
                    peaks[key] = max(peaks.get(key, 0), value)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            return original(self, *args, **kwargs)
        finally:
            done.set()
            sampler.join()
            _LOAD_SNAPSHOTS["after_load"] = proc_status()
            _LOAD_SNAPSHOTS["sampled_max_during_load"] = peaks

    Worker.load_model = load_model  # type: ignore[method-assign]
    return True


def rank_memory(worker: Any) -> dict[str, Any]:
    """Run in every worker (``collective_rpc``): its bytes and resident memory."""
    import torch

    from engine.distributed.parallel_state import get_tp_group

    runner = worker.model_runner
    packed = [
        m.cpu_packed_weight
        for m in runner.model.modules()
        if getattr(m, "cpu_packed_weight", None) is not None
    ]
    return {
        "rank": get_tp_group().rank_in_group,
        "pid": os.getpid(),
        "torch_threads": torch.get_num_threads(),
        "param_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
        # The oneDNN-prepacked copies of the linear weights (linear.py keeps both).
        "packed_weight_bytes": sum(t.numel() * t.element_size() for t in packed),
        "kv_cache_bytes": sum(t.numel() * t.element_size() for t in runner.kv_caches),
        **_LOAD_SNAPSHOTS,
        "after_runs": proc_status(),
    }


def timed_run(llm: Any, prompts: list, params: Any, tag: str) -> dict[str, Any]:
    """``LLM.generate``'s loop, each ``step()`` timed."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    steps, tokens = [], 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - t)
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
    total = time.perf_counter() - start
    # With async scheduling (the default) the first call launches the prefill
    # and the second returns its tokens: the decode steps are the calls after.
    decode = steps[2:] if len(steps) > 3 else steps
    return {
        "seconds": total,
        "output_tokens": tokens,
        "output_tokens_per_second": tokens / total,
        "step_calls": len(steps),
        "first_step_ms": steps[0] * 1e3,
        "decode_step_mean_ms": statistics.mean(decode) * 1e3,
        "decode_step_median_ms": statistics.median(decode) * 1e3,
    }


def trace_collectives(path: str, num_prompts: int) -> dict[str, Any]:
    """Per decode step (every request decoding) and rank: ``execute_model``'s
    collectives, from the workers' ``worker.rpc_done`` events."""
    from engine.tracing import load_trace, merge_trace_parts
    from engine.tracing.events import SchedStep, WorkerRpcDone

    # An in-process engine leaves its workers' parts unmerged (only a
    # multi-process front end merges them at shutdown): merge them here.
    events = load_trace(merge_trace_parts(path))
    decode_steps = {
        e.step
        for e in events
        if isinstance(e, SchedStep)
        and not e.new_req_ids
        and e.total_num_scheduled_tokens == num_prompts
    }
    per_rank: dict[int, list[WorkerRpcDone]] = {}
    for e in events:
        if isinstance(e, WorkerRpcDone) and e.method == "execute_model" and e.step in decode_steps:
            per_rank.setdefault(e.tp_rank or 0, []).append(e)
    ranks = []
    for rank, done in sorted(per_rank.items()):
        n = len(done)
        ranks.append(
            {
                "rank": rank,
                "decode_steps": n,
                "all_reduce_per_step": sum(e.all_reduce_count for e in done) / n,
                "all_gather_per_step": sum(e.all_gather_count for e in done) / n,
                "collective_ms_per_step": sum(e.collective_seconds for e in done) / n * 1e3,
                "collective_bytes_per_step": sum(e.collective_bytes for e in done) / n,
                "execute_model_ms_per_step": sum(e.seconds for e in done) / n * 1e3,
            }
        )
    return {"decode_steps": len(decode_steps), "per_rank": ranks}


def run_engine(config: dict[str, Any]) -> dict[str, Any]:
    """In a child process: one model at one TP size (an untraced engine for
    the times and the memory, then a traced one for the collectives)."""
    os.environ["GLASSBOX_ENABLE_MULTIPROCESSING"] = "0"
    from engine import LLM, SamplingParams

    probed = install_load_probe()
    n, tp = config["num_prompts"], config["tp"]
    vocab = config["vocab_size"]
    prompts = [
        {
            "prompt_token_ids": [
                (17 * i + 29 * j) % (vocab - 10) + 5 for j in range(config["input_len"])
            ]
        }
        for i in range(n)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=config["output_len"], ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine_args = {
        "tensor_parallel_size": tp,
        "distributed_executor_backend": "mp",
        "dtype": "float32",
        "max_model_len": config["input_len"] + config["output_len"] + 16,
        "num_gpu_blocks_override": config["num_blocks"],
        "skip_tokenizer_init": True,
    }
    result: dict[str, Any] = {
        "model": config["model"],
        "tp": tp,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    start = time.perf_counter()
    llm = LLM(config["path"], **engine_args)
    result["startup_s"] = round(time.perf_counter() - start, 2)
    try:
        llm.generate(prompts[:2], warm, use_tqdm=False)
        runs = [timed_run(llm, prompts, params, f"r{i}") for i in range(config["repeats"])]
        executor = llm.llm_engine.engine_core.engine_core.model_executor
        result["memory_probed_at_load"] = probed
        result["ranks"] = executor.collective_rpc(rank_memory)
    finally:
        llm.shutdown()
    result["runs"] = runs
    middle = sorted(runs, key=lambda r: r["output_tokens_per_second"])[len(runs) // 2]
    result["output_tokens_per_second"] = middle["output_tokens_per_second"]
    result["decode_step_mean_ms"] = statistics.median(r["decode_step_mean_ms"] for r in runs)
    result["decode_step_median_ms"] = statistics.median(r["decode_step_median_ms"] for r in runs)
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = os.path.join(tmp, "run.jsonl")
        llm = LLM(config["path"], trace_path=trace_path, trace_level="lifecycle", **engine_args)
        try:
            llm.generate(prompts[:2], warm, use_tqdm=False)
            traced = timed_run(llm, prompts, params, "traced")
        finally:
            llm.shutdown()
        result["traced"] = {
            "output_tokens_per_second": traced["output_tokens_per_second"],
            "decode_step_mean_ms": traced["decode_step_mean_ms"],
            **trace_collectives(trace_path, n),
        }
    return result


def run_engine_child(config: dict[str, Any]) -> dict[str, Any]:
    """``run_engine`` in a fresh interpreter: every configuration's workers
    fork from a process of the same size, so their baselines compare."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(config)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{config['model']} at TP={config['tp']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# What each rank's memory grew by, from its baseline (``before_load``):
GROWTHS = {
    # resident memory after loading (weights and their packed copies, with anything else)
    "rss_after_load": ("after_load", "VmRSS", "before_load", "VmRSS"),
    # private memory after the runs: weights, packed copies, KV cache, activations
    "anon_after_runs": ("after_runs", "RssAnon", "before_load", "RssAnon"),
    # the high-water mark: the above and the checkpoint pages mapped while loading
    "peak_rss": ("after_runs", "VmHWM", "before_load", "VmRSS"),
    # the most checkpoint (file) pages mapped at once while loading, sampled every 2 ms
    "file_pages_during_load": ("sampled_max_during_load", "RssFile", "before_load", "RssFile"),
}


def memory_summary(rows: list[dict[str, Any]]) -> None:
    """Add to each rank its growths (``GROWTHS``) and, for each figure, its
    fraction of the same model's TP=1 rank."""
    reference = {r["model"]: r["ranks"][0] for r in rows if r["tp"] == 1}
    for row in rows:
        for rank in row["ranks"]:
            rank["weight_bytes"] = rank["param_bytes"] + rank["packed_weight_bytes"]
            if "before_load" in rank:
                rank["growth_bytes"] = {
                    name: rank[at][key] - rank[base][base_key]
                    for name, (at, key, base, base_key) in GROWTHS.items()
                }
        ref = reference.get(row["model"])
        if ref is None:
            continue
        for rank in row["ranks"]:
            fractions = {
                name: rank[name] / ref[name]
                for name in ("param_bytes", "weight_bytes", "kv_cache_bytes")
                if ref[name]
            }
            if "growth_bytes" in rank and "growth_bytes" in ref:
                fractions.update(
                    {
                        name: value / ref["growth_bytes"][name]
                        for name, value in rank["growth_bytes"].items()
                        if ref["growth_bytes"][name] > 0
                    }
                )
            rank["fraction_of_tp1"] = {k: round(v, 4) for k, v in fractions.items()}


# --- tables -----------------------------------------------------------------------------


def print_tables(result: dict[str, Any]) -> None:
    cpus = result["machine"]["cpus_usable"]
    print(f"\n{cpus} usable CPU(s); rows marked * run more ranks than that (oversubscribed).")
    print("\ncollectives alone (gloo, loopback, 1 thread per process), µs per call")
    print(
        f"{'op':10} {'world':>5} {'shape':>12} {'bytes':>8} {'median':>8} {'p90':>8} {'slowest':>8}"
    )
    for r in result["collectives"]:
        star = "*" if r["oversubscribed"] else " "
        shape = "x".join(map(str, r["shape"]))
        print(
            f"{r['op']:10} {r['world']:>4}{star} {shape:>12} {r['bytes_per_rank']:>8} "
            f"{r['median_us']:>8.1f} {r['p90_us']:>8.1f} {r['slowest_rank_median_us']:>8.1f}"
        )
    print("\ndecode: throughput, step, collectives per decode step (rank 0; from the trace)")
    print(
        f"{'model':8} {'tp':>3} {'tok/s':>8} {'step_ms':>8} {'traced_ms':>9} "
        f"{'allred':>6} {'allgat':>6} {'coll_ms':>8} {'exec_ms':>8}"
    )
    for r in result["engine"]:
        star = "*" if r["oversubscribed"] else " "
        ranks = r["traced"]["per_rank"]
        t = ranks[0] if ranks else {}
        print(
            f"{r['model']:8} {r['tp']:>2}{star} {r['output_tokens_per_second']:>8.1f} "
            f"{r['decode_step_mean_ms']:>8.2f} {r['traced']['decode_step_mean_ms']:>9.2f} "
            f"{t.get('all_reduce_per_step', 0):>6.1f} {t.get('all_gather_per_step', 0):>6.1f} "
            f"{t.get('collective_ms_per_step', 0):>8.2f} "
            f"{t.get('execute_model_ms_per_step', 0):>8.2f}"
        )
    print(
        "\nmemory per rank, MiB; (x): fraction of the same model's TP=1. weights: parameters "
        "+ their oneDNN-packed copies; growth from the worker's resident memory before loading"
    )
    print(
        f"{'model':8} {'tp':>3} {'rank':>4} {'params':>14} {'weights':>14} {'kv':>5} "
        f"{'base':>6} {'anon_growth':>14} {'peak_growth':>14} {'file_peak':>9}"
    )
    for r in result["engine"]:
        for k in r["ranks"]:
            if "growth_bytes" not in k:
                continue
            frac, grow = k.get("fraction_of_tp1", {}), k["growth_bytes"]

            def cell(value: float, name: str, frac: dict = frac) -> str:
                return f"{value / MiB:.1f}" + (f" ({frac[name]:.2f})" if name in frac else "")

            print(
                f"{r['model']:8} {r['tp']:>3} {k['rank']:>4} "
                f"{cell(k['param_bytes'], 'param_bytes'):>14} "
                f"{cell(k['weight_bytes'], 'weight_bytes'):>14} "
                f"{k['kv_cache_bytes'] / MiB:>5.1f} {k['before_load']['VmRSS'] / MiB:>6.1f} "
                f"{cell(grow['anon_after_runs'], 'anon_after_runs'):>14} "
                f"{cell(grow['peak_rss'], 'peak_rss'):>14} "
                f"{grow['file_pages_during_load'] / MiB:>9.1f}"
            )


# --- main -------------------------------------------------------------------------------


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--allreduce-worlds", default="2,3,4", help="process counts ('' skips)")
    ap.add_argument("--allreduce-iters", type=int, default=1000, help="timed calls per shape")
    ap.add_argument("--tiny-tp", default="1,2,4", help="TP sizes for the tiny llama ('' skips)")
    ap.add_argument("--default-tp", default="1,3", help="TP sizes for the default model")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per configuration")
    ap.add_argument("--num-blocks", type=int, default=64, help="KV blocks, the same at every TP")
    ap.add_argument("--out", help="write the JSON here (a directory: DIR/tensor_parallel_cpu.json)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    results_store.add_record_arguments(ap)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_engine(json.loads(args.child))))
        return 0

    started = time.perf_counter()
    load = [round(x, 2) for x in os.getloadavg()]
    cpus = usable_cpus()
    round_trip = tcp_round_trip_us()
    print(f"TCP round trip on loopback, 1 byte: {round_trip:.1f} µs (median)", flush=True)
    collectives = []
    for world in _sizes(args.allreduce_worlds):
        print(f"collectives: {world} processes ...", flush=True)
        collectives += run_collectives(world, args.allreduce_iters)

    from tests.helpers.hf_checkpoints import TINY_CONFIG, default_model_path, save_tiny_checkpoint

    engine_rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = []
        if _sizes(args.tiny_tp):
            tiny = Path(tmp) / "tiny_llama"
            save_tiny_checkpoint("llama", tiny, seed=0)
            models.append(("tiny", str(tiny), TINY_CONFIG["vocab_size"], _sizes(args.tiny_tp)))
        if _sizes(args.default_tp):
            models.append(("default", default_model_path(), DEFAULT_VOCAB, _sizes(args.default_tp)))
        for name, path, vocab, tps in models:
            for tp in tps:
                print(f"engine: {name} at TP={tp} ...", flush=True)
                config = {
                    "model": name,
                    "path": path,
                    "vocab_size": vocab,
                    "tp": tp,
                    "num_prompts": args.num_prompts,
                    "input_len": args.input_len,
                    "output_len": args.output_len,
                    "repeats": args.repeats,
                    "num_blocks": args.num_blocks,
                }
                row = run_engine_child(config)
                # The workers, plus the engine's own process beside them.
                row["oversubscribed"] = tp > cpus
                engine_rows.append(row)
    memory_summary(engine_rows)

    import torch

    from benchmarks.cpu_vs_transformers import cpu_model

    result = {
        "benchmark": "tensor_parallel",
        "device": "cpu",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "commit": results_store.commit_id(),
        "machine": {
            "cpu_model": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "cpus_usable": cpus,
            "load_average_at_start": load,
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            "tcp_loopback_round_trip_us": round_trip,
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "note_on_cores": (
            f"{cpus} usable CPU(s): rows with more ranks than that (oversubscribed: true) run "
            "their ranks in turns, and the engine's own process shares the cores at every TP. "
            "The figures measure what the communication costs, not a speed-up."
        ),
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "repeats": args.repeats,
            "num_gpu_blocks_override": args.num_blocks,
            "dtype": "float32",
            "greedy": True,
            "ignore_eos": True,
            "executor": "mp (TP=1 included)",
        },
        "collectives": collectives,
        "engine": engine_rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print_tables(result)
    print(f"\ntook {result['wall_s']:.0f} s")
    if args.out:
        path = results_store.output_path(args.out, result)
        path.write_text(results_store.dump_result(result))
        print(f"wrote {path}")
    if args.record:
        print(f"recorded {results_store.record(result, args.record, note=args.note)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
