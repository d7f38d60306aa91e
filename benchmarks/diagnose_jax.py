"""Where ``jax_kl``'s ``grad_weight`` accumulation goes (Hopper with Mosaic GPU only; what it
measured backs the in-place kernels' rows in docs/design-notes.md): one chunk's ``acc + gᵀ x`` on
the llama-3 head, by ``jax_kl.backends.mosaic_accumulate`` and by XLA, with a bf16 and a float32
accumulator, in ms and TFLOP/s, with the kernel's largest error against float32 on a slice; then
the label rows after the last chunk (``jax_kl.gemm.add_label_rows``), by XLA's segment sum and by
``jax_kl.backends.mosaic_label_rows``, for random and Zipf-distributed labels at two N.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m benchmarks.diagnose_jax   # from the repository root
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.measure import Timing, time_ms
from fused_kl.chunk import LabelTerm
from fused_kl.plan import plan_chunks
from jax_kl import gemm
from jax_kl.backends import mosaic_accumulate, mosaic_label_rows

V, H = 128256, 4096
ROWS = plan_chunks(8192, V, 2, None).chunk_rows  # the default chunk's rows on this head
REPS = 15
LABEL_ADDS = 10  # label-row adds in one program: one alone is too short to time by wall clock
ZIPF_EXPONENT = 1.1  # a text corpus's token frequencies, roughly


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


def label_rows_ms(n: int, zipf: bool) -> tuple[float, float, float]:
    """ms per label-row add of ``n`` rows by XLA and by the Mosaic GPU kernel, and the largest
    difference of their sums after :data:`LABEL_ADDS` adds into a bf16 accumulator."""
    keys = jax.random.split(jax.random.key(n), 3)
    x = jax.random.normal(keys[0], (n, H), jnp.bfloat16)
    if zipf:
        p = 1.0 / jnp.arange(1, V + 1) ** ZIPF_EXPONENT
        y = jax.random.choice(keys[1], V, (n,), p=p / p.sum())
    else:
        y = jax.random.randint(keys[1], (n,), 0, V)
    label = LabelTerm(jax.random.uniform(keys[2], (n,), jnp.float32) - 1.0, y)
    times, sums = [], []
    for in_place in (None, mosaic_label_rows):

        def adds(x: jax.Array, label: LabelTerm, in_place=in_place) -> jax.Array:
            acc = jnp.zeros((V, H), jnp.bfloat16)
            return lax.fori_loop(0, LABEL_ADDS, lambda _, a: gemm.add_label_rows(a, x, label, in_place), acc)

        step = jax.jit(adds)
        sums.append(step(x, label).block_until_ready())
        ms = time_ms("jax", lambda step=step: step(x, label), Timing(reps=REPS, rep_ms=0.0, warmup_ms=0.0), True)
        times.append(ms / LABEL_ADDS)
    return times[0], times[1], float(jnp.max(jnp.abs(sums[0].astype(jnp.float32) - sums[1].astype(jnp.float32))))


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
    for n in (8192, 32768):
        for zipf in (False, True):
            xla, kernel, diff = label_rows_ms(n, zipf)
            labels = f"Zipf labels (exponent {ZIPF_EXPONENT})" if zipf else "random labels"
            print(f"label rows, N = {n}, {labels}: XLA {xla:.3f} ms, mosaic_label_rows {kernel:.3f} ms;"
                  f" largest difference after {LABEL_ADDS} adds {diff:.2e}")


if __name__ == "__main__":
    main()
