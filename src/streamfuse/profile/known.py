"""What streamfuse knows about the kernels it generated, by kernel name, for the profiler:
bytes moved and flops per launch (from shapes), and registers / shared memory / occupancy once
the kernel has been compiled for a GPU."""

from __future__ import annotations

import weakref
from typing import Any

from streamfuse.profile.report import KernelInfo

_KNOWN: dict[str, tuple[float, float, Any]] = {}


def register(fn_name: str, nbytes: float, flops: float, step: Any) -> None:
    """Remember a generated kernel; `step` (a KernelStep) is held weakly, for its compiled binaries."""
    _KNOWN[fn_name] = (nbytes, flops, weakref.ref(step))


def kernel_info(fn_name: str) -> KernelInfo | None:
    entry = _KNOWN.get(fn_name)
    if entry is None:
        return None
    nbytes, flops, step_ref = entry
    occupancy, limiter = _occupancy(step_ref())
    return KernelInfo(bytes=nbytes, flops=flops, occupancy=occupancy, limiter=limiter)


def _occupancy(step: Any) -> tuple[float | None, str | None]:
    compiled = step.binary() if step is not None else None
    if compiled is None:
        return None, None
    try:
        import torch

        from streamfuse.fusion.resources import kernel_occupancy

        arch = torch.cuda.get_device_capability()
        occ = kernel_occupancy(arch, compiled.metadata.num_warps, compiled.n_regs, compiled.metadata.shared)
        return occ.occupancy, occ.limiter
    except Exception:  # noqa: BLE001 - occupancy is informative; never fail a report over it
        return None, None
