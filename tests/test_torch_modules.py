"""torch_kl's ``nn.Module``s: what they refuse at construction (a keyword they set themselves or
cannot pass, a value or group the call would refuse), and that they pass what they hold (a
chunk size, a 0-d tensor, each batch's top-k token ids) as the call does."""

from __future__ import annotations

import pytest
import torch
from harness import make_inputs, torch_tensors

import torch_kl
import torch_kl.driver


def _tensors(inp):
    """``x, weight, target, labels`` and the teacher's keywords, as torch tensors."""
    tensors = torch_tensors(inp, requires_grad=True)
    return (*(tensors.pop(k) for k in ("x", "weight", "target", "labels")), tensors)


def test_jsd_module_honours_chunk_size(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = []
    plan_chunks = torch_kl.driver.plan_chunks
    monkeypatch.setattr(torch_kl.driver, "plan_chunks", lambda *a, **k: sizes.append(a[3]) or plan_chunks(*a, **k))
    inp = make_inputs(10, 4, 19, target_format="hidden")
    x, w, t, lab, teacher = _tensors(inp)
    torch_kl.FusedLinearJSDLoss(chunk_size=3, backend="torch")(x, w, t, teacher["teacher_weight"], lab)
    assert sizes == [3]


@pytest.mark.parametrize(
    ("module", "keyword", "message"),
    [
        ("FusedLinearKLDivLoss", "bias", "this module sets it"),
        ("FusedLinearKLDivLoss", "labels", "this module sets it"),
        ("FusedLinearJSDLoss", "reduction", "this module sets it"),
        ("FusedLinearJSDLoss", "target_format", "this module sets it"),
        ("FusedLinearJSDLoss", "teacher_bias", "this module sets it"),
        ("FusedLinearJSDLoss", "x", "this module sets it"),
        ("FusedLinearJSDLoss", "weight", "this module sets it"),
        ("FusedLinearCrossEntropyLoss", "bias", "this module sets it"),
        # a misspelt keyword, refused where it is written rather than at the first call
        ("FusedLinearKLDivLoss", "temprature", r"not a keyword of torch_kl\.fused_linear_kl_div$"),
        ("FusedLinearJSDLoss", "temprature", r"not a keyword of torch_kl\.fused_linear_kl_div$"),
        ("FusedLinearCrossEntropyLoss", "temperature", r"not a keyword of torch_kl\.fused_linear_cross_entropy$"),
    ],
)
def test_modules_refuse_at_construction_a_keyword_they_cannot_pass(module: str, keyword: str, message: str) -> None:
    with pytest.raises(TypeError, match=rf"^{keyword}: {message}"):
        getattr(torch_kl, module)(**{keyword: 2.0})


BAD_MODULE_VALUES = [
    ("FusedLinearJSDLoss", dict(beta=5)),
    ("FusedLinearJSDLoss", dict(weight_hard_loss=-1.0)),
    ("FusedLinearJSDLoss", dict(temperature=float("nan"))),
    ("FusedLinearKLDivLoss", dict(temperature=0)),
    ("FusedLinearKLDivLoss", dict(reduction="none")),
    ("FusedLinearKLDivLoss", dict(target_format="topk_log_probs", beta=0.5)),
    ("FusedLinearKLDivLoss", dict(chunk_size=0)),
    ("FusedLinearCrossEntropyLoss", dict(label_smoothing=1.0)),
    ("FusedLinearCrossEntropyLoss", dict(reduction="batchmean")),
    ("FusedLinearKLDivLoss", dict(backend="nope")),
    ("FusedLinearCrossEntropyLoss", dict(backend="nope")),
    ("FusedLinearKLDivLoss", dict(accum_dtype="float32")),
    ("FusedLinearKLDivLoss", dict(return_row_losses="yes")),
    ("FusedLinearKLDivLoss", dict(target_format="hidden")),
    ("FusedLinearKLDivLoss", dict(teacher_weight=torch.zeros(5, 3))),
    ("FusedLinearJSDLoss", dict(target_indices=torch.zeros(2, 1, dtype=torch.long))),
    ("FusedLinearKLDivLoss", dict(temperature=torch.tensor(0.0))),
    ("FusedLinearJSDLoss", dict(beta=torch.tensor(2.0))),
]


@pytest.mark.parametrize(("module", "options"), BAD_MODULE_VALUES, ids=[f"{m}-{o}" for m, o in BAD_MODULE_VALUES])
def test_modules_refuse_at_construction_a_value_the_call_refuses(module: str, options: dict) -> None:
    """The function's own error, at construction instead of the first ``forward``."""
    x, w, t, lab = torch.zeros(2, 3), torch.zeros(5, 3), torch.full((2, 5), 0.2), torch.zeros(2, dtype=torch.long)
    call = dict(options)
    if module == "FusedLinearCrossEntropyLoss":
        fn, args = torch_kl.fused_linear_cross_entropy, (x, w, lab)
    else:
        fn, args = torch_kl.fused_linear_kl_div, (x, w, t, lab)
        if module == "FusedLinearJSDLoss":  # its defaults, beside the value tried
            call = dict(beta=0.5, weight_hard_loss=0.5, weight_soft_loss=0.5, target_format="hidden") | options
    with pytest.raises((TypeError, ValueError)) as by_call:
        fn(*args, **call)
    with pytest.raises(by_call.type) as at_construction:
        getattr(torch_kl, module)(**options)
    assert str(at_construction.value) == str(by_call.value)


@pytest.mark.parametrize("group", ["batch_group", "vocab_group"])
def test_modules_refuse_at_construction_a_group_that_is_not_a_process_group(group: str) -> None:
    with pytest.raises(TypeError, match=rf"^{group}: expected a torch.distributed ProcessGroup, got int"):
        torch_kl.FusedLinearKLDivLoss(**{group: 3})


def test_modules_take_a_0d_tensor_for_a_value_as_the_call_does() -> None:
    x, w, t = torch.randn(4, 3), torch.randn(7, 3), torch.softmax(torch.randn(4, 7), -1)
    lab = torch.tensor([1, 2, 3, -100])
    kl = torch_kl.FusedLinearKLDivLoss(temperature=torch.tensor(2.0), beta=torch.tensor(0.25), backend="torch")
    want = torch_kl.fused_linear_kl_div(x, w, t, temperature=2.0, beta=0.25, backend="torch")
    assert float(kl(x, w, t)) == float(want)
    ce = torch_kl.FusedLinearCrossEntropyLoss(label_smoothing=torch.tensor(0.1), backend="torch")
    want = torch_kl.fused_linear_cross_entropy(x, w, lab, label_smoothing=0.1, backend="torch")
    assert float(ce(x, w, lab)) == float(want)


def test_kl_module_takes_each_batch_top_k_token_ids() -> None:
    x, w = torch.randn(4, 3), torch.randn(7, 3)
    idx = torch.tensor([[0, 5], [1, 2], [6, 3], [4, 0]])
    t = torch.log_softmax(torch.randn(4, 2), -1) - 0.1
    module = torch_kl.FusedLinearKLDivLoss(target_format="topk_log_probs", backend="torch")
    for ids in (idx, idx.flip(1)):
        topk = dict(target_format="topk_log_probs", target_indices=ids, backend="torch")
        want = torch_kl.fused_linear_kl_div(x, w, t, **topk)
        assert float(module(x, w, t, target_indices=ids)) == float(want)


def test_jsd_module_refuses_row_losses_beside_its_parts() -> None:
    with pytest.raises(ValueError, match=r"^return_row_losses: not with return_soft_hard_loss=True"):
        torch_kl.FusedLinearJSDLoss(return_soft_hard_loss=True, return_row_losses=True)
    with pytest.raises(TypeError, match=r"^return_soft_hard_loss: expected True or False, got str"):
        torch_kl.FusedLinearJSDLoss(return_soft_hard_loss="yes")
