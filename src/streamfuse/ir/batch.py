"""Batch independence: may the batch be padded up to a bucket without changing the real rows?

Padding is safe when every output row block depends only on the input rows of the same batch
element. The analysis tracks, per node, either CONST (does not depend on the batch: weights and
what is computed from them alone) or ("rows", k): dim 0 has size B*k and each block of k rows
belongs to one batch element. Anything it cannot prove returns a reason instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from streamfuse.ir.graph import Graph, Node
from streamfuse.ir.ops import OpKind, packet_name

CONST = "const"


@dataclass(frozen=True)
class Rows:
    k: int
    """Rows of dim 0 per batch element."""
    iota: bool = False
    """The values are the batch element's own index (torch.arange(batch), possibly reshaped): as an
    index along dim 0 it selects each element's own rows."""


State = str | Rows

CONST_IOTA = "const-iota"
"""A constant that holds torch.arange(batch), or a view of one with every other dim of size 1. It
is a constant like any other (CONST) except as an index along dim 0 (`_index`), where it selects each
batch element's own rows. Captures fold `torch.arange(x.shape[0])` into such a constant (transformers'
attention-mask builders index the padding mask by it: session 40's HF sweep). Whether it follows the
batch, rather than being a fixed table that equals arange(batch) by chance, is left to the batch
check, which captures the model at a second batch size: `batch_signature` writes such a constant as
an arange where it is an index's first index, and `differs_beyond_batch` refuses one of length batch
that keeps its length at the other batch (a fixed table: eager would index past the rows of a
smaller batch)."""

# Ops that map over dim 0: each batch element's result comes from that element's rows alone, when
# their batch-carrying inputs have the batch at dim 0 (weights and index tables are constants).
_ROW_WISE = {
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution",
    "max_pool2d_with_indices", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d",
    "upsample_nearest2d", "upsample_bilinear2d", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "scaled_dot_product_attention", "embedding",
    "native_group_norm", "native_layer_norm", "_native_batch_norm_legit_no_training", "tril", "triu",
    "lift_fresh_copy", "clone", "alias", "_to_copy", "copy",
}
# Ops that work along the dims their `dim` (or `dims`) argument names and map over every other dim:
# reductions, scans, sorts, selections along a dim, concatenation and splitting. Rows stay
# independent exactly when the batch dim is not among those dims; the argument is read by name
# from the op's schema, its default where the call leaves it out (None or [] means every dim).
_ALONG_DIMS = {
    "any", "all", "sum", "mean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "logsumexp", "norm",
    "linalg_vector_norm", "std", "var", "std_mean", "var_mean", "count_nonzero", "_softmax", "_log_softmax",
    "softmax", "log_softmax", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "sort", "argsort", "topk",
    "kthvalue", "median", "mode", "flip", "roll", "gather", "scatter", "scatter_add", "scatter_reduce",
    "index_select", "index_add", "index_copy", "index_fill", "glu", "diff", "cat", "split", "split_with_sizes",
    "unbind", "chunk", "narrow",
}


