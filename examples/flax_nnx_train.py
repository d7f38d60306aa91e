"""Train a small Flax NNX student with optax under ``nnx.jit``, distilling a frozen NNX teacher
through ``jax_kl.fused_linear_kl_div`` with ``target_format="hidden"``.

The head layout: the loss takes the head as ``[V, H]`` (``nn.Linear`` / tied-embedding layout)
in both frameworks. ``jax_kl.flax.head_params`` gives it from either kind of NNX head: the student's
``nnx.Linear(H, V)``, whose kernel is ``[H, V]`` (transposed; under ``jit`` the transpose folds into
the GEMMs), and the teacher's tied ``nnx.Embed``, already ``[V, H]``. The example checks the first
step's loss and gradients against the unfused loss (full logits, ``log_softmax``, float32), then
checks that the loss goes down over 20 steps.

Runs on CPU in seconds.

    python examples/flax_nnx_train.py
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_kl
from jax_kl.flax import head_params

VOCAB, BATCH, SEQ, TEMPERATURE = 384, 8, 16, 1.5


class TinyLM(nnx.Module):
    """Embedding, one residual MLP block, layer norm, and a head: an ``nnx.Linear`` ``lm_head``, or
    the embedding itself when ``tied``."""

    def __init__(self, hidden: int, *, tied: bool, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, hidden, rngs=rngs)
        self.up = nnx.Linear(hidden, 4 * hidden, rngs=rngs)
        self.down = nnx.Linear(4 * hidden, hidden, rngs=rngs)
        self.norm = nnx.LayerNorm(hidden, rngs=rngs)
        self.lm_head = self.embed if tied else nnx.Linear(hidden, VOCAB, rngs=rngs)

    def hidden(self, tokens: jax.Array) -> jax.Array:
        """The hidden states entering the head, ``[B, T, H]``."""
        h = self.embed(tokens)
        return self.norm(h + self.down(jax.nn.gelu(self.up(h))))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Full ``[B, T, V]`` logits: only the unfused reference uses this."""
        h = self.hidden(tokens)
        return self.lm_head.attend(h) if isinstance(self.lm_head, nnx.Embed) else self.lm_head(h)


def fused_loss(student: TinyLM, teacher: TinyLM, tokens: jax.Array, labels: jax.Array) -> jax.Array:
    w, b = head_params(student)  # the student's nnx.Linear lm_head: kernel [H, V] -> [V, H]
    tw, tb = head_params(teacher)  # the teacher's tied nnx.Embed: [V, H], no bias
    t_hidden = jax.lax.stop_gradient(teacher.hidden(tokens))
    return jax_kl.fused_linear_kl_div(
        student.hidden(tokens), w, t_hidden, labels, bias=b,
        target_format="hidden", teacher_weight=tw, teacher_bias=tb, temperature=TEMPERATURE,
    )  # fmt: skip


def unfused_loss(student: TinyLM, teacher: TinyLM, tokens: jax.Array, labels: jax.Array) -> jax.Array:
    """KL(teacher || student) at ``TEMPERATURE`` on full logits, mean over kept positions."""
    with jax.default_matmul_precision("highest"):
        log_q = jax.nn.log_softmax(student(tokens) / TEMPERATURE, axis=-1)
        log_p = jax.nn.log_softmax(jax.lax.stop_gradient(teacher(tokens)) / TEMPERATURE, axis=-1)
    keep = labels != -100
    rows = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    return jnp.sum(jnp.where(keep, rows, 0.0)) / jnp.sum(keep)


@nnx.jit
def train_step(
    student: TinyLM, optimizer: nnx.Optimizer, teacher: TinyLM, tokens: jax.Array, labels: jax.Array
) -> jax.Array:
    loss, grads = nnx.value_and_grad(fused_loss)(student, teacher, tokens, labels)
    optimizer.update(student, grads)
    return loss


def main() -> None:
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ)), dtype=jnp.int32)
    labels = tokens.at[::2, -5:].set(-100)  # padding on every other row: ignored positions
    student = TinyLM(32, tied=False, rngs=nnx.Rngs(0))
    teacher = TinyLM(96, tied=True, rngs=nnx.Rngs(1))
    teacher.embed.embedding[...] = 4.0 * teacher.embed.embedding[...]  # a peakier teacher: more to learn

    # First step: the fused loss and gradients equal the unfused ones.
    fused, g_fused = nnx.jit(nnx.value_and_grad(fused_loss))(student, teacher, tokens, labels)
    ref, g_ref = nnx.jit(nnx.value_and_grad(unfused_loss))(student, teacher, tokens, labels)
    print(f"first step: fused {float(fused):.6f}  unfused {float(ref):.6f}")
    np.testing.assert_allclose(fused, ref, rtol=1e-5)
    flat_fused, flat_ref = jax.tree.leaves(nnx.to_pure_dict(g_fused)), jax.tree.leaves(nnx.to_pure_dict(g_ref))
    n_params = len(jax.tree.leaves(nnx.to_pure_dict(nnx.state(student, nnx.Param))))
    assert len(flat_fused) == len(flat_ref) == n_params, "one gradient per student parameter"
    for a, b in zip(flat_fused, flat_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * float(jnp.abs(b).max()))
    print(f"  {len(flat_ref)} gradients match the unfused ones")

    optimizer = nnx.Optimizer(student, optax.adam(1e-2), wrt=nnx.Param)
    losses = [float(train_step(student, optimizer, teacher, tokens, labels)) for _ in range(20)]
    for step in (0, 5, 10, 15, 19):
        print(f"step {step:2d}  loss {losses[step]:.4f}")
    np.testing.assert_allclose(losses[0], ref, rtol=1e-5)  # the jitted train step saw the same loss
    assert all(b < a for a, b in itertools.pairwise(losses)), "loss should fall at every step"
    assert losses[-1] < 0.6 * losses[0], f"loss did not go down enough: {losses[0]:.4f} -> {losses[-1]:.4f}"
    print("OK")


if __name__ == "__main__":
    main()
