"""A factored chunk's logits GEMM with its pass in the epilogue, as a Mosaic GPU kernel: from the
chunk's inputs ``x [rows, H]`` and the head's rows ``w [V, H]``, ``E = exp(a - SHIFT) u`` of the
float32 products (``fused_kl.factored``) written as the chunk's ``[rows, V]`` array, with each
row's statistics; the logits themselves are never stored, and no pass reads the chunk to make
``E`` (``torch_kl``'s Triton logits GEMM does the same in its epilogue, ``triton_factored``).

Layout: ``mosaic_accumulate``'s persistent warp-specialised GEMM (one program per multiprocessor,
a memory warpgroup streaming ``64``-column slices of ``x`` and ``w`` through shared memory, two
compute warpgroups each multiplying one ``128 x 128`` half of a ``128 x 256`` output tile with
WGMMA, ``w``'s slice read transposed). Each half's epilogue writes its ``E`` through shared memory
and its rows' maximum ``a`` and ``sum exp(a - max)``, combined over the halves afterwards as the
row kernels' segments are (``pallas_mosaic``). The label's logit is one float32 dot product per
row by XLA (``x_r . w_{y_r}``), more exact than the bfloat16 logit the row pass reads.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fused_kl import factored, terms
from fused_kl.loss import Loss
from fused_kl.rows import Stats

from . import pallas_mosaic
from .mosaic_accumulate import CTA_M, CTA_N, STAGES, TILE_K, TILE_M, TILE_N, operand_transforms, sms
from .pallas_mosaic import XP, unchecked_vma

NAME = "fused_kl_exp_logits_mosaic"
SNAKE_WIDTH, SNAKE_MINOR = 4, 1  # bands of 4 row tiles walked along the vocabulary first (L2 reuse of w)


class Product(NamedTuple):
    """A chunk's logits not yet made: ``x [rows, H]`` times the head's rows ``w [V, H]``. Its
    ``shape`` and ``dtype`` are the logits', so that the chunk's plan reads it as their array."""

    x: jax.Array
    w: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        return self.x.shape[0], self.w.shape[0]

    @property
    def dtype(self) -> jnp.dtype:
        return self.x.dtype


def fits(x: jax.Array, w: jax.Array) -> bool:
    """Whether the kernel can make this chunk: 16-bit operands of one dtype, the head's rows a
    whole number of ``128``-column halves, ``H`` of ``64``-column slices, the rows a multiple of
    the operands' 8-row tiling."""
    same = x.dtype == w.dtype and x.dtype in (jnp.bfloat16, jnp.float16)
    tiled = w.shape[0] % TILE_N == 0 and x.shape[1] % TILE_K == 0 and x.shape[0] % 8 == 0
    return same and tiled and x.shape[1] == w.shape[1]


