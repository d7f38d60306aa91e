"""The label rows of ``grad_weight``, each label's rows summed in float32 and rounded into its row
once, whatever the runs' lengths and where they fall among the kernels' tiles of rows and runs:
``torch_kl``'s ``triton_factored.add_label_rows`` (in Triton's interpreter and, compiled, on the
GPU) and ``jax_kl``'s (``jax_kl.gemm.add_label_rows`` by XLA, and the Mosaic GPU kernel
``mosaic_label_rows`` on the GPU)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fused_kl.chunk import LabelTerm
from torch_kl.backends import triton_factored

_JAX = pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.gpu),
    pytest.param("jax-xla", marks=_JAX),
    pytest.param("jax-mosaic", marks=[_JAX, pytest.mark.gpu]),
]


def _add_jax(grad_w: torch.Tensor, x: torch.Tensor, coef: torch.Tensor, y: torch.Tensor, mosaic: bool) -> torch.Tensor:
    """``grad_w`` after ``jax_kl``'s label rows: XLA's, or the Mosaic GPU kernel's on the columns
    padded with zeros to a multiple of its warpgroup (``fits``)."""
    import jax.numpy as jnp
    import numpy as np

    from jax_kl import gemm
    from jax_kl.backends import mosaic_label_rows

    def as_jax(t: torch.Tensor, pad: int = 0) -> jnp.ndarray:
        t = torch.nn.functional.pad(t, (0, pad)) if pad else t
        return jnp.asarray(t.float().numpy()).astype(str(t.dtype).removeprefix("torch."))

    h = x.shape[1]
    pad = -h % mosaic_label_rows.THREADS if mosaic else 0
    acc, xs = as_jax(grad_w, pad), as_jax(x.contiguous(), pad)
    label = LabelTerm(jnp.asarray(coef.numpy()), jnp.asarray(y.numpy()))
    if mosaic:
        assert mosaic_label_rows.fits(acc, xs)
        out = mosaic_label_rows.add_label_rows(acc, xs, label)
    else:
        out = gemm.add_label_rows(acc, xs, label)
    return torch.from_numpy(np.array(out[:, :h].astype(jnp.float32))).to(grad_w.dtype)


def _add(grad_w: torch.Tensor, x: torch.Tensor, coef: torch.Tensor, y: torch.Tensor, device: str) -> torch.Tensor:
    """``grad_w`` after ``add_label_rows`` on ``device`` (``jax-*``: ``jax_kl``'s), back on the CPU."""
    if device.startswith("jax-"):
        return _add_jax(grad_w, x, coef, y, device == "jax-mosaic")
    got = grad_w.to(device, copy=True)
    label = triton_factored.LabelTerm(coef.to(device), y.to(device))
    triton_factored.add_label_rows(got, x.to(device), label)
    return got.cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_the_label_rows_are_summed_in_float32_and_rounded_once(device):
    """Rows sharing a label (here 40 rows of label 3) are summed before their one rounding into
    ``grad_w``; rows with no term (``coef = 0``) and other labels add nothing there. Their
    bfloat16 sum, rounded 40 times, would be off by far more than one rounding."""
    gen = torch.Generator().manual_seed(6)
    rows, v, h = 64, 10, 48
    x = torch.randn(rows, h, generator=gen).to(torch.bfloat16)
    y = torch.randint(0, v, (rows,), generator=gen)
    y[:40] = 3
    coef = -torch.rand(rows, generator=gen) / rows
    coef[40:44] = 0.0  # ignored rows, a label outside the slice
    grad_w = torch.randn(v, h, generator=gen).to(torch.bfloat16) * 1e-3
    want = grad_w.double().index_add(0, y, coef.double()[:, None] * x.double())
    got = _add(grad_w, x, coef, y, device)
    ulp = want.abs() * 2.0**-7  # one rounding of the sum (Triton's interpreter truncates: a whole ulp)
    assert ((got.double() - want).abs() <= ulp + 1e-12).all()
    untouched = torch.ones(v, dtype=torch.bool)
    untouched[y[coef != 0]] = False
    assert torch.equal(got[untouched], grad_w[untouched])


@pytest.mark.parametrize("device", DEVICES)
def test_a_label_most_rows_share_is_summed_in_blocks_of_rows(device):
    """300 rows of one label (many tiles of rows), the rest alone: each label's rows summed once."""
    gen = torch.Generator().manual_seed(10)
    rows, v, h = 331, 7, 300
    x = torch.randn(rows, h, generator=gen).to(torch.bfloat16)
    y = torch.full((rows,), 2)
    y[300:] = torch.tensor([0, 1, 3, 4, 5, 6] * 6)[:31]
    coef = -torch.rand(rows, generator=gen) / rows
    got = _add(torch.zeros(v, h, dtype=torch.float32), x, coef, y, device)
    terms = coef.double()[:, None] * x.double()
    want = torch.zeros(v, h, dtype=torch.float64).index_add(0, y, terms)
    # The bound is float32's rounding (6e-8) of the sum of |terms| (the sum itself may cancel)
    # times 16, well above what the kernel's order of summation errs by; a dropped row moves
    # its columns by ~1/300 of that sum.
    size = torch.zeros(v, h, dtype=torch.float64).index_add(0, y, terms.abs())
    assert ((got.double() - want).abs() <= 1e-6 * size).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [0, 5, 15, 16, 17])
