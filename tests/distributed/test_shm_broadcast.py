"""The shared-memory broadcast queue (``engine/distributed/device_communicators/shm_broadcast.py``;
vLLM twin: ``vllm/distributed/device_communicators/shm_broadcast.py``).

* A writer and 1, 2 or 4 reader processes (and readers over ZMQ, as on other
  machines): 200 messages of varied sizes, some larger than a chunk, reach
  every reader whole and in order, through a ring of 3 chunks.
* Waiting sleeps (an idle reader costs little CPU) and gives up: ``dequeue``
  with nothing written times out, a ``cancel`` event or ``close()`` from
  another thread stops it, and a writer blocked by a reader ``max_chunks``
  behind times out naming that reader.
* Nothing is left behind: after ``close()`` no ``/dev/shm/glassbox_*`` segment
  (nor ipc socket file) of the test remains, and a process that reads a
  child's queue, writes to forked and spawned readers, and leaves a writer
  unclosed, exits with none left and no resource-tracker warning or error
  (run under ``-W error``).
* The handle (and the ring buffer) pickle.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from engine.distributed.device_communicators.shm_broadcast import (
    SHM_NAME_PREFIX,
    Handle,
    MessageQueue,
    ShmRingBuffer,
)

ROOT = Path(__file__).resolve().parents[2]
CHUNK_BYTES = 32 * 1024
NUM_CHUNKS = 3
NUM_MESSAGES = 200
OVERSIZED_AT = (57, 58, 150)  # larger than a chunk: they go over the local socket
TIMEOUT = 30.0  # generous: only a hang reaches it


def make_message(i: int) -> Any:
    """Message ``i`` of a deterministic sequence: ints, dicts of lists, byte
    strings of 0..20 KB, tuples; three of them ~100 KB (over a chunk)."""
    if i in OVERSIZED_AT:
        return {"i": i, "blob": bytes([i % 251]) * (3 * CHUNK_BYTES + i)}
    kind = i % 4
    if kind == 0:
        return i
    if kind == 1:
        return {"req_id": f"req-{i}", "block_ids": list(range(i, i + (i * 37) % 500)), "n": i}
    if kind == 2:
        return bytes([i % 256]) * ((i * 131) % 20000)
    return ("step", i, [float(i)] * (i % 64))


def read_all(handle: Handle, rank: int, n: int, results: Any) -> None:
    """A reader process: join, take ``n`` messages, report (rank, count, first bad index)."""
    bad: int | str | None = None
    count = 0
    try:
        mq = MessageQueue.create_from_handle(handle, rank)
        mq.wait_until_ready(timeout=TIMEOUT)
        for i in range(n):
            got = mq.dequeue(timeout=TIMEOUT)
            count += 1
            if bad is None and got != make_message(i):
                bad = i
        mq.close()
    except Exception as e:  # reported to the test, which fails with it
        bad = f"{type(e).__name__}: {e}"
    results.put((rank, count, bad))


def shm_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


@pytest.fixture
def queues():
    """Queues a test makes; closed afterwards, and their segments must be gone."""
    made: list[MessageQueue] = []
    yield made
    names = [mq.buffer.name for mq in made if mq._is_writer and mq.buffer is not None]
    for mq in made:
        mq.close()
    assert all(name.startswith(SHM_NAME_PREFIX) for name in names)
    assert [name for name in names if shm_exists(name)] == []


@pytest.mark.parametrize(
    ("n_reader", "n_local_reader"),
    [(1, 1), (2, 2), (4, 4), (2, 1), (1, 0)],
    ids=["1-local", "2-local", "4-local", "1-local-1-remote", "1-remote"],
)
def test_every_reader_gets_every_message_in_order(queues, n_reader, n_local_reader):
    ctx = multiprocessing.get_context("fork")
    writer = MessageQueue(
        n_reader,
        n_local_reader,
        max_chunk_bytes=CHUNK_BYTES,
        max_chunks=NUM_CHUNKS,
        connect_ip="127.0.0.1",
    )
    queues.append(writer)
    handle = writer.export_handle()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=read_all, args=(handle, rank, NUM_MESSAGES, results))
        for rank in range(n_reader)
    ]
    for p in procs:
        p.start()
    try:
        writer.wait_until_ready(timeout=TIMEOUT)
        for i in range(NUM_MESSAGES):
            assert writer.broadcast_object(make_message(i)) == make_message(i)
        reports = sorted(results.get(timeout=TIMEOUT) for _ in procs)
    finally:
        for p in procs:
            p.join(TIMEOUT)
            if p.is_alive():
                p.kill()
    assert reports == [(rank, NUM_MESSAGES, None) for rank in range(n_reader)]
    assert [p.exitcode for p in procs] == [0] * n_reader
    if n_local_reader:
        # The ring went round 66 times and more (one chunk per message, oversized or not).
        assert NUM_MESSAGES > NUM_CHUNKS
        assert writer.current_idx == NUM_MESSAGES % NUM_CHUNKS


def test_chunk_boundary_and_overflow_mark(queues):
    """A payload that fills a chunk exactly stays in the ring; one byte more
    leaves only the overflow mark there and travels over the socket."""
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    queues += [writer, reader]
    writer.wait_until_ready(timeout=TIMEOUT)  # one thread: the reader is connected already
    reader.wait_until_ready(timeout=TIMEOUT)
    header = 9
    base = len(pickle.dumps(b"a" * 1000, protocol=5)) - 1000  # the pickle's overhead
    fits = b"a" * (4096 - header - base)
    assert header + len(pickle.dumps(fits, protocol=5)) == 4096
    for payload, overflow in ((fits, 0), (fits + b"b", 1)):
        idx = writer.current_idx
        writer.enqueue(payload, timeout=TIMEOUT)
        assert writer.buffer is not None and writer.buffer.get_data(idx)[0] == overflow
        assert reader.dequeue(timeout=TIMEOUT) == payload


def test_dequeue_times_out_when_nothing_is_written(queues):
    writer = MessageQueue(2, 1, max_chunk_bytes=4096, max_chunks=2, connect_ip="127.0.0.1")
    local = MessageQueue.create_from_handle(writer.export_handle(), 0)
    remote = MessageQueue.create_from_handle(writer.export_handle(), 1)
    queues += [writer, local, remote]
    for reader, what in ((local, "chunk 0 to be written"), (remote, "a message")):
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=what):
            reader.dequeue(timeout=0.2)
        assert 0.2 <= time.monotonic() - start < 2.0
    # A writer gone for good (closed: its segment unlinked) leaves the reader
    # waiting on a chunk that never fills: it still gives up.
    writer.close()
    with pytest.raises(TimeoutError):
        local.dequeue(timeout=0.05)


@pytest.mark.parametrize("rank", [0, 1], ids=["local", "remote"])
def test_an_idle_reader_sleeps(queues, rank):
    """Waiting half a second costs a few ms of CPU, not half a second of spinning
    (measured ~2% for the ring, ~0.5% for the socket)."""
    writer = MessageQueue(2, 1, max_chunk_bytes=4096, max_chunks=2, connect_ip="127.0.0.1")
    reader = MessageQueue.create_from_handle(writer.export_handle(), rank)
    queues += [writer, reader]
    cpu = time.process_time()
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.5)
    assert time.process_time() - cpu < 0.05


@pytest.mark.parametrize("rank", [0, 1], ids=["local", "remote"])
def test_cancel_and_close_stop_a_waiting_reader(queues, rank):
    writer = MessageQueue(2, 1, max_chunk_bytes=4096, max_chunks=2, connect_ip="127.0.0.1")
    reader = MessageQueue.create_from_handle(writer.export_handle(), rank)
    queues += [writer, reader]

    cancel = threading.Event()
    cancel.set()
    with pytest.raises(RuntimeError, match="cancelled"):
        reader.dequeue(cancel=cancel)

    cancel = threading.Event()
    timer = threading.Timer(0.1, cancel.set)
    timer.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="cancelled"):
        reader.dequeue(cancel=cancel)
    assert time.monotonic() - start < 2.0
    timer.join()

    # close() from another thread: the waiting dequeue raises, then close() finishes.
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            reader.dequeue()
        except BaseException as e:
            errors.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)
    reader.close()
    waiter.join(5.0)
    assert not waiter.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "closed" in str(errors[0])
    reader.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        reader.dequeue(timeout=0)


def test_writer_blocked_by_a_stalled_reader_times_out(queues):
    writer = MessageQueue(2, 2, local_reader_ranks=[3, 5], max_chunk_bytes=4096, max_chunks=3)
    fast = MessageQueue.create_from_handle(writer.export_handle(), 3)
    stalled = MessageQueue.create_from_handle(writer.export_handle(), 5)
    queues += [writer, fast, stalled]
    for i in range(3):
        writer.enqueue(i, timeout=1.0)
        assert fast.dequeue(timeout=1.0) == i
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"chunk 0 to be read by local reader rank\(s\) \[5\]"):
        writer.enqueue(3, timeout=0.2)
    assert 0.2 <= time.monotonic() - start < 2.0
    # The failed enqueue published nothing; once the stalled reader takes one
    # message, the writer goes on.
    assert stalled.dequeue(timeout=1.0) == 0
    writer.enqueue(3, timeout=1.0)
    assert [stalled.dequeue(timeout=1.0) for _ in range(3)] == [1, 2, 3]
    assert fast.dequeue(timeout=1.0) == 3
    with pytest.raises(TimeoutError):
        fast.dequeue(timeout=0.01)


def test_roles_are_enforced(queues):
    writer = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    queues += [writer, reader]
    with pytest.raises(RuntimeError, match="only readers"):
        writer.dequeue(timeout=0)
    with pytest.raises(RuntimeError, match="only the writer"):
        reader.enqueue(1)
    with pytest.raises(ValueError):
        MessageQueue(1, 2)
    with pytest.raises(ValueError):
        MessageQueue.create_from_handle(writer.export_handle(), 7)  # not local, no remote


def test_handle_and_ring_buffer_pickle(queues):
    writer = MessageQueue(2, 1, max_chunk_bytes=4096, max_chunks=2, connect_ip="127.0.0.1")
    queues.append(writer)
    handle = writer.export_handle()
    copy = pickle.loads(pickle.dumps(handle))
    assert copy == handle and isinstance(copy, Handle)
    assert copy.buffer_handle is not None and copy.buffer_handle[3].startswith(SHM_NAME_PREFIX)
    assert copy.remote_subscribe_addr is not None
    assert copy.remote_subscribe_addr.startswith("tcp://127.0.0.1:")
    reader = MessageQueue.create_from_handle(copy, 0)
    queues.append(reader)
    writer.enqueue({"hello": [1, 2, 3]}, timeout=1.0)
    assert reader.dequeue(timeout=1.0) == {"hello": [1, 2, 3]}

    assert writer.buffer is not None
    attached = pickle.loads(pickle.dumps(writer.buffer))
    assert isinstance(attached, ShmRingBuffer) and not attached.is_creator
    assert attached.handle() == writer.buffer.handle()
    attached.close()
    assert shm_exists(writer.buffer.name)  # a reader's close does not unlink


LEAK_SCRIPT = """
import multiprocessing as mp
import os

