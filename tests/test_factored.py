"""The fused cross-entropy's ``dL/dz = diag(alpha) E`` (``torch_kl/backends/triton_factored.py``):
``E`` written by the logits GEMM's epilogue, rows whose maxima leave the window rescaled by
``settle``, against float64; which chunks take it; in Triton's interpreter and on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_kl
from fused_kl.loss import Loss, Teacher
from fused_kl.reference import reference
from fused_kl.rows import STATS
from torch_kl.backends import resolve, triton_factored

FLUSHED = 7


def _logits_of_every_kind(rows: int, v: int, h: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """bfloat16 ``x``, ``W`` whose logits are, by row: ordinary (``|a| < 10``); about 100 (above
    the window); about -70 (below it); about 20, but 60 on the first quarter of the columns
    (some column tiles out of the window). Column 0 of ``W`` is 1, so ``x[:, 0]`` shifts a row;
    column 1 is 1 on the first quarter, so ``x[:, 1]`` lifts those columns; column 2 is 1 at
    ``FLUSHED`` alone, where the ordinary rows' logit is -100."""
    gen = torch.Generator().manual_seed(rows + v)
    x = torch.randn(rows, h, generator=gen)
    w = torch.randn(v, h, generator=gen) / h**0.5
    w[:, 0], w[:, 1] = 1.0, 0.0
    w[: v // 4, 1] = 1.0
    x[:, :2] = 0.0
    x[1::4, 0] = 100.0
    x[2::4, 0] = -70.0
    x[3::4, 0], x[3::4, 1] = 20.0, 40.0
    w[:, 2] = 0.0
    w[FLUSHED, 2] = 1.0
    x[0::4, 2] = -100.0  # ordinary rows: one logit far below the shift, where E flushes to zero
    return x.to(torch.bfloat16).to(device), w.to(torch.bfloat16).to(device)


CE = Loss(teacher=None, weight_soft=0.0, weight_hard=1.0)
CAPPED = Loss(teacher=None, weight_soft=0.0, weight_hard=1.0, softcap=80.0, logit_scale=1.25)


@pytest.mark.parametrize("loss", [CE, CAPPED])
def test_alpha_times_e_plus_the_label_term_is_the_gradient_in_float64(loss):
    rows, v, h = 24, 96, 16
    x, w = _logits_of_every_kind(rows, v, h)
    y = torch.randint(0, v, (rows,), generator=torch.Generator().manual_seed(1))
    z = torch.empty(rows, v, dtype=torch.bfloat16)
    make_stats, tiles = triton_factored.exp_logits(x, w, None, loss, z)
    stats = make_stats(y)
    bad = tiles.bad.bool()
    assert bad.any() and not bad.all()  # both kinds of rows, so the repair runs and skips
    row_max = tiles.max.amax(0)
    assert torch.equal(bad, ((tiles.max < triton_factored.LO.value) | (tiles.max > triton_factored.HI.value)).any(0))
    assert (row_max < triton_factored.LO.value).any() and (row_max > triton_factored.HI.value).any()
    assert torch.equal(tiles.shift, torch.where(bad, row_max, triton_factored.SHIFT.value))
    c_hard = torch.rand(rows, generator=torch.Generator().manual_seed(2))
    alpha, label = triton_factored.settle(z, tiles, stats, c_hard, c_hard, y, loss)

    a = (x.double() @ w.double().T) * loss.logit_scale
    if loss.softcap is not None:
        a = loss.softcap * torch.tanh(a / loss.softcap)
    slope = loss.logit_scale * (1.0 if loss.softcap is None else 1.0 - (a / loss.softcap) ** 2)
    grad = c_hard.double()[:, None] * slope * (torch.softmax(a, -1) - F.one_hot(y, v))
    torch.testing.assert_close(stats[:, STATS.lse_hard].double(), torch.logsumexp(a, -1), rtol=1e-5, atol=1e-4)
    f_y = a.gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(stats[:, STATS.label_logit].double(), f_y, rtol=1e-5, atol=1e-4)
    slope_y = loss.logit_scale * (1.0 if loss.softcap is None else 1.0 - (f_y / loss.softcap) ** 2)
    torch.testing.assert_close(label.coef.double(), -c_hard.double() * slope_y, rtol=1e-5, atol=0.0)
    assert torch.equal(label.y, y)
    got = alpha.double()[:, None] * z.double()
    got.scatter_add_(1, y[:, None], label.coef.double()[:, None])
    # bfloat16's rounding of each entry, relative to the row's largest
    scale = grad.abs().amax(-1, keepdim=True)
    assert ((got - grad).abs() / scale).max() < 8e-3
    # the row's largest entry, the label's, is not rounded to bfloat16 at all (rows inside the window)
    inside, at_y = ~bad, y[:, None]
    err_y = ((got.gather(1, at_y) - grad.gather(1, at_y)).abs() / scale)[inside]
    assert err_y.max() < 3e-4  # bfloat16 would be off by up to 4e-3 there


def test_the_fused_cross_entropy_matches_float64_on_rows_outside_the_window():
    x, w = _logits_of_every_kind(32, 96, 16)
    y = torch.randint(0, 96, (32,), generator=torch.Generator().manual_seed(3))
    y[5] = -100
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = torch_kl.fused_linear_cross_entropy(xr, wr, y, backend="triton", chunk_size=16)
    loss.backward()
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    want = F.cross_entropy(xd @ wd.T, y)
    want.backward()
    assert abs(float(loss.detach()) - float(want.detach())) < 1e-4 * abs(float(want.detach()))
    for got, ref in ((xr.grad, xd.grad), (wr.grad, wd.grad)):
        assert float((got.double() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize(
    "options",
    [dict(weight_hard_loss=0.5, logit_scale=1.25), dict(topk_tail="renormalize", temperature=2.0, reduction="sum")],
)
def test_a_topk_teacher_matches_float64_on_rows_outside_the_window_and_flushed_tokens(options):
    """Its logits at the teacher's tokens come from E (log E + the shift), or from a dot product
    where E flushed to zero: the token FLUSHED, -100 in the ordinary rows, is every row's first."""
    rows, v, h, k = 32, 96, 16, 6
    x, w = _logits_of_every_kind(rows, v, h)
    gen = torch.Generator().manual_seed(4)
    y = torch.randint(0, v, (rows,), generator=gen)
    y[5] = -100
    order = torch.rand(rows, v, generator=gen)
    order[:, FLUSHED] = 2.0  # drawn last: the other tokens are distinct from it
    idx = torch.cat([torch.full((rows, 1), FLUSHED), order.argsort(-1)[:, : k - 1]], dim=1)
    t = torch.randn(rows, v, generator=gen).log_softmax(-1).gather(1, idx)
    t[::3, -1] = float("-inf")  # padding
    args = dict(target_format="topk_log_probs", target_indices=idx, **options)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = torch_kl.fused_linear_kl_div(xr, wr, t, y, backend="triton", chunk_size=16, **args)
    loss.backward()
    want = reference(x, w, t, y, **args)
    assert abs(float(loss.detach()) - want.loss) < 1e-3 * abs(want.loss)
    for got, ref in ((xr.grad, want.grad_x), (wr.grad, want.grad_weight)):
        ref = torch.as_tensor(ref, dtype=torch.float64)
        assert float((got.double() - ref).norm() / ref.norm()) < 1e-2


def test_a_nan_teacher_row_that_is_ignored_leaves_the_gradients_alone():
    """An ignored top-k row takes none of the teacher's mass ``k``: its NaN log-probabilities
    reach neither ``alpha`` nor the gradients, which equal those of the call with finite ones
    (a row of weight 0 beside it: no soft weight either)."""
    rows, v, h, k = 8, 64, 16, 4
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(rows, h, generator=gen).to(torch.bfloat16)
    w = (torch.randn(v, h, generator=gen) * 0.3).to(torch.bfloat16)
    y = torch.randint(0, v, (rows,), generator=gen)
    idx = torch.rand(rows, v, generator=gen).argsort(-1)[:, :k]
    t = torch.randn(rows, v, generator=gen).log_softmax(-1).gather(1, idx)
    y[2] = -100
    weights = torch.ones(rows)
    weights[5] = 0.0
    clean = t.clone()
    t[2] = float("nan")
    grads = []
    for teacher in (t, clean):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = torch_kl.fused_linear_kl_div(
            xr, wr, teacher, y, target_format="topk_log_probs", target_indices=idx, row_weight=weights,
            weight_hard_loss=0.5, backend="triton",
        )  # fmt: skip
        loss.backward()
        assert torch.isfinite(loss)
        grads.append((xr.grad, wr.grad))
    for got, want in zip(*grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want)


def test_rows_with_sparse_values_and_no_dense_part_are_zeroed():
    """``q_factor = 0`` (a top-k row whose factor K vanishes, without the hard term): ``settle`` zeroes
    the row's E and writes its top-k entries alone."""
    rows, v, h = 8, 64, 16
    x, w = _logits_of_every_kind(rows, v, h)
    loss = Loss(teacher=Teacher("topk_log_probs", 1.0))
    z = torch.empty(rows, v, dtype=torch.bfloat16)
    make_stats, tiles = triton_factored.exp_logits(x, w, None, loss, z)
    stats = make_stats(None)
    q_factor = torch.tensor([0.0, 1.0, 0.0, 0.5, 1.0, 0.0, 2.0, 1.0])
    at = torch.tensor([[3, 9]] * rows)
    values = torch.full((rows, 2), -0.25)
    values[5] = 0.0  # no dense part and no sparse value: left as it is
    mask = torch.ones(rows, 2, dtype=torch.bool)
    from torch_kl.ops import OPS

    sparse = (at, values, mask)
    alpha, label = triton_factored.settle(z, tiles, stats, q_factor, torch.zeros(rows), None, loss, sparse, OPS.set_at)
    assert label is None
    g = alpha[:, None].double() * z.double()
    for r in (0, 2):
        assert torch.count_nonzero(g[r]) == 2 and torch.allclose(
            g[r, [3, 9]], torch.full((2,), -0.25, dtype=torch.float64), rtol=1e-2
        )
    assert torch.all(g[5] == 0)
    q = torch.softmax((x.double() @ w.double().T), -1)
    dense = q_factor[:, None].double() * q
    dense[:, [3, 9]] = -0.25
    for r in (1, 3, 4, 6, 7):
        assert ((g[r] - dense[r]).abs().max() / dense[r].abs().max()) < 8e-3


def _taken(monkeypatch, teacher: bool, **call) -> bool:
    """Whether the Triton backend factored the chunks of a bfloat16 call: the cross-entropy, or
    with a ``teacher`` the KL divergence to one in ``call``'s ``target_format``."""
    seen = []
    original = triton_factored.exp_logits

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(triton_factored, "exp_logits", spy)
    dtype = call.pop("dtype", torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 16, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(64, 16, generator=gen) / 4).to(dtype).requires_grad_()
    y = torch.randint(0, 64, (20,), generator=gen)
    bias = torch.zeros(64, dtype=dtype, requires_grad=True) if call.pop("bias", False) else None
    if not teacher:
        loss = torch_kl.fused_linear_cross_entropy(x, w, y, bias=bias, backend="triton", **call)
    elif call.get("target_format") == "topk_log_probs":
        t, idx = torch.randn(20, 64, generator=gen).log_softmax(-1).topk(5, dim=-1)
        loss = torch_kl.fused_linear_kl_div(x, w, t, y, bias=bias, target_indices=idx, backend="triton", **call)
    else:
        t = torch.randn(20, 64, generator=gen).softmax(-1)
        loss = torch_kl.fused_linear_kl_div(x, w, t, y, bias=bias, backend="triton", **call)
    loss.backward()
    assert seen, "the Triton backend offers every chunk to the factored path"
    return all(seen)


TOPK = dict(target_format="topk_log_probs")


@pytest.mark.parametrize(
    ("teacher", "call", "taken"),
    [
        (False, dict(), True),
        (False, dict(softcap=5.0, logit_scale=0.5, reduction="sum", accum_dtype=torch.float32), True),
        (False, dict(label_smoothing=0.1), False),  # -eps/V on every entry: not a row scale of E
        (False, dict(bias=True), False),
        (False, dict(dtype=torch.float16), False),  # float16's range cannot hold E
        (True, dict(TOPK, temperature=2.0, topk_tail="drop"), True),
        (True, dict(TOPK, weight_hard_loss=0.5), True),
        (True, dict(TOPK, weight_hard_loss=0.5, temperature=2.0), False),  # two exponentials: q at T and at 1
        (True, dict(TOPK, softcap=5.0), False),  # E would not give the logits back
        (True, dict(target_format="probs"), False),  # a dense teacher's p on every entry
    ],
)
def test_which_chunks_factor(monkeypatch, teacher, call, taken):
    assert _taken(monkeypatch, teacher, **call) is taken


def test_only_the_triton_backend_factors():
    cpu = torch.device("cpu")
    assert resolve("triton", cpu).factored is triton_factored
    assert resolve("torch", cpu).factored is None


@pytest.mark.gpu
def test_on_the_gpu_with_partial_tiles():
    """The TMA path with the GPU tile shape, 300 rows and 2056 columns (partial tiles)."""
    x, w = _logits_of_every_kind(300, 2056, 264, "cuda")
    y = torch.randint(0, 2056, (300,), device="cuda")
    z = torch.empty(300, 2056, dtype=torch.bfloat16, device="cuda")
    make_stats, tiles = triton_factored.exp_logits(x, w, None, CE, z)
    stats = make_stats(y)
    ones = torch.ones(300, device="cuda")
    alpha, label = triton_factored.settle(z, tiles, stats, ones, ones, y, CE)
    a = x.double() @ w.double().T
    grad = torch.softmax(a, -1) - F.one_hot(y, 2056)
    got = alpha.double()[:, None] * z.double()
    got.scatter_add_(1, y[:, None], label.coef.double()[:, None])
    assert ((got - grad).abs() / grad.abs().amax(-1, keepdim=True)).max() < 8e-3


@pytest.mark.parametrize("tail", ["bin", "renormalize", "drop"])
@pytest.mark.parametrize(("temperature", "hard", "scale"), [(1.0, True, 1.25), (1.7, False, 2.5)])
def test_the_topk_kernel_is_the_shared_topk_part(tail, temperature, hard, scale):
    """``triton_topk`` against ``fused_kl.chunk.topk_part`` on the same ``E``: rows outside the
    window, a flushed token, ``-inf`` padding, a NaN log-probability, an ignored row, a token id
    outside the vocabulary (read by neither; an unchecked call's driver makes its row NaN) and k
    not a power of two."""
    from fused_kl import rowmath
    from fused_kl.chunk import topk_part
    from torch_kl.backends import triton_topk
    from torch_kl.layout import Layout
    from torch_kl.ops import OPS

    rows, v, h, k = 32, 96, 16, 5
    loss = Loss(teacher=Teacher("topk_log_probs", temperature, topk_tail=tail), temperature=temperature,
                logit_scale=scale, weight_hard=0.5 if hard else 0.0)  # fmt: skip
    x, w = _logits_of_every_kind(rows, v, h)
    gen = torch.Generator().manual_seed(5)
    y = torch.randint(0, v, (rows,), generator=gen)
    order = torch.rand(rows, v, generator=gen)
    order[:, FLUSHED] = 2.0
    idx = torch.cat([torch.full((rows, 1), FLUSHED), order.argsort(-1)[:, : k - 1]], dim=1)
    y[1::5] = idx[1::5, 2]  # some labels among the teacher's tokens
    t = torch.randn(rows, v, generator=gen).log_softmax(-1).gather(1, idx)
    t[::3, -1] = float("-inf")
    t[4, 1] = float("nan")
    idx[6, 3] = v + 2
    keep = torch.ones(rows, dtype=torch.bool)
    keep[7] = False
    z = torch.empty(rows, v, dtype=torch.bfloat16)
    make_stats, tiles = triton_factored.exp_logits(x, w, None, loss, z)
    assert (z[::4, FLUSHED] == 0).all()  # the dot product's path runs
    stats = make_stats(y if hard else None)
    weights = rowmath.loss_weights(keep.sum(dtype=torch.float32), loss, v, False, torch)
    scales = rowmath.grad_scales(keep, None, weights, loss, torch)
    scales = (scales.soft, scales.hard, rowmath.z_scale(stats, scales))
    want = topk_part(lambda at, inside: triton_factored.logits_at(z, tiles, at, inside, x, w, loss), (t, idx),
                     y if hard else None, scales, 0, v, stats, loss, v, Layout(), OPS)  # fmt: skip
    got = triton_topk.topk_part(z, tiles, (t, idx), y if hard else None, stats, scales, x, w, loss)
    for name, a, b in zip(("soft", "K", "at", "dL/dz", "write"), got, want, strict=True):
        b = torch.as_tensor(b).expand_as(a)
        assert a.dtype == b.dtype or name in ("soft", "K", "dL/dz"), name
        torch.testing.assert_close(a, b.to(a.dtype), rtol=2e-5, atol=2e-6, equal_nan=True, msg=name)
    assert got[0][4].isnan() and not got[0][:4].isnan().any() and got[0][5:].isfinite().all()


def test_a_row_scale_with_the_label_row():
    """``scale_rows`` with a label term: ``alpha_r src_r + coef_r W_{y_r}`` summed in float32."""
    gen = torch.Generator().manual_seed(7)
    rows, v, h = 12, 9, 40
    src, w = torch.randn(rows, h, generator=gen), torch.randn(v, h, generator=gen).to(torch.bfloat16)
    alpha, y = torch.rand(rows, generator=gen), torch.randint(0, v, (rows,), generator=gen)
    coef = torch.randn(rows, generator=gen)
    coef[3] = 0.0
    out = torch.empty(rows, h, dtype=torch.bfloat16)
    triton_factored.scale_rows(src, alpha, out, triton_factored.LabelTerm(coef, y), w)
    want = alpha.double()[:, None] * src.double() + coef.double()[:, None] * w.double()[y]
    torch.testing.assert_close(out.double(), want, rtol=2.0**-7, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1000, 4096])
def test_on_the_gpu_the_gradients_are_as_accurate_as_the_unfused_bfloat16_loss(n):
    """Against float64, the fused cross-entropy's gradients err no more than the unfused loss's on
    bfloat16 logits (what ``torch.compile`` of it computes), within 10 %: the label's term, the
    row's largest, stays out of ``E``'s bfloat16. ``N = 1000``: a divisor that is no power of two."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    h, v = 1024, 32000
    x = torch.randn(n, h, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(v, h, generator=gen, device="cuda") * 0.04).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), generator=gen, device="cuda")
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    F.cross_entropy(xd @ wd.T, y).backward()
    errors = {}
    for name in ("fused", "unfused"):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        if name == "fused":
            torch_kl.fused_linear_cross_entropy(xr, wr, y, backend="triton", chunk_size=1024).backward()
        else:
            F.cross_entropy((xr @ wr.T).float(), y).backward()
        errors[name] = [float((g.double() - r).norm() / r.norm()) for g, r in ((xr.grad, xd.grad), (wr.grad, wd.grad))]
    for fused, unfused in zip(errors["fused"], errors["unfused"], strict=True):
        assert fused <= 1.1 * unfused, errors


def test_the_label_rows_are_added_once_after_the_last_chunk(monkeypatch):
    """Over several chunks, ``grad_weight``'s label term is added by one call over all ``N`` rows,
    after every chunk's GEMM, in float32 whatever torch's default dtype, and the result matches
    float64."""
    calls = []
    original = triton_factored.add_label_rows

    def spy(grad_w, x, label):
        calls.append((x.shape[0], int(torch.count_nonzero(label.coef)), label.coef.dtype))
        return original(grad_w, x, label)

    monkeypatch.setattr(triton_factored, "add_label_rows", spy)
    chunks = []
    exp_logits = triton_factored.exp_logits
    monkeypatch.setattr(triton_factored, "exp_logits", lambda *a: chunks.append(a[0].shape[0]) or exp_logits(*a))
    gen = torch.Generator().manual_seed(9)
    n, h, v = 40, 16, 64
    x = torch.randn(n, h, generator=gen).to(torch.bfloat16)
    w = (torch.randn(v, h, generator=gen) / 4).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), generator=gen)
    y[:8] = 5
    y[9] = -100
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch_kl.fused_linear_cross_entropy(xr, wr, y, backend="triton", chunk_size=16).backward()
    finally:
        torch.set_default_dtype(default)
    assert chunks == [16, 16, 8] and calls == [(n, n - 1, torch.float32)]
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    F.cross_entropy(xd @ wd.T, y).backward()
    for got, ref in ((xr.grad, xd.grad), (wr.grad, wd.grad)):
        assert float((got.double() - ref).norm() / ref.norm()) < 1e-2
