"""One way to build inputs and run any backend of either framework, for every test file.

A backend id is ``"<framework>/<backend>"``: ``torch/torch``, ``torch/triton``,
``torch/jax``, ``jax/xla``, ``jax/pallas``, ``jax/triton``. ``run`` returns NumPy float64
results so they compare directly with ``reference.reference``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TORCH_BACKENDS = ("torch/torch", "torch/triton", "torch/jax")
JAX_BACKENDS = ("jax/xla", "jax/pallas", "jax/triton")
ALL_BACKENDS = TORCH_BACKENDS + JAX_BACKENDS

# Relative-norm tolerance of a result against float64, from the input dtype's precision:
# a few units of its rounding (2**-23, 2**-8, 2**-11) times the depth of the sums.
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 4e-3}


@dataclass
class Inputs:
    x: np.ndarray  # float32 values already rounded to ``dtype``
    weight: np.ndarray
    target: np.ndarray
    labels: np.ndarray | None
    bias: np.ndarray | None
    dtype: str


@dataclass
class Outputs:
    loss: float
    grad_x: np.ndarray | None
    grad_weight: np.ndarray | None
    grad_bias: np.ndarray | None


def _round_to(a: np.ndarray, dtype: str) -> np.ndarray:
    import ml_dtypes

    dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    return a.astype(dt).astype(np.float32)


def make_inputs(
    n: int,
    h: int,
    v: int,
    *,
    dtype: str = "float32",
    target_format: str = "probs",
    seed: int = 0,
    ignore_frac: float | None = 0.3,
    bias: bool = False,
    logit_scale: float = 1.0,
    teacher_scale: float = 2.0,
    lead: tuple[int, ...] | None = None,
    zero_frac: float = 0.0,
    one_hot_frac: float = 0.0,
    min_mass: float | None = None,
) -> Inputs:
    """Random inputs; ``lead`` reshapes the rows to ``[B, T]``.

    For ``target_format="probs"`` only: ``zero_frac`` sets about that fraction of the target's
    entries to exactly 0 (rows renormalised; a row left with no mass stays all zero), and
    ``one_hot_frac`` makes about that fraction of the rows exactly one-hot. Both default to 0,
    which draws nothing more from the generator, so the other inputs do not depend on them.
    ``min_mass`` scales each row's probabilities (``"probs"`` / ``"log_probs"``) by a factor
    drawn in ``[min_mass, 1]``, as a truncated (top-k) teacher's are: then ``S_i = sum_j p_ij < 1``.
    """
    rng = np.random.default_rng(seed)
    x = _round_to(rng.standard_normal((n, h)).astype(np.float32), dtype)
    w = _round_to((rng.standard_normal((v, h)) * logit_scale / np.sqrt(h)).astype(np.float32), dtype)
    raw = rng.standard_normal((n, v)) * teacher_scale
    if target_format == "logits":
        t = raw
    else:
        log_p = raw - raw.max(-1, keepdims=True)
        log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
        t = np.exp(log_p) if target_format == "probs" else log_p
    labels = None
    if ignore_frac is not None:
        labels = rng.integers(0, v, n)
        labels[rng.random(n) < ignore_frac] = -100
    b = _round_to(rng.standard_normal(v).astype(np.float32), dtype) if bias else None
    if (zero_frac or one_hot_frac) and target_format != "probs":
        raise ValueError("zero_frac and one_hot_frac apply to target_format='probs' only")
    if zero_frac:
        t = np.where(rng.random((n, v)) < zero_frac, 0.0, t)
        mass = t.sum(-1, keepdims=True)
        t = np.divide(t, mass, out=np.zeros_like(t), where=mass > 0)
    if one_hot_frac:
        rows = rng.random(n) < one_hot_frac
        t[rows] = 0.0
        t[rows, rng.integers(0, v, int(rows.sum()))] = 1.0
    if min_mass is not None:
        factor = rng.uniform(min_mass, 1.0, (n, 1))
        t = t * factor if target_format == "probs" else t + np.log(factor)
    if lead is not None:
        x, t = x.reshape(*lead, h), t.reshape(*lead, v)
        labels = None if labels is None else labels.reshape(lead)
    return Inputs(x, w, t.astype(np.float32), labels, b, dtype)


def run(backend: str, inp: Inputs, *, upstream: float = 1.0, grads: bool = True, **options) -> Outputs:
    """Loss and gradients of ``upstream * loss`` from one backend, as NumPy float64."""
    framework, name = backend.split("/")
    return (_run_torch if framework == "torch" else _run_jax)(name, inp, upstream, grads, options)


def _run_torch(name: str, inp: Inputs, upstream: float, grads: bool, options: dict) -> Outputs:
    import torch

    import torch_kl

    dt = getattr(torch, inp.dtype)
    x = torch.tensor(inp.x).to(dt).requires_grad_(grads)
    w = torch.tensor(inp.weight).to(dt).requires_grad_(grads)
    b = None if inp.bias is None else torch.tensor(inp.bias).to(dt).requires_grad_(grads)
    t = torch.tensor(inp.target)
    lab = None if inp.labels is None else torch.tensor(inp.labels)
    if "accum_dtype" in options and isinstance(options["accum_dtype"], str):
        options = {**options, "accum_dtype": getattr(torch, options["accum_dtype"])}
    loss = torch_kl.fused_linear_kl_div(x, w, t, lab, bias=b, backend=name, **options)
    if grads:
        (loss * upstream).backward()

    def grad(a):
        return None if a is None or a.grad is None else a.grad.double().numpy()

    return Outputs(float(loss), grad(x), grad(w), grad(b))


def _run_jax(name: str, inp: Inputs, upstream: float, grads: bool, options: dict) -> Outputs:
    import jax
    import jax.numpy as jnp

    import jax_kl

    dt = jnp.dtype(inp.dtype)
    x, w = jnp.asarray(inp.x, dt), jnp.asarray(inp.weight, dt)
    b = None if inp.bias is None else jnp.asarray(inp.bias, dt)
    t = jnp.asarray(inp.target)
    lab = None if inp.labels is None else jnp.asarray(inp.labels, jnp.int32)

    def f(x, w, b, t, lab):
        return jax_kl.fused_linear_kl_div(x, w, t, lab, bias=b, backend=name, **options) * upstream

    if not grads:
        return Outputs(float(jax.jit(f)(x, w, b, t, lab)) / upstream, None, None, None)
    loss, (gx, gw, gb) = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(x, w, b, t, lab)

    def as64(a):
        return None if a is None else np.asarray(a.astype(jnp.float32), np.float64)

    return Outputs(float(loss) / upstream, as64(gx), as64(gw), as64(gb))


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """``||got - want|| / ||want||``; NaN anywhere fails any tolerance."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"shape {got.shape} != {want.shape}")
    denom = np.linalg.norm(want)
    diff = np.linalg.norm(got - want)
    return float(diff / denom) if denom > 0 else float(diff)


