"""What runs when streamfuse cannot compile a model whole: the backend over Dynamo's pieces, or the
model itself, eagerly; each with one warning naming the reason.

`streamfuse.compile` never raises for a model that eager runs. A model it cannot capture as one
graph (a data-dependent branch or shape, an output torch.export cannot flatten, such as Mamba's
cache) goes through the torch.compile backend instead (`BackendFallback`): Dynamo splits it where it
must and the backend compiles the pieces. Where that fails too, or for a planning or code generation
failure of a shape a compiled model meets later, the model runs as it is (`EagerFallback`). Both
answer `stats` and `explain()` like a CompiledGraph, with the reason, and warn once. The backend
does the same with each graph Dynamo hands it (capture/backend.py).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch


class StreamfuseFallbackWarning(UserWarning):
    """streamfuse runs (part of) a model eagerly, or through the backend instead of whole; the message
    says why."""


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


class BackendFallback:
    """The model through `torch.compile(model, backend=make_backend(config))`, because streamfuse
    could not capture it as one graph (`reason`). Compiles at its first call, as torch.compile does.
    A call the compiled model fails where eager runs (Dynamo or the backend failing on a new shape)
    sends the model to eager for good, with a second warning; where eager fails too, the input is
    bad and eager's error is raised."""

    def __init__(self, model: Callable[..., Any], reason: str, config: Any):
        from streamfuse.capture.backend import compiled_graphs, make_backend

        self.model = model
        self.reason = reason
        self.eager_reason: str | None = None
        """Set once the compiled model failed where eager ran: every call runs eagerly from then on."""
        self._graphs: list[weakref.ref[Any]] = []
        inner = make_backend(config)

        def backend(gm: Any, example_inputs: list[Any], **kwargs: Any) -> Any:
            start = len(compiled_graphs)
            compiled = inner(gm, example_inputs, **kwargs)
            self._graphs.extend(weakref.ref(g) for g in compiled_graphs[start:] if g is not None)
            return compiled

        self.compiled = torch.compile(model, backend=backend)
        warnings.warn(f"streamfuse: the model could not be captured as one graph ({reason}); it runs through "
                      "torch.compile(backend='streamfuse'), which compiles it in pieces", StreamfuseFallbackWarning,
                      stacklevel=3)

    def __call__(self, *inputs: Any, **named: Any) -> Any:
        if self.eager_reason is not None:
            return self.model(*inputs, **named)
        try:
            return self.compiled(*inputs, **named)
        except torch.OutOfMemoryError:
            raise  # the backend's graphs already dropped what they held and tried again (runtime/memory.py)
        except Exception as exc:  # noqa: BLE001 - never fail where eager runs
            out = self.model(*inputs, **named)  # a bad input raises eager's own error here
            # Dynamo wraps a backend's error (BackendCompilerFailed): the reason is the one inside
            cause = getattr(exc, "inner_exception", None) or exc
            self.eager_reason = f"torch.compile(backend='streamfuse') failed too: {failure_text(cause)}"
            warn_fallback("the model", self.eager_reason)
            return out

    @property
    def graphs(self) -> list[Any]:
        """The backend's graphs compiled for this model so far (forward and inference graphs)."""
        return [g for g in (r() for r in self._graphs) if g is not None]

    @property
    def stats(self) -> dict[str, Any]:
        graphs = self.graphs
        kernels = [g.stats.get("kernels") for g in graphs if hasattr(g, "stats")]
        return {"fallback": self.eager_reason or self.reason, "path": "torch.compile(backend='streamfuse')",
                "kernels": sum(k for k in kernels if k) if graphs and self.eager_reason is None else None,
                "graphs": len(graphs), "specializations": 0}

    def explain(self, source: bool = True) -> str:
        head = (f"streamfuse could not capture this model as one graph ({self.reason}); it runs through "
                f"torch.compile(backend='streamfuse'), {len(self.graphs)} graph(s) compiled so far.\n")
        if self.eager_reason is not None:
            return head + f"That failed too; the model runs eagerly.\nreason: {self.eager_reason}\n"
        return head + "".join(g.explain(source) for g in self.graphs if hasattr(g, "explain"))

    def __repr__(self) -> str:
        return f"BackendFallback({self.reason!r})"
