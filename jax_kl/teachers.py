"""The teacher of one chunk, whatever form it arrives in (mirror of ``torch_kl/teachers.py``).

A dense target is read where it lies (``(array, row0)``: the Pallas kernels index the full
array, XLA fuses the slice); a teacher head makes the chunk's logits with one more GEMM;
top-k log-probabilities stay ``[rows, k]`` and are handled around the row kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fused_kl.loss import Loss

from .gemm import dot


class TeacherArrays(NamedTuple):
    """The teacher's arrays, flattened to rows: ``target`` ``[N, V | Ht | k]``."""

    target: jax.Array | None = None
    weight: jax.Array | None = None
    bias: jax.Array | None = None
    indices: jax.Array | None = None


# A dense teacher as the row phases take it: the array and the row where the chunk starts.
DenseChunk = tuple[jax.Array, int]


def dense_chunk(loss: Loss, arrays: TeacherArrays, start: int, hidden: jax.Array | None) -> DenseChunk | None:
    """The chunk's dense teacher as ``(array, row0)``, or None. For a teacher head, ``hidden``
    is the chunk of its hidden states (sliced by the driver, after its barrier)."""
    if loss.teacher is None or loss.teacher.dense_format is None or not loss.soft:
        return None
    if hidden is None:
        return arrays.target, start  # type: ignore[return-value]
    if arrays.bias is None:
        return dot(hidden, arrays.weight, (1, 1), hidden.dtype), 0
    u = dot(hidden, arrays.weight, (1, 1), jnp.float32) + arrays.bias.astype(jnp.float32)  # type: ignore[union-attr]
    return u.astype(hidden.dtype), 0
