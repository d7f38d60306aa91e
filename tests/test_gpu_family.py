"""GPU tests of the loss family and the teachers without ``[N, V]``: every GPU backend against
the float64 reference; Liger 0.8.5's JSD and cross-entropy losses as drop-in anchors; memory
flat in N for the teacher head and top-k teachers.

Run on a GPU machine: ``XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
from gpu_runners import GPU_BACKENDS, rel, run_gpu  # noqa: E402
from harness import TOLERANCE  # noqa: E402

import torch_kl  # noqa: E402
from fused_kl.reference import reference, reference_cross_entropy  # noqa: E402

SHAPES = {"fp32-odd": (1692, 167, 1423, "float32"), "bf16-32k": (2048, 1024, 32000, "bfloat16")}
HIDDEN_T = 96  # the teacher's hidden size


def _inputs(n, h, v, dtype, *, seed=0, fmt="probs", k=64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    x = torch.randn(n, h, device="cuda", generator=g).to(dt)
    w = (torch.randn(v, h, device="cuda", generator=g) * (2.0 / h**0.5)).to(dt)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[torch.rand(n, device="cuda", generator=g) < 0.25] = -100
    extra = {}
    if fmt == "hidden":
        t = torch.randn(n, HIDDEN_T, device="cuda", generator=g).to(dt)
        extra["teacher_weight"] = (torch.randn(v, HIDDEN_T, device="cuda", generator=g) / HIDDEN_T**0.5 * 3).to(dt)
    elif fmt == "topk_log_probs":
        raw = torch.randn(n, v, device="cuda", generator=g) * 3
        t, idx = raw.log_softmax(-1).topk(k, dim=-1)
        t[: n // 10, k // 2 :] = float("-inf")  # padding
        extra["target_indices"] = idx
    else:
        raw = torch.randn(n, v, device="cuda", generator=g) * 2
        t = {"probs": raw.softmax(-1), "log_probs": raw.log_softmax(-1), "logits": raw}[fmt]
    return x, w, t, labels, extra


def _check(backend, inputs, tol, fn="fused_linear_kl_div", **options):
    x, w, t, lab, extra = inputs
    opts = {k: v for k, v in options.items() if k not in ("chunk_size", "accum_dtype")}
    if fn == "fused_linear_cross_entropy":
        ref = reference_cross_entropy(x, w, lab, **opts)
    else:
        ref = reference(x, w, t, lab, **opts, **extra)
    loss, gx, gw, _ = run_gpu(backend, x, w, t, lab, fn=fn, **options, **extra)
    assert torch.isfinite(loss), loss
    assert abs(float(loss) - ref.loss) <= tol * max(abs(ref.loss), 1e-2), (float(loss), ref.loss)
    errors = {"grad_x": rel(gx, ref.grad_x), "grad_weight": rel(gw, ref.grad_weight)}
    assert all(e <= tol for e in errors.values()), errors


LOSSES = {
    "reverse": dict(beta=1.0),
    "jsd": dict(beta=0.5, temperature=2.0),
    "jsd-hard": dict(beta=0.3, weight_hard_loss=0.5, weight_soft_loss=0.5, label_smoothing=0.1),
    "softcap-scale": dict(softcap=30.0, logit_scale=0.5, beta=0.5),
    "fwd-hard-T": dict(weight_hard_loss=1.0, temperature=2.0, reduction="sum"),
}


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("loss", LOSSES)
def test_family(backend, shape, loss):
    n, h, v, dtype = SHAPES[shape]
    for fmt in ("probs", "logits"):
        _check(backend, _inputs(n, h, v, dtype, fmt=fmt), TOLERANCE[dtype], target_format=fmt, **LOSSES[loss])


TEACHERS = {
    "hidden": dict(target_format="hidden", teacher_softcap=20.0),
    "hidden-jsd": dict(target_format="hidden", beta=0.5, weight_hard_loss=0.5),
    "topk-bin": dict(target_format="topk_log_probs"),
    "topk-renormalize": dict(target_format="topk_log_probs", topk_tail="renormalize", temperature=2.0),
    "topk-drop-hard": dict(target_format="topk_log_probs", topk_tail="drop", weight_hard_loss=0.3, softcap=20.0),
}


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("teacher", TEACHERS)
def test_teachers(backend, shape, teacher):
    n, h, v, dtype = SHAPES[shape]
    opts = TEACHERS[teacher]
    _check(backend, _inputs(n, h, v, dtype, fmt=opts["target_format"]), TOLERANCE[dtype], chunk_size=512, **opts)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(
    "options", ({}, {"label_smoothing": 0.1}, {"label_smoothing": 0.1, "softcap": 30.0, "reduction": "sum"})
)
def test_cross_entropy(backend, options):
    n, h, v, dtype = SHAPES["bf16-32k"]
    _check(backend, _inputs(n, h, v, dtype), TOLERANCE[dtype], fn="fused_linear_cross_entropy", **options)


def _liger():
    return pytest.importorskip("liger_kernel.chunked_loss")


@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
def test_jsd_module_matches_liger(beta):
    """``FusedLinearJSDLoss`` against Liger's ``LigerFusedLinearJSDLoss`` itself: loss, soft, hard, gradients."""
    liger = _liger()
    n, h, v, ht = 2048, 1024, 32000, 512
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(n, h, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(v, h, device="cuda", generator=g, dtype=torch.bfloat16) / h**0.5
    tx = torch.randn(n, ht, device="cuda", generator=g, dtype=torch.bfloat16)
    tw = torch.randn(v, ht, device="cuda", generator=g, dtype=torch.bfloat16) / ht**0.5
    lab = torch.randint(0, v, (n,), device="cuda", generator=g)
    lab[::5] = -100
    kw = dict(weight_hard_loss=0.3, weight_soft_loss=0.7, beta=beta, temperature=2.0, return_soft_hard_loss=True)
    outs = {}
    for name, module in (("ours", torch_kl.FusedLinearJSDLoss(**kw)), ("liger", liger.LigerFusedLinearJSDLoss(**kw))):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss, soft, hard = module(xi, wi, tx, tw, lab)
        loss.backward()
        outs[name] = (float(loss), float(soft), float(hard), xi.grad, wi.grad)
    ours, ref = outs["ours"], outs["liger"]
    for a, b in zip(ours[:3], ref[:3], strict=True):
        assert abs(a - b) <= 2e-2 * max(abs(b), 1e-2), (ours[:3], ref[:3])
    assert rel(ours[3], ref[3]) < 3e-2 and rel(ours[4], ref[4]) < 3e-2


def test_memory_flat_in_n_for_teacher_head_and_topk():
    """Peak memory beyond the gradients does not grow with N for the head and top-k teachers."""
    h, v = 2048, 128256
    peaks = {}
    for fmt in ("hidden", "topk_log_probs"):
        for n in (4096, 8192):
            x, w, t, lab, extra = _inputs(n, h, v, "bfloat16", fmt=fmt)
            if fmt == "hidden":
                t, extra = torch.randn(n, h, device="cuda", dtype=torch.bfloat16), {
                    "teacher_weight": torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / h**0.5}
            x.requires_grad_()
            w.requires_grad_()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            torch_kl.fused_linear_kl_div(x, w, t, lab, target_format=fmt, chunk_size=1024, **extra).backward()
            torch.cuda.synchronize()
            grads = x.numel() * 2 + w.numel() * 2
            peaks[(fmt, n)] = torch.cuda.max_memory_allocated() - base - grads
            del x, w, t, extra
    for fmt in ("hidden", "topk_log_probs"):
        assert peaks[(fmt, 8192)] <= peaks[(fmt, 4096)] * 1.1 + (64 << 20), peaks
        assert peaks[(fmt, 8192)] < 1 << 30, peaks
