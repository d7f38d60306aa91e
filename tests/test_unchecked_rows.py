"""Rows a compiled call could not check (docs/contract.md): under ``torch.compile`` and
``jax.jit`` the labels and top-k token ids are not concrete, so the eager value check cannot
raise. A kept row with a label outside ``[0, V)``, a token id outside ``[0, V)`` or a token id
repeated within its row then gives NaN in the loss, in that row of ``grad_x`` and in
``grad_weight``; the other rows of ``grad_x`` are those of the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import (
    BRIDGES,
    JAX_BACKENDS,
    TOLERANCE,
    TORCH_BACKENDS,
    Inputs,
    expected,
    make_inputs,
    rel_err,
    run,
    torch_tensors,
)

import torch_kl

N, H, V, K = 6, 8, 16, 4
BAD = 2  # the row made invalid

# (how the row is broken, the call's options): a bad label needs the hard term; a top-k teacher
# with labels as a mask only.
CASES = {
    "label-out-of-range": dict(weight_hard_loss=0.5),
    "cross-entropy-label-out-of-range": dict(fn="cross_entropy"),
    "token-id-out-of-range": dict(),
    "token-id-repeated": dict(),
}


def _problem(case: str, dtype: str = "float32") -> tuple[Inputs, Inputs]:
    """``(the inputs with row BAD broken, the same inputs valid)``; every row kept."""
    topk = case.startswith("token-id")
    valid = make_inputs(
        N, H, V, dtype=dtype, target_format="topk_log_probs" if topk else "probs", k=K if topk else None,
        ignore_frac=0.0, seed=3,
    )  # fmt: skip
    broken = Inputs(**{**valid.__dict__})
    if topk:
        broken.target_indices = valid.target_indices.copy()
        broken.target_indices[BAD, 1] = V + 2 if case == "token-id-out-of-range" else broken.target_indices[BAD, 0]
    else:
        broken.labels = valid.labels.copy()
        broken.labels[BAD] = V + 3
    return broken, valid


def _compiled_torch(name: str, inp: Inputs, fn: str, options: dict) -> tuple[float, np.ndarray, np.ndarray]:
    """Loss, ``grad_x`` and ``grad_weight`` of the call under ``torch.compile(fullgraph=True)``."""
    torch._dynamo.reset()  # each test compiles its own call: no recompile limit shared across tests
    a = torch_tensors(inp, requires_grad=True)
    x, w, target, labels = (a.pop(k) for k in ("x", "weight", "target", "labels"))
    a.pop("bias")

    def loss_of(x, w, target, labels, indices):
        if fn == "cross_entropy":
            return torch_kl.fused_linear_cross_entropy(x, w, labels, reduction="sum", backend=name, **options)
        teacher = {**a, "target_indices": indices} if indices is not None else a
        return torch_kl.fused_linear_kl_div(x, w, target, labels, reduction="sum", backend=name, **teacher, **options)

    loss = torch.compile(loss_of, backend="eager", fullgraph=True)(x, w, target, labels, a.pop("target_indices", None))
    loss.backward()
    return float(loss.detach()), x.grad.double().numpy(), w.grad.double().numpy()


def _jitted_jax(name: str, inp: Inputs, fn: str, options: dict) -> tuple[float, np.ndarray, np.ndarray]:
    """The same under ``jax.jit`` (the harness jits every JAX call)."""
    out = run(f"jax/{name}", inp, fn=fn, reduction="sum", **options)
    return out.loss, out.grad_x, out.grad_weight


def _check(got: tuple[float, np.ndarray, np.ndarray], valid: Inputs, fn: str, options: dict) -> None:
    loss, grad_x, grad_w = got
    assert np.isnan(loss), f"loss {loss}: expected NaN"
    assert np.isnan(grad_x[BAD]).all(), "the broken row's grad_x: expected NaN"
    assert np.isnan(grad_w).any(), "grad_weight: expected NaN"
    others = np.arange(N) != BAD
    assert np.isfinite(grad_x[others]).all(), "the other rows' grad_x: expected finite values"
    want = expected(valid, fn, reduction="sum", **options).grad_x[others]
    assert rel_err(grad_x[others], want) < TOLERANCE[valid.dtype] * 10


COMPILED_BACKENDS = TORCH_BACKENDS + JAX_BACKENDS


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", COMPILED_BACKENDS)
def test_a_row_the_compiled_call_could_not_check_is_nan(backend: str, case: str) -> None:
    framework, name = backend.split("/")
    options = dict(CASES[case])
    fn = options.pop("fn", "kl_div")
    broken, valid = _problem(case)
    got = (_compiled_torch if framework == "torch" else _jitted_jax)(name, broken, fn, options)
    _check(got, valid, fn, options)


@pytest.mark.parametrize("case", ["cross-entropy-label-out-of-range", "token-id-repeated"])
def test_the_factored_triton_path_gives_nan_too(case: str) -> None:
    """bfloat16 on the Triton backend writes ``E`` in the logits GEMM (``triton_factored``):
    the row's NaN reaches its gradients through the rows' factor ``alpha``."""
    options = dict(CASES[case])
    fn = options.pop("fn", "kl_div")
    broken, valid = _problem(case, "bfloat16")
    _check(_compiled_torch("triton", broken, fn, options), valid, fn, options)


@pytest.mark.parametrize("backend", [b for b in BRIDGES if b.startswith("torch/")] + ["torch/torch"])
def test_an_eager_call_still_raises(backend: str) -> None:
    broken, _ = _problem("token-id-repeated")
    with pytest.raises(ValueError, match="target_indices"):
        run(backend, broken)


def test_a_jax_call_outside_jit_still_raises() -> None:
    from harness import jax_arrays

    import jax_kl

    broken, _ = _problem("label-out-of-range")
    a = jax_arrays(broken)
    with pytest.raises(ValueError, match="labels"):
        jax_kl.fused_linear_kl_div(a["x"], a["weight"], a["target"], a["labels"], weight_hard_loss=0.5)
