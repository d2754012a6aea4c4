"""Counter-based random numbers for training-mode dropout.

`native_dropout` is lowered (ir/lowerings.py) to `philox_rand` -> keep = rand >= p -> the scaled
select, all pointwise, so dropout fuses into its neighbours (a GEMM epilogue included). Each
`philox_rand` node draws uniform [0, 1) numbers from Philox at counters

    offset_of_this_call + base_of_this_node + flat_index_of_the_element

under one seed per compiled graph (`tl.rand(seed, counter)` in generated kernels). Every call
advances the offset past all the counters it used, so calls draw fresh masks; generated kernels
read the offset from device memory, which each call advances on the device (a kernel at its end),
so a replayed CUDA graph draws a fresh mask on every replay too. A given seed
reproduces the same sequence of masks (Config.seed; by default the seed is drawn from torch's
generator when the graph is built, so `torch.manual_seed` before compiling reproduces a run).
The reference executor draws from torch's Philox generator seeded with (seed, counter) instead:
deterministic as well, but not the same bits as the Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from streamfuse.ir.graph import Graph, Node

OP = "streamfuse.philox_rand.default"


@dataclass
class RngState:
    seed: int
    offset: int = 0
    """Counter base of the current call."""
    per_call: int = 0
    """Counters one call uses (rounded up to 16)."""
    offset_tensor: torch.Tensor | None = None
    """The counter base generated kernels read (one int64 on the graph's device), advanced by
    `per_call` on the device at the end of every call: a replayed CUDA graph advances it too, so
    each replay draws a fresh mask (runtime/executable.py)."""

    def advance(self) -> None:
        """The host-side base, which the reference executor's draws use (generated kernels read
        `offset_tensor`)."""
        self.offset += self.per_call

    def __repr__(self) -> str:
        return f"RngState(seed={self.seed}, offset={self.offset})"


_MASK64 = (1 << 64) - 1


def _mixed(key: int) -> int:
    """splitmix64's finalizer: every bit of `key` reaches every bit of the result. A CPU generator
    keeps only the low 32 bits of its seed (mt19937), and the call's counter base sits in the high 32
    (Executable.follow_torch_seed): seeding with the plain sum drew the same mask at every call."""
    key &= _MASK64
    key = ((key ^ (key >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    key = ((key ^ (key >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (key ^ (key >> 31)) >> 1  # manual_seed takes up to 2**63 - 1 here


def philox_rand(state: RngState | None, shape: list[int], base: int, device: torch.device) -> torch.Tensor:
    """Reference implementation (the NodeStep target): uniform [0, 1) float32 of `shape`."""
    assert state is not None, "philox_rand used before attach_rng() gave the graph its state"
    gen = torch.Generator(device=device)
    gen.manual_seed(_mixed(state.seed * 1_000_003 + state.offset + base))
    return torch.rand(shape, generator=gen, device=device, dtype=torch.float32)


philox_rand.__name__ = OP


def rand_nodes(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if n.op == OP]


def attach_rng(graph: Graph, seed: int | None) -> RngState | None:
    """Give the graph's philox_rand nodes one state and disjoint counter ranges; None without any."""
    nodes = rand_nodes(graph)
    if not nodes:
        return None
    existing = nodes[0].args[0]
    if isinstance(existing, RngState):
        return existing
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    state = RngState(seed=seed)
    base = 0
    for n in nodes:
        n.args = (state, n.args[1], base, n.args[3])
        base += n.numel
    state.per_call = (base + 15) // 16 * 16
    return state


def rand_node_args(node: Node) -> tuple[RngState, int]:
    state, _, base, _ = node.args
    assert isinstance(state, RngState) and isinstance(base, int)
    return state, base


def is_rand(node: Any) -> bool:
    return isinstance(node, Node) and node.op == OP
