"""``fused-kl check``: every backend of both registries against the float64 reference.

The backends are those of ``torch_kl.backends.REGISTRY`` and ``jax_kl.backends.REGISTRY``; each
runs a few small problems through the public API (``fused_linear_kl_div`` and
``fused_linear_cross_entropy``) and is compared with :func:`fused_kl.reference.reference`, the
unfused loss in float64 under torch autograd, which shares no code with the kernels.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Odd sizes, so the last chunk and the last column block are partial; several chunks, so
# grad_weight is accumulated across them; a bias, ignored rows and a temperature.
N, H, V = 37, 24, 203
TEACHER_H = 16  # the teacher head's hidden size (target_format="hidden")
TOPK = 16
CHUNK_SIZE = 16
IGNORE_INDEX = -100
IGNORED_FRACTION = 0.25
# Float32 inputs: a few float32 roundings (6e-8) times the depth of the sums (the tests use the same).
TOLERANCE = 2e-5
OUTPUTS = ("loss", "grad_x", "grad_weight", "grad_bias")


@dataclass(frozen=True)
class Case:
    """One loss to check: ``arrays`` maps the API's argument names to :class:`Problem` fields."""

    name: str
    arrays: dict[str, str]
    options: dict[str, Any] = field(default_factory=dict)
    cross_entropy: bool = False  # fused_linear_cross_entropy instead of fused_linear_kl_div


CASES = (
    Case("kl", {"target": "probs", "labels": "labels"}, {"temperature": 2.0}),
    Case(
        "jsd+ce",
        {"target": "logits", "labels": "labels"},
        {"target_format": "logits", "beta": 0.5, "weight_hard_loss": 0.5, "temperature": 1.5},
    ),
    Case(
        "hidden",
        {"target": "hidden", "teacher_weight": "teacher_weight", "labels": "labels"},
        {"target_format": "hidden", "beta": 1.0},
    ),
    Case(
        "topk",
        {"target": "topk_log_probs", "target_indices": "topk_indices", "labels": "labels"},
        {"target_format": "topk_log_probs", "topk_tail": "bin"},
    ),
    Case("ce", {"labels": "labels"}, {"label_smoothing": 0.1}, cross_entropy=True),
)


@dataclass(frozen=True)
class Problem:
    """Small random float32 inputs and every form of teacher the cases read."""

    x: np.ndarray  # [N, H]
    weight: np.ndarray  # [V, H]
    bias: np.ndarray  # [V]
    labels: np.ndarray  # [N] int64, some IGNORE_INDEX
    probs: np.ndarray  # [N, V], rows sum to 1
    logits: np.ndarray  # [N, V]
    hidden: np.ndarray  # [N, TEACHER_H]
    teacher_weight: np.ndarray  # [V, TEACHER_H]
    topk_log_probs: np.ndarray  # [N, TOPK]
    topk_indices: np.ndarray  # [N, TOPK] int64


@dataclass(frozen=True)
class Row:
    """One line of the table: a backend over every case."""

    backend: str
    device: str
    result: str  # "pass", "FAIL" or "skipped"
    errors: dict[str, float]  # case -> max relative error over the loss and the gradients
    note: str


def make_problem(seed: int) -> Problem:
    """The seeded problem every backend runs."""
    rng = np.random.default_rng(seed)
    logits = 2.0 * rng.standard_normal((N, V))
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    top = np.argsort(-log_probs, axis=-1)[:, :TOPK]
    labels = rng.integers(0, V, N)
    labels[rng.random(N) < IGNORED_FRACTION] = IGNORE_INDEX
    f32 = np.float32
    return Problem(
        x=rng.standard_normal((N, H)).astype(f32),
        weight=(rng.standard_normal((V, H)) / np.sqrt(H)).astype(f32),
        bias=rng.standard_normal(V).astype(f32),
        labels=labels,
        probs=np.exp(log_probs).astype(f32),
        logits=logits.astype(f32),
        hidden=rng.standard_normal((N, TEACHER_H)).astype(f32),
        teacher_weight=(2.0 * rng.standard_normal((V, TEACHER_H)) / np.sqrt(TEACHER_H)).astype(f32),
        topk_log_probs=np.take_along_axis(log_probs, top, -1).astype(f32),
        topk_indices=top,
    )


def arrays_of(case: Case, p: Problem) -> dict[str, np.ndarray]:
    """The case's array arguments (besides ``x``, ``weight`` and ``bias``)."""
    return {arg: getattr(p, name) for arg, name in case.arrays.items()}


def expected(case: Case, p: Problem) -> dict[str, np.ndarray]:
    """The float64 loss and gradients of one case."""
    from fused_kl.reference import reference, reference_cross_entropy

    arrays = arrays_of(case, p)
    if case.cross_entropy:
        want = reference_cross_entropy(p.x, p.weight, arrays.pop("labels"), bias=p.bias, **arrays, **case.options)
    else:
        want = reference(p.x, p.weight, bias=p.bias, ignore_index=IGNORE_INDEX, **arrays, **case.options)
    return {k: np.asarray(getattr(want, k), np.float64) for k in OUTPUTS}


def _run_torch(backend: str, case: Case, p: Problem) -> tuple[str, dict[str, np.ndarray]]:
    import torch

    import torch_kl

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, w, b = (torch.tensor(a, device=dev, requires_grad=True) for a in (p.x, p.weight, p.bias))
    arrays = {k: torch.tensor(v, device=dev) for k, v in arrays_of(case, p).items()}
    options = dict(case.options, chunk_size=CHUNK_SIZE, backend=backend)
    if case.cross_entropy:
        loss = torch_kl.fused_linear_cross_entropy(x, w, arrays.pop("labels"), bias=b, **arrays, **options)
    else:
        loss = torch_kl.fused_linear_kl_div(x, w, bias=b, ignore_index=IGNORE_INDEX, **arrays, **options)
    loss.backward()
    outs = (loss.detach(), x.grad, w.grad, b.grad)
    return dev.type, {k: v.cpu().numpy() for k, v in zip(OUTPUTS, outs, strict=True)}


