"""Index algebra (ir/indexing.py): a view's split index sums back to the index it came from."""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
from helpers import compile_and_check

from streamfuse.ir.indexing import Expr, delinearize, linearize, reshape_index, strided_sum


def _value(e: Expr, **env: int) -> int:
    return eval(e.text, {}, env)  # noqa: S307 - the algebra's own output: integer arithmetic on named ints


def test_a_split_index_sums_back_to_its_source() -> None:
    x = Expr.var("x")
    assert linearize((x.floordiv(16), x.mod(16)), [32, 16]).text == "x"
    assert linearize(delinearize(Expr.var("rows"), [512, 6, 49]), [512, 6, 49]).text == "rows"
    # a reshape that regroups dims reads the source index, not its digits summed again
    assert [e.text for e in reshape_index((x.floordiv(16), x.mod(16), Expr.var("c")), [512, 7], [32, 16, 7])] == \
        ["x", "c"]
    # digits that do not tile each other stay as they are
    assert linearize((x.floordiv(16), x.mod(16)), [32, 8]).text == "(x // 16) * 8 + x % 16"
    assert linearize((x.floordiv(16), x.floordiv(2).mod(8)), [4, 8]).text == "x // 2"


def test_folded_sums_equal_the_unfolded_ones_on_every_index() -> None:
    """Random digit chains of one variable (each term `(x // d) % size`, sometimes without the
    modulo, at a dense stride or a broken one) against the plain sum of their terms, on every value."""
    rng = random.Random(0)
    x = Expr.var("x")
    for _ in range(300):
        sizes = [rng.choice([1, 2, 3, 4, 7, 16]) for _ in range(rng.randint(1, 4))]
        div = rng.choice([1, 2, 3])
        terms: list[tuple[Expr, int]] = []
        for k, size in enumerate(sizes):
            inner = math.prod(sizes[k + 1:])
            e = x.floordiv(div * inner)
            terms.append((e.mod(size) if rng.random() < 0.8 else e, inner if rng.random() < 0.85 else inner + 1))
        folded = strided_sum(terms)
        for v in range(3 * math.prod(sizes) * div + 5):
            want = sum(_value(e, x=v) * st for e, st in terms)
            assert _value(folded, x=v) == want, (terms, folded.text, v)


def test_a_window_softmax_reads_its_input_by_row(config) -> None:  # type: ignore[no-untyped-def]
    """swin_t's window softmax views [B*nW, heads, 49, 49] as [B, nW, ...] to add the mask: the
    generated load reads the first dim as it is, not as `((i // nW) * nW + i % nW)`."""
    def window_softmax(attn: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attn = (attn + bias.unsqueeze(0)).view(2, 4, 2, 49, 49) + mask.unsqueeze(1).unsqueeze(0)
        return F.softmax(attn.view(-1, 2, 49, 49), dim=-1)

    g = torch.Generator().manual_seed(0)
    xs = tuple(torch.randn(s, generator=g) for s in ((8, 2, 49, 49), (2, 49, 49), (4, 49, 49)))
    compiled = compile_and_check(window_softmax, xs, config)
    sources = "\n".join(s.source for s in compiled.sources.values())
    assert "* 4 + " not in sources and "// 4) * 4" not in sources, sources
