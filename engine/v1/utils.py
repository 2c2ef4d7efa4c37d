"""Small helpers shared across v1 (vLLM twin: ``vllm/v1/utils.py``).

``ConstantList`` is the read-only view that ``Request`` hands out for its token
lists: readers can index and iterate, only the request itself may append.
``compute_iteration_details`` splits a step into prompt (context) and
generation work: the label of each step in a profiler trace.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar, overload

if TYPE_CHECKING:
    from engine.v1.core.sched.output import SchedulerOutput

T = TypeVar("T")


class ConstantList(Generic[T], Sequence[T]):
    def __init__(self, x: list[T]) -> None:
        self._x = x

    def _refuse(self, *args, **kwargs):
        raise TypeError("this list is read-only; change it through its owner (e.g. Request)")

    append = extend = insert = pop = remove = clear = _refuse
    __setitem__ = __delitem__ = __iadd__ = _refuse

    @overload
    def __getitem__(self, item: int) -> T: ...

    @overload
    def __getitem__(self, s: slice) -> list[T]: ...

    def __getitem__(self, item):
        return self._x[item]

    def __len__(self) -> int:
        return len(self._x)

    def __iter__(self) -> Iterator[T]:
        return iter(self._x)

    def __contains__(self, item: object) -> bool:
        return item in self._x

    def index(self, item, *args) -> int:
        return self._x.index(item, *args)

    def copy(self) -> list[T]:
        return self._x.copy()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ConstantList):
            return self._x == other._x
        return self._x == other

    def __repr__(self) -> str:
        return f"ConstantList({self._x!r})"


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many size-``b`` blocks hold ``a`` items."""
    return -(-a // b)


@dataclass
class IterationDetails:
    """One step's requests and tokens: prompt work (new requests and later
    prefill chunks) and generation work (requests with an output token)."""

    num_ctx_requests: int
    num_ctx_tokens: int
    num_generation_requests: int
    num_generation_tokens: int


def compute_iteration_details(scheduler_output: SchedulerOutput) -> IterationDetails:
    new_req_ids = {req.req_id for req in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    in_prompt = {
        req_id for req_id, num_out in zip(cached.req_ids, cached.num_output_tokens) if num_out == 0
    }
    details = IterationDetails(0, 0, 0, 0)
    for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
        if req_id in new_req_ids or req_id in in_prompt:
            details.num_ctx_requests += 1
            details.num_ctx_tokens += num_tokens
        else:
            details.num_generation_requests += 1
            details.num_generation_tokens += num_tokens
    return details
