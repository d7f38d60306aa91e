"""The row phases as Pallas kernels on Mosaic GPU (Hopper and newer, jax >= 0.11): the same
phases, inputs and outputs as ``pallas_triton`` (whose docstring and ``fused_kl.terms`` state
the math), laid out the way the Hopper hardware moves data.

One program (``pl.kernel`` on a Mosaic GPU mesh) owns ``R = 64`` rows (one warpgroup's WGMMA
register layout) and one segment of the vocabulary; ``plgpu.emit_pipeline`` walks the segment
in ``[R, TV]`` tiles that the tensor memory accelerator (TMA) copies into shared memory while
the previous tile is computed, the rows' running maxima and sums carried in registers. The segments' partial
statistics are combined afterwards by XLA (the log-sum-exp combination of a vocabulary-sharded
layout): segments exist because a chunk has too few 64-row blocks to fill the GPU. The per-row
inputs are copied to shared memory once per program. ``dL/dz`` is written over the logits,
passed to ``finish`` as a mutable ref (the kernel's output aliases them, as the Triton
lowering's ``input_output_aliases`` do): no second ``[chunk, V]`` buffer. The label's logit is
one gather done by XLA.

The TMA needs the vocabulary to be a multiple of the 128-byte tile (64 bf16 columns) and a
teacher chunk to start on a 64-row boundary: :func:`fits` says whether a chunk qualifies;
backend ``"pallas"`` runs the XLA phases otherwise (``Backend.chunk_phases``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import config as jax_config  # the check plgpu.kernel turns off, where it exists
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fused_kl import factored, rowmath, terms
from fused_kl.checks import BackendUnavailable
from fused_kl.loss import Loss
from fused_kl.rows import COEFS, STATS, Coefs, MixtureSums, Stats

from ..ops import OPS
from ..teachers import DenseChunk
from . import online

R = 64  # rows per program
# Columns per step, by whether a teacher tile is read too (a TMA box holds at most 256 per
# dimension; registers and shared memory per program bound it from above).
TV = {False: 128, True: 64}
H100_SMS = 132  # multiprocessors of an H100/H200
# At least eight programs per multiprocessor of an H100/H200, two tiles in flight per program:
# the fastest of 64/128/256 columns, 2-4 stages and 2, 8 or 16 programs per multiprocessor on
# the H200 (docs/design-notes.md, Mosaic GPU).
MIN_PROGRAMS = 8 * H100_SMS
STAGES = 2
# The hardware's approximate exp2 and lg2 (``approx_math``): a handful of instructions where the
# exact logarithm takes about thirty, as in torch_kl's Triton kernels (log arguments are clamped
# at float32's smallest normal, ``fused_kl.terms.TINY``, since the approximation flushes smaller
# ones). A softcap's tanh goes through exp (``XP``), not through the coarser ``tanh.approx``.
APPROX_MATH = True
NAME = "fused_kl_rows_mosaic"  # the kernel, as profiles and the lowered program name it
WGMMA = plgpu.Layout.WGMMA
ROW = WGMMA.reduce(1)


def _tile_cols(dtype) -> int:
    return 128 // jnp.dtype(dtype).itemsize  # one 128-byte swizzled row of a tile


def fits(z: jax.Array, t: DenseChunk | None) -> bool:
    """Whether the TMA can move this chunk's logits (and teacher) as Mosaic GPU needs."""
    arrays = [z] if t is None else [z, t[0]]
    aligned = all(a.shape[1] % _tile_cols(a.dtype) == 0 and a.shape[0] % 8 == 0 for a in arrays)
    return aligned and (t is None or t[1] % R == 0) and all(a.dtype.itemsize >= 2 for a in arrays)


def _require_fit(z: jax.Array, t) -> None:
    if not fits(z, t):
        raise BackendUnavailable(
            "pallas_mosaic",
            f"the TMA needs the vocabulary (slice) to be a multiple of 128 bytes (64 bf16 or 32 float32 "
            f"columns), chunks of rows in multiples of 8 and a teacher chunk starting on a multiple of {R} "
            f"rows; got logits {z.shape} {z.dtype}"
            + ("" if t is None else f", teacher {t[0].shape} {t[0].dtype} from row {t[1]}")
            + "; backend='pallas' runs the XLA phases here",
        )


