"""The float64 reference of docs/contract.md: the unfused computation in float64 with autograd.

Whole ``[N, V]`` logits, no chunks, no online softmax; torch float64 ops, gradients from
``torch.autograd.grad`` with respect to ``x``, ``weight`` and ``bias`` (the teacher is a constant)::

    z = x @ weight.T (+ bias);  z~ = logit_scale * z;  z~ = softcap * tanh(z~ / softcap) if softcap
    log_q = log_softmax(z~ / T)
    teacher: probs p = t, log p = log(max(p, eps)); log_probs p = exp(t), log p = t;
             logits / hidden (u = t @ teacher_weight.T + teacher_bias): the same transform with the
             teacher's scale and softcap, log p = log_softmax(u~ / Tt), Tt defaulting to T
    beta 0: sum p (log p - log q); beta 1: sum q (log q - log p);
    else:   beta sum p log(p / m) + (1 - beta) sum q log(q / m), m = beta p + (1 - beta) q;  0 log 0 = 0
    topk_log_probs (S: the row's entries with p > 0; -inf entries are padding, off S):
      bin   sum_S p (log p - log q) + p_t (log p_t - log q_t), p_t = max(1 - P, 0), q_t = 1 - Q
            (q_t as the sum of q off S; p_t and q_t floored at eps inside the logs)
      renormalize sum_S p^ (log p^ - log q), p^ = p / P;   drop sum_S p (log p - log q)
    hard = cross_entropy(z~, labels, label_smoothing) at temperature 1, per kept row
    zsq  = lse(z~)**2, the z-loss, at temperature 1, per kept row
    row_i = weight_soft_loss * soft_i + weight_hard_loss * hard_i + z_loss_weight * zsq_i   (0 if ignored)
    loss = sum_i w_i (weight_soft_loss * soft_i / (n | 1 | n V) + (weight_hard_loss * hard_i
           + z_loss_weight * zsq_i) / (n | 1 | n))
           for reduction batchmean | sum | mean, n = kept rows, w = row_weight (1 if None);
           n == 0: everything exactly 0. ``return_row_losses`` adds ``row_i`` (unweighted, unnormalised).

Importing this module does not import torch; calling it does. Inputs are NumPy arrays (or
anything ``np.asarray`` takes) or torch tensors of any float dtype and device; the gradients come
back in float64 as the kind of ``x`` (torch: on ``x``'s device).
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
    row_losses: Any | None = None  # shaped like the rows, float64; only when asked for


def _to(a: Any, device: Any, dtype: Any) -> Any:
    import torch

    if isinstance(a, torch.Tensor):
        return a.detach().to(device=device, dtype=dtype)
    return torch.as_tensor(np.asarray(a, np.float64 if dtype is torch.float64 else np.int64), device=device)


def _transform(z: Any, scale: float, cap: float | None) -> Any:
    z = scale * z
    return z if cap is None else cap * (z / cap).tanh()


def _divergence(p: Any, log_p: Any, log_q: Any, beta: float) -> Any:
    """Row sums of the divergence; ``log_p`` already floored where the format says so."""
    import torch

    pos = p != 0  # NaN stays in, to propagate
    log_p_safe = torch.where(pos, log_p, 0.0)
    q = log_q.exp()
    if beta == 0:
        return torch.where(pos, p * (log_p_safe - log_q), 0.0).sum(-1)
    if beta == 1:
        return (q * (log_q - log_p)).sum(-1)
    m = beta * p + (1 - beta) * q
    log_m = torch.where(m > 0, m, 1.0).log()
    forward = torch.where(pos, p * (log_p_safe - log_m), 0.0).sum(-1)
    return beta * forward + (1 - beta) * (q * (log_q - log_m)).sum(-1)


def _topk(t: Any, idx: Any, log_q: Any, tail: str, eps: float) -> Any:
    import torch

    p = torch.zeros_like(log_q).scatter(1, idx, t.exp())
    in_s = p != 0
    log_p = torch.zeros_like(log_q).scatter(1, idx, torch.where(t == -torch.inf, 0.0, t))
    if tail == "renormalize":
        total = p.sum(-1, keepdim=True)
        p, log_p = p / torch.where(total > 0, total, 1.0), log_p - torch.where(total > 0, total, 1.0).log()
    head = torch.where(in_s, p * (log_p - log_q), 0.0).sum(-1)
    if tail != "bin":
        return head
    p_t = (1 - p.sum(-1)).clamp_min(0.0)
    q_t = torch.where(in_s, 0.0, log_q.exp()).sum(-1)
    return head + torch.where(p_t > 0, p_t * (p_t.clamp_min(eps).log() - q_t.clamp_min(eps).log()), 0.0)


def reference(
    x: Any, weight: Any, target: Any = None, labels: Any = None, *, bias: Any = None,
    reduction: str = "batchmean", ignore_index: int = -100, temperature: float = 1.0, eps: float = 1e-10,
    target_format: str = "probs", teacher_temperature: float | None = None, beta: float = 0.0,
    weight_hard_loss: float = 0.0, weight_soft_loss: float = 1.0, label_smoothing: float = 0.0,
    logit_scale: float = 1.0, softcap: float | None = None, teacher_weight: Any = None, teacher_bias: Any = None,
    target_indices: Any = None, topk_tail: str = "bin", teacher_logit_scale: float = 1.0,
    teacher_softcap: float | None = None, row_weight: Any = None, return_row_losses: bool = False,
    z_loss_weight: float = 0.0,
) -> Expected:
    """Loss and gradients of the contract's loss in float64 (see the module docstring for the math);
    with ``return_row_losses``, each row's unweighted, unnormalised loss too."""
    import torch

    if reduction not in ("batchmean", "sum", "mean"):
        raise ValueError(f"reduction: expected 'batchmean', 'sum' or 'mean', got {reduction!r}")
    on_torch = isinstance(x, torch.Tensor)
    dev = x.device if on_torch else torch.device("cpu")
    f64 = torch.float64
    xt = _to(x, dev, f64).requires_grad_(True)
    w = _to(weight, dev, f64).requires_grad_(True)
    b = None if bias is None else _to(bias, dev, f64).requires_grad_(True)
    leaves = [xt, w] + ([] if b is None else [b])
    v = w.shape[0]
    x2 = xt.reshape(-1, xt.shape[-1])
    rows = x2.shape[0]
    lab = None if labels is None else _to(labels, dev, torch.int64).reshape(-1)
    keep = torch.ones(rows, dtype=torch.bool, device=dev) if lab is None else lab != ignore_index
    n = int(keep.sum())
    rw = torch.ones(rows, dtype=f64, device=dev) if row_weight is None else _to(row_weight, dev, f64).reshape(-1)
    if rw.shape != (rows,):
        raise ValueError(f"row_weight: expected {rows} values, one per row, got shape {tuple(rw.shape)}")
    row_losses = torch.zeros(rows, dtype=f64, device=dev)

    def out(a: Any) -> Any:
        return a if on_torch else a.cpu().numpy()

    def per_row() -> Any:
        return out(row_losses.detach().reshape(xt.shape[:-1])) if return_row_losses else None

    if n == 0:
        zeros = [out(torch.zeros_like(a)) for a in (xt, w)]
        return Expected(0.0, *zeros, None if b is None else out(torch.zeros_like(b)), per_row())

    z = x2 @ w.T if b is None else x2 @ w.T + b
    zk = _transform(z, logit_scale, softcap)[keep]  # all rows enter the GEMMs, kept rows the loss
    loss = torch.zeros((), dtype=f64, device=dev)
    wk = rw[keep]
    kept_rows = torch.zeros(n, dtype=f64, device=dev)  # each kept row's unweighted, unnormalised loss
    if target is not None:
        log_q = torch.log_softmax(zk / temperature, dim=-1)
        t = _to(target, dev, f64)
        t = t.reshape(-1, t.shape[-1])[keep]
        if target_format == "topk_log_probs":
            if beta != 0:
                raise ValueError(f"beta: top-k targets support beta = 0 only, got {beta}")
            idx = _to(target_indices, dev, torch.int64).reshape(-1, t.shape[-1])[keep]
            rowsum = _topk(t, idx, log_q, topk_tail, eps)
        else:
            if target_format == "probs":
                p, log_p = t, t.clamp_min(eps).log()
            elif target_format == "log_probs":
                p, log_p = t.exp(), t
            elif target_format in ("logits", "hidden"):
                if target_format == "hidden":
                    t = t @ _to(teacher_weight, dev, f64).T
                    t = t if teacher_bias is None else t + _to(teacher_bias, dev, f64)
                tt = temperature if teacher_temperature is None else teacher_temperature
                log_p = torch.log_softmax(_transform(t, teacher_logit_scale, teacher_softcap) / tt, dim=-1)
                p = log_p.exp()
            else:
                raise ValueError(f"target_format: unknown {target_format!r}")
            rowsum = _divergence(p, log_p, log_q, beta)
        soft = (wk * rowsum).sum() / {"batchmean": n, "sum": 1, "mean": n * v}[reduction]
        loss = loss + weight_soft_loss * soft
        kept_rows = kept_rows + weight_soft_loss * rowsum
    elif weight_soft_loss != 0:
        raise ValueError("target: required when weight_soft_loss != 0")
    hard_rows = torch.zeros(n, dtype=f64, device=dev)
    if weight_hard_loss != 0:
        if lab is None:
            raise ValueError("labels: required when weight_hard_loss > 0")
        y = lab[keep]
        if bool(((y < 0) | (y >= v)).any()):
            raise ValueError(f"labels: kept labels must lie in [0, {v})")
        log_q1 = torch.log_softmax(zk, dim=-1)
        nll = -log_q1.gather(1, y[:, None]).squeeze(1)
        rowce = (1 - label_smoothing) * nll - label_smoothing / v * log_q1.sum(-1)
        hard_rows = hard_rows + weight_hard_loss * rowce
    if z_loss_weight != 0:
        hard_rows = hard_rows + z_loss_weight * torch.logsumexp(zk, dim=-1) ** 2
    loss = loss + (wk * hard_rows).sum() / (1 if reduction == "sum" else n)
    row_losses[keep] = (kept_rows + hard_rows).detach()
    if loss.requires_grad:
        grads = torch.autograd.grad(loss, leaves)
    else:
        grads = tuple(torch.zeros_like(a) for a in leaves)
    grad_b = None if b is None else out(grads[2])
    return Expected(float(loss.detach()), out(grads[0]), out(grads[1]), grad_b, per_row())


def reference_cross_entropy(
    x: Any, weight: Any, labels: Any, *, bias: Any = None, reduction: str = "mean", ignore_index: int = -100,
    label_smoothing: float = 0.0, logit_scale: float = 1.0, softcap: float | None = None, row_weight: Any = None,
    return_row_losses: bool = False, z_loss_weight: float = 0.0,
) -> Expected:
    """``torch.nn.functional.cross_entropy`` on the transformed logits z~ ("mean": over kept rows; n == 0: 0),
    plus the z-loss; row weights and per-row losses as :func:`reference`'s."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction: expected 'mean' or 'sum', got {reduction!r}")
    return reference(
        x, weight, None, labels, bias=bias, reduction=reduction, ignore_index=ignore_index,
        weight_hard_loss=1.0, weight_soft_loss=0.0, label_smoothing=label_smoothing,
        logit_scale=logit_scale, softcap=softcap, row_weight=row_weight, return_row_losses=return_row_losses,
        z_loss_weight=z_loss_weight,
    )
