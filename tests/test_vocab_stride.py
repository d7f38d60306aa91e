"""Any vocabulary size at the GEMMs' aligned rate: a chunk's ``[rows, V]`` logits (and a teacher
head's block of logits) live in a buffer whose rows are ``fused_kl.plan.padded_row_stride(V)``
elements apart (``torch_kl.driver.chunk_buffer``). Every kernel of both ``torch_kl`` backends gets
that row stride at an unaligned ``V``, never writes the padding, and the results match float64."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import assert_matches, make_inputs, run, torch_tensors

import torch_kl
from fused_kl.loss import Loss
from fused_kl.plan import ROW_STRIDE_MULTIPLE, padded_row_stride
from fused_kl.reference import reference
from torch_kl import backends, gemm, teachers
from torch_kl.backends import torch_phases, triton_factored, triton_logits, triton_phases
from torch_kl.driver import chunk_buffer
from torch_kl.teachers import dense_chunk

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("v", "stride"), [(1, 64), (63, 64), (64, 64), (65, 128), (50257, 50304), (128256, 128256), (128257, 128320)]
)
def test_padded_row_stride_is_v_rounded_up_to_a_multiple_of_64(v, stride):
    assert padded_row_stride(v) == stride


def test_the_chunk_buffer_pads_only_an_unaligned_vocabulary():
    odd = chunk_buffer(5, 67, torch.bfloat16, CPU)
    assert odd.shape == (5, 67) and odd.stride() == (128, 1) and odd.dtype == torch.bfloat16
    aligned = chunk_buffer(5, 128, torch.float32, CPU)
    assert aligned.shape == (5, 128) and aligned.stride() == (128, 1) and aligned.is_contiguous()


# (make_inputs keywords, options): every teacher format and loss family at a V that is no multiple
# of 64, in the dtypes that take each Triton path in the interpreter (bfloat16: the factored chunks
# and the pointer-path GEMM; float16: the TMA-path GEMM; float32: cuBLAS).
CASES = {
    "forward-probs-bf16": (dict(n=20, h=16, v=67, dtype="bfloat16"), dict(chunk_size=8)),
    "forward-logits-bias": (dict(n=17, h=8, v=131, target_format="logits", bias=True), dict(temperature=2.0)),
    "jsd-probs-fp16": (dict(n=16, h=16, v=67, dtype="float16"), dict(beta=0.5)),
    "hidden-reverse-bf16": (
        dict(n=20, h=16, v=67, target_format="hidden", ht=16, dtype="bfloat16", teacher_bias=True),
        dict(beta=1.0, chunk_size=8),
    ),
    "hidden-fp16-bias": (dict(n=16, h=16, v=67, target_format="hidden", ht=16, dtype="float16", bias=True), dict()),
    "topk-bf16-hard": (
        dict(n=20, h=16, v=131, target_format="topk_log_probs", k=6, dtype="bfloat16", pad_frac=0.3),
        dict(weight_hard_loss=0.5),
    ),
    "cross-entropy-bf16": (dict(n=20, h=16, v=131, dtype="bfloat16"), dict(fn="cross_entropy", chunk_size=8)),
    "cross-entropy-bf16-bias-smoothing": (
        dict(n=20, h=16, v=67, dtype="bfloat16", bias=True),
        dict(fn="cross_entropy", label_smoothing=0.1),
    ),
}


def _spy(monkeypatch: pytest.MonkeyPatch, v: int) -> list[tuple[str, tuple[int, ...]]]:
    """Record the strides of every ``[rows, V]`` buffer the row phases, the Triton logits GEMMs and
    the factored chunk receive, and of a teacher head's blocks: ``(who, stride)``. A dense teacher
    is the caller's tensor, read as it is: not recorded."""
    seen: list[tuple[str, tuple[int, ...]]] = []

    def note(who: str, *tensors) -> None:
        for a in tensors:
            if isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[1] == v and a.shape[0] > 1:
                seen.append((who, a.stride()))

    def wrap(module, name: str, at: slice) -> None:
        real = getattr(module, name)

        def spied(*args):
            note(f"{module.__name__}.{name}", *args[at])
            return real(*args)

        monkeypatch.setattr(module, name, spied)

    def teacher_block(loss: Loss, *args):
        block = dense_chunk(loss, *args)
        if loss.teacher_head:
            note("teacher head's block", block)
        return block

    for phases in (torch_phases, triton_phases):
        for name in ("stats", "mixture_sums", "finish"):
            wrap(phases, name, slice(0, 1))
    monkeypatch.setattr(teachers, "dense_chunk", teacher_block)
    wrap(triton_logits, "logits_with_stats", slice(-1, None))
    wrap(triton_logits, "plain_logits", slice(-1, None))
    wrap(triton_factored, "exp_logits", slice(-1, None))
    return seen


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_kernel_reads_aligned_rows_and_matches_float64_at_an_unaligned_vocabulary(monkeypatch, backend, case):
    shape, options = CASES[case]
    assert shape["v"] % ROW_STRIDE_MULTIPLE != 0
    seen = _spy(monkeypatch, shape["v"])
    inp = make_inputs(**shape)
    out = run(f"torch/{backend}", inp, **options)
    assert_matches(out, inp, **options)
    assert seen, "no kernel saw the chunk's buffer"
    assert any(who == "teacher head's block" for who, _ in seen) == (shape.get("target_format") == "hidden")
    wrong = [(who, stride) for who, stride in seen if stride != (padded_row_stride(shape["v"]), 1)]
    assert not wrong, f"buffers without the padded row stride: {wrong}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])  # the pointer and the TMA path
