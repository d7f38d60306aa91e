"""The unfused losses the benchmark's anchors run: whole ``[N, V]`` logits, fp32 softmax,
written as a user would in plain torch (and in jnp, for XLA, where written).

Each takes ``(x, weight, arrays)``, ``arrays`` the mode's keyword arrays (``benchmarks.modes``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

EPS = 1e-10  # the API's default floor of teacher probabilities inside the log

LossFn = Callable[[Any, Any, dict[str, Any]], Any]


def _log_q(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax((x @ weight.T).float(), dim=-1)


def kl(x: torch.Tensor, weight: torch.Tensor, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
    """``KLDivLoss(reduction="batchmean")`` of the log-softmax against teacher probabilities."""
    return F.kl_div(_log_q(x, weight), arrays["target"], reduction="batchmean")


def reverse(x: torch.Tensor, weight: torch.Tensor, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
    """``sum q (log q - log p) / N``."""
    log_q = _log_q(x, weight)
    log_p = arrays["target"].float().clamp_min(EPS).log()
    return (log_q.exp() * (log_q - log_p)).sum() / x.shape[0]


def jsd(x: torch.Tensor, weight: torch.Tensor, arrays: dict[str, torch.Tensor], beta: float = 0.5) -> torch.Tensor:
    """``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p + (1 - beta) q``, per row, over N."""
    log_q = _log_q(x, weight)
    p = arrays["target"].float()
    log_m = (beta * p + (1 - beta) * log_q.exp()).log()
    kl_pm = F.kl_div(log_m, p, reduction="sum")
    kl_qm = F.kl_div(log_m, log_q, reduction="sum", log_target=True)
    return (beta * kl_pm + (1 - beta) * kl_qm) / x.shape[0]


def _teacher_head(arrays: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.log_softmax((arrays["target"] @ arrays["teacher_weight"].T).float(), dim=-1)


def hidden(x: torch.Tensor, weight: torch.Tensor, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward KL against the teacher head's log-softmax (its logits are one more GEMM)."""
    return F.kl_div(_log_q(x, weight), _teacher_head(arrays), reduction="batchmean", log_target=True)


def reverse_hidden(x: torch.Tensor, weight: torch.Tensor, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
    """Reverse KL against the teacher head: ``KL(q || p)`` with ``log_target``, over N."""
    return F.kl_div(_teacher_head(arrays), _log_q(x, weight), reduction="batchmean", log_target=True)


def topk(x: torch.Tensor, weight: torch.Tensor, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward KL on the top-k tokens plus the tail bin ``p_t log(p_t / q_t)``."""
    log_p = arrays["target"].float()
    log_q = _log_q(x, weight).gather(1, arrays["target_indices"])
    p = log_p.exp()
    p_tail = (1 - p.sum(-1)).clamp_min(0)
    q_tail = (1 - log_q.exp().sum(-1)).clamp_min(EPS)
    tail = torch.where(p_tail > 0, p_tail * (p_tail.clamp_min(EPS).log() - q_tail.log()), 0.0)
    return ((p * (log_p - log_q)).sum(-1) + tail).sum() / x.shape[0]


def ce(x: torch.Tensor, weight: torch.Tensor, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
    """``F.cross_entropy`` of the fp32 logits."""
    return F.cross_entropy((x @ weight.T).float(), arrays["labels"])


def ce_smooth(x: torch.Tensor, weight: torch.Tensor, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
    """:func:`ce` with label smoothing 0.1 (the bench's ``ce-smooth`` mode)."""
    return F.cross_entropy((x @ weight.T).float(), arrays["labels"], label_smoothing=0.1)


TORCH: dict[str, LossFn] = {
    "kl": kl,
    "reverse": reverse,
    "jsd": jsd,
    "hidden": hidden,
    "reverse-hidden": reverse_hidden,
    "topk": topk,
    "ce": ce,
    "ce-smooth": ce_smooth,
}


def kl_jax(x: Any, weight: Any, arrays: dict[str, Any]) -> Any:
    """:func:`kl` in jnp, for XLA to fuse as it can."""
    import jax
    import jax.numpy as jnp

    log_q = jax.nn.log_softmax((x @ weight.T).astype(jnp.float32), axis=-1)
    p = arrays["target"].astype(jnp.float32)
    return jnp.sum(jax.scipy.special.xlogy(p, p) - p * log_q) / x.shape[0]


def ce_jax(x: Any, weight: Any, arrays: dict[str, Any]) -> Any:
    """:func:`ce` in jnp."""
    import jax
    import jax.numpy as jnp

    log_q = jax.nn.log_softmax((x @ weight.T).astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_q, arrays["labels"][:, None], axis=-1))


JAX: dict[str, LossFn] = {"kl": kl_jax, "ce": ce_jax}
