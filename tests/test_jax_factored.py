"""``jax_kl``'s factored cross-entropy (``jax_kl/factored.py``, ``fused_kl.factored``): ``E`` and the
statistics from one pass, rows out of the window remade, against float64 and against the
unfactored chunks; which calls factor. On CPU the XLA phases' ``exp_stats`` stands in for the
Mosaic GPU kernel (Hopper only), which the GPU test runs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from harness import Outputs, assert_matches, expected, make_inputs, rel_err  # noqa: E402

import jax_kl  # noqa: E402
from fused_kl import factored, rowmath  # noqa: E402
from fused_kl.chunk import VocabPart  # noqa: E402
from fused_kl.loss import Loss, Teacher  # noqa: E402
from jax_kl import factored as jax_factored  # noqa: E402
from jax_kl.backends import resolve, xla_phases  # noqa: E402
from jax_kl.layout import SINGLE  # noqa: E402

FACTORED = replace(resolve("xla"), factored=xla_phases)
CE = Loss(teacher=None, weight_soft=0.0, weight_hard=1.0)
CAPPED = Loss(teacher=None, weight_soft=0.0, weight_hard=1.0, softcap=80.0, logit_scale=1.25)


def _rows_of_every_kind(n: int, h: int, v: int, seed: int = 0):
    """bfloat16 inputs (float64 copies of them) whose rows' largest logits are, by row: ordinary;
    about 60 (above the window); about -50 (below it); about 200 and ignored (``E`` overflows);
    ordinary again. Column 0 of ``W`` is 1, so ``x[:, 0]`` shifts a row."""
    inp = make_inputs(n, h, v, dtype="bfloat16", seed=seed, ignore_frac=0.2)
    x, w, labels = inp.x.copy(), inp.weight.copy(), inp.labels.copy()
    w[:, 0] = 1.0
    x[:, 0] = 0.0
    x[1::5, 0], x[2::5, 0], x[3::5, 0] = 58.0, -52.0, 200.0
    labels[3::5] = -100
    return replace(inp, x=x, weight=w, labels=labels)


def _reference_dz(x: np.ndarray, w: np.ndarray, y: np.ndarray, c_hard: np.ndarray, loss: Loss) -> np.ndarray:
    """``c_hard f'(z) (softmax(f(z)) - onehot(y))`` in float64 from bfloat16-rounded logits."""
    z = np.asarray(jnp.asarray(x @ w.T, jnp.bfloat16).astype(jnp.float32), np.float64) * loss.logit_scale
    f = z if loss.softcap is None else loss.softcap * np.tanh(z / loss.softcap)
    slope = loss.logit_scale * (1.0 if loss.softcap is None else 1.0 - (f / loss.softcap) ** 2)
    q = np.exp(f - f.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    onehot = np.zeros_like(q)
    onehot[np.arange(len(y)), np.maximum(y, 0)] = y >= 0
    return c_hard[:, None] * slope * (q - onehot)


@pytest.mark.parametrize("loss", [CE, CAPPED])
def test_alpha_times_e_plus_the_label_term_is_the_gradient_in_float64(loss: Loss) -> None:
    inp = _rows_of_every_kind(20, 16, 96)
    x, w = jnp.asarray(inp.x, jnp.bfloat16), jnp.asarray(inp.weight, jnp.bfloat16)
    y = jnp.asarray(inp.labels, jnp.int32)
    keep = y != loss.ignore_index
    kept = jnp.sum(keep, dtype=jnp.float32)
    weights, scales, _, labels = rowmath.row_plan(keep, kept, y, None, None, loss, True, 96, False, jnp.sort, jnp)
    z = jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    _, row_max = xla_phases.exp_stats(z, labels, loss)[1:]
    outside = ~np.asarray(factored.in_window(row_max))
    assert outside[1::5].all() and outside[2::5].all() and not outside[0::5].any()  # both kinds of rows
    parts = [VocabPart(z, None, 0, xla_phases)]
    _, fac = jax_factored.chunk(parts, x, w, labels, keep, None, scales, None, 0, 96, weights, loss, SINGLE, True)
    got = np.asarray(fac.alpha, np.float64)[:, None] * np.asarray(fac.e[0].astype(jnp.float32), np.float64)
    rows = np.arange(20)
    coef = np.asarray(fac.label.coef, np.float64)
    np.add.at(got, (rows, np.asarray(fac.label.y)), coef)
    assert np.isfinite(got).all()  # the ignored rows whose E overflowed are zero
    want = _reference_dz(inp.x, inp.weight, inp.labels, np.asarray(scales.hard, np.float64), loss)
    kept_rows = np.asarray(keep)
    assert (got[~kept_rows] == 0).all()
    # bfloat16's rounding of each entry, relative to the row's largest; the remade rows read
    # float32 logits where the reference rounds them to bfloat16, so their tolerance is the
    # rounding of a logit of 50 to 60 (2^-3 in the exponent)
    scale = np.abs(want).max(-1, keepdims=True)
    err = (np.abs(got - want) / np.where(scale > 0, scale, 1.0)).max(-1)
    assert err[~outside].max() < 8e-3
    assert err[outside & kept_rows].max() < 0.2


OPTIONS = {
    "plain": dict(),
    "z-loss, sum": dict(z_loss_weight=1e-3, reduction="sum"),
    "capped, scaled": dict(softcap=30.0, logit_scale=1.5),
    "row weights": dict(row_weight=True),
}


def _counting(monkeypatch) -> list:
    """The calls of the XLA phases' ``exp_stats`` from now on (one per factored chunk traced)."""
    calls = []
    original = xla_phases.exp_stats

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(xla_phases, "exp_stats", counted)
    return calls


@pytest.mark.parametrize("name", list(OPTIONS))
def test_factored_calls_match_float64_and_the_unfactored_chunks(monkeypatch, name: str) -> None:
    options = dict(OPTIONS[name])
    calls = _counting(monkeypatch)
    inp = make_inputs(37, 16, 256, dtype="bfloat16", seed=3, ignore_frac=0.25)
    if options.pop("row_weight", False):
        options["row_weight"] = np.random.default_rng(0).uniform(0.0, 2.0, 37).astype(np.float32)
    x, w = jnp.asarray(inp.x, jnp.bfloat16), jnp.asarray(inp.weight, jnp.bfloat16)
    y = jnp.asarray(inp.labels, jnp.int32)
    rw = options.pop("row_weight", None)

    def loss(x, w, backend):
        return jax_kl.fused_linear_cross_entropy(
            x, w, y, backend=backend, chunk_size=16, row_weight=None if rw is None else jnp.asarray(rw), **options
        )  # fmt: skip

    results = {}
    for label, backend in (("factored", FACTORED), ("unfactored", resolve("xla"))):
        value, (gx, gw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, backend)
        results[label] = Outputs(float(value), *(np.asarray(g.astype(jnp.float32), np.float64) for g in (gx, gw)), None)
    assert len(calls) == 3  # the factored call's three chunks of 16 rows
    reference_options = dict(options, row_weight=rw)
    assert_matches(results["factored"], inp, fn="cross_entropy", **reference_options)
    got, other = results["factored"], results["unfactored"]
    assert got.loss == pytest.approx(other.loss, rel=1e-6)
    for a, b in ((got.grad_x, other.grad_x), (got.grad_weight, other.grad_weight)):
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b)


