"""One way to build inputs and run any backend of either framework, for every test file.

A backend id is ``"<framework>/<name>"``, ``name`` a key of that framework's registry
(``torch_kl.backends.REGISTRY``, ``jax_kl.backends.REGISTRY``): the lists below are built
from the registries, never written out. ``run`` calls ``fused_linear_kl_div`` (or
``fused_linear_cross_entropy``) and returns NumPy float64 results; ``assert_matches`` compares
them with the one float64 reference, ``fused_kl.reference``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

import jax_kl.backends
import torch_kl.backends
from fused_kl.reference import Expected, reference, reference_cross_entropy

TORCH_BACKENDS = tuple(f"torch/{name}" for name in torch_kl.backends.REGISTRY)
# The Mosaic GPU kernels run only on a Hopper GPU; on CPU they are checked by lowering them
# (tests/test_pallas_lowering.py).
JAX_BACKENDS = tuple(
    f"jax/{name}"
    for name in jax_kl.backends.REGISTRY
    if name != "pallas_mosaic" or jax_kl.backends.mosaic_missing() is None
)
ALL_BACKENDS = TORCH_BACKENDS + JAX_BACKENDS
# The bridges: one framework's autograd around the other framework's kernels (single device).
BRIDGES = tuple(
    f"{fw}/{name}"
    for fw, registry in (("torch", torch_kl.backends.REGISTRY), ("jax", jax_kl.backends.REGISTRY))
    for name, backend in registry.items()
    if backend.single_device
)

# Relative-norm tolerance of a result against float64, from the input dtype's precision:
# a few units of its rounding (2**-23, 2**-8, 2**-11) times the depth of the sums.
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 4e-3}
# Options of how a call runs, never what it computes: the reference does not take them.
RUN_OPTIONS = ("accum_dtype", "chunk_size", "backend")
TEACHER_ARRAYS = ("teacher_weight", "teacher_bias", "target_indices")


def jax_pallas_on_hopper(**fields) -> jax_kl.backends.Backend:
    """``jax_kl``'s ``"pallas"`` as it resolves where Mosaic GPU runs (its phases and in-place
    ``grad_weight`` kernels), with ``fields`` replaced: lowered for CUDA on a machine without one."""
    from jax_kl.backends import mosaic_accumulate, mosaic_label_rows, pallas_mosaic, xla_phases

    hopper = {
        "phases": xla_phases, "mosaic_phases": pallas_mosaic,
        "in_place_grad_weight": mosaic_accumulate, "in_place_label_rows": mosaic_label_rows,
    }  # fmt: skip
    return dataclasses.replace(jax_kl.backends.resolve("pallas"), **{**hopper, **fields})


@dataclass
class Inputs:
    """A problem as NumPy arrays. Float arrays hold float32 values already rounded to
    ``dtype`` where the call passes them in ``dtype`` (``x``, ``weight``, ``bias``, and the
    teacher's hidden states and head); dense and top-k targets are passed as float32."""

    x: np.ndarray
    weight: np.ndarray
    target: np.ndarray | None
    labels: np.ndarray | None
    bias: np.ndarray | None
    dtype: str
    target_format: str = "probs"
    teacher_weight: np.ndarray | None = None
    teacher_bias: np.ndarray | None = None
    target_indices: np.ndarray | None = None

    @property
    def target_dtype(self) -> str:
        return self.dtype if self.target_format == "hidden" else "float32"

    def teacher(self) -> dict:
        """The teacher's keywords of a call beyond ``target``; ``target_format`` only if not the default."""
        kw = {k: getattr(self, k) for k in TEACHER_ARRAYS if getattr(self, k) is not None}
        return kw if self.target_format == "probs" else {**kw, "target_format": self.target_format}


@dataclass
class Outputs:
    """A call's results; ``loss_only`` when no gradient was asked for (``run(grads=False)``)."""

    loss: float
    grad_x: np.ndarray | None
    grad_weight: np.ndarray | None
    grad_bias: np.ndarray | None
    loss_only: bool = False


def round_to(a: np.ndarray, dtype: str) -> np.ndarray:
    import ml_dtypes

    dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    return np.asarray(a).astype(dt).astype(np.float32)


def _log_softmax(a: np.ndarray) -> np.ndarray:
    a = a - a.max(-1, keepdims=True)
    return a - np.log(np.exp(a).sum(-1, keepdims=True))


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
    ht: int = 6,
    teacher_bias: bool = False,
    k: int | None = None,
    pad_frac: float = 0.0,
) -> Inputs:
    """Random inputs of ``n`` rows; ``lead`` reshapes the rows to ``[B, T]``.

    ``labels`` (unless ``ignore_frac`` is None) are class indices in ``[0, V)`` with about
    ``ignore_frac`` of the rows set to ``-100``. The teacher, by ``target_format``:

    * ``"probs"`` / ``"log_probs"`` / ``"logits"``: ``[n, V]`` from logits of size ``teacher_scale``.
      For ``"probs"``, ``zero_frac`` zeroes about that fraction of the entries (rows renormalised;
      a row left with no mass stays all zero) and ``one_hot_frac`` makes that fraction of the rows
      one-hot. ``min_mass`` scales rows (``"probs"``, ``"log_probs"``) by a factor in ``[min_mass, 1]``,
      as a truncated teacher's: then ``sum_j p_ij < 1``.
    * ``"hidden"``: hidden states ``[n, ht]`` and a head ``teacher_weight [V, ht]`` (and a
      ``teacher_bias [V]`` if asked), in ``dtype``.
    * ``"topk_log_probs"``: the teacher's ``k`` most likely tokens per row, in shuffled order
      (``target_indices [n, k]``, distinct) and their log-probabilities ``[n, k]``; in about
      ``pad_frac`` of the rows, 1 to ``k - 1`` entries are ``-inf`` padding.
    """
    rng = np.random.default_rng(seed)
    x = round_to(rng.standard_normal((n, h)), dtype)
    w = round_to(rng.standard_normal((v, h)) * logit_scale / np.sqrt(h), dtype)
    raw = rng.standard_normal((n, v)) * teacher_scale
    if (zero_frac or one_hot_frac) and target_format != "probs":
        raise ValueError("zero_frac and one_hot_frac apply to target_format='probs' only")
    tw = tb = idx = None
    if target_format == "logits":
        t = raw
    elif target_format == "hidden":
        t = round_to(rng.standard_normal((n, ht)), dtype)
        tw = round_to(rng.standard_normal((v, ht)) * teacher_scale / np.sqrt(ht), dtype)
        tb = round_to(rng.standard_normal(v), dtype) if teacher_bias else None
    elif target_format == "topk_log_probs":
        k = v if k is None else k
        log_p = _log_softmax(raw)
        idx = rng.permuted(np.argsort(-log_p, axis=-1)[:, :k], axis=-1)
        t = np.take_along_axis(log_p, idx, -1)
        for row in np.flatnonzero(rng.random(n) < pad_frac) if k > 1 else ():
            t[row, k - rng.integers(1, k) :] = -np.inf
    else:
        log_p = _log_softmax(raw)
        t = np.exp(log_p) if target_format == "probs" else log_p
    labels = None
    if ignore_frac is not None:
        labels = rng.integers(0, v, n)
        labels[rng.random(n) < ignore_frac] = -100
    b = round_to(rng.standard_normal(v), dtype) if bias else None
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
        x, t = x.reshape(*lead, h), t.reshape(*lead, t.shape[-1])
        labels = None if labels is None else labels.reshape(lead)
        idx = None if idx is None else idx.reshape(*lead, idx.shape[-1])
    return Inputs(x, w, t.astype(np.float32), labels, b, dtype, target_format, tw, tb, idx)


