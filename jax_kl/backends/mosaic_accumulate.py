"""The ``grad_weight`` GEMM of a chunk as a Mosaic GPU kernel that adds into its accumulator in
place: ``acc[V, H] <- acc + gᵀ x`` for the chunk's ``dL/dz`` ``g [rows, V]`` and inputs
``x [rows, H]``, the sum taken in float32 and rounded once to ``acc``'s dtype (the operands'
16-bit dtype, or float32: ``accum_dtype=float32``).

Why: XLA folds ``acc + dot(g, x)`` into one GEMM (cuBLAS's beta = 1) only with its Triton GEMMs
off; otherwise every chunk after the first costs a ``[V, H]`` product buffer and an add pass
that reads it and the accumulator (docs/design-notes.md, GEMMs). Here the accumulator goes in as a
mutable ref (the kernel's output aliases it). A 16-bit accumulator's tile is loaded by the tensor
memory accelerator (TMA) while the tile's main loop runs, so the add costs one read and the write
a GEMM makes anyway; a float32 accumulator is added to by the TMA's store itself (a reducing
store, ``cp.reduce.async.bulk`` add), which reads nothing into the multiprocessor.

Layout: a persistent kernel, one program per multiprocessor, walks the ``[V, H]`` output in
``128 x 256`` tiles; in each, a memory warpgroup streams ``64``-row slices of ``g`` and ``x``
through shared memory and two compute warpgroups each multiply one ``128 x 128`` half with WGMMA,
``g``'s slice read transposed (``[64, 128]`` in memory, ``[128, 64]`` to the tensor cores).
The chunk's columns and ``H`` must be whole numbers of output tiles (:func:`fits`); the driver
uses XLA's add elsewhere. The accumulator may have more rows than the chunk has columns: its tiles
move through shared memory in slices of one 128-byte swizzle row (``[128, 64]`` 16-bit, ``[128,
32]`` float32), tiled ``(1, cols)``: the same bytes as an ``(8, cols)`` tiling, but a tiling that
asks nothing of the accumulator's row count, where ``(8, cols)`` needs it a multiple of 8.

``torch_kl`` needs no counterpart: ``torch.addmm`` into the accumulator is cuBLAS's beta = 1 GEMM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .pallas_mosaic import H100_SMS, unchecked_vma

TILE_M, TILE_N, TILE_K = 128, 128, 64  # one compute warpgroup's output tile; the slice of rows per step
CTA_M, CTA_N = TILE_M, 2 * TILE_N  # one program's output tile: the two warpgroups side by side along H
STAGES = 3  # 3 x 48 KiB of operand slices beside the 64 KiB of BUFFERS, in 227 KiB of shared memory
SLICE_BYTES = 128  # the accumulator tile's slices: one 128-byte swizzle row
# Shared-memory slices per compute warpgroup: a 16-bit accumulator's whole [128, 128] half (two
# slices of 64 columns), a float32 one's four slices of 32 columns two at a time.
BUFFERS = 2
DELAY = 0  # each step's MMA waited for before its slot is released: 5 % faster alone than one in flight
SNAKE_WIDTH, SNAKE_MINOR = 4, 1  # bands of 4 tiles along V walked along H first (L2 reuse)
NAME = "fused_kl_grad_weight_mosaic"
ROWS_NAME = "fused_kl_grad_weight_rows"  # put_rows's kernel


def fits(acc: jax.Array, g: jax.Array, x: jax.Array) -> bool:
    """Whether this kernel can add ``gᵀ x`` into the first rows of ``acc``: 16-bit operands of
    one dtype, the accumulator in theirs or in float32, ``g``'s columns and ``H``
    whole numbers of output tiles, at least as many accumulator rows as ``g`` has columns, the
    chunk's rows a multiple of the operands' 8-row tiling (the TMA reads zeros past the last
    64-row slice, not past a partial 8-row tile)."""
    (rows, v), h = g.shape, x.shape[1]
    same = g.dtype == x.dtype and g.dtype in (jnp.bfloat16, jnp.float16) and acc.dtype in (g.dtype, jnp.float32)
    tiled = v % CTA_M == 0 and h % CTA_N == 0 and rows % 8 == 0
    return same and tiled and acc.shape[0] >= v and acc.shape[1] == h and x.shape[0] == rows


def _sms() -> int:
    """One program per multiprocessor; an H100's count where no GPU can be asked (lowering on CPU)."""
    device = jax.devices()[0]
    return (getattr(device, "core_count", None) if device.platform == "gpu" else None) or H100_SMS


