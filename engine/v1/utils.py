"""Small helpers shared across v1 (vLLM twin: ``vllm/v1/utils.py``).

``ConstantList`` is the read-only view that ``Request`` hands out for its token
lists: readers can index and iterate, only the request itself may append.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar, overload

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
