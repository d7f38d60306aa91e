"""Property tests: random configurations of every option of docs/contract.md on every
backend of both frameworks, against the float64 reference.

Each example draws a shape, a dtype, a teacher format (dense, hidden, top-k), the divergence
(``beta``), the hard term, the logit transforms and a style of inputs (ignored rows, exact
zeros and one-hot rows, top-k padding, large logits, 3-D inputs, loss-only calls, an upstream
gradient), runs one backend and compares the loss and every gradient with
``fused_kl.reference`` through ``harness.assert_matches``. Examples are derandomized and each
parametrized test has its own fixed stream, so a run is reproducible.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from harness import ALL_BACKENDS, TOLERANCE, Inputs, assert_matches, expected, make_inputs, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fused_kl.loss import REDUCTIONS, TARGET_FORMATS, TOPK_TAILS
from fused_kl.rowmath import float16_unscale

# Examples per backend, run in shards of SHARD examples (one test each, so that the two
# workers share a backend's examples). JAX compiles every example (the options are static
# and shapes vary), and the Triton and Pallas kernels are interpreted on CPU: those backends
# get fewer examples than plain torch. Modest counts: the matrix of test_backends.py covers
# every option value; these look for the combinations it does not list.
SHARD = 8
EXAMPLES = {"torch/torch": 64}
DEFAULT_EXAMPLES = 16
SHARDS = [(b, i) for b in ALL_BACKENDS for i in range(EXAMPLES.get(b, DEFAULT_EXAMPLES) // SHARD)]

# Backends that compile per example through JAX, which unrolls the chunk loop: at most 3 chunks.
JAX_COMPILED = tuple(b for b in ALL_BACKENDS if b.startswith("jax/") or b == "torch/pallas")
LARGEST_N = {"torch/torch": 200}  # else 40; the interpreted kernels cost some ms per row

# Unit roundoff of the dtype in which the logits and dL/dz are stored, and its smallest
# subnormal (the spacing of the values near 0).
ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-9, "float16": 2.0**-11}
SUBNORMAL = {"float32": 2.0**-149, "bfloat16": 2.0**-133, "float16": 2.0**-24}
# The logit rounding ``|f(z)|max * u / T`` that a configuration may reach (see ``tolerances``):
# beyond a few percent, the rounding of the logits decides between nearly tied logits and the
# comparison means little. It bounds the logit sizes drawn for a dtype and temperature.
MAX_LOGIT_ROUNDING = 0.02
MAX_LOGIT = 1e3  # largest logits drawn: |z| up to about 1e3 (|z| <~ 4.5 * scale)
# Reverse KL and JSD: the student's scaled logits |f(z) / T| stay below this. Beyond it, q is
# one-hot to float32's precision and those gradients vanish into rounding noise (a relative
# comparison with float64 then means nothing; ``tolerances`` would say so).
MAX_SATURATION = 20.0


def log_uniform(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(math.log(lo), math.log(hi)).map(math.exp)


def _norm(a: np.ndarray | None) -> float:
    return 0.0 if a is None else float(np.linalg.norm(a))


def _logits(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    return x @ np.asarray(w, np.float64).T + (0.0 if b is None else np.asarray(b, np.float64))


def _transform(z: np.ndarray, scale: float, cap: float | None) -> np.ndarray:
    z = scale * z
    return z if cap is None else cap * np.tanh(z / cap)


def _log_softmax(a: np.ndarray) -> np.ndarray:
    a = a - a.max(-1, keepdims=True)
    return a - np.log(np.exp(a).sum(-1, keepdims=True))


def _teacher_logits(inp: Inputs) -> np.ndarray:
    """The teacher's logits ``[N, V]`` (formats ``"logits"`` and ``"hidden"``), in float64."""
    if inp.target_format == "hidden":
        return _logits(inp.target, inp.teacher_weight, inp.teacher_bias)
    return np.asarray(inp.target, np.float64).reshape(-1, inp.target.shape[-1])


