"""The float64 reference of SPEC.md, in NumPy: one reference for both frameworks' tests.

Written independently of the kernels: whole rows, no chunks, no online softmax, and the
gradients from the closed form of SPEC.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Expected:
    loss: float
    grad_x: np.ndarray
    grad_weight: np.ndarray
    grad_bias: np.ndarray | None


def _log_softmax(a: np.ndarray) -> np.ndarray:
    m = a.max(axis=-1, keepdims=True)
    return a - m - np.log(np.exp(a - m).sum(axis=-1, keepdims=True))


def reference(
    x,
    weight,
    target,
    labels=None,
    *,
    bias=None,
    reduction="batchmean",
    ignore_index=-100,
    temperature=1.0,
    eps=1e-10,
    target_format="probs",
    teacher_temperature=None,
) -> Expected:
    """Loss and gradients in float64 of NumPy arrays (any float dtype, upcast here)."""
    x = np.asarray(x, np.float64)
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    w = np.asarray(weight, np.float64)
    v = w.shape[0]
    t = np.asarray(target, np.float64).reshape(-1, v)
    n = x2.shape[0]
    keep = np.ones(n, bool) if labels is None else (np.asarray(labels).reshape(-1) != ignore_index)
    tt = temperature if teacher_temperature is None else teacher_temperature

    z = x2 @ w.T
    if bias is not None:
        z = z + np.asarray(bias, np.float64)
    log_q = _log_softmax(z / temperature)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if target_format == "probs":
            p, log_p = t, np.log(np.maximum(t, eps))
        elif target_format == "log_probs":
            p, log_p = np.exp(t), t
        else:
            log_p = _log_softmax(t / tt)
            p = np.exp(log_p)
        terms = np.where(p == 0, 0.0, p * (log_p - log_q))
    row_loss = np.where(keep, terms.sum(-1), 0.0)
    kept = int(keep.sum())
    scale = {"batchmean": 1 / max(kept, 1), "sum": 1.0, "mean": 1 / max(kept * v, 1)}[reduction]
    scale = scale if kept else 0.0
    s_row = p.sum(-1, keepdims=True)
    g = np.where(keep[:, None], scale * (np.exp(log_q) * s_row - p) / temperature, 0.0)
    return Expected(
        loss=float(row_loss.sum() * scale),
        grad_x=(g @ w).reshape(x.shape),
        grad_weight=g.T @ x2,
        grad_bias=None if bias is None else g.sum(0),
    )
