"""One writer, many readers: each step's message to every worker through shared memory.

vLLM twin: ``vllm/distributed/device_communicators/shm_broadcast.py``
(``ShmRingBuffer``, ``Handle``, ``MessageQueue``).
Read it for how a multiprocess executor hands the same ``SchedulerOutput`` to
every worker process each step (``MessageQueue.broadcast_object``), and how
each worker answers on a queue of its own with one reader:

  1. ``ShmRingBuffer`` -- one shared-memory segment: ``max_chunks`` chunks of
     ``max_chunk_bytes``, then, per chunk, a *written* byte and one *read*
     byte per reader. The writer takes the next chunk once every reader has
     read it (or it was never written), writes the pickled message, clears the
     read bytes and sets the written byte last. Reader ``i`` waits until its
     next chunk is written and not yet read by it, unpickles it and sets its
     read byte. One writer and byte-sized flags: no lock is needed, only the
     order of the stores (payload first, flag last).
  2. ``MessageQueue`` -- the writer's side (``enqueue``) and, through
     ``create_from_handle``, a reader's (``dequeue``). Readers on this machine
     read the ring; readers on other machines (Ray workers) get every message
     over a ZMQ XPUB socket on TCP. A message larger than a chunk leaves an
     "overflow" mark in its chunk and travels over a local ZMQ socket.
  3. ``Handle`` -- what a reader needs to find the queue (the segment's name,
     the socket addresses); it pickles, so the executor sends it to its workers.
  4. ``wait_until_ready`` -- the handshake (every subscriber announced, then
     one READY message) after which no socket message can be lost.

How a waiting side waits: it spins for a few hundred microseconds (yielding
the CPU with ``os.sched_yield``), then sleeps, doubling the sleep up to 1 ms.
A step message usually comes right after the previous one was answered, so
the spin catches it at once; an idle worker (no requests) costs a wake-up per
millisecond instead of a whole core. That matters on a 2-core machine with
four workers and EngineCore itself: four spinning readers would take the CPU
the scheduler needs to produce the very message they wait for. The price is
up to ~1 ms of extra latency for the first message after an idle spell
(``benchmarks/broadcast_cpu.py`` measures both cases).
Sessions: 07 (executor).

Simpler than vLLM: an idle reader sleeps in steps of at most 1 ms instead of
blocking on a notification socket. (vLLM's ``SpinCondition`` spins for a
second after each read, then waits on a ZMQ socket the writer pings after
every write.) Also: one pickle per message (vLLM sends large buffers out of
band), no ``create_from_process_group`` constructors (they need
``torch.distributed``: our executor passes the ``Handle`` to its workers
itself) and no spin-loop C extension. A reader's ``dequeue`` takes a
``cancel`` event, and ``close()`` both wakes waiting calls and frees the
sockets and the segment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import struct
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import zmq

from engine.utils.network_utils import get_ip, remove_ipc_socket_file

logger = logging.getLogger(__name__)

# Every segment's name starts with this (tests look for leaks in /dev/shm).
SHM_NAME_PREFIX = "glassbox_"
# 100 MiB of /dev/shm per queue by default, but only the pages written to
# (the head of each chunk, for small messages) take memory.
DEFAULT_MAX_CHUNK_BYTES = 10 * 1024 * 1024
DEFAULT_MAX_CHUNKS = 10

# Waiting: spin this long (yielding the CPU), then sleep from FIRST_SLEEP_S,
# doubling up to MAX_SLEEP_S (see the module docstring for why).
SPIN_S = 300e-6
FIRST_SLEEP_S = 50e-6
MAX_SLEEP_S = 1e-3
# A wait on a socket checks for close/cancel this often.
SOCKET_POLL_SLICE_MS = 20
# An unbounded wait says so in the log this often.
LONG_WAIT_LOG_S = 60.0
# close() waits this long for an enqueue/dequeue of another thread to notice it.
CLOSE_WAIT_S = 10.0

# A chunk starts with: overflow flag (1 byte), payload length (8 bytes); the payload follows.
_CHUNK_HEADER = struct.Struct("<BQ")

_fence_lock = threading.Lock()


def memory_fence() -> None:
    """Order this process's shared-memory stores and loads around this call.

    Taking and releasing a lock is an atomic read-modify-write, which the CPU
    does not reorder other memory accesses across. On x86 the flag protocol
    would hold without it; on weakly ordered CPUs (ARM) a reader could
    otherwise see the written flag before the payload it publishes."""
    with _fence_lock:
        pass


def _new_shm_name() -> str:
    return f"{SHM_NAME_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}"


_tracker_patch_lock = threading.Lock()


def _attach_shared_memory(name: str) -> shared_memory.SharedMemory:
    """Open an existing segment without the resource tracker hearing of it.

    Before Python 3.13, attaching registers the segment with the resource
    tracker. A reader whose tracker is not the creator's would have it
    unlinked (with a "leaked shared_memory" warning) when the reader exits.
    Unregistering after attaching is no fix: a reader started by
    ``multiprocessing`` (forked or spawned) shares the creator's tracker, so
    its unregister removes the creator's registration, and the creator's own
    unlink later makes the tracker print a ``KeyError``. So the registration
    is skipped: ``track=False`` on 3.13+, before that by swapping out
    ``resource_tracker.register`` for the duration of the call."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    original = resource_tracker.register

    def register_all_but_this(res_name: str, rtype: str) -> None:
        # Only this segment: another thread may be creating one of its own.
        if rtype != "shared_memory" or res_name.lstrip("/") != name.lstrip("/"):
            original(res_name, rtype)

    with _tracker_patch_lock:
        resource_tracker.register = register_all_but_this
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = original


