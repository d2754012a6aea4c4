"""The op-kind table (fusion legality classes, after TVM's FuseOps and XLA).

Keys are aten overload packets ("aten.add"); an overload ("aten.add.Tensor") takes its
packet's kind unless listed itself. Anything absent is OPAQUE: it runs through ATen, and a
model never fails to compile because of it.
"""

from __future__ import annotations

import enum

import torch


class OpKind(enum.Enum):
    INPUT = "input"
    POINTWISE = "pointwise"
    BROADCAST = "broadcast"
    VIEW = "view"
    REDUCTION = "reduction"
    CONTRACTION = "contraction"
    OPAQUE = "opaque"
    GETITEM = "getitem"
    CONCAT = "concat"
    """torch.cat: each output element is one input's element, picked by its index along `dim`
    (generated as masked loads and a select, so producers and consumers fuse through it)."""
    WINDOW = "window"
    """2-D max or average pooling: each output element is the max or mean of a small window of its
    input, read by shifted loads masked at the borders (ir/lowerings.py lowers max_pool2d when its
    indices are unused, avg_pool2d when every window has the same divisor)."""
    GATHER = "gather"
    """aten.embedding: each output row is a row of the table (a 2-D input read from memory) at an index
    loaded from the index tensor at the row's own position, so the lookup fuses into the kernel that
    adds the embeddings and normalizes them (codegen/gather.py)."""

    @property
    def fusible(self) -> bool:
        return self in (OpKind.POINTWISE, OpKind.BROADCAST, OpKind.VIEW, OpKind.REDUCTION, OpKind.CONCAT,
                        OpKind.WINDOW, OpKind.GATHER)

    @property
    def gathers(self) -> bool:
        """Reads its input at indices other than its own (a shifted or offset position)."""
        return self in (OpKind.CONCAT, OpKind.WINDOW, OpKind.GATHER)


_POINTWISE = ["add", "sub", "rsub", "mul", "div", "neg", "abs", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "reciprocal", "sigmoid", "tanh", "erf", "relu", "gelu", "silu", "sin", "cos", "floor", "ceil", "maximum", "minimum", "clamp", "clamp_min", "clamp_max", "where", "masked_fill", "pow", "eq", "ne", "gt", "ge", "lt", "le", "logical_not", "logical_and", "logical_or", "bitwise_not", "bitwise_and", "bitwise_or", "bitwise_xor", "_to_copy", "clone", "alias", "leaky_relu", "hardtanh", "scalar_tensor", "full"]

_VIEW = ["view", "_unsafe_view", "reshape", "permute", "transpose", "t", "unsqueeze", "squeeze", "slice", "select"]

# Views with several results (read through getitem): zero-copy, run on the host.
MULTI_VIEWS = frozenset({"aten.split", "aten.split_with_sizes", "aten.unbind", "aten.chunk", "aten.tensor_split"})

_BROADCAST = ["expand"]

_REDUCTION = ["sum", "mean", "amax", "amin", "var"]

_CONTRACTION = ["mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "convolution", "_convolution"]

OP_KINDS: dict[str, OpKind] = {
    **{f"aten.{n}": OpKind.POINTWISE for n in _POINTWISE},
    **{f"aten.{n}": OpKind.VIEW for n in _VIEW},
    **{f"aten.{n}": OpKind.BROADCAST for n in _BROADCAST},
    **{f"aten.{n}": OpKind.REDUCTION for n in _REDUCTION},
    **{f"aten.{n}": OpKind.CONTRACTION for n in _CONTRACTION},
    **{n: OpKind.VIEW for n in MULTI_VIEWS},
    "aten.cat": OpKind.CONCAT,
    "streamfuse.philox_rand": OpKind.POINTWISE,  # counter-based: a pure function of its index (ir/rng.py)
    "streamfuse.max_pool2d": OpKind.WINDOW,
    "streamfuse.avg_pool2d": OpKind.WINDOW,
    "aten.embedding": OpKind.GATHER,
}

# Overloads whose semantics differ from the packet's default and that v1 does not generate.
OPAQUE_OVERLOADS = frozenset(
    {
        "aten.div.Tensor_mode",  # floor/trunc rounding
        "aten.div.Scalar_mode",
        "aten.sum.default",  # full reduction to a scalar: ATen's tree reduction is better
        "aten.pow.Tensor_Tensor",
        "aten.copy.default",  # copy_ into an existing buffer (mutation)
    }
)


def kind_of(qualified_name: str) -> OpKind:
    """Kind of an overload given as "aten.add.Tensor"."""
    if qualified_name in OPAQUE_OVERLOADS:
        return OpKind.OPAQUE
    packet = qualified_name.rsplit(".", 1)[0] if qualified_name.count(".") >= 2 else qualified_name
    return OP_KINDS.get(packet, OpKind.OPAQUE)


def packet_name(qualified_name: str) -> str:
    """"aten.add.Tensor" -> "add"."""
    parts = qualified_name.split(".")
    return parts[1] if len(parts) >= 2 else qualified_name


def refine_kind(qualified_name: str, kind: OpKind, args: tuple, kwargs: dict) -> OpKind:
    """Argument-dependent exceptions to the table: cases the generated code does not cover."""
    name = packet_name(qualified_name)
    if name == "pow" and kind is OpKind.POINTWISE:
        base = args[0] if args else kwargs.get("self")
        if isinstance(base, int | float):  # pow.Scalar: number ** tensor
            # a float b > 0 ** tensor (optimizers' bias corrections, beta ** step): codegen's pow, or
            # exp2(e * log2(b)) in Triton's interpreter (codegen/pointwise_ops.py)
            return OpKind.POINTWISE if isinstance(base, float) and base > 0 else OpKind.OPAQUE
        exponent = args[1] if len(args) > 1 else kwargs.get("exponent")
        if not (isinstance(exponent, (int, float)) and float(exponent) in POW_FAST_EXPONENTS):
            return OpKind.OPAQUE
    if name in ("_to_copy", "clone") and kind is OpKind.POINTWISE:
        if kwargs.get("device") is not None:
            return OpKind.OPAQUE  # a device move is a copy ATen does best
        layout = kwargs.get("memory_format")
        if layout not in (None, torch.contiguous_format, torch.channels_last):
            # preserve_format: the strides follow the input's, which need not be dense. A
            # channels_last copy (training convolutions' weights, capture/train_layout.py) is a
            # generated kernel storing the traced strides (codegen/kernel.store_strides)
            return OpKind.OPAQUE
    return kind


POW_FAST_EXPONENTS = frozenset({-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0, 4.0})
