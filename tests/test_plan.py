"""The framework-neutral core: chunk plan, reduction and float16 scales, and its imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from fused_kl.loss import Loss
from fused_kl.plan import CHUNK_BYTES, INT32_MAX, TEACHER_BLOCK_BYTES, plan_chunks
from fused_kl.rowmath import float16_unscale, loss_weights, reduction_scale


@pytest.mark.parametrize(
    "n, v, chunk_size",
    [(8192, 128256, None), (10, 7, 3), (1, 1, None), (5, 4099, 100), (0, 33, None), (17000, 128256, None)],
)
@pytest.mark.parametrize("teacher_head, blocks", [(False, False), (True, False), (True, True)])
def test_chunks_cover_the_rows_in_order(
    n: int, v: int, chunk_size: int | None, teacher_head: bool, blocks: bool
) -> None:
    plan = plan_chunks(n, v, 2, chunk_size, teacher_head, blocks)
    starts = [s for s, _ in plan.bounds]
    stops = [e for _, e in plan.bounds]
    assert starts == [0, *stops[:-1]][: len(starts)] and (stops[-1] if stops else 0) == n
    assert all(0 < e - s <= plan.chunk_rows for s, e in plan.bounds)
    assert plan.chunk_rows * v <= INT32_MAX  # in-chunk offsets fit in 32 bits
    for start, stop in plan.bounds:  # each chunk's blocks cover it in order
        rows = [r for a, b in plan.blocks(start, stop) for r in range(a, b)]
        assert rows == list(range(start, stop))
        assert all(0 < b - a <= plan.block_rows for a, b in plan.blocks(start, stop))


def test_default_chunk_of_the_llama_head() -> None:
    plan = plan_chunks(8192, 128256, 2, None)
    assert plan.chunk_rows == 3072 and plan.chunk_rows * 128256 * 2 <= CHUNK_BYTES
    assert len(plan.bounds) == 3


def test_a_teacher_head_halves_the_default_chunk() -> None:
    """Made whole, a teacher head's logits share the chunk's bytes: half the rows, one block."""
    one, two = plan_chunks(8192, 128256, 2, None), plan_chunks(8192, 128256, 2, None, True)
    assert two.chunk_rows == one.chunk_rows // 2 == 1536 == two.block_rows
    assert 2 * two.chunk_rows * 128256 * 2 <= CHUNK_BYTES
    assert plan_chunks(100, 50, 2, 7, True).chunk_rows == 7  # an explicit chunk size is kept


def test_a_teacher_head_in_blocks_keeps_the_chunk() -> None:
    """Made in blocks, a teacher head's logits leave the chunk its rows and take a third of them
    on the llama-3 head: both buffers within 1 GiB."""
    plan = plan_chunks(8192, 128256, 2, None, True, blocks=True)
    assert plan.chunk_rows == 3072 and plan.block_rows == 1024
    assert plan.block_rows * 128256 * 2 <= TEACHER_BLOCK_BYTES
    assert (plan.chunk_rows + plan.block_rows) * 128256 * 2 < 2**30
    assert plan.blocks(6144, 8192) == ((6144, 7168), (7168, 8192))
    assert plan_chunks(100, 50, 2, 7, True, blocks=True).block_rows == 7  # capped by an explicit chunk size
    assert plan_chunks(8192, 128256, 2, None, blocks=True).block_rows == 3072  # no teacher head: one block


@pytest.mark.parametrize(
    "v, tile", [(128256, (32, 128)), (4099, (32, 128)), (1423, (16, 128)), (300, (4, 128)), (17, (1, 32)), (1, (1, 1))]
)
def test_tile_shape(v: int, tile: tuple[int, int]) -> None:
    assert plan_chunks(4, v, 2, None).tile == tile


@pytest.mark.parametrize(
    "kept, reduction, want",
    [(4.0, "sum", 1.0), (4.0, "batchmean", 0.25), (4.0, "mean", 0.05), (0.0, "mean", 0.0), (0.0, "sum", 0.0),
     (0.0, "batchmean", 0.0)],
)
def test_reduction_scale(kept: float, reduction: str, want: float) -> None:
    assert float(reduction_scale(np.float32(kept), reduction, 5)) == pytest.approx(want)


def test_float16_unscale_is_a_clamped_power_of_two() -> None:
    for s, want in ((1 / 3000, 2.0**-12), (1.0, 1.0), (3.0, 1.0), (2.0**-20, 2.0**-14), (0.3, 0.25)):
        assert float(float16_unscale(np.float32(s), np)) == want


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
def test_loss_weights_weigh_the_soft_and_hard_terms(reduction: str) -> None:
    loss = Loss(reduction=reduction, weight_soft=0.5, weight_hard=2.0)
    kept, v = np.float32(4.0), 5
    soft, hard, _, unscale = loss_weights(kept, loss, v, False, np)
    s = {"batchmean": 1 / 4, "sum": 1.0, "mean": 1 / 20}[reduction]
    assert float(soft) == pytest.approx(0.5 * s)
    assert float(hard) == pytest.approx(2.0 * (1.0 if reduction == "sum" else 1 / 4))  # the hard term: per row
    assert unscale is None
    # float16: dL/dz stored divided by the power of two of the larger row weight.
    assert float(loss_weights(kept, loss, v, True, np).unscale) == float(float16_unscale(max(soft, hard), np))
    assert float(loss_weights(np.float32(3000.0), Loss(), v, True, np).unscale) == 2.0**-12


@pytest.mark.parametrize("reduction", ["sum", "mean", "batchmean"])
def test_loss_weights_are_strongly_typed_float32(reduction: str) -> None:
    """A weakly typed scale operand breaks the Pallas kernel's GPU lowering (seen on the H200)."""
    for kept in (jnp.float32(3), jnp.float32(0)):
        for scale in loss_weights(kept, Loss(reduction=reduction, weight_hard=0.5), 5, True, jnp):
            assert scale.dtype == jnp.float32 and not scale.weak_type


def test_importing_fused_kl_loads_no_framework() -> None:
    modules = ["fused_kl", "fused_kl.loss", "fused_kl.options", "fused_kl.checks", "fused_kl.terms",
               "fused_kl.rowmath", "fused_kl.plan", "fused_kl.reference"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "loaded = sorted(m for m in ('torch', 'jax', 'triton') if m in sys.modules)\n"
            + "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
