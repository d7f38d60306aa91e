"""How JAX spells the array operations the framework-free core asks for: the chunk's indexed
operations (``fused_kl.chunk.ChunkOps``, functional) and the plain backend's whole-row phases'
(``fused_kl.wholerow.RowOps``). ``torch_kl/ops.py`` is the mirror."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fused_kl.chunk import ChunkOps
from fused_kl.wholerow import RowOps


def _set_at(g: jax.Array, at: jax.Array, values: jax.Array, mask: jax.Array) -> jax.Array:
    # The masked-out entries go out of range and are dropped, so each kept entry is written once,
    # rounded once (torch adds the difference: its masked-out entries share column 0).
    at = jnp.where(mask, at, g.shape[1])
    return g.at[jnp.arange(g.shape[0])[:, None], at].set(values.astype(g.dtype), mode="drop")


OPS = ChunkOps(
    xp=jnp,
    gather=lambda z, at: jnp.take_along_axis(z, at, axis=1).astype(jnp.float32),
    set_at=_set_at,
    f32=lambda a: a.astype(jnp.float32),
    materialize=lambda z, values: lax.optimization_barrier((z, values)),
    sort=lambda a: jnp.sort(a, axis=-1),
)

ROW_OPS = RowOps(
    chunk=OPS,
    lse=lambda a: jax.nn.logsumexp(a, axis=-1),
    teacher_rows=lambda t, shape: lax.dynamic_slice(t[0], (t[1], 0), shape).astype(jnp.float32),
    columns=lambda a: jnp.arange(a.shape[1]),
    write=lambda z, g: g.astype(z.dtype),  # a new array
)
