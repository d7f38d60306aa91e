"""``torch_kl.FusedLinearKLDivLoss``: the ``nn.Module`` form, a drop-in for Liger's."""

from __future__ import annotations

import torch

from .api import fused_linear_kl_div


class FusedLinearKLDivLoss(torch.nn.Module):
    """Fused LM head + ``KL(teacher || student)`` loss.

    Takes the keyword arguments of :func:`torch_kl.fused_linear_kl_div` (``reduction``,
    ``ignore_index``, ``temperature``, ``eps``, ``target_format``, ``teacher_temperature``,
    ``accum_dtype``, ``chunk_size``, ``backend``). ``forward(x, weight, target, labels=None,
    bias=None)`` has the positional order of Liger's ``LigerFusedLinearKLDivLoss``.
    """

    def __init__(self, **options: object) -> None:
        super().__init__()
        self.options = options

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        labels: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return fused_linear_kl_div(x, weight, target, labels, bias=bias, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
