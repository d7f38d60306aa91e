"""``fused-kl demo``: distil a fixed random teacher into a small student, four ways at once.

The four runs train the same student (a one-layer MLP and an LM head ``[V, H]``) from the same
initial parameters on the same batches: ``jax_kl`` under ``jax.grad`` and optax's Adam,
``torch_kl`` under autograd and ``torch.optim.Adam``, and each through the DLPack bridge into
the other framework's kernel (``torch_kl`` backend ``"pallas"``, ``jax_kl`` backend ``"triton"``).
They compute one function of the same numbers, so their loss curves agree up to float32
rounding, and the demo fails when they do not; each run's first step (loss and every
parameter's gradient) is also checked against the float64 reference, ``fused_kl.reference``.
Everything is embedded: no download.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .check import relative_error

# Sizes small enough that the bridges, interpreted on CPU (about 4 ms per row for the Triton
# interpreter), keep the whole demo to a minute or two on two cores (the interpreted
# jax→triton bridge takes most of it).
ROWS, D_IN, HIDDEN, VOCAB, BATCH = 4096, 64, 64, 512, 16
TEACHER_HIDDEN = 256  # wider than the student, so the KL cannot reach 0
TEACHER_SCALE = 8.0  # logit scale of the teacher: peaked, but not one-hot, soft targets
TEMPERATURE = 2.0
LEARNING_RATE = 1e-2
REPORT_EVERY = 25
# Float32 rounding differs between the frameworks' GEMMs by ~1e-7 and Adam carries it along;
# 1e-3 is far above that and far below any real disagreement.
TOLERANCE = 1e-3


@dataclass(frozen=True)
class Problem:
    """The embedded data set, the student's initial parameters and every run's batches."""

    inputs: np.ndarray  # [ROWS, D_IN] float32
    target: np.ndarray  # [ROWS, VOCAB] float32: the teacher's probabilities at TEMPERATURE
    init: dict[str, np.ndarray]  # w1 [D_IN, HIDDEN], b1 [HIDDEN], head [VOCAB, HIDDEN]
    batches: np.ndarray  # [steps, BATCH] row indices


@dataclass(frozen=True)
class RunResult:
    """One run's loss curve and its first step's gradients."""

    losses: np.ndarray  # [steps] float64
    first_grads: dict[str, np.ndarray]  # the gradient of every parameter at step 0 (the initial ones)


def make_problem(steps: int, seed: int) -> Problem:
    """The seeded teacher, data set, initial student and batch order (float64 math, float32 out)."""
    rng = np.random.default_rng(seed)
    inputs = rng.standard_normal((ROWS, D_IN))
    teacher_hidden = np.tanh(inputs @ rng.standard_normal((D_IN, TEACHER_HIDDEN)) / np.sqrt(D_IN))
    teacher_head = rng.standard_normal((VOCAB, TEACHER_HIDDEN)) * TEACHER_SCALE / np.sqrt(TEACHER_HIDDEN)
    z = teacher_hidden @ teacher_head.T / TEMPERATURE
    probs = np.exp(z - z.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    init = {
        "w1": rng.standard_normal((D_IN, HIDDEN)) / np.sqrt(D_IN),
        "b1": np.zeros(HIDDEN),
        "head": rng.standard_normal((VOCAB, HIDDEN)) / np.sqrt(HIDDEN),
    }
    return Problem(
        inputs=inputs.astype(np.float32),
        target=probs.astype(np.float32),
        init={k: v.astype(np.float32) for k, v in init.items()},
        batches=rng.integers(0, ROWS, (steps, BATCH)),
    )


def first_step_reference(problem: Problem) -> tuple[float, dict[str, np.ndarray]]:
    """The first batch's loss and every parameter's gradient at the initial parameters, in float64.

    ``fused_kl.reference`` gives the head's loss and its gradients for ``h`` and ``head``; the
    chain rule through ``h = tanh(inputs @ w1 + b1)`` gives those of ``w1`` and ``b1``.
    """
    from fused_kl.reference import reference

    p = {k: v.astype(np.float64) for k, v in problem.init.items()}
    idx = problem.batches[0]
    inputs = problem.inputs[idx].astype(np.float64)
    h = np.tanh(inputs @ p["w1"] + p["b1"])
    want = reference(h, p["head"], problem.target[idx], temperature=TEMPERATURE)
    pre = want.grad_x * (1.0 - h**2)  # through tanh
    return want.loss, {"w1": inputs.T @ pre, "b1": pre.sum(0), "head": want.grad_weight}


def torch_run(problem: Problem, backend: str, steps: Iterable[int]) -> RunResult:
    """Train with ``torch_kl.FusedLinearKLDivLoss``, autograd and ``torch.optim.Adam``."""
    import torch

    import torch_kl

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    inputs, target = torch.tensor(problem.inputs, device=dev), torch.tensor(problem.target, device=dev)
    batches = torch.tensor(problem.batches, device=dev)
    params = {k: torch.tensor(v, device=dev, requires_grad=True) for k, v in problem.init.items()}
    fused = torch_kl.FusedLinearKLDivLoss(temperature=TEMPERATURE, backend=backend)

    def loss_fn(idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(inputs[idx] @ params["w1"] + params["b1"])
        return fused(h, params["head"], target[idx])

    opt = torch.optim.Adam(params.values(), lr=LEARNING_RATE)
    losses, first_grads = [], {}
    for step in steps:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(batches[step])
        loss.backward()
        if step == 0:
            first_grads = {k: p.grad.cpu().numpy() for k, p in params.items()}
        opt.step()
        losses.append(loss.detach())
    return RunResult(torch.stack(losses).double().cpu().numpy(), first_grads)


def jax_run(problem: Problem, backend: str, steps: Iterable[int]) -> RunResult:
    """Train with ``jax_kl.fused_linear_kl_div``, ``jax.grad`` and ``optax.adam``."""
    import jax
    import jax.numpy as jnp
    import optax

    import jax_kl

    hi = jax.lax.Precision.HIGHEST  # full float32 GEMMs, as torch does by default (no TF32)
    inputs, target = jnp.asarray(problem.inputs), jnp.asarray(problem.target)
    batches = jnp.asarray(problem.batches)
    params = {k: jnp.asarray(v) for k, v in problem.init.items()}

    def loss_fn(params: dict, inputs: jax.Array, target: jax.Array, idx: jax.Array) -> jax.Array:
        h = jnp.tanh(jnp.dot(inputs[idx], params["w1"], precision=hi) + params["b1"])
        return jax_kl.fused_linear_kl_div(h, params["head"], target[idx], temperature=TEMPERATURE, backend=backend)

    opt = optax.adam(LEARNING_RATE)

    @jax.jit
    def train_step(params: dict, state, inputs: jax.Array, target: jax.Array, idx: jax.Array):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, target, idx)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, grads

    state = opt.init(params)
    losses, first_grads = [], {}
    for step in steps:
        params, state, loss, grads = train_step(params, state, inputs, target, batches[step])
        if step == 0:
            first_grads = {k: np.asarray(g) for k, g in grads.items()}
        losses.append(loss)
    return RunResult(np.asarray(jnp.stack(losses), np.float64), first_grads)


def _torch_peak_memory() -> str:
    """Peak memory of one fused vs unfused forward + backward of a real-sized LM head (GPU only)."""
    import torch
    import torch.nn.functional as F

    import torch_kl

    if not torch.cuda.is_available():
        return "no GPU: memory comparison skipped"
    n, h, v = 8192, 2048, 32768
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=gen, requires_grad=True)
    w = (torch.randn(v, h, device="cuda", generator=gen) / h**0.5).requires_grad_()
    target = torch.softmax(torch.randn(n, v, device="cuda", generator=gen), dim=-1)

    def peak_mib(loss_fn: Callable[[], torch.Tensor]) -> float:
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()  # the inputs: the same for both
        loss_fn().backward()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    fused = peak_mib(lambda: torch_kl.fused_linear_kl_div(x, w, target, temperature=TEMPERATURE))
    unfused = peak_mib(lambda: F.kl_div(F.log_softmax(x @ w.T / TEMPERATURE, dim=-1), target, reduction="batchmean"))
    return (
        f"peak memory above the inputs, one forward + backward of a float32 LM head N={n}, H={h}, V={v} "
        f"(torch): fused {fused:,.0f} MiB, unfused {unfused:,.0f} MiB ({unfused / fused:.1f}x less)"
    )


def _plot(curves: dict[str, np.ndarray], out: Path) -> None:
    """Loss curves (top) and each curve's relative difference from the jax run (bottom)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(curves["jax"]) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(2, 1))
    for (name, losses), style in zip(curves.items(), ("-", "--", "-.", ":"), strict=True):
        top.plot(steps, losses, style, label=name, linewidth=1.2)
    top.set_ylabel(f"KL(teacher || student), T={TEMPERATURE:g}")
    top.set_title("fused linear KL distillation: the same run in four ways")
    top.legend()
    for name, losses in list(curves.items())[1:]:
        bottom.plot(steps, np.abs(losses - curves["jax"]) / np.abs(curves["jax"]), label=f"{name} vs jax")
    bottom.set_yscale("log", nonpositive="mask")  # identical steps (difference 0) are not drawn
    bottom.axhline(TOLERANCE, color="red", linewidth=0.8, label="tolerance")
    bottom.set_xlabel("step")
    bottom.set_ylabel("relative difference")
    bottom.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _print_curves(curves: dict[str, np.ndarray]) -> None:
    steps = len(curves["jax"])
    print(f"{'step':>6}" + "".join(f"{name:>13}" for name in curves))
    for i in range(steps):
        if i == 0 or (i + 1) % REPORT_EVERY == 0 or i == steps - 1:
            print(f"{i + 1:>6}" + "".join(f"{c[i]:>13.6f}" for c in curves.values()))