def _teacher_log_probs(inp: Inputs, options: dict) -> np.ndarray:
    """The finite teacher log-probabilities the kernels take differences of (floored at eps)."""
    t = np.asarray(inp.target, np.float64).reshape(-1, inp.target.shape[-1])
    floor = math.log(options.get("eps", 1e-10))
    if inp.target_format == "probs":
        return np.log(np.maximum(t, math.exp(floor)))
    if inp.target_format in ("log_probs", "topk_log_probs"):
        return np.where(np.isfinite(t), t, floor)  # top-k: p_t and q_t are floored at eps too
    teacher_t = options.get("teacher_temperature") or options.get("temperature", 1.0)
    u = _transform(_teacher_logits(inp), options.get("teacher_logit_scale", 1.0), options.get("teacher_softcap"))
    return _log_softmax(u / teacher_t)


def tolerances(inp: Inputs, options: dict) -> tuple[float, float]:
    """Relative tolerances ``(loss, gradients)`` of a configuration, derived from its dtype.

    ``harness.TOLERANCE[dtype]`` covers the dtype's rounding at logits of order 1 and
    temperature 1. Three regimes need more, each from a bound rather than a fitted constant:

    * Logit rounding amplified by ``logit_scale / T``. The kernel reads ``z`` rounded to its
      dtype (``|dz_j| <= |z_j| u``) and works on ``f(z) / T`` with ``|f'| <= logit_scale``, so
      ``log_q`` is off by up to ``2 logit_scale |z|max u / T`` (the hard term: ``T = 1``); ``q``,
      the loss and ``dL/dz`` inherit that to first order. A teacher's logits add the same with
      its own scale and temperature: ``"logits"`` read in float32, ``"hidden"`` made by a GEMM
      whose output is rounded to the dtype.
    * Cancellation in the float32 row math. ``dL/dz`` is made of differences of log-probabilities
      (reverse KL and JSD: ``q_j (log q_j - log p_j - R)``), each known to float32's ``u32`` times
      its size, ``|a| <= A`` for the student's scaled logits and ``|log p| <= L``: an absolute
      error up to about ``u32 (2A + L + log V)`` times ``c q_j`` (``c`` the row's weight), where
      the gradient itself can be far smaller (a nearly one-hot ``q``). Relative to the reference:
      ``u32 (2A + L + log V) ||c Q||_F`` through the gradient GEMMs as below.
    * Underflow (float16 only in practice). A value below its dtype's normal range is off by up
      to half the subnormal spacing ``d/2``. ``dL/dz = G`` is stored in the logits' dtype, in
      float16 divided by ``c = fused_kl.rowmath.float16_unscale(largest row weight)`` and
      multiplied back after the GEMMs, so ``||dG||_F <= c d/2 sqrt(n V)`` over the ``n`` kept
      rows; then ``grad_x = G @ W`` is off by ``c d/2 sqrt(n V) ||W||_2``, ``grad_weight`` by
      ``c d/2 sqrt(n V) ||X||_2``, ``grad_bias`` by ``c d/2 sqrt(n V) sqrt(n)``, and each by ``d/2``
      per entry of its own storage; relative to the reference's norm.

    And one more for a top-k teacher's tail bin: float32 knows the student's mass on the tokens
    ``Q`` to about ``delta = u32 (k + 2A + log V)``, so a tail ``q_t = 1 - Q`` not far above
    ``delta`` is known to ``q_t +- delta``, floored at ``eps`` (:func:`_tail_bin_error`).
    """
    x = np.asarray(inp.x, np.float64).reshape(-1, inp.x.shape[-1])
    w = np.asarray(inp.weight, np.float64)
    h, v = w.shape[1], w.shape[0]
    z = _logits(x, w, inp.bias)
    temperature = options.get("temperature", 1.0)
    w_soft, w_hard = options.get("weight_soft_loss", 1.0), options.get("weight_hard_loss", 0.0)
    student_t = min(temperature, 1.0) if w_hard else temperature
    logit = 2 * options.get("logit_scale", 1.0) * np.abs(z).max(initial=0.0) * ROUNDOFF[inp.dtype] / student_t
    if inp.target_format in ("logits", "hidden"):
        teacher_t = options.get("teacher_temperature") or temperature
        roundoff = ROUNDOFF["float32" if inp.target_format == "logits" else inp.dtype]
        u_max = np.abs(_teacher_logits(inp)).max(initial=0.0)
        logit += 2 * options.get("teacher_logit_scale", 1.0) * u_max * roundoff / teacher_t
    ref = expected(inp, **options)
    keep = np.ones(x.shape[0], bool) if inp.labels is None else inp.labels.reshape(-1) != options.get(
        "ignore_index", -100)
    kept = int(keep.sum())
    reduction = options.get("reduction", "batchmean")
    s = {"batchmean": 1 / max(kept, 1), "sum": 1.0, "mean": 1 / max(kept * v, 1)}[reduction]
    s_hard = 1.0 if reduction == "sum" else 1 / max(kept, 1)

    f = _transform(z[keep], options.get("logit_scale", 1.0), options.get("softcap"))
    big_a = np.abs(f).max(initial=0.0) / student_t
    log_q = _log_softmax(f / temperature)
    tail_loss, tail_grad = _tail_bin_error(inp, options, keep, log_q, big_a, w_soft * s)
    loss_tol = TOLERANCE[inp.dtype] + logit + tail_loss / max(abs(ref.loss), 1e-2)
    big_l = np.abs(_teacher_log_probs(inp, options)[keep]).max(initial=0.0) if w_soft else 0.0
    q_norm = (w_soft * s / temperature * _norm(np.exp(log_q)),
              w_hard * s_hard * _norm(np.exp(_log_softmax(f))))
    arithmetic = 2.0**-24 * (2 * big_a + big_l + math.log(v)) * math.hypot(*q_norm)

    half = SUBNORMAL[inp.dtype] / 2
    underflow = half * math.sqrt(kept * v)  # bound on ||dG||_F from underflow
    if inp.dtype == "float16" and kept:
        underflow *= float(float16_unscale(np.float64(max(w_soft * s, w_hard * s_hard)), np))
    bounds = [
        (ref.grad_x, np.linalg.norm(w, 2), half * math.sqrt(x.size)),
        (ref.grad_weight, np.linalg.norm(x, 2) if x.size else 0.0, half * math.sqrt(v * h)),
        (ref.grad_bias, math.sqrt(kept), half * math.sqrt(v)),
    ]
    # Nothing added where the reference gradient is exactly 0 (no rows kept, V == 1).
    extra = max((((underflow + arithmetic + tail_grad) * gemm + storage) / _norm(g) for g, gemm, storage in bounds
                 if _norm(g) > 0), default=0.0)
    return loss_tol, loss_tol + extra


