"""When a recorded CUDA graph pays: the host costs a replay saves (launches, allocations) against
the ones it adds (input copies, output copies, the replay call), measured on an H200
(GPU_FACTS.md, benchmarks/host_overhead.py). CompiledGraph asks `graph_skip_reason` before it
records; a plan it says no to launches directly."""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamfuse.ir.graph import Node

if TYPE_CHECKING:
    from streamfuse.runtime.executable import Executable

GRAPH_NODE_US = 1.1
"""A kernel launched from a CUDA graph (H200, GPU_FACTS.md)."""
DIRECT_LAUNCH_US = 10.0
"""A kernel launched from Python, through streamfuse's direct path or ATen (measured 9.6-14 µs)."""
DIRECT_CALL_US = 13.0
"""Host cost a direct call pays once whatever its launches: input checks, the run loop's setup and
its output list. A one-kernel plan (bf16 Linear + GELU, batch 8) cost 35 µs per call launched
directly against its 10.6 µs kernel, where a CUDA graph's call costs ~22 µs (run 171; host_overhead.py:
24.4 µs for compiled(x) through a graph); less this, the model had one launch lose to the graph's
copies, and it did not. Run 173 (H100, benchmarks/graph_choice.py): one-kernel plans 37-45 µs direct
against 22-27 replayed, so the true figure is nearer 15-20; the model chose right on all nine plans."""
COPY_CALL_US = 7.0
"""Host cost of one copy or clone call (benchmarks/host_overhead.py: 6.5 and 7.9 µs)."""
COPY_NODE_US = 1.8
"""Host cost of pointing a graph's input copy node at a tensor (Config.input_copy_node;
benchmarks/host_overhead.py, run 46: 1.8 µs, against 5.9 for a cudaMemcpyAsync)."""
REPLAY_US = 4.0
"""Host cost of graph.replay() itself (benchmarks/host_overhead.py: 3.0-4.9 µs)."""


def copy_nodes_pay(inputs: int) -> bool:
    """Pointing one copy node per input costs less than one batched copy of all of them."""
    return 0 < inputs * COPY_NODE_US < COPY_CALL_US


def input_copy_us(inputs: int, copy_node: bool) -> float:
    """Host cost of bringing `inputs` tensors into a graph's static buffers."""
    if not inputs:
        return 0.0
    return inputs * COPY_NODE_US if copy_node and copy_nodes_pay(inputs) else COPY_CALL_US


COPY_BYTES_PER_US = 4.2e6 / 2
"""Device copy: bytes read + written at 4.2 TB/s, so each copied byte costs two."""
ALLOC_US = 2.5
"""torch.empty on the host (benchmarks/host_overhead.py: 2.3-2.5 µs)."""
VIEW_US = 1.0
"""Carving one fresh output out of the per-dtype buffer."""


def host_rng_reason(exe: Executable) -> str | None:
    """Why no CUDA graph may replay `exe` whatever it would save: random numbers drawn through ATen
    (an ATen step, or a kernel that failed to compile), whose offsets advance on the host. Asked
    before any kernel ran (graph_skip_reason) and again after a recording's warm-up, where a kernel
    may have failed (CompiledGraph._record)."""
    if exe.rng is not None and exe.draws_on_host():
        return ("the graph draws random numbers (dropout) through ATen: a replayed CUDA graph would repeat the "
                "first call's mask, so calls launch directly and each draws a fresh one")
    return None


def graph_estimate(exe: Executable) -> tuple[float, float, int]:
    """(µs a replay saves, µs it adds, bytes it copies) per call of `exe` against launching directly.

    A graph saves the host cost of the direct call, of every launch and allocation, but adds copies:
    inputs into its static buffers and (unless reuse_outputs) results out of them."""
    launches = exe.launches
    # launching directly allocates every intermediate and result on the host, per call
    allocations = sum(len(g.outputs) for g in exe.plan.groups if g.launches)
    saved = DIRECT_CALL_US + launches * (DIRECT_LAUNCH_US - GRAPH_NODE_US) + allocations * ALLOC_US
    # inputs the graph updates in place are read where they are (runtime/graphs.py): not copied
    written = set(exe.graph.written_inputs)
    tensors = [n for i, n in enumerate(exe.graph.inputs) if i not in written]
    copied_inputs = len(tensors)
    # the caller's outputs only: those written back into inputs stay inside the graph
    visible = [o for o in exe.graph.outputs[: exe.graph.user_outputs] if isinstance(o, Node)]
    if not exe.config.reuse_outputs:
        tensors += visible
    copy_bytes = sum(n.numel * n.itemsize for n in tensors)
    inputs_in = input_copy_us(copied_inputs, exe.config.input_copy_node)
    outputs = 0 if exe.config.reuse_outputs else len(visible)
    out_copy = 0.0 if exe.config.reuse_outputs else COPY_CALL_US
    cost = copy_bytes / COPY_BYTES_PER_US + inputs_in + out_copy + outputs * VIEW_US + REPLAY_US
    return saved, cost, copy_bytes


def graph_skip_reason(exe: Executable) -> str | None:
    """Why replaying a CUDA graph would not beat launching directly (graph_estimate), or None if it
    would. With tensors so large that the copies cost more than the host work saved, direct
    launches win."""
    rng = host_rng_reason(exe)
    if rng is not None:
        return rng
    launches = exe.launches
    if not launches:  # the direct call's own cost would otherwise "pay" for copies around an empty graph
        return "the plan launches no kernel (it returns its inputs, views of them or constants): nothing to replay"
    saved, cost, copy_bytes = graph_estimate(exe)
    if cost > saved:
        what = "one kernel launch" if launches == 1 else f"{launches} launches"
        return (f"copying inputs{'' if exe.config.reuse_outputs else ' and outputs'} ({copy_bytes / 2**20:.1f} MiB, "
                f"~{cost:.0f} µs) would cost more than the graph saves on {what} (~{saved:.0f} µs)")
    return None
