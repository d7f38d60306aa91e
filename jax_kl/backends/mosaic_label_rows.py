"""The label's term of ``grad_weight`` as a Mosaic GPU kernel that writes in place:
``acc[k] <- acc[k] + sum of coef_r x_r`` over the rows ``r`` labelled ``k``, each label's sum made in
float32 and rounded into its row once (``jax_kl.gemm.add_label_rows`` states the term; mirror of
``torch_kl``'s ``triton_factored.add_label_rows``).

Why: XLA makes the sums as a float32 ``[n, H]`` segment sum (a scatter of atomic adds into zeros),
then gathers and scatters the accumulator's rows: several passes over ``[n, H]`` float32 arrays,
about 1.7 % of a cross-entropy step (docs/design-notes.md). Here each input row is read about once
(a run's last step reads up to :data:`ROWS` - 1 rows past it, masked) and each labelled row of the
accumulator is read and written once.

Layout: XLA sorts the rows by label and cuts the sorted rows into runs, one a label (:func:`runs`:
each run's first sorted row, length and label; runs of no rows past the last). One program takes
:data:`RUNS` consecutive runs and one slice of columns (:func:`width`): it loads its runs' first
rows at once, sums each run's other rows :data:`ROWS` at a time (their loads independent of each
other), then adds each run's sum to its accumulator row and stores it. Runs are disjoint, so no
two programs write one row: no atomic adds, and the sum's order is the sorted rows' (the same
result every call, unlike XLA's scatter).
Rows, labels and columns are read with plain vector loads (no TMA): any row of the head, up to
:data:`MAX_ROWS` rows (:func:`fits`; beyond, and on other machines, ``jax_kl.gemm``'s XLA form).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fused_kl.chunk import LabelTerm

from .pallas_mosaic import read, unchecked_vma

RUNS = 16  # runs a program: for random labels most runs are one row, so a program's loads are its runs'
ROWS = 16  # a run's rows summed per step, their loads independent (a frequent label's run is long)
THREADS = 128  # one warpgroup a program, each thread loading adjacent columns of a row (vec)
# The runs' programs lie along CUDA's grid axis y, of at most 65535 blocks (Mosaic GPU reverses a
# mesh's axes onto CUDA's, the columns' on x): beyond, XLA's form runs.
MAX_ROWS = 65535 * RUNS
NAME = "fused_kl_label_rows_mosaic"


def vec(h: int) -> int:
    """Adjacent columns a thread loads at once: 4 (16 bytes of float32) where ``h`` allows it, else
    2 or 1."""
    return next(v for v in (4, 2, 1) if h % (THREADS * v) == 0)


def width(h: int) -> int:
    """Columns a program takes: its warpgroup's threads times :func:`vec`."""
    return THREADS * vec(h)


def fits(acc: jax.Array, x: jax.Array) -> bool:
    """Whether this kernel can add the label's rows of ``x`` into ``acc``: bfloat16, float16 or
    float32 arrays, ``H`` a multiple of :data:`THREADS`, at most :data:`MAX_ROWS` rows."""
    floats = all(a.dtype in (jnp.bfloat16, jnp.float16, jnp.float32) for a in (acc, x))
    shapes = acc.ndim == x.ndim == 2 and acc.shape[0] > 0 and acc.shape[1] == x.shape[1]
    return floats and shapes and x.shape[1] % THREADS == 0 and x.shape[0] <= MAX_ROWS


