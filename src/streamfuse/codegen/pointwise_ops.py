"""Each pointwise aten op as a Triton expression over its (already loaded) operands.

Operands arrive as `Operand`s: a Triton expression with its compute dtype, or a Python
scalar. `emit_pointwise` casts them to the op's working type and returns the expression of
the result, in the node's compute dtype (see types.compute_dtype).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from streamfuse.codegen.types import TL_DTYPE, compute_dtype, literal
from streamfuse.ir.graph import Node
from streamfuse.ir.ops import packet_name

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
NAN_ALL = "propagate_nan=tl.PropagateNan.ALL"


@dataclass(frozen=True)
class Operand:
    text: str
    dtype: torch.dtype | None
    """Compute dtype of a tensor operand; None for a Python scalar."""

    @property
    def is_scalar(self) -> bool:
        return self.dtype is None


def scalar(value: object) -> Operand:
    return Operand(literal(value), None)


def cast(x: Operand, to: torch.dtype) -> str:
    if x.is_scalar:
        if to is torch.bool:
            return x.text
        if to in FLOATS and x.text in ("True", "False"):
            return "1.0" if x.text == "True" else "0.0"
        return x.text
    if x.dtype == to:
        return x.text
    if to is torch.bool:
        return f"({x.text} != 0)"
    return convert(x.text, x.dtype, to)


def convert(text: str, frm: torch.dtype, to: torch.dtype) -> str:
    """`text` (a value of dtype `frm`) as `to`. Integers, bools and float64 reach the half types
    through float32, as ATen converts them (c10::BFloat16 and Half are built from a float: a float64
    value is rounded to float32 first, as is a single-value float32 result computed in float64,
    pointwise_ops.single_value_float64); Triton's interpreter turns a direct int or float64 -> bf16
    cast into zeros."""
    if to in (torch.bfloat16, torch.float16) and (frm not in FLOATS or frm is torch.float64):
        return f"{text}.to(tl.float32).to({TL_DTYPE[to]})"
    return f"{text}.to({TL_DTYPE[to]})"


def _compare_type(ops: list[Operand]) -> torch.dtype:
    tensors = [o.dtype for o in ops if o.dtype is not None]
    result = tensors[0]
    for d in tensors[1:]:
        result = torch.promote_types(result, d)
    if result not in FLOATS and any(not o.is_scalar or "." in o.text or "float" in o.text
                                    for o in ops if o.is_scalar):
        result = torch.float32  # int tensor compared with a float literal
    return compute_dtype(result)


def _common_dtype(node: Node) -> torch.dtype | None:
    """torch.result_type of a binary op's two operands (Nodes or Python scalars), None if unknown."""
    def probe(a: Any) -> Any:
        if isinstance(a, Node):
            return torch.empty((1,) * len(a.shape) if a.shape else (), dtype=a.dtype) if a.dtype else None
        return a if isinstance(a, (bool, int, float)) else None

    operands = [probe(a) for a in node.args[:2]]
    if len(operands) != 2 or any(o is None for o in operands):
        return None
    if not any(isinstance(o, torch.Tensor) for o in operands):
        return None
    return torch.result_type(*operands)


def _tanh(x: str, target: str) -> str:
    if target == "cuda":
        return f"libdevice.tanh({x})"
    return f"(2.0 * tl.sigmoid(2.0 * {x}) - 1.0)"  # the interpreter has no libdevice


def _pow(x: str, p: float) -> str:
    table = {2.0: f"({x} * {x})", 3.0: f"({x} * {x} * {x})", 4.0: f"({x} * {x} * {x} * {x})",
             0.5: f"tl.sqrt({x})", -0.5: f"tl.rsqrt({x})", -1.0: f"(1.0 / {x})",
             -2.0: f"(1.0 / ({x} * {x}))", 1.0: x,
             0.0: f"(tl.zeros_like({x}) + 1)"}  # 1 for every x, inf and NaN included (x * 0 + 1 is NaN)
    return table[float(p)]


def _clamp(x: str, lo: str | None, hi: str | None, floating: bool) -> str:
    nan = f", {NAN_ALL}" if floating else ""
    if lo is not None and lo != "None":
        x = f"tl.maximum({x}, {lo}{nan})"
    if hi is not None and hi != "None":
        x = f"tl.minimum({x}, {hi}{nan})"
    return x


