"""The decomposition table used at capture: torch's own tables, not hand-written rules.

Core ATen decompositions, plus softmax / log_softmax / layer_norm lowered to the
reductions and pointwise ops the fusion planner understands. Scaled dot-product attention stays
whole: it runs on ATen's fused kernels (flash attention on the GPU), and torch's rule for its CPU
kernel is for inference only: it returns the attention probabilities where the kernel returns the
logsumexp that the (not decomposed) backward reads, so training gradients came out silently wrong
(60-1,300% on GPT-2; Inductor excludes it too; tests/test_training.py). var and var_mean stay whole
(their reference decompositions go through prims that cannot be functionalized), and so does
inference batch-norm (its decomposition goes through a mutating op): ir/lowerings.py lowers
them while converting. Optimizers' `_foreach_*` ops become one op per tensor (capture/foreach.py).
The backend's table can keep embedding_dense_backward whole too (Config.embedding_backward: eager's
kernel, where torch's rule makes a scatter that sums repeated indices serially; ir/scatter_add.py).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._decomp import core_aten_decompositions, get_decompositions

from streamfuse.capture.foreach import foreach_decompositions

aten = torch.ops.aten

_EXTRA = [
    aten._softmax,
    aten._log_softmax,
    aten.native_layer_norm,
    aten.gelu_backward,
]
_KEEP_WHOLE = [aten.var_mean, aten.var, aten.gelu, aten.scaled_dot_product_attention,
               aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_attention_math]


def _full_like(x: torch.Tensor, fill_value: Any, *, dtype: torch.dtype | None = None, layout: Any = None,
               device: torch.device | None = None, pin_memory: bool | None = None,
               memory_format: Any = None) -> torch.Tensor:
    """full_like -> full (pointwise in the IR): torch's tables have no rule for it, and core's rule for
    pow(scalar, tensor) (optimizers' bias corrections) produces it."""
    return aten.full.default(list(x.shape), fill_value, dtype=dtype or x.dtype, device=device or x.device)


def _finish(core: dict[Any, Any], keep: tuple[Any, ...] = ()) -> dict[Any, Any]:
    table = dict(core)
    table.update(get_decompositions(_EXTRA))
    table.update(foreach_decompositions())  # optimizers' multi-tensor updates, one op per tensor
    table[aten.full_like.default] = _full_like
    for packet in (*_KEEP_WHOLE, *keep):
        for overload in packet.overloads():
            table.pop(getattr(packet, overload), None)
    return table


@functools.cache
def decomposition_table(embedding_backward: bool = False) -> dict[Any, Any]:
    """The table for tracing (make_fx, AOTAutograd). There a CompositeImplicitAutograd op (linear,
    dropout, ...) decomposes by itself as it is traced, so torch's core table without those ops'
    entries gives the same graphs (every suite model's inference capture and training forward and
    backward, session 37) and skips materializing those entries (on the CPU, 70 ms of a new
    process's first compile). Where this torch lacks that table, the full one. `embedding_backward`:
    embedding_dense_backward stays one op (Config.embedding_backward)."""
    lean = getattr(torch._decomp, "_core_aten_decompositions_post_autograd", None)
    return _finish(lean() if lean is not None else core_aten_decompositions(),
                   (aten.embedding_dense_backward,) if embedding_backward else ())


@functools.cache
def export_decomposition_table() -> dict[Any, Any]:
    """The table for ExportedProgram.run_decompositions, which keeps the ops its table does not name:
    torch's full core table, CompositeImplicitAutograd ops included."""
    return _finish(core_aten_decompositions())