def main(steps: int, out: Path, seed: int) -> int:
    """Run the demo; return 0 when the four curves and the unfused first step agree, else 1."""
    import jax
    import torch
    from tqdm import tqdm

    from jax_kl import backends as jax_backends
    from torch_kl import backends as torch_backends

    started = time.perf_counter()
    problem = make_problem(steps, seed)
    torch_dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def what(framework: str, requested: str, backend: Any) -> str:
        picked = "" if requested == backend.name else f" ({backend.name!r})"
        return f"{framework} backend {requested!r}{picked}: {backend.runs}"

    runs = {  # column -> (framework's run, backend, what it runs)
        "jax": (jax_run, "auto", what("jax_kl", "auto", jax_backends.resolve("auto"))),
        "torch": (torch_run, "auto", what("torch_kl", "auto", torch_backends.resolve("auto", torch_dev))),
        "torch→jax": (torch_run, "pallas", what("torch_kl", "pallas", torch_backends.REGISTRY["pallas"])),
        "jax→triton": (jax_run, "triton", what("jax_kl", "triton", jax_backends.REGISTRY["triton"])),
    }
    print(
        f"fused-kl demo: distil a random teacher (V={VOCAB}) into an MLP student (H={HIDDEN}), "
        f"{steps} Adam steps of {BATCH} rows from {ROWS}, temperature {TEMPERATURE:g}, seed {seed}"
    )
    print(f"devices: torch {torch_dev}, jax {jax.devices()[0].platform}; runs:")
    for name, (_, _, what) in runs.items():
        print(f"  {name:<11} {what}")

    results: dict[str, RunResult] = {}
    for name, (run, backend, _) in runs.items():
        results[name] = run(problem, backend, tqdm(range(steps), desc=f"{name:<11}", unit="step", leave=True))
    curves = {name: r.losses for name, r in results.items()}

    want_loss, want_grads = first_step_reference(problem)
    print(f"\nfirst step against the float64 reference (fused_kl.reference; loss {want_loss:.6f}):")
    print(f"  {'run':<11} {'fused loss':>12} {'loss rel diff':>14} {'grad rel diff':>14}")
    worst_reference = 0.0
    for name, r in results.items():
        loss_diff = abs(r.losses[0] - want_loss) / abs(want_loss)
        grad_diff = max(relative_error(r.first_grads[k], want_grads[k]) for k in want_grads)
        worst_reference = max(worst_reference, loss_diff, grad_diff)
        print(f"  {name:<11} {r.losses[0]:>12.6f} {loss_diff:>14.2e} {grad_diff:>14.2e}")

    print("\nloss curves:")
    _print_curves(curves)
    diffs = {name: float(np.max(np.abs(c - curves["jax"]) / np.abs(curves["jax"]))) for name, c in curves.items()}
    others = list(curves)[1:]
    worst = max(diffs[name] for name in others)
    print(
        "max relative difference from the jax curve: "
        + ", ".join(f"{name} {diffs[name]:.2e}" for name in others)
        + f" (tolerance {TOLERANCE:g})"
    )
    print(_torch_peak_memory())
    _plot(curves, out)
    print(f"wrote {out}  ({time.perf_counter() - started:.1f} s)")

    # ``not x <= tol`` also catches NaN
    if not worst <= TOLERANCE:
        print(f"FAILED: the loss curves diverge (max relative difference {worst:.2e} > {TOLERANCE:g})")
        return 1
    if not worst_reference <= TOLERANCE:
        print(f"FAILED: the first step differs from the float64 reference ({worst_reference:.2e} > {TOLERANCE:g})")
        return 1
    print("OK: the four runs agree")
    return 0
