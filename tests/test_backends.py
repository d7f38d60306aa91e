"""Every backend of both frameworks against the float64 reference, on one option matrix;
the fused cross-entropy; both frameworks' signatures; the ``nn.Module`` forms."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import (
    ALL_BACKENDS,
    TOLERANCE,
    TORCH_BACKENDS,
    Outputs,
    assert_matches,
    expected,
    make_inputs,
    rel_err,
    run,
    torch_tensors,
)

import jax_kl
import torch_kl

# (make_inputs keywords, options): together every option value, on small shapes, odd sizes included.
CASES = {
    # forward KL of dense teachers
    "probs-batchmean": (dict(n=23, h=8, v=41), dict()),
    "probs-sum-T2-bias": (dict(n=17, h=5, v=67, ignore_frac=None, bias=True), dict(reduction="sum", temperature=2.0)),
    # A truncated teacher (top-k cached probabilities): rows sum to less than 1, so S_i matters.
    "probs-truncated": (dict(n=19, h=6, v=45, zero_frac=0.5, min_mass=0.3), dict(temperature=1.5)),
    "probs-mean-T0.5": (dict(n=19, h=8, v=53), dict(reduction="mean", temperature=0.5)),
    "log_probs-bias": (dict(n=13, h=6, v=37, target_format="log_probs", bias=True), dict(temperature=2.0)),
    "log_probs-truncated-sum": (dict(n=12, h=5, v=33, target_format="log_probs", min_mass=0.2), dict(reduction="sum")),
    "logits-teacher-T": (dict(n=21, h=8, v=47, target_format="logits"), dict(teacher_temperature=3.0)),
    "logits-mean-bias": (
        dict(n=15, h=7, v=31, target_format="logits", bias=True), dict(reduction="mean", temperature=2.0)),
    "bf16-fp32-accum": (dict(n=33, h=16, v=61, dtype="bfloat16", bias=True), dict(accum_dtype="float32", chunk_size=8)),
    "bf16": (dict(n=29, h=16, v=43, dtype="bfloat16"), dict(chunk_size=5)),
    "fp16-logits": (dict(n=27, h=16, v=59, dtype="float16", target_format="logits"), dict()),
    "3d-input": (dict(n=12, h=8, v=37, lead=(3, 4)), dict(chunk_size=5)),
    "v41-n1": (dict(n=1, h=3, v=41, ignore_frac=None), dict()),
    "v1423": (dict(n=6, h=8, v=1423), dict(chunk_size=4)),
    "v4099-logits": (dict(n=5, h=4, v=4099, target_format="logits"), dict(chunk_size=3)),
    # float16 dL/dz scaled by 1/n would be subnormal: stored prescaled (fused_kl.rowmath.float16_unscale).
    "fp16-small-gradients": (dict(n=200, h=16, v=1000, dtype="float16"), dict(temperature=4.0)),
    "all-ignored": (dict(n=9, h=5, v=33, ignore_frac=1.0, bias=True), dict()),
    # the divergence family, the hard term, the logit transforms
    "reverse-probs-zeros": (dict(n=14, h=6, v=39, zero_frac=0.3), dict(beta=1.0)),
    "reverse-logits-sum": (
        dict(n=11, h=6, v=35, target_format="logits", bias=True), dict(beta=1.0, reduction="sum", temperature=1.5)),
    "jsd0.5-log_probs-mean": (dict(n=13, h=5, v=29, target_format="log_probs"), dict(beta=0.5, reduction="mean")),
    "jsd0.3-probs-zeros-T": (
        dict(n=16, h=6, v=43, zero_frac=0.4, one_hot_frac=0.2), dict(beta=0.3, temperature=2.0, chunk_size=5)),
    "hard-smoothing-T2": (
        dict(n=18, h=7, v=45, target_format="logits"),
        dict(weight_hard_loss=0.7, weight_soft_loss=0.4, label_smoothing=0.1, temperature=2.0)),
    "hard-only-sum": (
        dict(n=15, h=6, v=33, bias=True), dict(weight_hard_loss=1.0, weight_soft_loss=0.0, reduction="sum")),
    "scale-softcap-hard-jsd": (
        dict(n=17, h=8, v=51, target_format="logits", logit_scale=4.0),
        dict(logit_scale=1.7, softcap=5.0, beta=0.5, weight_hard_loss=0.5, label_smoothing=0.2)),
    "teacher-transform": (
        dict(n=14, h=6, v=37, target_format="logits", teacher_scale=4.0),
        dict(teacher_logit_scale=0.6, teacher_softcap=3.0, teacher_temperature=1.5, softcap=2.0)),
    "bf16-jsd-hard-fp32-accum": (
        dict(n=24, h=16, v=47, dtype="bfloat16", target_format="logits", bias=True),
        dict(beta=0.5, weight_hard_loss=0.5, accum_dtype="float32", chunk_size=7)),
    "fp16-reverse-hard-softcap": (
        dict(n=21, h=16, v=53, dtype="float16", target_format="log_probs"),
        dict(beta=1.0, weight_hard_loss=0.3, softcap=8.0, chunk_size=8)),
    "all-ignored-hard": (
        dict(n=7, h=5, v=23, ignore_frac=1.0, target_format="logits", bias=True), dict(beta=0.5, weight_hard_loss=1.0)),
    "v4100-jsd-hard": (
        dict(n=4, h=4, v=4100, target_format="logits"),
        dict(beta=0.5, weight_hard_loss=0.5, label_smoothing=0.1, chunk_size=3)),
    # teachers without [N, V]
    "hidden": (dict(n=19, h=8, v=41, target_format="hidden", ht=5), dict(chunk_size=6)),
    "hidden-bias-jsd-transform": (
        dict(n=15, h=6, v=37, target_format="hidden", ht=9, teacher_bias=True, bias=True),
        dict(beta=0.5, teacher_logit_scale=1.5, teacher_softcap=4.0, teacher_temperature=2.0)),
    "hidden-3d-reverse-hard": (
        dict(n=12, h=6, v=33, target_format="hidden", lead=(2, 6)), dict(beta=1.0, weight_hard_loss=0.4, chunk_size=5)),
    "hidden-bf16-mean": (
        dict(n=20, h=16, v=45, target_format="hidden", ht=16, dtype="bfloat16"), dict(reduction="mean", beta=0.3)),
    "topk-bin": (dict(n=17, h=6, v=43, target_format="topk_log_probs", k=5, pad_frac=0.4), dict(chunk_size=6)),
    "topk-renormalize-T": (
        dict(n=15, h=6, v=39, target_format="topk_log_probs", k=7, pad_frac=0.4),
        dict(topk_tail="renormalize", temperature=2.0)),
    "topk-drop-sum-bias": (
        dict(n=14, h=5, v=31, target_format="topk_log_probs", k=4, pad_frac=0.3, bias=True),
        dict(topk_tail="drop", reduction="sum")),
    "topk-bin-hard-softcap-3d": (
        dict(n=12, h=6, v=35, target_format="topk_log_probs", k=6, lead=(3, 4), pad_frac=0.3),
        dict(weight_hard_loss=0.5, label_smoothing=0.1, softcap=3.0, logit_scale=1.3)),
    "topk-all-tokens-mean": (dict(n=9, h=5, v=13, target_format="topk_log_probs", k=13), dict(reduction="mean")),
    "topk-bf16-renormalize": (
        dict(n=18, h=16, v=41, target_format="topk_log_probs", k=8, dtype="bfloat16"),
        dict(topk_tail="renormalize", accum_dtype="float32")),
    # bfloat16, uncapped, no bias, rows of 16-byte multiples: the Triton backend factors dL/dz
    "topk-bf16-factored-bin-hard": (
        dict(n=30, h=16, v=96, target_format="topk_log_probs", k=8, dtype="bfloat16", pad_frac=0.3),
        dict(weight_hard_loss=0.5, logit_scale=1.5, chunk_size=16)),
    "topk-bf16-factored-renormalize-T": (
        dict(n=21, h=16, v=64, target_format="topk_log_probs", k=6, dtype="bfloat16", logit_scale=4.0),
        dict(topk_tail="renormalize", temperature=2.0, reduction="sum", accum_dtype="float32")),
    "topk-v4099-drop": (
        dict(n=4, h=4, v=4099, target_format="topk_log_probs", k=20, pad_frac=0.5),
        dict(topk_tail="drop", chunk_size=3)),
}


def _zeros(out) -> None:
    """No row kept: exactly zero, never NaN."""
    assert out.loss == 0.0
    for g in (out.grad_x, out.grad_weight, out.grad_bias):
        assert g is None or not np.any(g)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(backend: str, case: str) -> None:
    shape, options = CASES[case]
    inp = make_inputs(**shape)
    out = run(backend, inp, **options)
    assert_matches(out, inp, **options)
    if case.startswith("all-ignored"):
        _zeros(out)


EMPTY = {
    "probs": (dict(), dict()),
    "hidden-jsd-hard": (dict(target_format="hidden", bias=True), dict(beta=0.5, weight_hard_loss=0.5)),
    "topk": (dict(target_format="topk_log_probs", k=3), dict(topk_tail="renormalize")),
}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("case", [*EMPTY, "cross_entropy"])
def test_empty_batch(backend: str, case: str) -> None:
    shape, options = EMPTY.get(case, (dict(), dict(fn="cross_entropy")))
    inp = make_inputs(0, 4, 11, **shape)
    out = run(backend, inp, **options)
    assert out.grad_x.shape == (0, 4) and out.grad_weight.shape == (11, 4)
    _zeros(out)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_upstream_gradient_scales_every_gradient(backend: str) -> None:
    inp = make_inputs(14, 6, 23, bias=True, target_format="logits")
    options = dict(beta=0.5, weight_hard_loss=0.5, softcap=3.0, chunk_size=8)
    out = run(backend, inp, upstream=-2.5, **options)
    assert_matches(out, inp, upstream=-2.5, **options)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_loss_only(backend: str) -> None:
    inp = make_inputs(14, 6, 23, target_format="hidden", teacher_bias=True)
    options = dict(beta=1.0, weight_hard_loss=0.3, chunk_size=8)
    out = run(backend, inp, grads=False, **options)
    assert out.grad_x is None and out.grad_weight is None
    assert_matches(out, inp, **options)


@pytest.mark.parametrize(
    ("options", "reads"), [({}, True), ({"beta": 1.0}, True), ({"beta": 0.5, "weight_hard_loss": 0.5}, False)]
)
def test_which_phases_read_the_probabilities(monkeypatch, options, reads) -> None:
    """The forward KL's statistics read the teacher's mass, reverse KL's make its sum ``R`` there;
    JSD's need neither (in torch_kl's Triton backend the logits GEMM makes them): only JSD reads
    the teacher in a ``mixture_sums`` pass of its own."""
    from torch_kl.backends import torch_phases

    seen, values = [], []
    real, real_mixture = torch_phases.stats, torch_phases.mixture_sums
    monkeypatch.setattr(torch_phases, "stats", lambda z, t, *rest: seen.append(t is not None) or real(z, t, *rest))
    monkeypatch.setattr(torch_phases, "mixture_sums", lambda *args: values.append(1) or real_mixture(*args))
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(12, 5, generator=gen), torch.randn(17, 5, generator=gen)
    target = torch.softmax(torch.randn(12, 17, generator=gen), -1)
    torch_kl.fused_linear_kl_div(x, w, target, torch.randint(0, 17, (12,), generator=gen), backend="torch", **options)
    assert seen == [reads]
    assert len(values) == (options.get("beta") == 0.5)


# fused_kl.rowmath.topk takes the student's mass off the teacher's top-k as q_t = 1 - Q (the contract's
# formula) in float32: once the student puts all but ~1e-6 of its mass on the top-k tokens, q_t is
# rounding noise, and so are the tail term p_t log(p_t / q_t) and r = p_t / q_t in dL/dz.
TOPK_TAIL_LIMIT = "known limitation (docs/contract.md): the 'bin' tail's q_t = 1 - Q cancels in float32"


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=TOPK_TAIL_LIMIT)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_topk_bin_tail_of_a_confident_student(backend: str) -> None:
    inp = make_inputs(4, 3, 64, target_format="topk_log_probs", k=5, ignore_frac=None)
    inp.target_indices[:] = np.arange(5)
    inp.target[:] = np.log([0.5, 0.2, 0.1, 0.06, 0.04])  # P = 0.9: p_t = 0.1
    inp.x[:] = [1.0, 0.0, 0.0]
    inp.weight[:, 0] = 0.0
    inp.weight[0, 0] = 20.0  # the student's logit of token 0: q_t = 63 exp(-20) ~ 1.3e-7
    assert_matches(run(backend, inp), inp)


# ---------------------------------------------------------------- the two frameworks' signatures

# How each framework names the devices a call is spread over: the one difference of the signatures.
LAYOUT_KEYWORDS = {"torch": ("batch_group", "vocab_group"), "jax": ("mesh", "batch_axis", "vocab_axis")}


@pytest.mark.parametrize("fn", ["fused_linear_kl_div", "fused_linear_cross_entropy"])
def test_both_frameworks_take_the_same_arguments(fn: str) -> None:
    """Mirror images: the same parameters in the same order, of the same kinds and defaults,
    but for the layout's keywords."""

    def parameters(module, framework: str) -> list[tuple]:
        params = inspect.signature(getattr(module, fn)).parameters.values()
        return [(p.name, p.kind, p.default) for p in params if p.name not in LAYOUT_KEYWORDS[framework]]

    assert parameters(torch_kl, "torch") == parameters(jax_kl, "jax")


