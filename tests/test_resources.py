"""Occupancy calculator: hand-computed cases (arithmetic in each row's comment) and argument checks."""

from __future__ import annotations

import pytest

from streamfuse.fusion.resources import ARCHS, ArchLimits, get_arch, kernel_occupancy, occupancy

# (arch, threads, regs, smem) -> (blocks_per_sm, active_warps, occupancy, limiter)
CASES = [
    # 8 warps/block; 32 regs -> 1024 regs/warp -> 64 warps -> 8 blocks == warp limit 8: tie, "warps" wins.
    pytest.param("sm_90", 256, 32, 0, (8, 64, 1.0, "warps"), id="sm90-256t-32r-full"),
    # 64 regs -> 2048 regs/warp -> 32 warps -> 4 blocks.
    pytest.param("sm_90", 256, 64, 0, (4, 32, 0.5, "registers"), id="sm90-256t-64r"),
    # 128 regs -> 4096 regs/warp -> 16 warps -> 2 blocks.
    pytest.param("sm_90", 256, 128, 0, (2, 16, 0.25, "registers"), id="sm90-256t-128r"),
    # smem: 49152 + 1024 = 50176 (a multiple of 128); 233472 // 50176 = 4 blocks.
    pytest.param("sm_90", 256, 32, 49152, (4, 32, 0.5, "shared memory"), id="sm90-48KB-smem"),
    # 4 warps/block; 255 regs -> 8160 -> 8192 regs/warp -> 8 warps -> 2 blocks = 8 warps.
    pytest.param("sm_80", 128, 255, 0, (2, 8, 0.125, "registers"), id="sm80-128t-255r"),
    # 32 warps/block; 64 regs -> 2048 regs/warp -> 32 warps -> 1 block (warp limit 2).
    pytest.param("sm_80", 1024, 64, 0, (1, 32, 0.5, "registers"), id="sm80-1024t-64r"),
    # smem: 102400 + 1024 = 103424; 167936 // 103424 = 1 block of 4 warps.
    pytest.param("sm_80", 128, 32, 102400, (1, 4, 0.0625, "shared memory"), id="sm80-100KB-smem"),
    # 2 warps/block; 48 regs -> 1536 regs/warp -> 42 warps, rounded down to 40 -> 20 blocks (not 21).
    pytest.param("sm_90", 64, 48, 0, (20, 40, 0.625, "registers"), id="warp-granularity"),
    # 33 threads = 2 warps; 64 regs -> 32 warps -> 16 blocks (1 warp/block would give 32).
    pytest.param("sm_90", 33, 64, 0, (16, 32, 0.5, "registers"), id="33-threads-2-warps"),
    # 1 warp/block; 16 regs -> 512 regs/warp -> 128 blocks; warp limit 64; block limit 32 binds.
    pytest.param("sm_90", 32, 16, 0, (32, 32, 0.5, "blocks"), id="block-limit"),
    # 0 regs: no register limit; 8 warps/block -> warp limit 8.
    pytest.param("sm_90", 256, 0, 0, (8, 64, 1.0, "warps"), id="no-register-limit"),
    # Largest legal smem: 232448 + 1024 = 233472 = the whole SM -> exactly 1 block.
    pytest.param("sm_90", 128, 32, 232448, (1, 4, 0.0625, "shared memory"), id="sm90-max-smem"),
    pytest.param("sm_80", 128, 32, 166912, (1, 4, 0.0625, "shared memory"), id="sm80-max-smem"),
]


@pytest.mark.parametrize(("arch", "threads", "regs", "smem", "expected"), CASES)
def test_hand_computed_cases(arch: str, threads: int, regs: int, smem: int, expected: tuple) -> None:
    result = occupancy(arch, threads, regs, smem)
    assert (result.blocks_per_sm, result.active_warps, result.occupancy, result.limiter) == expected


def test_limits_report_every_resource() -> None:
    result = occupancy("sm_90", 256, 64, 49152)
    # warps 64 // 8; registers 32 warps // 8; smem 233472 // 50176; blocks 32.
    assert result.limits == {"warps": 8, "registers": 4, "shared memory": 4, "blocks": 32}
    # registers and shared memory tie at 4: registers comes first in the tie order.
    assert result.limiter == "registers"


def test_warp_granularity_shows_in_register_limit() -> None:
    assert occupancy("sm_90", 64, 48, 0).limits["registers"] == 20


def test_no_register_limit_omits_registers() -> None:
    assert "registers" not in occupancy("sm_90", 256, 0, 0).limits


