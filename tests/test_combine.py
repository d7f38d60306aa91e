"""``fused_kl.rowmath.combine_stats``: the ``Stats`` of a row's vocabulary slices, combined,
equal the whole row's, reverse KL's sum included (``rows.Stats.reverse``), as the vocabulary-sharded
layouts and the Mosaic GPU kernels' segments combine them."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from fused_kl import rowmath
from fused_kl.loss import Loss, Teacher
from fused_kl.reference import reference
from fused_kl.rows import MIXTURE_SUMS
from torch_kl.backends import torch_phases

V = 96


def _row_inputs(fmt: str):
    g = torch.Generator().manual_seed(3)
    z = torch.randn(5, V, generator=g, dtype=torch.float64).float() * 3
    raw = torch.randn(5, V, generator=g) * 2
    t = {"probs": raw.softmax(-1), "log_probs": raw.log_softmax(-1), "logits": raw}[fmt]
    if fmt == "probs":
        t[:, ::5] = 0.0  # exact zeros: log p is floored at eps
    return z, t, torch.tensor([3, 50, 95, 0, 64])


@pytest.mark.parametrize("slices", [1, 2, 3, 4])
@pytest.mark.parametrize("fmt", ["probs", "log_probs", "logits"])
def test_slices_combine_to_the_whole_row(fmt: str, slices: int) -> None:
    loss = Loss(beta=1.0, temperature=1.5, weight_hard=0.5, teacher=Teacher(fmt, 2.0))
    z, t, y = _row_inputs(fmt)
    whole = torch_phases.stats(z, t, y, loss, (1, 1))
    bounds = torch.linspace(0, V, slices + 1).long().tolist()
    parts = torch.stack([torch_phases.stats(z[:, a:b], t[:, a:b], y - a, loss, (1, 1)) for a, b in pairwise(bounds)])
    combined = rowmath.combine_stats(parts, lambda a: a.amax(0), lambda a: a.sum(0), torch)
    assert combined.shape == whole.shape
    if fmt != "logits":  # no teacher log-sum-exp: its column is not read
        combined, whole = combined[:, [0, 1, 3, 4, 5, 6]], whole[:, [0, 1, 3, 4, 5, 6]]
    torch.testing.assert_close(combined, whole, rtol=2e-6, atol=2e-5)


@pytest.mark.parametrize("fmt", ["probs", "log_probs", "logits"])
def test_reverse_sum_is_the_reverse_kl(fmt: str) -> None:
    """``R = reverse + lse_teacher`` is each row's reverse KL (the float64 reference's, at
    ``reduction="sum"`` over one row at a time)."""
    loss = Loss(beta=1.0, temperature=1.5, teacher=Teacher(fmt, 2.0))
    z, t, _ = _row_inputs(fmt)
    r = rowmath.reverse_sums(torch_phases.stats(z, t, None, loss, (1, 1)), loss, torch)[:, MIXTURE_SUMS.student]
    eye = torch.eye(V)  # x = z, W = I: the logits are z
    for i in range(z.shape[0]):
        ref = reference(z[i : i + 1], eye, t[i : i + 1], None, beta=1.0, temperature=1.5, target_format=fmt,
                        teacher_temperature=2.0, reduction="sum")  # fmt: skip
        assert float(r[i]) == pytest.approx(ref.loss, rel=1e-5)


def test_an_empty_slice_adds_nothing() -> None:
    loss = Loss(beta=1.0, teacher=Teacher("probs", 1.0))
    z, t, _ = _row_inputs("probs")
    whole = torch_phases.stats(z, t, None, loss, (1, 1))
    empty = torch_phases.stats(z[:, :0], t[:, :0], None, loss, (1, 1))
    combined = rowmath.combine_stats(torch.stack([whole, empty]), lambda a: a.amax(0), lambda a: a.sum(0), torch)
    torch.testing.assert_close(combined[:, [0, 6]], whole[:, [0, 6]])