def test_the_fused_logits_gemm_takes_padded_rows_and_leaves_the_padding_alone(dtype):
    gen = torch.Generator().manual_seed(0)
    rows, h, v = 12, 16, 87
    x = torch.randn(rows, h, generator=gen).to(dtype)
    w = (torch.randn(v, h, generator=gen) / h**0.5).to(dtype)
    wide = torch.full((rows, padded_row_stride(v)), float("nan"), dtype=dtype)
    z = wide[:, :v]
    make_stats = triton_logits.logits_with_stats(x, w, None, Loss(teacher=None, weight_soft=0.0, weight_hard=1.0), z)
    assert make_stats is not None, "the fused GEMM refused rows padded to an aligned stride"
    torch.testing.assert_close(z.float(), (x.float() @ w.float().t()).to(dtype).float(), atol=1e-2, rtol=1e-2)
    assert wide[:, v:].isnan().all()


def test_the_factored_chunk_takes_padded_rows_and_leaves_the_padding_alone():
    gen = torch.Generator().manual_seed(1)
    rows, h, v = 12, 16, 87
    x = torch.randn(rows, h, generator=gen).to(torch.bfloat16)
    w = (torch.randn(v, h, generator=gen) / h**0.5).to(torch.bfloat16)
    y = torch.randint(0, v, (rows,), generator=gen)
    loss = Loss(teacher=None, weight_soft=0.0, weight_hard=1.0)
    wide = torch.full((rows, padded_row_stride(v)), float("nan"), dtype=torch.bfloat16)
    z = wide[:, :v]
    exp = triton_factored.exp_logits(x, w, None, loss, z)
    assert exp is not None, "the factored GEMM refused rows padded to an aligned stride"
    make_stats, tiles = exp
    c_hard = torch.ones(rows)
    alpha, label = triton_factored.settle(z, tiles, make_stats(y), c_hard, c_hard, y, loss)
    logits = x.double() @ w.double().t()
    want = torch.softmax(logits, -1) - torch.nn.functional.one_hot(y, v).double()
    got = (alpha.double()[:, None] * z.double()).scatter_add_(1, y[:, None], label.coef.double()[:, None])
    torch.testing.assert_close(got, want, atol=1e-2, rtol=2e-2)
    assert wide[:, v:].isnan().all()


def test_torchs_gemms_write_and_read_padded_rows_in_place():
    """The cuBLAS / CPU path: ``torch.mm(out=)`` writes the strided buffer itself (no contiguous
    temporary copied back), and the gradient GEMMs read it as it is."""
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(6, 8, generator=gen), torch.randn(67, 8, generator=gen)
    wide = torch.full((6, padded_row_stride(67)), float("nan"))
    z = wide[:, :67]
    with torch.profiler.profile() as prof:
        torch.mm(x, w.t(), out=z)
        grad_x, grad_w = torch.mm(z, w), torch.mm(z.t(), x)
    assert "aten::copy_" not in {e.key for e in prof.key_averages()}
    torch.testing.assert_close(z, x @ w.t())
    assert wide[:, 67:].isnan().all()
    dense = (x @ w.t()).contiguous()
    torch.testing.assert_close(grad_x, dense @ w)
    torch.testing.assert_close(grad_w, dense.t() @ x)