from engine.distributed.device_communicators.shm_broadcast import MessageQueue

N = 40


def message(i):
    return (i, b"x" * (i * 1000))  # from 16 KB on, bigger than a chunk


def reader(handle, rank, close):
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready(timeout=30)
    for i in range(N):
        assert mq.dequeue(timeout=30) == message(i), i
    if close:
        mq.close()


def make_writer(n_reader):
    return MessageQueue(n_reader, n_reader, max_chunk_bytes=16 * 1024, max_chunks=4)


def write_all(mq):
    mq.wait_until_ready(timeout=30)
    for i in range(N):
        mq.enqueue(message(i), timeout=30)


def close_writer(mq):
    handle = mq.export_handle()
    name = handle.buffer_handle[3]
    # The readers are gone, closed or not: the segment is still the writer's.
    still_there = os.path.exists("/dev/shm/" + name)
    mq.close()
    mq.close()
    print(name, handle.local_subscribe_addr, still_there, flush=True)


def child_writer(conn):
    mq = make_writer(1)
    conn.send(mq.export_handle())
    write_all(mq)
    conn.recv()
    close_writer(mq)


if __name__ == "__main__":
    fork, spawn = mp.get_context("fork"), mp.get_context("spawn")
    # 1. The writer in a child, which starts a resource tracker of its own;
    #    this process reads, with none (an executor reading a worker's answers).
    here, there = fork.Pipe()
    child = fork.Process(target=child_writer, args=(there,))
    child.start()
    reader(here.recv(), 0, True)
    here.send("done")
    child.join(30)
    # 2. The writer here; readers forked and spawned after it share its
    #    tracker (workers reading the executor's broadcast); two never close.
    mq = make_writer(3)
    handle = mq.export_handle()
    procs = [
        fork.Process(target=reader, args=(handle, 0, True)),
        fork.Process(target=reader, args=(handle, 1, False)),
        spawn.Process(target=reader, args=(handle, 2, False)),
    ]
    for p in procs:
        p.start()
    write_all(mq)
    for p in procs:
        p.join(30)
    close_writer(mq)
    print([child.exitcode] + [p.exitcode for p in procs])
    # 3. A writer never closed: its files go when the process exits.
    abandoned = make_writer(1)
    handle = abandoned.export_handle()
    print(handle.buffer_handle[3], handle.local_subscribe_addr, flush=True)
"""


FORK_WARNING = "ignore:This process:DeprecationWarning"


def test_no_segment_left_and_no_resource_tracker_warning(tmp_path):
    script = tmp_path / "leak_check.py"
    script.write_text(textwrap.dedent(LEAK_SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        # Every warning an error, but Python 3.12+'s about fork() after ZMQ's
        # I/O threads started (the readers here run no threads of their own).
        [sys.executable, "-W", "error", "-W", FORK_WARNING, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    # Nothing at all on stderr: no "leaked shared_memory" warning (a reader that
    # registered the segment with a tracker of its own), no KeyError from a
    # shared tracker (a reader that unregistered the creator's registration).
    assert out.stderr == ""
    *writers, exitcodes, abandoned = out.stdout.splitlines()
    assert exitcodes == "[0, 0, 0, 0]"
    assert len(writers) == 2
    for line in [*writers, abandoned + " True"]:
        name, ipc_addr, still_there = line.split()
        assert still_there == "True"
        assert name.startswith(SHM_NAME_PREFIX) and not shm_exists(name)
        assert not os.path.exists(ipc_addr.removeprefix("ipc://"))
