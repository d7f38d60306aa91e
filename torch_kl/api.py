"""``torch_kl.fused_linear_kl_div`` and ``fused_linear_cross_entropy``: validate, pick the
backend, run under autograd."""

from __future__ import annotations

from typing import Any

import torch

from fused_kl.checks import check_flag, cross_entropy_options
from fused_kl.options import Needs

from . import compiled
from .autograd import FusedLinearLossFunction
from .backends import Backend
from .layout import Layout
from .teachers import TeacherArrays
from .validate import validate, widen_indices


def _autocast(arrays: dict[str, Any]) -> dict[str, Any]:
    """Under ``torch.autocast``, ``arrays`` with the head's floating inputs (``x``, ``weight``,
    ``bias``) in the autocast dtype, as ``nn.Linear`` would run them; before the checks, so that the
    mix autocast allows (a float32 head beside bfloat16 activations) is not refused."""
    x = arrays.get("x")
    device = x.device.type if isinstance(x, torch.Tensor) else None
    # A device autocast does not know ("meta") has no autocast state to ask about.
    if device is None or not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
        return arrays
    dtype = torch.get_autocast_dtype(device)
    cast = {k: a.to(dtype) for k in ("x", "weight", "bias") if isinstance(a := arrays.get(k), torch.Tensor)
            and a.is_floating_point()}  # fmt: skip
    return arrays | cast


