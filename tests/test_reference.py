"""The float64 reference (fused_kl.reference) against independent closed forms: NumPy formulas,
docs/contract.md's gradient tables, torch.nn.functional, and finite differences."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fused_kl.reference import Expected, reference, reference_cross_entropy

EPS = 1e-10


def _log_softmax(a: np.ndarray) -> np.ndarray:
    m = a.max(-1, keepdims=True)
    return a - m - np.log(np.exp(a - m).sum(-1, keepdims=True))


def _problem(n=6, h=5, v=7, seed=0, bias=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h))
    w = rng.standard_normal((v, h)) * 0.7
    b = rng.standard_normal(v) * 0.3 if bias else None
    return rng, x, w, b


def _logits(x, w, b):
    return x @ w.T + (0 if b is None else b)


def _scale(reduction, n, v):
    return {"batchmean": 1 / n, "sum": 1.0, "mean": 1 / (n * v)}[reduction]


def _check(e: Expected, loss, g_z, x, w, b, tol=1e-10):
    """``g_z`` is dL/dz [N, V]; the gradients follow from it."""
    assert e.loss == pytest.approx(loss, rel=tol, abs=tol)
    np.testing.assert_allclose(e.grad_x, (g_z @ w).reshape(np.shape(e.grad_x)), rtol=tol, atol=tol)
    np.testing.assert_allclose(e.grad_weight, g_z.T @ x.reshape(-1, x.shape[-1]), rtol=tol, atol=tol)
    if b is not None:
        np.testing.assert_allclose(e.grad_bias, g_z.sum(0), rtol=tol, atol=tol)


def _truncated_probs(rng, n, v):
    p = np.exp(_log_softmax(rng.standard_normal((n, v)) * 2))
    p[rng.random((n, v)) < 0.3] = 0.0  # truncated: rows sum to < 1, with zeros
    p[0] = 0.0
    p[0, 2] = 0.6
    return p


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
@pytest.mark.parametrize("fmt", ["probs", "log_probs", "logits"])
def test_forward_kl_closed_form(fmt, reduction):
    rng, x, w, b = _problem(n=8)
    n, v, temp = 8, w.shape[0], 1.7
    labels = np.array([3, -100, 1, 0, -100, 2, 5, 6])
    keep = labels != -100
    if fmt == "logits":
        target = rng.standard_normal((n, v)) * 3
        log_p = _log_softmax(target / 0.8)
        p = np.exp(log_p)
        kw = {"teacher_temperature": 0.8}
    else:
        p = _truncated_probs(rng, n, v)
        with np.errstate(divide="ignore"):
            target = p if fmt == "probs" else np.log(p)
        log_p = np.log(np.maximum(p, EPS))
        kw = {}
    log_q = _log_softmax(_logits(x, w, b) / temp)
    s = _scale(reduction, keep.sum(), v)
    terms = np.where(p > 0, p * (log_p - log_q), 0.0)
    loss = s * terms[keep].sum()
    g = np.where(keep[:, None], s * (np.exp(log_q) * p.sum(-1, keepdims=True) - p) / temp, 0.0)
    e = reference(x.reshape(2, 4, -1), w, target.reshape(2, 4, -1), labels.reshape(2, 4), bias=b,
                  reduction=reduction, temperature=temp, target_format=fmt, **kw)
    assert e.grad_x.shape == (2, 4, x.shape[1])
    _check(e, loss, g, x, w, b)


@pytest.mark.filterwarnings("ignore:reduction. 'mean' divides")
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
@pytest.mark.parametrize("log_target", [False, True])
def test_equals_torch_kl_div(log_target, reduction):
    rng, x, w, b = _problem()
    p = _truncated_probs(rng, *_logits(x, w, b).shape)
    if log_target:  # torch's kl_div makes exp(-inf) * -inf NaN, so no zeros here: rows still sum to < 1
        p = np.where(p > 0, p, 1e-3) * 0.8
    target = np.log(p) if log_target else p
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    log_q = torch.log_softmax((xt @ wt.T + bt) / 2.0, -1)
    loss = F.kl_div(log_q, torch.tensor(target), reduction=reduction, log_target=log_target)
    grads = torch.autograd.grad(loss, (xt, wt, bt))
    e = reference(xt, wt, torch.tensor(target), bias=bt, reduction=reduction, temperature=2.0,
                  target_format="log_probs" if log_target else "probs")
    assert isinstance(e.grad_x, torch.Tensor)
    assert e.loss == pytest.approx(loss.item(), rel=1e-12, abs=1e-14)
    for got, want in zip((e.grad_x, e.grad_weight, e.grad_bias), grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("transform", [{}, {"logit_scale": 0.7, "softcap": 2.5}])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_equals_torch(reduction, smoothing, transform):
    _, x, w, b = _problem(n=6)
    labels = np.array([[3, -1, 0], [6, 2, -1]])
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x.reshape(2, 3, -1), w, b))
    z = (xt @ wt.T + bt) * transform.get("logit_scale", 1.0)
    if "softcap" in transform:
        z = transform["softcap"] * torch.tanh(z / transform["softcap"])
    loss = F.cross_entropy(z.reshape(6, -1), torch.tensor(labels).reshape(-1), ignore_index=-1,
                           label_smoothing=smoothing, reduction=reduction)
    grads = torch.autograd.grad(loss, (xt, wt, bt))
    e = reference_cross_entropy(x.reshape(2, 3, -1), w, labels, bias=b, reduction=reduction, ignore_index=-1,
                                label_smoothing=smoothing, **transform)
    assert isinstance(e.grad_x, np.ndarray)
    assert e.loss == pytest.approx(loss.item(), rel=1e-12)
    for got, want in zip((e.grad_x, e.grad_weight, e.grad_bias), grads, strict=True):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-14)


def _np_divergence(x, w, b, p, log_p, beta, temp=1.0):
    """Row losses straight from the contract's beta table; ``log_p`` floored where the format floors."""
    log_q = _log_softmax(_logits(x, w, b) / temp)
    q = np.exp(log_q)
    if beta == 1:
        return (q * (log_q - log_p)).sum(-1)
    m = beta * p + (1 - beta) * q
    with np.errstate(divide="ignore", invalid="ignore"):
        fwd = np.where(p > 0, p * (log_p - np.log(m)), 0.0).sum(-1)
    return beta * fwd + (1 - beta) * (q * (log_q - np.log(m))).sum(-1)


