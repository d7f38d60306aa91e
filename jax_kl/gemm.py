"""The GEMMs of the chunk driver, at the precision docs/contract.md asks for."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def dot(a: jax.Array, b: jax.Array, contract: tuple[int, int], out_dtype) -> jax.Array:
    """``a`` times ``b`` over the given axes; float32 operands in full float32 (no TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out_dtype)
