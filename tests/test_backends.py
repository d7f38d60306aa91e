"""Every backend of both frameworks against the float64 reference, on one option matrix."""

from __future__ import annotations

import numpy as np
import pytest
from harness import ALL_BACKENDS, assert_matches, make_inputs, run

# (inputs, options): together every option value, on small shapes, odd sizes included.
CASES = {
    "probs-batchmean": (dict(n=23, h=8, v=41), dict()),
    "probs-sum-T2-bias": (dict(n=17, h=5, v=67, ignore_frac=None, bias=True), dict(reduction="sum", temperature=2.0)),
    # A truncated teacher (top-k cached probabilities): rows sum to less than 1, so S_i matters.
    "probs-truncated": (dict(n=19, h=6, v=45, zero_frac=0.5, min_mass=0.3), dict(temperature=1.5)),
    "probs-mean-T0.5": (dict(n=19, h=8, v=53), dict(reduction="mean", temperature=0.5)),
    "log_probs-bias": (
        dict(n=13, h=6, v=37, target_format="log_probs", bias=True),
        dict(target_format="log_probs", temperature=2.0),
    ),
    "log_probs-truncated": (
        dict(n=12, h=5, v=33, target_format="log_probs", min_mass=0.2),
        dict(target_format="log_probs"),
    ),
    "log_probs-sum": (
        dict(n=11, h=4, v=29, target_format="log_probs"),
        dict(target_format="log_probs", reduction="sum"),
    ),
    "logits-teacher-T": (
        dict(n=21, h=8, v=47, target_format="logits"),
        dict(target_format="logits", teacher_temperature=3.0),
    ),
    "logits-mean-bias": (
        dict(n=15, h=7, v=31, target_format="logits", bias=True),
        dict(target_format="logits", reduction="mean", temperature=2.0),
    ),
    "bf16-fp32-accum": (dict(n=33, h=16, v=61, dtype="bfloat16", bias=True), dict(accum_dtype="float32", chunk_size=8)),
    "bf16": (dict(n=29, h=16, v=43, dtype="bfloat16"), dict(chunk_size=5)),
    "fp16-logits": (dict(n=27, h=16, v=59, dtype="float16", target_format="logits"), dict(target_format="logits")),
    "3d-input": (dict(n=12, h=8, v=37, lead=(3, 4)), dict(chunk_size=5)),
    "v41-n1": (dict(n=1, h=3, v=41, ignore_frac=None), dict()),
    "v1423": (dict(n=6, h=8, v=1423), dict(chunk_size=4)),
    "v4099": (dict(n=5, h=4, v=4099, target_format="logits"), dict(target_format="logits", chunk_size=3)),
    "many-chunks": (dict(n=40, h=6, v=35), dict(chunk_size=7)),
    # float16 dL/dz scaled by 1/n would be subnormal: stored prescaled (fused_kl.plan.float16_unscale).
    "fp16-small-gradients": (dict(n=200, h=16, v=1000, dtype="float16"), dict(temperature=4.0)),
    "all-ignored": (dict(n=9, h=5, v=33, ignore_frac=1.0, bias=True), dict()),
}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(backend: str, case: str) -> None:
    shape, options = CASES[case]
    inp = make_inputs(**shape)
    out = run(backend, inp, **options)
    assert_matches(out, inp, **options)
    if case == "all-ignored":  # exactly zero, never NaN
        assert out.loss == 0.0
        for g in (out.grad_x, out.grad_weight, out.grad_bias):
            assert g is not None and not np.any(g)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_empty_batch(backend: str) -> None:
    inp = make_inputs(0, 4, 11)
    out = run(backend, inp)
    assert out.loss == 0.0
    assert out.grad_x.shape == (0, 4)
    assert out.grad_weight.shape == (11, 4) and not np.any(out.grad_weight)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_upstream_gradient_scales_every_gradient(backend: str) -> None:
    inp = make_inputs(14, 6, 23, bias=True)
    out = run(backend, inp, upstream=-2.5, chunk_size=4)
    assert_matches(out, inp, upstream=-2.5)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_loss_only(backend: str) -> None:
    inp = make_inputs(14, 6, 23, target_format="log_probs")
    out = run(backend, inp, grads=False, target_format="log_probs", chunk_size=4)
    assert_matches(out, inp, target_format="log_probs")