def _finite_differences(f, arrays, h=1e-6):
    out = []
    for a in arrays:
        g = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            old = a[i]
            a[i] = old + h
            up = f()
            a[i] = old - h
            down = f()
            a[i] = old
            g[i] = (up - down) / (2 * h)
        out.append(g)
    return out


@pytest.mark.parametrize("beta", [0.5, 1.0, 0.3])
@pytest.mark.parametrize("fmt", ["probs", "logits"])
def test_reverse_kl_and_jsd_vs_numpy_and_finite_differences(fmt, beta):
    rng, x, w, b = _problem(n=4, h=3, v=5, seed=1)
    labels = np.array([1, -100, 0, 4])
    keep = labels != -100
    if fmt == "probs":
        target = _truncated_probs(rng, 4, 5)
        p, log_p = target, np.log(np.maximum(target, EPS))
    else:
        target = rng.standard_normal((4, 5)) * 2
        log_p = _log_softmax(target / 1.3)
        p = np.exp(log_p)

    def loss():
        return _np_divergence(x, w, b, p, log_p, beta, temp=1.3)[keep].sum() / keep.sum()

    e = reference(x, w, target, labels, bias=b, temperature=1.3, target_format=fmt, beta=beta)
    assert e.loss == pytest.approx(loss(), rel=1e-12)
    gx, gw, gb = _finite_differences(loss, [x, w, b])
    for got, want in zip((e.grad_x, e.grad_weight, e.grad_bias), (gx, gw, gb), strict=True):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


def _topk_problem(seed=2):
    rng, x, w, b = _problem(n=5, h=4, v=9, seed=seed)
    n, v, k = 5, 9, 4
    log_p_full = _log_softmax(rng.standard_normal((n, v)) * 2)
    idx = np.stack([rng.permutation(v)[:k] for _ in range(n)])
    target = np.take_along_axis(log_p_full, idx, 1)
    target[1, -1] = -np.inf  # padding: that token is off S
    return x, w, b, target, idx


