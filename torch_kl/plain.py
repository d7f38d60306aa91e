"""The row kernel in plain PyTorch: the ``"torch"`` backend, for CPUs and any device.

Same inputs, outputs and math as ``kernel.kl_rows`` (see its module docstring), written
with whole-row tensor ops instead of an online pass; it holds a few float32 copies of the
chunk, which the chunk size bounds.
"""

from __future__ import annotations

import torch

from fused_kl.contract import Options


def kl_rows(
    z: torch.Tensor,
    target: torch.Tensor,
    labels: torch.Tensor | None,
    scale: torch.Tensor,
    row_loss: torch.Tensor,
    row0: int,
    opts: Options,
    tile: tuple[int, int],
    write_grad: bool,
) -> None:
    """Write the chunk's row losses into ``row_loss`` and, if asked, ``dL/dz`` over ``z``."""
    del tile  # whole rows at once
    rows = slice(row0, row0 + z.shape[0])
    log_q = torch.log_softmax(z.float() / opts.temperature, dim=-1)
    t = target[rows].float()
    if opts.target_format == "probs":
        p, log_p = t, torch.log(t.clamp_min(opts.eps))
    elif opts.target_format == "log_probs":
        p, log_p = torch.exp(t), t
    else:
        log_p = torch.log_softmax(t / opts.teacher_temperature, dim=-1)
        p = torch.exp(log_p)
    term = torch.where(p == 0, 0.0, p * (log_p - log_q))
    keep = (
        (labels[rows] != opts.ignore_index) if labels is not None else torch.ones_like(row_loss[rows], dtype=torch.bool)
    )
    row_loss[rows] = torch.where(keep, term.sum(-1) * scale[0], 0.0)
    if write_grad:
        p_sum = 1.0 if opts.target_format == "logits" else p.sum(-1, keepdim=True)
        g = (torch.exp(log_q) * p_sum - p) * (scale[1] / opts.temperature)
        z.copy_(torch.where(keep[:, None], g, 0.0))
