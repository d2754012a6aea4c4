"""How each contraction runs: the Triton matmul template with its epilogue fused, or cuBLAS through
ATen followed by one generated epilogue kernel. Chosen per node by the cost model (below) or, with
`Config.profile_guided`, by measurement on the GPU (runtime/tuning passes measured times in).

The cost model is a roofline with a launch cost, on the device's ceilings (tune/ceilings.py):

    cuBLAS:  max(flops / rate, operand bytes / bw) + launch
             + epilogue kernel: (read the product + write the result) / bw + launch
    Triton:  max(flops / (rate * e), operand bytes / bw, K steps per program * step latency) + launch,
             e = triton_matmul_efficiency; a program waits on each K step's loads in turn, and
             split-K (geometry.fill_split) divides the steps where the output tiles are too few to
             fill the GPU; split over all SMs the template streams operands as fast as cuBLAS
             (H200, PERF.md run 18: 8.9 vs 9.3 us for bf16 8x4096x4096)

so the template wins where the epilogue's round trip through memory and its launch cost more than
the template's lower arithmetic rate: small and medium M, wide epilogues. A contraction without a
pointwise consumer always runs through cuBLAS (nothing to fuse), and so does a float32 product of
more than one row (the template's IEEE tl.dot has no tensor cores) unless measured faster; with
Config.float32_matmul="tf32x3" (TF32 off) the template's float32 products run on the tensor cores at
float32's accuracy, at a sixth of the 16-bit rate, and may win with or without an epilogue.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from streamfuse.config import Config
from streamfuse.fusion.geometry import fill_split
from streamfuse.fusion.legality import matmul_dims, matmul_operands, matmul_refusal
from streamfuse.ir.graph import Graph, Node
from streamfuse.ir.ops import OpKind, packet_name
from streamfuse.tune.ceilings import DeviceCeilings, builtin_for

Strategy = Literal["triton", "cublas"]


@dataclass(frozen=True)
class MatmulChoice:
    strategy: Strategy
    cublas_us: float
    """The product alone through cuBLAS."""
    epilogue_us: float
    """The separate epilogue kernel that cuBLAS needs (0 without an epilogue)."""
    triton_us: float
    """The template with the epilogue fused."""
    measured: bool
    """True where cublas_us and triton_us were measured on the GPU (profile_guided)."""

    rule: str = ""
    """Why the strategy differs from what the times alone say (forced, no epilogue, float32)."""

    @property
    def reason(self) -> str:
        how = "measured" if self.measured else "predicted"
        cmp = "<" if self.triton_us < self.cublas_us + self.epilogue_us else ">="
        rule = f" ({self.rule})" if self.rule else ""
        return (f"{how}: Triton template + epilogue {self.triton_us:.1f} us {cmp} cuBLAS {self.cublas_us:.1f} us "
                f"+ epilogue kernel {self.epilogue_us:.1f} us -> {self.strategy}{rule}")


def predict(node: Node, ceilings: DeviceCeilings, config: Config) -> MatmulChoice:
    """The cost model's times for both strategies (see the module docstring)."""
    batch, m, n, k = matmul_dims(node)
    a, b = matmul_operands(node)
    assert node.dtype is not None
    flops = 2.0 * batch * m * n * k
    operand_bytes = (a.numel + b.numel) * a.itemsize + node.numel * node.itemsize
    rate = ceilings.flops_per_us(node.dtype)
    bw = ceilings.bytes_per_us()
    launch = ceilings.graph_kernel_us
    cublas = max(flops / rate, operand_bytes / bw) + launch
    has_epilogue = bool(epilogue_users(node))
    epilogue = (2.0 * node.numel * node.itemsize / bw + launch) if has_epilogue else 0.0
    eff = config.triton_matmul_efficiency
    emulated = emulates_float32(node, config)
    # tf32x3: three TF32 products, TF32 at half the 16-bit tensor-core rate
    template_rate = ceilings.flops_per_us(torch.bfloat16) / 6.0 if emulated else rate
    k_steps = math.ceil(k / (256 if node.itemsize <= 2 else 128))  # the deepest K tile the tuner tries
    tiles = batch * math.ceil(m / (16 if m <= 16 else 128)) * math.ceil(n / 64)  # ~ codegen's heuristic tile
    steps = math.ceil(k_steps / fill_split(tiles, k_steps, ceilings.sm_count, config.matmul_max_split_k))
    triton = max(flops / (template_rate * eff), operand_bytes / bw, steps * config.triton_matmul_k_step_us) + launch
    choice = decide(cublas, epilogue, triton, measured=False, has_epilogue=has_epilogue, config=config,
                    tensor_cores=node.dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 or m == 1
                    or emulated, alone_ok=emulated)
    if node.op == "aten.bmm.default" and config.matmul_strategy == "auto" and choice.strategy == "triton":
        # tested in Triton's interpreter only: runs when forced or measured (profile_guided), not by default
        return MatmulChoice("cublas", cublas, epilogue, triton, False,
                            "the batched template has not been measured on a GPU yet")
    return choice


