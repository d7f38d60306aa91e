"""torch_kl behaviour beyond the shared matrix: autograd, the module form, needs, autocast."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import assert_matches, make_inputs, run

import torch_kl
from torch_kl import chunked

BACKENDS = ("torch", "triton")


def _tensors(inp, requires_grad=True):
    x = torch.tensor(inp.x, requires_grad=requires_grad)
    w = torch.tensor(inp.weight, requires_grad=requires_grad)
    b = None if inp.bias is None else torch.tensor(inp.bias, requires_grad=requires_grad)
    lab = None if inp.labels is None else torch.tensor(inp.labels)
    return x, w, torch.tensor(inp.target), lab, b


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_is_a_drop_in(backend: str) -> None:
    inp = make_inputs(12, 6, 29, bias=True)
    x, w, t, lab, b = _tensors(inp)
    # Liger's constructor order: reduction, ignore_index, temperature, eps, accum_dtype.
    module = torch_kl.FusedLinearKLDivLoss("sum", -100, 2.0, 1e-10, None, backend=backend)
    loss = module(x, w, t, lab, b)
    loss.backward()
    assert "reduction='sum'" in repr(module)
    out = run(f"torch/{backend}", inp, reduction="sum", temperature=2.0)
    assert float(loss) == pytest.approx(out.loss, rel=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), out.grad_x, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_are_never_modified(backend: str) -> None:
    inp = make_inputs(10, 5, 23, bias=True)
    tensors = _tensors(inp)
    before = [None if a is None else a.detach().clone() for a in tensors]
    loss = torch_kl.fused_linear_kl_div(*tensors[:4], bias=tensors[4], backend=backend, chunk_size=3)
    loss.backward()
    for a, b in zip(tensors, before, strict=False):
        assert torch.equal(a.detach(), b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend: str) -> None:
    inp = make_inputs(9, 6, 31, target_format="log_probs")
    _x, _w, _t, lab, _ = _tensors(inp)
    x_nc = torch.tensor(inp.x.T.copy()).T.requires_grad_()  # column-major
    t_nc = torch.tensor(inp.target.T.copy()).T
    w_nc = torch.tensor(np.asfortranarray(inp.weight)).requires_grad_()
    assert not (x_nc.is_contiguous() or t_nc.is_contiguous())
    loss = torch_kl.fused_linear_kl_div(x_nc, w_nc, t_nc, lab, target_format="log_probs", backend=backend)
    loss.backward()
    want = run(f"torch/{backend}", inp, target_format="log_probs")
    assert float(loss) == pytest.approx(want.loss, rel=1e-6)
    np.testing.assert_allclose(x_nc.grad.numpy(), want.grad_x, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(w_nc.grad.numpy(), want.grad_weight, rtol=1e-5, atol=1e-7)


class _Spy:
    """Records what the chunk loop asks of the kernel and of the grad_weight GEMM."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.write_grad: list[bool] = []
        self.weight_gemms = 0
        kernel = chunked.row_kernel("torch")
        accumulate = chunked._accumulate

        def spy_kernel(*args):
            self.write_grad.append(args[-1])
            return kernel(*args)

        def spy_accumulate(*args):
            self.weight_gemms += 1
            return accumulate(*args)

        monkeypatch.setattr(chunked, "row_kernel", lambda backend: spy_kernel)
        monkeypatch.setattr(chunked, "_accumulate", spy_accumulate)


def test_loss_only_without_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch)
    inp = make_inputs(10, 4, 19)
    x, w, t, lab, _ = _tensors(inp)
    with torch.no_grad():
        loss = torch_kl.fused_linear_kl_div(x, w, t, lab, backend="torch", chunk_size=4)
    assert not loss.requires_grad
    assert spy.write_grad == [False] * 3 and spy.weight_gemms == 0
    loss2 = torch_kl.fused_linear_kl_div(x.detach(), w.detach(), t, lab, backend="torch", chunk_size=4)
    assert float(loss2) == float(loss)


def test_frozen_head_skips_the_weight_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch)
    inp = make_inputs(10, 4, 19)
    x, w, t, lab, _ = _tensors(inp)
    w.requires_grad_(False)
    torch_kl.fused_linear_kl_div(x, w, t, lab, backend="torch", chunk_size=4).backward()
    assert spy.weight_gemms == 0 and all(spy.write_grad)
    assert w.grad is None and x.grad is not None


def test_target_gets_no_gradient() -> None:
    inp = make_inputs(6, 4, 17)
    x, w, t, lab, _ = _tensors(inp)
    t.requires_grad_()
    torch_kl.fused_linear_kl_div(x, w, t, lab, backend="torch").backward()
    assert t.grad is None and x.grad is not None


def test_second_backward_is_refused() -> None:
    inp = make_inputs(6, 4, 17)
    x, w, t, lab, _ = _tensors(inp)
    loss = torch_kl.fused_linear_kl_div(x, w, t, lab, backend="torch")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_runs_the_head_in_bf16(backend: str) -> None:
    inp = make_inputs(16, 8, 37)
    x, w, t, lab, _ = _tensors(inp)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch_kl.fused_linear_kl_div(x, w, t, lab, backend=backend)
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    bf16 = make_inputs(16, 8, 37, dtype="bfloat16")  # the same draws, rounded as autocast rounds them
    out = type(run("torch/torch", bf16))(float(loss), x.grad.double().numpy(), w.grad.double().numpy(), None)
    assert_matches(out, bf16)


def test_auto_backend_on_cpu_is_torch() -> None:
    from torch_kl.validate import resolve_backend

    assert resolve_backend("auto", torch.device("cpu")) == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g", [1.0, 3.0, 0.1])
def test_rescale_kernel_multiplies_in_float32(dtype: torch.dtype, g: float) -> None:
    from torch_kl.rescale import BLOCK, scale_

    grad = torch.randn(2 * BLOCK + 37, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = grad.clone()
    assert scale_(got, torch.tensor(g)) is got
    want = (grad.to(torch.float32) * g).to(dtype)
    if dtype == torch.bfloat16 and g != 1.0:
        # The interpreter truncates to bfloat16 where the GPU rounds (bitwise: test_gpu.py).
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, want)