def _dims(n: Node) -> list[int] | None:
    """The dims `n` works along (normalized), read from its `dim`/`dims` argument; None for every dim."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return None
    for pos, arg in enumerate(schema.arguments):
        if arg.name not in ("dim", "dims"):
            continue
        value = n.kwargs[arg.name] if arg.name in n.kwargs else n.args[pos] if pos < len(n.args) else \
            arg.default_value if arg.has_default_value() else None
        if value is None or value == []:
            return None
        src = n.args[0]
        # a list (cat): its rank is the largest operand's, since cat skips 1-D empty tensors (a KV
        # cache's first append, cat([empty [0], x], dim=-2), read as the batch dim with the empty one's
        # rank: OPT, Bloom, Falcon and GPT-NeoX lost their padding)
        operands = [a for a in src if isinstance(a, Node)] if isinstance(src, (list, tuple)) else [src]
        rank = max([len(a.shape) for a in operands if isinstance(a, Node)] + [1])
        return [d % rank for d in ([value] if isinstance(value, int) else list(value))]
    return None


def batch_rows(graph: Graph, follows: frozenset[Node] = frozenset()) -> dict[Node, State] | str:
    """Per-node batch state, or the reason the graph's rows are not provably independent.
    `follows`: nodes whose dim 0 the comparison with a capture at another batch size saw follow the
    batch (`batch_sized`). One of them made from no batch-carrying operand (`torch.zeros_like(x)`,
    `torch.ones(x.shape[0], n)`: the trace made the size a number) holds rows of the batch, not a
    constant: padded, it grows with the bucket, so it is sliced like any batch output, and a sum over
    it (`ones_like(x).sum()`) counts the padding rows, which the reduction rule refuses."""
    if not graph.inputs:
        return "the graph has no inputs"
    batch = graph.inputs[0].shape[0] if graph.inputs[0].shape else None
    if not batch:
        return "the first input has no leading batch dimension"
    state: dict[Node, State] = {}
    for n in graph.inputs:
        if not n.shape or n.shape[0] != batch:
            return f"input %{n.name} has shape {list(n.shape)}: every input must have the batch ({batch}) at dim 0"
        state[n] = Rows(1)
    for n, value in graph.constants.items():
        state[n] = CONST_IOTA if n.shape == (batch,) and _is_arange(value) else CONST
    for n in graph.ops():
        result = _transfer(n, state, batch, follows)
        if isinstance(result, tuple):
            return f"%{n.name} ({n.op}): {result[0]}"
        state[n] = result
    for o in graph.output_nodes:
        if o not in state:
            return f"output %{o.name} is not computed by the graph"
    return state


def _transfer(n: Node, state: dict[Node, State], batch: int, follows: frozenset[Node]) -> State | tuple[str]:
    ins = [state[a] for a in n.input_nodes() if a in state]
    rows = [s for s in ins if isinstance(s, Rows)]
    if not rows:
        if _is_batch_arange(n, batch):
            return Rows(1, iota=True)
        if _iota_view(n, state, batch):
            return CONST_IOTA
        if n in follows and n.is_tensor and n.shape and n.shape[0] % batch == 0:
            return Rows(n.shape[0] // batch)
        src = n.args[0] if n.args else None
        if packet_name(n.op) == "expand" and isinstance(src, Node) and n.shape and n.shape[0] % batch == 0 \
                and (len(src.shape) < len(n.shape) or src.shape[0] != n.shape[0]):
            return Rows(n.shape[0] // batch)  # a constant broadcast to the batch: trivially independent rows
        return CONST
    if n.kind is OpKind.GETITEM:
        return rows[0]
    name = packet_name(n.op)
    if n.kind in (OpKind.POINTWISE, OpKind.BROADCAST) or _tagged_pointwise(n):
        for a in n.input_nodes():
            if isinstance(state.get(a), Rows) and (len(a.shape) != len(n.shape) or a.shape[0] != n.shape[0]):
                return ("a batch-carrying operand is broadcast along dim 0",)
        if len({s.k for s in rows}) > 1:
            return ("operands group dim 0 differently",)
        return Rows(rows[0].k)
    if name == "index":
        return _index(n, state)
    if n.kind is OpKind.REDUCTION or name in _ALONG_DIMS:
        dims = _dims(n)
        if dims is None or 0 in dims:
            return ("reduces over the batch dimension",) if n.kind is OpKind.REDUCTION else \
                ("works along the batch dimension",)
        if len({s.k for s in rows}) > 1:
            return ("operands group dim 0 differently",)
        if n.is_tensor and (not n.shape or n.shape[0] % batch):
            return ("result has no batch at dim 0",)
        return rows[0]
    if n.kind is OpKind.VIEW:
        return _view(n, rows[0], batch)
    if name == "constant_pad_nd":  # pads the last len(pad) // 2 dims
        pad = n.args[1] if len(n.args) > 1 else n.kwargs.get("pad", [])
        src = n.args[0]
        if not isinstance(src, Node):
            return ("pads the batch dimension",)
        first = 2 * (len(src.shape) - 1)  # pad lists (before, after) pairs from the last dim back: dim 0's pair
        if len(pad) // 2 < len(src.shape) or all(isinstance(p, int) and p == 0 for p in pad[first:first + 2]):
            return rows[0]
        return ("pads the batch dimension",)
    if name in _ROW_WISE:
        if not n.is_tensor:  # several results (read through getitem): each has the batch at dim 0
            return rows[0]
        return rows[0] if n.shape and n.shape[0] % batch == 0 else ("result has no batch at dim 0",)
    return ("opaque op: rows are not known to be independent",)


def _tagged_pointwise(n: Node) -> bool:
    """ATen marks elementwise ops with torch.Tag.pointwise (bitwise ops, comparisons, ...): they map
    over every dim, whatever streamfuse's fusion table says about generating them."""
    return torch.Tag.pointwise in getattr(n.target, "tags", ())


