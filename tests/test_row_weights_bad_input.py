"""Bad row weights, z-loss weights and ``reduction="none"`` (contract v3) are refused in both
frameworks with an error naming the argument (eager calls, every check on)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import Inputs, jax_arrays, make_inputs, torch_tensors

import jax_kl
import torch_kl


def _call(framework: str, inp: Inputs, **options):
    """One call with every check on (eager), on the plain backend of ``framework``."""
    if framework == "torch":
        a = torch_tensors(inp)
        rw = options.pop("row_weight", None)
        rw = torch.as_tensor(rw) if isinstance(rw, np.ndarray) else rw
        return torch_kl.fused_linear_kl_div(a["x"], a["weight"], a["target"], a["labels"], row_weight=rw,
                                            backend="torch", **options)  # fmt: skip
    a = jax_arrays(inp)
    return jax_kl.fused_linear_kl_div(a["x"], a["weight"], a["target"], a["labels"], backend="xla", **options)


BAD_ROW_WEIGHTS = {
    "too-few": (ValueError, lambda n: np.ones(n - 1, np.float32)),
    "a-column": (ValueError, lambda n: np.ones((n, 1), np.float32)),
    "negative": (ValueError, lambda n: np.where(np.arange(n) == 2, -0.5, 1.0).astype(np.float32)),
    "nan": (ValueError, lambda n: np.where(np.arange(n) == 1, np.nan, 1.0).astype(np.float32)),
    "inf": (ValueError, lambda n: np.full(n, np.inf, np.float32)),
    "integer": (TypeError, lambda n: np.ones(n, np.int32)),
}


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("case", list(BAD_ROW_WEIGHTS))
def test_bad_row_weight_is_refused_naming_it(framework: str, case: str) -> None:
    error, make = BAD_ROW_WEIGHTS[case]
    inp = make_inputs(6, 4, 9, ignore_frac=None)
    rw = make(6)
    if framework == "jax":
        import jax.numpy as jnp

        rw = jnp.asarray(rw)
    with pytest.raises(error, match="row_weight"):
        _call(framework, inp, row_weight=rw)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_row_weights_of_the_wrong_rows_shape_are_refused(framework: str) -> None:
    """With ``x`` ``[B, T, H]`` the weights are ``[B, T]``: ``[B * T]`` is refused."""
    inp = make_inputs(6, 4, 9, lead=(2, 3))
    rw = np.ones(6, np.float32)
    if framework == "jax":
        import jax.numpy as jnp

        rw = jnp.asarray(rw)
    with pytest.raises(ValueError, match="row_weight"):
        _call(framework, inp, row_weight=rw)


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf")])
def test_bad_z_loss_weight_is_refused_naming_it(framework: str, value: float) -> None:
    with pytest.raises(ValueError, match="z_loss_weight"):
        _call(framework, make_inputs(6, 4, 9), z_loss_weight=value)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_reduction_none_names_the_way_to_per_row_losses(framework: str) -> None:
    with pytest.raises(ValueError, match="reduction") as info:
        _call(framework, make_inputs(6, 4, 9), reduction="none")
    assert "row_weight" in str(info.value) and "return_row_losses" in str(info.value)