@pytest.mark.parametrize(
    ("v", "itemsize", "split", "parts"),
    [
        (131, 2, True, ((0, 128), (128, 131))),
        (131, 2, False, ((0, 131),)),
        (128, 2, True, ((0, 128),)),
        (40, 2, True, ((0, 40),)),
        (132, 4, True, ((0, 132),)),  # float32 rows of 528 bytes: aligned already
        (130, 4, True, ((0, 128), (128, 130))),
    ],
)
def test_the_gemms_take_the_aligned_columns_and_the_rest_apart(v, itemsize, split, parts):
    assert tuple((p.start, p.stop) for p in gemm.vocab_parts(v, itemsize, split)) == parts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_split_gemms_give_the_whole_gemms_and_leave_the_padding_alone(dtype):
    """At V = 131 the GEMMs run over columns [0, 128) and [128, 131): the logits, ``grad_x`` (the
    aligned part added to the rest's product, the sum rounded once), ``grad_weight``'s
    accumulation over two chunks and the factored path's float32 product equal one GEMM over
    every column."""
    gen = torch.Generator().manual_seed(3)
    v, parts = 131, gemm.vocab_parts(131, 2, True)
    x, w, b = (torch.randn(*s, generator=gen).to(dtype) for s in ((6, 16), (v, 16), (v,)))
    wide = torch.full((6, padded_row_stride(v)), float("nan"), dtype=dtype)
    z = gemm.logits(x, w, b, wide[:, :v], parts)
    assert wide[:, v:].isnan().all()
    whole = torch.addmm(b.float(), x.float(), w.float().t())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=1e-2)
    torch.testing.assert_close(z.float(), whole, **tol)
    gx = torch.empty(6, 16, dtype=dtype)
    gemm.grad_x(z, w, gx, parts)
    exact = z.double() @ w.double()
    assert gx.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(gx.double(), exact, atol=1e-4, rtol=1e-5)
    else:  # the sum and the three columns' product each rounded once: 2**-8 of each at most
        rest = z[:, v - 3 :].double() @ w[v - 3 :].double()
        assert ((gx.double() - exact).abs() <= 2.0**-8 * (exact.abs() + rest.abs()) + 1e-4).all()
    torch.testing.assert_close(gemm.mm_f32(z, w, parts).double(), exact, atol=1e-3, rtol=1e-4)
    acc = torch.full((v, 16), float("nan"), dtype=torch.float32)
    gemm.accumulate(acc, z, x, True, parts)
    gemm.accumulate(acc, z, x, False, parts)
    rtol = 1e-5 if dtype == torch.float32 else 1e-2  # a product in bfloat16 where the CPU's GEMM makes one
    torch.testing.assert_close(acc.double(), 2 * z.double().t() @ x.double(), atol=1e-3, rtol=rtol)


def test_the_loss_is_the_same_with_the_gemms_split_or_whole():
    inp = make_inputs(n=12, h=8, v=131, target_format="logits", bias=True)
    split = backends.resolve("torch", CPU)
    results = []
    for backend in (split, dataclasses.replace(split, split_vocab_gemms=False)):
        t = torch_tensors(inp, requires_grad=True)
        arrays = {k: t[k].detach().requires_grad_() for k in ("x", "weight", "bias")}
        loss = torch_kl.fused_linear_kl_div(
            arrays["x"], arrays["weight"], t["target"], t["labels"], bias=arrays["bias"],
            target_format="logits", chunk_size=5, backend=backend,
        )  # fmt: skip
        loss.backward()
        results.append([loss.detach(), *(a.grad for a in arrays.values())])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_the_padding_is_zero_so_a_cpu_gemm_that_reads_it_adds_nothing(monkeypatch):
    """torch's bfloat16 GEMM on the CPU reads a row's padding (times zeros): with every new
    buffer full of NaN, as uninitialized memory can be, the gradients stay finite and right."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", nan_empty)
    gen = torch.Generator().manual_seed(3)
    n, h, v = 33, 3, 45
    x = torch.randn(n, h, generator=gen).to(torch.bfloat16).requires_grad_()
    w = torch.randn(v, h, generator=gen).to(torch.bfloat16).requires_grad_()
    t = torch.randn(n, v, generator=gen).log_softmax(-1)
    torch_kl.fused_linear_kl_div(x, w, t, target_format="log_probs", backend="torch").backward()
    want = reference(x.detach(), w.detach(), t, target_format="log_probs")
    for got, ref in ((x.grad, want.grad_x), (w.grad, want.grad_weight)):
        ref = torch.as_tensor(ref, dtype=torch.float64)
        assert torch.isfinite(got).all()
        assert float((got.double() - ref).norm() / ref.norm()) < 3e-2