def _tail_bin_error(
    inp: Inputs, options: dict, keep: np.ndarray, log_q: np.ndarray, big_a: float, soft_scale: float
) -> tuple[float, float]:
    """``(loss, ||dL/dz||_F)`` error bounds of the tail bin's ``q_t = 1 - Q`` known to ``+- delta``:
    the loss takes ``p_t log q_t`` per row, and ``dL/dz`` carries ``r = p_t / q_t`` on ``q`` off the
    tokens and on the tokens through ``K``, each of norm at most ``c |dr| q_t`` (``c`` the row's
    soft scale, ``c = soft_scale / T``); ``log_q`` the kept rows' student log-probabilities.
    0 for other teachers and tails."""
    if inp.target_format != "topk_log_probs" or options.get("topk_tail", "bin") != "bin" or not keep.any():
        return 0.0, 0.0
    temperature, eps = options.get("temperature", 1.0), options.get("eps", 1e-10)
    t = np.asarray(inp.target, np.float64).reshape(-1, inp.target.shape[-1])
    idx = np.asarray(inp.target_indices).reshape(t.shape)[keep]
    t = t[keep]
    q_at = np.exp(np.take_along_axis(log_q, idx, 1))
    q_t = np.maximum(1.0 - np.where(np.isfinite(t), q_at, 0.0).sum(-1), 0.0)
    p_t = np.maximum(1.0 - np.exp(t).sum(-1), 0.0)
    delta = 2.0**-24 * (t.shape[1] + 2 * big_a + math.log(log_q.shape[1]))
    low, floored = np.maximum(q_t - delta, eps), np.maximum(q_t, eps)
    log_err = np.maximum(np.log((q_t + delta) / floored), np.log(floored / low))
    # |dr| q_t / p_t, for a computed tail in [low, q_t + delta]; r = 0 where it falls to eps
    r_err = np.maximum(q_t / low - 1.0, np.where(q_t - delta <= eps, 1.0, 0.0))
    loss = soft_scale * float(np.sum(p_t * log_err))
    return loss, 2 * soft_scale / temperature * float(np.linalg.norm(p_t * r_err))


