"""Predicted kernel time for scheduling and simulation: a roofline from shapes, plus a launch cost.

A deliberately simple model from shapes alone (bytes each input is read and each output written
once; 2*M*N*K flops for contractions). The device ceilings are H200 figures (GPU_FACTS.md);
calibration on the present GPU belongs to tune/.
"""

from __future__ import annotations

import math

from streamfuse.fusion.groups import Group, GroupKind
from streamfuse.ir.graph import Node
from streamfuse.ir.ops import packet_name

BYTES_PER_US = 4.2e6  # device-to-device copy, bytes read + written per microsecond
FLOPS_PER_US = 4.0e8  # dense half-precision matrix rate, about half the measured peak
LAUNCH_US = 2.0


def estimate_us(group: Group, bytes_per_us: float = BYTES_PER_US, flops_per_us: float = FLOPS_PER_US,
                launch_us: float = LAUNCH_US) -> float:
    """max(memory time, arithmetic time) plus a launch cost (the roofline, plus overhead)."""
    if group.kind is GroupKind.ALIAS:
        return 0.0
    return launch_us + max(group_bytes(group) / bytes_per_us, group_flops(group) / flops_per_us)


def group_bytes(group: Group) -> float:
    """Bytes a group's kernel must move: each input read once, each output written once."""
    return float(sum(n.numel * n.itemsize for n in group.inputs + group.outputs))


def group_flops(group: Group) -> float:
    return sum(_flops(n) for n in group.nodes)


def _flops(n: Node) -> float:
    name = packet_name(n.op)
    args = [a for a in n.args if isinstance(a, Node)]
    if name in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear") and len(args) >= 2:
        a = args[-2]
        return 2.0 * n.numel * (a.shape[-1] if a.shape else 1)
    if name in ("convolution", "_convolution") and len(args) >= 2:
        weight = args[1]
        return 2.0 * n.numel * math.prod(weight.shape[1:])
    return float(n.numel)