def _is_arange(value: Any) -> bool:
    """A real 1-D integer tensor holding 0, 1, ..., len - 1."""
    from torch._subclasses.fake_tensor import is_fake

    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.is_floating_point() \
            or value.is_complex() or value.dtype is torch.bool or value.is_meta or is_fake(value):
        return False
    return bool(torch.equal(value.detach().cpu(), torch.arange(value.numel(), dtype=value.dtype)))


_IOTA_RESHAPES = ("unsqueeze", "view", "_unsafe_view", "reshape", "alias")
_IOTA_VIEWS = (*_IOTA_RESHAPES, "expand")
"""Views that keep a CONST_IOTA constant's values along dim 0 (reshapes to (batch, 1, ..., 1), and
expands of those)."""


def _iota_view(n: Node, state: dict[Node, State], batch: int) -> bool:
    """A view of a CONST_IOTA constant that keeps the arange along dim 0: unsqueeze, view or
    reshape to (batch, 1, ..., 1), or an expand of such a view over its size-1 dims."""
    src = n.args[0] if n.args else None
    if not isinstance(src, Node) or state.get(src) != CONST_IOTA or not n.shape or n.shape[0] != batch:
        return False
    name = packet_name(n.op)
    if name in _IOTA_RESHAPES:
        return all(d == 1 for d in n.shape[1:])
    return name == "expand" and len(src.shape) == len(n.shape)


def _is_batch_arange(n: Node, batch: int) -> bool:
    """torch.arange(batch) (start 0, step 1): each value is its own position along dim 0."""
    if packet_name(n.op) != "arange" or n.shape != (batch,):
        return False
    numbers = [a for a in n.args if isinstance(a, (int, float))]
    start, step = (numbers[0], numbers[2] if len(numbers) > 2 else 1) if len(numbers) > 1 else (0, 1)
    return start == 0 and step == 1


def _index(n: Node, state: dict[Node, State]) -> State | tuple[str]:
    """aten.index.Tensor (advanced indexing, self[i0, i1, ...]): rows stay independent where dim 0 is
    either not indexed (then the indexed dims must be adjacent, so the result keeps dim 0 first) or
    indexed by the batch's own positions (Rows.iota, CONST_IOTA) with the other indices constant or
    one row per batch element."""
    src, indices = n.args[0], list(n.args[1]) if len(n.args) > 1 else []
    src_state = state.get(src) if isinstance(src, Node) else None
    used = [i for i, x in enumerate(indices) if x is not None]
    others = [state.get(indices[i]) for i in used if i != 0]
    first = state.get(indices[0]) if indices and indices[0] is not None else None
    if isinstance(src_state, Rows) and src_state.k == 1 and (first == CONST_IOTA or isinstance(first, Rows) and first.iota):
        # self[arange(B)[:, None], j] with j constant or one index row per batch element (CLIP's pooling,
        # x[arange(B), ids.argmax(-1)]): element b reads its own row. The indices broadcast from the
        # right, so none may have more dims than the batch's positions, and one that carries the
        # batch needs as many (its dim 0 is then the batch's).
        rank = len(indices[0].shape)
        if all(len(indices[i].shape) <= rank and (not isinstance(state.get(indices[i]), Rows) or (
                state[indices[i]].k == 1 and len(indices[i].shape) == rank)) for i in used):
            return Rows(1)
        return ("indexes the batch dimension with indices that move it",)
    if not isinstance(src_state, Rows) or any(isinstance(o, Rows) for o in others):
        return ("indexes with tensors that carry the batch",)
    if not used:
        return src_state
    if indices[0] is None:
        if used != list(range(used[0], used[-1] + 1)):
            return ("non-adjacent advanced indices move the result's dims",)
        return Rows(src_state.k)
    return ("indexes the batch dimension",)


