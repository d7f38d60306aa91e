"""``torch_kl.FusedLinearKLDivLoss``: the ``nn.Module`` form, a drop-in for Liger's."""

from __future__ import annotations

import torch

from .api import fused_linear_kl_div


class FusedLinearKLDivLoss(torch.nn.Module):
    """Fused LM head + ``KL(teacher || student)`` loss; see :func:`torch_kl.fused_linear_kl_div`.

    The constructor's first five parameters and ``forward(x, weight, target, labels=None,
    bias=None)`` have the positional order of Liger's ``LigerFusedLinearKLDivLoss``, so it is
    a drop-in replacement; the rest are keyword-only.
    """

    def __init__(
        self,
        reduction: str = "batchmean",
        ignore_index: int = -100,
        temperature: float = 1.0,
        eps: float = 1e-10,
        accum_dtype: torch.dtype | None = None,
        *,
        target_format: str = "probs",
        teacher_temperature: float | None = None,
        chunk_size: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.options = dict(
            reduction=reduction,
            ignore_index=ignore_index,
            temperature=temperature,
            eps=eps,
            accum_dtype=accum_dtype,
            target_format=target_format,
            teacher_temperature=teacher_temperature,
            chunk_size=chunk_size,
            backend=backend,
        )

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        labels: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss of ``x @ weight.T (+ bias)`` against ``target``; rows labelled ``ignore_index`` skipped."""
        return fused_linear_kl_div(x, weight, target, labels, bias=bias, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
