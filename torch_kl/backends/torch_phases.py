"""The row phases in plain PyTorch: the ``"torch"`` backend, for CPUs and any device.

``fused_kl.wholerow`` (shared with JAX's ``"xla"`` backend) in torch's spelling: the same inputs,
outputs and math as ``triton_phases``, with whole-row tensor ops instead of an online pass
(``torch_kl.ops.ROW_OPS``: ``dL/dz`` is written over the logits, as the Triton kernels write it).
"""

from __future__ import annotations

import torch

from fused_kl import wholerow
from fused_kl.loss import Loss

from ..ops import ROW_OPS


def stats(
    z: torch.Tensor, t: torch.Tensor | None, y: torch.Tensor | None, loss: Loss, tile: tuple[int, int]
) -> torch.Tensor:
    """``fused_kl.rows.Stats`` of each row of the chunk (local to this vocabulary slice)."""
    del tile  # whole rows at once
    return wholerow.stats(z, t, y, loss, ROW_OPS)


def mixture_sums(
    z: torch.Tensor, t: torch.Tensor, stats: torch.Tensor, loss: Loss, tile: tuple[int, int]
) -> torch.Tensor:
    """Phase 2 (JSD): each row's ``fused_kl.rows.MixtureSums``, of ``fused_kl.terms.jsd_terms``."""
    del tile
    return wholerow.mixture_sums(z, t, stats, loss, ROW_OPS)


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
    return wholerow.finish(z, t, y, coefs, loss, v_total, write_grad, ROW_OPS)