def _view(n: Node, src_state: Rows, batch: int) -> State | tuple[str]:
    name = packet_name(n.op)
    src = n.args[0]
    assert isinstance(src, Node)
    if not n.is_tensor:  # split / unbind / chunk: handled by the dim rule when listed
        return ("multi-result view",)
    if name in ("view", "_unsafe_view", "reshape", "unsqueeze", "squeeze"):
        # a row-major reshape keeps each batch element's elements contiguous; output rows stay
        # inside one element exactly when dim 0 is a multiple of the batch
        if n.shape and n.shape[0] % batch == 0 and n.shape[0] >= batch:
            k = n.shape[0] // batch
            return Rows(k, iota=src_state.iota and k == 1 and src_state.k == 1)
        return ("reshape moves the batch out of dim 0",)
    if name in ("permute", "transpose", "t"):
        from streamfuse.ir.indexing import permutation

        return src_state if permutation(n)[0] == 0 else ("permutes the batch dimension away from dim 0",)
    if name in ("slice", "select"):
        dim = n.args[1] if len(n.args) > 1 else 0
        return src_state if dim % len(src.shape) != 0 else ("slices the batch dimension",)
    if name == "expand":
        return src_state if src.shape and src.shape[0] == n.shape[0] else ("expands along dim 0",)
    return ("view not analysed",)


# -- the same function of the batch ---------------------------------------------------------------
# The analysis above proves that rows do not mix; it cannot see a batch size that the trace turned
# into a number (`x * x.shape[0]`, `x.sum(1) / x.numel()`, `expand(-1, x.shape[0], -1)`): at the
# compiled batch the graph holds a literal, and padded rows would be computed with the bucket's
# value (the session-27 CPU sweep: errors of 1.5 at batch 3 of a batch-4 plan). So the model is also
# traced at a second batch size, and the two graphs must differ only where the batch is a size:
# dim 0 of every node (scaled alike), the first entry of a size list, arange's bounds.

_BATCH_ARGUMENTS = {"native_group_norm": (3,)}
"""Ops that take the batch size itself as a plain int argument (by position): native_group_norm's N
(GroupNorm normalizes each sample alone; poolformer lost its padding to this)."""

NodeSig = tuple[str, tuple[int, ...], str, Any, Any]
"""(op, shape, dtype, args, kwargs) with node references as ("%", position in the graph)."""


def _row_index_constants(graph: Graph) -> set[Node]:
    """Constants that are, through views, the first index of an aten.index (where a CONST_IOTA one
    selects the batch's own rows): only these are written as an arange in the batch signature, so
    another 1-D arange constant (positions) still compares by value and keeps its padding when its
    length happens to equal the batch."""
    def root(x: Any) -> Any:
        while isinstance(x, Node) and x not in graph.constants and packet_name(x.op) in _IOTA_VIEWS and x.args:
            x = x.args[0]
        return x

    heads: set[Node] = set()
    for n in graph.ops():
        if packet_name(n.op) != "index" or len(n.args) < 2 or not n.args[1] or root(n.args[0]) in graph.constants:
            continue  # (a table of weights looked up by positions does not index the batch)
        x = root(n.args[1][0])
        if isinstance(x, Node) and x in graph.constants:
            heads.add(x)
    return heads


def batch_signature(graph: Graph) -> list[NodeSig]:
    """What two captures of one model at two batch sizes must share (see `differs_beyond_batch`);
    small constants (up to 64 elements: lifted literals such as torch.tensor(x.shape[0])) by value."""
    index = {id(n): i for i, n in enumerate(graph.nodes)}

    def skeleton(a: Any) -> Any:
        if isinstance(a, Node):
            return ("%", index.get(id(a), -1))
        if isinstance(a, (list, tuple)):
            return tuple(skeleton(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, skeleton(v)) for k, v in a.items()))
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), str(a.dtype))
        return a

    heads = _row_index_constants(graph)
    sig: list[NodeSig] = []
    for n in graph.nodes:
        value = graph.constants.get(n)
        small = ("arange",) if n in heads and _is_arange(value) else \
            tuple(value.detach().flatten().tolist()) if isinstance(value, torch.Tensor) and value.numel() <= 64 else None
        sig.append((n.op, tuple(n.shape), str(n.dtype), skeleton(n.args), (skeleton(n.kwargs), small)))
    return sig


