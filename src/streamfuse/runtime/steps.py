"""Executable steps: one per planned group, each reading and writing slots of an environment.

A slot is a node's position in the graph; the environment is a list indexed by slot. Steps
run in plan order; after each step the slots nobody reads any more are released.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from streamfuse.codegen.kernel import KernelSource
from streamfuse.fusion.groups import Group
from streamfuse.ir.graph import Arg, Node, map_args
from streamfuse.ir.rng import RngState

Env = list[Any]


def resolve(value: Arg, env: Env, slot: dict[Node, int]) -> Any:
    return map_args(value, lambda n: env[slot[n]])


@dataclass
class _Call:
    """One node's call with its arguments pre-laid: constants in place, tensor slots patched in."""

    target: Any
    args: list[Any]
    kwargs: dict[str, Any]
    patches: list[tuple[int, int]]
    """(argument position, env slot) for top-level Node arguments."""
    nested: bool
    """Some Node sits inside a list argument: resolve the slow way."""
    node: Node
    out: int


def _prepare(node: Node, slot: dict[Node, int]) -> _Call:
    args = list(node.args)
    patches = [(i, slot[a]) for i, a in enumerate(args) if isinstance(a, Node)]
    nested = any(isinstance(a, (list, tuple)) and any(isinstance(x, Node) for x in _walk(a)) for a in args)
    nested |= any(any(isinstance(x, Node) for x in _walk(v)) for v in node.kwargs.values())
    target = node.target if node.target is not None else operator.getitem
    target = _STAND_INS.get(target, target)
    return _Call(target, args, dict(node.kwargs), patches, nested, node, slot[node])


def _view_or_reshape(x: torch.Tensor, size: Any) -> torch.Tensor:
    """aten.view, or a reshape where the input's strides differ from the traced ones (an ATen op may
    lay out its result otherwise than its fake kernel said): the values are the same in a
    functional graph, and the generated kernels that read the result take its strides."""
    try:
        return x.view(size)
    except RuntimeError:
        return x.reshape(size)


def _batch_norm_functional(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                           running_mean: torch.Tensor, running_var: torch.Tensor, training: bool, momentum: float,
                           eps: float) -> tuple[torch.Tensor, ...]:
    """aten._native_batch_norm_legit_functional (training-mode batch norm as AOTAutograd traces it) on
    CUDA through aten._batch_norm_with_update_functional, which picks cuDNN where eager's batch norm
    would: the traced op runs ATen's native kernels (statistics and transform: 3.4 ms of resnet50's
    batch-32 training step against cuDNN's 1.7 ms; the step went from 22.0 to 19.7 ms, H100, session 50).
    Same results in the same positions (output, saved mean, saved inverse std, new running mean and
    variance); cuDNN's extra workspace result is dropped."""
    if training and x.is_cuda:
        out, mean, invstd, _, new_mean, new_var = torch.ops.aten._batch_norm_with_update_functional.default(
            x, weight, bias, running_mean, running_var, momentum, eps)
        return out, mean, invstd, new_mean, new_var
    return torch.ops.aten._native_batch_norm_legit_functional.default(  # type: ignore[no-any-return]
        x, weight, bias, running_mean, running_var, training, momentum, eps)


_STAND_INS: dict[Any, Any] = {torch.ops.aten.view.default: _view_or_reshape,
                              torch.ops.aten._unsafe_view.default: _view_or_reshape,
                              torch.ops.aten._native_batch_norm_legit_functional.default: _batch_norm_functional}
"""Targets run through a stand-in with the same results: views that tolerate an ATen op's other
strides, and training batch norm on cuDNN."""

STAND_IN_NOTES: dict[Any, str] = {
    torch.ops.aten._native_batch_norm_legit_functional.default:
        "on CUDA as cuDNN's batch norm (aten._batch_norm_with_update_functional), as eager's runs",
}
"""What explain() says of an ATen step that runs through a stand-in of _STAND_INS."""


