"""The teacher of one chunk, whatever form it arrives in (mirror of ``torch_kl/teachers.py``).

A dense target is read where it lies (``(array, row0)``: the Pallas kernels index the full
array, XLA fuses the slice), but for the few columns an unaligned vocabulary leaves; a teacher
head makes the chunk's logits with one more GEMM (per vocabulary part, as the student's); top-k
log-probabilities stay ``[rows, k]`` and are handled around the row kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax

from fused_kl.loss import Loss

from .gemm import logits


class TeacherArrays(NamedTuple):
    """The teacher's arrays, flattened to rows: ``target`` ``[N, V | Ht | k]``."""

    target: jax.Array | None = None
    weight: jax.Array | None = None
    bias: jax.Array | None = None
    indices: jax.Array | None = None


# A dense teacher as the row phases take it: the array and the row where the chunk starts; the
# chunk's columns are the array's first ones, as many as its logits have.
DenseChunk = tuple[jax.Array, int]


def dense_chunk(
    loss: Loss, arrays: TeacherArrays, start: int, stop: int, hidden: jax.Array | None, parts: Sequence[slice]
) -> tuple[DenseChunk | None, ...]:
    """The chunk's dense teacher as ``(array, row0)`` per vocabulary part (``jax_kl.gemm.
    vocab_parts``), or None per part: the part's teacher is that array's ``rows`` rows from
    ``row0`` and its first columns, as many as the part's logits have. For a teacher head,
    ``hidden`` is the chunk of its hidden states (sliced by the driver, after its barrier), and
    its GEMM makes each part. A dense target is read where it lies for the part of the first
    columns (every part of a chunk in one array); the few columns left at an unaligned
    vocabulary are sliced out (XLA fuses the slice into the XLA phases that take them)."""
    if loss.teacher is None or loss.teacher.dense_format is None or not loss.soft:
        return (None,) * len(parts)
    if hidden is not None:
        return tuple((u, 0) for u in logits(hidden, arrays.weight, arrays.bias, hidden.dtype, parts))  # type: ignore[arg-type]
    return tuple(
        (arrays.target, start) if cols.start == 0 else (arrays.target[start:stop, cols], 0)  # type: ignore[index]
        for cols in parts
    )
