"""A fused group -> Triton source (pointwise and persistent-reduction templates).

Every value is produced lazily by `Emitter.value(node, index)`: an input is a strided load at
that index, a view remaps the index (ir/indexing.py), a pointwise op combines its operands'
values at the broadcast index, a reduction reduces its input's row tile. Values are cached by
(node, index), so a shared producer is computed once per distinct index.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from streamfuse.codegen.gather import emit_embedding
from streamfuse.codegen.pointwise_ops import Operand, cast, convert, emit_pointwise, single_value_float64
from streamfuse.codegen.pooling import emit_window
from streamfuse.codegen.types import INT32_LIMIT, TL_DTYPE, compute_dtype, literal
from streamfuse.config import Config
from streamfuse.fusion.geometry import pointwise_launch
from streamfuse.fusion.groups import Group, GroupKind, ReductionDomain
from streamfuse.ir.graph import Node
from streamfuse.ir.indexing import (
    CHANNELS_LAST_ORDER,
    ZERO,
    Expr,
    Index,
    broadcast_index,
    concat_parts,
    contiguous_strides,
    delinearize,
    dense_order,
    linearize,
    view_input_index,
)
from streamfuse.ir.ops import OpKind, packet_name
from streamfuse.ir.rng import OP as RAND_OP
from streamfuse.ir.rng import rand_node_args

_HELPERS = {
    "_sf_max_nan": "\n\n@triton.jit\ndef _sf_max_nan(a, b):\n"
                   "    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)",
    "_sf_min_nan": "\n\n@triton.jit\ndef _sf_min_nan(a, b):\n"
                   "    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)",
    # float32 -> bfloat16 rounded to nearest even, as the GPU converts: Triton's interpreter (3.6)
    # truncates toward zero, up to one bfloat16 ulp off on every store (interpreter sources only)
    "_sf_bf16": "\n\n@triton.jit\ndef _sf_bf16(x):\n"
                "    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)\n"
                "    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000\n"
                "    kept = tl.where(x != x, bits, rounded)\n"
                "    return kept.to(tl.float32, bitcast=True).to(tl.bfloat16)",
}

_TO_BF16 = ".to(tl.bfloat16)"


def round_bf16_to_nearest(line: str) -> str:
    """`X.to(tl.bfloat16)` as `_sf_bf16(X)` (X: the operand before the call, a name, an attribute
    chain, a call or a parenthesized expression)."""
    while (at := line.find(_TO_BF16)) >= 0:
        start, depth = at, 0
        while start > 0:
            c = line[start - 1]
            if c in ")]":
                depth += 1
            elif c in "([":
                if depth == 0:
                    break
                depth -= 1
            elif depth == 0 and not (c.isalnum() or c in "_."):
                break
            start -= 1
        line = f"{line[:start]}_sf_bf16({line[start:at]}){line[at + len(_TO_BF16):]}"
    return line


@dataclass
class KernelSource:
    """Everything the runtime needs to launch one generated kernel."""

    fn_name: str
    source: str
    inputs: list[Node]
    input_stride_dims: list[tuple[int, ...]]
    """For each input, the dims whose strides follow its pointer in the signature."""
    outputs: list[Node]
    grid: tuple[int, ...]
    num_warps: int
    constexprs: dict[str, int] = field(default_factory=dict)
    ops: list[str] = field(default_factory=list)
    num_stages: int | None = None
    """Software-pipelining depth (the matmul template's buffered tiles); None is Triton's default."""
    rng: bool = False
    """Takes the seed and a pointer to the call's counter offset after the output pointers (dropout; ir/rng.py)."""
    scratch: list[tuple[int, torch.dtype]] = field(default_factory=list)
    """Zero-initialised buffers (numel, dtype) passed last, owned by the launch site and reused by
    every launch (the matmul template's split-K workspace and tile counters)."""

    pdl: bool = False
    """Compiled for programmatic dependent launch: it signals its dependents at its start and waits
    for the previous kernel on its stream (griddepcontrol) before reading anything that kernel may
    write. Launched with the attribute where runtime/steps.py finds it safe."""
    descriptors: bool = False
    """Builds tensor descriptors on the device (the matmul template with Config.matmul_tma): its
    launches need Triton's global-scratch allocator (runtime/steps.ensure_allocator)."""

    output_strides: list[tuple[int, ...] | None] = field(default_factory=list)
    """For each output, the strides the kernel stores it with (store_strides), None for row-major."""

    def output_tensors(self, device: torch.device) -> list[torch.Tensor]:
        """Fresh (uninitialised) outputs for one launch, in the layout the kernel stores."""
        strides = self.output_strides or [None] * len(self.outputs)
        return [torch.empty(o.shape, dtype=o.dtype, device=device) if st is None else
                torch.empty_strided(o.shape, st, dtype=o.dtype, device=device)
                for o, st in zip(self.outputs, strides, strict=True)]

    def scratch_tensors(self, device: torch.device) -> list[torch.Tensor]:
        return [torch.zeros(max(1, numel), dtype=dtype, device=device) for numel, dtype in self.scratch]


def use_pdl(config: Config, device: torch.device) -> bool:
    """Compile for programmatic dependent launch: Config.pdl on a GPU of compute capability 9.0
    (Hopper) or newer."""
    return config.pdl and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def generate(group: Group, config: Config, target: str, sm_count: int, pdl: bool = False,
             constants: frozenset[Node] = frozenset()) -> KernelSource:
    """Triton source for a generated group. `target` is "cuda" or "interpret". A MATMUL group's
    source comes with the heuristic tile (codegen/matmul.py); the tuner may pick another.
    `pdl`: compile for programmatic dependent launch (Hopper+, KernelSource.pdl); `constants` are
    nodes no kernel writes (weights and their views), which a PDL kernel may read before its wait."""
    if group.kind is GroupKind.POINTWISE:
        return _generate_pointwise(group, config, target, pdl)
    if group.kind is GroupKind.REDUCTION:
        from streamfuse.codegen.reduction import generate_reduction

        assert group.domain is not None
        return generate_reduction(group, group.domain, config, target, sm_count, pdl)
    if group.kind is GroupKind.HORIZONTAL:
        return _generate_horizontal(group, config, target, pdl)
    if group.kind is GroupKind.MATMUL:
        from streamfuse.codegen.matmul import generate_matmul, heuristic_tile, with_tile

        source = generate_matmul(group, target, tma=config.matmul_tma, pdl=pdl, constants=constants,
                                 float32=config.float32_matmul)
        return with_tile(source, group, heuristic_tile(group, config, sm_count))
    raise ValueError(f"group {group.name} of kind {group.kind.value} is not generated")


def needs_int64(group: Group, n: int) -> bool:
    return max([n] + [x.numel for x in group.inputs + group.outputs]) > INT32_LIMIT


def _generate_pointwise(group: Group, config: Config, target: str, pdl: bool) -> KernelSource:
    n = math.prod(group.shape)
    block, num_warps = pointwise_launch(n, config, group.split)
    pid = "tl.program_id(0).to(tl.int64)" if needs_int64(group, n) else "tl.program_id(0)"
    em = Emitter(group, target, masks={frozenset({"offs"}): "mask"}, pdl=pdl)
    em.branch_cats_from = config.concat_branches_from
    _pointwise_body(em, group, block, pid, out_offset=0)
    return em.finish("pw", ["BLOCK: tl.constexpr"], grid=(math.ceil(n / block),), num_warps=num_warps,
                     constexprs={"BLOCK": block})


def store_strides(node: Node) -> tuple[int, ...] | None:
    """The strides a generated kernel writes `node` with: its traced strides where they are a dense
    permutation other than row-major (SDPA's transposed operands, a permuted result), so that the
    tensor has the layout the traced graph recorded and the ATen ops after it (views above all)
    see what they saw at trace time; None for row-major (or a layout with gaps or overlaps, which
    a fresh tensor never needs)."""
    return tuple(node.strides) if dense_order(node.shape, node.strides) is not None else None


def store_offset(index: Index, node: Node) -> Expr:
    """Where element `index` of output `node` lies in memory (store_strides; row-major otherwise)."""
    strides = store_strides(node) or contiguous_strides(node.shape)
    out = ZERO
    for e, st, size in zip(index, strides, node.shape, strict=True):
        if size != 1:
            out = out + e * st
    return out


def memory_order(node: Node) -> tuple[int, ...] | None:
    """CHANNELS_LAST_ORDER where the kernel stores a 4-D `node` channels_last (store_strides), else None."""
    strides = store_strides(node)
    if strides is None or len(node.shape) != 4:
        return None
    live = [d for d in CHANNELS_LAST_ORDER if node.shape[d] != 1]
    return CHANNELS_LAST_ORDER if all(strides[a] > strides[b] for a, b in itertools.pairwise(live)) else None


def _pointwise_body(em: Emitter, group: Group, block: int, pid: str, out_offset: int) -> None:
    """Lines computing and storing `group`'s outputs for the tile of program `pid`."""
    n = math.prod(group.shape)
    em.lines.append(f"offs = {pid} * BLOCK + tl.arange(0, BLOCK)")
    if n % block:
        em.lines.append(f"mask = offs < {n}")
    else:
        em.full_masks.add("mask")
    order = group.walk  # (the network layout's or the stored order; every output has the domain's shape)
    chunk = cat_chunk(group, em.branch_cats_from)
    if chunk is not None:  # the cat dim, innermost in memory, walked in chunks of q (cat_chunk)
        dim, q = chunk
        walk = order or tuple(range(len(group.shape)))
        outer = [d for d in walk if d != dim]
        walked = delinearize(Expr.var("offs"), [group.shape[dim] // q] + [group.shape[d] for d in outer] + [q])
        coords = dict(zip(outer, walked[1:-1], strict=True))
        coords[dim] = walked[0] * q + walked[-1]
        index = em.hoist(tuple(coords[d] for d in range(len(group.shape))), "i")
    elif order is None:
        index = em.hoist(delinearize(Expr.var("offs"), group.shape), "i")
    else:  # offs walks memory order: element offs's coordinates, put back in logical dim order
        walked = delinearize(Expr.var("offs"), [group.shape[d] for d in order])
        index = em.hoist(tuple(walked[order.index(d)] for d in range(len(order))), "i")
    for j, out in enumerate(group.outputs):
        v = em.value(out, index)
        if chunk is not None:
            offset = store_offset(index, out).text
        elif (store_strides(out) is None) if order is None else order in (memory_order(out),
                                                                          dense_order(out.shape, out.strides)):
            offset = "offs"  # dense, and walked in its own memory order
        else:  # the traced layout: the element's own coordinates in the output's shape
            own = index if out.shape == tuple(group.shape) else delinearize(Expr.var("offs"), out.shape)
            offset = store_offset(own, out).text
        em.store(f"out{out_offset + j}_ptr + {offset}", store_cast(v, out), em.mask_for(frozenset({"offs"})))


CAT_CHUNK_MAX = 128
"""Widest chunk of the cat dim a program of a chunked walk covers (cat_chunk)."""


def cat_chunk(group: Group, branch_from: int) -> tuple[int, int] | None:
    """(dim, q) where a pointwise kernel reading a cat in branches (Config.concat_branches_from) would
    walk the cat dim innermost: densenet's cat of feature maps along the channels, stored
    channels_last. Walked in memory order, every block of BLOCK elements spans all the cat's inputs,
    so every program takes every branch (run 90: 25% of the copy bandwidth at batch 32). Walked as
    [dim // q, other dims in memory order, q] instead, with q the largest power of two dividing
    every input's extent along the dim (at most CAT_CHUNK_MAX), a block covers q consecutive
    elements along the dim (32 floats: one 128-byte line per warp) of BLOCK // q positions, all
    inside one input: one branch per program. None where that does not apply (q under 32 bytes,
    a cat dim that is not innermost, an output of another shape)."""
    if branch_from <= 0 or group.kind is not GroupKind.POINTWISE:
        return None
    walk = group.walk or tuple(range(len(group.shape)))
    live = [d for d in walk if group.shape[d] != 1]
    if not live or any(tuple(o.shape) != tuple(group.shape) for o in group.outputs):
        return None
    inner, widths = live[-1], []
    for n in group.nodes:
        if n.kind is OpKind.CONCAT and tuple(n.shape) == tuple(group.shape):
            parts, dim = concat_parts(n)
            if len(parts) >= branch_from and dim == inner:
                widths += [p.shape[dim] for p in parts]
    if not widths:
        return None
    g = math.gcd(*widths)
    q = min(g & -g, CAT_CHUNK_MAX)  # the largest power of two dividing every width
    itemsize = max(o.itemsize for o in group.outputs)
    if q * itemsize < 32 or q >= group.shape[inner]:
        return None
    return inner, q


def _generate_horizontal(group: Group, config: Config, target: str, pdl: bool) -> KernelSource:
    """One launch, one program-id range per part: `if pid < end0: part 0 elif pid < end1: part 1 ...`."""
    sizes = [math.prod(p.shape) for p in group.parts]
    block, num_warps = pointwise_launch(max(sizes), config, max(p.split for p in group.parts))
    wide = any(needs_int64(p, n) for p, n in zip(group.parts, sizes, strict=True))
    top = Emitter(group, target, masks={}, pdl=pdl)
    top.lines.append("pid = tl.program_id(0).to(tl.int64)" if wide else "pid = tl.program_id(0)")
    start, out_offset = 0, 0
    for k, (part, n) in enumerate(zip(group.parts, sizes, strict=True)):
        sub = Emitter(part, target, masks={frozenset({"offs"}): "mask"}, input_slot=top.input_slot)
        sub.counter = top.counter
        _pointwise_body(sub, part, block, "pid" if start == 0 else f"(pid - {start})", out_offset)
        start += math.ceil(n / block)
        top.lines.append(f"{'if' if k == 0 else 'elif'} pid < {start}:")
        top.lines += [f"    {line}" for line in sub.lines]
        top.helpers |= sub.helpers
        top.uses_rng |= sub.uses_rng
        top.counter = sub.counter
        out_offset += len(part.outputs)
    return top.finish("hz", ["BLOCK: tl.constexpr"], grid=(start,), num_warps=num_warps, constexprs={"BLOCK": block})


def store_cast(v: Operand, out: Node) -> str:
    assert out.dtype is not None
    return v.text if v.dtype == out.dtype else convert(v.text, v.dtype, out.dtype)


class Emitter:
    def __init__(self, group: Group, target: str, masks: dict[frozenset[str], str],
                 input_slot: dict[Node, int] | None = None, pdl: bool = False):
        self.group = group
        self.target = target
        self.pdl = pdl
        """Programmatic dependent launch (KernelSource.pdl): `finish` puts the dependents' signal
        and, unless the template placed it itself (`waits`), the grid-dependency wait first."""
        self.waits = False
        self.masks = masks
        self.members = set(group.nodes)
        self.input_slot = input_slot if input_slot is not None else {n: i for i, n in enumerate(group.inputs)}
        self.lines: list[str] = []
        self.cache: dict[tuple[Node, tuple[str, ...]], Operand] = {}
        self.reduced: dict[Node, Operand] = {}
        self.full_index: Index = ()
        self.domain: ReductionDomain | None = None
        self.counter = 0
        self.bound: dict[tuple[str, torch.dtype], Operand] = {}
        self.full_masks: set[str] = set()
        """Masks that are statically all-true (the extent divides the block): never applied."""
        self.helpers: set[str] = set()
        self.uses_rng = False
        """The kernel draws random numbers (dropout): it takes rng_seed and rng_offset_ptr (ir/rng.py)."""
        self.fixed: dict[Node, Operand] = {}
        """Values computed outside value()'s rules (the matmul template's product), at every index."""
        self.scratch_params: list[str] = []
        """Pointer parameters of the kernel's scratch buffers (KernelSource.scratch), after rng's."""
        self.branch_cats_from = 0
        """Config.concat_branches_from, where the index is one block of `offs` (pointwise kernels)."""
        self.guard: tuple[str, frozenset[str]] | None = None
        """While a cat's input is computed: the condition (and its index variables) under which the
        lanes read that input. Loads whose address moves with those variables are masked by it, so
        lanes that belong to another input never touch memory outside this one."""

    def hoist(self, index: Index, prefix: str) -> Index:
        """Bind each non-trivial coordinate to a named variable, for readable loads."""
        out = []
        for k, e in enumerate(index):
            if e.is_zero or e.text.isidentifier():
                out.append(e)
                continue
            name = f"{prefix}{k}"
            self.lines.append(f"{name} = {e.text}")
            out.append(Expr(name, e.deps))
        return tuple(out)

    def tmp(self, expr: str, dtype: torch.dtype) -> Operand:
        """Bind expr to a fresh variable; an expression already bound is reused (CSE)."""
        if (expr, dtype) in self.bound:
            return self.bound[(expr, dtype)]
        name = f"t{self.counter}"
        self.counter += 1
        self.lines.append(f"{name} = {expr}")
        self.bound[(expr, dtype)] = Operand(name, dtype)
        return self.bound[(expr, dtype)]

    def where_valid(self, x: str, fill: str) -> str:
        """x where the row tile is in bounds, `fill` elsewhere (no-op when the tile is always full)."""
        return x if "mask" in self.full_masks else f"tl.where(mask, {x}, {fill})"

    def mask_for(self, deps: frozenset[str]) -> str | None:
        if not deps:
            return None
        for key, mask in sorted(self.masks.items(), key=lambda kv: len(kv[0])):
            if deps <= key:
                return None if mask in self.full_masks else mask
        raise AssertionError(f"no mask covers index variables {sorted(deps)}")

    def value(self, node: Node, index: Index) -> Operand:
        if node in self.fixed:
            return self.fixed[node]
        if node.kind is OpKind.REDUCTION and node in self.members:
            return self.reduction(node)
        key = (node, tuple(e.text for e in index), self.guard[0] if self.guard else "")
        if key in self.cache:
            return self.cache[key]
        if node not in self.members:
            result = self.load(node, index)
        elif node.kind is OpKind.CONCAT:
            result = self.concat(node, index)
        elif node.kind is OpKind.WINDOW:
            result = emit_window(self, node, index)
        elif node.kind is OpKind.GATHER:
            result = emit_embedding(self, node, index)
        elif node.op == RAND_OP:
            _, base = rand_node_args(node)
            self.uses_rng = True
            counter = linearize(index, node.shape).text
            result = self.tmp(f"tl.rand(rng_seed, tl.load(rng_offset_ptr) + {base} + ({counter}))", torch.float32)
        elif node.kind in (OpKind.VIEW, OpKind.BROADCAST):
            result = self.value(node.args[0], view_input_index(node, index))  # type: ignore[arg-type]
        else:
            args = [self.value(a, broadcast_index(index, a.shape, node.shape)) if isinstance(a, Node) else a
                    for a in node.args]
            assert node.dtype is not None
            wide = torch.float64 if single_value_float64(node) else compute_dtype(node.dtype)
            if wide is not torch.float64:
                args = [_rounded(v, a) for v, a in zip(args, node.args, strict=True)]
            result = self.tmp(emit_pointwise(node, args, self.target, wide), wide)
        self.cache[key] = result
        return result

    def concat(self, node: Node, index: Index) -> Operand:
        """torch.cat: each input's value at the index shifted by its offset along the cat dim, computed
        under a guard (masked loads), then selected by where the index falls."""
        tensors, dim = concat_parts(node)
        assert node.dtype is not None
        wide = compute_dtype(node.dtype)
        offsets = list(itertools.accumulate((t.shape[dim] for t in tensors), initial=0))
        coord = index[dim]

        def part(k: int) -> Operand:
            shifted = index[:dim] + (coord + (-offsets[k]),) + index[dim + 1:]
            return self.value(tensors[k], shifted)

        if coord.text.isdigit():  # a fixed position along the cat dim: one input, no select
            k = bisect.bisect_right(offsets, int(coord.text)) - 1
            return Operand(cast(part(k), wide), wide)
        if len(tensors) > 1 and 0 < self.branch_cats_from <= len(tensors) and coord.deps == frozenset({"offs"}):
            return self.branched_concat(coord, offsets, part, wide)
        values = []
        for k in range(len(tensors)):
            guard = self.part_guard(coord, offsets, k)
            values.append(cast(self.guarded(guard, coord.deps, lambda k=k: part(k)), wide))
        text = values[-1]
        for k in range(len(tensors) - 2, -1, -1):
            text = f"tl.where({coord.text} < {offsets[k + 1]}, {values[k]}, {text})"
        return self.tmp(text, wide)

    def part_guard(self, coord: Expr, offsets: list[int], k: int) -> str | None:
        """The condition under which a lane's position `coord` along the cat dim falls in input k
        (None for the only input)."""
        conds = ([f"({coord.text} >= {offsets[k]})"] if k > 0 else []) + \
                ([f"({coord.text} < {offsets[k + 1]})"] if k < len(offsets) - 2 else [])
        return self.tmp(" & ".join(conds), torch.bool).text if conds else None

    def branched_concat(self, coord: Expr, offsets: list[int], part: Callable[[int], Operand],
                        wide: torch.dtype) -> Operand:
        """A cat of many inputs (Config.concat_branches_from): the block's range along the cat dim,
        then one `if` per input that only programs reaching it take, each selecting its lanes into
        one accumulator. Nothing computed inside a branch is reused outside it."""
        lo = self.tmp(f"tl.min({coord.text}, axis=0)", torch.int64).text
        hi = self.tmp(f"tl.max({coord.text}, axis=0)", torch.int64).text
        acc = f"cat{self.counter}"
        self.counter += 1
        self.lines.append(f"{acc} = tl.full([BLOCK], 0, {TL_DTYPE[wide]})")
        for k in range(len(offsets) - 1):
            start, cache, bound = len(self.lines), dict(self.cache), dict(self.bound)
            guard = self.part_guard(coord, offsets, k)
            value = cast(self.guarded(guard, coord.deps, lambda k=k: part(k)), wide)
            self.lines.append(f"{acc} = tl.where({guard}, {value}, {acc})")
            body = self.lines[start:]
            self.lines[start:] = [f"if ({hi} >= {offsets[k]}) & ({lo} < {offsets[k + 1]}):"] + \
                                 [f"    {line}" for line in body]
            self.cache, self.bound = cache, bound
        return Operand(acc, wide)

    def guarded(self, cond: str | None, deps: frozenset[str], fn: Callable[[], Operand]) -> Operand:
        """fn() with `cond` (over index variables `deps`) added to the load guard (see `guard`)."""
        outer = self.guard
        if cond is not None:
            text = cond if outer is None else self.tmp(f"{outer[0]} & {cond}", torch.bool).text
            self.guard = (text, deps | (outer[1] if outer else frozenset()))
        try:
            return fn()
        finally:
            self.guard = outer

    def store(self, ptr: str, value: str, mask: str | None) -> None:
        masked = "" if mask is None else f", mask={mask}"
        self.lines.append(f"tl.store({ptr}, {value}{masked})")

    def load(self, node: Node, index: Index) -> Operand:
        slot = self.input_slot[node]
        offset, deps = ZERO, frozenset[str]()
        for d, e in enumerate(index):
            if node.shape[d] != 1 and not e.is_zero:
                offset = offset + e * Expr(f"in{slot}_s{d}")
                deps |= e.deps
        mask = self.mask_for(deps)
        if self.guard is not None and deps & self.guard[1]:
            mask = self.guard[0] if mask is None else f"{mask} & {self.guard[0]}"
        ptr = f"in{slot}_ptr" if offset.is_zero else f"in{slot}_ptr + {offset.text}"
        text = f"tl.load({ptr})" if mask is None else f"tl.load({ptr}, mask={mask}, other=0)"
        assert node.dtype is not None
        wide = compute_dtype(node.dtype)
        if wide != node.dtype:
            text += f".to({TL_DTYPE[wide]})"
        return self.tmp(text, wide)

    def reduction(self, node: Node) -> Operand:
        if node in self.reduced:
            return self.reduced[node]
        src = node.args[0]
        assert isinstance(src, Node) and node.dtype is not None and self.domain is not None
        acc = compute_dtype(node.dtype)
        outer, self.guard = self.guard, None  # a reduction reads whole rows, whoever asks for it first
        try:
            loaded = self.value(src, self.full_index)
        finally:
            self.guard = outer
        x = loaded.text if loaded.dtype == acc else f"{loaded.text}.to({TL_DTYPE[acc]})"
        # an operand that does not vary along the reduced dims (broadcast or expanded there) loads as a
        # [BLOCK_M, 1] column or a scalar: spread it over the row tile first, or the sum would count it
        # once instead of row_size times (x[5, 1].expand(5, 8).sum(1) returned x; found by the fuzz test)
        x = self.tmp(f"tl.broadcast_to({x}, (BLOCK_M, BLOCK_R))", acc).text
        r = self.domain.row_size
        name = packet_name(node.op)
        if name in ("sum", "mean", "var"):
            total = self.tmp(f"tl.sum({self.where_valid(x, '0.0')}, axis=1)[:, None]", acc)
            result = total if name == "sum" else self.tmp(f"{total.text} / {r}.0", acc)
            if name == "var":
                correction = node.kwargs.get("correction")
                correction = 1 if correction is None else correction
                dev = self.tmp(self.where_valid(f"{x} - {result.text}", "0.0"), acc)
                result = self.tmp(f"tl.sum({dev.text} * {dev.text}, axis=1)[:, None] / "
                                  f"{literal(float(r - correction))}", acc)
        elif name in ("amax", "amin"):
            # NaN-propagating max/min (as ATen's), in one tree reduction
            helper, fill = ("_sf_max_nan", 'float("-inf")') if name == "amax" else ("_sf_min_nan", 'float("inf")')
            self.helpers.add(helper)
            result = self.tmp(f"tl.reduce({self.where_valid(x, fill)}, 1, {helper})[:, None]", acc)
        else:
            raise NotImplementedError(f"no reduction template for {node.op}")
        self.reduced[node] = result
        return result

    def finish(self, tag: str, constexpr_params: list[str], grid: tuple[int, ...], num_warps: int,
               constexprs: dict[str, int], num_stages: int | None = None) -> KernelSource:
        params, stride_dims = [], []
        for i, n in enumerate(self.group.inputs):
            dims = tuple(d for d, s in enumerate(n.shape) if s != 1)
            stride_dims.append(dims)
            params += [f"in{i}_ptr"] + [f"in{i}_s{d}" for d in dims]
        params += [f"out{j}_ptr" for j in range(len(self.group.outputs))]
        params += ["rng_seed", "rng_offset_ptr"] if self.uses_rng else []
        params += self.scratch_params
        params += constexpr_params
        lines = self.lines
        if self.target != "cuda" and any(_TO_BF16 in line for line in lines):
            lines = [round_bf16_to_nearest(line) for line in lines]
            self.helpers.add("_sf_bf16")
        if self.pdl:  # before any load: nothing a previous kernel writes may be read earlier
            lines = ["gdc_launch_dependents()", *([] if self.waits else ["gdc_wait()"]), *lines]
        body = "\n".join(f"    {line}" for line in lines)
        signature = ", ".join(params)
        digest = hashlib.sha256(f"{self.target}\n{signature}\n{body}".encode()).hexdigest()[:12]
        fn_name = f"sf_{tag}_{digest}"
        ops = [n.op for n in self.group.nodes]
        header = ["import triton", "import triton.language as tl"]
        if self.pdl:
            header.append("from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait")
        if "libdevice." in body:
            header.append("from triton.language.extra import libdevice")
        for helper in sorted(self.helpers):
            header.append(_HELPERS[helper])
        summary = ", ".join(o.removeprefix("aten.") for o in ops)
        source = (
            "\n".join(header) + "\n\n\n"
            + f"# {self.group.name}: {len(ops)} ops: {summary}\n"
            + f"@triton.jit\ndef {fn_name}({signature}):\n{body}\n"
        )
        return KernelSource(fn_name=fn_name, source=source, inputs=list(self.group.inputs),
                            input_stride_dims=stride_dims, outputs=list(self.group.outputs), grid=grid,
                            num_warps=num_warps, constexprs=constexprs, ops=ops, num_stages=num_stages,
                            rng=self.uses_rng, pdl=self.pdl,
                            output_strides=[store_strides(o) for o in self.group.outputs])


def _rounded(value: Any, arg: Any) -> Any:
    """A single-value chain's float64 result (pointwise_ops.single_value_float64) rounded to its
    node's float32 where an op that is not widened reads it: a comparison, a cast to an integer or a
    bool, a `where`. Eager decides these on the float32 value: float32(0.7) * 10 is 7.0 in float32 and
    6.99999988 in float64, so `.to(int32)` gave 6 and `!= 7` True; amin's backward compared the
    widened input with the float32 minimum, found no tie and divided by zero (NaN gradient; CPU fuzz,
    session 39)."""
    if isinstance(value, Operand) and value.dtype is torch.float64 and isinstance(arg, Node) \
            and arg.dtype is torch.float32:
        return Operand(cast(value, torch.float32), torch.float32)
    return value