def test_rows_out_of_the_window_match_float64_end_to_end(monkeypatch) -> None:
    calls = _counting(monkeypatch)
    inp = _rows_of_every_kind(30, 16, 128, seed=5)
    x, w = jnp.asarray(inp.x, jnp.bfloat16), jnp.asarray(inp.weight, jnp.bfloat16)
    y = jnp.asarray(inp.labels, jnp.int32)
    loss = lambda x, w: jax_kl.fused_linear_cross_entropy(x, w, y, backend=FACTORED, chunk_size=8)
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    got = Outputs(float(value), *(np.asarray(g.astype(jnp.float32), np.float64) for g in grads), None)
    assert all(np.isfinite(g).all() for g in grads) and len(calls) == 4
    # the loss reads bfloat16 logits of 50 to 200, rounded by up to 0.5: the reference does not
    assert_matches(got, inp, fn="cross_entropy", tolerance=0.05, grad_tolerance=2e-2)


TOPK = {
    "bin, hard": dict(weight_hard_loss=0.5, logit_scale=1.25),
    "renormalize, T = 2, sum": dict(topk_tail="renormalize", temperature=2.0, reduction="sum"),
    "drop, z-loss": dict(topk_tail="drop", z_loss_weight=1e-3),
    "drop alone": dict(topk_tail="drop"),  # rows whose gradient lies at the teacher's tokens alone
}