def emulates_float32(node: Node, config: Config) -> bool:
    """The template would run this float32 product on the tensor cores at float32's accuracy
    (Config.float32_matmul="tf32x3", TF32 off, more than one row) while cuBLAS runs it on the CUDA
    cores: then the template can win without an epilogue to fuse."""
    return (config.float32_matmul == "tf32x3" and node.dtype == torch.float32
            and not torch.backends.cuda.matmul.allow_tf32 and matmul_dims(node)[1] > 1)


def decide(cublas_us: float, epilogue_us: float, triton_us: float, measured: bool, has_epilogue: bool,
           config: Config, tensor_cores: bool = True, alone_ok: bool = False) -> MatmulChoice:
    """`tensor_cores`: False for float32 products, whose IEEE template runs on the CUDA cores: on the
    H200 it made 4 MLPs (d=1024, batch 1) 2-4x slower than cuBLAS (PERF.md run 16), so "auto" keeps
    cuBLAS for them unless a measurement (profile_guided) says otherwise. One-row products are the
    exception (True): their matrix-vector loop uses no tl.dot in any dtype. `alone_ok`: the template
    may win without an epilogue (emulates_float32)."""
    rule = ""
    if config.matmul_strategy != "auto":
        strategy: Strategy = config.matmul_strategy
        rule = f"forced by Config.matmul_strategy={strategy!r}"
    elif not has_epilogue and not alone_ok:
        strategy, rule = "cublas", "no pointwise epilogue to fuse"
    elif not tensor_cores and not measured:
        strategy, rule = "cublas", "float32: the template's IEEE products run without tensor cores"
    else:
        large = measured and triton_us >= config.matmul_template_margin_from_us
        margin = config.matmul_template_margin if large else 1.0
        strategy = "triton" if triton_us * margin < cublas_us + epilogue_us else "cublas"
        if margin != 1.0 and strategy == "cublas" and triton_us < cublas_us + epilogue_us:
            rule = f"a measured template this large must be {margin:g}x faster: Config.matmul_template_margin"
    return MatmulChoice(strategy, cublas_us, epilogue_us, triton_us, measured, rule)


def epilogue_users(node: Node) -> list[Node]:
    """Pointwise consumers of `node`, looking through reshapes (what the template would fuse)."""
    out: list[Node] = []
    for u in node.users:
        if u.kind is OpKind.VIEW and packet_name(u.op) in ("view", "_unsafe_view", "reshape"):
            out += epilogue_users(u)
        elif u.kind in (OpKind.POINTWISE, OpKind.BROADCAST):
            out.append(u)
    return out


def choose_matmuls(graph: Graph, config: Config, ceilings: DeviceCeilings | None = None,
                   measured: Mapping[Node, MatmulChoice] | None = None) -> dict[Node, MatmulChoice]:
    """A choice for every contraction the template supports; `measured` overrides the model."""
    ceilings = ceilings or builtin_for(None)
    choices: dict[Node, MatmulChoice] = {}
    for node in graph.ops():
        if node.kind is not OpKind.CONTRACTION or matmul_refusal(node) is not None:
            continue
        choices[node] = (measured or {}).get(node) or predict(node, ceilings, config)
    return choices