# ---------------------------------------------------------------- fused cross-entropy

CE_CASES = {
    "mean-ignored": (dict(n=21, h=7, v=37), dict()),
    "sum-bias-smoothing": (dict(n=17, h=6, v=45, bias=True), dict(reduction="sum", label_smoothing=0.2)),
    "scale-softcap-3d": (dict(n=12, h=6, v=33, lead=(3, 4)), dict(logit_scale=2.0, softcap=4.0, chunk_size=5)),
    "bf16-fp32-accum": (
        dict(n=26, h=16, v=41, dtype="bfloat16", bias=True), dict(accum_dtype="float32", label_smoothing=0.1)),
    "fp16": (dict(n=40, h=16, v=53, dtype="float16"), dict(chunk_size=16)),
    "v4099": (dict(n=4, h=4, v=4099), dict(chunk_size=3)),
    "all-ignored": (dict(n=6, h=5, v=19, ignore_frac=1.0, bias=True), dict()),
    # bfloat16, no bias, no smoothing, rows of 16-byte multiples: the Triton backend factors dL/dz
    "bf16-factored": (dict(n=37, h=16, v=104, dtype="bfloat16"), dict(chunk_size=16)),
    "bf16-factored-softcap-sum": (
        dict(n=22, h=16, v=64, dtype="bfloat16", logit_scale=20.0, lead=(2, 11)),
        dict(reduction="sum", logit_scale=3.0, softcap=90.0, accum_dtype="float32")),
}


