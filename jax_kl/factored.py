"""A factored chunk in JAX (``fused_kl.factored``; mirror of ``torch_kl.driver._factored_chunk``
with ``torch_kl/backends/triton_factored.py``): the cross-entropy and the z-loss, no teacher.

The backend's ``exp_stats`` pass reads the chunk's logits once and writes ``E`` over them with
the rows' statistics: no ``stats`` pass before it, no ``finish`` pass after. A row whose
maximum left the window (``fused_kl.factored.in_window``) is remade from its logits with its
own log-sum-exp as the shift, :data:`REMADE_ROWS` rows a GEMM, in a loop that runs no step where every row
kept the fixed shift. ``grad_x = diag(alpha) (E W)`` with the label's term, ``grad_W += E^T
(diag(alpha) x)``, the label's term of ``grad_W`` added once after the last chunk, as in every
chunk (``fused_kl.chunk.LabelTerm``). Top-k teachers are not factored here: ``torch_kl`` reads
their logits back from ``log E`` in a kernel of its own.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fused_kl import factored, rowmath, terms
from fused_kl.chunk import LabelTerm, label_term, local_labels
from fused_kl.loss import Loss
from fused_kl.rows import STATS

from . import gemm

REMADE_ROWS = 64  # rows a GEMM when remaking rows out of the window: a [64, V] float32 product


def takes(x: jax.Array, bias: jax.Array | None, loss: Loss, layout: Any) -> bool:
    """Whether a call's chunks factor here: ``fused_kl.factored.takes`` without top-k teachers,
    the hard term at temperature 1 (the exponent ``exp_stats`` writes), whole rows (a
    vocabulary-sharded layout would need its collective inside the loop that remakes rows)."""
    bf16 = x.dtype == jnp.bfloat16
    plain = layout.vocab_axis is None and not loss.separate_hard_lse
    return plain and factored.takes(bf16, bias is not None, loss, topk=False)


class Factors(NamedTuple):
    """A factored chunk's ``dL/dz = diag(alpha) E`` plus ``label`` (None without the cross-entropy)."""

    e: jax.Array
    alpha: jax.Array
    label: LabelTerm | None

    def scaled_rows(self, xc: jax.Array) -> jax.Array:
        """``diag(alpha) xc`` in ``xc``'s dtype: what ``grad_W``'s GEMM reads with ``E``."""
        return (self.alpha[:, None] * xc.astype(jnp.float32)).astype(xc.dtype)


def _remade(e: jax.Array, bad: jax.Array, q_factor: jax.Array, xc: jax.Array, weight: jax.Array,
            loss: Loss) -> jax.Array:  # fmt: skip
    """``e`` with each ``bad`` row remade as ``softmax(f(x_r W^T)) u`` from its float32 logits, its
    shift its own log-sum-exp, so that the row sums to 1 whatever the rounding of the logits the
    statistics read (0 where the row's ``q_factor`` is: an ignored row's ``E`` may be infinite, and
    ``0 * inf`` would reach the GEMMs)."""
    rows = e.shape[0]
    order = jnp.nonzero(bad, size=rows, fill_value=rows)[0]  # the bad rows, then `rows` (dropped)
    order = jnp.pad(order, (0, -rows % REMADE_ROWS), constant_values=rows)

    def remake(i: jax.Array, e: jax.Array) -> jax.Array:
        at = lax.dynamic_slice_in_dim(order, i * REMADE_ROWS, REMADE_ROWS)
        held = jnp.minimum(at, rows - 1)
        z = gemm.dot(xc[held], weight, (1, 1), jnp.float32)
        own = jax.nn.logsumexp(terms.transform(z, loss.logit_scale, loss.softcap, jnp), axis=1)
        values = factored.exponentials(z, loss, jnp, own[:, None])
        values = jnp.where((q_factor[held] != 0)[:, None], values, 0.0)
        return e.at[at].set(values.astype(e.dtype), mode="drop")

    steps = (jnp.sum(bad, dtype=jnp.int32) + REMADE_ROWS - 1) // REMADE_ROWS
    return lax.fori_loop(0, steps, remake, e)


def chunk(
    z: jax.Array, xc: jax.Array, weight: jax.Array, y: jax.Array | None, keep: jax.Array, row_weight: jax.Array | None,
    scales: rowmath.RowScales, v0: Any, v_total: int, weights: rowmath.LossWeights, loss: Loss, layout: Any,
    write_grad: bool, phases: ModuleType,
) -> tuple[tuple[jax.Array, jax.Array], Factors | None]:  # fmt: skip
    """``((the rows' shares of the loss, their own losses), Factors or None without write_grad)``
    of a chunk of logits ``z``, one array of this vocabulary slice; ``phases`` the module whose
    ``exp_stats`` makes ``E``."""
    y_local = local_labels(y, v0, loss)
    e, local_stats, row_max = phases.exp_stats(z, y_local, loss)
    stats = layout.combine_stats(local_stats)
    losses = rowmath.row_losses(stats, keep, None, row_weight, weights, loss, v_total, jnp)
    if not write_grad:
        return losses, None
    lse = stats[:, STATS.lse]
    q_factor = scales.hard + rowmath.z_scale(stats, scales)  # the z-loss's gradient is a multiple of q
    bad = ~factored.in_window(row_max) | ~jnp.isfinite(lse)
    shift = jnp.where(bad, lse, factored.SHIFT)  # a remade row's alpha: w logit_scale
    e = _remade(e, bad, q_factor, xc, weight, loss)
    label = None
    if loss.cross_entropy:
        label = label_term(y_local, z.shape[1], scales.hard, stats[:, STATS.label_logit], loss, None, jnp)
    return losses, Factors(e, factored.alpha(q_factor, shift, lse, loss, jnp), label)
