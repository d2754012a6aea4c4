"""Launch geometry and estimated resources of a generated kernel, before any code exists.

The planner checks each candidate fusion against the resource limits in Config (registers per
thread, shared memory per block, occupancy relative to the kernels it replaces); codegen launches
with the same geometry. On the GPU, explain() and the profiler report the compiled kernel's real
registers and shared memory instead (KernelStep keeps the compiled binaries).

Register estimate (32-bit registers per thread), a deliberately simple model:
    16 for indices and program ids + 2 per pointer argument (64-bit) + one per stride argument
    + elements per thread x live tiles,
where live tiles are the values that must be held at once: the loaded inputs and the results
(pointwise: inputs + outputs, at most 8; reduction: the row tile of each input plus one per
reduced value; matmul: the fp32 accumulator plus the operand fragments). Triton's register
allocator often does better on pointwise code; it is an upper-side estimate used for refusals.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from streamfuse.config import Config
from streamfuse.fusion.groups import Group, GroupKind, ReductionDomain
from streamfuse.fusion.resources import WARP_SIZE, Occupancy, occupancy
from streamfuse.ir.graph import Node
from streamfuse.ir.indexing import concat_parts, dense_order, pool_params
from streamfuse.ir.ops import OpKind, packet_name

DEFAULT_ARCH = "sm_90"


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fill_split(tiles: int, k_steps: int, sm_count: int, max_split: int) -> int:
    """Split-K of the matmul template: the smallest power of two that gives `tiles` output tiles two
    programs per SM, with at most one slice per K step and at most `max_split`
    (Config.matmul_max_split_k); 1 where the output tiles already fill the GPU."""
    split = 1
    while tiles * split < 2 * sm_count and split * 2 <= min(k_steps, max_split):
        split *= 2
    return split


def pointwise_launch(n: int, config: Config, split: int = 1) -> tuple[int, int]:
    """(BLOCK, num_warps) of a pointwise kernel over n elements; `split` divides each thread's
    elements (the planner's remedy for a fusion that would lose occupancy)."""
    full = min(config.pointwise_block, max(16, next_pow2(n)))
    warps = max(1, min(config.pointwise_num_warps, full // 256))
    return max(min(full, warps * WARP_SIZE), full // split), warps


SHORT_ROW_WARP_COLUMNS = 64
"""Columns of a short row per warp of its program. Triton's default layout spreads a tile's warps
along the row before the rows, so each further warp splits every row and adds an exchange through
shared memory and a barrier to each of its reductions. Run 163 (H100, hand-written window softmax
over rows of 49, 8 rows per program): one warp 45.1 µs, two 66.4; at every rows-per-program one warp
was fastest."""


def reduction_launch(dom: ReductionDomain, config: Config, sm_count: int, split: int = 1) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_R, num_warps) of a persistent reduction: whole rows in registers, as many
    rows per program as the register budget allows while the grid still gives every SM
    `grid_min_waves` programs. Rows shorter than `reduction_tile_elems` share a tile of that size at
    `reduction_short_row_elems_per_thread`, one warp per SHORT_ROW_WARP_COLUMNS of the row; longer
    rows take warps at `reduction_elems_per_thread`. `split` divides each thread's elements (more
    warps per row tile, or fewer rows). Long rows on a grid smaller than the SM count take at most
    `reduction_small_grid_elems_per_thread`; short rows there keep their warps, with fewer rows per
    program (down to one)."""
    m, r = dom.rows, dom.row_size
    block_r = next_pow2(r)
    short = block_r < config.reduction_tile_elems
    if short:
        elems = max(1, config.reduction_short_row_elems_per_thread // split)
        warps = max(1, min(block_r // SHORT_ROW_WARP_COLUMNS, config.reduction_tile_elems // (WARP_SIZE * elems)))
        tile = warps * WARP_SIZE * elems
    else:
        elems = max(1, config.reduction_elems_per_thread // split)
        tile = WARP_SIZE * config.reduction_elems_per_thread * config.reduction_max_warps // 2
    block_m = max(1, min(next_pow2(m), tile // block_r))
    while block_m > 1 and math.ceil(m / block_m) < config.grid_min_waves * sm_count:
        block_m //= 2
    if short:
        return block_m, block_r, warps
    if math.ceil(m / block_m) < sm_count:  # latency-bound: more warps to each row
        elems = min(elems, config.reduction_small_grid_elems_per_thread)
    num_warps = min(config.reduction_max_warps, next_pow2(max(1, block_m * block_r // (WARP_SIZE * elems))))
    return block_m, block_r, num_warps


ROWS_TILE_MIN = 8
"""Fewest rows per program of the rows-contiguous reduction: one 32-byte sector of float32."""


def rows_contiguous_launch(dom: ReductionDomain, config: Config, sm_count: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_R, num_warps) of the looped reduction whose rows are adjacent in memory (a
    reduction over H and W of a channels_last tensor): threads along the rows, each program a
    BLOCK_M x BLOCK_R tile per step of a loop over the row. As many rows per program as keeps
    `grid_min_waves` programs per SM, at most 32 (a 128-byte line of float32) and at least
    ROWS_TILE_MIN; a tile of about 2048 elements per step."""
    m, r = dom.rows, dom.row_size
    block_m = min(32, max(ROWS_TILE_MIN, next_pow2(m)))
    while block_m > ROWS_TILE_MIN and math.ceil(m / block_m) < config.grid_min_waves * sm_count:
        block_m //= 2
    block_r = _rows_step(r, block_m)
    num_warps = 8 if block_m * block_r >= 2048 else 4
    return block_m, block_r, num_warps


LOOP_TILE = 2048
"""Elements of the looped reduction's [BLOCK_M, BLOCK_R] tile per step of its loop."""


def _rows_step(row_size: int, block_m: int) -> int:
    """BLOCK_R of the rows-contiguous reduction: a tile of about LOOP_TILE elements per step."""
    return max(1, min(next_pow2(row_size), LOOP_TILE // block_m))


def long_rows(dom: ReductionDomain, config: Config) -> bool:
    """Rows longer than Config.max_persistent_reduction: too long for registers, they take the
    looped reduction (or ATen, where the group cannot run in one pass: `loopable`)."""
    return dom.row_size > config.max_persistent_reduction


def looped_launch(dom: ReductionDomain, config: Config, sm_count: int,
                  rows_contiguous: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_R, num_warps) of the looped reduction: `rows_contiguous_launch` where the
    rows lie next to each other in memory; otherwise (a long row, Config.max_persistent_reduction:
    the sums over N, H and W of a batch-norm backward, a sum over every element of a large tensor) one row per
    program with the threads along it, LOOP_TILE elements per step at reduction_elems_per_thread."""
    if rows_contiguous:
        return rows_contiguous_launch(dom, config, sm_count)
    block_r = min(next_pow2(dom.row_size), LOOP_TILE)
    warps = max(1, min(config.reduction_max_warps, block_r // (WARP_SIZE * config.reduction_elems_per_thread)))
    return 1, block_r, warps


def fills_rows_contiguous(dom: ReductionDomain, config: Config, sm_count: int) -> bool:
    """Enough rows that the rows-contiguous reduction's smallest tile gives every SM
    `grid_min_waves` programs (with fewer, its long loops leave the GPU idle; the persistent
    reduction's one program per row keeps more loads in flight), counting the split of each row
    into BLOCK_R-long slices where Config.reduction_row_split allows it."""
    slices = math.ceil(dom.row_size / _rows_step(dom.row_size, ROWS_TILE_MIN))
    return math.ceil(dom.rows / ROWS_TILE_MIN) * (slices if config.reduction_row_split else 1) \
        >= config.grid_min_waves * sm_count


def looped_split(dom: ReductionDomain, config: Config, sm_count: int, rows_contiguous: bool) -> tuple[int, int]:
    """(SPLIT, CHUNK) of the looped reduction (`looped_launch`): SPLIT programs per row tile, each
    summing CHUNK of the row (a multiple of BLOCK_R), where the row tiles alone give fewer than
    `grid_min_waves` programs per SM; (1, row size) otherwise. Splits are as many as fill the GPU,
    rounded so that every slice is a whole number of steps (more slices rather than fewer), and at
    most Config.reduction_max_split (the last program's combine is unrolled over the splits)."""
    block_m, block_r, _ = looped_launch(dom, config, sm_count, rows_contiguous)
    tiles, steps = math.ceil(dom.rows / block_m), math.ceil(dom.row_size / block_r)
    target = config.grid_min_waves * sm_count
    if not config.reduction_row_split or tiles >= target or steps < 2:
        return 1, dom.row_size
    chunk = max(1, steps // min(steps, math.ceil(target / tiles)), math.ceil(steps / config.reduction_max_split))
    return math.ceil(steps / chunk), chunk * block_r


LOOPED_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin"})
"""Reductions the looped template accumulates elementwise over its steps (a variance needs the mean first)."""


def loopable(group: Group) -> bool:
    """The looped reduction can run `group` in one pass over each row: every reduction is a sum,
    mean, max or min of values that need no reduction of the group, and no output of the domain's
    shape needs one either (a row's reduced value exists only after the loop)."""
    return group.domain is not None and one_pass(group.nodes, group.outputs, group.domain)


def one_pass(nodes: Sequence[Node], outputs: Iterable[Node], dom: ReductionDomain) -> bool:
    """`loopable` for a kernel's (topologically ordered) nodes and outputs over domain `dom`."""
    reductions = [n for n in nodes if n.kind is OpKind.REDUCTION]
    if not reductions or any(packet_name(n.op) not in LOOPED_REDUCTIONS or n.dtype is None or not n.dtype.is_floating_point
                             for n in reductions):
        return False
    members = set(nodes)
    after: set[Node] = set()  # members computed from a reduction of the group
    for n in nodes:
        if any(a in after or (a in members and a.kind is OpKind.REDUCTION) for a in n.input_nodes()):
            after.add(n)
    return not any(n.args[0] in after for n in reductions) and not any(o in after for o in outputs if o.shape == dom.shape)


SPLITS = (1, 2, 4)
"""Per-thread work divisors the planner tries before it refuses a fusion for occupancy."""


@dataclass(frozen=True)
class Resources:
    threads: int
    registers: int
    """Per thread (estimated, or read from the compiled kernel when `measured`)."""
    shared_bytes: int
    spills: int = 0
    measured: bool = False

    def occupancy(self, arch: str | tuple[int, int] = DEFAULT_ARCH) -> Occupancy:
        return occupancy(arch, self.threads, min(self.registers, 255), self.shared_bytes)

    def __str__(self) -> str:
        how = "compiled" if self.measured else "estimated"
        occ = self.occupancy()
        spill = f", {self.spills} spilled" if self.spills else ""
        return (f"{how}: {self.registers} registers/thread{spill}, {self.shared_bytes / 1024:.1f} KB shared/block, "
                f"{self.threads} threads -> occupancy {occ.occupancy:.0%} ({occ.limiter}-limited)")


def estimate(kind: GroupKind, inputs: list[Node], outputs: list[Node], shape: tuple[int, ...],
             domain: ReductionDomain | None, reductions: int, config: Config, sm_count: int,
             matmul_tile: tuple[int, int, int, int, int] | None = None, itemsize: int = 4,
             split: int = 1, rows_contiguous: bool = False, branched: frozenset[Node] = frozenset()) -> Resources:
    """Estimated resources of a generated kernel (see the module docstring for the model);
    `rows_contiguous`: the looped reduction (Group.rows_contiguous; rows longer than
    Config.max_persistent_reduction loop too), whose accumulators are live too;
    `branched`: inputs read only in a cat's branches (`branched_inputs`), counted as two of them."""
    live = [n for n in inputs if n not in branched]
    if len(live) < len(inputs):
        live += sorted(branched, key=lambda n: len(n.shape), reverse=True)[:2]
    inputs = live
    args = 16 + 2 * (len(inputs) + len(outputs)) + sum(len(n.shape) for n in inputs)
    if kind is GroupKind.MATMUL:
        assert matmul_tile is not None
        bm, bn, bk, warps, stages = matmul_tile
        threads = warps * WARP_SIZE
        regs = args + bm * bn // threads + (bm * bk + bk * bn) * itemsize // 4 // threads
        shared = stages * (bm * bk + bk * bn) * itemsize
    elif kind is GroupKind.REDUCTION:
        assert domain is not None
        looped = rows_contiguous or long_rows(domain, config)
        block_m, block_r, warps = (looped_launch(domain, config, sm_count, rows_contiguous) if looped
                                   else reduction_launch(domain, config, sm_count, split))
        threads = warps * WARP_SIZE
        per_thread = max(1, block_m * block_r // threads)
        regs = args + per_thread * (len(inputs) + reductions * (2 if looped else 1) + 1)
        shared = 4 * block_m * warps * reductions  # cross-warp partial results
    else:
        block, warps = pointwise_launch(math.prod(shape), config, split)
        threads = warps * WARP_SIZE
        per_thread = max(1, block // threads)
        regs = args + per_thread * min(8, len(inputs) + len(outputs))
        shared = 0
    return Resources(threads=threads, registers=regs, shared_bytes=shared, spills=max(0, regs - 255))


def branched_inputs(kind: GroupKind, nodes: list[Node], inputs: list[Node], config: Config) -> frozenset[Node]:
    """The inputs a kernel of `nodes` reads only as parts of a cat that it reads in branches
    (Config.concat_branches_from; pointwise kernels only): one or two of them are live in a program
    at a time."""
    if config.concat_branches_from <= 0 or kind is not GroupKind.POINTWISE:
        return frozenset()
    readers: dict[Node, int] = {}
    for n in nodes:
        for a in set(n.input_nodes()):
            readers[a] = readers.get(a, 0) + 1
    ins, out = set(inputs), set()
    for n in nodes:
        if n.kind is OpKind.CONCAT:
            parts, _ = concat_parts(n)
            if len(parts) >= config.concat_branches_from:
                out |= {p for p in parts if p in ins and readers[p] == 1}
    return frozenset(out)


def resource_refusal(fused: Resources, parts: list[tuple[Resources, float]], config: Config) -> str | None:
    """Why a fusion breaks the resource limits, with the numbers; `parts` are the kernels it replaces
    with their bytes moved (occupancy is compared with their byte-weighted mean)."""
    if fused.registers > config.max_registers_per_thread:
        return (f"needs ~{fused.registers} registers/thread > max_registers_per_thread="
                f"{config.max_registers_per_thread} (it would spill)")
    if fused.shared_bytes > config.max_shared_bytes_per_block:
        return (f"needs {fused.shared_bytes / 1024:.1f} KB shared memory/block > max_shared_bytes_per_block="
                f"{config.max_shared_bytes_per_block / 1024:.0f} KB")
    total = sum(b for _, b in parts)
    if not parts or total <= 0:
        return None
    before = sum(r.occupancy().occupancy * b for r, b in parts) / total
    after = fused.occupancy().occupancy
    if after < (1.0 - config.max_occupancy_drop) * before:
        return (f"occupancy would fall to {after:.0%} from {before:.0%} (the replaced kernels', weighted by bytes): "
                f"more than max_occupancy_drop={config.max_occupancy_drop:.0%} below")
    return None


def evaluations_per_element(nodes: list[Node]) -> tuple[int, int]:
    """(evaluations, distinct): the ops and loads a generated kernel of `nodes` (topologically
    ordered) evaluates per element it writes, and how many distinct ops and loads that is.

    Each is evaluated once, except under a gather: a window (max pooling) evaluates its input at
    each of its taps, so what feeds it is computed again at every shifted index, and multiplicities
    compose (a window over a window over a cat of four branches evaluates each branch 81 times).
    A value read at the same index by several consumers counts once (codegen binds it to one
    variable); a cat evaluates each input once per element (under a guard)."""
    members = set(nodes)
    times: dict[Node, int] = {}
    total = distinct = 0
    for n in reversed(nodes):
        reach = times.get(n, 0) or 1  # a group output (or a node read only outside) is written once
        if n.kind in _COMPUTES:
            total += reach
            distinct += 1
        taps = window_taps(n)
        for a in n.input_nodes():
            if a in members:
                times[a] = max(times.get(a, 0), reach * taps)
            else:
                total += reach * taps  # a load
                distinct += 1
    return total, distinct


_COMPUTES = frozenset({OpKind.POINTWISE, OpKind.REDUCTION, OpKind.CONCAT, OpKind.WINDOW, OpKind.GATHER})


def window_taps(n: Node) -> int:
    """How many positions of its input a node reads per element it computes."""
    if n.kind is not OpKind.WINDOW:
        return 1
    kernel = pool_params(n)[0]
    return math.prod(kernel)


def recompute_refusal(nodes: list[Node], config: Config) -> str | None:
    """Why one kernel of `nodes` would recompute too much (Config.max_recomputed_evaluations)."""
    evaluations, distinct = evaluations_per_element(nodes)
    if evaluations - distinct > config.max_recomputed_evaluations:
        return (f"recomputation: the kernel would evaluate {evaluations} ops and loads per element it writes, "
                f"{evaluations - distinct} of them again at shifted positions (over max_recomputed_evaluations="
                f"{config.max_recomputed_evaluations})")
    return None


def walk_stored_order(groups: list[Group]) -> list[Group]:
    """Have each pointwise kernel whose results are all stored densely in one order other than
    row-major (the traced layout of a permuted result: convnext_tiny's `x.permute(0, 3, 1, 2)`
    scaled and added to the block input, stored channels_last) walk its domain in that memory
    order (Group.walk), so its stores and the reads of operands in the same layout are coalesced.
    Walked row-major, such a kernel ran at 470-520 GB/s on the H200 (run 96: 1.2 ms of convnext_tiny's
    call at batch 32). Groups with a walk already (the network layout's) are left as they are.
    Returns the groups given a walk."""
    walked = []
    for g in [p for h in groups for p in (h.parts if h.kind is GroupKind.HORIZONTAL else [h])]:
        if g.kind is not GroupKind.POINTWISE or g.walk is not None or not g.outputs:
            continue
        orders = {dense_order(o.shape, o.strides) if tuple(o.shape) == tuple(g.shape) else None for o in g.outputs}
        if len(orders) == 1 and (order := orders.pop()) is not None:
            g.walk = order
            walked.append(g)
    return walked
