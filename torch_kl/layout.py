"""Where the rows and the vocabulary live: the collective points of the chunk driver.

``SINGLE`` runs no collective. With ``batch_group`` each rank holds some rows: the kept-row
count is summed over the group. With ``vocab_group`` each rank holds a contiguous ``V / G``
slice of the head: the row statistics (log-sum-exps by max and sum, sums by sum), phase 2's
sums and the forward KL's row sums are all-reduced, and so is ``grad_x`` at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fused_kl import rowmath


@dataclass(frozen=True)
class Layout:
    batch_group: Any = None
    vocab_group: Any = None

    @property
    def vocab_shards(self) -> int:
        return 1 if self.vocab_group is None else _dist().get_world_size(self.vocab_group)

    def vocab_start(self, v_local: int) -> int:
        return 0 if self.vocab_group is None else _dist().get_rank(self.vocab_group) * v_local

    def batch_sum(self, a: torch.Tensor) -> torch.Tensor:
        return _all_reduce(a, "sum", self.batch_group)

    def vocab_sum(self, a: torch.Tensor) -> torch.Tensor:
        return _all_reduce(a, "sum", self.vocab_group)

    def combine_stats(self, stats: torch.Tensor) -> torch.Tensor:
        """The whole row's ``STATS`` from each vocabulary slice's."""
        if self.vocab_group is None:
            return stats
        n = rowmath.N_LSE
        lse = rowmath.combine_lse(stats[:, :n], lambda a: _all_reduce(a, "max", self.vocab_group),
                                  self.vocab_sum, torch)
        return torch.cat([lse, self.vocab_sum(stats[:, n:])], -1)


SINGLE = Layout()


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _all_reduce(a: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    if group is None:
        return a
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(a, op, group)
