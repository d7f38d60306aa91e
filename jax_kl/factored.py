"""A factored chunk in JAX (``fused_kl.factored``; mirror of ``torch_kl.driver._factored_chunk``
with ``torch_kl/backends/triton_factored.py``): the cross-entropy, the z-loss, top-k teachers.

The backend's ``exp_stats`` pass reads the chunk's logits once and writes ``E`` over them with
the rows' statistics (at an unaligned vocabulary, one pass per part, ``fused_kl.chunk.VocabPart``,
their statistics combined): no ``stats`` pass before it, no ``finish`` pass after. The label's logit
and a top-k teacher's tokens' logits are gathered before it. A row whose maximum left the
window (``fused_kl.factored.in_window``) is remade from its float32 logits with its own
log-sum-exp as the shift, :data:`REMADE_ROWS` rows a GEMM, in a loop that runs no step where
every row kept the fixed shift. The teacher's tokens' ``E_j`` are written as ``dL/dz_j /
alpha_r`` (``fused_kl.chunk.topk_part`` makes ``dL/dz`` there). ``grad_x = diag(alpha) (E W)``
with the label's term, ``grad_W += E^T (diag(alpha) x)``, the label's term of ``grad_W`` added
once after the last chunk, as in every chunk (``fused_kl.chunk.LabelTerm``).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fused_kl import factored, rowmath
from fused_kl.chunk import (
    LabelTerm,
    VocabPart,
    gather_parts,
    label_term,
    local_labels,
    part_labels,
    parts_stats,
    set_in_parts,
    topk_part,
)
from fused_kl.loss import Loss
from fused_kl.rows import STATS

from . import gemm
from .ops import OPS

REMADE_ROWS = 64  # rows a GEMM when remaking rows out of the window: a [64, V] float32 product


def takes(x: jax.Array, bias: jax.Array | None, loss: Loss, layout: Any) -> bool:
    """Whether a call's chunks factor here: ``fused_kl.factored.takes``, one exponent for every
    term (``fused_kl.factored.exponent``: the cross-entropy at temperature 1), whole rows (a
    vocabulary-sharded layout would need its collective inside the loop that remakes rows)."""
    bf16 = x.dtype == jnp.bfloat16
    plain = layout.vocab_axis is None and not loss.separate_hard_lse
    return plain and factored.takes(bf16, bias is not None, loss, topk=True)


class Factors(NamedTuple):
    """A factored chunk's ``dL/dz = diag(alpha) E`` plus ``label`` (None without the cross-entropy);
    ``e`` one array per vocabulary part."""

    e: tuple[jax.Array, ...]
    alpha: jax.Array
    label: LabelTerm | None

    def scaled_rows(self, xc: jax.Array) -> jax.Array:
        """``diag(alpha) xc`` in ``xc``'s dtype: what ``grad_W``'s GEMM reads with ``E``."""
        return (self.alpha[:, None] * xc.astype(jnp.float32)).astype(xc.dtype)


def _remade(parts: Sequence[VocabPart], bad: jax.Array, q_factor: jax.Array, xc: jax.Array, weight: jax.Array,
            loss: Loss) -> tuple[jax.Array, ...]:  # fmt: skip
    """The ``parts``' ``E`` (their arrays) with each ``bad`` row remade as
    ``softmax(f(x_r W^T)) u`` from its float32 logits, its shift its own log-sum-exp, so that the
    row sums to 1 whatever the rounding of the logits the statistics read (0 where the row's
    ``q_factor`` is: an ignored row's ``E`` may be infinite, and ``0 * inf`` would reach the
    GEMMs)."""
    rows = parts[0].z.shape[0]
    order = jnp.nonzero(bad, size=rows, fill_value=rows)[0]  # the bad rows, then `rows` (dropped)
    order = jnp.pad(order, (0, -rows % REMADE_ROWS), constant_values=rows)

    def remake(i: jax.Array, es: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        at = lax.dynamic_slice_in_dim(order, i * REMADE_ROWS, REMADE_ROWS)
        held = jnp.minimum(at, rows - 1)
        z = gemm.dot(xc[held], weight, (1, 1), jnp.float32)
        own = jax.nn.logsumexp(factored.exponent(z, loss, jnp), axis=1)
        values = factored.exponentials(z, loss, jnp, own[:, None])
        values = jnp.where((q_factor[held] != 0)[:, None], values, 0.0)
        return tuple(
            e.at[at].set(values[:, c : c + e.shape[1]].astype(e.dtype), mode="drop")
            for e, c in zip(es, (p.start for p in parts), strict=True)
        )

    steps = (jnp.sum(bad, dtype=jnp.int32) + REMADE_ROWS - 1) // REMADE_ROWS
    return lax.fori_loop(0, steps, remake, tuple(p.z for p in parts))


def chunk(
    parts: Sequence[VocabPart], xc: jax.Array, weight: jax.Array, y: jax.Array | None, keep: jax.Array,
    row_weight: jax.Array | None, scales: rowmath.RowScales, topk: tuple[jax.Array, jax.Array] | None, v0: Any,
    v_total: int, weights: rowmath.LossWeights, loss: Loss, layout: Any, write_grad: bool,
) -> tuple[tuple[jax.Array, jax.Array], Factors | None]:  # fmt: skip
    """``((the rows' shares of the loss, their own losses), Factors or None without write_grad)``
    of a chunk whose logits are ``parts`` of this vocabulary slice (no teacher chunk; each part's
    ``phases`` has an ``exp_stats`` pass), ``topk`` its top-k teacher's ``(log-probs, token ids)``
    or None."""
    y_local = local_labels(y, v0, loss)
    width = sum(p.z.shape[1] for p in parts)
    zs, at_tokens = tuple(p.z for p in parts), None
    if topk is not None:  # the student's logits at the teacher's tokens, read before E overwrites them
        idx = topk[1]
        at_tokens = gather_parts(parts, jnp.where((idx >= v0) & (idx < v0 + width), idx - v0, 0), OPS)
        zs, at_tokens = OPS.materialize(zs, at_tokens)
    passes = [
        p.phases.exp_stats(z, yp, loss) for p, z, yp in zip(parts, zs, part_labels(y_local, parts), strict=True)
    ]
    es, each, maxima = (tuple(column) for column in zip(*passes, strict=True))
    stats = layout.combine_stats(parts_stats(each, jnp))
    c_soft, c_hard, c_z = scales.soft, scales.hard, rowmath.z_scale(stats, scales)  # the z-loss's: a multiple of q
    soft, sparse, k = None, None, None  # k: a top-k teacher's rows' K
    if topk is not None:
        soft, k, at, g_at, write = topk_part(
            lambda at, inside: at_tokens, topk, y, (c_soft, c_hard, c_z), v0, width, stats, loss, v_total, layout, OPS
        )  # fmt: skip
        sparse = (at, g_at, write)
    q_factor = factored.q_factor(c_soft, c_hard, c_z, k, loss, jnp)
    losses = rowmath.row_losses(stats, keep, soft, row_weight, weights, loss, v_total, jnp)
    if not write_grad:
        return losses, None
    row_max = functools.reduce(jnp.maximum, maxima)
    parts = [p._replace(z=e) for p, e in zip(parts, es, strict=True)]
    return losses, settle(parts, row_max, stats, q_factor, c_hard, y_local, loss, sparse, xc, weight)


def settle(
    parts: Sequence[VocabPart], row_max: jax.Array, stats: jax.Array, q_factor: jax.Array, c_hard: jax.Array,
    y: jax.Array | None, loss: Loss, sparse: tuple[jax.Array, jax.Array, jax.Array] | None, xc: jax.Array,
    weight: jax.Array,
) -> Factors:  # fmt: skip
    """The chunk's :class:`Factors` from the pass's ``E`` (``parts``' arrays) and each row's
    maximum exponent (``torch_kl``'s ``triton_factored.settle``): ``q_factor`` the rows' factor
    ``w`` of ``q``, ``stats`` their combined ``Stats``, ``y`` the local labels (None without the
    hard term), ``sparse`` ``(at, values, mask)``, a top-k teacher's ``dL/dz`` at its tokens. Rows
    out of the window are remade; rows with no dense part (``w = 0``) but sparse values are
    zeroed; then the sparse entries are written."""
    lse = stats[:, STATS.lse]
    remake = ~factored.in_window(row_max) | ~jnp.isfinite(lse)
    shift = jnp.where(remake, lse, factored.SHIFT)  # a remade row's alpha: w logit_scale
    dense, held = q_factor, None
    if sparse is not None:  # a row whose gradient lies at the teacher's tokens alone: E zeroed there
        at, values, write = sparse
        empty = factored.only_sparse(q_factor, values, write)
        remake, dense = remake | empty, jnp.where(empty, 1.0, q_factor)
        held = factored.label_held(at, write, y)
    es = _remade(parts, remake, q_factor, xc, weight, loss)
    alpha = factored.alpha(dense, shift, lse, loss, jnp)
    if sparse is not None:
        es = set_in_parts(es, parts, at, values / jnp.where(alpha == 0, 1.0, alpha)[:, None], write, OPS)
    label = None
    if loss.cross_entropy:
        width = sum(e.shape[1] for e in es)
        label = label_term(y, width, c_hard, stats[:, STATS.label_logit], loss, held, jnp)
    return Factors(es, alpha, label)
