"""The one typed config object: every tunable of streamfuse lives here, with its default.

Pass a `Config` to `streamfuse.compile(..., config=Config(...))`; nothing is read from
environment variables (Triton's own `TRITON_INTERPRET` aside, which Triton itself reads).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Executor = Literal["auto", "triton", "reference"]
MatmulStrategy = Literal["auto", "triton", "cublas"]
ConvLayout = Literal["auto", "native", "channels_last"]
AddmmBias = Literal["auto", "addmm", "split"]
Float32Matmul = Literal["ieee", "tf32x3"]


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "streamfuse"


def _default_compile_threads() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(32, cores))


@dataclass(frozen=True)
class Config:
    # --- fusion (fusion/) -------------------------------------------------------------
    fuse: bool = True
    """Master switch: False puts every node in its own kernel (useful to bisect)."""
    fusion_fuel: int | None = None
    """At most this many merges (thunder's "fuel"); None is unlimited. Bisect a bad fusion."""
    max_kernel_args: int = 64
    """Upper bound on tensors (inputs + outputs) one generated kernel takes."""
    max_ops_per_kernel: int = 256
    """Upper bound on IR nodes fused into one kernel."""
    fold_batchnorm: bool = True
    """Fold inference batch-norm into the preceding conv's weights at compile time; False runs it as an
    epilogue reading live parameters. streamfuse.compile watches the snapshot's sources' version
    counters and computes it again in place when one changed (an optimizer step, load_state_dict);
    torch.compile(backend="streamfuse") binds the graph again unfolded at the first call that finds one
    changed."""
    fold_weights: bool = True
    """Evaluate once, at compile time, what an inference graph computes from parameters and buffers
    alone (weights cast under autocast, weight_norm / spectral_norm, position tables from a buffer),
    kept as snapshots watched like fold_batchnorm's (ir/weight_fold.py)."""
    fold_weights_max_bytes: int = 1 << 30
    """Memory the snapshots of fold_weights may take in all, per compiled model (autocast's bfloat16
    copies of a float32 model's weights take half its size); past it the rest is computed per call."""
    fold_constants: bool = True
    """Evaluate once, at compile time, the ops that depend on no input, parameter or buffer (a shifted-
    window attention mask built from zeros and literals, a roll's arange/fmod index), and keep their
    results as constants (ir/constant_fold.py; swin_t at batch 1: 481 launches per call without)."""
    fold_constants_max_bytes: int = 16 * 1024 * 1024
    """Largest result fold_constants keeps (larger ones run on every call: a materialized broadcast
    would hold memory for good)."""
    linear_bias_addmm: bool = True
    """A Linear layer traced as mm + bias add (torch.export over a 3-D/4-D activation) becomes addmm,
    as AOTAutograd traces it: cuBLAS adds the bias in its GEMM epilogue (ir/mm_bias.py)."""
    fold_scatter_add: bool = True
    """add(x, index_put(zeros, indices, values, accumulate=True)) becomes index_put(x, indices, values,
    accumulate=True): a tied weight's two gradients (GPT-2's word embedding and LM head) summed in one
    buffer instead of three, run in place where x is a buffer of the call (ir/scatter_add.py)."""
    embedding_backward: bool = True
    """The backend keeps an embedding's gradient as ATen's embedding_dense_backward, eager's kernel,
    which sums repeated indices in parallel, instead of torch's decomposition into an accumulating
    index_put into zeros, which sums them one after another (BERT's token types, all one index: 502
    µs per training step for its three embeddings, run 222). A tied weight's sum still folds into
    one scatter (fold_scatter_add). capture/decomp.py, ir/scatter_add.py."""
    addmm_bias: AddmmBias = "auto"
    """Where an `addmm`'s bias is added when every reader of the product is a pointwise op (which can
    add it for free: it reads the product anyway). "addmm": by cuBLAS, in its GEMM epilogue. "split":
    the product runs as `mm` and the readers' kernel adds the bias, as Inductor does: cuBLAS then
    picks its kernel for a plain product (split-K where the output tiles are too few to fill the
    GPU), which its bias epilogue can rule out (GPT-2's 3072 -> 768 projection at 8x128 tokens: run
    90). "auto": on CUDA with `autotune`, both products are timed once per shape, dtype and TF32
    setting (cached in cache_dir) and mm kept where it is faster by `addmm_split_margin`; otherwise
    addmm (convnext_tiny's Linear layers ran 10% faster as addmm in run 83)."""
    addmm_split_margin: float = 0.05
    """Fraction by which `mm` must beat `addmm` for addmm_bias="auto" to split (timing noise)."""
    addmm_gelu_epilogue: bool = True
    """On CUDA, a tanh-approximated GELU that alone reads a Linear layer's product (GPT-2's MLPs) is
    added by cuBLASLt in the GEMM epilogue (`_addmm_activation`, ir/mm_gelu.py) where the product runs
    through cuBLAS, instead of by a kernel of its own. Run 215 (H100, GPT-2 prefill, off -> on): bf16
    591.7 -> 576.8 us at batch 1 and 1529.3 -> 1460.1 at 8 x 128; float32 (TF32 off) unchanged
    (1671.1 / 1675.7 with the same 98-kernel plan at batch 1, 6631.2 / 6634.4 at 8 x 128)."""
    pointwise_conv_mm: bool = True
    """A convolution over a 1x1 image with a 1x1 filter (a squeeze-and-excitation block's two FC
    layers) runs as the product it is, addmm or mm, instead of a cuDNN convolution (ir/conv_mm.py),
    over at most pointwise_conv_mm_max_rows images. Run 216 (H100, batch 1, fp32): efficientnet_b0
    481.5 -> 436.2 us, mobilenet_v3_small 257.5 -> 236.4, mobilenet_v3_large 345.2 -> 339.6."""
    pointwise_conv_mm_max_rows: int = 8
    """Most images (product rows) for pointwise_conv_mm: the SE chain alone as products took 2x the
    cuDNN chain at batch 32 (run 216: 24.6 against 12.0 us for 32 -> 8 -> 32 channels) and 0.75-0.8x of
    it at batch 1; batches 2-8 are the GEMV-like regime of batch 1 (not measured)."""
    product_row_alignment: bool = True
    """With fold_weights, an mm / addmm whose result rows are not a whole number
    of 16 bytes (GPT-2's LM head: 50257 columns), over a weight on a CUDA device, runs over the weight
    padded with zero columns, evaluated once (ir/pad_mm.py), and hands on the [M, N] slice of its
    result (a graph output: a contiguous copy), so cuBLAS can take its aligned kernels. Runs 216-221
    (H100, 1024 x 768 x 50257): 837 -> 131 us per product in bf16; GPT-2 prefill at 8 x 128 from 0.63x
    to 1.07x of reduce-overhead in bf16, and 1.13x in float32 with TF32."""
    conv_bias_epilogue: bool = True
    """A convolution's bias is added by the pointwise kernel after it instead of by ATen, which adds
    it in a kernel of its own after cuDNN's (ir/conv_bias.py): where every reader is pointwise."""
    conv_input_copy: bool = True
    """A convolution's input that is neither NCHW- nor channels_last-dense (a channel slice:
    ShuffleNet's `chunk`) is copied by a generated kernel instead of by ATen before cuDNN, so the
    convolution can join the network's channels_last layout (ir/conv_input.py)."""
    merge_sibling_convolutions: bool = False
    """Convolutions reading the same input with the same geometry, whose weights are compile-time
    snapshots (batch-norm folded), run as one convolution over their stacked filters, each result a
    channel slice of it (an inception block's 1x1 convolutions: ir/merge.py). Off until measured on
    the GPU."""
    horizontal_fusion: bool = True
    """Pack independent small pointwise kernels into one launch."""
    horizontal_max_elements: int = 262144
    """A pointwise kernel is "small" (worth packing) up to this many elements: about what it takes
    to give every SM of an H200 two programs of 1024 elements."""
    max_horizontal_parts: int = 64
    """At most this many kernels in one packed launch (their tensors also count against max_kernel_args)."""
    max_recomputed_evaluations: int = 32
    """A window (pooling) fused over its producers recomputes them at each tap, and chained
    windows multiply that. A fusion whose kernel would evaluate more than this many ops and loads
    per element beyond one evaluation of each is refused (fusion/geometry.py). One 3x3 pool over a
    bias + ReLU epilogue recomputes 32 (the ResNet stem's, kept); GoogLeNet's two pools over a 4-way
    cat recomputed 1,369, and that kernel took 496 µs on the H200 where the unfused kernels take a
    few. At 64 (until session 25), Inception's and GoogLeNet's branch pools recomputed their block's
    4-way cat + bias + ReLU at all 9 taps (56-64) beside the kernel that stores that cat; at 32 the
    cat kernel takes the branches' epilogues and the pool reads the stored cat: 178 -> 169 launches
    for inception_v3, 108 -> 101 for googlenet, other suite vision models unchanged (CPU plans)."""
    concat_branches_from: int = 5
    """A cat of at least this many inputs (0: never), in a pointwise kernel, reads each input in a
    branch of its own that only the programs whose block reaches that input take, and selects into
    one accumulator: per element one load instead of one masked load per input, and registers that
    do not grow with the inputs (densenet121's layers read a cat of up to 32; the occupancy estimate
    refused 41 fusions there). Each program pays two block-wide reductions for its range along the
    cat dim. Run 89 (H200, densenet121): 1337.7 -> 1208.5 µs at batch 1, 7204.6 -> 5249.4 at batch 32."""
    walk_stored_order: bool = True
    """A pointwise kernel whose results are all stored densely in one non-row-major order (the traced
    layout of a permuted result) walks its domain in that memory order, so its stores and same-layout
    reads are coalesced (fusion/geometry.walk_stored_order; convnext_tiny's layer-scale + residual
    kernels ran at 470-520 GB/s walked row-major on the H200, run 96)."""
    max_persistent_reduction: int = 16384
    """Largest reduced extent (elements per row) kept in registers in one pass. Longer rows take
    the looped reduction where Config.long_row_reduction allows it and the kernel needs one pass
    (sums, means, maxima and minima of values that need no reduction of the kernel:
    fusion/geometry.loopable); otherwise they run through ATen (recorded as a refusal)."""
    sibling_reductions: bool = True
    """After producer/consumer merging, reductions over one domain that read the same full-size
    input and depend on each other in neither direction merge into one kernel, which reads the
    input once (a batch norm's backward sums of the gradient and of the gradient times the centred
    input; fusion/planner._merge_sibling_reductions), and so do reductions over one domain whose
    full-size inputs are all results or inputs of one other kernel (a layer norm's weight and bias
    gradients, sums over the batch and sequence dims of what its row kernel reads and writes; all are
    in memory then, so no tensor lives longer). False: each keeps its own kernel."""
    long_row_reduction: bool = True
    """Rows longer than max_persistent_reduction (a training batch norm's sums over N, H and W in
    its backward: 100,352 elements per channel in resnet50's first stage at batch 32) run as a
    looped reduction with one row per program, split across programs where the rows alone do not
    fill the GPU, with their prologue fused (the gradient and normalised input it multiplies) so
    the full-size intermediates are not written out for ATen's sum to read. False: through ATen."""
    matmul_strategy: MatmulStrategy = "auto"
    """mm / addmm with a pointwise epilogue: "auto" lets the cost model (or, with profile_guided, a
    measurement) pick the Triton template with the epilogue fused or cuBLAS + one epilogue kernel;
    "triton" or "cublas" force one."""
    float32_matmul: Float32Matmul = "ieee"
    """How the matmul template multiplies float32 operands while TF32 is off (PyTorch's default;
    with torch.backends.cuda.matmul.allow_tf32 the template uses TF32, as cuBLAS does). "ieee": on
    the CUDA cores, like cuBLAS's float32 kernels, so products without an epilogue stay on cuBLAS.
    "tf32x3": on the tensor cores, each operand split into a TF32 part and a TF32 remainder and
    three products summed (Triton's input_precision="tf32x3"; the dropped remainder x remainder term
    is ~2^-22 of each product, below float32 accumulation's own rounding over K >= 256); every
    float32 product of more than one row may then run in the template, epilogue or not, where the
    template is predicted and measured (check_templates) faster than cuBLAS's float32 kernels.
    Opt-in (PyTorch's default float32 precision means IEEE products): its results differ from eager's
    in the last bits, as another cuBLAS algorithm's would. Measured on an H100 (PERF.md run 239):
    BERT-base / GPT-2 training 1.25x over eager with it, 1.10x / 1.14x without, gradients as far
    from float64 as eager's; errors per product against float64 at or below cuBLAS float32's."""
    triton_matmul_efficiency: float = 0.7
    """Prior for the cost model: the fraction of cuBLAS's arithmetic rate and bandwidth a tuned Triton
    template reaches. Measured on the H200 (bf16 4096x4096, PERF.md): 0.66 at batch 4096, 0.81 at 512,
    0.70 of cuBLAS's bandwidth at batch 8."""
    triton_matmul_k_step_us: float = 0.8
    """Prior for the cost model: latency of one K step of the template when too few programs run to
    hide it (skinny products). Measured on the H200: bf16 [8, 4096] @ [4096, 4096] took 13.1 us over
    16 steps of 256."""
    profile_guided: bool = False
    """On CUDA, decide each matmul's strategy by timing both on the GPU at compile time."""
    check_templates: bool = True
    """On CUDA with autotune (and without profile_guided), each product the cost model gives the
    Triton template is tuned as planned and cuBLAS is timed alone on the same shapes (cached); where
    cuBLAS plus the modelled epilogue kernel is faster, the product runs through cuBLAS and the plan
    is made again. Run 93 (H200): GPT-2's 768 -> 3072 projection with GELU at 8x128 tokens in
    float32 with TF32 took 58 µs in the template against 26 µs in cuBLAS plus a 5.5 µs GELU kernel."""
    matmul_template_margin: float = 1.15
    """A measured template (check_templates, profile_guided) of at least matmul_template_margin_from_us
    is kept only where it times this factor faster than cuBLAS plus the epilogue kernel. Tuned alone,
    a large template ran slower inside the plan than cuBLAS + its epilogue kernel: run 171 (H100,
    TF32), the 768 -> 3072 + GELU product of bert-base, distilbert and roberta at 8x128 tokens timed
    29.6 µs against 20.9 + a modelled 9.7, and the models ran 4.9-5.8% faster with it on cuBLAS."""
    matmul_template_margin_from_us: float = 20.0
    """Smaller measured templates only have to be faster: inside a plan their chained launches (PDL)
    gain (run 171: bert-base at 1x128 ran 3.4% slower with its 3072 -> 768 + residual product, 11.2 µs
    in the template against 10.6 + 1.5, moved to cuBLAS)."""
    check_templates_give_up: float = 1.75
    """Config.check_templates: a template whose untuned (heuristic) tile takes more than this many
    times cuBLAS plus the epilogue goes to cuBLAS without tuning its other tiles (run 93: the
    heuristic tile was within 1.64x of the tuned best on 21 bfloat16 products)."""
    # --- resources (the seeds' defaults; issue 3 enforces the occupancy rule) ----------
    max_registers_per_thread: int = 255
    target_registers_per_thread: int = 64
    max_shared_bytes_per_block: int = 48 * 1024
    target_shared_bytes_per_block: int = 32 * 1024
    max_occupancy_drop: float = 0.2
    """Refuse a fusion whose (estimated) occupancy falls more than this fraction below that of the
    kernels it replaces (weighted by their bytes); the refusal names both figures."""
    grid_min_waves: int = 2
    """Aim for a grid of at least this many programs per SM where the problem allows."""
    # --- codegen (codegen/) -----------------------------------------------------------
    pointwise_block: int = 1024
    pointwise_num_warps: int = 4
    pointwise_no_split_from: int = 1 << 20
    """A fused pointwise kernel over at least this many elements is held to the hard limits only
    (spills, shared memory): the planner does not divide its per-thread work to restore estimated
    occupancy, which costs a memory-bound kernel its loads in flight (run 98: a cat + batch-norm +
    ReLU over 12.8M elements, 1679 GB/s at 2 elements per thread, 3883 GB/s at 8). 0: always."""
    reduction_elems_per_thread: int = 8
    """Register budget for a persistent reduction's row tile over rows of reduction_tile_elems or
    more, in elements per thread. Run 153 (benchmarks/reduction_tiles.py, H200, fp32): 8 was the
    fastest or level on all eight real-model softmaxes and layer norms timed at 2, 4, 8, 16 and 32;
    run 163 (H100): a layer norm over 4096 took 12.5 µs at 8 (16 warps), 13.3 at 16 (8 warps)."""
    reduction_tile_elems: int = 1024
    """Rows shorter than this (after padding to a power of two) share one program's tile of this
    many elements, at reduction_short_row_elems_per_thread, with one warp per 64 columns of the row
    (fusion/geometry.py, `reduction_launch`). Run 164 (benchmarks/reduction_tiles.py, H100, fp32),
    against the rule before (1: tiles of 2048 at 8 per thread for every row): swin_t's window
    softmaxes over rows of 49 at batch 32 took 53.9 and 26.5 µs instead of 94.2 and 49.2 (Inductor's:
    64.8 and 34.7), ViT-B's softmax over 197 took 43.6 instead of 63.5; BERT's over 128 took 4.1
    instead of 3.9, the layer norms were level."""
    reduction_short_row_elems_per_thread: int = 16
    """Register budget of the tile of rows shorter than reduction_tile_elems (run 163: 16 against 8
    at tiles of 1024 took 12% off swin_t's stage-2 window softmax, level elsewhere; on one warp, 8
    rows of 64 at 16 per thread were the fastest of the hand-written tiles)."""
    reduction_small_grid_elems_per_thread: int = 4
    """A persistent reduction whose grid has fewer programs than the GPU has SMs (a layer norm at
    batch 1) is latency-bound, and occupancy is no concern: its row tile gets at most this many
    elements per thread, so more warps share each row (run 118: GPT-2's layer norms over one or
    128 rows of 768 took 2.5-2.9 µs at 2 warps against Inductor's 1.6)."""
    reduction_max_warps: int = 16
    reduction_rows_contiguous: bool = True
    """A sum, mean, max or min whose kept innermost dim is dense in memory (over H and W of a
    channels_last tensor: a squeeze-and-excitation pool after a convolution kept channels_last; a
    column sum of a [tokens, features] tensor) runs as a looped reduction with its threads along
    those adjacent rows, where enough rows fill the GPU, and stores its other results of the full
    shape channels_last where the input is (Group.rows_contiguous); False keeps the persistent
    reduction, whose programs then read a row each with the stride of the kept dim."""
    reduction_row_split: bool = True
    """Where too few rows fill the GPU (a bias or layer-norm gradient's column sum over 768
    features), the looped reduction also splits each row: SPLIT programs share a row tile, each
    summing its slice, and the last to finish combines the partial results in split order
    (deterministic; fusion/geometry.looped_split). False: such reductions keep the
    persistent template (run 106: GPT-2's 768-wide column sums took 20-27 µs each in it)."""
    reduction_max_split: int = 64
    """Most programs sharing one row tile of the split looped reduction. The last of them combines
    the partial results in a loop unrolled over the splits. A 51 M-element mean split 265 ways (two
    waves of the H100's SMs; one row) gave no result within two minutes in run 202, where a split of
    38 had compiled and run in seconds; the unrolled combine is the likely cause (not confirmed)."""
    matmul_max_shared_bytes: int = 227 * 1024
    """Shared-memory cap for the matmul template's staged tiles. The template buffers its operand
    tiles in shared memory by design and opts in to the device maximum (as cuBLAS does); the 48 KB
    cap above applies to fused pointwise and reduction kernels, which keep data in registers."""
    matmul_max_split_k: int = 32
    """Most programs that may share one output tile of the matmul template, each summing a slice of K
    (split-K, for products whose tiles alone leave SMs idle; 1 turns split-K off)."""
    matmul_tma: bool = False
    """Experimental: the matmul template loads 16-bit operands through TMA tensor descriptors. A
    stand-alone version measured 1.14x cuBLAS's GEMM alone at bf16 4096^3 with bias + GELU fused
    (the tl.dot template: 1.5x; PERF.md run 22); this template path has run in Triton's interpreter
    only, so it is off until it is measured on a GPU. Needs a Hopper-or-newer GPU (compute
    capability 9.0+) or Triton's interpreter."""
    pdl: bool = True
    """On Hopper or newer GPUs, launch generated kernels with programmatic dependent launch: a
    kernel may start while the one before it on its stream finishes, and waits (griddepcontrol.wait)
    before it reads anything that kernel could have written; the matrix-vector loop reads its
    constant weights before that wait. Hides the launch gap between dependent kernels."""
    pdl_beside_others: bool = True
    """Also launch with programmatic dependent launch a kernel that the stream plan runs beside
    kernels of other streams (schedule concurrency > 1). Such a kernel's programs are resident, and
    hold SM slots, from the moment the kernel before it starts."""
    pdl_after_convolutions: bool = True
    """Also launch with programmatic dependent launch a generated kernel whose predecessor on its
    stream is a convolution run through ATen (cuDNN): it starts when the convolution's programs
    exit, instead of after the convolution completes."""
    autotune: bool = True
    """On CUDA, time the matmul template's candidate tile configurations once per shape and dtype and
    keep the fastest (cached on disk in cache_dir); otherwise a heuristic tile is used."""
    autotune_concurrency: bool = True
    """Tune a matmul that the stream plan runs beside other kernels by timing each candidate tile
    beside copies of itself on as many streams (schedule concurrency, at most max_streams): the
    fastest tile alone is not the fastest when it shares the GPU."""
    conv_layout: ConvLayout = "auto"
    """Memory layout a 2-D convolution with NCHW input and output runs in through cuDNN. "auto": on
    CUDA (with autotune), each such convolution is timed in NCHW and in channels_last (the layout
    changes inside the step) once per shape, cached, and the faster kept if it wins by
    conv_layout_margin (cuDNN's NCHW float32 5x5 ran 3x slower than its channels_last kernel on the
    H200); then the network's layout: every convolution channels_last, the pointwise kernels before
    them storing channels_last so no input is converted (tune/network_layout.py), kept if the
    convolutions timed so beat the one-by-one choices by the same margin (resnet50 at batch 32:
    3,483 to 2,513 µs on the H200). "native": as recorded; "channels_last": the network layout
    always (any device)."""
    conv_layout_margin: float = 0.1
    """Fraction by which channels_last must beat NCHW for "auto" to pick it (timing noise)."""
    network_layout_margin: float = 0.03
    """Fraction by which the network layout's convolutions, summed, must beat the one-by-one
    choices' for "auto" to keep it. A sum over many convolutions is steadier than one timing, and
    the network layout also saves what the sums leave out (the layout conversions of the kernels
    between convolutions): shufflenet_v2 at batch 32 measured 392.0 against 425.8 µs, 8% ahead,
    and was refused at conv_layout_margin's 10% (run 120)."""
    conv_keep_channels_last: bool = True
    """A convolution run in channels_last hands its result on in channels_last when only generated
    kernels read it (they take strides at launch): no conversion back to NCHW, one kernel fewer on
    its path. False always converts back."""
    compile_threads: int = field(default_factory=lambda: _default_compile_threads())
    """On CUDA, compile the plan's generated kernels ahead of the first call, and the tuner's
    candidate tiles, on this many threads (runtime/precompile.py; Triton's compiler releases the GIL,
    so they scale with cores); 1 compiles them one after another, 0 leaves each kernel to its first
    launch. Default: this process's CPU cores, at most 32."""
    autotune_budget_s: float = 60.0
    """Upper bound on tuning time per kernel; the candidates not reached are skipped."""
    # --- scheduling (schedule/) --------------------------------------------------------
    max_streams: int = 4
    """Independent kernels run on up to this many CUDA streams (capped by the DAG's width)."""
    stream_priorities: bool = False
    """Run the critical path on a stream of its own at high priority. The caller's stream has the
    lowest priority, so this takes a stream besides it, and one more fork and join wait per call: a
    fork/join of k branches then needs 2k waits instead of 2(k-1). Off by default: runs 27-29
    (docs/PERF.md) found no consistent effect of priorities on the four-stream times."""
    merge_sibling_linears: bool = False
    """Linears that read one input (attention's query, key and value; SwiGLU's gate and up) run as one
    over their concatenated weights, each result a column slice. Training through the backend
    (capture/sibling_linear.py): 9 GEMMs become 3 for a copy of the weights per step; H200 runs 236-238
    (fp32, TF32 off): BERT-base's 8x128 step 0.9% and T5-small's 4.6-7.6% faster, T5's step reserved
    52 MiB more. Inference graphs (ir/merge_mm.py): the concatenation is folded once (the weights'
    size again in memory), no copy per call; not yet measured on a GPU. Off by default."""
    train_channels_last: bool = True
    """A graph that trains through torch.compile(backend="streamfuse") and has 2-D convolutions runs
    them channels_last: each reads its input and weight converted so, and AOTAutograd traces the
    forward and backward in that layout (capture/train_layout.py), so cuDNN's NHWC kernels need no
    layout conversions around every convolution and its backward (resnet50's training step on an
    H100 spent 2.16 of 16.8 busy ms in them, run 195). Outputs keep eager's layout. Graphs with a
    grouped convolution, depthwise included, are left NCHW. H100, batch 32, off -> on (runs 205-207,
    one machine): resnet50 18.33 -> 16.53-17.31 ms (Inductor 18.76), googlenet 12.43 -> 11.72;
    mobilenet_v3_small and efficientnet_b0 (depthwise) keep their NCHW plan. Under TF32 (cuDNN's
    default) the NHWC algorithms round differently from eager's NCHW ones: gradients differ from
    eager's by TF32's own error (3e-4 relative on a first convolution's weight, run 205), as eager's
    channels_last does."""
    training_max_streams: int = 1
    """max_streams for the forward and backward graphs of a training step through torch.compile
    (with backend_cuda_graphs), which keep their memory pool (with the saved activations) for the
    life of the model. A block freed on a side stream goes back to that stream's own free blocks,
    which the caching allocator hands out to no other stream, so each stream keeps its own
    high-water mark: a saved activation made on the forward's side stream is never reused by the
    backward. Runs 131-134 (docs/PERF.md, session 34): against one stream, 4 streams bought 0%
    (resnet50 b32), 3% (BERT-base) and 5% (GPT-2) of a training step and cost 1.9 GB, 0.5 GB and
    0.5 GB of pool; 2 streams about the same."""
    stream_release_bytes: int = 1 << 20
    """A buffer of at least this many bytes that is read on another stream than its own goes back
    to the allocator once a later step of its own stream waits for those reads: a wait is added
    where the schedule has none, at the first step of its stream issued after each reading stream
    moved on (schedule/release.py). Smaller ones are held to the end of a CUDA-graph capture,
    which cannot record the allocator's events. 0 adds a wait for every such buffer."""
    # --- CUDA graphs (runtime/graphs.py) ----------------------------------------------
    cuda_graphs: bool = True
    """On CUDA, capture the whole multi-stream schedule as a CUDA graph and replay it."""
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """One graph per bucket; a batch is padded up to its bucket where rows are provably
    independent along dim 0 (otherwise only the compiled shape is accepted)."""
    max_graphs: int = 8
    """At most this many recorded graphs; the least recently used is evicted."""
    graph_memory_fraction: float = 0.5
    """Recorded inference graphs of all compiled models on a device keep at most this fraction of its
    memory (static inputs, and each graph's pool: its buffers' peak and outputs); past it the least
    recently replayed are dropped, and recorded again at their next call (runtime/memory.py)."""
    backend_cuda_graphs: bool = True
    """Through torch.compile(backend="streamfuse"), an inference graph binds its parameters and
    buffers as constants at its first call (on any device; its plan is built then), so on CUDA its
    graphs are recorded and replayed copying in only the other inputs, as streamfuse.compile's are.
    A call with other parameter tensors (a module's parameter replaced) takes a plan over every
    argument. Training graphs (AOTAutograd's forward and backward) on CUDA record a CUDA graph once the
    inputs that stay at one address from call to call are known, read those in place and copy the
    rest (runtime/replay.py). Off: the backend passes every argument on every call and runs its
    graphs on streams without CUDA graphs."""
    training_shared_pool: bool = True
    """A training graph's backward is recorded into its forward's memory pool and takes over the
    saved activations' memory, releasing each after its last reader, so its temporaries and
    gradients reuse it as eager's backward does (runtime/replay.py). The forward then replays only
    once the backward's gradients are no longer referenced; where they stay referenced into the next
    forward (gradient accumulation), both graphs are recorded again with separate pools. Off: separate
    pools from the start (peak memory holds all saved activations and all gradients at once)."""
    training_pool_reserve: bool = True
    """A training graph recorded on one stream first takes one block of its pool as large as the
    most memory its recording will hold at once (counted in its warm-up run: the allocator's bytes
    after each step, plus the copied and taken-over inputs not yet released), and frees it, so
    its buffers are cut from that one block, whose freed parts merge again. Without it every large
    buffer that finds no free block gets a segment of its own, and free blocks of different segments
    never merge (runs 139-140: resnet50's pool 2808 MiB of segments with it, 3464 without, for a
    peak of 2673 MiB live; PERF.md, session 35). A backward recorded into its forward's pool takes
    only what its peak needs beyond the forward's block."""
    training_warmup_pool: bool = True
    """A training graph's calls before its CUDA graph records (the first few, while it learns which
    inputs stay put) allocate in one memory pool per device, shared by the training graphs still
    observing, which goes back to the device once they have recorded and the last of those calls'
    tensors is freed. In the allocator's default pool those calls' activations and gradients leave
    free blocks inside segments that also hold the optimizer's state allocated beside them; eager
    reuses such blocks at every step, replays never do: BERT-base 8x128 kept 277 MiB of them, its
    whole excess over eager's reservation (run 211, H100; docs/PERF.md, session 55). With the pool
    (run 212, H100, one process per mode): a training step's reservation went from 1942 to 1742 MiB
    for BERT-base 8x128 (eager 1730) and from 2842 to 2654 for GPT-2 8x128 (eager 2654), with step
    times 1-2% apart (19.90 against 20.17 ms, 24.39 against 24.87)."""
    max_specializations: int = 8
    """A call whose input shapes (beyond a batch that pads to a bucket) or dtypes differ from the
    compiled ones gets a plan of its own, built on first use (streamfuse.compile captures the model
    again; the torch.compile backend traces Dynamo's graph at the concrete sizes). At most this many
    are kept, least recently used out; 0 makes such a call a ValueError instead."""
    max_specializations_built: int = 16
    """After this many specializations of one model (or one backend graph) have been compiled,
    evicted ones included, a call with yet another new shape runs eagerly (ATen), with one warning,
    while the plans kept still serve their shapes: a workload cycling through more shapes than the
    cache keeps (token-by-token generation with a growing cache) would otherwise compile on
    nearly every call."""
    store_in_place: bool = True
    """An input the graph updates in place (an optimizer's parameters and states, through the
    torch.compile backend) is written by the kernel that computes its new value, where nothing can
    read the old value afterwards (runtime/writeback.py); False copies every update
    over its input at the end of the call. Also: a scatter (index_put, index_copy) into a buffer
    the same call fills and nothing else reads (the embedding backward's full + index_put) updates
    that buffer in place instead of a copy of it."""
    reuse_outputs: bool = False
    """True returns the graph's own output buffers (zero-copy), overwritten by the next call;
    False (default) returns fresh tensors."""
    output_sets: int = 2
    """Fresh outputs without a copy (runtime/graphs.py): up to this many recorded instances of each
    graph hand out their own output buffers, an instance only once the caller holds no tensor or
    view of its last outputs; past that, outputs are copied. Each instance holds its own activation
    memory; 0 always copies."""
    input_copy_node: bool = True
    """Copy a call's inputs inside its CUDA graph: each graph starts with a memcpy node per input,
    pointed at the caller's tensors before the replay (one CUDA runtime call per input instead of
    a separate cudaMemcpyAsync). False copies them before the replay."""
    # --- tuning (tune/) ---------------------------------------------------------------
    calibrate: bool = True
    """On CUDA, measure the device's ceilings once (a few seconds) and cache them in cache_dir; False
    uses the cache if present, else the built-in table."""
    # --- runtime (runtime/) -----------------------------------------------------------
    executor: Executor = "auto"
    """"auto": Triton kernels on CUDA, and on CPU under TRITON_INTERPRET=1; otherwise the
    reference executor (each group's ops run through torch). "triton" or "reference" force one."""
    seed: int | None = None
    """Seed of dropout's random numbers (ir/rng.py). None (default): dropout follows torch's random
    state as eager's does: each call draws its counter base from torch's default generator, so
    torch.manual_seed(s) before a call reproduces its masks. An int: masks follow that seed and the
    call count alone (two plans with one seed repeat each other's sequence)."""
    check_inputs: bool = True
    """Validate count, shape, dtype and device of each call's inputs (ValueError on mismatch)."""
    cache_dir: Path = field(default_factory=_default_cache_dir)
    """Where generated kernel sources are written (named by content hash)."""

    def replace(self, **changes: object) -> Config:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def with_settings(self, settings: list[str]) -> Config:
        """This config with "name=value" settings applied (the CLI's --set), each value parsed as its
        field's type: true/false, an int, a float, a comma-separated tuple, a path, or none."""
        fields = {f.name: str(f.type) for f in dataclasses.fields(self)}
        changes: dict[str, object] = {}
        for setting in settings:
            name, sep, text = setting.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in fields:
                raise ValueError(f"--set takes NAME=VALUE with NAME a Config field ({', '.join(sorted(fields))}); "
                                 f"got {setting!r}")
            changes[name] = _parse_setting(name, fields[name], text.strip())
        return self.replace(**changes)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # a bool field given "no" or 0 would be taken as truthy or falsy silently
            if f.type in (bool, "bool") and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"Config.{f.name} must be True or False, got {getattr(self, f.name)!r}")
        positive = {
            "max_kernel_args": self.max_kernel_args,
            "max_ops_per_kernel": self.max_ops_per_kernel,
            "max_persistent_reduction": self.max_persistent_reduction,
            "fold_constants_max_bytes": self.fold_constants_max_bytes,
            "fold_weights_max_bytes": self.fold_weights_max_bytes,
            "max_recomputed_evaluations": self.max_recomputed_evaluations,
            "horizontal_max_elements": self.horizontal_max_elements,
            "max_horizontal_parts": self.max_horizontal_parts,
            "pointwise_block": self.pointwise_block,
            "pointwise_num_warps": self.pointwise_num_warps,
            "reduction_elems_per_thread": self.reduction_elems_per_thread,
            "reduction_tile_elems": self.reduction_tile_elems,
            "reduction_short_row_elems_per_thread": self.reduction_short_row_elems_per_thread,
            "reduction_small_grid_elems_per_thread": self.reduction_small_grid_elems_per_thread,
            "reduction_max_warps": self.reduction_max_warps,
            "reduction_max_split": self.reduction_max_split,
            "max_streams": self.max_streams,
            "training_max_streams": self.training_max_streams,
            "max_graphs": self.max_graphs,
            "pointwise_conv_mm_max_rows": self.pointwise_conv_mm_max_rows,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"Config.{name} must be a positive int, got {value!r}")
        if not isinstance(self.stream_release_bytes, int) or self.stream_release_bytes < 0:
            raise ValueError(f"Config.stream_release_bytes must be an int >= 0, got {self.stream_release_bytes!r}")
        if not isinstance(self.pointwise_no_split_from, int) or self.pointwise_no_split_from < 0:
            raise ValueError(f"Config.pointwise_no_split_from must be an int >= 0, got {self.pointwise_no_split_from!r}")
        if self.pointwise_block & (self.pointwise_block - 1):
            raise ValueError(f"Config.pointwise_block must be a power of two, got {self.pointwise_block}")
        if self.executor not in ("auto", "triton", "reference"):
            raise ValueError(f"Config.executor must be 'auto', 'triton' or 'reference', got {self.executor!r}")
        buckets = self.batch_buckets
        if (not isinstance(buckets, tuple) or not buckets or any(not isinstance(b, int) or b <= 0 for b in buckets)
                or list(buckets) != sorted(set(buckets))):
            raise ValueError(f"Config.batch_buckets must be a non-empty tuple of increasing positive ints, "
                             f"got {buckets!r}")
        if self.float32_matmul not in ("ieee", "tf32x3"):
            raise ValueError(f"Config.float32_matmul must be 'ieee' or 'tf32x3', got {self.float32_matmul!r}")
        if self.matmul_strategy not in ("auto", "triton", "cublas"):
            raise ValueError(f"Config.matmul_strategy must be 'auto', 'triton' or 'cublas', got {self.matmul_strategy!r}")
        if self.addmm_bias not in ("auto", "addmm", "split"):
            raise ValueError(f"Config.addmm_bias must be 'auto', 'addmm' or 'split', got {self.addmm_bias!r}")
        if not 0.0 <= self.addmm_split_margin < 1.0:
            raise ValueError(f"Config.addmm_split_margin must be in [0, 1), got {self.addmm_split_margin}")
        if self.conv_layout not in ("auto", "native", "channels_last"):
            raise ValueError(f"Config.conv_layout must be 'auto', 'native' or 'channels_last', got {self.conv_layout!r}")
        if not 0.0 <= self.conv_layout_margin < 1.0:
            raise ValueError(f"Config.conv_layout_margin must be in [0, 1), got {self.conv_layout_margin}")
        if not 0.0 <= self.network_layout_margin < 1.0:
            raise ValueError(f"Config.network_layout_margin must be in [0, 1), got {self.network_layout_margin}")
        if self.matmul_template_margin_from_us < 0:
            raise ValueError("Config.matmul_template_margin_from_us must be >= 0, "
                             f"got {self.matmul_template_margin_from_us}")
        if not 1.0 <= self.matmul_template_margin <= 4.0:
            raise ValueError(f"Config.matmul_template_margin must be in [1, 4], got {self.matmul_template_margin}")
        if not 0.0 < self.triton_matmul_efficiency <= 2.0:
            raise ValueError(f"Config.triton_matmul_efficiency must be in (0, 2], got {self.triton_matmul_efficiency}")
        if not 1 <= self.matmul_max_split_k <= 1024:
            raise ValueError(f"Config.matmul_max_split_k must be in [1, 1024], got {self.matmul_max_split_k}")
        if not 0.0 < self.graph_memory_fraction <= 1.0:
            raise ValueError(f"Config.graph_memory_fraction must be in (0, 1], got {self.graph_memory_fraction}")
        if not isinstance(self.concat_branches_from, int) or self.concat_branches_from < 0:
            raise ValueError(f"Config.concat_branches_from must be an int >= 0 (0: never), got {self.concat_branches_from!r}")
        if not 0.0 <= self.max_occupancy_drop <= 1.0:
            raise ValueError(f"Config.max_occupancy_drop must be in [0, 1], got {self.max_occupancy_drop}")
        if not self.check_templates_give_up >= 1.0:
            raise ValueError(f"Config.check_templates_give_up must be >= 1, got {self.check_templates_give_up}")
        if self.autotune_budget_s <= 0:
            raise ValueError(f"Config.autotune_budget_s must be > 0, got {self.autotune_budget_s}")
        if not isinstance(self.compile_threads, int) or self.compile_threads < 0:
            raise ValueError(f"Config.compile_threads must be an int >= 0, got {self.compile_threads!r}")
        if not isinstance(self.max_specializations, int) or self.max_specializations < 0:
            raise ValueError(f"Config.max_specializations must be an int >= 0, got {self.max_specializations!r}")
        if not isinstance(self.max_specializations_built, int) or self.max_specializations_built < 0:
            raise ValueError(f"Config.max_specializations_built must be an int >= 0, "
                             f"got {self.max_specializations_built!r}")
        if not isinstance(self.output_sets, int) or self.output_sets < 0:
            raise ValueError(f"Config.output_sets must be an int >= 0, got {self.output_sets!r}")
        if self.fusion_fuel is not None and self.fusion_fuel < 0:
            raise ValueError(f"Config.fusion_fuel must be None or >= 0, got {self.fusion_fuel}")


def _parse_setting(name: str, kind: str, text: str) -> object:
    """One --set value as the field's declared type (`kind`, the annotation's text)."""
    if "None" in kind and text.lower() in ("none", ""):
        return None
    try:
        if kind.startswith("bool"):
            if text.lower() not in ("true", "false", "1", "0", "on", "off"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "on")
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float"):
            return float(text)
        if kind.startswith("tuple"):
            return tuple(int(v) for v in text.split(",") if v.strip())
        if kind.startswith("Path"):
            return Path(text)
    except ValueError:
        raise ValueError(f"--set {name}: expected a value of type {kind}, got {text!r}") from None
    return text  # a string or one of the Literal choices (checked by Config itself)
