"""What runs when streamfuse cannot: the model itself, eagerly, with one warning naming the reason.

`streamfuse.compile` never raises for a model that eager runs: a capture, planning or code
generation failure returns an `EagerFallback`, which calls the model as it is and answers
`stats` and `explain()` like a CompiledGraph, with the reason. The torch.compile backend does the
same with the graph Dynamo handed it (capture/backend.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any


class StreamfuseFallbackWarning(UserWarning):
    """streamfuse runs (part of) a model eagerly; the message says why."""


def failure_text(exc: BaseException) -> str:
    """One line naming an exception: its type and the first line of its message."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:400]


def warn_fallback(what: str, reason: str) -> None:
    warnings.warn(f"streamfuse: {what} runs eagerly: {reason}", StreamfuseFallbackWarning, stacklevel=3)


class EagerFallback:
    """The model, run eagerly because streamfuse could not compile it (`reason`)."""

    def __init__(self, model: Callable[..., Any], reason: str):
        self.model = model
        self.reason = reason
        warn_fallback("the model", reason)

    def __call__(self, *inputs: Any, **named: Any) -> Any:
        return self.model(*inputs, **named)

    @property
    def stats(self) -> dict[str, Any]:
        return {"fallback": self.reason, "kernels": None, "graphs": 0, "specializations": 0}

    def explain(self, source: bool = True) -> str:
        return f"streamfuse could not compile this model; it runs eagerly.\nreason: {self.reason}\n"

    def __repr__(self) -> str:
        return f"EagerFallback({self.reason!r})"