class ShmRingBuffer:
    """``max_chunks`` chunks of ``max_chunk_bytes`` for one writer and ``n_reader``
    readers, in one shared-memory segment.

    Layout: all data chunks first, then the metadata, ``1 + n_reader`` bytes
    per chunk: ``[written, read_0, ..., read_{n-1}]``. A chunk is free for the
    writer when ``written == 0`` or every ``read_i == 1``; it is ready for
    reader ``i`` when ``written == 1`` and ``read_i == 0``. The writer clears
    ``written`` before it writes, and clears the read bytes before it sets
    ``written`` again, so no reader sees a half-written chunk or a stale read
    byte.

    ``name=None`` creates the segment (this object owns it and unlinks it on
    ``close``); a name attaches to an existing one (``handle()`` gives the
    arguments; the buffer also pickles as them)."""

    def __init__(
        self,
        n_reader: int,
        max_chunk_bytes: int,
        max_chunks: int,
        name: str | None = None,
    ) -> None:
        if n_reader < 1 or max_chunks < 1:
            raise ValueError(
                f"need n_reader >= 1 and max_chunks >= 1, got {n_reader}, {max_chunks}"
            )
        if max_chunk_bytes <= _CHUNK_HEADER.size:
            raise ValueError(f"max_chunk_bytes must exceed {_CHUNK_HEADER.size}")
        self.n_reader = n_reader
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self.metadata_size = 1 + n_reader
        self.data_offset = 0
        self.metadata_offset = max_chunk_bytes * max_chunks
        self.total_bytes_of_buffer = self.metadata_offset + self.metadata_size * max_chunks
        self._pid = os.getpid()
        self._closed = True  # until the views below exist
        if name is None:
            self.is_creator = True
            self.shared_memory = shared_memory.SharedMemory(
                name=_new_shm_name(), create=True, size=self.total_bytes_of_buffer
            )
        else:
            self.is_creator = False
            self.shared_memory = _attach_shared_memory(name)
            if self.shared_memory.size < self.total_bytes_of_buffer:
                self.shared_memory.close()
                raise ValueError(
                    f"shared memory {name!r} has {self.shared_memory.size} bytes, "
                    f"the ring needs {self.total_bytes_of_buffer}"
                )
        buf = self.shared_memory.buf
        assert buf is not None
        # One view per chunk and per metadata row, made once (slicing per
        # message would cost more than the flag checks themselves).
        chunk, meta, base = max_chunk_bytes, self.metadata_size, self.metadata_offset
        self._data = [buf[i * chunk : (i + 1) * chunk] for i in range(max_chunks)]
        self._metadata = [buf[base + i * meta : base + (i + 1) * meta] for i in range(max_chunks)]
        if self.is_creator:
            # A new POSIX segment is zero-filled already; say it anyway.
            for row in self._metadata:
                row[:] = bytes(self.metadata_size)
        self._closed = False

    @property
    def name(self) -> str:
        return self.shared_memory.name

    def handle(self) -> tuple[int, int, int, str]:
        """The arguments that attach another process to this segment."""
        return (self.n_reader, self.max_chunk_bytes, self.max_chunks, self.shared_memory.name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, self.handle())

    def get_data(self, current_idx: int) -> memoryview:
        """Chunk ``current_idx``'s bytes (a view into the segment)."""
        return self._data[current_idx]

    def get_metadata(self, current_idx: int) -> memoryview:
        """Chunk ``current_idx``'s flags: ``[written, read_0, ..., read_{n-1}]``."""
        return self._metadata[current_idx]

    def close(self) -> None:
        """Unmap the segment; the creator also unlinks it. Idempotent.
        Glassbox's own (vLLM's buffer does this in ``__del__`` only).

        A forked child holding a copy of the creator's object does not unlink:
        the segment is its parent's."""
        if self._closed:
            return
        self._closed = True
        for view in self._data + self._metadata:
            view.release()
        try:
            self.shared_memory.close()
        except BufferError:
            # A view of the segment is still alive somewhere (a traceback's
            # frame, say); the mapping goes when that view does.
            logger.warning("shared memory %s: a view is still in use", self.shared_memory.name)
        if self.is_creator and os.getpid() == self._pid:
            try:
                self.shared_memory.unlink()
            except FileNotFoundError:
                pass

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                pass


