"""What one model forward tells the code it calls (packed metadata, a stepping-aside cause, the caller's mask): a
context variable set for the span of a block, so nested and concurrent forwards never see each other's."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def scoped(variable: contextvars.ContextVar[T], value: T) -> Iterator[None]:
    """`variable` holds `value` within the block, and what it held before after it."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)