def _walk(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [y for x in value for y in _walk(x)]
    return [value]


@dataclass
class NodeStep:
    """Run the group's nodes one by one through torch: ATen/alias groups, and every group
    under the reference executor."""

    group: Group
    slot: dict[Node, int]
    calls: list[_Call] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.calls = [_prepare(n, self.slot) for n in self.group.nodes]

    def run(self, env: Env) -> None:
        for c in self.calls:
            args, kwargs = self.arguments(c, env)
            env[c.out] = c.target(*args, **kwargs)

    def arguments(self, c: _Call, env: Env) -> tuple[list[Any], dict[str, Any]]:
        """`c`'s positional and keyword arguments, with this call's tensors in place."""
        if c.nested:
            return list(resolve(c.node.args, env, self.slot)), {k: resolve(v, env, self.slot)
                                                                 for k, v in c.node.kwargs.items()}
        args = c.args.copy()
        for i, s in c.patches:
            args[i] = env[s]
        return args, c.kwargs


class ChannelsLastConvStep(NodeStep):
    """A 2-D convolution (one node, NCHW input and output) run through cuDNN in channels_last:
    the input is converted, the result converted back to the contiguous NCHW the plan expects
    (unless only generated kernels read it: `convert_back`).
    A weight the graph owns (a folded snapshot) is converted once here, and again when the snapshot
    is computed again in place (ir/fold.SnapshotWatch). A live parameter bound as a
    constant (`source`) is converted once too, into a buffer of the step's that the caller refreshes
    in place whenever the parameter's version counter moved (Executable.refresh_weights: an
    in-place update, an optimizer step or load_state_dict, is seen by the next call, replays of
    recorded CUDA graphs included); a weight passed as an input, or one without a version counter
    (made under inference_mode), is converted on every call (densenet121: 58 conversions per call,
    291 µs at batch 32 in run 90)."""

    def __init__(self, group: Group, slot: dict[Node, int], weight: torch.Tensor | None, convert_back: bool = True,
                 source: torch.Tensor | None = None):
        super().__init__(group, slot)
        (self.call,) = self.calls
        self.source: torch.Tensor | None = None
        if weight is None and source is not None and not source.is_inference():
            weight = source  # channels_last already (a 1x1 filter): read where it is, live
            if not source.is_contiguous(memory_format=torch.channels_last):
                self.source, self.version = source, source._version
        elif weight is not None and source is weight and not weight.is_inference() and \
                not weight.is_contiguous(memory_format=torch.channels_last):
            self.source, self.version = weight, weight._version  # an owned snapshot, refreshed in place (ir/fold.py)
        with torch.no_grad():
            self.weight = None if weight is None else weight.detach().contiguous(memory_format=torch.channels_last)
        self.convert_back = convert_back
        """False when every reader of the result is a generated kernel, which takes its input's
        strides at launch: the channels_last result is passed on as it is (one kernel fewer)."""

    def run(self, env: Env) -> None:
        c = self.call
        args, kwargs = self.arguments(c, env)
        args[0] = args[0].contiguous(memory_format=torch.channels_last)
        args[1] = self.weight if self.weight is not None else args[1].contiguous(memory_format=torch.channels_last)
        out = c.target(*args, **kwargs)
        env[c.out] = out.contiguous() if self.convert_back else out

    def refresh(self, force: bool = False) -> None:
        """Convert the live weight again if it changed in place since it was last converted (or
        `force`: a change no version counter saw, CompiledGraph.weights_changed)."""
        if self.source is not None and (force or self.source._version != self.version):
            assert self.weight is not None
            with torch.no_grad():
                self.weight.copy_(self.source)
            self.version = self.source._version


class HoistedStep:
    """A step whose results depend on constants only, computed once when the plan was built."""

    def __init__(self, group: Group):
        self.group = group

    def run(self, env: Env) -> None:
        return None


@dataclass
class KernelStep:
    """Launch one generated Triton kernel.

    On CUDA the first launch per argument specialization goes through Triton's JIT (which
    compiles and caches); later launches call the compiled kernel directly with a key computed
    the way Triton specializes (16-byte pointer alignment; ints equal to 1, divisible by 16, or
    beyond int32), which skips most of Triton's per-launch Python work."""

    group: Group
    source: KernelSource
    kernel: Any
    in_slots: list[int]
    out_slots: list[int]
    device: torch.device
    direct: bool = False
    """Launch compiled kernels directly (CUDA only; the interpreter goes through the JIT)."""
    rng: RngState | None = None
    """The graph's random-number state, for kernels that draw (dropout)."""
    scratch: list[torch.Tensor] = field(default_factory=list)
    """The kernel's scratch buffers (split-K workspace and counters), allocated once: each launch
    leaves them ready for the next, and a captured graph replays with the same addresses."""
    needs_allocator: bool = False
    """Builds tensor descriptors on the GPU (KernelSource.descriptors): Triton's allocator must be set."""
    pdl: bool = False
    """Launch with programmatic dependent launch (a KernelSource.pdl kernel right after another of
    ours on its stream: runtime/executable.mark_pdl_launches)."""
    fallback_slot: dict[Node, int] | None = None
    """Slots of the whole graph: where a kernel that fails to compile runs its ops through ATen."""
    failed: NodeStep | None = None
    """The group's ops run through ATen because the kernel failed to compile (`failure` says why)."""
    failure: str | None = None
    out_into: dict[int, int] = field(default_factory=dict)
    """Output position -> slot of the input it is stored into, in place (an optimizer's parameter:
    runtime/writeback.store_in_place proved nothing reads the old value afterwards)."""
    _compiled: dict[tuple, Any] = field(default_factory=dict)

    def run(self, env: Env) -> None:
        if self.failed is not None:
            self._run_failed(env)
            return
        args: list[Any] = []
        for s, dims in zip(self.in_slots, self.source.input_stride_dims, strict=True):
            t = env[s]
            args.append(t)
            if dims:
                strides = t.stride()
                args += [strides[d] for d in dims]
        outs = self.source.output_tensors(self.device)
        for pos, s in self.out_into.items():
            outs[pos] = env[s]
        args += outs
        if self.rng is not None:
            args += (self.rng.seed, self.rng.offset_tensor)
        args += self.scratch
        if self.needs_allocator:
            ensure_allocator()
        if self.direct:
            compiled = self._compiled.get(key := launch_key(args))
            if compiled is not None and triton_hooks_unset():
                grid = self.source.grid
                stream = torch._C._cuda_getCurrentRawStream(self.device.index or 0)
                compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, 1, stream, compiled.function,
                             compiled.packed_metadata, None, None, None, *args, *self.source.constexprs.values())
            elif compiled is None and self.fallback_slot is not None:
                try:
                    self._compiled[key] = self._launch(args)
                except Exception as exc:  # noqa: BLE001 - a kernel that does not compile runs through ATen
                    self._fall_back(exc, env)
                    return
            else:
                self._compiled[key] = self._launch(args)
        else:
            self._launch(args)
        for s, t in zip(self.out_slots, outs, strict=True):
            env[s] = t

    def _fall_back(self, exc: Exception, env: Env) -> None:
        from streamfuse.runtime.fallback import failure_text, warn_fallback

        assert self.fallback_slot is not None
        self.failure = f"kernel {self.source.fn_name} failed to compile or launch: {failure_text(exc)}"
        warn_fallback(f"group {self.group.name}", self.failure)
        self.failed = NodeStep(self.group, self.fallback_slot)
        self._run_failed(env)

    def _run_failed(self, env: Env) -> None:
        """The group through ATen; a result meant to be stored in place is copied there."""
        assert self.failed is not None
        self.failed.run(env)
        for pos, s in self.out_into.items():
            out = self.out_slots[pos]
            env[s].copy_(env[out])
            env[out] = env[s]

    def binary(self) -> Any | None:
        """A compiled kernel of this step (registers, shared memory, spills), once it has run on a GPU."""
        return next(iter(self._compiled.values()), None)

    def launch_options(self) -> dict[str, Any]:
        """Triton launch options and constexprs of this kernel (also runtime/precompile.py's)."""
        options: dict[str, Any] = {"num_warps": self.source.num_warps}
        if self.pdl:
            options["launch_pdl"] = True
        if self.source.num_stages is not None:
            options["num_stages"] = self.source.num_stages
        return options | self.source.constexprs

    def _launch(self, args: list[Any]) -> Any:
        return self.kernel[self.source.grid](*args, **self.launch_options())


