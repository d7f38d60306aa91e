"""Where the rows and the vocabulary live: the collective points of the chunk driver (mirror
of ``torch_kl/layout.py``), as named-axis collectives inside ``shard_map``.

``SINGLE`` runs no collective. With ``batch_axis`` each device holds some rows: the kept-row
count is summed over that axis. With ``vocab_axis`` each holds a contiguous ``V / G`` slice
of the head: row statistics, phase 2's sums and the forward KL's row sums are all-reduced, and
so is ``grad_x`` at the end unless ``sum_grad_x`` is False (inside the caller's ``shard_map``,
whose transpose may do that sum itself: ``jax_kl.sharding``).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from fused_kl import rowmath


@dataclass(frozen=True)
class Layout:
    batch_axis: str | tuple[str, ...] | None = None
    vocab_axis: str | tuple[str, ...] | None = None
    sum_grad_x: bool = True

    @property
    def vocab_shards(self) -> int:
        return 1 if self.vocab_axis is None else lax.psum(1, self.vocab_axis)

    def vocab_start(self, v_local: int) -> jax.Array | int:
        return 0 if self.vocab_axis is None else lax.axis_index(self.vocab_axis) * v_local

    def batch_sum(self, a: jax.Array) -> jax.Array:
        return a if self.batch_axis is None else lax.psum(a, self.batch_axis)

    def vocab_sum(self, a: jax.Array) -> jax.Array:
        return a if self.vocab_axis is None else lax.psum(a, self.vocab_axis)

    def combine_stats(self, stats: jax.Array) -> jax.Array:
        """The whole row's ``STATS`` from each vocabulary slice's."""
        if self.vocab_axis is None:
            return stats
        return rowmath.combine_stats(stats, self._shift, self.vocab_sum, jnp)

    def _shift(self, a: jax.Array) -> jax.Array:
        # The max only shifts the exponentials (the combined statistics do not depend on it), and
        # pmax has no derivative rule: without its gradient, second derivatives differentiate too.
        return lax.pmax(lax.stop_gradient(a), self.vocab_axis)


SINGLE = Layout()