@dataclass
class Handle:
    """What a reader needs to join a ``MessageQueue`` (picklable)."""

    # The ranks that read through shared memory, in reader-flag order.
    local_reader_ranks: list[int] = field(default_factory=list)
    # ShmRingBuffer.handle(): (n_reader, max_chunk_bytes, max_chunks, shm name).
    buffer_handle: tuple[int, int, int, str] | None = None
    # ipc:// address of the writer's socket for messages bigger than a chunk.
    local_subscribe_addr: str | None = None
    # tcp:// address of the writer's socket for readers on other machines.
    remote_subscribe_addr: str | None = None
    remote_addr_ipv6: bool = False


def _open_ipc_path() -> str:
    return f"ipc://{tempfile.gettempdir()}/glassbox-mq-{uuid.uuid4().hex[:16]}"


def unlink_orphaned_segment(name: str) -> None:
    """Remove the segment ``name`` whose writer died without unlinking it (a
    killed worker's answer queue), and the resource tracker's record of it."""
    with contextlib.suppress(FileNotFoundError):
        segment = shared_memory.SharedMemory(name=name)
        segment.close()
        segment.unlink()  # also drops the resource tracker's record of it
        return
    with contextlib.suppress(Exception):  # already gone: forget the record
        resource_tracker.unregister(f"/{name}", "shared_memory")


def _remove_writer_files(
    pid: int, shm: shared_memory.SharedMemory | None, ipc_address: str | None
) -> None:
    """For a writer never closed, at exit (or when collected): remove its
    segment and its ipc socket file, which would otherwise outlive it."""
    if os.getpid() != pid:
        return
    remove_ipc_socket_file(ipc_address)
    if shm is not None:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