def _grid(rows: int, v: int, tv: int) -> tuple[int, int, int]:
    """``(row blocks, segments, steps per segment)``: the fewest segments that give the GPU
    ``MIN_PROGRAMS`` programs, among the divisors of the tile count (no tile is visited twice)."""
    blocks, tiles = pl.cdiv(rows, R), pl.cdiv(v, tv)
    segs = next(d for d in range(1, tiles + 1) if tiles % d == 0 and (blocks * d >= MIN_PROGRAMS or d == tiles))
    return blocks, segs, tiles // segs


def _tiles(dtype, i, s, steps: int, tv: int, row0: int = 0) -> plgpu.BlockSpec:
    return plgpu.BlockSpec(
        (R, tv),
        lambda j: (i + row0, s * steps + j),
        transforms=(plgpu.TilingTransform((8, _tile_cols(dtype))), plgpu.SwizzleTransform(128)),
    )


def _wide(row: jax.Array, like: jax.Array) -> jax.Array:
    """A per-row value broadcast along the tile's columns (``like``'s shape)."""
    return lax.broadcast_in_dim(row, like.shape, (0,))


def read(ref: Any, layout: plgpu.Layout) -> jax.Array:
    """The whole of ``ref`` in registers, in ``layout``: jax 0.11 takes the ref alone (an index is
    deprecated), 0.10 needs the index."""
    return plgpu.load(ref, layout=layout) if _REF_ONLY else plgpu.load(ref, (), layout=layout)


def _load(ref) -> jax.Array:
    """A ``[R, TV]`` tile in registers, in float32."""
    return read(ref, WGMMA).astype(jnp.float32)


_LOAD_PARAMS = inspect.signature(plgpu.load).parameters
_REF_ONLY = "idx" not in _LOAD_PARAMS or _LOAD_PARAMS["idx"].default is not inspect.Parameter.empty


def unchecked_vma() -> contextlib.AbstractContextManager:
    """What ``plgpu.kernel`` runs its kernel under: no varying-manual-axes check inside a
    ``shard_map`` (the kernel's refs carry none)."""
    check = getattr(jax_config, "_check_vma", None)
    return contextlib.nullcontext() if check is None else check(False)


class _KernelNumpy:
    """``jnp`` as ``fused_kl.terms`` sees it inside the kernels, ``tanh`` aside: under
    ``approx_math``, ``jnp.tanh`` would lower to ``tanh.approx`` (error up to 2^-11, coarse for
    capped logits); :func:`fused_kl.terms.tanh_by_exp` takes the approximate ``exp2`` instead,
    as the Triton kernels do."""

    tanh = staticmethod(functools.partial(terms.tanh_by_exp, xp=jnp))

    def __getattr__(self, name: str):
        return getattr(jnp, name)


XP = _KernelNumpy()