@st.composite
def configurations(draw: st.DrawFn, backend: str) -> tuple[dict, dict, dict]:
    """``(make_inputs keywords, options of the call, harness.run keywords)``."""
    big = draw(st.integers(0, 4)) == 0  # mostly small N, 1 in 5 larger; N == 0 included
    n = draw(st.integers(17, LARGEST_N.get(backend, 40)) if big else st.integers(0, 16))
    h = draw(st.integers(1, 24))
    v = draw(st.integers(1, 160))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    fmt = draw(st.sampled_from(TARGET_FORMATS))
    temperature = draw(log_uniform(0.1, 10.0))
    options: dict = dict(reduction=draw(st.sampled_from(REDUCTIONS)), temperature=temperature)
    inputs: dict = dict(n=n, h=h, v=v, dtype=dtype, target_format=fmt, seed=draw(st.integers(0, 2**32 - 1)),
                        bias=draw(st.booleans()))
    teacher_t = temperature
    if fmt == "topk_log_probs":
        options["topk_tail"] = draw(st.sampled_from(TOPK_TAILS))
        inputs["k"] = draw(st.integers(1, v))
        inputs["pad_frac"] = draw(st.sampled_from([0.0, 0.5]))
    else:
        options["beta"] = draw(st.sampled_from([0.0, 1.0, 0.5]) | st.floats(0.01, 0.99))
        if draw(st.booleans()):
            teacher_t = options["teacher_temperature"] = draw(log_uniform(0.1, 10.0))
    teacher_scale = 1.0
    if fmt in ("logits", "hidden") and draw(st.booleans()):
        teacher_scale = options["teacher_logit_scale"] = draw(log_uniform(0.3, 3.0))
        if draw(st.booleans()):
            options["teacher_softcap"] = draw(log_uniform(0.5, 30.0))
    if fmt == "hidden":
        inputs["ht"] = draw(st.integers(1, 24))
        inputs["teacher_bias"] = draw(st.booleans())

    hard = draw(st.booleans())
    if hard:
        options["weight_hard_loss"] = draw(st.sampled_from([1.0]) | log_uniform(0.01, 10.0))
        options["weight_soft_loss"] = draw(st.sampled_from([1.0, 0.0]) | log_uniform(0.01, 10.0))
        if draw(st.booleans()):
            options["label_smoothing"] = draw(st.floats(0.0, 0.9))
    if draw(st.booleans()):
        options["logit_scale"] = draw(log_uniform(0.3, 3.0))
    if draw(st.booleans()):
        options["softcap"] = draw(log_uniform(0.5, 30.0))

    labels = draw(st.sampled_from(["some ignored", "all ignored", "none ignored"] + ([] if hard else ["none"])))
    ignore_frac = {"none": None, "all ignored": 1.0, "none ignored": 0.0}.get(labels)
    if labels == "some ignored":
        ignore_frac = draw(st.floats(0.05, 0.95))
    if ignore_frac is not None and not hard and draw(st.integers(0, 3)) == 0:
        options["ignore_index"] = 0  # rows labelled 0 are ignored, those labelled -100 kept
    inputs["ignore_frac"] = ignore_frac

    # Logits up to about MAX_LOGIT, as far as the dtype's rounding at this temperature allows
    # (MAX_LOGIT_ROUNDING): float32 reaches 1e3 at any temperature, bf16 at T = 10.
    student_t = min(temperature, 1.0) if hard else temperature
    top = min(MAX_LOGIT, MAX_LOGIT_ROUNDING * student_t / ROUNDOFF[dtype]) / 4.5 / options.get("logit_scale", 1.0)
    if options.get("beta", 0.0) > 0:
        top = min(top, MAX_SATURATION * temperature / 4.5 / options.get("logit_scale", 1.0))
    inputs["logit_scale"] = {
        "unit": min(1.0, top), "drawn": draw(log_uniform(min(0.25, top), top)), "largest": top,
    }[draw(st.sampled_from(["unit", "drawn", "largest"]))]
    # The teacher's logits likewise; a hidden teacher's are rounded to the dtype.
    roundoff = ROUNDOFF[dtype if fmt == "hidden" else "float32"]
    largest = min(30.0, MAX_LOGIT_ROUNDING * teacher_t / roundoff / 4.5 / teacher_scale)
    inputs["teacher_scale"] = draw(log_uniform(min(0.1, largest), largest))
    if fmt == "probs" and draw(st.booleans()):
        inputs["zero_frac"] = draw(st.sampled_from([0.0, 0.5, 0.9, 0.99]))
        inputs["one_hot_frac"] = draw(st.sampled_from([0.0, 0.3, 1.0]))
    if n and draw(st.integers(0, 4)) == 0:
        b = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
        inputs["lead"] = (b, n // b)

    if draw(st.booleans()):
        least = max(1, -(-n // 3)) if backend in JAX_COMPILED else 1
        options["chunk_size"] = draw(st.integers(least, max(least, n + 2)))
    if dtype != "float32" and draw(st.booleans()):
        options["accum_dtype"] = "float32"
    how = dict(grads=draw(st.integers(0, 5)) > 0, upstream=draw(st.sampled_from([1.0, 1.0, -2.5])))
    return inputs, options, how


@pytest.mark.parametrize(("backend", "shard"), SHARDS, ids=[f"{b}-{i}" for b, i in SHARDS])
@given(data=st.data())
@settings(max_examples=SHARD, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
def test_matches_reference(backend: str, shard: int, data: st.DataObject) -> None:
    del shard  # it only gives each shard its own stream of examples
    inputs, options, how = data.draw(configurations(backend), label="configuration")
    inp = make_inputs(**inputs)
    out = run(backend, inp, **how, **options)

    loss_tol, grad_tol = tolerances(inp, options)
    assert_matches(out, inp, upstream=how["upstream"], tolerance=loss_tol, grad_tolerance=grad_tol, **options)
    if how["grads"]:
        assert out.grad_x.shape == inp.x.shape and out.grad_weight.shape == inp.weight.shape
        assert (out.grad_bias is None) == (inp.bias is None)
    else:
        assert out.grad_x is None and out.grad_weight is None and out.grad_bias is None

    ignore_index = options.get("ignore_index", -100)
    if inp.x.size == 0 or (inp.labels is not None and np.all(inp.labels == ignore_index)):
        # No row kept: exactly zero, never NaN.
        assert out.loss == 0.0
        for g in (out.grad_x, out.grad_weight, out.grad_bias):
            assert g is None or not np.any(g)
