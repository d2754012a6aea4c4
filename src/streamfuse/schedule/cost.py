"""Predicted kernel time for scheduling and simulation: a roofline from shapes, plus a launch cost.

A deliberately simple model from shapes alone (bytes each input is read and each output written
once; 2*M*N*K flops for contractions). The default ceilings are H200 figures (GPU_FACTS.md);
pass `ceilings` (tune.ceilings.ceilings_for) to estimate with the present GPU's calibrated ones.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from streamfuse.fusion.groups import Group, GroupKind, read_bytes
from streamfuse.ir.graph import Node
from streamfuse.ir.ops import OpKind, packet_name

if TYPE_CHECKING:
    from streamfuse.tune.ceilings import DeviceCeilings

BYTES_PER_US = 4.2e6  # device-to-device copy, bytes read + written per microsecond
FLOPS_PER_US = 4.0e8  # dense half-precision matrix rate, about half the measured peak
LAUNCH_US = 2.0


def estimate_us(group: Group, bytes_per_us: float | None = None, flops_per_us: float | None = None,
                launch_us: float | None = None, ceilings: DeviceCeilings | None = None) -> float:
    """max(memory time, arithmetic time) plus a launch cost (the roofline, plus overhead).

    A figure passed explicitly wins; otherwise `ceilings` supplies it (bandwidth, the matmul rate of
    each contraction's dtype with float32's for other arithmetic, the per-kernel cost inside a CUDA
    graph), and without ceilings the module's H200 constants do."""
    if group.kind is GroupKind.ALIAS:
        return 0.0
    if launch_us is None:
        launch_us = ceilings.graph_kernel_us if ceilings is not None else LAUNCH_US
    if bytes_per_us is None:
        bytes_per_us = ceilings.bytes_per_us() if ceilings is not None else BYTES_PER_US
    if flops_per_us is not None or ceilings is None:
        arith_us = group_flops(group) / (flops_per_us if flops_per_us is not None else FLOPS_PER_US)
    else:
        arith_us = sum(_flops(n) / _rate(n, ceilings) for n in group.nodes)
    return launch_us + max(group_bytes(group) / bytes_per_us, arith_us)


def unfused_us(group: Group, ceilings: DeviceCeilings) -> tuple[float, int]:
    """(predicted µs, kernel count) of the group's ops run one kernel each, as eager would: every op
    reads its inputs from memory and writes its result back (views and expands cost nothing)."""
    total, kernels = 0.0, 0
    for n in group.nodes:
        if n.kind in (OpKind.VIEW, OpKind.BROADCAST, OpKind.GETITEM) or not n.is_tensor:
            continue
        moved = sum(read_bytes(a, [n]) for a in n.input_nodes() if a.is_tensor) + n.numel * n.itemsize
        total += ceilings.graph_kernel_us + max(moved / ceilings.bytes_per_us(), _flops(n) / _rate(n, ceilings))
        kernels += 1
    return total, kernels


_PRODUCTS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation"})
"""Products by name (`_addmm_activation`: addmm with cuBLASLt's GELU epilogue, ir/mm_gelu.py, an
opaque ATen op to the planner)."""


def _rate(n: Node, ceilings: DeviceCeilings) -> float:
    """flop/µs for a node: contractions at cuBLAS's rate for their dtype; everything else runs on the
    CUDA cores, which Triton's kernels drive in float32 whatever the storage dtype."""
    if (n.kind is OpKind.CONTRACTION or packet_name(n.op) in _PRODUCTS) and n.dtype is not None:
        return ceilings.flops_per_us(n.dtype)
    return ceilings.flops_per_us(torch.float32)


def group_bytes(group: Group) -> float:
    """Bytes a group's kernel must move: each input read once (a table only its rows looked up),
    each output written once."""
    written = sum(n.numel * n.itemsize for n in group.outputs)
    return sum(read_bytes(n, group.nodes) for n in group.inputs) + float(written)


def group_flops(group: Group) -> float:
    return sum(_flops(n) for n in group.nodes)


def _flops(n: Node) -> float:
    name = packet_name(n.op)
    args = [a for a in n.args if isinstance(a, Node)]
    if name in _PRODUCTS and len(args) >= 2:
        a = args[-2]
        return 2.0 * n.numel * (a.shape[-1] if a.shape else 1)
    if name in ("convolution", "_convolution") and len(args) >= 2:
        weight = args[1]
        return 2.0 * n.numel * math.prod(weight.shape[1:])
    return float(n.numel)
