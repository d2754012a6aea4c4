"""Batch buckets of a CompiledGraph (runtime/compiled.py): a call at another batch than the compiled
one runs padded up to its bucket (Config.batch_buckets), where ir/batch.py proves the rows independent
along dim 0. The first call at another batch compares the model captured at that batch with the
compiled graph (`_check_function_of_batch`); a bucket's plan is captured again at the bucket's batch
(`_add_variant`); a plan that cannot serve other batches fixes the batch (`batch_reason`), and other
batches then get plans of their own (specializations).

The padding rows repeat the call's last real row (an op valid on the real rows is valid on them), and
each output is sliced back to the call's batch by the rows per batch element the analysis found
(`_slices`, which a recorded graph's runner follows: GraphRunner.slice_by).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

from streamfuse.ir.batch import batch_rows, padded_outputs
from streamfuse.ir.graph import Node
from streamfuse.runtime.executable import Executable
from streamfuse.runtime.fallback import failure_text
from streamfuse.runtime.inputs import BadInput, InputMismatch, pad_rows, raise_bad_count, raise_bad_input


class BatchBuckets:
    """Mixin of CompiledGraph: checking a call's batch, and running it padded to its bucket."""

    base: Executable
    call: Any
    config: Any
    base_batch: int
    batch_reason: str | None
    batch_check: Callable[[int], list[int | None]] | None
    recapture: Callable[[list[torch.Tensor]], Executable] | None
    _variants: dict[int, Executable]
    _slices: dict[int, list[int | None]]
    _runners: OrderedDict[int, Any]
    _ran: set[int]
    _note_tf32: Callable[[Any], None]  # runtime/model_state.py

    def _run_bucketed(self, inputs: list[Any]) -> list[Any]:
        """Without CUDA graphs: the compiled batch runs as is, another batch padded to its bucket."""
        batch = self._check_batch(inputs)
        if batch == self.base_batch:  # already checked: only the documented contiguous copy remains
            return self.base.run(self.base.contiguous(inputs))
        padded = self._bucket(batch)
        exe = self._variants[padded]
        staged = []
        for x, node in zip(inputs, exe.graph.inputs, strict=True):
            buf = torch.empty(node.shape, dtype=node.dtype, device=self.base.device)
            pad_rows(buf, x)
            staged.append(buf)
        if padded in self._ran:
            outs = exe.run(staged)
        else:
            try:
                outs = exe.run(staged)
            except (BadInput, torch.OutOfMemoryError):
                raise
            except Exception as exc:  # noqa: BLE001 - the bucket's plan fails where the compiled one ran
                self._bucket_failed(padded, exc)
            self._ran.add(padded)
        return [o[: batch * k] if k is not None and isinstance(o, torch.Tensor) else o
                for o, k in zip(outs, self._slices[padded], strict=True)]


    def _check_batch(self, inputs: Sequence[Any]) -> int:
        expected = self.base.graph.inputs
        if len(inputs) != len(expected):
            raise_bad_count(len(expected), len(inputs), self.call.input_names)
        if not inputs:
            return 0
        first = inputs[0]
        # a 0-d first input has no batch dimension: the batch is fixed (batch_rows gives a reason), and
        # the call runs the compiled one (run 85 on the GPU: -1 here sent the replay to a bucket "-1")
        batch = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() > 0 else self.base_batch
        if batch != self.base_batch and self.batch_reason is None and self.batch_check is not None:
            self._check_function_of_batch(inputs, batch)
        flexible = self.batch_reason is None
        if batch == self.base_batch or not flexible:
            # the common call: every input exactly as compiled (one shape compare per input, ~0.3 µs
            # against ~0.8 for the loop below; 32 inputs took 27 µs); anything else is judged below
            device = self.base.device
            for t, (dtype, shape) in zip(inputs, self._exact_flexible if flexible else self._exact_fixed, strict=True):
                if not (isinstance(t, torch.Tensor) and t.dtype is dtype and t.shape == shape and t.device == device):
                    break
            else:
                return batch
        for i, (t, node) in enumerate(zip(inputs, expected, strict=True)):
            ok = isinstance(t, torch.Tensor) and t.dtype == node.dtype and t.device == self.base.device
            if ok and flexible:
                ok = t.dim() > 0 and t.shape[0] == batch and t.shape[1:] == node.shape[1:]
            elif ok:
                ok = t.shape == node.shape
            if not ok:
                batch_only = isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[1:] == node.shape[1:]
                note = (" (only the batch dimension, dim 0, may change between calls)" if flexible else
                        f" (the batch size is fixed at {self.base_batch}: {self.batch_reason})" if batch_only
                        else "")
                raise_bad_input(i, t, _with_batch(node, batch) if flexible else node, self.base.device,
                                self.call.input_names, note)
        return batch

    @functools.cached_property
    def _exact_flexible(self) -> list[tuple[torch.dtype | None, tuple[int, ...] | None]]:
        """(dtype, shape) of each input that _check_batch's loop accepts at the compiled batch while the
        batch may change: the batch dimension at the compiled batch; None for a 0-d input (rejected)."""
        return [(n.dtype, (self.base_batch, *tuple(n.shape)[1:]) if n.shape else None) for n in self.base.graph.inputs]

    @functools.cached_property
    def _exact_fixed(self) -> list[tuple[torch.dtype | None, tuple[int, ...] | None]]:
        """(dtype, shape) of each input that _check_batch's loop accepts once the batch is fixed."""
        return [(n.dtype, tuple(n.shape)) for n in self.base.graph.inputs]

    def _check_function_of_batch(self, inputs: Sequence[Any], batch: int) -> None:
        """Once, at the first call of another batch: the model captured at that batch must be the
        compiled graph with the batch changed; otherwise the batch is fixed (batch_reason) and other
        batches get plans of their own."""
        check, self.batch_check = self.batch_check, None
        if not all(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch for t in inputs):
            self.batch_check = check  # not a batch change the padding would take: bad input decides
            return
        try:
            slices = check(batch)  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - not provably the same function: no padding
            self.batch_reason = f"{type(exc).__name__}: {exc}"[:300]
            return
        if len(slices) == len(self._slices[self.base_batch]):
            self._slices[self.base_batch] = slices  # the compiled plan serves smaller batches of its bucket
            # its graph, recorded by a call at the compiled batch, kept the slices of the analysis
            # of the device's graph, where the batch's size was folded into constants (zeros_like(x)
            # is not sliced there: [4, 16] came back for batch 3 on the H200)
            runner = self._runners.get(self.base_batch)
            if runner is not None:
                runner.slice_by(slices)


    def _bucket(self, batch: int) -> int:
        buckets = self.config.batch_buckets
        if batch > buckets[-1]:
            raise InputMismatch(f"input 0: batch {batch} exceeds the largest batch bucket {buckets[-1]}; "
                                f"add a bucket with Config(batch_buckets=...)")
        if batch < 1:
            raise InputMismatch(f"input 0: batch {batch} must be at least 1")
        padded = next(b for b in buckets if b >= batch)
        if padded not in self._variants:
            try:
                self._add_variant(padded)
            except Exception as exc:  # noqa: BLE001 - the batch cannot be padded: it gets its own plan
                self.batch_reason = f"batch {padded} could not be built ({type(exc).__name__}: {exc})"[:300]
                raise InputMismatch(self.batch_reason) from exc
        return padded

    def _add_variant(self, padded: int) -> None:
        assert self.recapture is not None
        examples = [torch.zeros((padded,) + n.shape[1:], dtype=n.dtype, device=self.base.device)
                    for n in self.base.graph.inputs]
        exe = self.recapture(examples)
        analysis = batch_rows(exe.graph)
        if isinstance(analysis, str):
            raise ValueError(f"batch {padded} cannot be padded: {analysis}")
        slices = exe.graph.padded_outputs if exe.graph.padded_outputs is not None else padded_outputs(exe.graph, analysis)
        base_out = [o.shape if isinstance(o, Node) else None for o in self.base.graph.outputs]
        for j, (o, rows) in enumerate(zip(exe.graph.outputs, slices, strict=True)):
            if isinstance(o, Node) and rows is not None and o.shape[1:] != base_out[j][1:]:  # type: ignore[index]
                raise ValueError(f"output {j} changes shape beyond dim 0 with the batch; batch is fixed")
        self._variants[padded] = exe
        self._slices[padded] = slices
        self._note_tf32(exe.graph)

    def _bucket_failed(self, padded: int, exc: Exception) -> NoReturn:
        """A batch bucket's plan (captured at that batch) failed on its first run, where the compiled
        one ran: at batch 1 a reshape of a transposed tensor stays a view, which ATen's group norm
        rejects though eager's composite makes it contiguous first (a helper's random networks,
        session 41). The batch is fixed from now on, so this call and every other batch gets a plan
        of its own, whose first call falls back to eager with a warning if it fails too."""
        self._variants.pop(padded, None)
        self._slices.pop(padded, None)
        self._runners.pop(padded, None)  # its recorded graph, if any (drop_graph)
        self.batch_reason = f"the plan for batch bucket {padded} failed on its first call: {failure_text(exc)}"[:300]
        raise InputMismatch(self.batch_reason) from exc



def _with_batch(node: Node, batch: int) -> Node:
    """The node as the call should have looked, for error messages."""
    from dataclasses import replace

    return replace(node, shape=(batch,) + node.shape[1:]) if batch > 0 else node