def test_a_label_run_starting_anywhere_among_the_sorted_rows(offset, device):
    """A run of 37 rows of one label (more than two of the kernel's 16-row tiles) starting
    ``offset`` rows past a multiple of 16 among the rows sorted by label is summed whole into its
    row; labels of a few rows around it too, ignored rows (``coef = 0``) add nothing; x through strides."""
    gen = torch.Generator().manual_seed(11 + offset)
    rows, v, h, run = 150, 60, 40, 37
    below = 32 + offset  # rows labelled below the run: where it starts once sorted
    y = torch.cat([torch.randint(0, 30, (below,), generator=gen), torch.full((run,), 30),
                   torch.randint(31, v, (rows - below - run,), generator=gen)])  # fmt: skip
    coef = -torch.rand(rows, generator=gen)
    coef[below + run :: 5] = 0.0  # ignored rows, sorted past every label
    shuffle = torch.randperm(rows, generator=gen)
    y, coef = y[shuffle], coef[shuffle]
    x = torch.randn(h, rows, generator=gen).t()  # not contiguous
    grad_w = torch.randn(v, h, generator=gen)
    want = grad_w.double().index_add(0, y, coef.double()[:, None] * x.double())
    got = _add(grad_w, x, coef, y, device)  # .to keeps x's strides
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES[1:])
@pytest.mark.parametrize("acc_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("zipf", [False, True])
def test_labels_of_text_and_random_labels_are_summed_once(zipf, acc_dtype, device):
    """Labels drawn at random over an odd vocabulary, or as a text's (Zipf's law: a few labels
    take many rows, most one), 300 rows, not a whole number of the kernels' tiles of rows or
    runs: every labelled row of ``grad_w`` is its sum rounded once, the others untouched."""
    gen = torch.Generator().manual_seed(12)
    rows, v, h = 300, 1001, 512
    if zipf:
        p = 1.0 / torch.arange(1, v + 1, dtype=torch.float64) ** 1.1
        y = torch.multinomial(p, rows, replacement=True, generator=gen)
    else:
        y = torch.randint(0, v, (rows,), generator=gen)
    coef = -torch.rand(rows, generator=gen)
    coef[::7] = 0.0
    x = torch.randn(rows, h, generator=gen).to(torch.bfloat16)
    grad_w = (torch.randn(v, h, generator=gen) * 10).to(acc_dtype)
    want = grad_w.double().index_add(0, y, coef.double()[:, None] * x.double())
    got = _add(grad_w, x, coef, y, device).double()
    ulp = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-23}[acc_dtype]  # half a unit (float32: its sums too)
    assert ((got - want).abs() <= ulp * want.abs() + 1e-5).all()
    untouched = torch.ones(v, dtype=torch.bool)
    untouched[y[coef != 0]] = False
    assert torch.equal(got[untouched], grad_w[untouched].double())


