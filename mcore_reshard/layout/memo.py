"""Work keyed by object identity, for layouts and plans of hundreds of thousands of pieces.

Hashing such a layout or plan by value costs about what caching its results saves, and its
pieces share a few thousand Box and View objects. ``IdentityCache``: results cached by the
identity of the layouts and plans they were computed from (it holds them, so an id cannot
pass to a new object while its entry lives). ``ValueIds``: Box and View values as small ints,
each object's value looked up once.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterable, TypeVar

from .descriptor import Box, View

__all__ = ["IdentityCache", "ValueIds"]

T = TypeVar("T")


class IdentityCache:
    """``build()`` once per (identities of ``held``, ``extra``); the ``most`` entries used last
    are kept. A ``build`` that raises caches nothing."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._entries: "OrderedDict[tuple, tuple[tuple, Any]]" = OrderedDict()

    def get(self, held: tuple, extra: Hashable, build: Callable[[], T]) -> T:
        key = (tuple(map(id, held)), extra)
        hit = self._entries.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], held)):
            self._entries.move_to_end(key)
            return hit[1]
        value = build()
        self._entries[key] = (held, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.most:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()


class ValueIds:
    """Box and View values as small ints (``ids(x)``; ``ids.values[i]``: the value). A full-size
    side has ~300k pieces but ~1k distinct Box and View objects (the rules share them between
    ranks): each object's value is looked up once, by identity, and pieces are then hashed
    and compared as ints -- not by the dataclasses' Python-level ``__hash__`` and ``__eq__``
    once per piece and dict. The objects must outlive it (they are the layout's)."""

    __slots__ = ("by_id", "by_value", "values")

    def __init__(self) -> None:
        self.by_id: dict[int, int] = {}
        self.by_value: dict[Box | View, int] = {}
        self.values: list[Box | View] = []

    def __call__(self, x: Box | View) -> int:
        i = self.by_id.get(id(x))
        if i is None:
            i = self.by_value.get(x)
            if i is None:
                i = self.by_value[x] = len(self.values)
                self.values.append(x)
            self.by_id[id(x)] = i
        return i

    def many(self, xs: Iterable[Box | View]) -> list[int]:
        """``[ids(x) for x in xs]``, C-level where every object was seen before (the bulk)."""
        xs = list(xs)
        out = list(map(self.by_id.get, map(id, xs)))
        if None in out:
            out = [self(x) if i is None else i for i, x in zip(out, xs)]
        return out