def _run_jax(backend: str, case: Case, p: Problem) -> tuple[str, dict[str, np.ndarray]]:
    import jax
    import jax.numpy as jnp

    import jax_kl

    # JAX's integers are 32-bit unless x64 is enabled.
    arrays = {k: jnp.asarray(v, jnp.int32 if v.dtype.kind == "i" else v.dtype) for k, v in arrays_of(case, p).items()}
    options = dict(case.options, chunk_size=CHUNK_SIZE, backend=backend)

    def loss_fn(x: jax.Array, w: jax.Array, b: jax.Array, arrays: dict[str, jax.Array]) -> jax.Array:
        arrays = dict(arrays)
        if case.cross_entropy:
            return jax_kl.fused_linear_cross_entropy(x, w, arrays.pop("labels"), bias=b, **arrays, **options)
        return jax_kl.fused_linear_kl_div(x, w, bias=b, ignore_index=IGNORE_INDEX, **arrays, **options)

    grad_fn = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2)))
    loss, grads = grad_fn(p.x, p.weight, p.bias, arrays)
    return jax.devices()[0].platform, {k: np.asarray(v) for k, v in zip(OUTPUTS, (loss, *grads), strict=True)}


RUNNERS: dict[str, Callable[[str, Case, Problem], tuple[str, dict[str, np.ndarray]]]] = {
    "torch": lambda *a: _run_torch(*a),  # looked up at call time, so tests can replace them
    "jax": lambda *a: _run_jax(*a),
}


def backends() -> dict[str, str]:
    """``"framework/name"`` -> what it runs, for every backend of both registries (aliases left out),
    or ``"framework/*"`` -> why none can run, for a framework that cannot be imported."""
    found = {}
    for framework in RUNNERS:
        try:
            registry = importlib.import_module(f"{framework}_kl.backends").REGISTRY
        except ImportError as e:
            found[f"{framework}/*"] = f"{e.name or e} is not installed"
            continue
        found.update({f"{framework}/{name}": backend.runs for name, backend in registry.items()})
    return found


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """``|got - want| / |want|`` in float64 (NaN in ``got`` gives NaN)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check_backend(backend: str, runs: str, p: Problem, want: dict[str, dict[str, np.ndarray]]) -> Row:
    """Run every case on one backend and compare every output with the reference; never raises."""
    framework, name = backend.split("/")
    if name == "*":
        return Row(backend, "-", "skipped", {}, runs)
    errors: dict[str, float] = {}
    failures: list[str] = []
    device = "-"
    for case in CASES:
        try:
            device, got = RUNNERS[framework](name, case, p)
        except ImportError as e:
            return Row(backend, "-", "skipped", {}, f"{e.name or e} is not installed")
        except ValueError as e:
            if "not available here" in str(e):
                return Row(backend, "-", "skipped", {}, str(e).split("not available here: ", 1)[-1])
            failures.append(f"{case.name}: ValueError: {e}")
            continue
        except Exception as e:  # a broken backend is a failed check, not a crash of the self-test
            failures.append(f"{case.name}: {type(e).__name__}: {e}")
            continue
        errors[case.name] = float(np.max([relative_error(got[k], want[case.name][k]) for k in OUTPUTS]))  # keeps a NaN
        if not errors[case.name] <= TOLERANCE:
            failures.append(f"{case.name}: error {errors[case.name]:.2e}")
    note = "; ".join(failures) if failures else runs
    return Row(backend, device, "FAIL" if failures else "pass", errors, note)


def main(seed: int) -> int:
    """Check every backend, print the table; return 1 if an available backend fails, else 0."""
    p = make_problem(seed)
    want = {case.name: expected(case, p) for case in CASES}
    kept = int((p.labels != IGNORE_INDEX).sum())
    print(
        f"fused-kl check: N={N} ({kept} kept), H={H}, V={V}, float32 with bias, chunks of {CHUNK_SIZE} rows; "
        f"loss, grad_x, grad_weight and grad_bias against fused_kl.reference in float64 "
        f"(tolerance {TOLERANCE:g}, relative norm)"
    )
    for case in CASES:
        api = "fused_linear_cross_entropy" if case.cross_entropy else "fused_linear_kl_div"
        options = ", ".join(f"{k}={v!r}" for k, v in case.options.items())
        print(f"  {case.name:<8} {api}({', '.join(case.arrays)}; {options})")
    listed = backends()
    width = max(len(b) for b in listed) + 2
    print(f"{'backend':<{width}}{'device':<8}{'result':<9}" + "".join(f"{c.name:<10}" for c in CASES) + "note")
    rows = []
    for backend, runs in listed.items():
        row = check_backend(backend, runs, p, want)
        rows.append(row)
        errors = "".join(f"{row.errors[c.name]:<10.1e}" if c.name in row.errors else f"{'-':<10}" for c in CASES)
        print(f"{row.backend:<{width}}{row.device:<8}{row.result:<9}{errors}{row.note}", flush=True)
    counts = {r: sum(row.result == r for row in rows) for r in ("pass", "FAIL", "skipped")}
    print(f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skipped']} skipped")
    return 1 if counts["FAIL"] else 0