@pytest.mark.parametrize("tail", ["bin", "renormalize", "drop"])
def test_topk_gradient_table(tail):
    x, w, b, target, idx = _topk_problem()
    n, v = target.shape[0], w.shape[0]
    labels = np.array([0, 1, -100, 3, 4])
    keep = labels != -100
    temp = 1.4
    log_q = _log_softmax(_logits(x, w, b) / temp)
    q = np.exp(log_q)
    p = np.zeros((n, v))
    np.put_along_axis(p, idx, np.exp(target), 1)
    in_s = p > 0
    big_p, big_q = p.sum(-1, keepdims=True), np.where(in_s, q, 0).sum(-1, keepdims=True)
    assert np.all(big_p < 1) and not in_s[1, idx[1, -1]]
    with np.errstate(divide="ignore", invalid="ignore"):
        head = np.where(in_s, p * (np.log(p) - log_q), 0.0)
    p_t, q_t = np.maximum(1 - big_p, 0), 1 - big_q
    if tail == "bin":
        rows = head.sum(-1) + (p_t * (np.log(p_t) - np.log(q_t)))[:, 0]
        g = np.where(in_s, q - p, q * (1 - p_t / q_t))
    elif tail == "renormalize":
        p_hat = p / big_p
        with np.errstate(divide="ignore", invalid="ignore"):
            rows = np.where(in_s, p_hat * (np.log(p_hat) - log_q), 0.0).sum(-1)
        g = q - p_hat
    else:
        rows = head.sum(-1)
        g = big_p * q - p
    s = 1 / keep.sum()
    g = np.where(keep[:, None], g * s / temp, 0.0)
    e = reference(x, w, target, labels, bias=b, temperature=temp, target_format="topk_log_probs",
                  target_indices=idx, topk_tail=tail)
    _check(e, s * rows[keep].sum(), g, x, w, b)


@pytest.mark.parametrize("tail", ["drop", "bin", "renormalize"])
def test_topk_with_all_tokens_equals_dense_log_probs(tail):
    rng, x, w, b = _problem(n=5, h=4, v=6, seed=3)
    log_p = _log_softmax(rng.standard_normal((5, 6)) * 2)
    idx = np.stack([rng.permutation(6) for _ in range(5)])
    topk = np.take_along_axis(log_p, idx, 1)
    labels = np.array([1, -100, 2, 3, 0])
    dense = reference(x, w, log_p, labels, bias=b, target_format="log_probs", reduction="sum", temperature=0.9)
    e = reference(x, w, topk, labels, bias=b, target_format="topk_log_probs", target_indices=idx, topk_tail=tail,
                  reduction="sum", temperature=0.9)
    assert e.loss == pytest.approx(dense.loss, rel=1e-9, abs=1e-12)
    for got, want in zip((e.grad_x, e.grad_weight, e.grad_bias), (dense.grad_x, dense.grad_weight, dense.grad_bias),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_hidden_equals_logits_precomputed(beta):
    rng, x, w, b = _problem(n=6, seed=4)
    hid, tw, tb = rng.standard_normal((6, 3)), rng.standard_normal((7, 3)), rng.standard_normal(7)
    kw = dict(bias=b, beta=beta, temperature=1.2, teacher_temperature=0.7, teacher_logit_scale=1.3,
              teacher_softcap=4.0, weight_hard_loss=0.4, label_smoothing=0.1)
    labels = np.array([0, -100, 6, 5, 1, 2])
    hidden = reference(x, w, hid, labels, target_format="hidden", teacher_weight=tw, teacher_bias=tb, **kw)
    logits = reference(x, w, hid @ tw.T + tb, labels, target_format="logits", **kw)
    assert hidden.loss == pytest.approx(logits.loss, rel=1e-13)
    np.testing.assert_allclose(hidden.grad_weight, logits.grad_weight, rtol=1e-13, atol=1e-15)
    # and the teacher transform is the materialised one: the logits format with u~ precomputed, scale 1, no cap
    u = 4.0 * np.tanh(1.3 * (hid @ tw.T + tb) / 4.0)
    plain = reference(x, w, u, labels, target_format="logits", **{**kw, "teacher_logit_scale": 1.0,
                                                                     "teacher_softcap": None})
    assert hidden.loss == pytest.approx(plain.loss, rel=1e-13)


@pytest.mark.parametrize("fmt", ["probs", "logits"])
def test_student_transform_closed_form(fmt):
    rng, x, w, b = _problem(n=6, seed=5)
    scale, cap, temp = 1.8, 1.5, 1.1
    z = _logits(x, w, b)
    th = np.tanh(scale * z / cap)
    log_q = _log_softmax(cap * th / temp)
    if fmt == "probs":
        target = p = _truncated_probs(rng, 6, 7)
        log_p = np.log(np.maximum(p, EPS))
    else:
        target = rng.standard_normal((6, 7))
        log_p = _log_softmax(target / temp)
        p = np.exp(log_p)
    s = 1 / 6
    loss = s * np.where(p > 0, p * (log_p - log_q), 0.0).sum()
    g = s * (np.exp(log_q) * p.sum(-1, keepdims=True) - p) / temp * scale * (1 - th**2)
    e = reference(x, w, target, bias=b, temperature=temp, target_format=fmt, logit_scale=scale, softcap=cap)
    _check(e, loss, g, x, w, b)


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
def test_soft_plus_hard_is_the_weighted_sum(reduction):
    rng, x, w, b = _problem(n=6, seed=6)
    target = rng.standard_normal((6, 7))
    labels = np.array([0, -100, 6, 5, -100, 2])
    kw = dict(bias=b, reduction=reduction, target_format="logits", temperature=2.0, logit_scale=0.9, softcap=3.0)
    both = reference(x, w, target, labels, weight_soft_loss=0.3, weight_hard_loss=0.7, label_smoothing=0.1, **kw)
    soft = reference(x, w, target, labels, **kw)
    hard = reference_cross_entropy(x, w, labels, bias=b, reduction="sum" if reduction == "sum" else "mean",
                                   label_smoothing=0.1, logit_scale=0.9, softcap=3.0)
    assert both.loss == pytest.approx(0.3 * soft.loss + 0.7 * hard.loss, rel=1e-13)
    for name in ("grad_x", "grad_weight", "grad_bias"):
        want = 0.3 * getattr(soft, name) + 0.7 * getattr(hard, name)
        np.testing.assert_allclose(getattr(both, name), want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"beta": 0.5, "weight_hard_loss": 1.0, "label_smoothing": 0.1},
        {"target_format": "topk_log_probs", "topk_tail": "bin"},
        {"target_format": "logits", "beta": 1.0, "reduction": "mean", "softcap": 2.0},
    ],
)
@pytest.mark.parametrize("rows", [0, 3])
def test_no_kept_rows_gives_exact_zeros(rows, kw):
    rng, x, w, b = _problem(n=rows, seed=7)
    if kw.get("target_format") == "topk_log_probs":
        target, extra = np.zeros((rows, 2)), {"target_indices": np.tile([0, 1], (rows, 1))}
    else:
        target, extra = rng.random((rows, 7)), {}
    e = reference(x, w, target, np.full(rows, -100), bias=b, **kw, **extra)
    assert e.loss == 0.0
    for g, a in zip((e.grad_x, e.grad_weight, e.grad_bias), (x, w, b), strict=True):
        assert g.shape == a.shape and np.all(g == 0)
    ce = reference_cross_entropy(x, w, np.full(rows, 7), ignore_index=7)
    assert ce.loss == 0.0 and np.all(ce.grad_weight == 0) and ce.grad_bias is None


