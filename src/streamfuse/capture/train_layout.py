"""Channels_last convolutions in training graphs (Config.train_channels_last).

cuDNN runs float32/TF32 and half-precision 2-D convolutions on Hopper in NHWC: given NCHW
tensors, each convolution, and each of its two backward convolutions, converts its input, its
weight and its result between layouts in kernels of their own (run 195, resnet50 b32 training on
an H100: `nchwToNhwc`/`nhwcToNchw` took 2.16 ms of a 16.8 ms step). Inductor runs such a network
channels_last throughout.

Here the graph Dynamo hands the backend is rewritten before AOTAutograd traces it: each 2-D
convolution reads `x.contiguous(memory_format=torch.channels_last)` and the same of its weight.
AOTAutograd then traces the whole training step in that layout: a convolution's result is
channels_last, the pointwise kernels and reductions after it keep the layout (their recorded
strides, which the generated kernels store), the saved activations are channels_last, and so are
the gradients reaching the backward convolutions. What is left to convert each step is the input
image once and the weights (a copy of each parameter forward, and of its gradient backward).

A graph output is returned in the layout eager gives it: a 4-D result that was contiguous in
Dynamo's trace is made contiguous again (one copy), so no caller sees other strides than eager's.

Not rewritten: graphs that train nothing (an inference graph keeps its weights as constants and
chooses layouts by measurement, tune/network_layout.py), and graphs with a grouped convolution,
depthwise ones included (cuDNN's grouped kernels are slower in channels_last, as Inductor's layout
heuristic also found; a network mixing layouts would convert between them). Depthwise: on an H100
(run 204, batch 32) efficientnet_b0's step went from 12.76 to 17.07 ms with the layout, where
mobilenet_v3_small gained 1.7%, resnet50 7.6% and googlenet 3.3%.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def example_value(node: Any) -> Any:
    """The value Dynamo recorded for an FX node (a fake tensor, an int, ...), None for a non-node."""
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def _convolutions(gm: torch.fx.GraphModule) -> list[torch.fx.Node] | None:
    """The graph's 2-D convolutions over 4-D floating tensors, or None where a grouped convolution
    (depthwise included) rules the layout out."""
    convs = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not torch.conv2d or len(n.args) < 2:
            continue
        x, w = example_value(n.args[0]), example_value(n.args[1])
        if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() != 4 or w.dim() != 4:
            continue
        if not x.dtype.is_floating_point:
            continue
        groups = n.args[6] if len(n.args) > 6 else n.kwargs.get("groups", 1)
        if not isinstance(groups, int) or groups > 1:
            return None
        convs.append(n)
    return convs


def trains(example_inputs: Sequence[Any]) -> bool:
    """The graph is traced for a backward: grad mode is on and some input requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def channels_last_training(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Rewrite `gm` in place as the module doc says; returns the convolutions rewritten (0: untouched)."""
    if not trains(example_inputs):
        return 0
    convs = _convolutions(gm)
    if not convs:
        return 0
    graph = gm.graph
    converted: dict[torch.fx.Node, torch.fx.Node] = {}
    for conv in convs:
        args = list(conv.args)
        for i in (0, 1):
            src = args[i]
            if src not in converted:  # convolutions come in order: the first reader dominates the rest
                with graph.inserting_before(conv):
                    converted[src] = graph.call_method("contiguous", (src,), {"memory_format": torch.channels_last})
            args[i] = converted[src]
        conv.args = tuple(args)
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        output.args = (torch.fx.map_arg(output.args[0], _eager_layout(graph)),)
    graph.lint()
    gm.recompile()
    return len(convs)


def _eager_layout(graph: torch.fx.Graph) -> Any:
    """A graph output contiguous in Dynamo's trace, 4-D and floating, made contiguous again."""
    def restore(node: torch.fx.Node) -> torch.fx.Node:
        value = example_value(node)
        if (isinstance(value, torch.Tensor) and value.dim() == 4 and value.dtype.is_floating_point
                and value.is_contiguous() and not value.is_contiguous(memory_format=torch.channels_last)):
            return graph.call_method("contiguous", (node,))
        return node
    return restore
