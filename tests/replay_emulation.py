"""CUDA graphs of training graphs emulated on any device (tests of runtime/replay.py's logic).

A "recorded" graph runs the plan once, as a warm-up does; a "replay" runs the plan again on the
inputs where the recorded graph would read them (the caller's tensors for inputs read in place,
the graph's buffers for copied ones) and writes the results into the recorded output buffers, as a
replayed graph does. Everything else (when to record, replay or run step by step, what is handed
out, copied or rebuilt) is the real code.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import streamfuse.capture.backend as backend_module
from streamfuse.runtime import replay
from streamfuse.runtime.compiled import CompiledGraph
from streamfuse.runtime.pinned import PinnedGraph
from streamfuse.runtime.replay import ReplayGraph


class EmulatedGraph(PinnedGraph):
    """A backward recorded into its forward's pool (Config.training_shared_pool) may reuse the saved
    activations' memory after their last reader, and the forward's next replay may write where that
    backward's gradients lie. The emulation makes both happen: a replayed backward fills the saved
    activations it took over with NaN, and a replayed forward fills the gradients of such backwards
    with NaN, so a replay the guards should have refused shows as NaN against eager's results."""

    def _record(self, args: list[Any]) -> list[Any]:
        # the copied inputs land in buffers of the graph's own (here owned), handed to the recording
        # run as the capture hands them (Executable.run's `donate`)
        self.buffers = [torch.empty_strided(args[i].shape, args[i].stride(), dtype=args[i].dtype,
                                            device=args[i].device) for i in self.copied_at]
        if self.buffers:
            torch._foreach_copy_(self.buffers, [args[i] for i in self.copied_at])
        staged = self._staged(args)
        self.kept: list[torch.Tensor] = []
        if self.source is not None:
            # a real pool keeps its segments while its graphs live: here the taken owners stay alive
            self.kept = list(self.source.owners.values())
            self._take(staged, args)
        return self.exe.run(staged, donate=frozenset(self.copied_at + self.taken))

    def _release(self, owners: list[torch.Tensor]) -> None:
        # the real graph lets go of its copied-out buffers (their memory stays in its pool, where a
        # backward recorded into it may write); here they stay owned, and a sharing backward's replay
        # overwrites them (below), so a copy-out that read them after it would show NaN
        self.released = list(owners)

    def _staged(self, args: list[Any]) -> list[Any]:
        staged = list(args)
        for i, buf in zip(self.copied_at, self.buffers, strict=True):
            staged[i] = buf
        return staged

    def _launch(self, args: list[Any]) -> None:
        for sharer in self.sharers:  # the forward writes where a sharing backward's gradients may lie
            _poison([o.value for o in sharer.outputs if o.kind == "pool"])
        fresh = self.exe.run(self._staged(args))[: self.exe.graph.user_outputs]  # writebacks done by run
        for out, value in zip(self.outputs, fresh, strict=True):
            if out.kind in ("pool", "copy"):
                _dense_part(out.value).copy_(_dense_part(value))
        _poison([args[i] for i in self.taken])  # the backward reused the saved activations' memory
        if self.source is not None:  # ... and the memory its forward copies out of
            _poison(getattr(self.source, "released", []))


def _poison(tensors: list[Any]) -> None:
    for t in tensors:
        if t.is_floating_point():
            _dense_part(t).fill_(float("nan"))


def _dense_part(t: Any) -> Any:
    """The elements an expanded (stride-0) tensor holds once: what a graph's kernel wrote."""
    return t[tuple(slice(0, 1) if st == 0 else slice(None) for st in t.stride())]


def emulate_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Training graphs on the CPU record and replay emulated CUDA graphs (undone by monkeypatch)."""

    def wrap(compiled: Any, training: Any) -> Any:
        if training is None or not isinstance(compiled, CompiledGraph):
            return compiled
        return ReplayGraph(compiled, training.role, set(range(training.visible)), training.static)

    monkeypatch.setattr(backend_module, "training_graph", wrap)
    monkeypatch.setattr(replay, "PinnedGraph", EmulatedGraph)
    monkeypatch.setattr(replay, "_capturing", lambda: False)
    monkeypatch.setattr(ReplayGraph, "_device_reason", staticmethod(lambda compiled: None))
