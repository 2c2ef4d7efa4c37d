"""The waiting queue, in two flavours.

vLLM twin: ``vllm/v1/core/sched/request_queue.py``.
Read it for: FCFS is a deque -- ``prepend_request`` puts a preempted request
back at the *front*, so it resumes before anyone who arrived later. PRIORITY is
a heap ordered by ``Request.__lt__`` (priority, then arrival time); there
"prepend" is just a push, because the heap decides the order anyway. The
scheduler keeps two queues of the same kind: ``waiting`` and
``skipped_waiting`` (requests blocked on something other than space).
Sessions: 02 (scheduler).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator
from enum import Enum

from engine.v1.request import Request


class SchedulingPolicy(Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def pop_request(self) -> Request: ...

    @abstractmethod
    def peek_request(self) -> Request: ...

    @abstractmethod
    def prepend_request(self, request: Request) -> None: ...

    @abstractmethod
    def prepend_requests(self, requests: RequestQueue) -> None: ...

    @abstractmethod
    def remove_request(self, request: Request) -> None: ...

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    @abstractmethod
    def __bool__(self) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in the order they would be popped."""


class FCFSRequestQueue(deque, RequestQueue):
    def add_request(self, request: Request) -> None:
        self.append(request)

    def pop_request(self) -> Request:
        return self.popleft()

    def peek_request(self) -> Request:
        if not self:
            raise IndexError("peek from an empty queue")
        return self[0]

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        """Put ``requests`` at the front in *reverse* order (``extendleft``),
        as vLLM does: the scheduler fills ``requests`` with
        ``prepend_request``, which reversed them once already."""
        self.extendleft(requests)

    def remove_request(self, request: Request) -> None:
        self.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = set(requests)
        kept = [r for r in self if r not in doomed]
        self.clear()
        self.extend(kept)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __len__(self) -> int:
        return deque.__len__(self)

    def __iter__(self) -> Iterator[Request]:
        return deque.__iter__(self)


class PriorityRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        # No front in a heap: each request goes to its place by priority.
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self.remove_requests([request])

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = set(requests)
        self._heap = [r for r in self._heap if r not in doomed]
        heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy == SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    if policy == SchedulingPolicy.FCFS:
        return FCFSRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
