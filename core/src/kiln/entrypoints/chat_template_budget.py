"""The bounds of one chat-template render: limits, the work budget and the guarded iterables that
charge it (used by :mod:`kiln.entrypoints.chat_template_sandbox`)."""

from __future__ import annotations

import time
from collections.abc import ItemsView, Iterator, KeysView, Mapping, Set, ValuesView
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2.utils import Namespace


@dataclass(frozen=True)
class RenderLimits:
    seconds: float = 2.0
    # Both grow with the inputs' size (messages, tools...), so a long conversation always fits.
    max_work: int = 64 << 20  # about the characters of all values built, plus 8 per input character
    max_output_chars: int = 16 << 20  # plus 1 per input character
    max_range: int = 100_000  # Jinja's own sandbox limit, which transformers' renderer has too
    max_call_depth: int = 64
    max_int_bits: int = 1 << 16
    # Compiling is not interruptible (a second per ~200 KB); the largest templates on the Hub are ~30 KB.
    max_template_chars: int = 1 << 17


DEFAULT_LIMITS = RenderLimits()
ITERATION_COST = 64  # work units per loop step: a loop over nothing still runs out (after ~1M steps)
CALL_COST = 16
INPUT_WORK = 8  # work allowed per character of input: a template's ordinary work is a few passes over it


class TemplateBoundError(jinja2.TemplateError):
    """A bound exceeded; sticky, so code that swallows it (Jinja's constant folding) cannot go on."""


class Budget:
    """One render's bounds: the deadline, the work done, the call depth and the sizes of values seen."""

    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.work = 0
        self.max_work = limits.max_work
        self.depth = 0
        self.tripped: str | None = None
        # Sizes of lists, tuples and dicts by id; the sandbox keeps them immutable, and
        # holding them keeps the ids from being reused within the render.
        self._sizes: dict[int, int] = {}
        self._held: list[Any] = []

    def trip(self, why: str) -> None:
        self.tripped = why
        raise TemplateBoundError(why)

    def check(self) -> None:
        if self.tripped is not None:
            raise TemplateBoundError(self.tripped)
        if time.monotonic() > self.deadline:
            self.trip(f"it ran longer than {self.limits.seconds:g} s")

    def charge(self, units: int) -> None:
        self.check()
        self.work += units
        if self.work > self.max_work:
            self.trip(f"it built more than {self.max_work} characters of values")

    def afford(self, estimate: int, what: str) -> None:
        """Refuse, before it allocates, an operation whose result could be ``estimate`` long."""
        self.check()
        if self.work + estimate > self.max_work:
            self.trip(f"{what} would build a value of up to {estimate} characters")

    def built(self, value: Any) -> Any:
        """Charge a new value; iterators are charged item by item as they are consumed."""
        if isinstance(value, Iterator) and not isinstance(value, Guarded):
            self.charge(8)
            return Guarded(value, self)
        self.charge(self.size(value))
        return value

    def size(self, value: Any, held: bool = False) -> int:
        """What ``str()``, ``==`` or ``hash`` of ``value`` may cost: characters, plus 8 per item and number."""
        if isinstance(value, (str, bytes)):
            return len(value)
        if isinstance(value, int):
            return 8 + value.bit_length() // 8
        if isinstance(value, Namespace):
            # A namespace's attributes change after it is charged, so it may hold only plain
            # values and no list or dict may hold it: then its size is always its attributes'.
            if held:
                self.trip("a namespace cannot be stored in a list, a dict or another namespace")
            return 8 + sum(8 + self.size(v, True) for v in value._Namespace__attrs.values())
        if isinstance(value, (KeysView, ValuesView, ItemsView)) and isinstance(
            getattr(value, "mapping", None), Mapping
        ):
            return self.size(value.mapping, held)
        if not isinstance(value, (list, tuple, Set, Mapping)):
            return 8  # numbers, None, Undefined, macros, loop objects: short text
        known = self._sizes.get(id(value))
        if known is not None:
            return known
        if isinstance(value, Mapping):
            total = 8 + sum(16 + self.size(k, True) + self.size(v, True) for k, v in value.items())
        else:
            total = 8 + sum(8 + self.size(item, True) for item in value)
        self._sizes[id(value)] = total
        self._held.append(value)
        return total


class Guarded:
    """An iterable whose every step checks the deadline and is charged (loops and lazy filters)."""

    __slots__ = ("_inner", "_budget", "_iterator")

    def __init__(self, inner: Any, budget: Budget) -> None:
        self._inner, self._budget, self._iterator = inner, budget, None

    def __iter__(self) -> Iterator[Any]:
        budget = self._budget
        for item in self._inner:
            budget.charge(ITERATION_COST + (budget.size(item) if isinstance(self._inner, Iterator) else 0))
            yield item

    def __next__(self) -> Any:  # lazy filters' results are iterators, and stay so
        if self._iterator is None:
            self._iterator = iter(self)
        return next(self._iterator)

    def __len__(self) -> int:  # loop.length without materializing, where the iterable has a length
        return len(self._inner)


ACTIVE_BUDGET: ContextVar[Budget | None] = ContextVar("kiln_chat_template_budget", default=None)


def active_budget() -> Budget:
    budget = ACTIVE_BUDGET.get()
    if budget is None:
        raise RuntimeError("chat templates render through kiln's render_template() only")
    return budget
