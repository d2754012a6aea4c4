"""`any` lowered to a reduction (ir/lowerings.py): amax of the input as 0/1 float32, > 0. SDPA's math
path (taken on the GPU when the mask's last dim has stride 0, as BERT's traced mask has) ends in
`_safe_softmax`, whose all-masked-rows test was an ATen `any` launch per layer; it now fuses into
the softmax kernel."""

from __future__ import annotations

import pytest
import torch
from helpers import compile_and_check, randn


def safe_softmax(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What SDPA's math path computes after the scores: rows that are all -inf give 0, not NaN."""
    s = x + mask
    out = torch.softmax(s, -1)
    rows = s.eq(float("-inf")).all(dim=-1, keepdim=True)
    return torch.where(rows, torch.zeros_like(out), out)


def masks(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x = randn(2, 3, 8, 9, device=device, seed=1)
    mask = torch.zeros(2, 1, 8, 9, device=device)
    mask[0, :, 2, :] = float("-inf")  # a row masked whole: 0, where plain softmax gives NaN
    mask[1, :, :, 5] = float("-inf")  # a column: every row keeps the rest
    return x, mask


def test_safe_softmax_is_one_kernel(config, device) -> None:  # type: ignore[no-untyped-def]
    x, mask = masks(device)
    compiled = compile_and_check(safe_softmax, [x, mask], config)
    assert compiled.stats["kernels"] == 1 and compiled.stats["aten_kernels"] == 0, compiled.explain(source=False)
    out = compiled(x, mask)
    assert out[0, :, 2].eq(0).all() and not out.isnan().any()
    fresh = torch.randn_like(x)
    torch.testing.assert_close(compiled(fresh, mask), safe_softmax(fresh, mask), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["dim", "dims", "all-dims", "float", "int", "keepdim", "all"])
def test_any_matches_eager(config, device, case: str) -> None:  # type: ignore[no-untyped-def]
    x = randn(3, 5, 7, device=device, seed=2)
    fns = {
        "dim": lambda t: (t > 1.0).any(dim=1),
        "dims": lambda t: torch.any(t > 1.5, dim=(0, 2)),
        "all-dims": lambda t: (t > 2.0).any(),
        "float": lambda t: torch.relu(t - 1.0).any(dim=-1),  # nonzero floats
        "int": lambda t: (t * 2).round().to(torch.int32).any(dim=0),
        "keepdim": lambda t: torch.where((t > 1.0).any(dim=2, keepdim=True), t, -t),
        "all": lambda t: (t > -2.0).all(dim=1),
    }
    fn = fns[case]
    compiled = compile_and_check(fn, [x], config)
    assert not any(".any" in n.op or ".all" in n.op for g in compiled.plan.groups for n in g.nodes), \
        compiled.explain(source=False)
    for seed in (3, 4):  # rows with and without a True
        fresh = randn(3, 5, 7, device=device, seed=seed)
        assert torch.equal(compiled(fresh), fn(fresh))
