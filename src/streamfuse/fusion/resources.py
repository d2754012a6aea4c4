"""CUDA occupancy: how many blocks of a kernel fit on one SM, and which resource stops more from fitting.

A pure function of the architecture's limits and the kernel's launch resources (no torch, no CUDA),
following NVIDIA's occupancy calculator:

- warps per block = ceil(threads / 32);
- registers are allocated per warp in units of ``register_alloc_unit``, and the warps they allow
  are rounded down to ``warp_alloc_granularity`` (register files are handed out to warp groups);
- shared memory per block includes the driver's reserved bytes and is rounded up to
  ``shared_alloc_unit``;
- the resident block count is the smallest of the per-resource limits.

Tie rule for ``Occupancy.limiter``: when several resources allow the same (smallest) number of
blocks, the first of "warps", "registers", "shared memory", "blocks" is reported. "warps" comes
first because the warp limit is the architecture's ceiling for this block size: when it binds, no
register or shared-memory tuning could raise occupancy, so naming another resource would send the
reader after a gain that does not exist. The remaining order (registers, shared memory, blocks)
ranks the resources a kernel author most often controls first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

WARP_SIZE = 32

# Resource names, in tie-break order (see the module docstring).
LIMITERS: tuple[str, ...] = ("warps", "registers", "shared memory", "blocks")


@dataclass(frozen=True)
class ArchLimits:
    name: str
    max_threads_per_block: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    registers_per_sm: int
    max_registers_per_thread: int
    register_alloc_unit: int  # registers, allocated per warp
    warp_alloc_granularity: int  # warps
    shared_per_sm: int  # bytes
    max_shared_per_block: int  # bytes, excluding the reserved bytes
    shared_reserved_per_block: int  # bytes the driver keeps per resident block
    shared_alloc_unit: int  # bytes


def _arch(name: str, shared_per_sm_kb: int, max_shared_per_block_kb: int) -> ArchLimits:
    # sm_80 and sm_90 differ only in shared-memory capacity.
    return ArchLimits(
        name=name,
        max_threads_per_block=1024,
        max_warps_per_sm=64,
        max_blocks_per_sm=32,
        registers_per_sm=65536,
        max_registers_per_thread=255,
        register_alloc_unit=256,
        warp_alloc_granularity=4,
        shared_per_sm=shared_per_sm_kb * 1024,
        max_shared_per_block=max_shared_per_block_kb * 1024,
        shared_reserved_per_block=1024,
        shared_alloc_unit=128,
    )


ARCHS: dict[str, ArchLimits] = {
    "sm_80": _arch("sm_80", 164, 163),
    "sm_90": _arch("sm_90", 228, 227),
}


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    active_warps: int  # blocks_per_sm * warps per block
    occupancy: float  # active_warps / max_warps_per_sm
    limiter: str  # one of LIMITERS: the binding limit, ties broken per the module docstring
    # Blocks per SM allowed by each resource; "registers" is absent when registers_per_thread is 0
    # (no register limit), so that a made-up number never wins a tie.
    limits: dict[str, int] = field(default_factory=dict)


def get_arch(arch: str | tuple[int, int] | ArchLimits) -> ArchLimits:
    """The limits for ``arch``: "sm_90", "90", "9.0", (9, 0) (likewise for sm_80), or an ArchLimits."""
    if isinstance(arch, ArchLimits):
        return arch
    key: str | None = None
    if isinstance(arch, tuple) and len(arch) == 2 and all(isinstance(v, int) for v in arch):
        key = f"sm_{arch[0]}{arch[1]}"
    elif isinstance(arch, str):
        # "sm_90", "sm90", "90" and "9.0" all name sm_90.
        text = arch.strip().lower().removeprefix("sm_").removeprefix("sm")
        major, dot, minor = text.partition(".")
        key = f"sm_{major}{minor}" if dot else f"sm_{text}"
    if key not in ARCHS:
        known = ", ".join(sorted(ARCHS))
        raise ValueError(f"arch: expected one of {known} (or '90', '9.0', (9, 0) style aliases), got {arch!r}")
    return ARCHS[key]


def _check_range(name: str, value: int, low: int, high: int) -> None:
    # bool is an int subclass; True threads is surely a bug, not one thread.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name}: expected an int in [{low}, {high}], got {value}")


def _blocks_by_registers(limits: ArchLimits, registers_per_thread: int, warps_per_block: int) -> int:
    registers_per_warp = math.ceil(registers_per_thread * WARP_SIZE / limits.register_alloc_unit)
    registers_per_warp *= limits.register_alloc_unit
    warps = limits.registers_per_sm // registers_per_warp
    # The register file is handed out to groups of warps, so a partial group is unusable.
    warps -= warps % limits.warp_alloc_granularity
    return warps // warps_per_block


def _blocks_by_shared(limits: ArchLimits, shared_bytes_per_block: int) -> int:
    # Every resident block costs the reserved bytes too, even one using no shared memory.
    per_block = shared_bytes_per_block + limits.shared_reserved_per_block
    per_block = math.ceil(per_block / limits.shared_alloc_unit) * limits.shared_alloc_unit
    return limits.shared_per_sm // per_block


def occupancy(
    arch: str | tuple[int, int] | ArchLimits,
    threads_per_block: int,
    registers_per_thread: int,
    shared_bytes_per_block: int,
) -> Occupancy:
    """Resident blocks, warps and occupancy of one kernel on one SM of ``arch``.

    ``registers_per_thread == 0`` means the register use is unknown or negligible: no register limit.
    The limiter is the resource allowing the fewest blocks; ties go to the first of "warps",
    "registers", "shared memory", "blocks" (why: see the module docstring). A configuration that
    fits no block returns blocks_per_sm == 0, occupancy 0.0 and the resource that refused it.
    Raises ValueError, naming the argument, for an unknown arch or an out-of-range resource.
    """
    limits = get_arch(arch)
    _check_range("threads_per_block", threads_per_block, 1, limits.max_threads_per_block)
    _check_range("registers_per_thread", registers_per_thread, 0, limits.max_registers_per_thread)
    _check_range("shared_bytes_per_block", shared_bytes_per_block, 0, limits.max_shared_per_block)

    warps_per_block = math.ceil(threads_per_block / WARP_SIZE)
    per_resource = {"warps": limits.max_warps_per_sm // warps_per_block}
    if registers_per_thread > 0:
        per_resource["registers"] = _blocks_by_registers(limits, registers_per_thread, warps_per_block)
    per_resource["shared memory"] = _blocks_by_shared(limits, shared_bytes_per_block)
    per_resource["blocks"] = limits.max_blocks_per_sm

    blocks = min(per_resource.values())
    # min() over LIMITERS order returns the first tied name: that is the tie rule.
    limiter = min((name for name in LIMITERS if name in per_resource), key=lambda name: per_resource[name])
    active_warps = blocks * warps_per_block
    return Occupancy(
        blocks_per_sm=blocks,
        active_warps=active_warps,
        occupancy=active_warps / limits.max_warps_per_sm,
        limiter=limiter,
        limits={name: per_resource[name] for name in LIMITERS if name in per_resource},
    )


def kernel_occupancy(
    arch: str | tuple[int, int] | ArchLimits, num_warps: int, n_regs: int, shared_bytes: int
) -> Occupancy:
    """Occupancy of a compiled Triton kernel, from its ``num_warps``, ``n_regs`` and ``shared`` metadata."""
    _check_range("num_warps", num_warps, 1, get_arch(arch).max_threads_per_block // WARP_SIZE)
    return occupancy(arch, num_warps * WARP_SIZE, n_regs, shared_bytes)
