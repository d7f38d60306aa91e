"""torch_kl behaviour beyond the shared matrix: autograd, needs, autocast, torch.compile."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import TORCH_BACKENDS, Outputs, assert_matches, make_inputs, run, torch_tensors

import torch_kl
import torch_kl.backends
import torch_kl.driver
import torch_kl.gemm
from torch_kl.backends import torch_phases

NAMES = [b.split("/")[1] for b in TORCH_BACKENDS]


def _tensors(inp, requires_grad=True):
    """``x, weight, target, labels, bias`` and the teacher's keywords, as torch tensors."""
    tensors = torch_tensors(inp, requires_grad=requires_grad)
    return (*(tensors.pop(k) for k in ("x", "weight", "target", "labels", "bias")), tensors)


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("fmt", ["probs", "hidden", "topk_log_probs"])
def test_inputs_are_never_modified(backend: str, fmt: str) -> None:
    inp = make_inputs(10, 5, 23, bias=True, target_format=fmt, teacher_bias=True, k=4, pad_frac=0.5)
    x, w, t, lab, b, teacher = _tensors(inp)
    arrays = [x, w, t, lab, b, *(v for v in teacher.values() if isinstance(v, torch.Tensor))]
    before = [a.detach().clone() for a in arrays]
    loss = torch_kl.fused_linear_kl_div(x, w, t, lab, bias=b, backend=backend, chunk_size=3, weight_hard_loss=0.5,
                                        **teacher)
    loss.backward()
    for a, old in zip(arrays, before, strict=True):
        assert torch.equal(a.detach(), old)


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("fmt", ["log_probs", "hidden", "topk_log_probs"])
def test_non_contiguous_inputs(backend: str, fmt: str) -> None:
    inp = make_inputs(9, 6, 31, target_format=fmt, k=5, pad_frac=0.5)
    *_, lab, _, teacher = _tensors(inp)
    x_nc = torch.tensor(inp.x.T.copy()).T.requires_grad_()  # column-major
    t_nc = torch.tensor(inp.target.T.copy()).T
    w_nc = torch.tensor(np.asfortranarray(inp.weight)).requires_grad_()
    teacher = {k: torch.tensor(np.asfortranarray(v.numpy())) if isinstance(v, torch.Tensor) else v
               for k, v in teacher.items()}
    assert not (x_nc.is_contiguous() or t_nc.is_contiguous() or w_nc.is_contiguous())
    loss = torch_kl.fused_linear_kl_div(x_nc, w_nc, t_nc, lab, backend=backend, beta=0.0, **teacher)
    loss.backward()
    want = run(f"torch/{backend}", inp)
    assert float(loss.detach()) == pytest.approx(want.loss, rel=1e-6)
    np.testing.assert_allclose(x_nc.grad.numpy(), want.grad_x, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(w_nc.grad.numpy(), want.grad_weight, rtol=1e-5, atol=1e-7)


class _Spy:
    """Records whether the ``finish`` phase writes dL/dz, and counts the grad_weight GEMMs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.write_grad: list[bool] = []
        self.weight_gemms = 0
        finish, accumulate = torch_phases.finish, torch_kl.gemm.accumulate

        def spy_finish(*args):
            self.write_grad.append(args[-1])
            return finish(*args)

        def spy_accumulate(*args, **kwargs):
            self.weight_gemms += 1
            return accumulate(*args, **kwargs)

        monkeypatch.setattr(torch_phases, "finish", spy_finish)
        monkeypatch.setattr(torch_kl.gemm, "accumulate", spy_accumulate)


def test_loss_only_without_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch)
    inp = make_inputs(10, 4, 19)
    x, w, t, lab, _, _ = _tensors(inp)
    with torch.no_grad():
        loss = torch_kl.fused_linear_kl_div(x, w, t, lab, backend="torch", chunk_size=4)
    assert not loss.requires_grad
    assert spy.write_grad == [False] * 3 and spy.weight_gemms == 0
    loss2 = torch_kl.fused_linear_kl_div(x.detach(), w.detach(), t, lab, backend="torch", chunk_size=4)
    assert float(loss2) == float(loss)
    torch_kl.fused_linear_kl_div(x, w, t, lab, backend="torch", chunk_size=4).backward()  # the spy sees gradients
    assert spy.write_grad == [False] * 6 + [True] * 3 and spy.weight_gemms == 3


@pytest.mark.parametrize("fmt", ["probs", "hidden"])
def test_frozen_head_skips_the_weight_gemm(monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    spy = _Spy(monkeypatch)
    inp = make_inputs(10, 4, 19, target_format=fmt)
    x, w, t, lab, _, teacher = _tensors(inp)
    w.requires_grad_(False)
    torch_kl.fused_linear_kl_div(x, w, t, lab, backend="torch", chunk_size=4, **teacher).backward()
    assert spy.weight_gemms == 0 and all(spy.write_grad)
    assert w.grad is None and x.grad is not None


@pytest.mark.parametrize("backend", NAMES)
@pytest.mark.parametrize("grad", [True, False])
def test_the_value_check_is_waited_for_before_labels_are_read(
    monkeypatch: pytest.MonkeyPatch, backend: str, grad: bool
) -> None:
    """The eager value check's ``wait()`` runs once per call, after the first chunk's GEMMs are
    queued and before anything reads the labels or token ids; what it raises reaches the caller."""
    import torch_kl.validate

    inp = make_inputs(10, 5, 23, target_format="topk_log_probs", k=4)
    x, w, t, lab, _, teacher = _tensors(inp, requires_grad=grad)
    events: list[str] = []
    real_local_labels, real_check = torch_kl.driver.local_labels, torch_kl.validate.check_values
    real_mm = torch.mm

    def local_labels(*args):
        events.append("labels")
        return real_local_labels(*args)

    def mm(*args, **kwargs):
        events.append("gemm")
        return real_mm(*args, **kwargs)

    def check_values(*args):
        wait = real_check(*args)
        assert wait is not None
        return lambda: (events.append("wait"), wait())

    monkeypatch.setattr(torch_kl.driver, "local_labels", local_labels)
    monkeypatch.setattr(torch_kl.validate, "check_values", check_values)
    call = dict(backend=backend, chunk_size=4, weight_hard_loss=0.5, **teacher)
    with monkeypatch.context() as m:
        m.setattr(torch, "mm", mm)  # the torch backend's logits GEMM (Triton's fused one is not seen)
        torch_kl.fused_linear_kl_div(x, w, t, lab, **call)
    assert events.count("wait") == 1
    assert "labels" not in events[: events.index("wait")]
    if backend == "torch":
        assert events[0] == "gemm"
    bad = lab.clone()
    bad[3] = 23
    with pytest.raises(ValueError, match=r"^labels: "):
        torch_kl.fused_linear_kl_div(x, w, t, bad, **call)


def test_teacher_gets_no_gradient() -> None:
    inp = make_inputs(6, 4, 17, target_format="hidden", teacher_bias=True)
    x, w, t, lab, _, teacher = _tensors(inp)
    t.requires_grad_()
    for k in ("teacher_weight", "teacher_bias"):
        teacher[k].requires_grad_()
    torch_kl.fused_linear_kl_div(x, w, t, lab, backend="torch", **teacher).backward()
    assert t.grad is None and teacher["teacher_weight"].grad is None and teacher["teacher_bias"].grad is None
    assert x.grad is not None


def test_second_backward_is_refused() -> None:
    inp = make_inputs(6, 4, 17)
    x, w, t, lab, _, _ = _tensors(inp)
    loss = torch_kl.fused_linear_kl_div(x, w, t, lab, backend="torch")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_double_backward_is_refused_by_name() -> None:
    """The gradients are made in the forward pass, without a graph: a second derivative through
    them would be silently zero, so ``create_graph=True`` raises."""
    inp = make_inputs(6, 4, 17)
    x, w, t, lab, _, _ = _tensors(inp)
    loss = torch_kl.fused_linear_kl_div(x, w, t, lab, backend="torch")
    with pytest.raises(RuntimeError, match=r"double backward \(create_graph=True"):
        torch.autograd.grad(loss, x, create_graph=True)


@pytest.mark.parametrize("transform", ["grad", "vmap", "jacrev"])
def test_torch_func_transforms_are_refused_by_name(transform: str) -> None:
    inp = make_inputs(6, 4, 17)
    x, w, t, lab, _, _ = _tensors(inp, requires_grad=False)

    def f(x):
        return torch_kl.fused_linear_kl_div(x, w, t, lab, backend="torch")

    with pytest.raises(TypeError, match=r"^x: a tensor of a torch.func transform \(grad, vmap, jacrev"):
        getattr(torch.func, transform)(f)(x[None] if transform == "vmap" else x)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_autocast_runs_the_head_in_bf16(backend: str) -> None:
    inp = make_inputs(16, 8, 37, target_format="logits")
    x, w, t, lab, _, teacher = _tensors(inp)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch_kl.fused_linear_kl_div(x, w, t, lab, backend=backend, beta=0.5, **teacher)
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    # The same draws, rounded as autocast rounds them.
    bf16 = make_inputs(16, 8, 37, dtype="bfloat16", target_format="logits")
    out = Outputs(float(loss.detach()), x.grad.double().numpy(), w.grad.double().numpy(), None)
    assert_matches(out, bf16, beta=0.5)


def test_autocast_takes_a_float32_head_beside_bf16_activations() -> None:
    """The mix autocast makes (a float32 head, the body's bfloat16 output) runs as ``nn.Linear``
    would run it: both in bfloat16; the head's gradient float32, its own dtype."""
    x, w, p = torch.randn(6, 8).bfloat16(), torch.randn(13, 8), torch.softmax(torch.randn(6, 13), -1)
    wr = w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch_kl.fused_linear_kl_div(x, wr, p, backend="torch")
        want = torch_kl.fused_linear_kl_div(x, w.bfloat16(), p, backend="torch")
    loss.backward()
    assert float(loss) == float(want) and wr.grad.dtype == torch.float32
    with pytest.raises(TypeError, match=r"^weight: expected the dtype of x"):
        torch_kl.fused_linear_kl_div(x, w, p, backend="torch")  # outside autocast, refused as before


def test_auto_backend_on_cpu_is_torch() -> None:
    assert torch_kl.backends.resolve("auto", torch.device("cpu")).name == "torch"


@pytest.mark.parametrize(
    "backend, dtype", [("torch/torch", "float32"), ("torch/triton", "float32"), ("torch/triton", "bfloat16")]
)
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_teacher_head_in_blocks(monkeypatch: pytest.MonkeyPatch, backend: str, dtype: str, beta: float) -> None:
    """A teacher head's logits made in blocks of 4 rows inside chunks of 10 (then 3): each
    block's row phases run on its slice of the chunk, labels, ignored rows and hard term included
    (in bfloat16 the Triton backend's own GEMM makes the blocks)."""
    import fused_kl.plan
    from torch_kl.backends import triton_logits

    inp = make_inputs(23, 8, 40, dtype=dtype, target_format="hidden", bias=True, teacher_bias=True, ht=8)
    monkeypatch.setattr(fused_kl.plan, "ROW_MULTIPLE", 4)
    monkeypatch.setattr(fused_kl.plan, "TEACHER_BLOCK_BYTES", 5 * 40 * (4 if dtype == "float32" else 2))
    blocks, gemms = [], []
    plan_chunks, plain_logits = torch_kl.driver.plan_chunks, triton_logits.plain_logits

    def plan(*args, **kwargs):
        made = plan_chunks(*args, **kwargs)
        blocks.append(made.block_rows)
        return made

    monkeypatch.setattr(torch_kl.driver, "plan_chunks", plan)
    monkeypatch.setattr(triton_logits, "plain_logits", lambda *a: gemms.append(plain_logits(*a)) or gemms[-1])
    options = dict(chunk_size=10, beta=beta, weight_hard_loss=0.3, weight_soft_loss=0.7)
    assert_matches(run(backend, inp, **options), inp, **options)
    assert blocks == [4]
    assert gemms == ([] if backend == "torch/torch" else [dtype == "bfloat16"] * 7)  # 3 + 3 + 1 blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g", [1.0, 3.0, 0.1])
def test_rescale_kernel_multiplies_in_float32(dtype: torch.dtype, g: float) -> None:
    from torch_kl.backends.rescale import BLOCK, scale_

    grad = torch.randn(2 * BLOCK + 37, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = grad.clone()
    assert scale_(got, torch.tensor(g)) is got
    want = (grad.to(torch.float32) * g).to(dtype)
    if dtype == torch.bfloat16 and g != 1.0:
        # The interpreter truncates to bfloat16 where the GPU rounds (bitwise: test_gpu.py).
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, want)


def test_torch_compile_fullgraph_gives_the_eager_result() -> None:
    """A training step under ``torch.compile(fullgraph=True)`` (no graph break): the eager loss
    and gradients, with ignored rows, a non-contiguous view of ``x`` and the divergence family's terms; a kept
    label outside the vocabulary makes the loss NaN there instead of raising (docs/contract-devices.md: compilation)."""
    inp = make_inputs(10, 6, 23, target_format="logits", ignore_frac=0.4, bias=True)
    assert (inp.labels == -100).any() and (inp.labels != -100).any()
    x_t = torch.tensor(inp.x.T.copy())  # x is a transposed, non-contiguous view of this
    w, b = torch.tensor(inp.weight), torch.tensor(inp.bias)
    t, lab = torch.tensor(inp.target), torch.tensor(inp.labels)

    def step(x_t, w, b, t, lab):
        return torch_kl.fused_linear_kl_div(x_t.t(), w, t, lab, bias=b, target_format="logits", backend="torch",
                                            chunk_size=4, beta=0.5, weight_hard_loss=0.5, label_smoothing=0.1,
                                            softcap=5.0)

    def loss_and_grads(fn, lab):
        leaves = [a.clone().requires_grad_() for a in (x_t, w, b)]
        loss = fn(*leaves, t, lab)
        loss.backward()
        return [loss.detach(), *(a.grad for a in leaves)]

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    eager = loss_and_grads(step, lab)
    got = loss_and_grads(compiled, lab)
    for a, c in zip(eager, got, strict=True):
        torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-7)
    bad = lab.clone()
    bad[int(np.flatnonzero(inp.labels != -100)[0])] = 23  # kept, and outside [0, V)
    with pytest.raises(ValueError, match=r"^labels: "):
        step(x_t, w, b, t, bad)
    assert torch.isnan(compiled(x_t, w, b, t, bad))


def test_torch_compile_fullgraph_takes_a_new_float_on_each_call() -> None:
    """A schedule (temperature annealing, a hard-term warm-up) changes Python floats between
    calls of one compiled step: no graph break, no error, the eager loss and gradients each time.
    Dynamo makes a changed float symbolic: the checks compare it, never call math on it."""
    inp = make_inputs(8, 5, 19, target_format="logits", bias=True)
    x, w, t, lab, b, _ = _tensors(inp, requires_grad=False)

    def step(w, temperature, weight_hard_loss):
        return torch_kl.fused_linear_kl_div(x, w, t, lab, bias=b, target_format="logits", backend="torch",
                                            temperature=temperature, weight_hard_loss=weight_hard_loss, beta=0.5)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for temperature, weight_hard_loss in ((1.0, 0.0), (2.0, 0.0), (0.7, 0.0), (0.7, 0.3), (1.3, 0.6)):
        results = []
        for fn in (step, compiled):
            leaf = w.clone().requires_grad_()
            loss = fn(leaf, temperature, weight_hard_loss)
            loss.backward()
            results.append((loss.detach(), leaf.grad))
        (want, want_grad), (got, got_grad) = results
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-6, atol=1e-7)
