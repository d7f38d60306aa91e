"""Where ``jax_kl``'s ``grad_weight`` accumulation goes (Hopper with Mosaic GPU only; what it
measured backs the in-place kernel's rows in docs/design-notes.md): one chunk's ``acc + gᵀ x`` on
the llama-3 head, by ``jax_kl.backends.mosaic_accumulate`` and by XLA, with a bf16 and a float32
accumulator, in ms and TFLOP/s, with the kernel's largest error against float32 on a slice.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m benchmarks.diagnose_jax   # from the repository root
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks.measure import Timing, time_ms
from fused_kl.plan import plan_chunks
from jax_kl.backends import mosaic_accumulate

V, H = 128256, 4096
ROWS = plan_chunks(8192, V, 2, None).chunk_rows  # the default chunk's rows on this head
REPS = 15


def median_ms(step: Callable, acc: jax.Array, g: jax.Array, x: jax.Array) -> float:
    """The median time of ``acc = step(acc, g, x)``, the accumulator donated as the driver's is
    consumed (no copy of it is timed); the first call, which compiles, is not timed."""
    accs = [step(acc, g, x).block_until_ready()]

    def once() -> jax.Array:
        accs[0] = step(accs[0], g, x)
        return accs[0]

    return time_ms("jax", once, Timing(reps=REPS, rep_ms=0.0, warmup_ms=0.0), on_gpu=True)


def xla_add(acc: jax.Array, g: jax.Array, x: jax.Array) -> jax.Array:
    return acc + jnp.dot(g.T, x, preferred_element_type=jnp.float32).astype(acc.dtype)


def kernel_error(acc_dtype: jnp.dtype, g: jax.Array, x: jax.Array, rows: int = 512) -> float:
    """The kernel's largest relative error against float32 arithmetic on ``rows`` rows of the chunk."""
    acc = jax.random.normal(jax.random.key(3), (V, H)).astype(acc_dtype)
    got = jax.jit(mosaic_accumulate.accumulate)(acc, g[:rows], x[:rows]).astype(jnp.float32)
    exact = acc.astype(jnp.float32) + jnp.dot(
        g[:rows].astype(jnp.float32).T, x[:rows].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    return float(jnp.max(jnp.abs(got - exact) / (jnp.abs(exact) + 1e-3)))


def main() -> None:
    keys = jax.random.split(jax.random.key(0), 2)
    g = (jax.random.normal(keys[0], (ROWS, V)) * 0.01).astype(jnp.bfloat16)
    x = jax.random.normal(keys[1], (ROWS, H)).astype(jnp.bfloat16)
    flops = 2 * ROWS * V * H
    for acc_dtype in (jnp.bfloat16, jnp.float32):
        name = jnp.dtype(acc_dtype).name
        for label, step in (("XLA", xla_add), ("mosaic_accumulate", mosaic_accumulate.accumulate)):
            ms = median_ms(jax.jit(step, donate_argnums=0), jnp.zeros((V, H), acc_dtype), g, x)
            print(f"{label}, {name} accumulator, {ROWS} rows: {ms:.3f} ms = {flops / ms / 1e9:.0f} TFLOP/s")
        print(f"mosaic_accumulate, {name} accumulator: largest relative error {kernel_error(acc_dtype, g, x):.1e}")


if __name__ == "__main__":
    main()
