"""``torch_kl.fused_linear_kl_div``: validate, pick the backend, run under autograd."""

from __future__ import annotations

import torch

from . import chunked
from .autograd import FusedLinearKLDivFunction
from .validate import validate


def _compute(backend: str):
    if backend == "jax":
        from fused_kl import bridge

        return bridge.torch_through_pallas
    return chunked.forward


def _autocast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Under ``torch.autocast``, run the head in the autocast dtype, as ``nn.Linear`` would."""
    kind = x.device.type
    if not torch.is_autocast_enabled(kind):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(kind)
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def fused_linear_kl_div(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    reduction: str = "batchmean",
    ignore_index: int = -100,
    temperature: float = 1.0,
    eps: float = 1e-10,
    target_format: str = "probs",
    teacher_temperature: float | None = None,
    accum_dtype: torch.dtype | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``KL(p || softmax((x @ weight.T + bias) / temperature))`` without materialising the logits.

    Args:
        x: hidden states ``[N, H]`` or ``[B, T, H]`` (float32, bfloat16 or float16).
        weight: the LM head ``[V, H]``, same dtype and device as ``x``.
        target: the teacher ``[N, V]`` or ``[B, T, V]``, read as ``target_format`` says:
            ``"probs"``, ``"log_probs"`` or ``"logits"`` (softmax over ``teacher_temperature``).
        labels: optional integer ``[N]`` / ``[B, T]``; rows equal to ``ignore_index`` are ignored.
        bias: optional head bias ``[V]``.
        reduction: ``"batchmean"`` (sum / kept rows), ``"sum"``, or ``"mean"`` (sum / (kept rows * V)).
        temperature: the student's softmax temperature.
        eps: floor of the teacher's probabilities inside the log (``"probs"`` only).
        accum_dtype: dtype in which ``grad_weight`` is accumulated across chunks
            (None = ``weight.dtype``; ``torch.float32`` for precision).
        chunk_size: rows per chunk (None = a heuristic near the GEMM floor; smaller saves memory).
        backend: ``"auto"``, ``"triton"``, ``"torch"`` or ``"jax"`` (the Pallas kernel via DLPack).

    Returns:
        The float32 scalar loss. Gradients for ``x``, ``weight`` and ``bias`` are computed in
        this call (only those that are needed) and scaled by the upstream gradient in backward.
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
    x, weight, bias = _autocast(x, weight, bias)
    x2 = x.reshape(shapes.n, shapes.h)
    target2 = target.reshape(shapes.n, shapes.v)
    labels1 = None if labels is None else labels.reshape(shapes.n)
    compute = _compute(opts.backend)
    with torch.autocast(x.device.type, enabled=False):
        grad_wanted = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
        if not grad_wanted:
            return compute(x2, weight, target2, labels1, bias, opts, chunked.Needs())[0]
        return FusedLinearKLDivFunction.apply(x2, weight, target2.detach(), labels1, bias, opts, compute)
