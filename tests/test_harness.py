"""The harness itself can fail: ``assert_matches`` refuses a result that lacks a gradient the
reference has, or has one the reference lacks, or is off by more than the tolerance."""

from __future__ import annotations

from dataclasses import replace

import pytest
from harness import assert_matches, make_inputs, run


@pytest.fixture(scope="module")
def with_bias():
    inp = make_inputs(9, 5, 17, bias=True, target_format="logits")
    return inp, run("torch/torch", inp, beta=0.5)


def test_a_complete_result_passes(with_bias) -> None:
    inp, out = with_bias
    assert_matches(out, inp, beta=0.5)


@pytest.mark.parametrize("dropped", ["grad_x", "grad_weight", "grad_bias"])
def test_a_dropped_gradient_fails(with_bias, dropped: str) -> None:
    inp, out = with_bias
    with pytest.raises(AssertionError, match=rf"^{dropped}: got none, the reference has one of shape"):
        assert_matches(replace(out, **{dropped: None}), inp, beta=0.5)


def test_a_gradient_the_reference_lacks_fails(with_bias) -> None:
    inp, out = with_bias
    without_bias = replace(inp, bias=None)
    out = run("torch/torch", without_bias, beta=0.5)
    assert_matches(out, without_bias, beta=0.5)
    with pytest.raises(AssertionError, match=r"^grad_bias: got one of shape"):
        assert_matches(replace(out, grad_bias=inp.bias), without_bias, beta=0.5)


def test_a_wrong_gradient_fails(with_bias) -> None:
    inp, out = with_bias
    with pytest.raises(AssertionError, match=r"^grad_weight: relative error"):
        assert_matches(replace(out, grad_weight=out.grad_weight * 1.01), inp, beta=0.5)


def test_a_loss_only_result_is_compared_on_its_loss() -> None:
    inp = make_inputs(9, 5, 17, target_format="logits")
    out = run("torch/torch", inp, grads=False, beta=0.5)
    assert out.loss_only and out.grad_x is None
    assert_matches(out, inp, beta=0.5)
    with pytest.raises(AssertionError, match=r"^loss "):
        assert_matches(replace(out, loss=out.loss * 1.01), inp, beta=0.5)