def differs_beyond_batch(base: list[NodeSig], other: list[NodeSig], batch: int, other_batch: int) -> str | None:
    """Why the graph traced at `other_batch` is not the one traced at `batch` with the batch
    changed, or None when it is."""
    if len(base) != len(other):
        return f"the graph has {len(base)} nodes at batch {batch} and {len(other)} at batch {other_batch}"

    def scaled(s: Any, t: Any) -> bool:  # s is a multiple k of the batch and t the same multiple of the other
        return isinstance(s, int) and isinstance(t, int) and not isinstance(s, bool) and s > 0 \
            and s % batch == 0 and t == s // batch * other_batch

    def same(s: Any, t: Any, size_list: bool, bounds: bool) -> bool:
        if isinstance(s, tuple) and isinstance(t, tuple):
            if len(s) != len(t):
                return False
            if s[:1] == ("%",):
                return s == t
            # a list of ints is a size list: its first entry may be the batch
            ints = all(isinstance(x, int) for x in s)
            return all(same(x, y, size_list and ints and i == 0, bounds) for i, (x, y) in enumerate(zip(s, t)))
        if s == t or (isinstance(s, float) and isinstance(t, float) and s != s and t != t):
            return True
        return (size_list or bounds) and scaled(s, t)

    for i, (s, t) in enumerate(zip(base, other, strict=True)):
        op, shape, dtype, args, kwargs = s
        if (op, dtype) != (t[0], t[2]):
            return f"node {i} is {op} at batch {batch} and {t[0]} at batch {other_batch}"
        if len(shape) != len(t[1]) or shape[1:] != t[1][1:] or not (shape[:1] == t[1][:1] or scaled(shape[0], t[1][0])):
            return f"node {i} ({op}) has shape {list(shape)} at batch {batch} and {list(t[1])} at batch {other_batch}"
        if kwargs[1] == ("arange",) and shape == (batch,) and tuple(t[1]) != (other_batch,):
            # a constant arange(batch) (CONST_IOTA) that keeps its length: a fixed table, not the batch's rows
            return f"node {i} holds torch.arange({batch}) at batch {batch} and does not follow the batch to {other_batch}"
        name = packet_name(op)
        bounds = name == "arange"
        batch_at = _BATCH_ARGUMENTS.get(name, ())
        # args: the top-level tuple itself is not a size list; its list entries may be
        if not all(same(x, y, True, bounds) if isinstance(x, tuple) and x[:1] != ("%",) else
                   same(x, y, False, bounds or k in batch_at) for k, (x, y) in enumerate(zip(args, t[3]))) \
                or len(args) != len(t[3]) or not same(kwargs, t[4], False, False):
            return f"node {i} ({op}) takes a number that follows the batch size ({batch} -> {other_batch})"
    return None


def batch_sized(base: list[NodeSig], graph: Graph, other: list[NodeSig]) -> frozenset[Node]:
    """The nodes of `graph` (whose signature is `other`) with a dim 0 that differs from the one in
    the capture at another batch size (`base`, which `differs_beyond_batch` found the same function
    of the batch): for `batch_rows`'s `follows`."""
    return frozenset(n for n, s, t in zip(graph.nodes, base, other, strict=True) if s[1][:1] != t[1][:1])


def padded_outputs(graph: Graph, state: dict[Node, State]) -> list[int | None]:
    """Each output's rows per batch element, where it carries the batch (a padded call keeps the
    first batch * k rows), else None."""
    out: list[int | None] = []
    for o in graph.outputs:
        s = state.get(o) if isinstance(o, Node) else None
        out.append(s.k if isinstance(s, Rows) else None)
    return out
