"""Row weights, per-row losses and the z-loss (contract v3) on every backend of both frameworks,
against the float64 reference (``fused_kl.reference``): loss, every gradient, ``row_losses``
(values, dtype, shape, no gradient); the reference itself against closed forms. Bad input:
``test_row_weights_bad_input``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import (
    ALL_BACKENDS,
    TOLERANCE,
    TORCH_BACKENDS,
    Inputs,
    Outputs,
    assert_matches,
    expected,
    jax_arrays,
    make_inputs,
    rel_err,
    torch_tensors,
)

import jax_kl
import torch_kl
from fused_kl.reference import reference, reference_cross_entropy


def row_weights(inp: Inputs, seed: int = 1) -> np.ndarray:
    """Weights shaped like the rows, in ``[0, 3)``, about a fifth of them 0."""
    rng = np.random.default_rng(seed)
    shape = inp.x.shape[:-1]
    w = rng.uniform(0.0, 3.0, shape)
    return np.where(rng.random(shape) < 0.2, 0.0, w).astype(np.float32)


def logits_and_lse(inp: Inputs) -> tuple[np.ndarray, np.ndarray]:
    """The untransformed logits ``[..., V]`` and their log-sum-exp per row, in float64."""
    z = inp.x.astype(np.float64) @ inp.weight.T.astype(np.float64)
    z = z if inp.bias is None else z + inp.bias
    m = z.max(-1, keepdims=True)
    return z, np.log(np.exp(z - m).sum(-1)) + m[..., 0]


def run_rows(
    backend: str, inp: Inputs, row_weight: np.ndarray | None, *, fn: str = "kl_div", grads: bool = True, **options
) -> tuple[Outputs, np.ndarray]:
    """``(loss and gradients, row_losses)`` of one call with ``return_row_losses=True``; checks the
    returned ``row_losses``' dtype (float32), shape (the rows') and that it carries no gradient."""
    framework, name = backend.split("/")
    run = _run_torch if framework == "torch" else _run_jax
    out, rows = run(name, inp, row_weight, fn, grads, {**options, "return_row_losses": True})
    assert rows.shape == inp.x.shape[:-1], f"row_losses of shape {rows.shape}"
    return out, np.asarray(rows, np.float64)


def _run_torch(name: str, inp: Inputs, row_weight, fn: str, grads: bool, options: dict):
    a = torch_tensors(inp, requires_grad=grads)
    x, w, b, target, lab = (a.pop(k) for k in ("x", "weight", "bias", "target", "labels"))
    rw = None if row_weight is None else torch.tensor(row_weight)
    if fn == "cross_entropy":
        loss, rows = torch_kl.fused_linear_cross_entropy(x, w, lab, bias=b, row_weight=rw, backend=name, **options)
    else:
        loss, rows = torch_kl.fused_linear_kl_div(
            x, w, target, lab, bias=b, row_weight=rw, backend=name, **a, **options
        )  # fmt: skip
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert rows.dtype == torch.float32 and not rows.requires_grad
    if grads:
        loss.backward()

    def grad(t):
        return None if t is None or t.grad is None else t.grad.double().numpy()

    return Outputs(float(loss.detach()), grad(x), grad(w), grad(b), loss_only=not grads), rows.numpy()


def _run_jax(name: str, inp: Inputs, row_weight, fn: str, grads: bool, options: dict):
    import jax
    import jax.numpy as jnp

    a = jax_arrays(inp)
    static = {k: v for k, v in a.items() if isinstance(v, str)}
    x, w, b, target, lab = (a.pop(k) for k in ("x", "weight", "bias", "target", "labels"))
    arrays = {k: v for k, v in a.items() if k not in static}
    rw = None if row_weight is None else jnp.asarray(row_weight)

    def f(x, w, b, target, lab, rw, arrays):  # the row weights traced, as a training step passes them
        if fn == "cross_entropy":
            loss, rows = jax_kl.fused_linear_cross_entropy(x, w, lab, bias=b, row_weight=rw, backend=name, **options)
        else:
            loss, rows = jax_kl.fused_linear_kl_div(
                x, w, target, lab, bias=b, row_weight=rw, backend=name, **arrays, **static, **options
            )  # fmt: skip
        assert loss.dtype == jnp.float32 and loss.shape == () and rows.dtype == jnp.float32
        return loss, rows

    args = (x, w, b, target, lab, rw, arrays)
    if not grads:
        loss, rows = jax.jit(f)(*args)
        return Outputs(float(loss), None, None, None, loss_only=True), np.asarray(rows)
    (loss, rows), (gx, gw, gb) = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(*args)

    def as64(g):
        return None if g is None else np.asarray(g.astype(jnp.float32), np.float64)

    return Outputs(float(loss), as64(gx), as64(gw), as64(gb)), np.asarray(rows)


def assert_rows_match(rows: np.ndarray, inp: Inputs, row_weight, *, fn: str = "kl_div", **options) -> None:
    """``row_losses`` against the reference's, at the dtype's tolerance; exactly 0 on ignored rows."""
    want = expected(inp, fn, row_weight=row_weight, return_row_losses=True, **options).row_losses
    assert rel_err(rows, want) < TOLERANCE[inp.dtype], f"row_losses: relative error {rel_err(rows, want):.3g}"
    if inp.labels is not None:
        assert not np.any(rows[inp.labels == options.get("ignore_index", -100)]), "an ignored row has a loss"


# (make_inputs keywords, options): every teacher format, beta 0 / 0.5 / 1, the hard term, the z-loss,
# each reduction, ignored rows, [B, T] rows, the float16 divisor and the Triton backend's factored dL/dz.
CASES = {
    "probs-batchmean": (dict(n=13, h=6, v=29), dict()),
    "probs-truncated-sum-bias": (dict(n=11, h=5, v=31, bias=True, zero_frac=0.4, min_mass=0.4), dict(reduction="sum")),
    "log_probs-jsd-hard-mean-3d": (
        dict(n=12, h=6, v=27, target_format="log_probs", lead=(3, 4)),
        dict(beta=0.5, weight_hard_loss=0.6, reduction="mean", chunk_size=5)),
    "logits-reverse-hard-smoothing-zloss-T": (
        dict(n=14, h=6, v=33, target_format="logits", bias=True),
        dict(beta=1.0, weight_hard_loss=0.4, label_smoothing=0.1, z_loss_weight=0.05, temperature=2.0)),
    "hidden-jsd-zloss-softcap-sum": (
        dict(n=10, h=6, v=25, target_format="hidden", ht=5, teacher_bias=True),
        dict(beta=0.5, z_loss_weight=0.1, softcap=4.0, reduction="sum", chunk_size=4)),
    "topk-bin-hard-zloss-3d": (
        dict(n=12, h=6, v=31, target_format="topk_log_probs", k=5, pad_frac=0.3, lead=(2, 6)),
        dict(weight_hard_loss=0.5, z_loss_weight=0.02, logit_scale=1.3)),
    # z-loss alone on the hard side (weight_hard_loss = 0), every row kept, at a temperature
    "zloss-alone-no-labels-T": (dict(n=9, h=5, v=23, ignore_frac=None), dict(z_loss_weight=0.2, temperature=1.5)),
    "zloss-alone-no-soft": (
        dict(n=11, h=5, v=23, target_format="logits"), dict(weight_soft_loss=0.0, z_loss_weight=0.3, reduction="sum")),
    "fp16-hard-zloss": (
        dict(n=24, h=16, v=37, dtype="float16", target_format="logits"),
        dict(weight_hard_loss=0.5, z_loss_weight=0.01, chunk_size=8)),
    # bfloat16, uncapped, no bias, rows of 16-byte multiples: the Triton backend factors dL/dz
    "topk-bf16-factored-hard-zloss": (
        dict(n=20, h=16, v=64, target_format="topk_log_probs", k=6, dtype="bfloat16", pad_frac=0.3),
        dict(weight_hard_loss=0.5, z_loss_weight=0.05, chunk_size=16)),
    "all-ignored": (dict(n=6, h=5, v=19, ignore_frac=1.0, bias=True), dict(weight_hard_loss=0.5, z_loss_weight=0.1)),
}

CE_CASES = {
    "mean-zloss": (dict(n=15, h=6, v=29), dict(z_loss_weight=1e-2)),
    "sum-smoothing-softcap-3d": (
        dict(n=12, h=6, v=33, lead=(3, 4), bias=True), dict(reduction="sum", label_smoothing=0.1, softcap=4.0)),
    # bfloat16, no bias, no smoothing: the Triton backend factors dL/dz, the z-loss folded into its row scale
    "bf16-factored-zloss": (dict(n=21, h=16, v=64, dtype="bfloat16"), dict(z_loss_weight=0.05, chunk_size=16)),
}


def _denominators(inp: Inputs, options: dict) -> tuple[float, float]:
    """What the soft and the hard side of a row's loss are divided by in the total."""
    n = float(np.prod(inp.x.shape[:-1]) if inp.labels is None else np.sum(inp.labels != -100))
    reduction = options.get("reduction", "batchmean")
    soft = {"batchmean": n, "sum": 1.0, "mean": n * inp.weight.shape[0]}[reduction]
    return soft, 1.0 if reduction == "sum" else n