@pytest.mark.parametrize("device", DEVICES)
def test_rows_of_no_term_add_nothing_whatever_their_values(device):
    """Rows of ``coef`` 0 (ignored, or labelled outside the slice), sorted after every label, hold
    infinities and NaNs: no labelled row, the last run's included, takes any of them."""
    gen = torch.Generator().manual_seed(13)
    rows, v, h = 40, 9, 128
    x = torch.randn(rows, h, generator=gen).to(torch.bfloat16)
    y = torch.randint(0, v, (rows,), generator=gen)
    coef = -torch.rand(rows, generator=gen)
    coef[::3] = 0.0
    x[::3, ::2], x[::3, 1::2] = float("inf"), float("nan")
    grad_w = torch.randn(v, h, generator=gen)
    want = grad_w.double().index_add(0, y[coef != 0], coef.double()[coef != 0, None] * x.double()[coef != 0])
    torch.testing.assert_close(_add(grad_w, x, coef, y, device).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
def test_the_mosaic_kernel_runs_cover_each_labelled_row_once():
    """``mosaic_label_rows.runs``: the rows sorted by label, cut into one run a label, cover every
    row of a term exactly once, each run's rows of its label, in runs padded to whole programs."""
    import jax.numpy as jnp
    import numpy as np

    from jax_kl.backends import mosaic_label_rows

    rng = np.random.default_rng(3)
    n, v = 203, 50
    y = rng.integers(0, v, n)
    y[:60] = 7
    coef = -rng.random(n).astype(np.float32)
    coef[::9] = 0.0
    order, sorted_coef, start, length, key = map(
        np.asarray, mosaic_label_rows.runs(LabelTerm(jnp.asarray(coef), jnp.asarray(y)), v)
    )
    assert len(start) % mosaic_label_rows.RUNS == 0 and len(start) >= n
    covered = np.concatenate([order[s : s + c] for s, c in zip(start, length, strict=True)])
    assert sorted(covered) == sorted(np.flatnonzero(coef))  # each row of a term once, no other
    for s, c, k in zip(start, length, key, strict=True):
        assert (y[order[s : s + c]] == k).all()
    assert len(set(key[length > 0])) == int((length > 0).sum())  # one run a label
    assert ((key >= 0) & (key < v)).all()  # every run's row, an empty run's too, is one the kernel may read
    np.testing.assert_array_equal(sorted_coef, coef[order])


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
def test_the_mosaic_kernel_takes_what_it_can_launch():
    """``mosaic_label_rows.fits``: 16- or 32-bit floats, ``H`` a multiple of its warpgroup, at
    most ``MAX_ROWS`` rows (its grid's axis); the rest is left to XLA's form."""
    import jax
    import jax.numpy as jnp

    from jax_kl.backends import mosaic_label_rows

    def fits(n: int, h: int = 256, acc=jnp.bfloat16, x=jnp.bfloat16, v: int = 1001) -> bool:
        return mosaic_label_rows.fits(jax.ShapeDtypeStruct((v, h), acc), jax.ShapeDtypeStruct((n, h), x))

    assert fits(300) and fits(300, 384, jnp.float32) and fits(mosaic_label_rows.MAX_ROWS, x=jnp.float16)
    assert not fits(mosaic_label_rows.MAX_ROWS + 1)
    assert not fits(300, 200) and not fits(300, v=0)
    assert not fits(300, x=jnp.float8_e4m3fn) and not fits(300, acc=jnp.float64)