def launch_key(args: list[Any]) -> tuple[Any, ...]:
    """How Triton specializes a launch on `args`: a tensor by 16-byte alignment, an int by
    equal to 1, divisible by 16, and within int32."""
    return tuple([a.data_ptr() % 16 == 0 if isinstance(a, torch.Tensor) else
                  (a == 1, a % 16 == 0, -(2**31) <= a < 2**31) for a in args])


_knobs: Any = None


def triton_hooks_unset() -> bool:
    """True when no Triton launch hook is installed (the direct path would bypass it)."""
    global _knobs
    if _knobs is None:
        from triton import knobs

        _knobs = knobs
    runtime = _knobs.runtime
    hooks = (runtime.launch_enter_hook, runtime.launch_exit_hook)
    return not any(getattr(h, "calls", h) for h in hooks)  # HookChain (triton >= 3.5) or None


def ensure_allocator() -> None:
    """A kernel that builds tensor descriptors asks Triton's allocator for global scratch at each
    launch (a few hundred bytes per program); install one backed by torch's caching allocator, on
    the launching stream, unless the caller has set their own. Triton keeps it per thread."""
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


def _torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")  # 512-byte aligned blocks


Step = NodeStep | KernelStep | HoistedStep


def make_kernel_step(group: Group, source: KernelSource, kernel: Any, slot: dict[Node, int],
                     device: torch.device, rng: RngState | None = None) -> KernelStep:
    assert group.kind.generated
    return KernelStep(
        group=group, source=source, kernel=kernel,
        in_slots=[slot[n] for n in source.inputs],
        out_slots=[slot[n] for n in source.outputs],
        device=device,
        direct=device.type == "cuda",
        rng=rng if source.rng else None,
        scratch=source.scratch_tensors(device),
        needs_allocator=source.descriptors and device.type == "cuda",  # the interpreter needs none
        fallback_slot=slot if device.type == "cuda" else None,  # the interpreter's errors are bugs to see
    )
