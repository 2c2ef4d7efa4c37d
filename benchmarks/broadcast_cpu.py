"""What one step's broadcast to the workers costs: ``MessageQueue`` on the CPU.

A multiprocess executor sends every step's ``SchedulerOutput`` to each worker
process through ``engine/distributed/device_communicators/shm_broadcast.py``.
This times one such broadcast: from the writer's ``enqueue`` (pickling
included) until every reader has taken the message off the ring (its read
flag set, which a reader does after unpickling), in microseconds, median and
p90 over ``--iters`` broadcasts, for

  * payloads: a real ``SchedulerOutput`` of a ``decode`` step (every request
    already known to the workers: its id, token counts, a new block id now
    and then) and of a ``prefill`` step (every request new: a 256-token
    prompt, its sampling parameters and 16 block ids);
  * batch sizes 1, 8, 64, 256 requests; 1, 2 and 4 reader processes;
  * ``gap_ms`` 0 (back to back: the readers are spinning when the message
    comes) and 5 (decode only: the readers have gone to sleep, so the figure
    includes their wake-up, at most ~1 ms by design).

The writer waits for the read flags by spinning with ``os.sched_yield`` (it
must not sleep, or its own wake-up would be timed). Also reported per
payload: its pickled size and the time to pickle and unpickle it in one
process. vLLM twin: none (read ``vllm/distributed/device_communicators/shm_broadcast.py``
for the queue). Session 07.

Usage: python benchmarks/broadcast_cpu.py [--iters N] [--out PATH]
Prints a table; ``--out`` also writes the JSON
(``{"benchmark", "date", "host", "commit", "machine", ..., "results": [...]}``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import results_store  # noqa: E402
from engine.distributed.device_communicators.shm_broadcast import (  # noqa: E402
    DEFAULT_MAX_CHUNK_BYTES,
    DEFAULT_MAX_CHUNKS,
    MessageQueue,
)
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)

BATCH_SIZES = (1, 8, 64, 256)
READERS = (1, 2, 4)
BLOCK_SIZE = 16
PROMPT_LEN = 256
CONTEXT_LEN = 300  # a decode step's requests: ~300 tokens in, so ~19 blocks each


def req_id(i: int) -> str:
    # vLLM's request ids are "cmpl-<32 hex digits>-0"; ours are as long.
    return f"cmpl-{i:032x}-0"


def decode_output(batch: int, step: int = 0) -> SchedulerOutput:
    """A decode step: every request known, one token each; one in 16 needs a new block."""
    ids = [req_id(i) for i in range(batch)]
    computed = [CONTEXT_LEN + i for i in range(batch)]
    cached = CachedRequestData(
        req_ids=ids,
        new_block_ids=[
            ([1000 + i],) if (c + step) % BLOCK_SIZE == 0 else None for i, c in enumerate(computed)
        ],
        num_computed_tokens=computed,
        num_output_tokens=[c - PROMPT_LEN for c in computed],
    )
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict.fromkeys(ids, 1),
        total_num_scheduled_tokens=batch,
        num_common_prefix_blocks=[0],
        finished_req_ids=set(),
        step=step,
    )


def prefill_output(batch: int, step: int = 0) -> SchedulerOutput:
    """A step of new requests: each a 256-token prompt, sampling params, 16 blocks."""
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=128)
    new = [
        NewRequestData(
            req_id=req_id(i),
            prompt_token_ids=[(i * 7919 + j * 104729) % 49152 for j in range(PROMPT_LEN)],
            sampling_params=params,
            block_ids=(list(range(i * 16, i * 16 + PROMPT_LEN // BLOCK_SIZE)),),
            num_computed_tokens=0,
        )
        for i in range(batch)
    ]
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={r.req_id: PROMPT_LEN for r in new},
        total_num_scheduled_tokens=batch * PROMPT_LEN,
        num_common_prefix_blocks=[0],
        finished_req_ids=set(),
        step=step,
    )


PAYLOADS = {"decode": decode_output, "prefill": prefill_output}


def reader_loop(handle: Any, rank: int) -> None:
    """A worker stand-in: take messages until ``None``."""
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=60)
    while mq.dequeue(timeout=60) is not None:
        pass
    mq.close()


def timed_us(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def run_config(payload: str, batch: int, readers: int, gap_ms: float, iters: int) -> dict:
    ctx = multiprocessing.get_context("fork")
    mq = MessageQueue(readers, readers)
    buffer = mq.buffer
    assert buffer is not None
    procs = [ctx.Process(target=reader_loop, args=(mq.export_handle(), r)) for r in range(readers)]
    for p in procs:
        p.start()
    all_read = b"\x01" * readers
    try:
        mq.wait_until_ready(timeout=60)
        # Distinct objects per step (a new SchedulerOutput each step, as in the engine).
        objs = [PAYLOADS[payload](batch, step) for step in range(8)]
        size = len(pickle.dumps(objs[0], protocol=5))
        times = []
        warmup = max(20, iters // 10)
        for i in range(warmup + iters):
            if gap_ms:
                time.sleep(gap_ms / 1000)
            idx = mq.current_idx
            meta = buffer.get_metadata(idx)
            start = time.perf_counter()
            mq.enqueue(objs[i % len(objs)])
            while meta[1:].tobytes() != all_read:
                os.sched_yield()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times.append(elapsed)
        mq.enqueue(None)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        mq.close()
    times.sort()
    obj = objs[0]
    data = pickle.dumps(obj, protocol=5)
    return {
        "payload": payload,
        "batch": batch,
        "readers": readers,
        "gap_ms": gap_ms,
        "payload_bytes": size,
        "iters": iters,
        "median_us": round(statistics.median(times) * 1e6, 1),
        "p90_us": round(times[int(0.9 * (len(times) - 1))] * 1e6, 1),
        "min_us": round(times[0] * 1e6, 1),
        "pickle_us": round(timed_us(lambda: pickle.dumps(obj, protocol=5), 50), 1),
        "unpickle_us": round(timed_us(lambda: pickle.loads(data), 50), 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=300, help="timed broadcasts per configuration")
    ap.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    ap.add_argument("--readers", default=",".join(map(str, READERS)))
    ap.add_argument("--idle-gap-ms", type=float, default=5.0, help="0: skip the idle rows")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    readers = [int(r) for r in args.readers.split(",")]
    configs = [(p, b, r, 0.0) for p in PAYLOADS for b in batches for r in readers]
    if args.idle_gap_ms:
        configs += [("decode", b, r, args.idle_gap_ms) for b in batches for r in readers]
    load = [round(x, 2) for x in os.getloadavg()]
    header = (
        f"{'payload':8} {'batch':>5} {'readers':>7} {'gap_ms':>6} {'bytes':>8} "
        f"{'median_us':>9} {'p90_us':>8} {'pickle_us':>9} {'unpickle_us':>11}"
    )
    print(header, flush=True)
    results = []
    for config in configs:
        r = run_config(*config, iters=args.iters)
        results.append(r)
        print(
            f"{r['payload']:8} {r['batch']:>5} {r['readers']:>7} {r['gap_ms']:>6g} "
            f"{r['payload_bytes']:>8} {r['median_us']:>9.1f} {r['p90_us']:>8.1f} "
            f"{r['pickle_us']:>9.1f} {r['unpickle_us']:>11.1f}",
            flush=True,
        )
    from benchmarks.cpu_vs_transformers import cpu_model  # imports torch: only now

    result = {
        "benchmark": "broadcast",
        "device": "cpu",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "commit": results_store.commit_id(),
        "machine": {
            "cpu_model": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)),
            "load_average_at_start": load,
            "python": platform.python_version(),
        },
        "max_chunk_bytes": DEFAULT_MAX_CHUNK_BYTES,
        "max_chunks": DEFAULT_MAX_CHUNKS,
        "results": results,
    }
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(results_store.dump_result(result))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
