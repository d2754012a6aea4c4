"""The input copy of a CUDA-graph call, as one directly launched Triton kernel.

A graph replays from static input buffers, so every call copies its inputs in. Through
`Tensor.copy_` that copy was the largest piece of a call's host time: 6-11 µs per input on the
H200 machines, of which the CUDA runtime's own cudaMemcpyAsync is 7.4 µs (benchmarks/
host_overhead.py, PERF.md session 11). A kernel launched through Triton's compiled launcher costs
a few µs less on the host. Inputs the kernel does not cover (non-contiguous, bool or complex,
2^31 elements or more) go through `copy_`.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from streamfuse.runtime.steps import specialization, triton_hooks_unset

BLOCK = 1024
_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                     torch.int16, torch.int32, torch.int64})


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


class InputCopy:
    """dst[:src.numel()] <- src for a contiguous dst of the same dtype (a static buffer or a prefix of
    one); compiled kernels are launched directly on CUDA, keyed as Triton specializes them."""

    def __init__(self, device: torch.device):
        self.direct = device.type == "cuda"
        self._compiled: dict[tuple, Any] = {}

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        n = src.numel()
        if (src.dtype not in _DTYPES or src.dtype != dst.dtype or n >= 2**31 or n != dst.numel()
                or not (src.is_contiguous() and dst.is_contiguous())):
            dst.copy_(src)
            return
        if n == 0:
            return
        grid = (n + BLOCK - 1) // BLOCK
        if not self.direct:
            _copy_kernel[(grid,)](src, dst, n, BLOCK=BLOCK)
            return
        key = (src.dtype, specialization(src), specialization(dst), specialization(n))
        compiled = self._compiled.get(key)
        if compiled is not None and triton_hooks_unset():
            stream = torch._C._cuda_getCurrentRawStream(src.device.index or 0)
            compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                         src, dst, n, BLOCK)
        else:
            self._compiled[key] = _copy_kernel[(grid,)](src, dst, n, BLOCK=BLOCK, num_warps=4)