def _check_case(backend: str, inp: Inputs, options: dict, fn: str = "kl_div") -> tuple[Outputs, np.ndarray]:
    w = row_weights(inp)
    out, rows = run_rows(backend, inp, w, fn=fn, **options)
    assert_matches(out, inp, fn=fn, row_weight=w, **options)
    assert_rows_match(rows, inp, w, fn=fn, **options)
    soft_n, hard_n = _denominators(inp, {"reduction": "mean", **options} if fn == "cross_entropy" else options)
    if soft_n == hard_n and soft_n > 0:  # the loss is the weighted sum of the rows' losses over one denominator
        want = float(np.sum(w * rows)) / soft_n
        assert out.loss == pytest.approx(want, rel=TOLERANCE["float32"], abs=1e-6)
    return out, rows


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_row_weights_and_row_losses_match_the_reference(backend: str, case: str) -> None:
    shape, options = CASES[case]
    out, rows = _check_case(backend, make_inputs(**shape), options)
    if case == "all-ignored":
        assert out.loss == 0.0 and not np.any(rows)
        assert not np.any(out.grad_x) and not np.any(out.grad_weight) and not np.any(out.grad_bias)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("case", list(CE_CASES))
def test_cross_entropy_row_weights_row_losses_and_z_loss(backend: str, case: str) -> None:
    shape, options = CE_CASES[case]
    _check_case(backend, make_inputs(**shape), options, fn="cross_entropy")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_loss_only_returns_the_rows_losses(backend: str) -> None:
    inp = make_inputs(10, 5, 21, target_format="logits")
    options = dict(beta=0.5, weight_hard_loss=0.5, z_loss_weight=0.1, chunk_size=4)
    w = row_weights(inp)
    out, rows = run_rows(backend, inp, w, grads=False, **options)
    assert out.grad_x is None
    assert_matches(out, inp, row_weight=w, **options)
    assert_rows_match(rows, inp, w, **options)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_empty_batch_gives_empty_row_losses(backend: str) -> None:
    inp = make_inputs(0, 4, 11)
    out, rows = run_rows(backend, inp, np.zeros(0, np.float32), weight_hard_loss=0.5, z_loss_weight=0.1)
    assert out.loss == 0.0 and rows.shape == (0,)
    assert out.grad_x.shape == (0, 4) and not np.any(out.grad_weight)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_row_losses_without_row_weights_and_unit_weights_change_nothing(backend: str) -> None:
    inp = make_inputs(9, 5, 23, target_format="log_probs", lead=(3, 3))
    options = dict(beta=1.0, weight_hard_loss=0.3, z_loss_weight=0.05)
    plain, rows = run_rows(backend, inp, None, **options)
    assert_matches(plain, inp, **options)
    assert_rows_match(rows, inp, None, **options)
    ones, rows_ones = run_rows(backend, inp, np.ones(inp.x.shape[:-1], np.float32), **options)
    assert ones.loss == pytest.approx(plain.loss, rel=1e-6)
    assert rel_err(ones.grad_weight, plain.grad_weight) < 1e-6
    np.testing.assert_allclose(rows_ones, rows, rtol=1e-6)