def _torch_cross_entropy(inp, reduction="mean", label_smoothing=0.0, logit_scale=1.0, softcap=None, **_) -> float:
    """``torch.nn.functional.cross_entropy`` of the materialised transformed logits, in float64."""
    x = torch.tensor(inp.x, dtype=torch.float64).reshape(-1, inp.x.shape[-1])
    z = x @ torch.tensor(inp.weight, dtype=torch.float64).T
    z = z if inp.bias is None else z + torch.tensor(inp.bias, dtype=torch.float64)
    z = logit_scale * z
    z = z if softcap is None else softcap * torch.tanh(z / softcap)
    labels = torch.tensor(inp.labels).reshape(-1)
    return float(F.cross_entropy(z, labels, reduction=reduction, label_smoothing=label_smoothing))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("case", list(CE_CASES))
def test_cross_entropy(backend: str, case: str) -> None:
    shape, options = CE_CASES[case]
    inp = make_inputs(**shape)
    out = run(backend, inp, fn="cross_entropy", **options)
    assert_matches(out, inp, fn="cross_entropy", **options)
    if case == "all-ignored":  # where torch's "mean" is 0 / 0 = NaN, the fused loss is exactly 0
        _zeros(out)
    else:
        want = _torch_cross_entropy(inp, **options)
        assert abs(out.loss - want) <= TOLERANCE[inp.dtype] * abs(want)


