"""The float64 reference of SPEC.md: one reference for both frameworks' tests.

Written independently of the kernels: whole rows, no chunks, no online softmax, and the
gradients from the closed form of SPEC.md. It runs on NumPy arrays, or on torch tensors
(so the GPU tests can run it in float64 on the device at the llama-3 head's size); the
result has the inputs' kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Expected:
    loss: float
    grad_x: Any
    grad_weight: Any
    grad_bias: Any | None


def _namespace(a: Any) -> tuple[Any, Any]:
    """The array module of ``a`` and a float64 converter for it."""
    if type(a).__module__.startswith("torch"):
        import torch

        return torch, lambda b: torch.as_tensor(b, device=a.device).double()
    return np, lambda b: np.asarray(b, np.float64)


def _log_softmax(xp: Any, a: Any) -> Any:
    m = xp.amax(a, axis=-1, keepdims=True)
    return a - m - xp.log(xp.sum(xp.exp(a - m), axis=-1, keepdims=True))


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
    """Loss and gradients in float64 (inputs of any float dtype are upcast here)."""
    xp, f64 = _namespace(x)
    x = f64(x)
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    w = f64(weight)
    v = w.shape[0]
    t = f64(target).reshape(-1, v)
    keep = xp.ones_like(x2[:, 0]) > 0 if labels is None else xp.asarray(labels).reshape(-1) != ignore_index
    keep = keep if xp is np else keep.to(x.device)
    tt = temperature if teacher_temperature is None else teacher_temperature

    z = x2 @ w.T
    if bias is not None:
        z = z + f64(bias)
    log_q = _log_softmax(xp, z / temperature)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if target_format == "probs":
            p, log_p = t, xp.log(xp.maximum(t, f64(eps)))
        elif target_format == "log_probs":
            p, log_p = xp.exp(t), t
        else:
            log_p = _log_softmax(xp, t / tt)
            p = xp.exp(log_p)
        terms = xp.where(p == 0, 0.0, p * (log_p - log_q))
    row_loss = xp.where(keep, xp.sum(terms, axis=-1), 0.0)
    kept = int(keep.sum())
    scale = {"batchmean": 1 / max(kept, 1), "sum": 1.0, "mean": 1 / max(kept * v, 1)}[reduction]
    scale = scale if kept else 0.0
    s_row = xp.sum(p, axis=-1, keepdims=True)
    g = xp.where(keep[:, None], scale * (xp.exp(log_q) * s_row - p) / temperature, 0.0)
    return Expected(
        loss=float(xp.sum(row_loss) * scale),
        grad_x=(g @ w).reshape(x.shape),
        grad_weight=g.T @ x2,
        grad_bias=None if bias is None else xp.sum(g, axis=0),
    )
