"""GPU tests of the loss API beyond the family (row weights, per-row losses, z-loss, rows a
compiled call could not check) and of unaligned vocabularies: every GPU backend against the
float64 reference with the compiled kernels, where the CPU suite runs the interpreters.

Run on a GPU machine: ``XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
from gpu_runners import GPU_BACKENDS, rel, run_gpu  # noqa: E402
from harness import TOLERANCE  # noqa: E402
from test_gpu_family import _inputs  # noqa: E402

import jax_kl  # noqa: E402
import torch_kl  # noqa: E402
from fused_kl.reference import reference, reference_cross_entropy  # noqa: E402

# (N, H, V, dtype): an odd vocabulary in float32, and in bf16 vocabularies one token past a
# multiple of 64 (the chunk buffers' row stride is padded; the TMA moves aligned rows only).
SHAPES = {
    "fp32-odd": (1692, 167, 1423, "float32"),
    "bf16-32k": (2048, 1024, 32000, "bfloat16"),
    "bf16-gpt2": (1536, 512, 50257, "bfloat16"),
    "bf16-32k+1": (1024, 512, 32001, "bfloat16"),
}
TEACHERS = {
    "probs": dict(target_format="probs"),
    "hidden": dict(target_format="hidden"),
    "topk": dict(target_format="topk_log_probs"),
    "ce": dict(),
}


def _row_weight(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(n, device="cuda", generator=g) * 2


def _check(backend: str, shape: str, teacher: str, **options) -> None:
    n, h, v, dtype = SHAPES[shape]
    ce = teacher == "ce"
    x, w, t, lab, extra = _inputs(n, h, v, dtype, fmt=TEACHERS[teacher].get("target_format", "probs"))
    opts = TEACHERS[teacher] | options
    math = {k: v for k, v in opts.items() if k != "chunk_size"}
    if ce:
        ref = reference_cross_entropy(x, w, lab, **math)
        loss, gx, gw, _ = run_gpu(backend, x, w, t, lab, fn="fused_linear_cross_entropy", **opts)
    else:
        ref = reference(x, w, t, lab, **math, **extra)
        loss, gx, gw, _ = run_gpu(backend, x, w, t, lab, **opts, **extra)
    tol = TOLERANCE[dtype]
    assert torch.isfinite(loss), loss
    assert abs(float(loss) - ref.loss) <= tol * max(abs(ref.loss), 1e-2), (float(loss), ref.loss)
    errors = {"grad_x": rel(gx, ref.grad_x), "grad_weight": rel(gw, ref.grad_weight)}
    assert all(e <= tol for e in errors.values()), errors


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("shape", ("fp32-odd", "bf16-32k"))
@pytest.mark.parametrize("teacher", TEACHERS)
def test_row_weight_and_z_loss(backend: str, shape: str, teacher: str) -> None:
    n = SHAPES[shape][0]
    hard = {} if teacher == "ce" else {"weight_hard_loss": 0.5}
    _check(backend, shape, teacher, row_weight=_row_weight(n), z_loss_weight=1e-3, **hard)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("shape", ("bf16-gpt2", "bf16-32k+1"))
@pytest.mark.parametrize("teacher", TEACHERS)
def test_unaligned_vocabulary(backend: str, shape: str, teacher: str) -> None:
    _check(backend, shape, teacher, chunk_size=512)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("teacher", ("probs", "ce"))
def test_row_losses_match_the_reference(backend: str, teacher: str) -> None:
    n, h, v, dtype = SHAPES["fp32-odd"]
    x, w, t, lab, _ = _inputs(n, h, v, dtype)
    rw = _row_weight(n)
    framework, name = backend.split("/")
    if name == "pallas_mosaic":
        pytest.skip("the TMA cannot move this shape's chunks: pallas_mosaic refuses it (test_gpu_mosaic)")
    opts = dict(row_weight=rw, return_row_losses=True, z_loss_weight=1e-3)
    if teacher == "ce":
        ref = reference_cross_entropy(x, w, lab, **opts)
    else:
        opts |= dict(weight_hard_loss=0.5, beta=0.5)
        ref = reference(x, w, t, lab, **opts)
    if framework == "torch":
        head = (x, w) if teacher == "ce" else (x, w, t)
        fn = torch_kl.fused_linear_cross_entropy if teacher == "ce" else torch_kl.fused_linear_kl_div
        loss, rows = fn(*head, lab, backend=name, **opts)
    else:
        j = lambda a: jax.dlpack.from_dlpack(a.detach())
        head = (j(x), j(w)) if teacher == "ce" else (j(x), j(w), j(t))
        fn = jax_kl.fused_linear_cross_entropy if teacher == "ce" else jax_kl.fused_linear_kl_div
        opts["row_weight"] = j(rw)
        loss, rows = fn(*head, j(lab).astype("int32"), backend=name, **opts)
        loss, rows = torch.from_dlpack(loss), torch.from_dlpack(rows)
    assert rows.dtype == torch.float32 and rows.shape == (n,)
    assert rel(rows, ref.row_losses) <= TOLERANCE[dtype], rel(rows, ref.row_losses)
    assert abs(float(loss) - ref.loss) <= TOLERANCE[dtype] * abs(ref.loss)


def test_a_compiled_call_gives_nan_for_a_row_it_could_not_check() -> None:
    n, h, v, dtype = SHAPES["bf16-32k"]
    x, w, t, lab, _ = _inputs(n, h, v, dtype)
    lab = lab.clone()
    lab[3] = v  # kept, out of range: only a compiled call lets it through
    xg = x.detach().clone().requires_grad_()
    fn = torch.compile(torch_kl.fused_linear_kl_div, fullgraph=True)
    loss = fn(xg, w, t, lab, weight_hard_loss=0.5, backend="triton")
    loss.backward()
    assert torch.isnan(loss)
    assert torch.isnan(xg.grad[3]).all()
    assert torch.isfinite(xg.grad[torch.arange(n, device="cuda") != 3]).all()