def runs(label: LabelTerm, v: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(order, coef, start, length, key)``: the rows sorted by label (``order``, the rows'
    indices; ``coef``, theirs in that order) and, per run of one label in that order, its first
    sorted row, its length and its label, for as many runs as there are rows, padded to a whole
    number of programs; a run past the last has length 0 and label 0 (a row its program may
    read, never writes). Rows of ``coef`` 0 add nothing: they are sorted last and belong to no
    run."""
    n = label.y.shape[0]
    key = jnp.where(label.coef != 0, label.y, v).astype(jnp.int32)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    ordered = key[order]
    first = (ordered != jnp.concatenate([jnp.full((1,), -1, jnp.int32), ordered[:-1]])) & (ordered < v)
    total = n + -n % RUNS
    at = jnp.where(first, jnp.cumsum(first) - 1, total)  # each run's index at its first row; the others dropped
    start = jnp.zeros((total,), jnp.int32).at[at].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    labels = jnp.zeros((total,), jnp.int32).at[at].set(ordered, mode="drop")
    count, rows = jnp.sum(first, dtype=jnp.int32), jnp.sum(ordered < v, dtype=jnp.int32)
    j = jnp.arange(total, dtype=jnp.int32)
    end = jnp.where(j + 1 < count, jnp.concatenate([start[1:], jnp.zeros((1,), jnp.int32)]), rows)
    length = jnp.where(j < count, end - start, 0)
    return order, label.coef[order].astype(jnp.float32), start, length, labels


def _body(order, coef, start, length, key, x, acc) -> None:
    """A program's runs: their first rows loaded at once (most runs of random labels have one
    row), each run's other rows :data:`ROWS` at a time, then their accumulator rows loaded at
    once and the runs of rows written."""
    n, h = order.shape[0], x.shape[1]
    cols = pl.ds(lax.axis_index("c") * width(h), width(h))
    strided = plgpu.Layout.WG_STRIDED((width(h),), vec_size=vec(h))
    runs_here = [lax.axis_index("g") * RUNS + j for j in range(RUNS)]

    def row(at: jax.Array, end: jax.Array) -> jax.Array:
        """Sorted row ``at``'s ``coef x`` in float32, 0 at and past ``end``."""
        held = jnp.minimum(at, n - 1)
        term = coef[held] * read(x.at[order[held], cols], strided).astype(jnp.float32)
        return jnp.where(at < end, term, 0.0)  # not 0 * x: a row past the run may hold an infinity

    firsts, counts = [start[r] for r in runs_here], [length[r] for r in runs_here]
    totals = [row(first, first + count) for first, count in zip(firsts, counts, strict=True)]
    for j, (first, count) in enumerate(zip(firsts, counts, strict=True)):

        def step(s: jax.Array, total: jax.Array, first=first, count=count) -> jax.Array:
            base = first + 1 + s * ROWS
            return total + functools.reduce(lambda a, b: a + b, [row(base + t, first + count) for t in range(ROWS)])

        totals[j] = lax.fori_loop(0, (count + ROWS - 2) // ROWS, step, totals[j])  # no step for a run of one row
    rows = [acc.at[key[r]] for r in runs_here]
    sums = [read(dst.at[cols], strided).astype(jnp.float32) + t for dst, t in zip(rows, totals, strict=True)]
    for dst, total, count in zip(rows, sums, counts, strict=True):

        @pl.when(count > 0)
        def _(dst=dst, total=total) -> None:
            dst[cols] = total.astype(acc.dtype)


def add_label_rows(acc: jax.Array, x: jax.Array, label: LabelTerm) -> jax.Array:
    """``acc`` (``grad_weight``'s ``[V, H]`` accumulator) with ``sum of label.coef_r x_r`` over the
    rows ``r`` labelled ``k`` added to row ``k``, written over ``acc``; needs :func:`fits`."""
    assert fits(acc, x) and label.y.shape == label.coef.shape == x.shape[:1], "add_label_rows needs fits's shapes"
    order, coef, start, length, key = runs(label, acc.shape[0])
    grid = (start.shape[0] // RUNS, x.shape[1] // width(x.shape[1]))
    mesh = plgpu.Mesh(grid=grid, grid_names=("g", "c"), kernel_name=NAME)
    # Lane semantics named: the layouts above are Lane's, and a kernel without compiler
    # parameters is not lowered in them by every jax.
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
    ref = jax.new_ref(acc)
    with unchecked_vma():
        pl.kernel(_body, out_type=(), mesh=mesh, compiler_params=params, name=NAME)(
            order, coef, start, length, key, x, ref
        )
    return jax.freeze(ref)
