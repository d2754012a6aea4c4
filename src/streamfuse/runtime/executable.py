"""Executable: one fixed-shape plan made runnable, and `build_executable`, the flat driver of the
pipeline after capture, read top to bottom:

plan fusion -> generate kernels -> assign streams -> tune tiles -> lay out steps -> buffer lifetimes.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

import networkx as nx
import torch

from streamfuse.codegen.kernel import KernelSource, generate, use_pdl
from streamfuse.config import Config
from streamfuse.fusion.geometry import walk_stored_order
from streamfuse.fusion.groups import Group, GroupKind, Plan
from streamfuse.fusion.planner import plan_fusion
from streamfuse.fusion.strategy import choose_matmuls
from streamfuse.ir.constant_fold import fold_constants
from streamfuse.ir.conv_bias import bias_to_epilogue
from streamfuse.ir.conv_input import copy_strided_conv_inputs
from streamfuse.ir.conv_mm import convolutions_as_products
from streamfuse.ir.graph import Graph, Node
from streamfuse.ir.indexing import channels_last_strides, is_contiguous_meta
from streamfuse.ir.mm_bias import bias_into_addmm, split_addmm, split_candidates
from streamfuse.ir.mm_gelu import gelu_into_addmm
from streamfuse.ir.rng import RngState, attach_rng, is_rand
from streamfuse.ir.scatter_add import fold_scatter_add
from streamfuse.profile import known
from streamfuse.runtime.inputs import BadInput, move_cpu_snapshots, raise_bad_count, raise_bad_input, scalars_to_device
from streamfuse.runtime.precompile import precompile
from streamfuse.runtime.steps import ChannelsLastConvStep, HoistedStep, KernelStep, NodeStep, Step, make_kernel_step
from streamfuse.runtime.streams import StreamRunner
from streamfuse.runtime.writeback import scatter_into_fresh, store_in_place
from streamfuse.schedule.cost import group_bytes, group_flops
from streamfuse.schedule.plan import StreamSchedule, schedule_steps
from streamfuse.tune.ceilings import DeviceCeilings, builtin_for, ceilings_for
from streamfuse.tune.conv_layout import CONV, ConvLayoutChoice, choose_layout, eligible
from streamfuse.tune.network_layout import NetworkLayout, choose_network_layout, rows_contiguous_reductions
from streamfuse.tune.network_layout import apply as apply_network_layout

DEFAULT_SM_COUNT = 132  # H200; used for planning when no GPU is present


def resolve_executor(config: Config, device: torch.device) -> str:
    if config.executor != "auto":
        if config.executor == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("Config.executor='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                             "triton is imported; use executor='reference' or 'auto'")
        return config.executor
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    return "reference"


def build_executable(graph: Graph, config: Config, device: torch.device) -> Executable:
    executor = resolve_executor(config, device)
    sm_count = (torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda" else DEFAULT_SM_COUNT)
    target = "cuda" if device.type == "cuda" else "interpret"
    on_gpu = device.type == "cuda" and executor == "triton"
    if config.fold_constants:  # what depends on no input, parameter or buffer: computed once, here
        fold_constants(graph, config.fold_constants_max_bytes)
    if config.pointwise_conv_mm:  # a 1x1 convolution of a 1x1 image -> addmm or mm
        convolutions_as_products(graph, config.pointwise_conv_mm_max_rows)
    if config.linear_bias_addmm:  # mm + bias add -> addmm, the bias in cuBLAS's epilogue
        bias_into_addmm(graph)
    if config.fold_scatter_add:  # x + scatter into zeros -> the scatter into x
        fold_scatter_add(graph)
    clock = StageClock()
    if config.addmm_bias != "addmm":  # addmm -> mm, the bias added by the pointwise readers
        split = split_candidates(graph)
        if config.addmm_bias == "auto":
            if device.type == "cuda" and config.autotune and executor == "triton":
                from streamfuse.tune.addmm_split import prefer_mm

                split = [n for n in split if prefer_mm(n, config, device)]
            else:
                split = []
        split_addmm(graph, split)
    clock.lap("addmm timing")
    rng = attach_rng(graph, config.seed)  # dropout's counter-based random numbers (ir/rng.py)
    if device.type == "cuda":
        move_cpu_snapshots(graph, device)
    if config.conv_bias_epilogue:
        bias_to_epilogue(graph)  # ATen adds a cuDNN convolution's bias in a kernel of its own
    if config.conv_input_copy:
        copy_strided_conv_inputs(graph)  # ATen copies a strided input before cuDNN in a kernel of its own
    # 1. how each matmul runs (cost model on the device's ceilings, or measured), which nodes share
    #    a kernel, and why others do not
    ceilings = ceilings_for(device if device.type == "cuda" else None, config.cache_dir, config.calibrate)
    clock.lap("calibration")
    if on_gpu and config.profile_guided:
        from streamfuse.tune.autotune import measure_choices

        choices = measure_choices(graph, config, ceilings, device, lambda src: _load(src, config))
    else:
        choices = choose_matmuls(graph, config, ceilings)
    plan = plan_fusion(graph, config, choices, sm_count)
    clock.lap("fusion planning")
    if on_gpu and config.autotune and config.check_templates and not config.profile_guided:
        from streamfuse.tune.autotune import check_templates

        # the template's predicted products timed against cuBLAS; planned again where cuBLAS won
        choices, changed = check_templates(plan, choices, config, ceilings, device, lambda src: _load(src, config))
        plan = plan_fusion(graph, config, choices, sm_count) if changed else plan
        plan.matmul_choices = choices
        clock.lap("template check")
    if device.type == "cuda" and config.addmm_gelu_epilogue:  # CUDA only: the CPU's op is the exact GELU
        cublas = [n for n, c in choices.items() if c.strategy == "cublas"]
        if gelu_into_addmm(graph, cublas):
            kept = set(graph.nodes)
            choices = {n: c for n, c in choices.items() if n in kept}
            plan = plan_fusion(graph, config, choices, sm_count)
    # 2. each convolution's layout (measured under Config.conv_layout="auto" on CUDA; timed the way
    #    it will run: a result only generated kernels read stays channels_last), then the network's:
    #    channels_last throughout where that beats the one-by-one choice, the kernels before the
    #    convolutions storing their results so (before code generation, which writes them)
    owner = plan.group_of()
    convs = [g for g in plan.groups if len(g.nodes) == 1 and eligible(g.nodes[0], graph)]
    keep_cl = {g.name: config.conv_keep_channels_last and executor == "triton"
               and read_by_kernels_only(g.nodes[0], plan, owner) for g in convs}
    conv_layouts = {g.name: choose_layout(g.nodes[0], graph, config, device, convert_back=not keep_cl[g.name])
                    for g in convs}
    network = NetworkLayout(False, "the executor runs no generated kernels")
    if executor == "triton":
        network, conv_layouts = choose_network_layout(plan, owner, convs, conv_layouts, keep_cl, config, device)
        if network.channels_last:
            apply_network_layout(network, owner)
        if config.reduction_rows_contiguous:  # reductions over H and W of results kept channels_last
            kept = {g.nodes[0]: channels_last_strides(g.nodes[0].shape) for g in convs
                    if conv_layouts[g.name].layout == "channels_last" and keep_cl[g.name]}
            rows_contiguous_reductions(plan, owner, kept, config, sm_count)
    if executor == "triton" and config.walk_stored_order:
        walk_stored_order(plan.groups)  # a result stored permuted: its kernel walks that memory order
    measured = {g.id: us for g in convs if (us := conv_layouts[g.name].measured_us) is not None}
    clock.lap("convolution layouts")
    # 3. Triton source for each generated group (always, so explain() shows it on any machine)
    pdl = on_gpu and use_pdl(config, device)
    constants = graph.constant_nodes()
    sources = {g.id: generate(g, config, target, sm_count, pdl, constants) for g in plan.groups if g.kind.generated}
    clock.lap("code generation")
    # 4. streams and events for the launches (a pure function; planned on every device), a measured
    #    convolution's time in place of the cost model's estimate on the critical path; on the GPU
    #    the matmul template's tile is tuned (or read from the tuning cache), a kernel that runs
    #    beside others timed beside copies of itself (Config.autotune_concurrency)
    schedule = schedule_steps(plan, config, measured)
    clock.lap("stream schedule")
    wrong: set[int] = set()  # templates that disagreed with torch: their ops run through torch
    if on_gpu and config.autotune:
        from streamfuse.tune.autotune import tune_plan

        wrong = tune_plan(plan, sources, schedule.concurrency, config, device, lambda src: _load(src, config))
    clock.lap("matmul tuning")
    # 5. one step per group; generated kernels are compiled (cached by content hash) when used; a
    #    convolution runs in the layout chosen above
    slot = {n: i for i, n in enumerate(graph.nodes)}
    steps: list[Step] = []
    for g in plan.groups:
        choice = conv_layouts.get(g.name)
        if choice is not None and choice.layout == "channels_last":
            w = g.nodes[0].args[1]
            owned = w in graph.snapshots
            steps.append(ChannelsLastConvStep(g, slot, graph.constants[w] if owned else None,
                                              convert_back=not keep_cl[g.name],
                                              source=graph.constants.get(w)))
            continue
        if g.kind.generated and executor == "triton" and g.id not in wrong:
            kernel = _load(sources[g.id], config)
            step = make_kernel_step(g, sources[g.id], kernel, slot, device, rng)
            known.register(sources[g.id].fn_name, group_bytes(g), group_flops(g), step)
            steps.append(step)
        else:
            steps.append(NodeStep(g, slot))
    # 6. zero-copy views of weights are taken once, not on every call; programmatic dependent
    #    launch where the launch before a kernel on its stream is one of ours
    steps = _hoist_constant_aliases(plan, steps, graph)
    in_place = store_in_place(plan, steps, graph, slot) if config.store_in_place else set()  # runtime/writeback.py
    if config.store_in_place:  # the streams matter only where the call runs on several
        on_streams = runs_on_streams(device, executor, schedule)
        scatter_into_fresh(plan, steps, graph, schedule.stream_of if on_streams else {})
    mark_pdl_launches(steps, schedule, config.pdl_beside_others, config.pdl_after_convolutions)
    clock.lap("steps")
    # 7. the generated kernels compiled ahead of the first call, several at once
    failures = precompile(steps, device, config.compile_threads) if on_gpu and config.compile_threads else []
    clock.lap("kernel compile")
    exe = Executable(graph, plan, steps, sources, schedule, config, device, executor)
    exe.ceilings = ceilings
    exe.conv_layouts = conv_layouts
    exe.network_layout = network
    exe.rng = rng
    exe.use_in_place(in_place)
    if rng is not None and (rng.offset_tensor is None or rng.offset_tensor.device != device):
        rng.offset_tensor = torch.zeros(1, dtype=torch.int64, device=device)
    exe.sm_count = sm_count
    exe.precompile_failures = failures
    exe.through_torch = wrong
    exe.compile_times = clock.laps
    return exe


def runs_on_streams(device: torch.device, executor: str, schedule: StreamSchedule) -> bool:
    """A call runs its steps on the schedule's several CUDA streams (a StreamRunner); otherwise every
    step runs on the caller's stream, in order."""
    return device.type == "cuda" and executor == "triton" and schedule.streams > 1


