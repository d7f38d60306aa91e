"""How torch spells the array operations the framework-free core asks for: the chunk's indexed
operations (``fused_kl.chunk.ChunkOps``, in place) and the plain backend's whole-row phases'
(``fused_kl.wholerow.RowOps``). ``jax_kl/ops.py`` is the mirror."""

from __future__ import annotations

import torch

from fused_kl.chunk import ChunkOps
from fused_kl.wholerow import RowOps

OPS = ChunkOps(
    xp=torch,
    gather=lambda z, at: z.gather(1, at).float(),
    # An add of the difference, not a write: the masked-out entries all point at column 0.
    set_at=lambda g, at, values, mask: g.scatter_add_(
        1, at, torch.where(mask, values - g.gather(1, at).float(), 0.0).to(g.dtype)
    ),
    f32=lambda a: a.float(),
    materialize=lambda z, values: (z, values),  # eager: already made
    sort=lambda a: a.sort(-1).values,
)


def _lse(a: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(a, dim=-1) if a.shape[-1] else a.sum(-1) + float("-inf")


ROW_OPS = RowOps(
    chunk=OPS,
    lse=_lse,
    teacher_rows=lambda t, shape: t.float(),  # the chunk's block already
    columns=lambda a: torch.arange(a.shape[1], device=a.device),
    write=lambda z, g: z.copy_(g),  # over the logits, as the Triton kernels write it
)
