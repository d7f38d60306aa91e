"""The row phases in plain PyTorch: the ``"torch"`` backend, for CPUs and any device.

Same inputs, outputs and math as ``triton_phases`` (the math is ``fused_kl.terms``'s, shared
with JAX), written with whole-row tensor ops instead of an online pass; it holds a few
float32 copies of the chunk, which the chunk size bounds.
"""

from __future__ import annotations

import torch

from fused_kl import terms
from fused_kl.loss import Loss


def _lse(a: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(a, dim=-1) if a.shape[-1] else a.sum(-1) + float("-inf")


def _student(z: torch.Tensor, loss: Loss) -> torch.Tensor:
    return terms.transform(z.float(), loss.logit_scale, loss.softcap, torch)


def _teacher(t: torch.Tensor, loss: Loss, lse_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return terms.teacher_probs(t.float(), loss.teacher, lse_t[:, None], torch)  # type: ignore[arg-type]


def _is_label(y: torch.Tensor | None, v: int, like: torch.Tensor) -> torch.Tensor | bool:
    return False if y is None else torch.arange(v, device=like.device)[None, :] == y[:, None]


def stats(z: torch.Tensor, t: torch.Tensor | None, y: torch.Tensor | None, loss: Loss, tile: tuple[int, int]):
    """``fused_kl.rowmath.STATS`` of each row of the chunk (local to this vocabulary slice)."""
    del tile  # whole rows at once
    f = _student(z, loss)
    zero = f.new_zeros(f.shape[0])
    lse = _lse(f / loss.temperature)
    lse_h = _lse(f) if loss.separate_hard_lse else lse
    lse_t = mass = logit_sum = label_logit = rho = zero
    if t is not None:
        if loss.teacher.has_logits or loss.kind == "reverse":  # type: ignore[union-attr]
            b = terms.teacher_log(t.float(), loss.teacher, torch)  # type: ignore[arg-type]
        if loss.teacher.has_logits:  # type: ignore[union-attr]
            lse_t = _lse(b)
        elif loss.kind == "forward":
            mass = _teacher(t, loss, zero)[0].sum(-1)
        if loss.kind == "reverse":
            log_q = f / loss.temperature - lse[:, None]
            rho = terms.reverse_term(torch.exp(log_q), log_q, b).sum(-1)
    if y is not None:
        logit_sum = f.sum(-1)
        inside = (y >= 0) & (y < f.shape[1])
        label_logit = torch.where(inside, f.gather(1, y.clamp(0, f.shape[1] - 1)[:, None])[:, 0], 0.0)
    return torch.stack([lse, lse_h, lse_t, mass, logit_sum, label_logit, rho], -1)


def value(z: torch.Tensor, t: torch.Tensor, stats: torch.Tensor, loss: Loss, tile: tuple[int, int]) -> torch.Tensor:
    """Phase 2 (JSD): each row's sums of ``fused_kl.terms.jsd_terms``."""
    del tile
    log_q = _student(z, loss) / loss.temperature - stats[:, :1]
    p, log_p = _teacher(t, loss, stats[:, 2])
    a, b = terms.jsd_terms(torch.exp(log_q), log_q, p, log_p, loss.beta, torch)
    return torch.stack([a.sum(-1), b.sum(-1)], -1)


def finish(
    z: torch.Tensor,
    t: torch.Tensor | None,
    y: torch.Tensor | None,
    coefs: torch.Tensor,
    loss: Loss,
    v_total: int,
    tile: tuple[int, int],
    write_grad: bool,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Phase 3: ``dL/dz`` written over ``z`` (if ``write_grad``); returns ``(z or None, the rows'
    forward-KL sums)``."""
    del tile
    f = _student(z, loss)
    log_q = f / loss.temperature - coefs[:, :1]
    q = torch.exp(log_q)
    partial = f.new_zeros(f.shape[0])
    p = log_p = q
    if t is not None:
        p, log_p = _teacher(t, loss, coefs[:, 2])
        if loss.kind == "forward":
            partial = terms.forward_term(p, log_p, log_q, torch).sum(-1)
    if write_grad:
        g = coefs[:, 4:5] * terms.soft_direction(loss.kind, q, log_q, p, log_p, coefs[:, 3:4], loss.beta, torch)
        if loss.hard:
            g = g + coefs[:, 5:6] * terms.hard_direction(
                f, coefs[:, 1:2], _is_label(y, f.shape[1], f), loss, v_total, torch
            )
        live = (coefs[:, 4:5] != 0) | (coefs[:, 5:6] != 0)  # ignored rows: exactly 0, never NaN
        z.copy_(torch.where(live, g * terms.slope(z.float(), loss.logit_scale, loss.softcap, torch), 0.0))
    return (z if write_grad else None), partial
