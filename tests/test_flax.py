"""``jax_kl.flax.head_params``: an NNX head in the loss's ``[V, H]`` layout, gradients back to the module."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx", reason="jax_kl.flax needs flax: pip install 'fused-kl[flax]'")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_kl  # noqa: E402
from jax_kl.flax import HeadParams, head_params  # noqa: E402

H, V = 8, 24


def _hidden(rows: int = 6) -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).normal(size=(rows, H)), jnp.float32)


class _TiedLM(nnx.Module):
    def __init__(self) -> None:
        self.embed = nnx.Embed(V, H, rngs=nnx.Rngs(0))
        self.lm_head = self.embed


def test_linear_head_gives_the_transposed_kernel_and_its_bias() -> None:
    head = nnx.Linear(H, V, rngs=nnx.Rngs(0))
    head.bias[...] = jnp.arange(V, dtype=jnp.float32)  # a bias that is not zero, so a dropped one shows
    weight, bias = head_params(head)
    assert weight.shape == (V, H) and bias.shape == (V,)
    h = _hidden()
    np.testing.assert_allclose(jnp.dot(h, weight.T, precision="highest") + bias, head(h), rtol=1e-5, atol=1e-6)


def test_linear_head_without_bias_gives_none() -> None:
    assert head_params(nnx.Linear(H, V, use_bias=False, rngs=nnx.Rngs(0))).bias is None


def test_tied_embedding_is_the_weight_as_is() -> None:
    embed = nnx.Embed(V, H, rngs=nnx.Rngs(0))
    weight, bias = head_params(embed)
    assert bias is None
    np.testing.assert_array_equal(weight, embed.embedding[...])
    h = _hidden()
    np.testing.assert_allclose(jnp.dot(h, weight.T, precision="highest"), embed.attend(h), rtol=1e-5, atol=1e-6)


def test_model_with_an_lm_head_gives_that_head() -> None:
    model = _TiedLM()
    np.testing.assert_array_equal(head_params(model).weight, model.embed.embedding[...])


@pytest.mark.parametrize("head", [nnx.LayerNorm(H, rngs=nnx.Rngs(0)), jnp.ones((V, H))], ids=["module", "array"])
def test_anything_else_is_a_type_error_naming_head(head: object) -> None:
    with pytest.raises(TypeError, match=r"^head: expected an nnx.Linear head"):
        head_params(head)


def test_loss_gradient_reaches_the_linear_kernel_and_bias() -> None:
    head = nnx.Linear(H, V, rngs=nnx.Rngs(0))
    h = _hidden()
    teacher = jax.nn.softmax(jnp.asarray(np.random.default_rng(1).normal(size=(6, V)), jnp.float32), -1)

    def fused(head: nnx.Linear) -> jax.Array:
        weight, bias = head_params(head)
        return jax_kl.fused_linear_kl_div(h, weight, teacher, bias=bias, temperature=2.0)

    def unfused(head: nnx.Linear) -> jax.Array:
        with jax.default_matmul_precision("highest"):
            log_q = jax.nn.log_softmax(head(h) / 2.0, -1)
        return jnp.sum(teacher * (jnp.log(teacher) - log_q)) / h.shape[0]

    loss, grads = nnx.value_and_grad(fused)(head)
    expected, expected_grads = nnx.value_and_grad(unfused)(head)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(grads.kernel[...], expected_grads.kernel[...], rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(grads.bias[...], expected_grads.bias[...], rtol=1e-4, atol=1e-7)
    assert float(jnp.abs(grads.bias[...]).max()) > 0


def test_a_lora_head_folds_its_adapter_and_trains_it() -> None:
    """``nnx.LoRALinear``: the loss sees ``W + A B`` (the head's own output), and the adapter's
    gradients are the unfused loss's."""
    head = nnx.LoRALinear(H, V, lora_rank=2, rngs=nnx.Rngs(0))
    head.lora.lora_b[...] = jnp.asarray(np.random.default_rng(2).normal(size=(2, V)), jnp.float32)
    h = _hidden()
    weight, bias = head_params(head)
    np.testing.assert_allclose(h @ weight.T + bias, head(h), rtol=1e-5, atol=1e-5)
    teacher = jax.nn.softmax(jnp.asarray(np.random.default_rng(1).normal(size=(6, V)), jnp.float32), -1)

    def fused(head: nnx.LoRALinear) -> jax.Array:
        weight, bias = head_params(head)
        return jax_kl.fused_linear_kl_div(h, weight, teacher, bias=bias)

    def unfused(head: nnx.LoRALinear) -> jax.Array:
        with jax.default_matmul_precision("highest"):
            log_q = jax.nn.log_softmax(head(h), -1)
        return jnp.sum(teacher * (jnp.log(teacher) - log_q)) / h.shape[0]

    grads, expected = nnx.grad(fused)(head), nnx.grad(unfused)(head)
    for name in ("lora_a", "lora_b"):
        got, want = getattr(grads.lora, name)[...], getattr(expected.lora, name)[...]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
        assert float(jnp.abs(got).max()) > 0


def test_a_linear_subclass_with_its_own_output_is_refused() -> None:
    class Scaled(nnx.Linear):
        def __call__(self, x: jax.Array) -> jax.Array:
            return 2.0 * super().__call__(x)

    with pytest.raises(TypeError, match=r"^head: a Scaled computes its own output"):
        head_params(Scaled(H, V, rngs=nnx.Rngs(0)))


def test_head_params_is_a_named_pair() -> None:
    params = head_params(nnx.Linear(H, V, rngs=nnx.Rngs(0)))
    assert isinstance(params, HeadParams) and params.weight is params[0] and params.bias is params[1]


def test_import_jax_kl_imports_neither_flax_nor_tunix() -> None:
    optional = ("flax", "tunix", "jax_kl.flax", "jax_kl.tunix")
    code = f"import sys, jax_kl; print(sorted(m for m in {optional} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]"