def _kw(node: Node, name: str, pos: int, default: Any) -> Any:
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


_WIDENED = frozenset({"add", "sub", "rsub", "mul", "div", "neg", "reciprocal", "sqrt", "pow"})


def single_value_float64(node: Node) -> bool:
    """A float32 arithmetic op on single values (every tensor operand holds one element) is computed
    in float64 and rounded once where its value is stored or meets a larger tensor, and where any op
    that is not widened reads it (a comparison, a cast: kernel.py `_rounded`). Such chains are
    scalar bookkeeping, above all an optimizer's bias corrections: eager Adam computes
    `1 - beta2 ** step` in Python floats (double), a traced step in float32 tensors, where the
    cancellation costs ~1e-5 relative (issue 16 asks for 1e-6 of eager: run 63, 3.9e-6 for both
    torch.compile and streamfuse). In float64 the rounded result is eager's double rounded once."""
    if node.dtype is not torch.float32 or math.prod(node.shape) != 1 or packet_name(node.op) not in _WIDENED:
        return False
    return all(math.prod(a.shape) == 1 for a in node.args if isinstance(a, Node))


def emit_pointwise(node: Node, args: list[Any], target: str, wide: torch.dtype | None = None) -> str:
    """Expression for `node` given `args` (node.args with tensors replaced by Operands), computed in
    `wide` if given, else in the node's compute dtype."""
    name = packet_name(node.op)
    out = wide or (compute_dtype(node.dtype) if node.dtype is not None else torch.float32)
    floating = out in FLOATS
    ops = [a for a in args if isinstance(a, Operand)]

    def t(i: int, to: torch.dtype = out) -> str:
        a = args[i]
        return cast(a if isinstance(a, Operand) else scalar(a), to)

    if name in ("scalar_tensor", "full"):
        value = args[0] if name == "scalar_tensor" else args[1]
        # a 0-d value, like a load of a 0-d input: it broadcasts against any rank (a [1] block does not
        # broadcast_to the [BLOCK_M, BLOCK_R] of a reduction kernel: long CPU fuzz, session 17)
        return f"tl.full([], {literal(value)}, {TL_DTYPE[out]})"
    if name in _COMPARE:
        work = _compare_type(ops + [scalar(a) for a in args[1:2] if not isinstance(a, Operand)])
        common = _common_dtype(node)
        if common in (torch.float16, torch.bfloat16):
            # ATen compares in the operands' common dtype, with a Python scalar converted to it:
            # x_fp16 > 0.3 compares with fp16(0.3) = 0.30005, and a value computed here in float32
            # compares as its fp16 rounding. Round both sides, then compare exactly in float32.
            def side(i: int) -> str:
                a = args[i]
                if not isinstance(a, Operand):
                    return literal(float(torch.tensor(a, dtype=common).float()))
                return f"{cast(a, common)}.to({TL_DTYPE[work]})"
            return f"({side(0)} {_COMPARE[name]} {side(1)})"
        return f"({t(0, work)} {_COMPARE[name]} {t(1, work)})"
    if name in _LOGICAL:
        return _LOGICAL[name]([t(i, torch.bool) for i in range(len(args))])
    if name in _BITWISE:  # bool or integer operands in the result's dtype (ATen's promotion)
        return f"({t(0)} {_BITWISE[name]} {t(1)})"
    if name == "bitwise_not":
        if out is torch.bool:
            return f"({t(0)} == 0)"
        return f"({t(0)} ^ {255 if out is torch.uint8 else -1})"  # all bits flipped (Triton's ~ on uint8 fails in the interpreter)
    if name in ("_to_copy", "clone", "alias"):
        src, src_node = args[0], node.args[0]
        assert isinstance(src, Operand) and isinstance(src_node, Node)
        if node.dtype is torch.bool:
            return cast(src, torch.bool)
        if node.dtype == out or src_node.dtype == node.dtype:
            return cast(src, out)
        return f"{cast(src, node.dtype)}.to({TL_DTYPE[out]})"  # round to the narrow type, compute wide
    if name in ("add", "sub", "rsub"):
        alpha = node.kwargs.get("alpha", 1)
        b = t(1) if alpha == 1 else f"{t(1)} * {literal(alpha)}"
        return {"add": f"({t(0)} + {b})", "sub": f"({t(0)} - {b})", "rsub": f"({b} - {t(0)})"}[name]
    if name == "where":
        return f"tl.where({t(0, torch.bool)}, {t(1)}, {t(2)})"
    if name == "masked_fill":
        return f"tl.where({t(1, torch.bool)}, {t(2)}, {t(0)})"
    if name in ("clamp", "clamp_min", "clamp_max", "hardtanh"):
        x = t(0)
        if name == "clamp":
            lo = t(1) if len(args) > 1 and args[1] is not None else None
            hi = t(2) if len(args) > 2 and args[2] is not None else None
        elif name == "hardtanh":
            lo, hi = literal(_kw(node, "min_val", 1, -1.0)), literal(_kw(node, "max_val", 2, 1.0))
        else:
            lo, hi = (t(1), None) if name == "clamp_min" else (None, t(1))
        return _clamp(x, lo, hi, floating)
    if name in ("maximum", "minimum"):
        fn = "tl.maximum" if name == "maximum" else "tl.minimum"
        nan = f", {NAN_ALL}" if floating else ""
        return f"{fn}({t(0)}, {t(1)}{nan})"
    if name == "pow":
        if not isinstance(args[0], Operand):  # float b > 0 ** tensor (ir/ops.refine_kind)
            if target == "cuda":  # powf (1-2 ulp): 1 - beta2 ** step amplifies any error ~1000x
                return f"libdevice.pow(tl.zeros_like({t(1)}) + {literal(float(args[0]))}, {t(1)})"
            return f"tl.exp2({t(1)} * {literal(math.log2(float(args[0])))})"  # the interpreter has no libdevice
        return _pow(t(0), float(args[1]))
    if name == "gelu":
        x = t(0)
        if node.kwargs.get("approximate", "none") == "tanh":
            inner = f"0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})"
            return f"(0.5 * {x} * (1.0 + {_tanh(inner, target)}))"
        return f"(0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476)))"
    if name == "leaky_relu":
        slope = literal(float(_kw(node, "negative_slope", 1, 0.01)))
        return f"tl.where({t(0)} > 0, {t(0)}, {t(0)} * {slope})"
    if name == "tanh":
        return _tanh(t(0), target)
    if name in ("floor", "ceil") and not floating:
        return t(0)
    if name in _UNARY:
        return _UNARY[name](t(0))
    if name in _BINARY:
        return f"({t(0)} {_BINARY[name]} {t(1)})"
    raise NotImplementedError(f"no Triton expression for {node.op}")