class MessageQueue:
    """One writer broadcasting pickled objects to ``n_reader`` readers, in order.

    The constructor makes the writer's side; ``export_handle()`` gives the
    ``Handle`` that ``create_from_handle(handle, rank)`` turns into a
    reader's side in another process. ``n_local_reader`` of the readers
    (``local_reader_ranks``, default ``0 .. n_local_reader - 1``) read
    through shared memory; the other ranks subscribe over TCP on
    ``connect_ip``. Then every side calls ``wait_until_ready()``."""

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        connect_ip: str | None = None,
    ) -> None:
        if not 0 <= n_local_reader <= n_reader:
            raise ValueError(
                f"need 0 <= n_local_reader <= n_reader, got {n_local_reader}, {n_reader}"
            )
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        elif len(local_reader_ranks) != n_local_reader:
            raise ValueError(
                f"{len(local_reader_ranks)} local_reader_ranks for {n_local_reader} local readers"
            )
        self._init_state(is_writer=True)
        self.n_local_reader = n_local_reader
        self.n_remote_reader = n_reader - n_local_reader
        local_subscribe_addr = remote_subscribe_addr = None
        remote_addr_ipv6 = False
        try:
            if n_local_reader > 0:
                self.buffer = ShmRingBuffer(n_local_reader, max_chunk_bytes, max_chunks)
                self.current_idx = 0
                # XPUB (a PUB that also receives subscriptions, every one of
                # them with XPUB_VERBOSE) lets wait_until_ready count readers.
                local_subscribe_addr = _open_ipc_path()
                self.local_socket = self._make_socket(zmq.XPUB)
                self.local_socket.bind(local_subscribe_addr)
                self._ipc_address = local_subscribe_addr
            if self.n_remote_reader > 0:
                ip = connect_ip or get_ip()
                self.remote_socket = self._make_socket(zmq.XPUB)
                if ":" in ip:
                    self.remote_socket.setsockopt(zmq.IPV6, 1)
                    remote_addr_ipv6 = True
                    ip = f"[{ip}]"
                # Port 0: the OS picks a free one (no race with another binder).
                self.remote_socket.bind(f"tcp://{ip}:0")
                remote_subscribe_addr = self.remote_socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self.close()
            raise
        self.handle = Handle(
            local_reader_ranks=list(local_reader_ranks),
            buffer_handle=self.buffer.handle() if self.buffer is not None else None,
            local_subscribe_addr=local_subscribe_addr,
            remote_subscribe_addr=remote_subscribe_addr,
            remote_addr_ipv6=remote_addr_ipv6,
        )
        logger.debug("message queue handle: %s", self.handle)
        shm = self.buffer.shared_memory if self.buffer is not None else None
        self._finalizer = weakref.finalize(
            self, _remove_writer_files, self._pid, shm, self._ipc_address
        )

    def _init_state(self, is_writer: bool) -> None:
        self._is_writer = is_writer
        self._is_local_reader = False
        self._is_remote_reader = False
        self.local_reader_rank = -1  # this reader's index into the read flags
        self.rank = -1  # a reader's rank, as given to create_from_handle
        self.n_local_reader = 0
        self.n_remote_reader = 0  # a reader does not know the other readers: 0
        self.buffer: ShmRingBuffer | None = None
        self.current_idx = -1  # the next chunk to write or read
        self.local_socket: zmq.Socket | None = None
        self.remote_socket: zmq.Socket | None = None
        self.shutting_down = False
        self._closed = False
        self._pid = os.getpid()
        self._ipc_address: str | None = None  # ipc:// address of the writer's bound socket
        self._finalizer: weakref.finalize | None = None  # the writer's, until close()
        # Held by enqueue/dequeue; close() takes it so that it never frees a
        # socket or the segment under a call running in another thread.
        self._io_lock = threading.RLock()
        self._context = zmq.Context()

    def _make_socket(self, socket_type: int) -> zmq.Socket:
        sock = self._context.socket(socket_type)
        # Never drop a message (a PUB socket drops past its high-water mark).
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        if socket_type == zmq.XPUB:
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        return sock

    def export_handle(self) -> Handle:
        return self.handle

    @staticmethod
    def create_from_handle(handle: Handle, rank: int) -> MessageQueue:
        """The reader's side for ``rank``: attached to the ring buffer if the
        rank is one of ``handle.local_reader_ranks``, else subscribed over TCP."""
        self = MessageQueue.__new__(MessageQueue)
        self._init_state(is_writer=False)
        self.handle = handle
        self.rank = rank
        try:
            if rank in handle.local_reader_ranks:
                if handle.buffer_handle is None or handle.local_subscribe_addr is None:
                    raise ValueError("handle has local reader ranks but no shared memory")
                self.buffer = ShmRingBuffer(*handle.buffer_handle)
                self.current_idx = 0
                self.local_reader_rank = handle.local_reader_ranks.index(rank)
                self._is_local_reader = True
                self.n_local_reader = len(handle.local_reader_ranks)
                self.local_socket = self._make_socket(zmq.SUB)
                self.local_socket.setsockopt(zmq.SUBSCRIBE, b"")
                self.local_socket.connect(handle.local_subscribe_addr)
            else:
                if handle.remote_subscribe_addr is None:
                    raise ValueError(
                        f"rank {rank} is not a local reader and the queue has no remote"
                    )
                self._is_remote_reader = True
                self.remote_socket = self._make_socket(zmq.SUB)
                if handle.remote_addr_ipv6:
                    self.remote_socket.setsockopt(zmq.IPV6, 1)
                self.remote_socket.setsockopt(zmq.SUBSCRIBE, b"")
                self.remote_socket.connect(handle.remote_subscribe_addr)
        except BaseException:
            self.close()
            raise
        return self

    def _who(self) -> str:
        if self._is_writer:
            return "MessageQueue writer"
        kind = "local" if self._is_local_reader else "remote"
        return f"MessageQueue {kind} reader (rank {self.rank})"

    def _check_open(self) -> None:
        if self._closed or self.shutting_down:
            raise RuntimeError(f"{self._who()} is closed")

    # ------------------------------------------------------------------ waiting
    def _wait(
        self,
        ready: Callable[[], bool],
        timeout: float | None,
        cancel: threading.Event | None,
        what: Callable[[], str],
    ) -> None:
        """Return once ``ready()``; spin, then sleep with backoff (see the
        module docstring). ``what()`` says what was waited for, in errors."""
        if ready():
            return
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        next_log = start + LONG_WAIT_LOG_S
        sleep_s = FIRST_SLEEP_S
        while True:
            if self.shutting_down:
                raise RuntimeError(f"{self._who()} was closed while waiting for {what()}")
            if cancel is not None and cancel.is_set():
                raise RuntimeError(f"{self._who()}: cancelled while waiting for {what()}")
            if ready():
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"{self._who()}: timed out after {timeout} s waiting for {what()}"
                )
            if now >= next_log:
                logger.info(
                    "%s: still waiting for %s after %.0f s", self._who(), what(), now - start
                )
                next_log += LONG_WAIT_LOG_S
            if now - start < SPIN_S:
                os.sched_yield()
            else:
                time.sleep(sleep_s if deadline is None else min(sleep_s, deadline - now))
                sleep_s = min(2 * sleep_s, MAX_SLEEP_S)

    def _recv(
        self,
        sock: zmq.Socket,
        timeout: float | None,
        cancel: threading.Event | None,
        what: str,
    ) -> zmq.Frame:
        """One message from ``sock``, polling in slices so that close/cancel are seen."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        next_log = start + LONG_WAIT_LOG_S
        while True:
            if self.shutting_down:
                raise RuntimeError(f"{self._who()} was closed while waiting for {what}")
            if cancel is not None and cancel.is_set():
                raise RuntimeError(f"{self._who()}: cancelled while waiting for {what}")
            now = time.monotonic()
            slice_ms = SOCKET_POLL_SLICE_MS
            if deadline is not None:
                slice_ms = max(0, min(slice_ms, int((deadline - now) * 1000) + 1))
            if sock.poll(slice_ms, zmq.POLLIN):
                return sock.recv(copy=False)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"{self._who()}: timed out after {timeout} s waiting for {what}")
            if now >= next_log:
                logger.info("%s: still waiting for %s after %.0f s", self._who(), what, now - start)
                next_log += LONG_WAIT_LOG_S

    # ---------------------------------------------------------------- handshake
    def wait_until_ready(self, timeout: float | None = None) -> None:
        """The start-up handshake; every side (writer and all readers) calls it.

        A subscriber that connects after a message was published misses it,
        so the writer first waits for every reader's subscription (XPUB
        reports each one), then publishes READY; each reader waits for it.
        After that, nothing sent on the sockets is lost. (The ring buffer
        needs no handshake: a chunk waits for its readers.)"""
        with self._io_lock:
            self._check_open()
            deadline = None if timeout is None else time.monotonic() + timeout

            def left() -> float | None:
                return None if deadline is None else max(0.0, deadline - time.monotonic())

            if self._is_writer:
                for sock, n, kind in (
                    (self.local_socket, self.n_local_reader, "local"),
                    (self.remote_socket, self.n_remote_reader, "remote"),
                ):
                    if sock is None or n == 0:
                        continue
                    subscribed = 0
                    while subscribed < n:
                        what = f"{kind} reader subscriptions ({subscribed} of {n} so far)"
                        msg = self._recv(sock, left(), None, what)
                        # b"\x01" + topic: a subscription; b"\x00" + topic: a leave.
                        if msg.bytes[:1] == b"\x01":
                            subscribed += 1
                    sock.send(b"READY")
            else:
                sock = self.local_socket if self._is_local_reader else self.remote_socket
                assert sock is not None
                msg = self._recv(sock, left(), None, "the writer's READY")
                if msg.bytes != b"READY":
                    raise RuntimeError(f"{self._who()}: expected READY, got {msg.bytes[:32]!r}")

    # ----------------------------------------------------------- ring buffer I/O
    @contextmanager
    def acquire_write(self, timeout: float | None = None) -> Iterator[memoryview]:
        """Wait for the next chunk to be free, yield its bytes, then publish it
        (unless the body raised: the chunk then stays unwritten and is reused)."""
        assert self._is_writer and self.buffer is not None, "only the writer acquires a write"
        buffer = self.buffer
        idx = self.current_idx
        metadata = buffer.get_metadata(idx)
        all_read = b"\x01" * buffer.n_reader

        def free() -> bool:
            memory_fence()
            flags = metadata.tobytes()
            return flags[0] == 0 or flags[1:] == all_read

        def what() -> str:
            flags = metadata.tobytes()
            behind = [r for r, f in zip(self.handle.local_reader_ranks, flags[1:]) if not f]
            return f"chunk {idx} to be read by local reader rank(s) {behind}"

        self._wait(free, timeout, None, what)
        metadata[0] = 0  # ours now: no reader looks at an unwritten chunk
        memory_fence()
        yield buffer.get_data(idx)
        # Clear the read flags before setting the written flag: the other
        # order would briefly show "written, already read" to a reader.
        metadata[1:] = bytes(buffer.n_reader)
        memory_fence()
        metadata[0] = 1
        memory_fence()
        self.current_idx = (idx + 1) % buffer.max_chunks

    @contextmanager
    def acquire_read(
        self, timeout: float | None = None, cancel: threading.Event | None = None
    ) -> Iterator[memoryview]:
        """Wait for this reader's next chunk, yield its bytes, then mark it read
        (also when the body raised, so that one bad message cannot stall the writer)."""
        assert self._is_local_reader and self.buffer is not None, "only local readers read chunks"
        buffer = self.buffer
        idx = self.current_idx
        metadata = buffer.get_metadata(idx)
        flag = 1 + self.local_reader_rank

        def ready() -> bool:
            memory_fence()
            return metadata[0] == 1 and metadata[flag] == 0

        self._wait(ready, timeout, cancel, lambda: f"chunk {idx} to be written")
        try:
            yield buffer.get_data(idx)
        finally:
            if not buffer._closed:
                memory_fence()
                metadata[flag] = 1
                memory_fence()
                self.current_idx = (idx + 1) % buffer.max_chunks

    # ------------------------------------------------------------ the messages
    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Send ``obj`` to every reader. Blocks while the slowest local reader is
        ``max_chunks`` messages behind; ``timeout`` (s) bounds that wait."""
        if not self._is_writer:
            raise RuntimeError(f"{self._who()} cannot enqueue: only the writer does")
        payload = pickle.dumps(obj, protocol=5)
        with self._io_lock:
            self._check_open()
            if self.buffer is not None:
                overflow = _CHUNK_HEADER.size + len(payload) > self.buffer.max_chunk_bytes
                with self.acquire_write(timeout) as buf:
                    _CHUNK_HEADER.pack_into(buf, 0, int(overflow), len(payload))
                    if not overflow:
                        buf[_CHUNK_HEADER.size : _CHUNK_HEADER.size + len(payload)] = payload
                if overflow:
                    # The mark is in the ring, in order; the bytes follow on the socket.
                    assert self.local_socket is not None
                    self.local_socket.send(payload, copy=False)
            if self.remote_socket is not None:
                self.remote_socket.send(payload, copy=False)

    def dequeue(self, timeout: float | None = None, cancel: threading.Event | None = None) -> Any:
        """The next message, in the order enqueued. ``timeout`` (s) raises
        ``TimeoutError``; ``cancel`` set (by another thread, at shutdown)
        raises ``RuntimeError``, as does ``close()`` from another thread."""
        if self._is_writer:
            raise RuntimeError("MessageQueue writer cannot dequeue: only readers do")
        with self._io_lock:
            self._check_open()
            deadline = None if timeout is None else time.monotonic() + timeout
            if self._is_local_reader:
                overflow = False
                with self.acquire_read(timeout, cancel) as buf:
                    overflow_flag, size = _CHUNK_HEADER.unpack_from(buf, 0)
                    overflow = bool(overflow_flag)
                    if not overflow:
                        with buf[_CHUNK_HEADER.size : _CHUNK_HEADER.size + size] as view:
                            obj = pickle.loads(view)
                if overflow:
                    assert self.local_socket is not None
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    frame = self._recv(self.local_socket, left, cancel, "an oversized message")
                    obj = pickle.loads(frame.buffer)
                return obj
            assert self.remote_socket is not None
            frame = self._recv(self.remote_socket, timeout, cancel, "a message")
            return pickle.loads(frame.buffer)

    def broadcast_object(self, obj: Any = None) -> Any:
        """The writer sends ``obj`` and returns it; a reader returns what was sent."""
        if self._is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    # ----------------------------------------------------------------- closing
    def close(self) -> None:
        """Close the sockets and unmap the segment (the writer also unlinks it).
        Idempotent. A call waiting in another thread raises ``RuntimeError``.
        Glassbox's own (vLLM frees these when the object is collected)."""
        if getattr(self, "_closed", True):
            return
        self.shutting_down = True  # a wait in another thread sees this within ~20 ms
        if not self._io_lock.acquire(timeout=CLOSE_WAIT_S):
            logger.warning("%s: close() gave up waiting for a call in another thread", self._who())
            return
        try:
            if self._closed:
                return
            self._closed = True
            if self._finalizer is not None:
                self._finalizer.detach()  # close() removes the files itself
            if os.getpid() != self._pid:
                # A forked copy: the sockets and the segment are the parent's.
                return
            for sock in (self.local_socket, self.remote_socket):
                if sock is not None:
                    sock.close(linger=0)
            self._context.destroy(linger=0)  # also any socket a failed constructor left
            remove_ipc_socket_file(self._ipc_address)
            if self.buffer is not None:
                self.buffer.close()
        finally:
            self._io_lock.release()

    def shutdown(self) -> None:
        """vLLM's name: wake a reader waiting in another thread (it raises
        ``RuntimeError``). Ours then also closes, as ``close()``."""
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
