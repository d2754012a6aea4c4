"""The one typed config object: every tunable of streamfuse lives here, with its default.

Pass a `Config` to `streamfuse.compile(..., config=Config(...))`; nothing is read from
environment variables (Triton's own `TRITON_INTERPRET` aside, which Triton itself reads).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Executor = Literal["auto", "triton", "reference"]


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "streamfuse"


@dataclass(frozen=True)
class Config:
    # --- fusion (fusion/) -------------------------------------------------------------
    fuse: bool = True
    """Master switch: False puts every node in its own kernel (useful to bisect)."""
    fusion_fuel: int | None = None
    """At most this many merges (thunder's "fuel"); None is unlimited. Bisect a bad fusion."""
    max_kernel_args: int = 64
    """Upper bound on tensors (inputs + outputs) one generated kernel takes."""
    max_ops_per_kernel: int = 256
    """Upper bound on IR nodes fused into one kernel."""
    horizontal_fusion: bool = True
    """Pack independent small pointwise kernels into one launch."""
    horizontal_max_elements: int = 262144
    """A pointwise kernel is "small" (worth packing) up to this many elements: about what it takes
    to give every SM of an H200 two programs of 1024 elements."""
    max_horizontal_parts: int = 64
    """At most this many kernels in one packed launch (their tensors also count against max_kernel_args)."""
    max_persistent_reduction: int = 16384
    """Largest reduced extent (elements per row) kept in registers in one pass; larger
    reductions run through ATen (recorded as a refusal)."""
    # --- resources (the seeds' defaults; issue 3 enforces the occupancy rule) ----------
    max_registers_per_thread: int = 255
    target_registers_per_thread: int = 64
    max_shared_bytes_per_block: int = 48 * 1024
    target_shared_bytes_per_block: int = 32 * 1024
    grid_min_waves: int = 2
    """Aim for a grid of at least this many programs per SM where the problem allows."""
    # --- codegen (codegen/) -----------------------------------------------------------
    pointwise_block: int = 1024
    pointwise_num_warps: int = 4
    reduction_elems_per_thread: int = 16
    """Register budget for a persistent reduction's row tile, in elements per thread."""
    reduction_max_warps: int = 16
    # --- scheduling (schedule/) --------------------------------------------------------
    max_streams: int = 4
    """Independent kernels run on up to this many CUDA streams (capped by the DAG's width)."""
    stream_priorities: bool = True
    """Run the critical path on a high-priority stream."""
    # --- CUDA graphs (runtime/graphs.py) ----------------------------------------------
    cuda_graphs: bool = True
    """On CUDA, capture the whole multi-stream schedule as a CUDA graph and replay it."""
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """One graph per bucket; a batch is padded up to its bucket where rows are provably
    independent along dim 0 (otherwise only the compiled shape is accepted)."""
    max_graphs: int = 8
    """At most this many recorded graphs; the least recently used is evicted."""
    reuse_outputs: bool = False
    """True returns the graph's own output buffers (zero-copy), overwritten by the next call;
    False (default) returns fresh tensors."""
    # --- runtime (runtime/) -----------------------------------------------------------
    executor: Executor = "auto"
    """"auto": Triton kernels on CUDA, and on CPU under TRITON_INTERPRET=1; otherwise the
    reference executor (each group's ops run through torch). "triton" or "reference" force one."""
    check_inputs: bool = True
    """Validate count, shape, dtype and device of each call's inputs (ValueError on mismatch)."""
    cache_dir: Path = field(default_factory=_default_cache_dir)
    """Where generated kernel sources are written (named by content hash)."""

    def replace(self, **changes: object) -> Config:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        positive = {
            "max_kernel_args": self.max_kernel_args,
            "max_ops_per_kernel": self.max_ops_per_kernel,
            "max_persistent_reduction": self.max_persistent_reduction,
            "horizontal_max_elements": self.horizontal_max_elements,
            "max_horizontal_parts": self.max_horizontal_parts,
            "pointwise_block": self.pointwise_block,
            "pointwise_num_warps": self.pointwise_num_warps,
            "reduction_elems_per_thread": self.reduction_elems_per_thread,
            "reduction_max_warps": self.reduction_max_warps,
            "max_streams": self.max_streams,
            "max_graphs": self.max_graphs,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Config.{name} must be a positive int, got {value!r}")
        if self.pointwise_block & (self.pointwise_block - 1):
            raise ValueError(f"Config.pointwise_block must be a power of two, got {self.pointwise_block}")
        if self.executor not in ("auto", "triton", "reference"):
            raise ValueError(f"Config.executor must be 'auto', 'triton' or 'reference', got {self.executor!r}")
        buckets = self.batch_buckets
        if (not isinstance(buckets, tuple) or not buckets or any(not isinstance(b, int) or b <= 0 for b in buckets)
                or list(buckets) != sorted(set(buckets))):
            raise ValueError(f"Config.batch_buckets must be a non-empty tuple of increasing positive ints, "
                             f"got {buckets!r}")
        if self.fusion_fuel is not None and self.fusion_fuel < 0:
            raise ValueError(f"Config.fusion_fuel must be None or >= 0, got {self.fusion_fuel}")
