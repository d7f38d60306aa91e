"""Hyperparameters as values (docs/contract.md): a schedule that changes ``temperature``,
``teacher_temperature``, ``beta`` (within one kind), the loss weights or ``label_smoothing``
between calls runs one compiled function without error (torch: past Dynamo's recompile limit of
8; JAX: traced 0-d arrays, no new trace), each call giving the eager result."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from harness import jax_arrays, make_inputs, torch_tensors

import jax_kl
import torch_kl

N, H, V = 6, 8, 16
STEPS = 12  # more than Dynamo's recompile limit (8)


def _schedule(step: int) -> dict[str, float]:
    """Every value changes at every step; beta stays inside (0, 1), the JSD kind."""
    return dict(
        temperature=1.0 + 0.15 * step,
        teacher_temperature=2.0 - 0.1 * step,
        beta=0.2 + 0.05 * step,
        weight_hard_loss=0.1 * step,  # 0 at the first step: the hard term stays, weighed by 0
        weight_soft_loss=1.0 - 0.05 * step,
        label_smoothing=0.02 * step,
    )


def _torch_problem(target_format: str = "logits") -> dict:
    inp = make_inputs(N, H, V, target_format=target_format, seed=5, ignore_frac=0.3)
    return torch_tensors(inp, requires_grad=True)


def _torch_step(a: dict, fn, **values) -> tuple[np.ndarray, ...]:
    """Loss, grad_x and grad_weight of ``fn`` on the problem ``a`` (gradients reset after)."""
    x, w = a["x"], a["weight"]
    loss = fn(x, w, a["target"], a["labels"], **values)
    loss.backward()
    out = tuple(t.detach().double().numpy().copy() for t in (loss, x.grad, w.grad))
    x.grad = w.grad = None
    return out


def _kl(x, w, target, labels, **values):
    return torch_kl.fused_linear_kl_div(x, w, target, labels, target_format="logits", backend="torch", **values)


def _assert_close(got: tuple, want: tuple) -> None:
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)


def test_a_temperature_schedule_runs_one_compiled_function_with_the_eager_results() -> None:
    torch._dynamo.reset()
    a = _torch_problem()
    compiled = torch.compile(_kl, backend="eager", fullgraph=True)
    temperatures = [0.5 + 0.25 * i for i in range(STEPS)]
    for t in temperatures:
        _assert_close(_torch_step(a, compiled, temperature=t), _torch_step(a, _kl, temperature=t))


def test_every_value_changing_at_every_step_runs_one_compiled_function() -> None:
    torch._dynamo.reset()
    a = _torch_problem()
    compiled = torch.compile(_kl, backend="eager", fullgraph=True)
    for step in range(STEPS):
        values = _schedule(step)
        _assert_close(_torch_step(a, compiled, **values), _torch_step(a, _kl, **values))


@pytest.mark.parametrize("name", ["temperature", "weight_hard_loss"])
def test_a_zero_d_tensor_is_a_value_in_eager_torch(name: str) -> None:
    a = _torch_problem()
    base = dict(weight_hard_loss=0.25)
    want = _torch_step(a, _kl, **{**base, name: 1.5})
    _assert_close(_torch_step(a, _kl, **{**base, name: torch.tensor(1.5)}), want)


def _jax_problem() -> dict:
    return jax_arrays(make_inputs(N, H, V, target_format="logits", seed=5, ignore_frac=0.3))


def _jax_kl(a: dict, backend: str = "xla", **values):
    def loss(x, w):
        return jax_kl.fused_linear_kl_div(x, w, a["target"], a["labels"], target_format="logits", backend=backend,
                                          **values)  # fmt: skip

    return loss


def _jax_eager(a: dict, **values) -> tuple:
    loss, grads = jax.value_and_grad(_jax_kl(a, **values), argnums=(0, 1))(a["x"], a["weight"])
    return (loss, *grads)


def test_traced_values_change_without_a_new_trace_and_give_the_float_results() -> None:
    a = _jax_problem()
    traces = []

    def step(x, w, values):
        traces.append(1)
        return _jax_kl(a, **values)(x, w)

    grad_step = jax.jit(jax.value_and_grad(step, argnums=(0, 1, 2)))
    for i in range(4):
        values = _schedule(i)
        loss, (gx, gw, g_values) = grad_step(a["x"], a["weight"], {k: jnp.float32(v) for k, v in values.items()})
        _assert_close((loss, gx, gw), _jax_eager(a, **values))
        assert all(float(g) == 0.0 for g in g_values.values()), "a traced hyperparameter gets no gradient"
    assert len(traces) == 1


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_a_traced_beta_at_either_end_gives_the_jsd_limit(beta: float) -> None:
    """A traced beta is the JSD kind; at 0 and at 1 its two terms vanish: loss 0, gradients 0."""
    a = _jax_problem()
    loss, grads = jax.jit(jax.value_and_grad(lambda x, w, b: _jax_kl(a, beta=b)(x, w), argnums=(0, 1)))(
        a["x"], a["weight"], jnp.float32(beta)
    )
    assert float(loss) == pytest.approx(0.0, abs=1e-6)
    assert all(float(jnp.abs(g).max()) < 1e-6 for g in grads)
    assert float(_jax_kl(a, beta=beta)(a["x"], a["weight"])) > 0.01  # a concrete beta: that KL


def test_a_concrete_zero_d_array_is_checked_like_a_float() -> None:
    a = _jax_problem()
    _assert_close(_jax_eager(a, temperature=jnp.float32(1.5)), _jax_eager(a, temperature=1.5))
    with pytest.raises(ValueError, match="temperature"):
        _jax_kl(a, temperature=jnp.float32(-1.0))(a["x"], a["weight"])
    with pytest.raises(TypeError, match="label_smoothing"):
        _jax_kl(a, label_smoothing=jnp.zeros(2))(a["x"], a["weight"])


def test_a_traced_value_on_a_kernel_backend_is_refused_by_name() -> None:
    a = _jax_problem()
    with pytest.raises(ValueError, match=r"temperature.*'pallas'"):
        jax.jit(lambda t: _jax_kl(a, backend="pallas", temperature=t)(a["x"], a["weight"]))(jnp.float32(2.0))


def test_a_traced_beta_with_a_top_k_teacher_is_refused() -> None:
    a = jax_arrays(make_inputs(N, H, V, target_format="topk_log_probs", k=4, seed=5))

    def loss(b):
        topk = dict(target_format="topk_log_probs", target_indices=a["target_indices"])
        return jax_kl.fused_linear_kl_div(a["x"], a["weight"], a["target"], a["labels"], beta=b, **topk)

    with pytest.raises(ValueError, match="beta"):
        jax.jit(loss)(jnp.float32(0.0))
