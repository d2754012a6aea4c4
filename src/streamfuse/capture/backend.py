"""torch.compile(model, backend="streamfuse"): Dynamo graph -> AOTAutograd aten graphs -> streamfuse.

AOTAutograd hands forward (and, when training, backward) aten graphs to the same compiler,
so backward graphs arrive the same way as forward ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd

from streamfuse.capture.decomp import decomposition_table
from streamfuse.config import Config
from streamfuse.ir.from_fx import graph_from_fx
from streamfuse.runtime.compiled import CompiledGraph, build
from streamfuse.runtime.executable import graph_device

compiled_graphs: list[CompiledGraph] = []
"""The graphs compiled through the backend in this process, newest last (for explain/tests)."""


def _compiler(config: Config) -> Any:
    def compile_aten_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graph = graph_from_fx(gm)
        compiled = build(graph, config, graph_device(graph, example_inputs))
        compiled_graphs.append(compiled)

        def run(args: list[Any]) -> list[Any]:
            return compiled.run_flat(args)

        run._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd passes the args list itself
        return run

    return compile_aten_graph


def make_backend(config: Config | None = None) -> Any:
    """A torch.compile backend with a given Config: torch.compile(m, backend=make_backend(cfg))."""
    compiler = _compiler(config or Config())
    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, decompositions=decomposition_table())


def streamfuse_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
    """The backend registered as "streamfuse" (default Config)."""
    return make_backend()(gm, example_inputs, **kwargs)


def register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "streamfuse" not in _BACKENDS or _BACKENDS.get("streamfuse") is None:
        register_backend(compiler_fn=streamfuse_backend, name="streamfuse")
