"""``jax_kl.fused_linear_kl_div``: validate, pick the backend, run under ``custom_vjp``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import chunked
from .autograd import fused_linear_kl_div_vjp
from .validate import validate


def _compute(backend: str):
    if backend == "triton":
        from fused_kl import bridge

        return bridge.jax_through_triton
    return chunked.forward


def fused_linear_kl_div(
    x: jax.Array,
    weight: jax.Array,
    target: jax.Array,
    labels: jax.Array | None = None,
    *,
    bias: jax.Array | None = None,
    reduction: str = "batchmean",
    ignore_index: int = -100,
    temperature: float = 1.0,
    eps: float = 1e-10,
    target_format: str = "probs",
    teacher_temperature: float | None = None,
    accum_dtype=None,
    chunk_size: int | None = None,
    backend: str = "auto",
) -> jax.Array:
    """``KL(p || softmax((x @ weight.T + bias) / temperature))`` without materialising the logits.

    Args:
        x: hidden states ``[N, H]`` or ``[B, T, H]`` (float32, bfloat16 or float16).
        weight: the LM head ``[V, H]`` (the ``nn.Linear`` layout), same dtype as ``x``.
        target: the teacher ``[N, V]`` or ``[B, T, V]``, read as ``target_format`` says:
            ``"probs"``, ``"log_probs"`` or ``"logits"`` (softmax over ``teacher_temperature``).
            It is a constant: ``jax.grad`` gives it a zero gradient.
        labels: optional integer ``[N]`` / ``[B, T]``; rows equal to ``ignore_index`` are ignored.
        bias: optional head bias ``[V]``.
        reduction: ``"batchmean"`` (sum / kept rows), ``"sum"``, or ``"mean"`` (sum / (kept rows * V)).
        temperature: the student's softmax temperature.
        eps: floor of the teacher's probabilities inside the log (``"probs"`` only).
        accum_dtype: dtype in which ``grad_weight`` is accumulated across chunks
            (None = ``weight.dtype``; ``jnp.float32`` for precision).
        chunk_size: rows per chunk (None = a heuristic near the GEMM floor; smaller saves memory).
        backend: ``"auto"``, ``"pallas"`` (interpreted on CPU), ``"xla"`` or ``"triton"``
            (torch_kl's kernel via DLPack).

    Returns:
        The float32 scalar loss. Works under ``jax.jit``, ``jax.grad`` and ``jax.value_and_grad``.
    """
    shapes, opts = validate(
        x,
        weight,
        target,
        labels,
        bias,
        reduction=reduction,
        ignore_index=ignore_index,
        temperature=temperature,
        eps=eps,
        target_format=target_format,
        teacher_temperature=teacher_temperature,
        accum_dtype=accum_dtype,
        chunk_size=chunk_size,
        backend=backend,
    )
    x = jnp.asarray(x)
    x2 = x.reshape(shapes.n, shapes.h)
    target2 = lax.stop_gradient(jnp.asarray(target).reshape(shapes.n, shapes.v))
    labels1 = None if labels is None else jnp.asarray(labels).reshape(shapes.n)
    bias = None if bias is None else jnp.asarray(bias)
    return fused_linear_kl_div_vjp(x2, jnp.asarray(weight), target2, labels1, bias, opts, _compute(opts.backend))