def _body(x_gmem, w_gmem, e_gmem, max_gmem, sum_gmem, *, loss: Loss) -> None:
    rows, h = x_gmem.shape
    v = w_gmem.shape[0]
    m_iters, n_iters = pl.cdiv(rows, CTA_M), pl.cdiv(v, CTA_N)

    def pipeline(mma, context):
        return plgpu.emit_pipeline_warp_specialized(
            mma,
            grid=(h // TILE_K,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((CTA_M, TILE_K), lambda k: (0, k), transforms=operand_transforms(x_gmem.dtype, TILE_K)),
                plgpu.BlockSpec((CTA_N, TILE_K), lambda k: (0, k), transforms=operand_transforms(w_gmem.dtype, TILE_K)),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=STAGES,
            compute_context=context,
        )

    ignore = lambda *_, **__: None  # the allocations do not depend on the bodies

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem),
        e_smem=plgpu.SMEM((2, TILE_M, TILE_N), e_gmem.dtype, transforms=operand_transforms(e_gmem.dtype, TILE_N)),
        row_smem=plgpu.SMEM((2, 2, TILE_M), jnp.float32),
        collective_axes="wg",
    )
    def scoped(allocations, e_smem, row_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def tiles(info: plgpu.NDLoopInfo) -> None:
            (index,) = info.index
            mi, ni = plgpu.planar_snake(index, (m_iters, n_iters), SNAKE_MINOR, SNAKE_WIDTH)
            m_slice, n_slice = pl.ds(mi * CTA_M, CTA_M), pl.ds(ni * CTA_N, CTA_N)
            half = pl.ds(wg * TILE_N, TILE_N)
            col0 = ni * CTA_N + wg * TILE_N  # a half lies wholly inside the vocabulary or wholly past it

            def context(run_main_loop):
                @functools.partial(pl.run_scoped, product=plgpu.ACC((TILE_M, TILE_N), jnp.float32))
                def epilogue(product):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores have left
                    run_main_loop(product)
                    z = product[...]
                    a = factored.exponent(z, loss, XP)
                    top = jnp.max(a, axis=1)
                    total = jnp.sum(jnp.exp(a - lax.broadcast_in_dim(top, a.shape, (0,))), axis=1)
                    e = factored.exponentials(z, loss, XP)

                    @pl.when(col0 < v)
                    def _store() -> None:
                        e_smem[wg] = e.astype(e_smem.dtype)
                        row_smem[wg, 0] = top
                        row_smem[wg, 1] = total
                        plgpu.commit_smem()
                        at = col0 // TILE_N
                        plgpu.copy_smem_to_gmem(e_smem.at[wg], e_gmem.at[m_slice, pl.ds(col0, TILE_N)])
                        plgpu.copy_smem_to_gmem(row_smem.at[wg, 0], max_gmem.at[at, m_slice])
                        plgpu.copy_smem_to_gmem(row_smem.at[wg, 1], sum_gmem.at[at, m_slice])

            def mma(indices, x_smem, w_smem, product):
                del indices
                plgpu.wgmma(product, x_smem, w_smem.at[half].T)
                plgpu.wgmma_wait(0)
                return product

            pipeline(mma, context)(x_gmem.at[m_slice, :], w_gmem.at[n_slice, :], allocations=allocations)

    plgpu.wait_smem_to_gmem(0)


def exp_stats(z: Product, y: jax.Array | None, loss: Loss) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What ``pallas_mosaic.exp_stats`` of the logits ``z`` would return, made from ``z``'s inputs
    (see the module docstring): ``(E``, the rows' ``fused_kl.rows.Stats``, each row's maximum
    exponent)``."""
    x, w = z
    assert fits(x, w), "exp_stats needs the kernel's shapes (fits)"
    rows, v = z.shape
    # The halves' row statistics are stored whole 128-row tiles at a time: a store past the last
    # row of a 1-D slice would reach the next half's first rows.
    halves = jax.ShapeDtypeStruct((v // TILE_N, pl.cdiv(rows, CTA_M) * CTA_M), jnp.float32)
    mesh = plgpu.Mesh(grid=(sms(),), grid_names=("sm",), num_threads=3, thread_name="wg", kernel_name=NAME)
    params = plgpu.CompilerParams(
        lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=pallas_mosaic.APPROX_MATH
    )
    kernel = pl.kernel(
        functools.partial(_body, loss=loss), out_type=(jax.ShapeDtypeStruct((rows, v), x.dtype), halves, halves),
        mesh=mesh, compiler_params=params, name=NAME,
    )  # fmt: skip
    with unchecked_vma():
        e, top, total = kernel(x, w)
    top, total = top[:, :rows], total[:, :rows]
    return e, row_stats(top, total, z, y, loss), jnp.max(top, axis=0)


def row_stats(top: jax.Array, total: jax.Array, z: Product, y: jax.Array | None, loss: Loss) -> jax.Array:
    """The rows' ``Stats`` from the halves' maximum exponent ``top`` and ``sum exp(a - top)``
    (``[halves, rows]``) and the labels ``y`` (columns of ``z``; None without the hard term): the
    log-sum-exp combined over the halves; the label's logit ``f(x_r . w_{y_r})`` in float32. A
    factored chunk has one temperature where the hard term is on (``fused_kl.factored.takes``),
    so the hard term's log-sum-exp is the student's; nothing else of ``Stats`` is read."""
    assert not loss.separate_hard_lse, "a factored chunk has one temperature with the hard term"
    x, w = z
    zero = jnp.zeros((x.shape[0],), jnp.float32)
    lse = pallas_mosaic.lse_of_segments(top, total)
    label_logit = zero
    if y is not None:
        inside = (y >= 0) & (y < w.shape[0])
        rows = w[jnp.where(inside, y, 0)].astype(jnp.float32)
        z_y = jnp.einsum("rh,rh->r", x.astype(jnp.float32), rows, precision=lax.Precision.HIGHEST)
        label_logit = jnp.where(inside, terms.transform(z_y, loss.logit_scale, loss.softcap, jnp), 0.0)
    stats = Stats(lse=lse, lse_hard=lse, lse_teacher=zero, mass=zero, logit_sum=zero, label_logit=label_logit,
                  reverse=zero)  # fmt: skip
    return jnp.stack(stats, axis=1)
