"""Config.addmm_bias="auto": for an addmm whose readers can add its bias (ir/mm_bias.split_candidates),
time cuBLAS's `addmm` against a plain `mm` of the same operands, once per shape, strides, dtype and
TF32 setting, and split where mm wins by Config.addmm_split_margin. Replayed from a CUDA graph on
random operands like the matmul tuner's candidates; results persist in cache_dir/autotune.json.

cuBLAS chooses its kernel differently for the two: on the H200 GPT-2's 3072 -> 768 projection at
8x128 tokens ran as a plain product with split-K (reduce-overhead's plan, Inductor splitting the
bias off) and as addmm without it (run 90), while convnext_tiny's Linear layers ran 10% faster as
addmm (run 83). Neither way is right for every shape, and timing both costs a few milliseconds.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from streamfuse.config import Config
from streamfuse.ir.graph import Node
from streamfuse.profile.timing import time_graph_us
from streamfuse.tune.autotune import load_cache, random_operand, store_cache, time_aten


def cache_key(node: Node, device: torch.device) -> str:
    bias, a, b = node.args
    assert isinstance(a, Node) and isinstance(b, Node)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    return (f"{torch.cuda.get_device_name(device)}|addmm-split|{a.shape}{a.strides}x{b.shape}{b.strides}"
            f"|{node.dtype}|tf32={tf32}")


def time_both(node: Node, device: torch.device) -> tuple[float, float]:
    """(addmm µs, mm µs) on random operands with the node's shapes and strides (the addmm timed as
    the profile-guided choice times any ATen contraction: autotune.time_aten)."""
    _, a, b = node.args
    assert isinstance(a, Node) and isinstance(b, Node)
    with unset_fake_temporarily():
        ta, tb = random_operand(a, device), random_operand(b, device)
        mm_us = time_graph_us(lambda: torch.mm(ta, tb))
    return time_aten(node, device), mm_us


def prefer_mm(node: Node, config: Config, device: torch.device) -> bool:
    """Whether `node` runs faster as mm (its bias added by its readers' kernel) on this GPU."""
    key = cache_key(node, device)
    cached = load_cache(config.cache_dir).get(key)
    if cached is None:
        addmm_us, mm_us = time_both(node, device)
        cached = {"addmm_us": addmm_us, "mm_us": mm_us}
        store_cache(config.cache_dir, key, cached)
    return float(cached["mm_us"]) < float(cached["addmm_us"]) * (1.0 - config.addmm_split_margin)