def _run(
    arrays: dict[str, Any], layout: Layout, with_teacher: bool, return_row_losses: bool, options: dict[str, Any]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The loss, and with ``return_row_losses`` the rows' own losses shaped like the rows."""
    check_flag("return_row_losses", return_row_losses)
    loss, rows = _loss_and_rows(arrays, layout, with_teacher, options)
    if not return_row_losses:
        return loss
    return loss, rows.reshape(arrays["x"].shape[:-1])


def _loss_and_rows(
    arrays: dict[str, Any], layout: Layout, with_teacher: bool, options: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    arrays = _autocast(arrays)
    shapes, loss, run, backend, wait = validate(arrays, layout, with_teacher=with_teacher, **options)
    arrays = widen_indices(arrays)  # after the checks, which see the caller's dtypes
    x, weight, bias = arrays["x"], arrays["weight"], arrays["bias"]
    n = shapes.n
    x2 = x.reshape(n, shapes.h)
    target = arrays.get("target")
    target2 = None if target is None else target.detach().reshape(n, shapes.t)
    idx = arrays.get("target_indices")
    idx2 = None if idx is None else idx.reshape(n, shapes.t)
    labels = arrays.get("labels")
    labels1 = None if labels is None else labels.reshape(n)
    row_weight = arrays.get("row_weight")
    row_weight1 = None if row_weight is None else row_weight.detach().reshape(n).to(torch.float32)
    tw, tb = arrays.get("teacher_weight"), arrays.get("teacher_bias")
    tw, tb = (None if a is None else a.detach() for a in (tw, tb))
    # ``wait``: the eager value check, waited for once the first GEMMs are queued.
    with torch.autocast(x.device.type, enabled=False):
        grad_wanted = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
        teacher = TeacherArrays(target2, tw, tb, idx2)
        if torch.compiler.is_compiling():
            needs = Needs(*(grad_wanted and t is not None and t.requires_grad for t in (x2, weight, bias)))
            return compiled.apply(x2, weight, bias, teacher, labels1, row_weight1, loss, run, layout, needs, backend)
        if not grad_wanted:
            value, rows, *_ = backend.compute(
                x2, weight, bias, teacher, labels1, row_weight1, loss, run, layout, Needs(), backend, ready=wait
            )  # fmt: skip
            return value, rows
        return FusedLinearLossFunction.apply(
            x2, weight, bias, target2, tw, tb, idx2, labels1, row_weight1, loss, run, layout, backend, wait
        )


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
    backend: str | Backend = "auto",
    beta: float = 0.0,
    weight_hard_loss: float = 0.0,
    weight_soft_loss: float = 1.0,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    target_indices: torch.Tensor | None = None,
    topk_tail: str = "bin",
    teacher_logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    row_weight: torch.Tensor | None = None,
    return_row_losses: bool = False,
    z_loss_weight: float = 0.0,
    batch_group: Any = None,
    vocab_group: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The distillation loss of the student head ``x @ weight.T (+ bias)`` against a teacher,
    without materialising the ``[N, V]`` logits (docs/contract.md has the full contract).

    Args:
        x: hidden states ``[N, H]`` or ``[B, T, H]`` (float32, bfloat16 or float16).
        weight: the LM head ``[V, H]`` (a ``V / G`` slice with ``vocab_group``), dtype and device of ``x``.
        target: the teacher, read as ``target_format`` says: ``"probs"``, ``"log_probs"``, ``"logits"``
            (``[N, V]``), ``"hidden"`` (its hidden states ``[N, Ht]``, with ``teacher_weight``) or
            ``"topk_log_probs"`` (``[N, k]``, with ``target_indices`` and ``topk_tail``).
        labels: optional integer ``[N]``: rows equal to ``ignore_index`` are ignored; the class
            indices of the hard term when ``weight_hard_loss > 0``.
        beta: 0 forward KL, 1 reverse KL, in between the generalized JSD.
        weight_soft_loss, weight_hard_loss, label_smoothing: ``w_soft * soft + w_hard * CE(labels)``.
        logit_scale, softcap: the student's logit transform (Cohere, Gemma-2/3); ``teacher_*`` the teacher's.
        row_weight: optional float ``[N]`` (``[B, T]``), finite ``>= 0``: each kept row's loss times its weight.
        return_row_losses: also return each row's loss (float32, shaped like the rows, no gradient):
            unweighted, unnormalised, 0 on ignored rows.
        z_loss_weight: adds ``z_loss_weight * lse(f(z))**2`` to each kept row's hard term (PaLM's z-loss).
        reduction, temperature, eps, teacher_temperature: see docs/contract.md.
        accum_dtype, chunk_size, backend: how it runs (never what it computes); ``backend`` a name of
            ``torch_kl.backends.NAMES`` or a value of ``torch_kl.backends.resolve`` (a variant of one
            made with ``dataclasses.replace``).
        batch_group, vocab_group: ``torch.distributed`` groups for rows or vocabulary sharded.

    Returns:
        The float32 scalar loss (with ``batch_group``: this rank's share), or ``(loss, row_losses)``
        with ``return_row_losses``. Gradients for ``x``, ``weight`` and ``bias`` are computed in this
        call and scaled by the upstream gradient.
    """
    arrays = dict(
        x=x,
        weight=weight,
        target=target,
        labels=labels,
        bias=bias,
        teacher_weight=teacher_weight,
        teacher_bias=teacher_bias,
        target_indices=target_indices,
        row_weight=row_weight,
    )
    options = dict(
        reduction=reduction,
        ignore_index=ignore_index,
        temperature=temperature,
        eps=eps,
        target_format=target_format,
        teacher_temperature=teacher_temperature,
        accum_dtype=accum_dtype,
        chunk_size=chunk_size,
        backend=backend,
        beta=beta,
        weight_hard_loss=weight_hard_loss,
        weight_soft_loss=weight_soft_loss,
        label_smoothing=label_smoothing,
        logit_scale=logit_scale,
        softcap=softcap,
        topk_tail=topk_tail,
        teacher_logit_scale=teacher_logit_scale,
        teacher_softcap=teacher_softcap,
        z_loss_weight=z_loss_weight,
    )
    return _run(arrays, Layout(batch_group, vocab_group), True, return_row_losses, options)


def fused_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    accum_dtype: torch.dtype | None = None,
    chunk_size: int | None = None,
    backend: str | Backend = "auto",
    row_weight: torch.Tensor | None = None,
    return_row_losses: bool = False,
    z_loss_weight: float = 0.0,
    batch_group: Any = None,
    vocab_group: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``torch.nn.functional.cross_entropy`` of the head's logits, fused the same way: no teacher,
    ``"mean"`` divides by the kept rows as torch does; ``row_weight``, ``return_row_losses`` and
    ``z_loss_weight`` as :func:`fused_linear_kl_div`'s."""
    arrays = dict(x=x, weight=weight, labels=labels, bias=bias, row_weight=row_weight)
    options = cross_entropy_options(
        reduction,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        logit_scale=logit_scale,
        softcap=softcap,
        accum_dtype=accum_dtype,
        chunk_size=chunk_size,
        backend=backend,
        z_loss_weight=z_loss_weight,
    )
    return _run(arrays, Layout(batch_group, vocab_group), False, return_row_losses, options)