# ---------------------------------------------------------------- the nn.Module forms (torch)


def _tensors(inp, *names: str, grad: bool = True) -> list:
    tensors = torch_tensors(inp, requires_grad=grad)
    return [tensors.get(name) for name in names]


def _outputs(loss, *leaves) -> Outputs:
    return Outputs(float(loss.detach()), *(a.grad.double().numpy() for a in leaves))


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_kl_div_module_is_a_drop_in(backend: str) -> None:
    inp = make_inputs(12, 6, 29, bias=True, target_format="logits")
    x, w, t, lab, b = _tensors(inp, "x", "weight", "target", "labels", "bias")
    # Liger's constructor order: reduction, ignore_index, temperature, eps, accum_dtype; other keywords after.
    module = torch_kl.FusedLinearKLDivLoss("sum", -100, 2.0, 1e-10, None, target_format="logits", beta=0.5,
                                           backend=backend.split("/")[1])
    loss = module(x, w, t, lab, b)
    loss.backward()
    assert "reduction='sum'" in repr(module) and "beta=0.5" in repr(module)
    out = _outputs(loss, x, w, b)
    assert_matches(out, inp, reduction="sum", temperature=2.0, beta=0.5)


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_cross_entropy_module(backend: str) -> None:
    inp = make_inputs(15, 6, 31, bias=True)
    options = dict(reduction="sum", label_smoothing=0.1, softcap=3.0)
    x, w, lab, b = _tensors(inp, "x", "weight", "labels", "bias")
    loss = torch_kl.FusedLinearCrossEntropyLoss(**options, backend=backend.split("/")[1])(x, w, lab, b)
    loss.backward()
    out = _outputs(loss, x, w, b)
    assert_matches(out, inp, fn="cross_entropy", **options)


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
def test_jsd_module_returns_loss_soft_and_hard(backend: str) -> None:
    """``FusedLinearJSDLoss`` (Liger's positional order): ``(loss, soft, hard)`` with
    ``loss = w_soft soft + w_hard hard``, each part the function's, gradients of the whole."""
    inp = make_inputs(10, 6, 29, target_format="hidden", ht=5, teacher_bias=True, bias=True)
    name = backend.split("/")[1]
    args = _tensors(inp, "x", "weight", "target", "teacher_weight", "labels", "bias", "teacher_bias")
    # weight_hard_loss, weight_soft_loss, beta, ignore_index, temperature, compiled, chunk_size, return_soft_hard_loss
    module = torch_kl.FusedLinearJSDLoss(0.3, 0.7, 0.4, -100, 1.5, True, 6, True, backend=name)
    loss, soft, hard = module(*args)
    loss.backward()
    family = dict(beta=0.4, temperature=1.5)
    assert float(soft) == pytest.approx(expected(inp, **family).loss, rel=TOLERANCE["float32"])
    assert float(hard) == pytest.approx(expected(inp, fn="cross_entropy").loss, rel=TOLERANCE["float32"])
    assert float(loss.detach()) == pytest.approx(0.7 * float(soft) + 0.3 * float(hard), rel=1e-6)
    x, w, b = args[0], args[1], args[5]
    out = _outputs(loss, x, w, b)
    assert_matches(out, inp, weight_soft_loss=0.7, weight_hard_loss=0.3, **family)

    # return_soft_hard_loss=False: one fused call, the function's value bit for bit.
    x, w, t, tw, lab, b, tb = _tensors(inp, "x", "weight", "target", "teacher_weight", "labels", "bias", "teacher_bias",
                                       grad=False)
    single = torch_kl.FusedLinearJSDLoss(0.3, 0.7, 0.4, -100, 1.5, True, 6, backend=name)(x, w, t, tw, lab, b, tb)
    direct = torch_kl.fused_linear_kl_div(x, w, t, lab, bias=b, target_format="hidden", teacher_weight=tw,
                                          teacher_bias=tb, beta=0.4, temperature=1.5, weight_soft_loss=0.7,
                                          weight_hard_loss=0.3, chunk_size=6, backend=name)
    assert float(single) == float(direct)
    assert rel_err(float(single), float(loss.detach())) < TOLERANCE["float32"]