def test_numpy_and_torch_inputs_agree():
    rng, x, w, b = _problem(n=6, seed=8)
    x32, w32, b32 = (a.astype(np.float32) for a in (x, w, b))
    target = rng.standard_normal((6, 7)).astype(np.float32)
    labels = np.array([0, -100, 6, 5, 1, 2])
    kw = dict(target_format="logits", beta=0.5, weight_hard_loss=0.5, label_smoothing=0.05, temperature=1.5)
    from_np = reference(x32.reshape(2, 3, 5), w32, target.reshape(2, 3, 7), labels.reshape(2, 3), bias=b32, **kw)
    from_t = reference(*(torch.from_numpy(a) for a in (x32.reshape(2, 3, 5), w32, target.reshape(2, 3, 7))),
                       torch.from_numpy(labels.reshape(2, 3)), bias=torch.from_numpy(b32), **kw)
    assert isinstance(from_np.grad_x, np.ndarray) and isinstance(from_t.grad_x, torch.Tensor)
    assert from_np.grad_x.dtype == np.float64 and from_t.grad_weight.dtype == torch.float64
    assert from_np.grad_x.shape == (2, 3, 5) and tuple(from_t.grad_x.shape) == (2, 3, 5)
    assert from_np.loss == from_t.loss
    for name in ("grad_x", "grad_weight", "grad_bias"):
        np.testing.assert_array_equal(getattr(from_np, name), getattr(from_t, name).numpy())


def test_reference_does_not_modify_inputs_and_gives_finite_gradients_at_zeros():
    _, x, w, b = _problem(seed=9)
    xt = torch.tensor(x, dtype=torch.float32, requires_grad=True)
    before = xt.detach().clone()
    p = np.zeros((6, 7))
    p[:, 0] = 1.0  # one-hot teacher: most terms are 0 log 0
    for beta in (0.0, 0.5, 1.0):
        e = reference(xt, w, p, bias=b, beta=beta)
        assert np.isfinite(e.loss) and all(torch.isfinite(g).all() for g in (e.grad_x, e.grad_weight, e.grad_bias))
    assert xt.grad is None and torch.equal(xt.detach(), before)


def test_import_does_not_import_torch():
    code = "import sys, fused_kl.reference; assert 'torch' not in sys.modules and 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