@pytest.mark.parametrize(
    ("arch", "threads", "regs", "smem", "limiter"),
    [
        # warps (8) == registers (8): warps wins, it is the architecture's ceiling.
        pytest.param("sm_90", 256, 32, 0, "warps", id="warps-beats-registers"),
        # 2 warps/block: warps 32 == registers 32 == blocks 32.
        pytest.param("sm_90", 33, 32, 0, "warps", id="warps-beats-registers-and-blocks"),
        # 2 warps/block: warps 32 == blocks 32 (16 regs -> 128 warps -> 64 blocks).
        pytest.param("sm_90", 64, 16, 0, "warps", id="warps-beats-blocks"),
        # 1 warp/block, 64 regs -> 32 warps -> 32 blocks == block limit 32.
        pytest.param("sm_90", 32, 64, 0, "registers", id="registers-beats-blocks"),
        # 1024 threads, 32 regs -> registers 2 == warps 2; smem (232448 + 1024) -> 1 block binds alone.
        pytest.param("sm_90", 1024, 32, 232448, "shared memory", id="strict-minimum-wins"),
        # smem 116736 + 1024 = 117760 -> 1 block; 32 warps/block with 64 regs -> 1 block: tie.
        pytest.param("sm_90", 1024, 64, 116736, "registers", id="registers-beats-shared-memory"),
        # 100 KB smem on sm_80 -> 1 block, below the warp limit 2 of 1024 threads; no register limit.
        pytest.param("sm_80", 1024, 0, 102400, "shared memory", id="shared-memory-below-warps"),
        # 512 threads (16 warps) -> warp limit 4; smem 40960 + 1024 = 41984 -> 167936 // 41984 = 4: tie.
        pytest.param("sm_80", 512, 0, 40960, "warps", id="warps-beats-shared-memory"),
    ],
)
def test_tie_rule(arch: str, threads: int, regs: int, smem: int, limiter: str) -> None:
    assert occupancy(arch, threads, regs, smem).limiter == limiter


@pytest.mark.parametrize(
    ("threads", "regs"),
    [
        # 65 regs -> 2080 -> 2304 regs/warp -> 28 warps, fewer than the 32 of one block.
        (1024, 65),
        # 255 regs -> 8192 regs/warp -> 8 warps < 32.
        (1024, 255),
        # 129 regs -> 4128 -> 4352 regs/warp -> 15 warps -> 12 after granularity < 16.
        (512, 129),
    ],
)
def test_zero_fit(threads: int, regs: int) -> None:
    result = occupancy("sm_90", threads, regs, 0)
    assert (result.blocks_per_sm, result.active_warps, result.occupancy) == (0, 0, 0.0)
    assert result.limiter == "registers"
    assert result.limits["registers"] == 0


def test_one_fewer_register_still_fits() -> None:
    assert occupancy("sm_90", 1024, 64, 0).blocks_per_sm == 1


@pytest.mark.parametrize("alias", ["sm_90", "90", "9.0", (9, 0), "SM_90", "sm90", ARCHS["sm_90"]])
def test_sm90_aliases(alias: object) -> None:
    assert get_arch(alias) is ARCHS["sm_90"]  # type: ignore[arg-type]
    assert occupancy(alias, 256, 64, 0).blocks_per_sm == 4  # type: ignore[arg-type]


@pytest.mark.parametrize("alias", ["sm_80", "80", "8.0", (8, 0)])
def test_sm80_aliases(alias: object) -> None:
    assert get_arch(alias) is ARCHS["sm_80"]  # type: ignore[arg-type]


def test_arch_tables() -> None:
    assert ARCHS["sm_90"].shared_per_sm == 233472
    assert ARCHS["sm_90"].max_shared_per_block == 232448
    assert ARCHS["sm_80"].shared_per_sm == 167936
    assert ARCHS["sm_80"].max_shared_per_block == 166912


def test_custom_arch_limits() -> None:
    small = ArchLimits("toy", 1024, 48, 16, 65536, 255, 256, 4, 102400, 101376, 1024, 128)
    result = occupancy(small, 256, 32, 0)  # 8 warps/block -> warp limit 6
    assert (result.blocks_per_sm, result.occupancy, result.limiter) == (6, 1.0, "warps")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("sm_75", 128, 32, 0), "arch"),
        (("7.5", 128, 32, 0), "arch"),
        (((9, 0, 1), 128, 32, 0), "arch"),
        (("sm_90", 0, 32, 0), "threads_per_block"),
        (("sm_90", 1025, 32, 0), "threads_per_block"),
        (("sm_90", 128, -1, 0), "registers_per_thread"),
        (("sm_90", 128, 256, 0), "registers_per_thread"),
        (("sm_90", 128, 32, -1), "shared_bytes_per_block"),
        (("sm_90", 128, 32, 232449), "shared_bytes_per_block"),
        (("sm_80", 128, 32, 166913), "shared_bytes_per_block"),
    ],
)
def test_errors_name_the_argument(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        occupancy(*args)
    assert "expected" in str(info.value)


def test_non_int_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="threads_per_block"):
        occupancy("sm_90", 128.0, 32, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="registers_per_thread"):
        occupancy("sm_90", 128, True, 0)


def test_kernel_occupancy_matches_occupancy() -> None:
    # A Triton kernel with num_warps=8, n_regs=64, shared=0 is 256 threads: 50 %.
    assert kernel_occupancy("sm_90", 8, 64, 0) == occupancy("sm_90", 256, 64, 0)
    assert kernel_occupancy((8, 0), 4, 32, 102400).limiter == "shared memory"


@pytest.mark.parametrize("num_warps", [0, 33])
def test_kernel_occupancy_checks_num_warps(num_warps: int) -> None:
    with pytest.raises(ValueError, match="num_warps"):
        kernel_occupancy("sm_90", num_warps, 32, 0)