# ---------------------------------------------------------------- no gradient through row_losses


def test_torch_row_losses_carry_no_gradient() -> None:
    inp = make_inputs(7, 4, 13)
    a = torch_tensors(inp, requires_grad=True)
    loss, rows = torch_kl.fused_linear_kl_div(a["x"], a["weight"], a["target"], a["labels"], backend="torch",
                                              weight_hard_loss=0.5, return_row_losses=True)  # fmt: skip
    assert rows.grad_fn is None and not rows.requires_grad
    loss.backward()
    assert a["x"].grad is not None


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_jax_row_losses_carry_no_gradient(backend: str) -> None:
    import jax

    inp = make_inputs(7, 4, 13)
    a = jax_arrays(inp)

    def total(x, with_rows: bool):
        loss, rows = jax_kl.fused_linear_kl_div(x, a["weight"], a["target"], a["labels"], weight_hard_loss=0.5,
                                                return_row_losses=True, backend=backend)  # fmt: skip
        return loss + rows.sum() if with_rows else loss

    g_rows = jax.grad(total)(a["x"], True)
    g_loss = jax.grad(total)(a["x"], False)
    np.testing.assert_array_equal(np.asarray(g_rows), np.asarray(g_loss))


# ---------------------------------------------------------------- the nn.Module forms (torch)


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_modules_take_row_weights_and_return_row_losses(backend: str) -> None:
    name = backend.split("/")[1]
    inp = make_inputs(10, 5, 21, target_format="logits", bias=True)
    w = row_weights(inp)
    options = dict(beta=0.5, weight_hard_loss=0.4, z_loss_weight=0.05)
    a = torch_tensors(inp, requires_grad=True)
    module = torch_kl.FusedLinearKLDivLoss(target_format="logits", return_row_losses=True, backend=name, **options)
    loss, rows = module(a["x"], a["weight"], a["target"], a["labels"], a["bias"], row_weight=torch.tensor(w))
    loss.backward()
    out = Outputs(float(loss.detach()), *(a[k].grad.double().numpy() for k in ("x", "weight", "bias")))
    assert_matches(out, inp, row_weight=w, **options)
    assert_rows_match(rows.numpy(), inp, w, **options)

    ce = dict(z_loss_weight=0.05, reduction="sum")
    a = torch_tensors(inp, requires_grad=True)
    module = torch_kl.FusedLinearCrossEntropyLoss(return_row_losses=True, backend=name, **ce)
    loss, rows = module(a["x"], a["weight"], a["labels"], a["bias"], row_weight=torch.tensor(w))
    loss.backward()
    out = Outputs(float(loss.detach()), *(a[k].grad.double().numpy() for k in ("x", "weight", "bias")))
    assert_matches(out, inp, fn="cross_entropy", row_weight=w, **ce)
    assert_rows_match(rows.numpy(), inp, w, fn="cross_entropy", **ce)


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_jsd_module_parts_with_row_weights(backend: str) -> None:
    """``return_soft_hard_loss=True`` with row weights: each part is the weighted, reduced part."""
    inp = make_inputs(10, 6, 29, target_format="hidden", ht=5)
    w = row_weights(inp)
    a = torch_tensors(inp, requires_grad=True)
    module = torch_kl.FusedLinearJSDLoss(0.3, 0.7, 0.4, return_soft_hard_loss=True, backend=backend.split("/")[1])
    loss, soft, hard = module(a["x"], a["weight"], a["target"], a["teacher_weight"], a["labels"],
                              row_weight=torch.tensor(w))  # fmt: skip
    family = dict(beta=0.4, row_weight=w)
    assert float(soft) == pytest.approx(expected(inp, **family).loss, rel=TOLERANCE["float32"])
    hard_want = expected(inp, weight_soft_loss=0.0, weight_hard_loss=1.0, **family).loss
    assert float(hard) == pytest.approx(hard_want, rel=TOLERANCE["float32"])
    loss.backward()
    out = Outputs(float(loss.detach()), a["x"].grad.double().numpy(), a["weight"].grad.double().numpy(), None)
    assert_matches(out, inp, weight_soft_loss=0.7, weight_hard_loss=0.3, **family)


