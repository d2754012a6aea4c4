"""Inference CUDA graphs (runtime/graphs.GraphRunner) emulated on any device, so that the graph path
of CompiledGraph (_replay, _record, the runner's slicing and instances) runs on the CPU.

A "recorded" instance runs the warm-up as _Instance does, then the plan once more on the static
inputs: its results stand in for the captured graph's buffers. A "replay" runs the plan on the
static inputs again and writes the results into those buffers. Everything else is the real code.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from streamfuse.runtime import compiled as compiled_module
from streamfuse.runtime import graphs
from streamfuse.runtime.compiled import CompiledGraph
from streamfuse.runtime.graphs import OutputGuard, _Instance


class EmulatedInstance(_Instance):
    warmups: ClassVar[list[list[torch.Tensor]]] = []
    """What each warm-up read: the static inputs' values (the test's record)."""

    def __init__(self, exe: Any, static_inputs: list[torch.Tensor], sources: Any = None, copied: Any = None):
        copied = list(range(len(static_inputs))) if copied is None else copied
        EmulatedInstance.warmups.append([t.clone() for t in static_inputs])
        with exe.writebacks_undone(static_inputs):
            for _ in range(2):
                exe.run(static_inputs)
            results = exe.run(static_inputs)  # the capture's buffers
        self.reserved_bytes = 0
        self._adopt(exe, results, static_inputs, copied)
        del results
        self.copy_nodes, self.exec, self.held = [], 0, []
        self.graph = SimpleNamespace(replay=lambda: _replay(self, exe, static_inputs))
        self.guard = OutputGuard(self.outputs)


def _replay(inst: EmulatedInstance, exe: Any, static_inputs: list[torch.Tensor]) -> None:
    fresh = exe.run(static_inputs)[: exe.graph.user_outputs]
    for j, value in enumerate(fresh):
        out = inst.outputs[j]
        if isinstance(out, torch.Tensor) and out.data_ptr() != value.data_ptr():
            for d in range(out.dim()):  # an expanded output (a broadcast view of a buffer): write each element once
                if out.stride(d) == 0 and out.shape[d] > 1:
                    out, value = out.narrow(d, 0, 1), value.narrow(d, 0, 1)
            out.copy_(value)


def emulate_graphs(monkeypatch: pytest.MonkeyPatch, compiled: CompiledGraph) -> None:
    """`compiled` records and replays emulated graphs (its device is the CPU)."""
    EmulatedInstance.warmups = []
    monkeypatch.setattr(graphs, "_Instance", EmulatedInstance)
    monkeypatch.setattr(compiled_module, "_capturing", lambda: False)
    monkeypatch.setattr(compiled_module, "graph_memory_limit", lambda device, fraction: float("inf"))
    monkeypatch.setattr(compiled_module, "_settle_generators", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    compiled.use_graphs = True
    compiled.graph_skip = None