def run(
    backend: str, inp: Inputs, *, fn: str = "kl_div", upstream: float = 1.0, grads: bool = True, **options
) -> Outputs:
    """Loss and gradients of ``upstream * loss`` from one backend, as NumPy float64.

    ``fn`` is ``"kl_div"`` (``fused_linear_kl_div`` with the inputs' teacher) or
    ``"cross_entropy"`` (``fused_linear_cross_entropy``, no teacher). JAX runs under
    ``jax.jit``; ``grads=False`` asks for the loss alone (torch: nothing requires grad).
    """
    framework, name = backend.split("/")
    return (_run_torch if framework == "torch" else _run_jax)(name, inp, fn, upstream, grads, options)


def torch_tensors(inp: Inputs, *, requires_grad: bool = False, index_dtype: str = "int64") -> dict:
    """The inputs as torch tensors, keyed by argument name: ``x``, ``weight``, ``bias`` (requiring
    grad if asked), ``target``, ``labels`` and the teacher's keywords (``target_format`` included)."""
    import torch

    def tensor(a, dtype: str, grad: bool = False):
        return None if a is None else torch.tensor(a).to(getattr(torch, dtype)).requires_grad_(grad)

    out = {k: tensor(getattr(inp, k), inp.dtype, requires_grad) for k in ("x", "weight", "bias")}
    out |= dict(target=tensor(inp.target, inp.target_dtype), labels=tensor(inp.labels, index_dtype))
    teacher = inp.teacher()
    for key in ("teacher_weight", "teacher_bias", "target_indices"):
        if key in teacher:
            teacher[key] = tensor(teacher[key], index_dtype if key == "target_indices" else inp.dtype)
    return out | teacher


def jax_arrays(inp: Inputs) -> dict:
    """The inputs as JAX arrays (integers int32), keyed as :func:`torch_tensors`'s."""
    import jax.numpy as jnp

    def array(a, dtype):
        return None if a is None else jnp.asarray(a, dtype)

    out = {k: array(getattr(inp, k), inp.dtype) for k in ("x", "weight", "bias")}
    out |= dict(target=array(inp.target, inp.target_dtype), labels=array(inp.labels, jnp.int32))
    teacher = inp.teacher()
    for key in ("teacher_weight", "teacher_bias", "target_indices"):
        if key in teacher:
            teacher[key] = array(teacher[key], jnp.int32 if key == "target_indices" else inp.dtype)
    return out | teacher