# ---------------------------------------------------------------- the reference against closed forms


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
def test_reference_weights_each_kept_row(reduction: str) -> None:
    """``sum`` gives ``sum_i w_i l_i``, ``batchmean`` / ``mean`` divide by the unweighted denominators,
    gradients included; the row losses are unweighted and unnormalised ``w_soft D + w_hard CE + z lse**2``,
    the z-loss's ``lse`` that of the logits at temperature 1."""
    inp = make_inputs(8, 4, 11, target_format="logits", bias=True)
    w = row_weights(inp).astype(np.float64)
    hard_side = dict(weight_hard_loss=0.5, z_loss_weight=0.1)
    common = dict(target_format="logits", beta=0.5, temperature=2.0)
    got = reference(inp.x, inp.weight, inp.target, inp.labels, bias=inp.bias, row_weight=w, return_row_losses=True,
                    reduction=reduction, weight_soft_loss=0.7, **hard_side, **common)  # fmt: skip
    kept = np.flatnonzero(inp.labels != -100)
    soft_n, hard_n = _denominators(inp, dict(reduction=reduction))

    def one_row(i: int, **weights) -> object:  # row i alone, summed: its own loss and gradients
        return reference(inp.x[[i]], inp.weight, inp.target[[i]], inp.labels[[i]], bias=inp.bias, reduction="sum",
                         **common, **weights)  # fmt: skip

    soft = [one_row(i) for i in kept]
    hard = [one_row(i, weight_soft_loss=0.0, **hard_side) for i in kept]
    z, lse = logits_and_lse(inp)
    ce = lse[kept] - z[kept, inp.labels[kept]]
    np.testing.assert_allclose([h.loss for h in hard], 0.5 * ce + 0.1 * lse[kept] ** 2, rtol=1e-10)
    loss = sum(w[i] * (0.7 * s.loss / soft_n + h.loss / hard_n) for i, s, h in zip(kept, soft, hard, strict=True))
    assert got.loss == pytest.approx(loss, rel=1e-10)
    grad_w = sum(w[i] * (0.7 * s.grad_weight / soft_n + h.grad_weight / hard_n)
                 for i, s, h in zip(kept, soft, hard, strict=True))  # fmt: skip
    np.testing.assert_allclose(got.grad_weight, grad_w, rtol=1e-9, atol=1e-12)
    rows = np.zeros(8)
    rows[kept] = [0.7 * s.loss + h.loss for s, h in zip(soft, hard, strict=True)]
    np.testing.assert_allclose(got.row_losses, rows, rtol=1e-10)


def test_reference_z_loss_of_the_cross_entropy_alone() -> None:
    inp = make_inputs(9, 4, 13, lead=(3, 3), ignore_frac=0.4)
    got = reference_cross_entropy(inp.x, inp.weight, inp.labels, z_loss_weight=0.2, return_row_losses=True)
    plain = reference_cross_entropy(inp.x, inp.weight, inp.labels, return_row_losses=True)
    lse = logits_and_lse(inp)[1]
    kept = inp.labels != -100
    assert got.row_losses.shape == (3, 3)
    np.testing.assert_allclose(got.row_losses - plain.row_losses, np.where(kept, 0.2 * lse**2, 0.0), atol=1e-12)
    assert got.loss - plain.loss == pytest.approx(0.2 * np.sum(lse[kept] ** 2) / kept.sum(), rel=1e-10)
