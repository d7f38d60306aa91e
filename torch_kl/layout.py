"""Where the rows and the vocabulary live: the collective points of the chunk driver.

``SINGLE`` runs no collective. With ``batch_group`` each rank holds some rows: the kept-row
count is summed over the group. With ``vocab_group`` each rank holds a contiguous ``V / G``
slice of the head: the row statistics (log-sum-exps by max and sum, sums by sum), phase 2's
sums and the forward KL's row sums are all-reduced, and so is ``grad_x`` at the end.

:meth:`Layout.agree` is the cross-rank check of a call: one tiny ``all_gather`` per group,
after the local validation and before the driver's first collective, so that ranks called
with different shapes or options (or one whose arguments were rejected) raise instead of
hanging in mismatched collectives or computing garbage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fused_kl import rowmath

# What ``agree`` gathers, and the argument each entry belongs to (for the error messages).
FACTS = ("failed", "N", "H", "V", "teacher size", "call")
_ARGUMENT = {"N": "x", "H": "x", "V": "weight", "teacher size": "target"}


def check_group_type(name: str, group: object) -> None:
    """``group`` is None or a ``torch.distributed`` process group: what can be checked before
    ``init_process_group`` (a module's constructor)."""
    dist = _dist()
    if group is not None and dist.is_available() and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name}: expected a torch.distributed ProcessGroup, got {type(group).__name__}")


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
        return rowmath.combine_stats(stats, lambda a: _all_reduce(a, "max", self.vocab_group), self.vocab_sum, torch)

    @property
    def distributed(self) -> bool:
        return self.batch_group is not None or self.vocab_group is not None

    def check_groups(self) -> None:
        """The groups are process groups of an initialised ``torch.distributed`` (local check)."""
        for name, group in (("batch_group", self.batch_group), ("vocab_group", self.vocab_group)):
            if group is None:
                continue
            dist = _dist()
            if not dist.is_available() or not dist.is_initialized():
                raise ValueError(f"{name}: torch.distributed is not initialised (call init_process_group first)")
            check_group_type(name, group)
        if self.batch_group is not None and self.batch_group is self.vocab_group:
            raise ValueError("batch_group, vocab_group: expected two different groups, got the same one for both")

    def agree(self, facts: tuple[int, ...] | None, device: torch.device) -> None:
        """Check that every rank of each group made a compatible call.

        ``facts`` is ``(N, H, V_local, teacher size, digest of the call)``, or None where this
        rank's own validation failed (it re-raises its error after this returns). Rows may
        differ across ``batch_group``; everything must match across ``vocab_group``. The
        values of the replicated arrays (``x``, ``labels``, top-k teachers across
        ``vocab_group``) are not compared: that would cost a pass over them.
        """
        mine = [1, 0, 0, 0, 0, 0] if facts is None else [0, *facts]
        named = (("batch_group", self.batch_group), ("vocab_group", self.vocab_group))
        groups = [(name, group) for name, group in named if group is not None]
        tables = [_gather(group, mine, device) for _, group in groups]  # every gather before any raise
        errors = [
            _judge(name, t, rows_may_differ=name == "batch_group") for (name, _), t in zip(groups, tables, strict=True)
        ]
        error = next((e for e in errors if e is not None), None)
        if len(groups) == 2:
            # A second round over both groups: on a grid, a rank that shares no group with a failing
            # rank hears of it from one that does, instead of going on into the driver's collectives.
            seen = [int(facts is None or error is not None)]
            heard = [_gather(group, seen, device) for _, group in groups]  # on every rank, whatever it saw
            if error is None and any(row[0] for table in heard for row in table):
                error = ValueError(
                    "batch_group, vocab_group: a rank of the grid rejected its call (its error "
                    "says why); every rank must make the same call"
                )
        if error is not None and facts is not None:
            raise error  # (where this rank's own validation failed, the caller raises that error)


def _gather(group: Any, mine: list[int], device: torch.device) -> list[list[int]]:
    import torch.distributed._functional_collectives as funcol

    if _dist().get_backend(group) == "gloo":
        device = torch.device("cpu")
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # torch 2.11 has only the second
    gathered = gather(torch.tensor(mine, dtype=torch.int64, device=device), 0, group)
    return gathered.reshape(-1, len(mine)).tolist()


def _judge(name: str, table: list[list[int]], rows_may_differ: bool) -> ValueError | None:
    """The error a group's gathered facts call for, or None."""
    failed = [r for r, row in enumerate(table) if row[0]]
    if failed:
        return ValueError(
            f"{name}: rank(s) {failed} of the group rejected their arguments (their error says why); "
            "every rank must make the same call"
        )
    for i, fact in enumerate(FACTS[1:], 1):
        values = [row[i] for row in table]
        if len(set(values)) == 1 or (fact == "N" and rows_may_differ):
            continue
        if fact == "call":
            return ValueError(
                f"{name}: the ranks' calls differ in their options, dtypes or optional arguments "
                "(reduction, temperature, chunk_size, bias, labels, ...); every rank must make the "
                "same call"
            )
        if fact == "V" and name == "vocab_group":
            return ValueError(
                f"weight: the vocab_group's ranks hold {values} rows of the head: V must be divisible "
                f"by the group size {len(values)}, each rank holding a contiguous V / G slice"
            )
        return ValueError(f"{_ARGUMENT[fact]}: the {name}'s ranks disagree on {fact}: {values} (rank by rank)")
    return None


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _all_reduce(a: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    if group is None:
        return a
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(a, op, group)


SINGLE = Layout()