def _run_torch(name: str, inp: Inputs, fn: str, upstream: float, grads: bool, options: dict) -> Outputs:
    import torch

    import torch_kl

    a = torch_tensors(inp, requires_grad=grads)
    x, w, b, target, lab = (a.pop(k) for k in ("x", "weight", "bias", "target", "labels"))
    if isinstance(options.get("accum_dtype"), str):
        options = {**options, "accum_dtype": getattr(torch, options["accum_dtype"])}
    if fn == "cross_entropy":
        loss = torch_kl.fused_linear_cross_entropy(x, w, lab, bias=b, backend=name, **options)
    else:
        loss = torch_kl.fused_linear_kl_div(x, w, target, lab, bias=b, backend=name, **a, **options)
    assert loss.dtype == torch.float32 and loss.shape == ()
    if grads:
        (loss * upstream).backward()

    def grad(a):
        return None if a is None or a.grad is None else a.grad.double().numpy()

    return Outputs(float(loss.detach()), grad(x), grad(w), grad(b), loss_only=not grads)


def _run_jax(name: str, inp: Inputs, fn: str, upstream: float, grads: bool, options: dict) -> Outputs:
    import jax
    import jax.numpy as jnp

    import jax_kl

    a = jax_arrays(inp)
    static = {k: v for k, v in a.items() if isinstance(v, str)}  # target_format
    x, w, b, target, lab = (a.pop(k) for k in ("x", "weight", "bias", "target", "labels"))
    arrays = {k: v for k, v in a.items() if k not in static}

    def f(x, w, b, target, lab, arrays):
        if fn == "cross_entropy":
            loss = jax_kl.fused_linear_cross_entropy(x, w, lab, bias=b, backend=name, **options)
        else:
            loss = jax_kl.fused_linear_kl_div(x, w, target, lab, bias=b, backend=name, **arrays, **static, **options)
        assert loss.dtype == jnp.float32 and loss.shape == ()
        return loss * upstream

    args = (x, w, b, target, lab, arrays)
    if not grads:
        return Outputs(float(jax.jit(f)(*args)) / upstream, None, None, None, loss_only=True)
    loss, (gx, gw, gb) = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(*args)

    def as64(a):
        return None if a is None else np.asarray(a.astype(jnp.float32), np.float64)

    return Outputs(float(loss) / upstream, as64(gx), as64(gw), as64(gb))


def expected(inp: Inputs, fn: str = "kl_div", **options) -> Expected:
    """The float64 reference of a call (``options`` may hold run options: they are dropped)."""
    opts = {k: v for k, v in options.items() if k not in RUN_OPTIONS}
    if fn == "cross_entropy":
        return reference_cross_entropy(inp.x, inp.weight, inp.labels, bias=inp.bias, **opts)
    return reference(inp.x, inp.weight, inp.target, inp.labels, bias=inp.bias, **inp.teacher(), **opts)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """``||got - want|| / ||want||``; NaN anywhere fails any tolerance."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"shape {got.shape} != {want.shape}")
    denom = np.linalg.norm(want)
    diff = np.linalg.norm(got - want)
    return float(diff / denom) if denom > 0 else float(diff)


def assert_matches(
    out: Outputs, inp: Inputs, *, fn: str = "kl_div", upstream: float = 1.0, tolerance: float | None = None,
    grad_tolerance: float | None = None, **options
) -> None:
    """Compare every output with the float64 reference, by default at the dtype's tolerance.

    Unless ``out.loss_only``, every gradient the reference has must be there (a backend that
    drops ``grad_weight`` fails) and none it lacks (``grad_bias`` without a bias)."""
    ref = expected(inp, fn, **options)
    tol = TOLERANCE[inp.dtype] if tolerance is None else tolerance
    grad_tol = tol if grad_tolerance is None else grad_tolerance
    # A KL near 0 is the difference of two sums of order 1 (cross-entropy and entropy), so its
    # rounding error is absolute: relative to a loss of 1e-3 it can exceed float32's tolerance.
    scale = max(abs(ref.loss), 1e-2)
    assert np.isfinite(out.loss), f"loss is {out.loss}"
    assert abs(out.loss - ref.loss) / scale < tol, f"loss {out.loss} vs {ref.loss}"
    if out.loss_only:
        return
    for name in ("grad_x", "grad_weight", "grad_bias"):
        got, want = getattr(out, name), getattr(ref, name)
        if want is None or got is None:
            assert got is None and want is None, f"{name}: got {_what(got)}, the reference has {_what(want)}"
            continue
        err = rel_err(got / upstream, want)
        assert err < grad_tol, f"{name}: relative error {err:.3g} > {grad_tol}"


def _what(grad: np.ndarray | None) -> str:
    return "none" if grad is None else f"one of shape {np.shape(grad)}"