@pytest.mark.parametrize("hard_weight", [1e-7, 0.0])
def test_jsd_module_logs_the_hard_part_at_any_hard_weight(hard_weight: float) -> None:
    """A hard weight small beside the soft one (a warm-up schedule's first steps): the logged hard
    part is still the cross-entropy, not a difference of nearly equal numbers divided by it."""
    inp = make_inputs(10, 6, 29, target_format="hidden", ht=5)
    args = _tensors(inp, "x", "weight", "target", "teacher_weight", "labels", grad=False)
    module = torch_kl.FusedLinearJSDLoss(hard_weight, 1.0, 0.4, return_soft_hard_loss=True, backend="torch")
    _, _, hard = module(*args)
    assert float(hard) == pytest.approx(expected(inp, fn="cross_entropy").loss, rel=TOLERANCE["float32"])


def test_jsd_module_logs_no_hard_part_without_labels() -> None:
    """Without labels (a hard weight of 0) the logged hard part is 0; the soft part is the loss."""
    inp = make_inputs(10, 6, 29, target_format="hidden", ht=5)
    x, w, t, tw = _tensors(inp, "x", "weight", "target", "teacher_weight", grad=False)
    module = torch_kl.FusedLinearJSDLoss(0.0, 1.0, 0.4, return_soft_hard_loss=True, backend="torch")
    loss, soft, hard = module(x, w, t, tw, None)
    assert float(hard) == 0.0
    assert float(soft) == pytest.approx(float(loss), rel=1e-6)