def _launch(step, tiled: list, rowvecs: list, inits: list[float], write_grad: bool = False) -> list:
    """Run ``step(cols, tiles, rowvecs, carry, g_ref) -> carry`` over every ``[R, TV]`` tile.

    ``tiled`` are ``(array, first row block)``; ``rowvecs`` are ``[rows]`` float32 or int32
    per-row inputs. Returns the per-segment partials ``[segs, rows]`` of each carried value
    (``inits`` are their starting values), then, with ``write_grad``, ``dL/dz``: written over
    the logits (the first tiled array, passed as a mutable ref), each tile after it was read.
    """
    rows, v = tiled[0][0].shape
    tv = TV[len(tiled) > 1]
    blocks, segs, steps = _grid(rows, v, tv)
    padded = blocks * R
    rowvecs = [jnp.pad(r, (0, padded - rows)) for r in rowvecs]  # whole 64-row copies
    out_type = [jax.ShapeDtypeStruct((segs, padded), jnp.float32) for _ in inits]
    arrays = [a for a, _ in tiled]
    if write_grad:
        arrays[0] = jax.new_ref(arrays[0])
    nt, nr = len(tiled), len(rowvecs)

    def body(*refs):
        tiled_gmem, row_gmem, partial_gmem = refs[:nt], refs[nt : nt + nr], refs[nt + nr :]
        g_gmem = tiled_gmem[0] if write_grad else None
        i, s = lax.axis_index("rows"), lax.axis_index("segs")
        rows_here = pl.ds(i * R, R)

        def scoped(row_smem, out_smem, barrier):
            for k in range(nr):  # this block's per-row inputs, once
                plgpu.copy_gmem_to_smem(row_gmem[k].at[rows_here], row_smem[k], barrier)
                plgpu.barrier_wait(barrier)
            row_values = [read(ref, ROW) for ref in row_smem]

            def pipelined(indices, *tile_refs_and_carry):
                *tile_refs, carry = tile_refs_and_carry
                (j,) = indices
                cols = (s * steps + j) * tv + plgpu.broadcasted_iota(jnp.int32, (R, tv), 1, layout=WGMMA)
                tiles, g_ref = (tile_refs[:-1], tile_refs[-1]) if write_grad else (tile_refs, None)
                return tuple(step(cols, tiles, row_values, list(carry), g_ref))

            in_specs = [_tiles(a.dtype, i, s, steps, tv, r0) for a, r0 in tiled]
            out_specs = [_tiles(tiled[0][0].dtype, i, s, steps, tv)] if write_grad else []
            init = tuple(plgpu.layout_cast(jnp.full((R,), x0, jnp.float32), ROW) for x0 in inits)
            final = plgpu.emit_pipeline(
                pipelined, grid=(steps,), in_specs=in_specs, out_specs=out_specs,
                max_concurrent_steps=STAGES, init_carry=init,
            )(*tiled_gmem, *([] if g_gmem is None else [g_gmem]))  # fmt: skip
            for k, value in enumerate(final):
                out_smem[k][...] = value
            plgpu.commit_smem()
            for k in range(len(final)):
                plgpu.copy_smem_to_gmem(out_smem[k], partial_gmem[k].at[s, rows_here])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scoped,
            [plgpu.SMEM((R,), r.dtype) for r in rowvecs],
            [plgpu.SMEM((R,), jnp.float32) for _ in inits],
            plgpu.Barrier(),
        )

    # pl.kernel on a Mosaic GPU mesh: plgpu.kernel's batching wrapper does not take a mutable ref.
    mesh = plgpu.Mesh(grid=(blocks, segs), grid_names=("rows", "segs"), kernel_name=NAME)
    params = plgpu.CompilerParams(approx_math=APPROX_MATH)
    with unchecked_vma():
        outs = pl.kernel(body, out_type=out_type, mesh=mesh, compiler_params=params, name=NAME)(*arrays, *rowvecs)
    return [o[:, :rows] for o in outs] + ([jax.freeze(arrays[0])] if write_grad else [])


def _stats_step(cols, tiles, rowvecs, carry, g_ref, *, v: int, loss: Loss, carries: online.StatsCarries):
    del rowvecs, g_ref
    teacher_tile = lambda: _load(tiles[1])
    return online.stats_tile(carry, _load(tiles[0]), teacher_tile, cols < v, loss, carries, _wide, XP)


def _exp_stats_step(cols, tiles, rowvecs, carry, g_ref, *, v: int, loss: Loss, carries: online.StatsCarries):
    del rowvecs
    z, mask = _load(tiles[0]), cols < v
    g_ref[...] = jnp.where(mask, factored.exponentials(z, loss, XP), 0.0).astype(g_ref.dtype)
    return online.stats_tile(carry, z, lambda: None, mask, loss, carries, _wide, XP)


def _mixture_sums_step(cols, tiles, rowvecs, carry, g_ref, *, v: int, loss: Loss):
    del g_ref
    lse, lse_t = (_wide(r, cols) for r in rowvecs)
    a, b = online.mixture_tile(_load(tiles[0]), _load(tiles[1]), lse, lse_t, cols < v, loss, XP)
    return [carry[0] + a, carry[1] + b]


def _finish_step(cols, tiles, rowvecs, carry, g_ref, *, v: int, v_total: int, loss: Loss, has_teacher: bool,
                 hard: bool):  # fmt: skip
    y = rowvecs.pop(0) if hard else None
    teacher_tile = (lambda: _load(tiles[1])) if has_teacher else None
    row = lambda r: _wide(r, cols)
    acc, g = online.finish_tile(
        _load(tiles[0]), teacher_tile, Coefs(*rowvecs), y, cols, cols < v, loss, v_total, g_ref is not None, row, XP
    )
    if g is not None:
        g_ref[...] = g.astype(g_ref.dtype)
    return [carry[0] if acc is None else carry[0] + acc]