@pytest.mark.parametrize("name", list(TOPK))
def test_a_topk_teacher_matches_float64_and_the_unfactored_chunks(monkeypatch, name: str) -> None:
    options = TOPK[name]
    calls = _counting(monkeypatch)
    inp = make_inputs(29, 16, 256, dtype="bfloat16", target_format="topk_log_probs", k=6, pad_frac=0.3, seed=4)
    x, w = jnp.asarray(inp.x, jnp.bfloat16), jnp.asarray(inp.weight, jnp.bfloat16)
    x = x.at[1::7, 0].multiply(60.0)  # rows out of the window: remade
    inp = replace(inp, x=np.asarray(x.astype(jnp.float32), np.float64))
    t, idx, y = jnp.asarray(inp.target), jnp.asarray(inp.target_indices), jnp.asarray(inp.labels)

    def loss(x, w, backend):
        return jax_kl.fused_linear_kl_div(
            x, w, t, y, target_format="topk_log_probs", target_indices=idx, backend=backend, chunk_size=8, **options
        )  # fmt: skip

    results = {}
    for label, backend in (("factored", FACTORED), ("unfactored", resolve("xla"))):
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, backend)
        results[label] = Outputs(float(value), *(np.asarray(g.astype(jnp.float32), np.float64) for g in grads), None)
    assert len(calls) == 4
    # the rows out of the window read bfloat16 logits of up to about 150, rounded by up to 0.5
    assert_matches(results["factored"], inp, tolerance=0.05, grad_tolerance=2e-2, **options)
    got, other = results["factored"], results["unfactored"]
    # XLA's unfactored program may gather the tokens' logits before the GEMM's bfloat16 rounding
    assert got.loss == pytest.approx(other.loss, rel=1e-4)
    want = expected(inp, **options)
    for name in ("grad_x", "grad_weight"):  # the remade rows' float32 logits: closer to float64
        errors = [rel_err(getattr(r, name), getattr(want, name)) for r in (got, other)]
        assert errors[0] <= errors[1] * 1.05, (name, errors)


@pytest.mark.parametrize("teacher", [False, True])
def test_an_unaligned_vocabulary_factors_its_parts_as_one_array(monkeypatch, teacher: bool) -> None:
    """At V = 300 a chunk is its 256 aligned columns and the 44 left (``gemm.vocab_parts``), each
    part's ``E`` from its own pass: the gradients equal those of the whole vocabulary as one
    array up to rounding, labels and teacher tokens in either part, rows out of the window remade
    across both."""
    calls = _counting(monkeypatch)
    fmt = "topk_log_probs" if teacher else "probs"
    inp = make_inputs(24, 16, 300, dtype="bfloat16", target_format=fmt, k=6, seed=8, ignore_frac=0.2)
    xs, ws = inp.x.copy(), inp.weight.copy()
    ws[:, 0], xs[:, 0] = 1.0, 0.0  # x[:, 0] shifts a row: rows 1, 8, ... above the window, 4, 11, ... below it
    xs[1::7, 0], xs[4::7, 0] = 58.0, -52.0
    inp = replace(inp, x=xs, weight=ws)
    x, w = jnp.asarray(inp.x, jnp.bfloat16), jnp.asarray(inp.weight, jnp.bfloat16)
    row_max = np.max(np.asarray(x, np.float64) @ np.asarray(w, np.float64).T, axis=1)
    assert (row_max[1::7] > factored.HI).all() and (row_max[4::7] < factored.LO).all()
    labels = np.where(inp.labels >= 0, np.arange(24) % 2 * 256 + inp.labels % 44, inp.labels)  # half in the tail
    y = jnp.asarray(labels)
    if teacher:
        rng = np.random.default_rng(1)  # distinct tokens per row, three of each even row's in the tail
        idx = np.stack([np.concatenate([rng.choice(256, 6 - 3 * (r % 2 == 0), replace=False),
                                        256 + rng.choice(44, 3 * (r % 2 == 0), replace=False)])
                        for r in range(24)]).astype(inp.target_indices.dtype)  # fmt: skip
        inp = replace(inp, target_indices=idx)
        t = jnp.asarray(inp.target)
        options = dict(weight_hard_loss=0.5, z_loss_weight=1e-3)

        def loss(x, w, backend):
            return jax_kl.fused_linear_kl_div(
                x, w, t, y, target_format=fmt, target_indices=jnp.asarray(idx), backend=backend, chunk_size=8,
                **options,
            )  # fmt: skip
    else:
        options = dict(z_loss_weight=1e-3, logit_scale=1.25)

        def loss(x, w, backend):
            return jax_kl.fused_linear_cross_entropy(x, w, y, backend=backend, chunk_size=8, **options)

    results = {}
    for label, backend in (("parts", FACTORED), ("whole", replace(FACTORED, vocab_parts=False))):
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, backend)
        results[label] = Outputs(float(value), *(np.asarray(g.astype(jnp.float32), np.float64) for g in grads), None)
    assert len(calls) == 3 * 2 + 3  # each part of three chunks, then the whole vocabulary's three
    got, whole = results["parts"], results["whole"]
    assert got.loss == pytest.approx(whole.loss, rel=1e-6)
    for a, b in ((got.grad_x, whole.grad_x), (got.grad_weight, whole.grad_weight)):
        assert np.linalg.norm(a - b) <= 2e-3 * np.linalg.norm(b)
    inp = replace(inp, labels=labels)
    fn = "kl_div" if teacher else "cross_entropy"
    assert_matches(got, inp, fn=fn, tolerance=0.05, grad_tolerance=2e-2, **options)


