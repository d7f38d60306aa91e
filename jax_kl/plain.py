"""The row kernel in plain ``jax.numpy``: the ``"xla"`` backend, for any device.

Same inputs, outputs and math as ``kernel.kl_rows`` (see its module docstring), written
with whole-row array ops that XLA fuses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fused_kl.contract import Options


def kl_rows(
    z: jax.Array,
    target: jax.Array,
    labels: jax.Array | None,
    scale: jax.Array,
    row0: int,
    opts: Options,
    tile: tuple[int, int],
    write_grad: bool,
) -> tuple[jax.Array | None, jax.Array]:
    """Return ``(dL/dz or None, the chunk's float32 row losses)``."""
    del tile  # whole rows at once
    rows = slice(row0, row0 + z.shape[0])
    log_q = jax.nn.log_softmax(z.astype(jnp.float32) / opts.temperature, axis=-1)
    t = target[rows].astype(jnp.float32)
    if opts.target_format == "probs":
        p, log_p = t, jnp.log(jnp.maximum(t, opts.eps))
    elif opts.target_format == "log_probs":
        p, log_p = jnp.exp(t), t
    else:
        log_p = jax.nn.log_softmax(t / opts.teacher_temperature, axis=-1)
        p = jnp.exp(log_p)
    term = jnp.where(p == 0, 0.0, p * (log_p - log_q))
    keep = (labels[rows] != opts.ignore_index) if labels is not None else jnp.ones(z.shape[0], bool)
    row_loss = jnp.where(keep, term.sum(-1) * scale[0], 0.0)
    if not write_grad:
        return None, row_loss
    p_sum = 1.0 if opts.target_format == "logits" else p.sum(-1, keepdims=True)
    g = (jnp.exp(log_q) * p_sum - p) * (scale[1] / opts.temperature)
    return jnp.where(keep[:, None], g, 0.0).astype(z.dtype), row_loss