class StageClock:
    """Seconds spent per named stage of a compile, in the order the stages ran."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.laps[stage] = self.laps.get(stage, 0.0) + now - self._last
        self._last = now


def mark_pdl_launches(steps: list[Step], schedule: StreamSchedule, beside_others: bool = True,
                      after_convolutions: bool = True) -> None:
    """A kernel compiled for programmatic dependent launch is launched with the attribute only where
    the launch before it on its stream is one of ours (that kernel writes nothing the early reads,
    constants, touch, and signals early) or, with `after_convolutions`, a convolution run through
    ATen (cuDNN's kernels write only the convolution's result; they do not signal, so the kernel
    can start only once their programs have exited, which still skips part of the launch gap).
    The first launch on a stream follows the caller's work (which may be writing a weight in place)
    and is launched plainly; its wait is then a no-op. Unless `beside_others`, a kernel the plan runs
    beside other streams' kernels (schedule concurrency > 1) is launched plainly too: its
    early-resident programs would hold their SM slots."""
    last_on: dict[int, Step] = {}
    for i in schedule.order if schedule.streams > 1 else range(len(steps)):
        step = steps[i]
        if isinstance(step, HoistedStep) or step.group.kind is GroupKind.ALIAS:
            continue  # launches nothing
        stream = schedule.stream_of.get(i, 0) if schedule.streams > 1 else 0
        if isinstance(step, KernelStep):
            alone = schedule.concurrency.get(i, 1) == 1
            prev = last_on.get(stream)
            after = isinstance(prev, KernelStep) or (after_convolutions and is_convolution_step(prev))
            step.pdl = step.source.pdl and after and (beside_others or alone)
        last_on[stream] = step


def is_convolution_step(step: Step | None) -> bool:
    """A step that runs one convolution through ATen (its last launch is a cuDNN kernel)."""
    return isinstance(step, NodeStep) and step.group.kind is GroupKind.ATEN and \
        step.group.nodes[0].op == CONV


def _load(source: KernelSource, config: Config) -> Any:
    from streamfuse.codegen.cache import load_kernel

    return load_kernel(source.fn_name, source.source, config.cache_dir)


def _hoist_constant_aliases(plan: Plan, steps: list[Step], graph: Graph) -> list[Step]:
    """Alias groups that read only constants run now; their results join graph.constants."""
    env: dict[Node, Any] = dict(graph.constants)
    out: list[Step] = []
    for group, step in zip(plan.groups, steps, strict=True):
        inputs = [a for n in group.nodes for a in n.input_nodes() if a not in group.nodes]
        if group.kind is GroupKind.ALIAS and inputs and all(a in env for a in inputs):
            local = {n: i for i, n in enumerate(inputs + group.nodes)}
            values: list[Any] = [env[a] for a in inputs] + [None] * len(group.nodes)
            NodeStep(group, local).run(values)
            for n in group.nodes:
                env[n] = graph.constants[n] = values[local[n]]
            out.append(HoistedStep(group))
        else:
            out.append(step)
    return out


_STRIDED_READERS = frozenset({GroupKind.POINTWISE, GroupKind.REDUCTION, GroupKind.HORIZONTAL})


def read_by_kernels_only(node: Node, plan: Plan, owner: dict[Node, Group]) -> bool:
    """Every reader of `node` is a generated pointwise/reduction kernel (which takes each input's
    strides at launch, so any memory layout reads correctly) and `node` is no graph output.
    `owner`: plan.group_of()."""
    return node not in plan.graph.output_nodes and bool(node.users) and \
        all(owner[u].kind in _STRIDED_READERS for u in node.users)


def group_dag(plan: Plan) -> nx.DiGraph:
    """Group id -> group ids that read what it writes."""
    owner = plan.group_of()
    dag: nx.DiGraph = nx.DiGraph()
    for g in plan.groups:
        dag.add_node(g.id)
        for n in g.nodes:
            for u in n.users:
                if owner[u].id != g.id:
                    dag.add_edge(g.id, owner[u].id)
    return dag


class Executable:
    """A fixed-shape plan with its steps; `run` executes it once, on one or several streams."""

    def __init__(self, graph: Graph, plan: Plan, steps: list[Step], sources: dict[int, KernelSource],
                 schedule: StreamSchedule, config: Config, device: torch.device, executor: str):
        self.graph = graph
        self.plan = plan
        self.steps = steps
        self.sources = sources
        self.schedule = schedule
        self.config = config
        self.device = device
        self.executor = executor
        self.slot = {n: i for i, n in enumerate(graph.nodes)}
        self.ceilings: DeviceCeilings = builtin_for(None)
        """The device ceilings the plan's cost model used (calibrated on CUDA)."""
        self.conv_layouts: dict[str, ConvLayoutChoice] = {}
        """Layout of each eligible convolution step, by group name (tune/conv_layout.py)."""
        self.network_layout: NetworkLayout | None = None
        """The activations' layout across the convolutions (tune/network_layout.py)."""
        self.sm_count = DEFAULT_SM_COUNT
        self.precompile_failures: list[str] = []
        """Kernels that did not compile ahead of the first call (runtime/precompile.py)."""
        self.through_torch: set[int] = set()
        """Ids of generated groups whose kernel disagreed with torch at tuning: their ops run through torch."""
        self.compile_times: dict[str, float] = {}
        """Seconds each stage of build_executable took (stats, explain)."""
        self.rng: RngState | None = None
        """Dropout's random-number state: advanced once per call, so each call draws a fresh mask."""
        self.input_slots = [self.slot[n] for n in graph.inputs]
        written = set(graph.written_inputs)
        self.scalar_inputs = ([i for i, n in enumerate(graph.inputs) if not n.shape and i not in written]
                              if device.type != "cpu" else [])
        """Positions of the 0-dim inputs of a device plan that it reads only: a caller may pass them on
        the host, and each call moves them (device_scalars; an input updated in place is never replaced)."""
        self._scalars: dict[int, tuple[Any, torch.Tensor]] = {}
        """The device copies device_scalars made last, by input position, with their values."""
        self.constants = [(self.slot[n], t) for n, t in graph.constants.items()]
        self.release = self.release_lists()
        self._donating: dict[tuple[frozenset[int], bool], list[list[int]]] = {}
        self.out_slots = [self.slot[o] if isinstance(o, Node) else None for o in graph.outputs]
        missing = [dst.name for _, dst in graph.writebacks if dst not in self.slot]
        if missing:
            raise ValueError(f"inputs written in place are not in the plan: {missing}")
        self.in_place: frozenset[int] = frozenset()
        """Indices into graph.writebacks that a generated kernel stores straight into the input
        (runtime/writeback.store_in_place): no copy at the end of the call."""
        self.writebacks: list[tuple[int, int]] = []
        """(output index, slot): the other writebacks, copied into their inputs at the end of every call."""
        self.use_in_place(frozenset())
        on_streams = runs_on_streams(device, executor, schedule)
        self.stream_runner = StreamRunner(self, schedule, device) if on_streams else None
        self.converted_weights = [s for s in steps if isinstance(s, ChannelsLastConvStep) and s.source is not None]
        """Convolutions holding a channels_last copy of a live weight (refresh_weights)."""

    def follow_torch_seed(self) -> None:
        """Dropout follows torch's random state, as eager's does: each call draws its counter base
        from torch's default generator (one int64), so `torch.manual_seed(s)` before two calls gives
        both the same masks (not eager's masks: another generator), and calls in between draw fresh
        ones. The kernels' seed argument stays (recorded CUDA graphs hold it); the base is written
        into the tensor they read before the call (one fill; plans without dropout skip this)."""
        if self.rng is None or self.config.seed is not None:  # a fixed Config.seed: its own sequence
            return
        self.rng.offset = int(torch.randint(0, 2**31 - 1, (1,)).item()) << 32
        if self.rng.offset_tensor is not None:
            self.rng.offset_tensor.fill_(self.rng.offset)

    def refresh_weights(self) -> None:
        """Convert again the live weights that changed in place since the last call (an optimizer
        step, load_state_dict): a version-counter compare per weight (ChannelsLastConvStep)."""
        for step in self.converted_weights:
            step.refresh()

    def run(self, inputs: Sequence[Any], keep_alive: list[Any] | None = None, one_stream: bool = False,
            donate: frozenset[int] = frozenset(), probe: list[int] | None = None) -> list[Any]:
        """Run once on already-checked inputs; returns the flat outputs. With `keep_alive` (a list),
        no buffer is released during the run and every buffer is appended to it (CUDA-graph capture:
        memory is then never reused within the graph, whatever stream reads it). `one_stream`
        issues every step on the current stream in plan order (benchmarks: the same kernels
        without the stream plan). `donate`: positions of inputs the run may release after their
        last reader, as it releases its own buffers; `inputs` must then be a list, and those
        positions are set to None in it (the caller hands its reference over: a training graph's
        copied inputs, whose landing buffers later kernels of its capture reuse). An input that is
        also an output is kept. Runs without autograd: the generated kernels record no graph, so
        results that carried one only through the ATen steps would give partial gradients.
        `probe` (a list; CUDA, plan order on the current stream): after each step, the device's
        allocated bytes plus the bytes of donated inputs not yet released are appended to it (the
        donated inputs stay the caller's: the run only drops its references), so that max(probe)
        less the allocated bytes before the run is what a capture of this run holds at most."""
        with torch.no_grad():
            return self._run(inputs, keep_alive, one_stream, donate, probe)

    def _run(self, inputs: Sequence[Any], keep_alive: list[Any] | None, one_stream: bool,
             donate: frozenset[int] = frozenset(), probe: list[int] | None = None) -> list[Any]:
        if self.converted_weights:
            self.refresh_weights()
        if self.rng is not None:
            self.rng.advance()
        env: list[Any] = [None] * len(self.graph.nodes)
        for s, t in zip(self.input_slots, inputs, strict=True):
            env[s] = t
        for s, t in self.constants:
            env[s] = t
        inputs_at = list(inputs) if probe is not None else []
        if donate:
            assert isinstance(inputs, list) and keep_alive is None, "donated inputs need a list and releases"
            for i in donate:
                inputs[i] = None
        multi = self.stream_runner is not None and not one_stream and probe is None
        releases = self.donating(donate, multi) if donate else None
        if probe is not None:
            self._probed(env, releases or self.release, probe, {self.input_slots[i]: inputs_at[i] for i in donate})
        elif multi:
            assert self.stream_runner is not None
            self.stream_runner.run(env, keep_alive is None, releases)
        else:
            for step, release in zip(self.steps, releases or self.release, strict=True):
                step.run(env)
                if keep_alive is None:
                    for s in release:
                        env[s] = None
        results = [env[s] if s is not None else o for s, o in zip(self.out_slots, self.graph.outputs, strict=True)]
        if self.writebacks:  # one multi-tensor copy on the caller's stream, after the streams joined
            torch._foreach_copy_([env[s] for _, s in self.writebacks], [results[i] for i, _ in self.writebacks])
        if self.rng is not None and self.rng.offset_tensor is not None:
            # after every kernel of the call (the stream runner joined its streams): the next call's
            # kernels draw from fresh counters, also when this call is a replayed CUDA graph
            self.rng.offset_tensor.add_(self.rng.per_call)
        if keep_alive is not None:
            keep_alive.extend(t for t in env if t is not None)
        return results

    def _probed(self, env: list[Any], releases: list[list[int]], probe: list[int], donated: dict[int, Any]) -> None:
        """The steps in plan order, with the memory count of `run`'s `probe` after each. `donated`:
        slot -> the caller's tensor; a storage counts until the last slot on it is released."""
        of_slot = {s: t.untyped_storage().data_ptr() for s, t in donated.items() if isinstance(t, torch.Tensor)}
        size = {of_slot[s]: t.untyped_storage().nbytes() for s, t in donated.items() if s in of_slot}
        holders = collections.Counter(of_slot.values())
        live = sum(size.values())
        allocated = torch.cuda.memory_allocated
        for step, release in zip(self.steps, releases, strict=True):
            step.run(env)
            probe.append(allocated(self.device) + live)
            for s in release:
                env[s] = None
                ptr = of_slot.pop(s, None)
                if ptr is not None:
                    holders[ptr] -= 1
                    live -= size[ptr] if holders[ptr] == 0 else 0

    @property
    def release_waits(self) -> int:
        """Waits the stream runner adds per call so that buffers read across streams are released
        within the call (schedule/release.py), in an ordinary call (without donated inputs)."""
        runner = self.stream_runner
        return runner.release_plan(runner.release).added_waits if runner is not None else 0

    def device_scalars(self, inputs: list[Any]) -> list[Any]:
        """`inputs` with the 0-dim host tensors among the plan's read-only 0-dim inputs on its device
        (scalars_to_device); `inputs` itself where the plan has no such input (no copy: per call)."""
        if not self.scalar_inputs:
            return inputs
        return scalars_to_device(inputs, self.scalar_inputs, self.device, self._scalars)

    def check_inputs(self, inputs: Sequence[Any], names: Sequence[str] | None) -> list[Any]:
        """Inputs as the plan expects them, or ValueError naming the bad one."""
        expected = self.graph.inputs
        if len(inputs) != len(expected):
            raise_bad_count(len(expected), len(inputs), names)
        checked = inputs if isinstance(inputs, list) else list(inputs)
        for i, (t, node) in enumerate(zip(inputs, expected, strict=True)):
            if (not isinstance(t, torch.Tensor) or t.shape != node.shape or t.dtype != node.dtype
                    or t.device != self.device):
                raise_bad_input(i, t, node, self.device, names)
            if not t.is_contiguous() and is_contiguous_meta(node):
                self._no_copy_of_written(i, node)
                checked = list(checked) if checked is inputs else checked
                checked[i] = t.contiguous()  # documented copy: the plan was traced with a contiguous input
        return checked

    def use_in_place(self, indices: set[int] | frozenset[int]) -> None:
        """Writebacks `indices` are stored in place by their kernels; the others are copied."""
        self.in_place = frozenset(indices)
        self.writebacks = [(i, self.slot[dst]) for k, (i, dst) in enumerate(self.graph.writebacks)
                           if k not in self.in_place]

    @property
    def stored_in_place(self) -> int:
        return len(self.in_place)

    def _no_copy_of_written(self, i: int, node: Node) -> None:
        if i in self.graph.written_inputs:
            raise BadInput(f"input {i} ({node.name}) is updated in place by the graph and must be contiguous, "
                           "as when it was compiled: an update of a contiguous copy would be lost")

    def contiguous(self, inputs: Sequence[Any]) -> list[Any]:
        """Inputs (already checked) with a documented copy where the plan was traced contiguous."""
        out = list(inputs)
        for i, (t, node) in enumerate(zip(inputs, self.graph.inputs, strict=True)):
            if not t.is_contiguous() and is_contiguous_meta(node):
                self._no_copy_of_written(i, node)
                out[i] = t.contiguous()
        return out

    def donating(self, donate: frozenset[int], multi: bool) -> list[list[int]]:
        """The release lists of a run that may release the inputs at positions `donate` (cached)."""
        key = (donate, multi)
        if key not in self._donating:
            order = self.stream_runner.schedule.order if multi and self.stream_runner is not None else None
            self._donating[key] = self.release_lists(order, donate)
        return self._donating[key]

    def release_lists(self, order: Sequence[int] | None = None, donate: Collection[int] = ()) -> list[list[int]]:
        """After step i, the slots whose last reader is step i when the steps run in `order` (plan
        order by default; the stream runner issues them in its schedule's order); never graph
        outputs, constants or inputs (but those at positions `donate`)."""
        last: dict[int, int] = {}
        for i in order if order is not None else range(len(self.steps)):
            step = self.steps[i]
            for node in step.group.nodes:
                last.setdefault(self.slot[node], i)
                for a in node.input_nodes():
                    last[self.slot[a]] = i
        keep = {self.slot[o] for o in self.graph.output_nodes}
        donated = {self.input_slots[i] for i in donate}
        keep |= {s for s in self.input_slots if s not in donated} | {s for s, _ in self.constants}
        release: list[list[int]] = [[] for _ in self.steps]
        for s, i in last.items():
            if s not in keep:
                release[i].append(s)
        return release

    @contextlib.contextmanager
    def writebacks_undone(self, inputs: Sequence[Any]) -> Iterator[None]:
        """Runs inside leave the tensors the plan writes back into (Graph.writebacks) as they were:
        a CUDA graph's warm-up runs the plan for real, and an optimizer step or a running statistic
        applied twice at recording would be silently wrong. The dropout counter base the kernels read
        is kept too: the warm-up advances it, and the recording call would otherwise draw its masks
        from other counters than follow_torch_seed set (run 105: torch.manual_seed did not reproduce
        the masks of a call that recorded a graph)."""
        targets = self._written_tensors(inputs, range(len(self.graph.writebacks)))
        if self.rng is not None and self.rng.offset_tensor is not None:
            targets.append(self.rng.offset_tensor)
        saved = [t.clone() for t in targets]
        try:
            yield
        finally:
            if targets:
                torch._foreach_copy_(targets, saved)

    @contextlib.contextmanager
    def restored_on_failure(self, inputs: Sequence[Any]) -> Iterator[None]:
        """A run that fails part-way may have stored some updates in place (store_in_place) before
        the caller falls back to running the model eagerly, which would apply them a second time:
        the tensors updated in place are saved first and put back if the run raises."""
        if not self.stored_in_place:
            yield
            return
        targets = self._written_tensors(inputs, sorted(self.in_place))
        saved = [t.clone() for t in targets]
        try:
            yield
        except BaseException:
            torch._foreach_copy_(targets, saved)
            raise

    def _written_tensors(self, inputs: Sequence[Any], indices: Iterable[int]) -> list[torch.Tensor]:
        """The tensors writebacks `indices` update: a constant, or the input passed in `inputs`."""
        out = []
        for k in indices:
            dst = self.graph.writebacks[k][1]
            out.append(self.graph.constants[dst] if dst in self.graph.constants
                       else inputs[next(i for i, n in enumerate(self.graph.inputs) if n is dst)])
        return out

    def draws_on_host(self) -> bool:
        """Some random numbers come from the host-side offset (an ATen step drawing them, or a kernel
        that failed to compile and runs its ops through ATen): a replayed CUDA graph would repeat
        them, where generated kernels read the offset the device advances."""
        for step in self.steps:
            group = getattr(step, "group", None)
            if group is None or not any(is_rand(n) for n in group.nodes):
                continue
            if not isinstance(step, KernelStep) or step.failed is not None:
                return True
        return False

    @property
    def launches(self) -> int:
        return sum(1 for g in self.plan.groups if g.kind is not GroupKind.ALIAS)
