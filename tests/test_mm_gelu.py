"""A tanh GELU after a Linear layer added by cuBLASLt's epilogue (ir/mm_gelu.py,
Config.addmm_gelu_epilogue): which activations the rewrite recognises (by evaluating them), which
it leaves alone, that the CPU never gets it (its `_addmm_activation` is the exact GELU), and on a GPU
that the rewritten plan matches eager."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from helpers import randn

import streamfuse
from streamfuse import Config
from streamfuse.bench.runner import exact_fp32
from streamfuse.ir.mm_gelu import gelu_into_addmm

nn = torch.nn
FUSED = "aten._addmm_activation.default"
ADDMM = "aten.addmm.default"


@pytest.fixture(autouse=True)
def ieee() -> Iterator[None]:
    with exact_fp32():
        yield


def gelu_new(x: torch.Tensor) -> torch.Tensor:  # Hugging Face's NewGELUActivation (GPT-2)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_sigmoid(x: torch.Tensor) -> torch.Tensor:  # the same function: 0.5 (1 + tanh z) = sigmoid(2z)
    return x * torch.sigmoid(2.0 * math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class MLP(nn.Module):
    """GPT-2's MLP: Linear, activation, Linear; `keep` also returns the pre-activation."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor], bias: bool = True, keep: bool = False) -> None:
        super().__init__()
        self.fc, self.proj, self.act, self.keep = nn.Linear(32, 96, bias=bias), nn.Linear(96, 32), act, keep

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        out = self.proj(self.act(h))
        return (out, h) if self.keep else out


def rewrite(model: nn.Module, x: torch.Tensor, config: Config) -> tuple[int, list[str]]:
    """Apply the rewrite to the compiled CPU plan's graph (every addmm a candidate); how many, and the ops."""
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config)
    graph = compiled.graph
    done = gelu_into_addmm(graph, [n for n in graph.nodes if n.op == ADDMM])
    return done, [n.op for n in graph.nodes]


@pytest.mark.parametrize("act", [gelu_new, gelu_sigmoid, gelu_tanh], ids=["hf-gelu-new", "sigmoid-form", "F.gelu-tanh"])
@pytest.mark.parametrize("shape", [(6, 32), (2, 5, 32)], ids=["2d", "3d"])
def test_each_spelling_of_the_tanh_gelu_joins_the_product(config: Config, act, shape) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    done, ops = rewrite(MLP(act).eval(), randn(*shape), config)
    assert done == 1
    assert ops.count(FUSED) == 1 and ops.count(ADDMM) == 1  # the second Linear keeps its addmm
    assert not any(op.split(".")[1] in ("tanh", "sigmoid", "gelu", "pow") for op in ops if op.startswith("aten."))


@pytest.mark.parametrize("act", [F.gelu, lambda x: x * torch.sigmoid(1.702 * x), torch.relu,
                                 lambda x: 2.0 * gelu_new(x)],
                         ids=["exact-gelu", "quick-gelu", "relu", "scaled-gelu"])
def test_other_activations_stay_as_they_are(config: Config, act) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    done, ops = rewrite(MLP(act).eval(), randn(6, 32), config)
    assert done == 0 and FUSED not in ops and ops.count(ADDMM) == 2


def test_a_product_read_elsewhere_or_without_bias_stays(config: Config) -> None:
    torch.manual_seed(0)
    x = randn(6, 32)
    assert rewrite(MLP(gelu_new, keep=True).eval(), x, config)[0] == 0  # the pre-activation is an output
    done, ops = rewrite(MLP(gelu_new, bias=False).eval(), x, config)  # mm: _addmm_activation needs the bias
    assert done == 0 and FUSED not in ops


def test_the_cpu_plan_never_takes_it(config: Config) -> None:
    """On the CPU `_addmm_activation` applies the exact GELU, so the setting must change nothing there."""
    torch.manual_seed(0)
    model, x = MLP(gelu_new).eval(), randn(2, 5, 32)
    with torch.no_grad():
        compiled = streamfuse.compile(model, (x,), config.replace(addmm_gelu_epilogue=True))
        assert FUSED not in [n.op for n in compiled.graph.nodes]
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_gpu_the_epilogue_matches_eager(config: Config, dtype: torch.dtype) -> None:
    """GPT-2-sized MLP at 128 tokens: the plan takes `_addmm_activation` and matches eager, and the
    backend (inference) does too."""
    torch.manual_seed(0)
    model = MLP(gelu_new).cuda().to(dtype).eval()
    model.fc, model.proj = nn.Linear(768, 3072).cuda().to(dtype), nn.Linear(3072, 768).cuda().to(dtype)
    x = randn(1, 128, 768, dtype=dtype, device="cuda")
    # cuBLAS forced: with "auto", bf16's first product may take the Triton template with the GELU
    # fused there (run 214, H100), and the rewrite only takes products left to cuBLAS
    on = config.replace(addmm_gelu_epilogue=True, matmul_strategy="cublas")
    with torch.no_grad():
        want = copy.deepcopy(model).double()(x.double()).to(dtype)
        compiled = streamfuse.compile(model, (x,), on)
        assert FUSED in [n.op for n in compiled.graph.nodes]
        tol = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2)}[dtype]
        torch.testing.assert_close(model(x), want, rtol=tol[0], atol=tol[1])  # eager: the tolerance fits
        torch.testing.assert_close(compiled(x), want, rtol=tol[0], atol=tol[1])
        backend = torch.compile(model, backend=streamfuse.make_backend(on))
        torch.testing.assert_close(backend(x), want, rtol=tol[0], atol=tol[1])


def test_the_scheduler_costs_the_fused_product_as_a_product(config: Config) -> None:
    """The stream scheduler's cost model counts the fused op's 2 M N K flops at the product's rate,
    as it did the addmm's (an opaque op would count one flop per element)."""
    from streamfuse.schedule.cost import _flops

    torch.manual_seed(0)
    with torch.no_grad():
        graph = streamfuse.compile(MLP(gelu_new).eval(), (randn(6, 32),), config).graph
    addmm = next(n for n in graph.nodes if n.op == ADDMM and n.shape == (6, 96))
    before = _flops(addmm)
    assert gelu_into_addmm(graph, [addmm]) == 1
    fused = next(n for n in graph.nodes if n.op == FUSED)
    assert before == 2 * 6 * 96 * 32 and _flops(fused) == before
