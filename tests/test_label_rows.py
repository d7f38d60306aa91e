"""``torch_kl``'s label rows of ``grad_weight`` (``triton_factored.add_label_rows``): each label's
rows summed in float32 and rounded into its row once, whatever the runs' lengths and where they
fall among the kernel's 16-row tiles; in Triton's interpreter and, compiled, on the GPU."""

from __future__ import annotations

import pytest
import torch

from torch_kl.backends import triton_factored

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _add(grad_w: torch.Tensor, x: torch.Tensor, coef: torch.Tensor, y: torch.Tensor, device: str) -> torch.Tensor:
    """``grad_w`` after ``add_label_rows`` on ``device``, back on the CPU."""
    got = grad_w.to(device, copy=True)
    label = triton_factored.LabelTerm(coef.to(device), y.to(device))
    triton_factored.add_label_rows(got, x.to(device), label)
    return got.cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_the_label_rows_are_summed_in_float32_and_rounded_once(device):
    """Rows sharing a label (here 40 rows of label 3) are summed before their one rounding into
    ``grad_w``; rows with no term (``coef = 0``) and other labels add nothing there. Their
    bfloat16 sum, rounded 40 times, would be off by far more than one rounding."""
    gen = torch.Generator().manual_seed(6)
    rows, v, h = 64, 10, 48
    x = torch.randn(rows, h, generator=gen).to(torch.bfloat16)
    y = torch.randint(0, v, (rows,), generator=gen)
    y[:40] = 3
    coef = -torch.rand(rows, generator=gen) / rows
    coef[40:44] = 0.0  # ignored rows, a label outside the slice
    grad_w = torch.randn(v, h, generator=gen).to(torch.bfloat16) * 1e-3
    want = grad_w.double().index_add(0, y, coef.double()[:, None] * x.double())
    got = _add(grad_w, x, coef, y, device)
    ulp = want.abs() * 2.0**-7  # one rounding of the sum (Triton's interpreter truncates: a whole ulp)
    assert ((got.double() - want).abs() <= ulp + 1e-12).all()
    untouched = torch.ones(v, dtype=torch.bool)
    untouched[y[coef != 0]] = False
    assert torch.equal(got[untouched], grad_w[untouched])


@pytest.mark.parametrize("device", DEVICES)
def test_a_label_most_rows_share_is_summed_in_blocks_of_rows(device):
    """300 rows of one label (many tiles of rows), the rest alone: each label's rows summed once."""
    gen = torch.Generator().manual_seed(10)
    rows, v, h = 331, 7, 300
    x = torch.randn(rows, h, generator=gen).to(torch.bfloat16)
    y = torch.full((rows,), 2)
    y[300:] = torch.tensor([0, 1, 3, 4, 5, 6] * 6)[:31]
    coef = -torch.rand(rows, generator=gen) / rows
    got = _add(torch.zeros(v, h, dtype=torch.float32), x, coef, y, device)
    terms = coef.double()[:, None] * x.double()
    want = torch.zeros(v, h, dtype=torch.float64).index_add(0, y, terms)
    # The bound is float32's rounding (6e-8) of the sum of |terms| (the sum itself may cancel)
    # times 16, well above what the kernel's order of summation errs by; a dropped row moves
    # its columns by ~1/300 of that sum.
    size = torch.zeros(v, h, dtype=torch.float64).index_add(0, y, terms.abs())
    assert ((got.double() - want).abs() <= 1e-6 * size).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [0, 5, 15, 16, 17])
def test_a_label_run_starting_anywhere_among_the_sorted_rows(offset, device):
    """A run of 37 rows of one label (more than two of the kernel's 16-row tiles) starting
    ``offset`` rows past a multiple of 16 among the rows sorted by label is summed whole into its
    row; labels of a few rows around it too, ignored rows (``coef = 0``) add nothing; x through strides."""
    gen = torch.Generator().manual_seed(11 + offset)
    rows, v, h, run = 150, 60, 40, 37
    below = 32 + offset  # rows labelled below the run: where it starts once sorted
    y = torch.cat([torch.randint(0, 30, (below,), generator=gen), torch.full((run,), 30),
                   torch.randint(31, v, (rows - below - run,), generator=gen)])  # fmt: skip
    coef = -torch.rand(rows, generator=gen)
    coef[below + run :: 5] = 0.0  # ignored rows, sorted past every label
    shuffle = torch.randperm(rows, generator=gen)
    y, coef = y[shuffle], coef[shuffle]
    x = torch.randn(h, rows, generator=gen).t()  # not contiguous
    grad_w = torch.randn(v, h, generator=gen)
    want = grad_w.double().index_add(0, y, coef.double()[:, None] * x.double())
    got = _add(grad_w, x, coef, y, device)  # .to keeps x's strides
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