_COMPARE = {"eq": "==", "ne": "!=", "gt": ">", "ge": ">=", "lt": "<", "le": "<="}
_BINARY = {"mul": "*", "div": "/"}
_LOGICAL: dict[str, Callable[[list[str]], str]] = {
    "logical_not": lambda a: f"({a[0]} == 0)",
    "logical_and": lambda a: f"({a[0]} & {a[1]})",
    "logical_or": lambda a: f"({a[0]} | {a[1]})",
}
_BITWISE = {"bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^"}
_UNARY: dict[str, Callable[[str], str]] = {
    "neg": lambda x: f"(-{x})",
    "abs": lambda x: f"tl.abs({x})",
    "exp": lambda x: f"tl.exp({x})",
    "exp2": lambda x: f"tl.exp2({x})",
    "log": lambda x: f"tl.log({x})",
    "log2": lambda x: f"tl.log2({x})",
    "sqrt": lambda x: f"tl.sqrt({x})",
    "rsqrt": lambda x: f"tl.rsqrt({x})",
    "reciprocal": lambda x: f"(1.0 / {x})",
    "sigmoid": lambda x: f"tl.sigmoid({x})",
    "erf": lambda x: f"tl.erf({x})",
    "relu": lambda x: f"tl.where({x} < 0, 0, {x})",
    "silu": lambda x: f"({x} * tl.sigmoid({x}))",
    "sin": lambda x: f"tl.sin({x})",
    "cos": lambda x: f"tl.cos({x})",
    "floor": lambda x: f"tl.floor({x})",
    "ceil": lambda x: f"tl.ceil({x})",
}
