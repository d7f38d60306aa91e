"""The hard term's label entries kept apart from the bfloat16 ``dL/dz`` (``fused_kl.chunk.LabelTerm``):
over many chunks, the labels' rows of ``grad_weight`` err against float64 as the unfused loss's
one GEMM does, in both frameworks and with or without label smoothing; a teacher head's blocks
each bring their rows' terms."""

from __future__ import annotations

import numpy as np
import pytest

N, H, V, LABELLED, CHUNK = 1024, 64, 256, 8, 32  # 32 chunks; 8 labels shared by every row


def _inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, H)).astype(np.float32)
    w = (rng.standard_normal((V, H)) * 0.5).astype(np.float32)
    return x, w, rng.integers(0, LABELLED, N)


def _want(x: np.ndarray, w: np.ndarray, y: np.ndarray, smoothing: float) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``(grad_x, grad_weight)`` of the mean cross-entropy."""
    z = x @ w.T
    p = np.exp(z - z.max(1, keepdims=True))
    dz = p / p.sum(1, keepdims=True) - smoothing / V
    dz[np.arange(N), y] -= 1.0 - smoothing
    dz /= N
    return dz @ w, dz.T @ x


# Each framework's (fused grads, unfused grads, the bf16 inputs), the grads as float64 numpy arrays.
def _torch(x, w, y, smoothing):
    import torch

    import torch_kl

    def grads(fn):
        xt, wt = (torch.tensor(a).bfloat16().requires_grad_() for a in (x, w))
        fn(xt, wt, torch.tensor(y)).backward()
        return [g.float().numpy().astype(np.float64) for g in (xt.grad, wt.grad)]

    def fused(xt, wt, yt):
        return torch_kl.fused_linear_cross_entropy(
            xt, wt, yt, chunk_size=CHUNK, label_smoothing=smoothing, backend="torch"
        )

    def unfused(xt, wt, yt):
        return torch.nn.functional.cross_entropy((xt @ wt.T).float(), yt, label_smoothing=smoothing)

    rounded = [t.float().numpy().astype(np.float64) for t in (torch.tensor(x).bfloat16(), torch.tensor(w).bfloat16())]
    return grads(fused), grads(unfused), rounded


def _jax(x, w, y, smoothing):
    import jax
    import jax.numpy as jnp

    import jax_kl

    xb, wb, yj = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(y, jnp.int32)

    def fused(x, w):
        return jax_kl.fused_linear_cross_entropy(
            x, w, yj, chunk_size=CHUNK, label_smoothing=smoothing, backend="xla"
        )

    def unfused(x, w):
        logits = jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        log_q = jax.nn.log_softmax(logits.astype(jnp.float32))
        hard = -jnp.take_along_axis(log_q, yj[:, None], 1)[:, 0]
        return jnp.mean((1.0 - smoothing) * hard - smoothing * jnp.mean(log_q, axis=1))

    def grads(fn):
        return [np.asarray(g, np.float64) for g in jax.grad(fn, (0, 1))(xb, wb)]

    return grads(fused), grads(unfused), [np.asarray(a, np.float64) for a in (xb, wb)]


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("framework", [_torch, _jax], ids=["torch", "jax"])
def test_the_labels_rows_of_grad_weight_take_one_rounding_over_many_chunks(framework, smoothing: float) -> None:
    """bfloat16 cross-entropy over 32 chunks: the labels' rows of ``grad_weight`` (a row's
    largest entries) err as the unfused loss's do, not 3.6x more as with a rounding per chunk;
    ``grad_x`` too (the label's term added in float32)."""
    x, w, y = _inputs()
    ours, theirs, (x64, w64) = framework(x, w, y, smoothing)
    want_x, want_w = _want(x64, w64, y, smoothing)
    at = slice(0, LABELLED)

    def errors(grads):
        gx, gw = grads
        return np.linalg.norm(gx - want_x), np.linalg.norm(gw[at] - want_w[at])

    (ours_x, ours_w), (theirs_x, theirs_w) = errors(ours), errors(theirs)
    assert ours_x <= 1.05 * theirs_x
    assert ours_w <= 1.1 * theirs_w


def test_a_teacher_heads_blocks_each_keep_their_labels_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch_kl``'s teacher head with a hard term, its chunk's logits made in several blocks:
    each block's label terms join the chunk's, and every result is the one-block call's."""
    import torch

    import fused_kl.plan
    import torch_kl

    gen = torch.Generator().manual_seed(0)
    n, h, ht, v = 600, 8, 12, 37
    x, w = torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen)
    xt, wt, b = torch.randn(n, ht, generator=gen), torch.randn(v, ht, generator=gen), torch.randn(v, generator=gen)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[::5] = -100

    def run() -> list[torch.Tensor]:
        leaves = [a.clone().requires_grad_() for a in (x, w, b)]
        loss = torch_kl.fused_linear_kl_div(
            leaves[0], leaves[1], xt, labels, bias=leaves[2], target_format="hidden", teacher_weight=wt,
            weight_hard_loss=0.5, label_smoothing=0.1, chunk_size=n, backend="torch",
        )  # fmt: skip
        loss.backward()
        return [loss.detach(), *(a.grad for a in leaves)]

    one = run()
    monkeypatch.setattr(fused_kl.plan, "TEACHER_BLOCK_BYTES", 1)  # blocks of the fewest rows: 256, 256, 88
    assert fused_kl.plan.plan_chunks(n, v, 4, n, True, blocks=True).block_rows == 256
    for got, want in zip(run(), one, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_strided_x_gives_the_contiguous_x_s_gradients(backend: str) -> None:
    """The labels' rows of ``grad_weight`` read ``x`` with its own strides (a column slice and a
    transpose): the gradients are those of the same values laid out contiguously."""
    import torch

    import torch_kl

    gen = torch.Generator().manual_seed(0)
    base, w = torch.randn(64, 32, generator=gen), torch.randn(40, 16, generator=gen)
    labels = torch.randint(0, 40, (64,), generator=gen)

    def grads(x: torch.Tensor) -> list[torch.Tensor]:
        leaves = [x.detach().requires_grad_(), w.clone().requires_grad_()]
        torch_kl.fused_linear_cross_entropy(
            leaves[0], leaves[1], labels, label_smoothing=0.1, chunk_size=16, backend=backend
        ).backward()
        return [a.grad for a in leaves]

    for strided in (base[:, ::2], torch.randn(16, 64, generator=gen).T):
        for got, want in zip(grads(strided), grads(strided.contiguous()), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
