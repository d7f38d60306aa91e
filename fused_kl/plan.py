"""Chunk planning, shared by every backend of both frameworks."""

from __future__ import annotations

from dataclasses import dataclass

# Rows per chunk are chosen so that one chunk of logits takes about this many bytes:
# large enough that the three GEMMs of a chunk run near their peak rate, small enough that
# the chunk buffer stays far below the gradients' size (docs/design-notes.md, chunks and blocks).
CHUNK_BYTES = 768 << 20
# GEMM-friendly granularity of the row count.
ROW_MULTIPLE = 256
# A teacher head's logits are made for a chunk in blocks of rows taking about this many bytes,
# each block's row phases run before the next block's GEMM overwrites its buffer: the chunk keeps
# all its rows, so its ``grad_weight`` GEMM stays deep (on the H200 one 1536 rows deep took 1.15x
# the unchunked GEMM, one 3072 deep 1.05x), while the two buffers stay under 1 GiB
# (docs/design-notes.md).
TEACHER_BLOCK_BYTES = 256 << 20
# The label terms' rows of grad_weight are summed in float32 after the last chunk
# (``fused_kl.chunk.LabelTerm``), a block of columns at a time taking about this many bytes.
LABEL_BLOCK_BYTES = 64 << 20
# The row kernels walk a row in tiles of at most MAX_BLOCK_V columns (fp32 registers per
# program), seen as [MAX_BLOCK_V / TILE_COLS, TILE_COLS]: sums and maxima along the TILE_COLS
# stay inside a warp, and the running statistics are kept per tile row, so no step needs a
# reduction across the whole block (14% faster on the H200 than a flat 4096-wide block).
MAX_BLOCK_V = 4096
TILE_COLS = 128
INT32_MAX = 2**31 - 1
# A chunk's [rows, V] buffers have rows this many elements apart, whatever V is (the columns past V
# are never read): the GEMMs that write and read them run at their rate only on rows of a multiple of
# 16 bytes (on the H200 a vocabulary one token off a multiple of 64 made the whole step 2-6x slower).
# 64 elements: rows of whole 128-byte lines in 16-bit dtypes, at most 63 columns more memory.
ROW_STRIDE_MULTIPLE = 64


@dataclass(frozen=True)
class Plan:
    """How the rows are cut: ``bounds`` are the chunks' ``(start, stop)`` row ranges; ``tile``
    is the ``[rows, columns]`` shape in which the row kernels walk one row of logits;
    ``block_rows`` the rows of a teacher head's logits made at a time (:meth:`blocks`)."""

    chunk_rows: int
    tile: tuple[int, int]
    bounds: tuple[tuple[int, int], ...]
    block_rows: int

    def blocks(self, start: int, stop: int) -> tuple[tuple[int, int], ...]:
        """The row ranges of the chunk ``[start, stop)`` in which its teacher is made and its row
        phases run: the chunk itself unless it has more than ``block_rows`` rows."""
        return tuple((s, min(s + self.block_rows, stop)) for s in range(start, stop, self.block_rows))


def padded_row_stride(v: int) -> int:
    """The row stride, in elements, of a chunk's ``[rows, v]`` buffer: ``v`` rounded up to a
    multiple of ``ROW_STRIDE_MULTIPLE`` (``v`` itself when it is one)."""
    return -(-v // ROW_STRIDE_MULTIPLE) * ROW_STRIDE_MULTIPLE


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def label_block_columns(n: int, h: int) -> int:
    """Columns of ``h`` per block of the label terms' float32 ``[n, columns]`` sums
    (:data:`LABEL_BLOCK_BYTES`)."""
    return max(1, min(h, LABEL_BLOCK_BYTES // (4 * max(n, 1))))


def default_chunk_rows(n: int, v: int, logits_itemsize: int, buffers: int = 1, nbytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk so the chunk's ``[rows, V]`` buffers take about ``nbytes``."""
    rows = nbytes // (v * logits_itemsize * buffers)
    rows = max(ROW_MULTIPLE, rows // ROW_MULTIPLE * ROW_MULTIPLE)
    return max(1, min(rows, n))


def plan_chunks(
    n: int, v: int, logits_itemsize: int, chunk_size: int | None, teacher_head: bool = False, blocks: bool = False
) -> Plan:
    """Cut ``n`` rows into chunks; the kernels' in-chunk offsets then fit in 32 bits. A teacher
    head holds a second ``[rows, V]`` buffer: made in blocks of rows (``blocks``), it takes at
    most ``TEACHER_BLOCK_BYTES``; else the chunk is one block and both buffers share
    ``CHUNK_BYTES``. ``chunk_size`` sets the chunk's rows, and caps a block's."""
    whole = teacher_head and not blocks
    rows = chunk_size if chunk_size is not None else default_chunk_rows(n, v, logits_itemsize, 1 + whole)
    rows = max(1, min(rows, n, INT32_MAX // v))
    bounds = tuple((s, min(s + rows, n)) for s in range(0, n, rows))
    block_rows = rows
    if teacher_head and blocks:
        block_rows = min(rows, default_chunk_rows(n, v, logits_itemsize, nbytes=TEACHER_BLOCK_BYTES))
    block_v = min(MAX_BLOCK_V, next_power_of_2(v))
    cols = min(block_v, TILE_COLS)
    return Plan(chunk_rows=rows, tile=(block_v // cols, cols), bounds=bounds, block_rows=block_rows)
