"""The framework-neutral chunk plan and scales that both packages use."""

from __future__ import annotations

import numpy as np
import pytest

from fused_kl.plan import CHUNK_BYTES, INT32_MAX, kernel_scales, plan_chunks, reduction_scale


@pytest.mark.parametrize(
    "n, v, chunk_size",
    [(8192, 128256, None), (10, 7, 3), (1, 1, None), (5, 4099, 100), (0, 33, None), (17000, 128256, None)],
)
def test_chunks_cover_the_rows_in_order(n: int, v: int, chunk_size: int | None) -> None:
    plan = plan_chunks(n, v, 2, chunk_size)
    starts = [s for s, _ in plan.bounds]
    stops = [e for _, e in plan.bounds]
    assert starts == [0, *stops[:-1]][: len(starts)] and (stops[-1] if stops else 0) == n
    assert all(0 < e - s <= plan.chunk_rows for s, e in plan.bounds)
    assert plan.chunk_rows * v <= INT32_MAX  # in-chunk offsets fit in 32 bits


def test_default_chunk_of_the_llama_head() -> None:
    plan = plan_chunks(8192, 128256, 2, None)
    assert plan.chunk_rows == 3072 and plan.chunk_rows * 128256 * 2 <= CHUNK_BYTES
    assert len(plan.bounds) == 3


@pytest.mark.parametrize(
    "v, tile", [(128256, (32, 128)), (4099, (32, 128)), (1423, (16, 128)), (300, (4, 128)), (17, (1, 32)), (1, (1, 1))]
)
def test_tile_shape(v: int, tile: tuple[int, int]) -> None:
    assert plan_chunks(4, v, 2, None).tile == tile


@pytest.mark.parametrize(
    "kept, reduction, want",
    [(4.0, "sum", 1.0), (4.0, "batchmean", 0.25), (4.0, "mean", 0.05), (0.0, "mean", 0.0), (0.0, "sum", 0.0)],
)
def test_reduction_scale(kept: float, reduction: str, want: float) -> None:
    assert float(reduction_scale(np.float32(kept), reduction, 5)) == pytest.approx(want)


def test_float16_scales_are_a_power_of_two_apart() -> None:
    scales, unscale = kernel_scales(np.float32(3000.0), "batchmean", 5, True, np)
    assert float(unscale) == 2.0**-12 and float(scales[1]) == float(scales[0]) / 2.0**-12
    scales, unscale = kernel_scales(np.float32(3000.0), "batchmean", 5, False, np)
    assert unscale is None and scales[0] == scales[1]
