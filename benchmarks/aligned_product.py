"""cuBLAS products with unaligned result rows, as traced and over the weight padded to 16-byte rows
(ir/pad_mm.py, Config.product_row_alignment).

    python benchmarks/aligned_product.py

For each (rows, K, N, dtype): mm and addmm over a Linear's `t(weight)` [K, N] as traced, against the
same product over the weight padded with zero columns to whole 16-byte rows (then sliced back to N
columns, as the plan does; the pad itself is folded at compile time), replayed in a CUDA graph
(median µs per call), and the pad's own time (what it would cost per call unfolded). The results
must agree. TF32 is allowed for float32, as the suite's benchmarks time it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from streamfuse.ir.pad_mm import padded_columns
from streamfuse.profile.timing import time_graph_us

SHAPES = [(1024, 768, 50257), (128, 768, 50257), (16, 768, 50257), (8, 768, 50257), (1, 768, 50257),
          (1024, 768, 30522), (4096, 1024, 1003)]
"""GPT-2's LM head at 8 x 128, 128, 16, 8 and 1 tokens; BERT's MLM head (30522 words) at 8 x 128; an odd classifier."""


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("rows     K      N  dtype     | mm     padded  ratio | addmm  padded  ratio | pad   (µs per call)")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for m, k, n in SHAPES:
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5
            c = torch.randn(n, device="cuda", dtype=dtype)
            p = padded_columns(n, a.element_size()) - n
            b_pad, c_pad = F.pad(w.t(), [0, p]), F.pad(c, [0, p])
            row = []
            for plain, padded in ((lambda: a @ w.t(), lambda: (a @ b_pad)[:, :n]),  # noqa: B023
                                  (lambda: torch.addmm(c, a, w.t()), lambda: torch.addmm(c_pad, a, b_pad)[:, :n])):  # noqa: B023
                torch.testing.assert_close(padded(), plain(), rtol=2e-2, atol=2e-2)
                t_plain, t_padded = time_graph_us(plain, calls=5, reps=10), time_graph_us(padded, calls=5, reps=10)
                row.append(f"{t_plain:6.1f} {t_padded:6.1f} {t_plain / t_padded:5.2f}x")
            t_pad = time_graph_us(lambda: F.pad(w.t(), [0, p]), calls=5, reps=10)  # noqa: B023
            print(f"{m:5d} {k:5d} {n:6d}  {str(dtype)[6:]:9s} | {row[0]} | {row[1]} | {t_pad:5.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