def _tiled(z: jax.Array, t) -> list:
    return [(z, 0)] if t is None else [(z, 0), (t[0], t[1] // R)]


def stats(z: jax.Array, t: DenseChunk | None, y: jax.Array | None, loss: Loss, tile: tuple[int, int]) -> jax.Array:
    """``fused_kl.rows.Stats`` of each row of the chunk (local to this vocabulary slice)."""
    del tile
    _require_fit(z, t)
    rows, v = z.shape
    carries = online.StatsCarries.of(loss, t is not None, y is not None)
    step = functools.partial(_stats_step, v=v, loss=loss, carries=carries)
    parts = _launch(step, _tiled(z, t), [], carries.inits())
    zero = jnp.zeros((rows,), jnp.float32)
    columns = online.stats_columns(parts, carries, online.lse_of, lambda a: jnp.sum(a, axis=0), zero)
    label_logit = zero
    if y is not None:
        label_logit = rowmath.label_logit(z, y, loss, OPS.gather, jnp)
    return jnp.stack(Stats(**columns, label_logit=label_logit), axis=1)


def exp_stats(z: jax.Array, y: jax.Array | None, loss: Loss) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A factored chunk's one pass (``fused_kl.factored``; no dense teacher): ``(E``
    written over ``z``, the rows' ``fused_kl.rows.Stats``, each row's maximum exponent)``. The
    label's logit is gathered before the kernel overwrites ``z``."""
    _require_fit(z, None)
    rows, v = z.shape
    label_logit = jnp.zeros((rows,), jnp.float32)
    if y is not None:
        label_logit = rowmath.label_logit(z, y, loss, OPS.gather, jnp)
        z, label_logit = OPS.materialize(z, label_logit)
    carries = online.StatsCarries.of(loss, False, y is not None)
    step = functools.partial(_exp_stats_step, v=v, loss=loss, carries=carries)
    *parts, e = _launch(step, [(z, 0)], [], carries.inits(), write_grad=True)
    total = lambda a: jnp.sum(a, axis=0)
    columns = online.stats_columns(parts, carries, online.lse_of, total, jnp.zeros_like(label_logit))
    return e, jnp.stack(Stats(**columns, label_logit=label_logit), axis=1), jnp.max(parts[0], axis=0)


def mixture_sums(z: jax.Array, t: DenseChunk, stats: jax.Array, loss: Loss, tile: tuple[int, int]) -> jax.Array:
    """Phase 2 (JSD): each row's ``fused_kl.rows.MixtureSums``."""
    del tile
    _require_fit(z, t)
    v = z.shape[1]
    step = functools.partial(_mixture_sums_step, v=v, loss=loss)
    a, b = _launch(step, _tiled(z, t), [stats[:, STATS.lse], stats[:, STATS.lse_teacher]], [0.0, 0.0])
    return jnp.stack(MixtureSums(teacher=jnp.sum(a, axis=0), student=jnp.sum(b, axis=0)), axis=1)


def finish(
    z: jax.Array,
    t: DenseChunk | None,
    y: jax.Array | None,
    coefs: jax.Array,
    loss: Loss,
    v_total: int,
    tile: tuple[int, int],
    write_grad: bool,
) -> tuple[jax.Array | None, jax.Array]:
    """Phase 3: ``(dL/dz or None, the rows' forward-KL sums)``; ``dL/dz`` is written over ``z``."""
    del tile
    _require_fit(z, t)
    v = z.shape[1]
    rowvecs = ([] if y is None else [y.astype(jnp.int32)]) + [coefs[:, at] for at in COEFS]
    step = functools.partial(_finish_step, v=v, v_total=v_total, loss=loss, has_teacher=t is not None,
                             hard=y is not None)  # fmt: skip
    outs = _launch(step, _tiled(z, t), rowvecs, [0.0], write_grad)
    sums = jnp.sum(outs[0], axis=0)
    return (outs[1], sums) if write_grad else (None, sums)
