"""The logits GEMM with the ``stats`` phase in its epilogue (``torch_kl/backends/triton_logits.py``)
against ``x @ W^T`` and the ``stats`` kernel run on the same logits, in Triton's interpreter
(float16 takes the TMA path, bfloat16 the pointer path) and on the GPU. It serves the chunks whose
statistics read no dense teacher: the cross-entropy, top-k teachers, reverse KL and JSD on
probabilities."""

from __future__ import annotations

import pytest
import torch

from fused_kl.loss import Loss, Teacher
from fused_kl.rows import STATS
from torch_kl.backends import resolve, triton_logits, triton_phases

TILE = (1, 32)


def _operands(dtype: torch.dtype, rows: int, v: int, h: int, bias: bool):
    gen = torch.Generator().manual_seed(rows * 7 + v)
    x = torch.randn(rows, h, generator=gen).to(dtype)
    w = (torch.randn(v, h, generator=gen) / h**0.5).to(dtype)
    b = torch.randn(v, generator=gen).to(dtype) if bias else None
    y = torch.randint(-1, v + 2, (rows,), generator=gen)  # some outside the slice: label_logit 0
    return x, w, b, y


TOPK = Teacher("topk_log_probs", temperature=1.3)
CASES = [  # (loss, hard term, bias)
    (Loss(teacher=None, weight_soft=0.0, weight_hard=1.0), True, True),
    (Loss(teacher=None, weight_soft=0.0, weight_hard=1.0, label_smoothing=0.1, softcap=3.0), True, False),
    (Loss(teacher=TOPK, temperature=2.0, weight_hard=0.5), True, True),
    (Loss(teacher=TOPK, softcap=5.0, logit_scale=0.5), False, False),
    # uncapped: the scale folded into the epilogue's exponent, the sum of f(z) and both log-sum-exps
    (Loss(teacher=None, weight_soft=0.0, weight_hard=1.0, logit_scale=0.7, label_smoothing=0.2), True, False),
    (Loss(teacher=TOPK, temperature=1.5, logit_scale=1.3, weight_hard=0.5), True, False),
]


def _without_unused_sum(stats: torch.Tensor, loss: Loss) -> torch.Tensor:
    """The epilogue makes ``sum f(z)`` only for label smoothing, the one term that reads it."""
    if loss.label_smoothing == 0.0:
        stats[:, STATS.logit_sum] = 0.0
    return stats


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("loss", "hard", "bias"), CASES)
@pytest.mark.parametrize(("rows", "v", "h"), [(37, 88, 40), (16, 32, 16)])
def test_logits_and_stats_match_the_unfused_phases(dtype, loss, hard, bias, rows, v, h):
    x, w, b, y = _operands(dtype, rows, v, h, bias)
    y = y if hard else None
    inputs = [a.clone() for a in (x, w, b) if a is not None]
    z = torch.full((rows, v), float("nan"), dtype=dtype)
    make_stats = triton_logits.logits_with_stats(x, w, b, loss, z)
    assert make_stats is not None
    stats = make_stats(y)  # the labels are read only here, after the GEMM
    expected_z = x.float() @ w.float().T + (0.0 if b is None else b.float())
    torch.testing.assert_close(z.float(), expected_z, atol=2e-2, rtol=1e-2)
    # The statistics are those of the logits as stored: the same as the stats kernel's on z.
    expected = _without_unused_sum(triton_phases.stats(z, None, y, loss, TILE), loss)
    torch.testing.assert_close(stats, expected, atol=2e-5, rtol=2e-5)
    assert all(torch.equal(a, c) for a, c in zip([a for a in (x, w, b) if a is not None], inputs, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("loss", "hard", "bias"), CASES)
def test_on_the_gpu_with_partial_tiles(dtype, loss, hard, bias):
    """The TMA path with the GPU tile shape: 300 rows, 2056 columns, H = 264 all leave partial tiles."""
    x, w, b, y = (None if a is None else a.cuda() for a in _operands(dtype, 300, 2056, 264, bias))
    y = y if hard else None
    z = torch.full((300, 2056), float("nan"), dtype=dtype, device="cuda")
    make_stats = triton_logits.logits_with_stats(x, w, b, loss, z)
    assert make_stats is not None
    stats = make_stats(y)  # the labels are read only here, after the GEMM
    expected_z = torch.mm(x, w.T) if b is None else torch.addmm(b, x, w.T)
    torch.testing.assert_close(z.float(), expected_z.float(), atol=2e-2, rtol=1e-2)
    expected = _without_unused_sum(triton_phases.stats(z, None, y, loss, (4, 128)), loss)
    torch.testing.assert_close(stats, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "change",
    [
        lambda x, w, z: (x.float(), w.float(), z.float()),  # float32: cuBLAS without TF32 instead
        lambda x, w, z: (x, w[:-1], z[:, :-1].contiguous()),  # 87 columns 174 bytes apart: not TMA-aligned
        lambda x, w, z: (x[:, :-2], w[:, :-2], z),  # a non-contiguous x
    ],
)
def test_operands_it_does_not_take_are_left_to_cublas(change):
    x, w, _, _ = _operands(torch.bfloat16, 8, 88, 40, False)
    z = torch.zeros(8, 88, dtype=torch.bfloat16)
    x, w, z = change(x, w, z)
    before = z.clone()
    assert triton_logits.logits_with_stats(x, w, None, CASES[0][0], z) is None
    assert torch.equal(z, before)


def test_a_dense_teacher_chunk_is_left_to_the_stats_kernel():
    x, w, _, _ = _operands(torch.float16, 8, 88, 40, False)
    z = torch.zeros(8, 88, dtype=torch.float16)
    assert triton_logits.logits_with_stats(x, w, None, Loss(teacher=Teacher("probs", 1.0)), z) is None
    assert not z.any()


@pytest.mark.parametrize(
    ("fmt", "beta", "reads"),
    [("probs", 0.0, True), ("log_probs", 0.0, True), ("logits", 0.5, True), ("hidden", 1.0, True),
     ("probs", 1.0, True), ("probs", 0.5, False), ("log_probs", 1.0, True), ("log_probs", 0.5, False),
     ("topk_log_probs", 0.0, False)],
)  # fmt: skip
def test_which_losses_read_the_teacher_in_their_statistics(fmt, beta, reads):
    assert Loss(teacher=Teacher(fmt, 1.0), beta=beta).stats_read_teacher is reads
    assert not Loss(teacher=Teacher(fmt, 1.0), beta=beta, weight_soft=0.0, weight_hard=1.0).stats_read_teacher


def test_only_the_triton_backend_has_it():
    cpu = torch.device("cpu")
    assert resolve("triton", cpu).fused_logits is triton_logits.logits_with_stats
    assert resolve("torch", cpu).fused_logits is None
