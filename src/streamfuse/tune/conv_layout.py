"""The memory layout each 2-D convolution runs in through cuDNN (Config.conv_layout).

cuDNN picks its engine from the layout. On the H200, a float32 5x5 convolution 64->16 channels at
56x56, batch 1, ran in NCHW as two layout transposes plus a 32 µs CUTLASS kernel, and in
channels_last as one 10.8 µs implicit-GEMM kernel; 1x1 and 3x3 were as fast either way
(benchmarks/probe_l2_conv.py, now in git history; docs/PERF.md session 10). So the layout is
measured, not guessed: "auto" times the convolution both ways on random inputs of its real shapes,
replayed from a CUDA graph, the channels_last way including its layout changes (and the weight's,
for a live parameter), and keeps channels_last only if it wins by Config.conv_layout_margin. The
result is cached in cache_dir/autotune.json beside the matmul tiles, keyed by device, shapes,
strides, convolution parameters, dtype and cuDNN's TF32 setting.

Only convolutions the step can convert safely qualify (`eligible`): 2-D, not transposed, input
and output contiguous NCHW as recorded, weight a graph constant. A model that is already
channels_last is left as recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from streamfuse.config import Config
from streamfuse.ir.graph import Graph, Node
from streamfuse.ir.indexing import contiguous_strides
from streamfuse.profile.timing import time_graph_us
from streamfuse.tune.autotune import load_cache, random_operand, store_cache

CONV = "aten.convolution.default"
Layout = Literal["native", "channels_last"]


@dataclass(frozen=True)
class ConvLayoutChoice:
    layout: Layout
    native_us: float | None = None
    """Measured µs of the convolution as recorded (None: not measured)."""
    channels_last_us: float | None = None
    reason: str = ""

    @property
    def measured_us(self) -> float | None:
        """Measured µs of the convolution in the chosen layout (None: not measured)."""
        return self.channels_last_us if self.layout == "channels_last" else self.native_us


def eligible(node: Node, graph: Graph) -> bool:
    """A 2-D convolution whose input and output are contiguous NCHW and whose weight is a constant."""
    if node.op != CONV or len(node.args) != 9 or node.kwargs or node.args[6] or len(node.shape) != 4:
        return False
    x, w = node.args[0], node.args[1]
    if not isinstance(x, Node) or not isinstance(w, Node) or w not in graph.constants:
        return False
    if node.dtype is None or not node.dtype.is_floating_point or len(x.shape) != 4 or len(w.shape) != 4:
        return False
    return all(_contiguous(n) for n in (x, w, node))


def _contiguous(n: Node) -> bool:
    """Contiguous in the recorded order (the stride of a dim of size 1 is free)."""
    return all(s == c for size, s, c in zip(n.shape, n.strides, contiguous_strides(n.shape), strict=True) if size > 1)


def choose_layout(node: Node, graph: Graph, config: Config, device: torch.device,
                  timer: Callable[[Callable[[], Any]], float] = time_graph_us,
                  convert_back: bool = True) -> ConvLayoutChoice:
    """The layout `node` runs in: Config.conv_layout, measured under "auto" on CUDA (see module doc).
    `convert_back`: the channels_last way converts its result back to NCHW (False where only
    generated kernels read it, runtime/steps.ChannelsLastConvStep), and is timed that way."""
    if config.conv_layout == "native" or not eligible(node, graph):
        return ConvLayoutChoice("native", reason="as recorded")
    if config.conv_layout == "channels_last":
        return ConvLayoutChoice("channels_last", reason="Config.conv_layout")
    if device.type != "cuda" or not config.autotune:
        return ConvLayoutChoice("native", reason="not measured: needs CUDA and Config.autotune")
    return measure_layout(node, graph, config, device, timer, convert_back)


def measure_layout(node: Node, graph: Graph, config: Config, device: torch.device,
                   timer: Callable[[Callable[[], Any]], float] = time_graph_us,
                   convert_back: bool = True, input_channels_last: bool = False) -> ConvLayoutChoice:
    """Both layouts timed with `timer` on random operands (or read from the cache), the faster kept.
    `input_channels_last`: the channels_last way gets its input already channels_last (written so by
    the kernel before it: tune/network_layout.py), so its time has no input conversion."""
    owned = node.args[1] in graph.snapshots
    key = (_key(node, device, owned) + ("" if convert_back else "|result kept channels_last")
           + ("|input channels_last" if input_channels_last else ""))
    cached = load_cache(config.cache_dir).get(key)
    if cached is None:
        try:
            times = _measure(node, device, owned, timer, convert_back, input_channels_last)
        except RuntimeError as e:  # cuDNN refused a layout: keep the recorded one
            return ConvLayoutChoice("native", reason=f"channels_last failed: {str(e).splitlines()[0][:80]}")
        if times is None:
            return ConvLayoutChoice("native", reason="channels_last result disagreed with NCHW")
        cached = {"native_us": times[0], "channels_last_us": times[1]}
        store_cache(config.cache_dir, key, cached)
    native_us, channels_last_us = cached["native_us"], cached["channels_last_us"]
    wins = channels_last_us < (1.0 - config.conv_layout_margin) * native_us
    return ConvLayoutChoice("channels_last" if wins else "native", native_us, channels_last_us, reason="measured")


def _measure(node: Node, device: torch.device, owned: bool, timer: Callable[[Callable[[], Any]], float],
             convert_back: bool = True, input_channels_last: bool = False) -> tuple[float, float] | None:
    """(NCHW µs, channels_last µs), or None if the two disagree by more than 1% of the result's scale."""
    cl = torch.channels_last
    with unset_fake_temporarily():
        args = [random_operand(a, device) if isinstance(a, Node) else a for a in node.args]
        weight = args[1].contiguous(memory_format=cl)
        x_cl = args[0].contiguous(memory_format=cl) if input_channels_last else None

        def native() -> Any:
            return node.target(*args)

        def channels_last() -> Any:
            a = list(args)
            a[0] = x_cl if x_cl is not None else a[0].contiguous(memory_format=cl)
            a[1] = weight if owned else a[1].contiguous(memory_format=cl)
            out = node.target(*a)
            return out.contiguous() if convert_back else out

        want = native().float()
        if (channels_last().float() - want).abs().max() > 1e-2 * want.abs().max().clamp_min(1e-6):
            return None
        return timer(native), timer(channels_last)


def _key(node: Node, device: torch.device, owned: bool) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    operands = ";".join(f"{list(a.shape)}/{list(a.strides)}/{a.dtype}" if isinstance(a, Node) else repr(a)
                        for a in node.args)
    tf32 = torch.backends.cudnn.allow_tf32
    return f"{name}|conv layout|{operands}|tf32={tf32}|owned={owned}"
