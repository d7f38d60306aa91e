"""Chunk planning and the reduction scale, shared by every backend of both frameworks."""

from __future__ import annotations

from dataclasses import dataclass

# Rows per chunk are chosen so that one chunk of logits takes about this many bytes:
# large enough that the three GEMMs of a chunk run near their peak rate, small enough that
# the chunk buffer stays far below the gradients' size (see benchmarks/RESULTS.md).
CHUNK_BYTES = 768 << 20
# GEMM-friendly granularity of the row count.
ROW_MULTIPLE = 256
# The row kernel walks a row in tiles of at most MAX_BLOCK_V columns (fp32 registers per
# program), seen as [MAX_BLOCK_V / TILE_COLS, TILE_COLS]: sums and maxima along the TILE_COLS
# stay inside a warp, and the running statistics are kept per tile row, so no step needs a
# reduction across the whole block (14% faster on the H200 than a flat 4096-wide block).
MAX_BLOCK_V = 4096
TILE_COLS = 128
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Plan:
    """How the rows are cut: ``bounds`` are the chunks' ``(start, stop)`` row ranges; ``tile``
    is the ``[rows, columns]`` shape in which the row kernel walks one row of logits."""

    chunk_rows: int
    tile: tuple[int, int]
    bounds: tuple[tuple[int, int], ...]


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def default_chunk_rows(n: int, v: int, logits_itemsize: int) -> int:
    """Rows per chunk so one chunk of logits is about ``CHUNK_BYTES``."""
    rows = CHUNK_BYTES // (v * logits_itemsize)
    rows = max(ROW_MULTIPLE, rows // ROW_MULTIPLE * ROW_MULTIPLE)
    return max(1, min(rows, n))


def plan_chunks(n: int, v: int, logits_itemsize: int, chunk_size: int | None) -> Plan:
    """Cut ``n`` rows into chunks; the kernel's in-chunk offsets then fit in 32 bits."""
    rows = chunk_size if chunk_size is not None else default_chunk_rows(n, v, logits_itemsize)
    rows = max(1, min(rows, n, INT32_MAX // v))
    bounds = tuple((s, min(s + rows, n)) for s in range(0, n, rows))
    block_v = min(MAX_BLOCK_V, next_power_of_2(v))
    cols = min(block_v, TILE_COLS)
    return Plan(chunk_rows=rows, tile=(block_v // cols, cols), bounds=bounds)


def float16_unscale(scale, xp):
    """The power of two ``c`` that float16 gradients are stored divided by, and multiplied by after.

    ``dL/dz`` is stored in the logits' dtype. Scaled by ``1/n`` (or ``1/(n*V)``) it falls below
    float16's smallest normal number (2**-14) and loses its precision before the gradient GEMMs,
    as it does in the unfused float16 loss. So the float16 kernels store ``dL/dz / c`` with
    ``c = 2**floor(log2(s))`` clamped to ``[2**-14, 1]``, and the gradients are multiplied by
    ``c`` after their GEMMs: exact, since ``c`` is a power of two and a normal float16 number.
    ``xp`` is ``torch`` or ``jax.numpy``; the count stays on the device.
    """
    return xp.exp2(xp.clip(xp.floor(xp.log2(scale)), -14.0, 0.0))


def kernel_scales(kept, reduction: str, v: int, float16: bool, xp):
    """The row kernel's scales ``[s, s / c]`` (the loss's, the stored dL/dz's) and ``c``.

    ``s`` is :func:`reduction_scale`; ``c`` is :func:`float16_unscale` for float16 logits, else
    ``None``: no pass over the gradients to multiply them by 1 (a traced 1 that XLA cannot
    fold would cost a ``grad_weight``-sized pass and buffer). Both stay on the device; ``xp``
    is ``torch`` or ``jax.numpy``.
    """
    scale = reduction_scale(kept, reduction, v)
    if not float16:
        return xp.stack([scale, scale]), None
    unscale = float16_unscale(scale, xp)
    return xp.stack([scale, scale / unscale]), unscale


def reduction_scale(kept, reduction: str, v: int):
    """``1/n``, ``1`` or ``1/(n*V)`` from the float32 count of kept rows; 0 when ``n == 0``.

    Written with operators only, so the same code runs on a torch tensor and a JAX array,
    on the device and without a host sync.
    """
    if reduction == "sum":  # not (kept > 0) * 1.0: JAX types that weakly, and Pallas's lowering
        return kept.clip(max=1.0)  # of a weakly typed kernel operand fails
    denom = kept * v if reduction == "mean" else kept
    return (kept > 0) / (denom + (kept == 0))