def test_rows_with_sparse_values_and_no_dense_part_are_zeroed() -> None:
    """``q_factor = 0`` (a top-k row whose factor K vanishes, without the hard term): ``settle``
    zeroes the row's ``E`` and writes its top-k entries alone."""
    rows, v = 10, 128
    inp = _rows_of_every_kind(rows, 16, v, seed=2)
    x, w = jnp.asarray(inp.x, jnp.bfloat16), jnp.asarray(inp.weight, jnp.bfloat16)
    loss = Loss(teacher=Teacher("topk_log_probs", 1.0))
    z = jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    e, stats, row_max = xla_phases.exp_stats(z, None, loss)
    q_factor = jnp.asarray([0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 2.0, 1.0, 0.5, 1.0])
    at = jnp.asarray([[3, 9]] * rows)
    values = jnp.full((rows, 2), -0.25).at[5].set(0.0)  # row 5: no dense part, no sparse value
    mask = jnp.ones((rows, 2), bool)
    parts = [VocabPart(e, None, 0, xla_phases)]
    fac = jax_factored.settle(parts, row_max, stats, q_factor, jnp.zeros(rows), None, loss, (at, values, mask), x, w)
    assert fac.label is None
    g = np.asarray(fac.alpha, np.float64)[:, None] * np.asarray(fac.e[0].astype(jnp.float32), np.float64)
    for r in (0, 2, 3):  # an ordinary row, one below the window and one whose E overflowed
        assert np.count_nonzero(g[r]) == 2 and np.allclose(g[r, [3, 9]], -0.25, rtol=1e-2)
    assert (g[5] == 0).all()
    logits = np.asarray(jnp.dot(x, w.T, preferred_element_type=jnp.float32), np.float64)
    q = np.exp(logits - logits.max(-1, keepdims=True))
    dense = np.asarray(q_factor, np.float64)[:, None] * q / q.sum(-1, keepdims=True)
    dense[:, [3, 9]] = -0.25
    for r in (1, 4, 6, 7, 8, 9):
        assert np.abs(g[r] - dense[r]).max() / np.abs(dense[r]).max() < 2e-2