def assert_matches(out: Outputs, inp: Inputs, *, upstream: float = 1.0, **options) -> None:
    """Compare every output with the float64 reference at the dtype's tolerance."""
    from reference import reference

    opts = {k: v for k, v in options.items() if k not in ("accum_dtype", "chunk_size")}
    ref = reference(inp.x, inp.weight, inp.target, inp.labels, bias=inp.bias, **opts)
    tol = TOLERANCE[inp.dtype]
    # A KL near 0 is the difference of two sums of order 1 (cross-entropy and entropy), so its
    # rounding error is absolute: relative to a loss of 1e-3 it can exceed float32's tolerance.
    scale = max(abs(ref.loss), 1e-2)
    assert np.isfinite(out.loss), f"loss is {out.loss}"
    assert abs(out.loss - ref.loss) / scale < tol, f"loss {out.loss} vs {ref.loss}"
    pairs = [("grad_x", out.grad_x, ref.grad_x), ("grad_weight", out.grad_weight, ref.grad_weight)]
    if inp.bias is not None:
        pairs.append(("grad_bias", out.grad_bias, ref.grad_bias))
    for name, got, want in pairs:
        if got is None:
            continue
        err = rel_err(got / upstream, want)
        assert err < tol, f"{name}: relative error {err:.3g} > {tol}"
