"""Batch independence: may the batch be padded up to a bucket without changing the real rows?

Padding is safe when every output row block depends only on the input rows of the same batch
element. The analysis tracks, per node, either CONST (does not depend on the batch: weights and
what is computed from them alone) or ("rows", k): dim 0 has size B*k and each block of k rows
belongs to one batch element. Anything it cannot prove returns a reason instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamfuse.ir.graph import Graph, Node
from streamfuse.ir.ops import OpKind, packet_name

CONST = "const"


@dataclass(frozen=True)
class Rows:
    k: int
    """Rows of dim 0 per batch element."""


State = str | Rows

# Opaque or contraction ops that treat dim 0 as a batch of independent rows when their
# batch-carrying inputs have it at dim 0 (the op-specific checks below cover the dim argument).
_ROW_WISE = {
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution",
    "max_pool2d_with_indices", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d",
    "upsample_nearest2d", "upsample_bilinear2d", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
    "scaled_dot_product_attention", "embedding", "index_select",
}
_DIM_ARG = {"cat": 1, "split": 2, "split_with_sizes": 2, "unbind": 1, "chunk": 2, "sort": 1, "cumsum": 1,
            "topk": 3, "argmax": 1, "argmin": 1, "max": 1, "min": 1, "_log_softmax": 1, "_softmax": 1}


def batch_rows(graph: Graph) -> dict[Node, State] | str:
    """Per-node batch state, or the reason the graph's rows are not provably independent."""
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
    for n in graph.constants:
        state[n] = CONST
    for n in graph.ops():
        result = _transfer(n, state, batch)
        if isinstance(result, tuple):
            return f"%{n.name} ({n.op}): {result[0]}"
        state[n] = result
    for o in graph.output_nodes:
        if o not in state:
            return f"output %{o.name} is not computed by the graph"
    return state


def _transfer(n: Node, state: dict[Node, State], batch: int) -> State | tuple[str]:
    ins = [state[a] for a in n.input_nodes() if a in state]
    rows = [s for s in ins if isinstance(s, Rows)]
    if not rows:
        src = n.args[0] if n.args else None
        if packet_name(n.op) == "expand" and isinstance(src, Node) and n.shape and n.shape[0] % batch == 0 \
                and (len(src.shape) < len(n.shape) or src.shape[0] != n.shape[0]):
            return Rows(n.shape[0] // batch)  # a constant broadcast to the batch: trivially independent rows
        return CONST
    if n.kind is OpKind.GETITEM:
        return rows[0]
    name = packet_name(n.op)
    if n.kind in (OpKind.POINTWISE, OpKind.BROADCAST):
        for a in n.input_nodes():
            if isinstance(state.get(a), Rows) and (len(a.shape) != len(n.shape) or a.shape[0] != n.shape[0]):
                return ("a batch-carrying operand is broadcast along dim 0",)
        if len({s.k for s in rows}) > 1:
            return ("operands group dim 0 differently",)
        return rows[0]
    if n.kind is OpKind.REDUCTION:
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        src = n.args[0]
        rank = len(src.shape) if isinstance(src, Node) else 0
        if dims is None or (isinstance(dims, (list, tuple)) and (len(dims) == 0 or any(d % rank == 0 for d in dims))):
            return ("reduces over the batch dimension",)
        return rows[0]
    if n.kind is OpKind.VIEW and name not in _DIM_ARG:
        return _view(n, rows[0], batch)
    if name in _DIM_ARG:
        pos = _DIM_ARG[name]
        dim = n.args[pos] if len(n.args) > pos else n.kwargs.get("dim", 0 if name in ("cat",) else -1)
        src = n.args[0]
        rank = len(src[0].shape if isinstance(src, list) else src.shape)  # type: ignore[union-attr]
        if isinstance(dim, int) and dim % max(rank, 1) == 0:
            return ("works along the batch dimension",)
        return rows[0]
    if name in _ROW_WISE:
        if not n.is_tensor:  # several results (read through getitem): each has the batch at dim 0
            return rows[0]
        return rows[0] if n.shape and n.shape[0] % batch == 0 else ("result has no batch at dim 0",)
    return ("opaque op: rows are not known to be independent",)


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
            return Rows(n.shape[0] // batch)
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
