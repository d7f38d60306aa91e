"""``fused_kl.terms`` functions with a numerical contract of their own, in float32, against
float64: the GPU kernels' ``tanh`` (through ``exp``, since the hardware's ``tanh.approx`` is
too coarse for capped logits)."""

from __future__ import annotations

import numpy as np
import pytest

from fused_kl import terms

X = np.concatenate([
    np.linspace(-12.0, 12.0, 20001),
    [0.0, -0.0, 1e-30, -1e-30, 1e-8, 44.0, 45.0, 89.0, 1e4, -1e4, 3e38, -3e38, np.inf, -np.inf],
])


@pytest.mark.parametrize("framework", ["numpy", "torch", "jax"])
def test_tanh_by_exp_is_within_float32_rounding(framework: str) -> None:
    if framework == "numpy":
        x, xp, back = X.astype(np.float32), np, np.asarray
    else:
        mod = pytest.importorskip(framework)
        if framework == "torch":
            x, xp, back = mod.tensor(X, dtype=mod.float32), mod, lambda a: a.numpy()
        else:
            x, xp, back = mod.numpy.asarray(X, dtype=np.float32), mod.numpy, np.asarray
    with np.errstate(over="ignore"):
        got = back(terms.tanh_by_exp(x, xp)).astype(np.float64)
    want = np.tanh(X.astype(np.float32).astype(np.float64))
    assert np.all(np.isfinite(got))
    assert np.abs(got - want).max() < 2.5e-7  # ~2 float32 ulps of 1; a wrong formula is off by far more
    assert got[np.inf == X].item() == 1.0 and got[-np.inf == X].item() == -1.0
    assert np.all(np.abs(got) <= 1.0)
