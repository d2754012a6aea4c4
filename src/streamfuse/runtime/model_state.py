"""The model-state checks a CompiledGraph makes at call entry (streamfuse.compile's path).

A plan computes the function the model computed when it was compiled: in that mode (train or eval),
under that autocast state, reading those parameters and buffers. A call made after the model was
switched to the other mode, or under another autocast state, or on CUDA after TF32 was withdrawn
where the plan baked it in, runs the model eagerly (with one warning per kind, until the state is
back); a parameter or buffer given new memory, or a parameter, buffer or
submodule replaced by another object, sends the model to eager for good (runtime/structure.py,
runtime/memory.PointerCheck). A call that wants gradients gets one warning: the results carry none.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from streamfuse.runtime.fallback import warn_fallback
from streamfuse.runtime.memory import PointerCheck
from streamfuse.runtime.structure import StructureWatch, describe_autocast


class ModelState:
    """Mixin of CompiledGraph (runtime/compiled.py): the attributes streamfuse.compile sets to describe
    the model as compiled, and what a call does when the model no longer matches them."""

    base: Any
    call: Any
    eager: Callable[..., Any] | None
    eager_reason: str | None
    _proven: bool

    def _init_model_state(self) -> None:
        self.bound_tensors: list[torch.Tensor] = []
        self.bound_pointers: PointerCheck | None = None
        """The model's parameters and buffers the plan reads, and their data pointers when compiled
        (streamfuse.compile; checked on every call: runtime/memory.PointerCheck)."""
        self.mode_source: torch.nn.Module | None = None
        """The nn.Module whose `training` flag the plan was compiled under (streamfuse.compile)."""
        self.structure: StructureWatch | None = None
        """Its submodules, parameters and buffers as compiled (streamfuse.compile): a replaced one
        makes the calls run eagerly (runtime/structure.py)."""
        self.compiled_training = False
        self._mode_warned = False
        self.autocast: tuple[Any, ...] | None = None
        """The autocast state the plan was captured under (streamfuse.compile; runtime/structure.py)."""
        self._autocast_warned = False
        self.tf32_baked: tuple[bool, bool] | None = None
        """(matmuls, convolutions): where the plan was built with TF32 allowed for float32 work it has
        (streamfuse.compile; runtime/structure.tf32_baked); None where nothing depends on it."""
        self._tf32_warned = False
        self.tracks_tf32 = False
        """streamfuse.compile's models only: the backend's graphs are guarded by Dynamo, which compiles
        again when the matmul TF32 setting changes."""
        self._grad_warned = False
        self._params_want_grad: bool | None = None
        """Some bound parameter requires grad (read at the first call made with grad enabled)."""

    def _replaced(self, what: str) -> None:
        """A parameter or buffer the plan reads was given new memory (`p.data = t`; `model.half()
        .float()` and other Module._apply conversions swap `.data`), or a parameter, buffer or
        submodule was replaced by another object (runtime/structure.py): the plan, and its recorded
        CUDA graphs, would read the old memory or compute the old function. The model runs eagerly
        from now on, with one warning."""
        self.bound_pointers = None
        self.structure = None
        self.eager_reason = f"{what}: compile again to run it compiled"
        warn_fallback("the model", self.eager_reason)
        self._proven = True

    def _in_other_mode(self, inputs: tuple[Any, ...], autocast: tuple[Any, ...] | None = None) -> Any:
        """The model was switched to the other mode (model.train() after compiling in eval mode, or
        back), or is called under another autocast state than it was compiled under (`autocast`:
        the call's): the plan computes the compiled function (dropout, batch-norm statistics, the
        dtypes autocast chose), so the call runs the model eagerly, with one warning per kind, until
        the state is back."""
        if autocast is not None:
            if not self._autocast_warned:
                self._autocast_warned = True
                warnings.warn(f"streamfuse: the model was compiled under {describe_autocast(self.autocast)} and is "
                              f"called under {describe_autocast(autocast)}: such calls run it eagerly (compile again "
                              "under the autocast state you call it with)", UserWarning, stacklevel=4)
        elif not self._mode_warned:
            self._mode_warned = True
            was, now = ("training", "eval") if self.compiled_training else ("eval", "training")
            warnings.warn(f"streamfuse: the model was compiled in {was} mode and is in {now} mode now: calls run it "
                          f"eagerly until it is back in {was} mode (compile again for {now} mode)", UserWarning,
                          stacklevel=4)
        return self.eager(*inputs)  # type: ignore[misc]

    def _note_tf32(self, graph: Any) -> None:
        """A plan built or a CUDA graph recorded now bakes in the TF32 settings of now (a batch bucket's
        plan, or the first call's recording, may come after the settings changed)."""
        if not self.tracks_tf32:
            return
        from streamfuse.runtime.structure import tf32_baked

        now = tf32_baked(graph, self.base.device.type)
        if now is not None:
            was = self.tf32_baked or (False, False)
            self.tf32_baked = (was[0] or now[0], was[1] or now[1])

    def _tf32_withdrawn(self, now: tuple[bool, bool] | None) -> bool:
        """TF32 was allowed when the plan was built and is not now, for work the plan has (`now`:
        runtime/structure.tf32_state()): its kernels and CUDA graphs still round to TF32, so the call
        runs the model eagerly (one warning) until it is allowed again. TF32 allowed only now changes
        nothing: the plan computes in float32, more exactly than asked."""
        baked = self.tf32_baked
        if baked is None or now is None or not ((baked[0] and not now[0]) or (baked[1] and not now[1])):
            return False
        if not self._tf32_warned:
            self._tf32_warned = True
            from streamfuse.runtime.structure import describe_tf32

            warnings.warn(f"streamfuse: the model was compiled with TF32 allowed for {describe_tf32(baked)} "
                          "(torch.backends.cuda.matmul / cudnn allow_tf32), and it is not now: the compiled "
                          "kernels and CUDA graphs would still round to TF32, so such calls run the model eagerly "
                          "(compile again with the settings you call it with)", UserWarning, stacklevel=4)
        return True

    def _warn_if_grad_wanted(self, inputs: Sequence[Any]) -> None:
        """Once per compiled model, at any call (not only the first): eager would have recorded a
        graph, since a parameter or an input requires grad, and the results carry none."""
        if self.call.out_spec is None:
            return  # the backend's graphs: AOTAutograd handles gradients around them
        if self._params_want_grad is None:
            self._params_want_grad = any(isinstance(t, torch.Tensor) and t.requires_grad
                                         for t in self.base.graph.constants.values())
        if self._params_want_grad or any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            self._grad_warned = True
            warnings.warn("streamfuse.compile is for inference: its results carry no gradients (backward() on them "
                          "raises, and a loss that adds them to other tensors gets no gradient through them). Call "
                          "it under torch.no_grad(); to train, use torch.compile(model, backend='streamfuse').",
                          UserWarning, stacklevel=4)