def test_a_nan_teacher_row_that_is_ignored_leaves_the_gradients_alone() -> None:
    """An ignored top-k row takes none of the teacher's mass ``k``: its NaN log-probabilities reach
    neither ``alpha`` nor the gradients, which equal those of the call with finite ones."""
    inp = make_inputs(16, 16, 128, dtype="bfloat16", target_format="topk_log_probs", k=4, seed=6, ignore_frac=None)
    x, w = jnp.asarray(inp.x, jnp.bfloat16), jnp.asarray(inp.weight, jnp.bfloat16)
    idx, clean = jnp.asarray(inp.target_indices), jnp.asarray(inp.target)
    y = jnp.arange(16).at[2].set(-100)
    rw = jnp.ones(16).at[5].set(0.0)

    def grads(t):
        return jax.grad(
            lambda x, w: jax_kl.fused_linear_kl_div(
                x, w, t, y, target_format="topk_log_probs", target_indices=idx, row_weight=rw, weight_hard_loss=0.5,
                backend=FACTORED,
            ),
            argnums=(0, 1),
        )(x, w)  # fmt: skip

    for got, want in zip(grads(clean.at[2].set(jnp.nan)), grads(clean), strict=True):
        assert np.isfinite(np.asarray(got, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def _exp_stats_calls(monkeypatch, backend, x, w, y, **options) -> int:
    calls = _counting(monkeypatch)
    jax.grad(lambda x: jax_kl.fused_linear_cross_entropy(x, w, y, backend=backend, chunk_size=8, **options))(x)
    return len(calls)


@pytest.mark.parametrize(
    ("dtype", "options", "factors"),
    [
        ("bfloat16", {}, True),
        ("bfloat16", {"z_loss_weight": 1e-3}, True),
        ("bfloat16", {"label_smoothing": 0.1}, False),  # -eps/V is not a multiple of q
        ("bfloat16", {"bias": True}, False),
        ("float16", {}, False),  # E needs bfloat16's range
        ("float32", {}, False),
    ],
)
def test_which_calls_factor(monkeypatch, dtype: str, options: dict, factors: bool) -> None:
    options = dict(options)
    x = jnp.ones((16, 8), dtype)
    w = jnp.asarray(np.random.default_rng(0).standard_normal((64, 8)), dtype)
    if options.pop("bias", False):
        options["bias"] = jnp.zeros(64, dtype)
    y = jnp.arange(16) % 64
    assert _exp_stats_calls(monkeypatch, FACTORED, x, w, y, **options) == (2 if factors else 0)
    assert _exp_stats_calls(monkeypatch, resolve("xla"), x, w, y, **options) == 0  # only where the backend factors


def test_a_kl_call_does_not_factor(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(xla_phases, "exp_stats", lambda *a: calls.append(1))
    inp = make_inputs(8, 8, 64, dtype="bfloat16", target_format="logits")
    x, w = jnp.asarray(inp.x, jnp.bfloat16), jnp.asarray(inp.weight, jnp.bfloat16)
    t, y = jnp.asarray(inp.target), jnp.asarray(inp.labels)
    jax.grad(lambda x: jax_kl.fused_linear_kl_div(x, w, t, y, target_format="logits", backend=FACTORED))(x)
    assert not calls


@pytest.mark.gpu
@pytest.mark.parametrize("teacher", [False, True])
@pytest.mark.parametrize(("n", "v"), [(1000, 32000), (4096, 32000), (1000, 32003)])
def test_on_the_gpu_the_mosaic_pass_matches_the_unfactored_chunks(n: int, v: int, teacher: bool) -> None:
    """At V = 32003 the aligned part runs the Mosaic GPU pass and the three columns left XLA's."""
    if jax.default_backend() != "gpu" or resolve("pallas").factored is None:
        pytest.skip("the Mosaic GPU kernels need a Hopper GPU and jax >= 0.11")
    key = jax.random.split(jax.random.key(0), 4)
    h, k = 1024, 64
    x = jax.random.normal(key[0], (n, h), jnp.bfloat16)
    w = (jax.random.normal(key[1], (v, h)) * 0.05).astype(jnp.bfloat16)
    x = x.at[7, :].multiply(40.0)  # a row above the window: remade
    y = jax.random.randint(key[2], (n,), 0, v).at[::7].set(-100)
    log_p, idx = jax.lax.top_k(jax.nn.log_softmax(jax.random.normal(key[3], (n, v)) * 3.0), k)

    def loss(x, w, backend):
        if not teacher:
            return jax_kl.fused_linear_cross_entropy(x, w, y, backend=backend, chunk_size=512)
        return jax_kl.fused_linear_kl_div(
            x, w, log_p, y, target_format="topk_log_probs", target_indices=idx, weight_hard_loss=0.5, backend=backend,
            chunk_size=512,
        )  # fmt: skip

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    pallas = resolve("pallas")
    (a, ga), (b, gb) = step(x, w, pallas), step(x, w, replace(pallas, factored=None))
    assert float(a) == pytest.approx(float(b), rel=1e-4)
    for p, q in zip(ga, gb, strict=True):
        p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
        assert np.isfinite(p).all() and np.linalg.norm(p - q) <= 2e-2 * np.linalg.norm(q)
