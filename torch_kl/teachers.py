"""The teacher of one chunk, whatever form it arrives in.

A dense target is sliced; a teacher head makes the chunk's logits with one more GEMM (the
teacher's ``[N, V]`` logits never exist); top-k log-probabilities stay ``[rows, k]`` and are
handled around the row kernel (``fused_kl.rowmath.topk``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fused_kl.loss import Loss

from .gemm import logits as cublas_logits


@dataclass
class TeacherArrays:
    """The teacher's arrays, flattened to rows: ``target`` ``[N, V | Ht | k]``."""

    target: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    indices: torch.Tensor | None = None


def dense_chunk(
    loss: Loss, arrays: TeacherArrays, start: int, stop: int, buf: torch.Tensor | None, gemm: Callable | None = None,
    parts: tuple[slice, ...] = (slice(None),),
) -> torch.Tensor | None:
    """The rows' dense ``[rows, V]`` teacher (a view, or the head's logits in ``buf``), or None.
    ``gemm(x, weight, bias, out)``, a backend's logits GEMM, makes the head's logits if it
    takes the operands (returns True); else cuBLAS does, over the vocabulary's ``parts``
    (``torch_kl.gemm.vocab_parts``; all at once by default)."""
    if loss.teacher is None or loss.teacher.dense_format is None or not loss.soft:
        return None
    rows = arrays.target[start:stop]  # type: ignore[index]
    if loss.teacher.format != "hidden":
        return rows
    out = buf[: stop - start]  # type: ignore[index]
    if gemm is not None and gemm(rows, arrays.weight, arrays.bias, out):
        return out
    return cublas_logits(rows, arrays.weight, arrays.bias, out, parts)  # type: ignore[arg-type]
