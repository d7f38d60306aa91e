"""``fused-kl check``: every backend available here against a float64 NumPy reference.

The reference is SPEC.md's closed form on whole rows (no chunks, no online softmax), written
independently of the kernels, so that it checks them rather than repeats them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Odd sizes, so the last chunk and the last column block are partial; several chunks, so
# grad_weight is accumulated across them; a bias, ignored rows and a temperature.
N, H, V = 37, 24, 203
CHUNK_SIZE = 16
TEMPERATURE = 2.0
IGNORE_INDEX = -100
IGNORED_FRACTION = 0.25
# Float32 inputs: a few float32 roundings (6e-8) times the depth of the sums (the tests use the same).
TOLERANCE = 2e-5

# backend id -> (what it runs, the kernel that is interpreted on CPU, if any)
BACKENDS = {
    "torch/torch": ("plain PyTorch, chunked", None),
    "torch/triton": ("Triton kernel", "Triton interpreter"),
    "torch/jax": ("Pallas kernel via DLPack", "Pallas interpret mode"),
    "jax/xla": ("pure JAX, chunked", None),
    "jax/pallas": ("Pallas kernel", "Pallas interpret mode"),
    "jax/triton": ("Triton kernel via DLPack", "Triton interpreter"),
}
OUTPUTS = ("loss", "grad_x", "grad_weight", "grad_bias")


@dataclass(frozen=True)
class Problem:
    """A small random problem, float32 inputs and teacher probabilities."""

    x: np.ndarray  # [N, H]
    weight: np.ndarray  # [V, H]
    bias: np.ndarray  # [V]
    target: np.ndarray  # [N, V], rows sum to 1
    labels: np.ndarray  # [N] int64, some IGNORE_INDEX


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    backend: str
    device: str
    result: str  # "pass", "FAIL" or "skipped"
    error: float | None  # max relative error over the loss and the gradients
    note: str


def make_problem(seed: int) -> Problem:
    """The seeded problem every backend runs."""
    rng = np.random.default_rng(seed)
    logits = 2.0 * rng.standard_normal((N, V))
    target = np.exp(logits - logits.max(-1, keepdims=True))
    labels = rng.integers(0, V, N)
    labels[rng.random(N) < IGNORED_FRACTION] = IGNORE_INDEX
    return Problem(
        x=rng.standard_normal((N, H)).astype(np.float32),
        weight=(rng.standard_normal((V, H)) / np.sqrt(H)).astype(np.float32),
        bias=rng.standard_normal(V).astype(np.float32),
        target=(target / target.sum(-1, keepdims=True)).astype(np.float32),
        labels=labels,
    )


def reference(p: Problem) -> dict[str, np.ndarray]:
    """Loss and gradients in float64: ``batchmean`` over kept rows, probabilities as target."""
    x, w, b, t = (np.asarray(a, np.float64) for a in (p.x, p.weight, p.bias, p.target))
    keep = (p.labels != IGNORE_INDEX)[:, None]
    z = (x @ w.T + b) / TEMPERATURE
    log_q = z - z.max(-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
    scale = 1.0 / keep.sum()  # IGNORED_FRACTION keeps most rows
    loss = scale * np.sum(keep * t * (np.log(t) - log_q))
    g = keep * scale * (np.exp(log_q) * t.sum(-1, keepdims=True) - t) / TEMPERATURE  # dL/dz
    return {"loss": np.asarray(loss), "grad_x": g @ w, "grad_weight": g.T @ x, "grad_bias": g.sum(0)}


def _run_torch(backend: str, p: Problem) -> tuple[str, dict[str, np.ndarray]]:
    import torch

    import torch_kl

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x, w, b = (torch.tensor(a, device=dev, requires_grad=True) for a in (p.x, p.weight, p.bias))
    target, labels = torch.tensor(p.target, device=dev), torch.tensor(p.labels, device=dev)
    loss = torch_kl.fused_linear_kl_div(
        x, w, target, labels, bias=b, temperature=TEMPERATURE, chunk_size=CHUNK_SIZE, backend=backend
    )
    loss.backward()
    outs = (loss.detach(), x.grad, w.grad, b.grad)
    return dev.type, {k: v.cpu().numpy() for k, v in zip(OUTPUTS, outs, strict=True)}


def _run_jax(backend: str, p: Problem) -> tuple[str, dict[str, np.ndarray]]:
    import jax
    import jax.numpy as jnp

    import jax_kl

    def loss_fn(x: jax.Array, w: jax.Array, b: jax.Array, target: jax.Array, labels: jax.Array) -> jax.Array:
        return jax_kl.fused_linear_kl_div(
            x, w, target, labels, bias=b, temperature=TEMPERATURE, chunk_size=CHUNK_SIZE, backend=backend
        )

    grad_fn = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2)))
    loss, grads = grad_fn(p.x, p.weight, p.bias, p.target, jnp.asarray(p.labels, jnp.int32))
    return jax.devices()[0].platform, {k: np.asarray(v) for k, v in zip(OUTPUTS, (loss, *grads), strict=True)}


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    got = np.asarray(got, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check_backend(backend: str, p: Problem, want: dict[str, np.ndarray]) -> Row:
    """Run one backend and compare every output with the reference; never raises."""
    framework, name = backend.split("/")
    run = _run_torch if framework == "torch" else _run_jax
    what, interpreter = BACKENDS[backend]
    try:
        device, got = run(name, p)
    except ImportError as e:
        return Row(backend, "-", "skipped", None, f"{e.name or e} is not installed")
    except ValueError as e:
        if "not available here" in str(e):
            return Row(backend, "-", "skipped", None, str(e).split("not available here: ", 1)[-1])
        return Row(backend, "-", "FAIL", None, f"ValueError: {e}")
    except Exception as e:  # a broken backend is a failed check, not a crash of the self-test
        return Row(backend, "-", "FAIL", None, f"{type(e).__name__}: {e}")
    error = float(np.max([_rel(got[k], want[k]) for k in OUTPUTS]))  # np.max keeps a NaN
    note = f"{what}, {interpreter}" if interpreter and device == "cpu" else what
    return Row(backend, device, "pass" if error <= TOLERANCE else "FAIL", error, note)


def main(seed: int) -> int:
    """Check every backend, print the table; return 1 if an available backend fails, else 0."""
    p = make_problem(seed)
    want = reference(p)
    kept = int((p.labels != IGNORE_INDEX).sum())
    print(
        f"fused-kl check: N={N} ({kept} kept), H={H}, V={V}, float32 with bias, temperature {TEMPERATURE:g}, "
        f"chunks of {CHUNK_SIZE} rows; loss, grad_x, grad_weight and grad_bias against float64 "
        f"(tolerance {TOLERANCE:g}, relative norm)"
    )
    print(f"{'backend':<14}{'device':<8}{'result':<9}{'max rel err':<13}note")
    rows = []
    for backend in BACKENDS:
        row = check_backend(backend, p, want)
        rows.append(row)
        error = "-" if row.error is None else f"{row.error:.2e}"
        print(f"{row.backend:<14}{row.device:<8}{row.result:<9}{error:<13}{row.note}", flush=True)
    counts = {r: sum(row.result == r for row in rows) for r in ("pass", "FAIL", "skipped")}
    print(f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skipped']} skipped")
    return 1 if counts["FAIL"] else 0