def _transforms(dtype, minor: int) -> tuple:
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def _slice_cols(dtype: jnp.dtype) -> int:
    return SLICE_BYTES // jnp.dtype(dtype).itemsize


def _slice_transforms(dtype: jnp.dtype) -> tuple:
    """An accumulator slice's layout: 128-byte swizzled rows, tiled ``(1, cols)`` (see the module
    docstring: ``(8, cols)`` would lay out the same bytes but need the accumulator's rows a
    multiple of 8)."""
    return plgpu.TilingTransform((1, _slice_cols(dtype))), plgpu.SwizzleTransform(SLICE_BYTES)


def _operand(cols: int, dtype) -> plgpu.BlockSpec:
    """Step ``k``'s ``[TILE_K, cols]`` slice of an operand: its rows ``k * TILE_K ...``; past the
    chunk's last row the TMA reads zeros, which add nothing."""
    transforms = _transforms(dtype, TILE_K)
    return plgpu.BlockSpec((TILE_K, cols), lambda k: (k, 0), transforms=transforms, delay_release=DELAY)


def _body(g_gmem, x_gmem, acc_gmem, add: bool = True):
    """The tile loop; with ``add`` false the tiles are written as they are (:func:`product`)."""
    rows, v = g_gmem.shape
    h = x_gmem.shape[1]
    m_iters, n_iters = v // CTA_M, h // CTA_N
    cols = _slice_cols(acc_gmem.dtype)
    slices = TILE_N // cols
    # A float32 accumulator is added to by the TMA's store itself (a reduction "add" in float32,
    # one rounding as the load and add would make): nothing is loaded, and its four slices take
    # turns in two buffers. A 16-bit one is loaded and summed in float32, to be rounded once.
    reduce = jnp.dtype(acc_gmem.dtype).itemsize == 4
    load = add and not reduce
    assert reduce or slices == BUFFERS, "a 16-bit accumulator's half tile stays in shared memory"

    def pipeline(mma, context):
        return plgpu.emit_pipeline_warp_specialized(
            mma,
            grid=(pl.cdiv(rows, TILE_K),),
            memory_registers=40,
            in_specs=[_operand(CTA_M, g_gmem.dtype), _operand(CTA_N, x_gmem.dtype)],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=STAGES,
            compute_context=context,
        )

    ignore = lambda *_, **__: None  # the allocations do not depend on the bodies

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(g_gmem, x_gmem),
        acc_smem=plgpu.SMEM((2, BUFFERS, TILE_M, cols), acc_gmem.dtype, transforms=_slice_transforms(acc_gmem.dtype)),
        loaded=plgpu.Barrier(num_barriers=2 * BUFFERS),
        collective_axes="wg",
    )
    def scoped(allocations, acc_smem, loaded):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def tiles(info: plgpu.NDLoopInfo) -> None:
            (index,) = info.index
            mi, ni = plgpu.planar_snake(index, (m_iters, n_iters), SNAKE_MINOR, SNAKE_WIDTH)
            m_slice, n_slice = pl.ds(mi * CTA_M, CTA_M), pl.ds(ni * CTA_N, CTA_N)
            half = pl.ds(wg * TILE_N, TILE_N)
            out = acc_gmem.at[m_slice, n_slice].at[:, half]
            outs = [out.at[:, pl.ds(j * cols, cols)] for j in range(slices)]
            mine = [acc_smem.at[wg, j] for j in range(BUFFERS)]
            arrived = [loaded.at[wg * BUFFERS + j] for j in range(BUFFERS)]

            def context(run_main_loop):
                @functools.partial(pl.run_scoped, product=plgpu.ACC((TILE_M, TILE_N), jnp.float32))
                def accumulate(product):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores have left
                    if load:  # the tile's accumulator slices load while the main loop runs
                        for src, dst, barrier in zip(outs, mine, arrived, strict=True):
                            plgpu.copy_gmem_to_smem(src, dst, barrier)
                    run_main_loop(product)
                    total = product[...]
                    for j, dst in enumerate(outs):
                        buf, part = mine[j % BUFFERS], total[:, j * cols : (j + 1) * cols]
                        if load:
                            plgpu.barrier_wait(arrived[j])
                            part = buf[...].astype(jnp.float32) + part
                        elif j >= BUFFERS:  # the store of slice j - BUFFERS has read this buffer
                            plgpu.wait_smem_to_gmem(BUFFERS - 1, wait_read_only=True)
                        buf[...] = part.astype(buf.dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(buf, dst, reduction_op="add" if add and reduce else None)

            def mma(indices, g_smem, x_smem, product):
                del indices
                plgpu.wgmma(product, g_smem.T, x_smem.at[:, half])
                plgpu.wgmma_wait(DELAY)  # the MMA DELAY steps back has read its slot: release it
                return product

            pipeline(mma, context)(g_gmem.at[:, m_slice], x_gmem.at[:, n_slice], allocations=allocations)

    plgpu.wait_smem_to_gmem(0)


def _kernel(out_type: jax.ShapeDtypeStruct | None = None):
    """The in-place add; with ``out_type``, the product into a fresh array of that shape."""
    mesh = plgpu.Mesh(grid=(_sms(),), grid_names=("sm",), num_threads=3, thread_name="wg", kernel_name=NAME)
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    body, out = (_body, ()) if out_type is None else (functools.partial(_body, add=False), out_type)
    return pl.kernel(body, out_type=out, mesh=mesh, compiler_params=params, name=NAME)


def accumulate(acc: jax.Array, g: jax.Array, x: jax.Array) -> jax.Array:
    """``acc`` with ``gᵀ x`` added to its first ``g.shape[1]`` rows, written over ``acc`` (see
    the module docstring); needs :func:`fits`."""
    ref = jax.new_ref(acc)
    with unchecked_vma():
        _kernel()(g, x, ref)
    return jax.freeze(ref)


def product(g: jax.Array, x: jax.Array, rows: int, dtype: jnp.dtype) -> jax.Array:
    """A new ``[rows, H]`` array of ``dtype`` whose first ``g.shape[1]`` rows are ``gᵀ x``, rounded
    once; its rows past those are left unwritten, for :func:`put_rows`. The first chunk's call at an
    unaligned vocabulary: no zero fill of the array its successors add into. Needs :func:`fits` of
    such an array."""
    out = jax.ShapeDtypeStruct((rows, x.shape[1]), dtype)
    assert fits(out, g, x), "product needs the in-place kernel's shapes (fits)"
    with unchecked_vma():
        return _kernel(out)(g, x)


def _put_body(rows_gmem, acc_gmem) -> None:
    """One program a slice of columns: the rows go through shared memory into the accumulator's
    last rows (the TMA moves any row count with the ``(1, cols)`` tiling)."""
    r = rows_gmem.shape[0]
    cols = _slice_cols(acc_gmem.dtype)
    columns = pl.ds(lax.axis_index("c") * cols, cols)
    start = acc_gmem.shape[0] - r

    @functools.partial(
        pl.run_scoped,
        smem=plgpu.SMEM((r, cols), acc_gmem.dtype, transforms=_slice_transforms(acc_gmem.dtype)),
        loaded=plgpu.Barrier(num_barriers=1),
    )
    def scoped(smem, loaded):
        plgpu.copy_gmem_to_smem(rows_gmem.at[:, columns], smem, loaded)
        plgpu.barrier_wait(loaded)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, acc_gmem.at[pl.ds(start, r), columns])
        plgpu.wait_smem_to_gmem(0)


def put_rows(acc: jax.Array, rows: jax.Array) -> jax.Array:
    """``acc`` with its last ``rows.shape[0]`` rows replaced by ``rows`` (its dtype, at most
    ``CTA_M`` of them), written over ``acc``: an unaligned vocabulary's rest joins the array
    without a pass over the whole of it."""
    r, (v, h), cols = rows.shape[0], acc.shape, _slice_cols(acc.dtype)
    if rows.dtype != acc.dtype or rows.shape[1] != h or not 0 < r <= min(CTA_M, v) or h % cols:
        raise ValueError(
            f"rows: expected 1 to {min(CTA_M, v)} rows of {acc.dtype}, {h} wide (a multiple of {cols}),"
            f" got {rows.dtype} {rows.shape}"
        )
    mesh = plgpu.Mesh(grid=(h // cols,), grid_names=("c",), kernel_name=ROWS_NAME)
    ref = jax.new_ref(acc)
    with unchecked_vma():
        pl.kernel(_put_body, out_type=(), mesh=mesh, name=ROWS_NAME)(rows, ref)
    return jax.freeze(ref)
