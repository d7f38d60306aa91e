"""Property tests: random configurations of every option on all six backends, against float64.

Each example draws a shape, a dtype, every option of SPEC.md and a style of inputs (ignored
rows, exact zeros and one-hot rows in the target, large logits, 3-D inputs, loss-only calls,
an upstream gradient), runs one backend and compares the loss and every gradient with
``reference.reference`` through ``harness.assert_matches``. Examples are derandomized and
each parametrized test has its own fixed stream, so a CI run is reproducible.
"""

from __future__ import annotations

import math
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
from harness import ALL_BACKENDS, TOLERANCE, Inputs, assert_matches, make_inputs, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference

# Examples per backend, run in shards of SHARD examples (one test each, so that the
# workers share a backend's examples). JAX compiles every example (the options are static
# and shapes vary) and the Triton and Pallas kernels are interpreted on CPU, so those
# backends get fewer examples than plain torch.
SHARD = 20
EXAMPLES = {
    "torch/torch": 200,
    "torch/triton": 80,
    "torch/jax": 80,
    "jax/xla": 80,
    "jax/pallas": 60,
    "jax/triton": 80,
}
assert sum(EXAMPLES.values()) >= 500 and all(count % SHARD == 0 for count in EXAMPLES.values())
SHARDS = [(backend, i) for backend in ALL_BACKENDS for i in range(EXAMPLES[backend] // SHARD)]

# Backends that compile per example through JAX, which unrolls the chunk loop: they get
# smaller N and at most 3 chunks. The interpreted Triton kernel costs some ms per row.
JAX_COMPILED = ("torch/jax", "jax/xla", "jax/pallas")
LARGEST_N = {"torch/torch": 300, "torch/triton": 160, "jax/triton": 160}  # else 64

# Unit roundoff of the dtype in which the logits and dL/dz are stored, and its smallest
# subnormal (the spacing of the values near 0).
ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-9, "float16": 2.0**-11}
SUBNORMAL = {"float32": 2.0**-149, "bfloat16": 2.0**-133, "float16": 2.0**-24}
# The logit rounding ``|z|max * u / T`` that a configuration may reach (see ``tolerances``):
# beyond a few percent, the rounding of the logits decides between nearly tied logits and
# the comparison means little. It bounds the logit scale drawn for a dtype and temperature.
MAX_LOGIT_ROUNDING = 0.02
# Largest logits drawn: |z| up to about 1e3 (x ~ N(0, 1), so |z| <~ 4.5 * logit_scale).
MAX_LOGIT = 1e3


def log_uniform(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(math.log(lo), math.log(hi)).map(math.exp)


def _norm(a: np.ndarray | None) -> float:
    return 0.0 if a is None else float(np.linalg.norm(a))


def tolerances(inp: Inputs, options: dict) -> tuple[float, float]:
    """Relative tolerances ``(loss, gradients)`` of a configuration, derived from its dtype.

    ``harness.TOLERANCE[dtype]`` covers the dtype's rounding at logits of order 1 and
    temperature 1. Two regimes need more, each from a bound rather than a fitted constant:

    * Logit rounding amplified by ``1/T``. The kernel reads ``z`` rounded to its dtype
      (``|dz_j| <= |z_j| u``) and works on ``z / T``, so ``log_q`` is off by up to
      ``2 |z|max u / T`` (each term, and the log-sum-exp by as much again); ``q``, the loss
      and ``dL/dz`` inherit that to first order. For ``"logits"`` the teacher's ``t / T_t``
      in float32 adds ``2 |t|max 2**-24 / T_t``. (bf16 at T = 0.05 amplifies the rounding 20x.)
    * Underflow (float16 only in practice). A value below its dtype's normal range is off
      by up to half the subnormal spacing ``d/2``, however small it is. ``dL/dz = G`` is
      stored in the logits' dtype, in float16 divided by ``c = 2**clip(floor(log2 s), -14, 0)``
      (``s`` the reduction scale) and multiplied back after the GEMMs, so
      ``||dG||_F <= c d/2 sqrt(n V)`` over the ``n`` kept rows. Then ``grad_x = G @ W`` is off
      by ``c d/2 sqrt(n V) ||W||_2``, ``grad_weight = G.T @ X`` by ``c d/2 sqrt(n V) ||X||_2``,
      ``grad_bias = G.sum(0)`` by ``c d/2 sqrt(n V) sqrt(n)``, and each by ``d/2`` per entry of
      its own storage; relative to the reference's norm. The loss, in float32, is not affected.
    """
    x = np.asarray(inp.x, np.float64).reshape(-1, inp.x.shape[-1])
    w = np.asarray(inp.weight, np.float64)
    z = x @ w.T + (0.0 if inp.bias is None else np.asarray(inp.bias, np.float64))
    temperature = options.get("temperature", 1.0)
    logit = 2 * np.abs(z).max(initial=0.0) * ROUNDOFF[inp.dtype] / temperature
    if options.get("target_format") == "logits":
        teacher_t = options.get("teacher_temperature") or temperature
        logit += 2 * np.abs(inp.target).max(initial=0.0) * ROUNDOFF["float32"] / teacher_t
    loss_tol = TOLERANCE[inp.dtype] + logit

    ref = reference(inp.x, inp.weight, inp.target, inp.labels, bias=inp.bias, **_reference_options(options))
    kept = x.shape[0] if inp.labels is None else int(np.sum(inp.labels != options.get("ignore_index", -100)))
    h, v = w.shape[1], w.shape[0]
    half = SUBNORMAL[inp.dtype] / 2
    g_err = half * math.sqrt(kept * v)  # bound on ||dG||_F from underflow
    if inp.dtype == "float16" and kept:
        s = {"batchmean": 1 / kept, "sum": 1.0, "mean": 1 / (kept * v)}[options.get("reduction", "batchmean")]
        g_err *= 2.0 ** min(max(math.floor(math.log2(s)), -14), 0)
    bounds = [
        (ref.grad_x, g_err * np.linalg.norm(w, 2) + half * math.sqrt(x.size)),
        (ref.grad_weight, g_err * (np.linalg.norm(x, 2) if x.size else 0.0) + half * math.sqrt(v * h)),
        (ref.grad_bias, g_err * math.sqrt(kept) + half * math.sqrt(v)),
    ]
    # No underflow allowance where the reference gradient is exactly 0 (no rows kept, V == 1).
    underflow = max((err / _norm(g) for g, err in bounds if _norm(g) > 0), default=0.0)
    return loss_tol, loss_tol + underflow


def _reference_options(options: dict) -> dict:
    return {k: v for k, v in options.items() if k not in ("accum_dtype", "chunk_size")}


@st.composite
def configurations(draw: st.DrawFn, backend: str) -> tuple[dict, dict, dict]:
    """``(make_inputs keywords, fused_linear_kl_div options, harness.run keywords)``."""
    # Mostly small N, 1 in 5 up to a few hundred; N == 0 included.
    big = draw(st.integers(0, 4)) == 0
    n = draw(st.integers(25, LARGEST_N.get(backend, 64)) if big else st.integers(0, 24))
    h = draw(st.integers(1, 33))
    v = draw(st.integers(1, 300))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    target_format = draw(st.sampled_from(["probs", "log_probs", "logits"]))
    temperature = draw(log_uniform(0.05, 20.0))
    options: dict = dict(
        target_format=target_format,
        reduction=draw(st.sampled_from(["batchmean", "sum", "mean"])),
        temperature=temperature,
    )
    if draw(st.booleans()):
        options["teacher_temperature"] = draw(log_uniform(0.05, 20.0))

    labels = draw(st.sampled_from(["none", "some ignored", "all ignored", "none ignored"]))
    ignore_frac = {"none": None, "all ignored": 1.0, "none ignored": 0.0}.get(labels)
    if labels == "some ignored":
        ignore_frac = draw(st.floats(0.05, 0.95))
    if ignore_frac is not None and draw(st.integers(0, 3)) == 0:
        # Another ignore_index: rows labelled 0 are ignored, those labelled -100 kept.
        options["ignore_index"] = 0

    # Logits up to about MAX_LOGIT, as far as the dtype's rounding at this temperature
    # allows (MAX_LOGIT_ROUNDING): float32 reaches 1e3 at any temperature, bf16 at T = 20.
    top = min(MAX_LOGIT, MAX_LOGIT_ROUNDING * temperature / ROUNDOFF[dtype]) / 4.5
    logit_scale = {
        "unit": min(1.0, top),
        "drawn": draw(log_uniform(min(0.25, top), top)),
        "largest": top,
    }[draw(st.sampled_from(["unit", "drawn", "largest"]))]
    inputs = dict(
        n=n,
        h=h,
        v=v,
        dtype=dtype,
        target_format=target_format,
        seed=draw(st.integers(0, 2**32 - 1)),
        ignore_frac=ignore_frac,
        bias=draw(st.booleans()),
        logit_scale=logit_scale,
        teacher_scale=draw(log_uniform(0.1, 30.0)),
    )
    if target_format == "probs" and draw(st.booleans()):
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
@settings(
    max_examples=SHARD,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
def test_matches_reference(backend: str, shard: int, data: st.DataObject) -> None:
    del shard  # it only gives each shard its own stream of examples
    inputs, options, how = data.draw(configurations(backend), label="configuration")
    inp = make_inputs(**inputs)
    out = run(backend, inp, **how, **options)

    loss_tol, grad_tol = tolerances(inp, options)
    loss_only = replace(out, grad_x=None, grad_weight=None, grad_bias=None)
    with mock.patch.dict(TOLERANCE, {inp.dtype: loss_tol}):
        assert_matches(loss_only, inp, upstream=how["upstream"], **options)
    if how["grads"]:
        with mock.patch.dict(TOLERANCE, {inp.dtype: grad_tol}):
            assert_matches(out, inp, upstream=how["upstream"], **options)
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
