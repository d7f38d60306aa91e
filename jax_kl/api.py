"""``jax_kl.fused_linear_kl_div`` and ``fused_linear_cross_entropy``: validate, pick the
backend, run under ``custom_vjp`` (mirror of ``torch_kl/api.py``)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

from fused_kl.checks import check_flag, cross_entropy_options

from .autograd import fused_linear_loss
from .backends import Backend
from .layout import Layout
from .sharding import run_inside, run_sharded, vma_checked, vocab_shards_inside
from .teachers import TeacherArrays
from .validate import validate, widen_indices


def _run(
    arrays: dict[str, Any], with_teacher: bool, return_row_losses: bool, mesh, batch_axis, vocab_axis,
    options: dict[str, Any],
):  # fmt: skip
    """The loss, and with ``return_row_losses`` the rows' own losses shaped like the rows."""
    check_flag("return_row_losses", return_row_losses)
    loss, rows = _loss_and_rows(arrays, with_teacher, mesh, batch_axis, vocab_axis, options)
    if not return_row_losses:
        return loss
    return loss, rows.reshape(jnp.shape(arrays["x"])[:-1])


def _loss_and_rows(arrays: dict[str, Any], with_teacher: bool, mesh, batch_axis, vocab_axis, options: dict[str, Any]):
    if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(f"mesh: expected None or a jax.sharding.Mesh, got {type(mesh).__name__} {mesh!r}")
    inside = mesh is None and (batch_axis is not None or vocab_axis is not None)
    shards = vocab_shards_inside(batch_axis, vocab_axis) if inside else 1
    shapes, loss, run, backend, values = validate(
        arrays, shards, with_teacher=with_teacher, single_device=mesh is None and not inside,
        check_vma=inside and vma_checked(batch_axis, vocab_axis), **options,
    )  # fmt: skip
    arrays = widen_indices(arrays)  # after the checks, which see the caller's dtypes
    n = shapes.n

    def rows(name: str, width: int | None):
        a = arrays.get(name)
        if a is None:
            return None
        a = jnp.asarray(a)
        return a.reshape(n) if width is None else a.reshape(n, width)

    target = rows("target", shapes.t)
    teacher = TeacherArrays(
        None if target is None else lax.stop_gradient(target),
        *(
            None if arrays.get(k) is None else lax.stop_gradient(jnp.asarray(arrays[k]))
            for k in ("teacher_weight", "teacher_bias")
        ),
        rows("target_indices", shapes.t),
    )
    x = rows("x", shapes.h)
    weight = jnp.asarray(arrays["weight"])
    bias = None if arrays.get("bias") is None else jnp.asarray(arrays["bias"])
    labels = rows("labels", None)
    row_weight = rows("row_weight", None)
    row_weight = None if row_weight is None else lax.stop_gradient(row_weight.astype(jnp.float32))
    layout = Layout(batch_axis, vocab_axis)
    if mesh is not None:
        return run_sharded(mesh, layout, x, weight, bias, teacher, labels, row_weight, loss, run, backend)
    if inside:
        return run_inside(layout, x, weight, bias, teacher, labels, row_weight, loss, run, backend)
    return fused_linear_loss(x, weight, bias, teacher, labels, row_weight, values, loss, run, layout, backend)


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
    accum_dtype: DTypeLike | None = None,
    chunk_size: int | None = None,
    backend: str | Backend = "auto",
    beta: float = 0.0,
    weight_hard_loss: float = 0.0,
    weight_soft_loss: float = 1.0,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    teacher_weight: jax.Array | None = None,
    teacher_bias: jax.Array | None = None,
    target_indices: jax.Array | None = None,
    topk_tail: str = "bin",
    teacher_logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    row_weight: jax.Array | None = None,
    return_row_losses: bool = False,
    z_loss_weight: float = 0.0,
    mesh: jax.sharding.Mesh | None = None,
    batch_axis: str | None = None,
    vocab_axis: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The distillation loss of the student head ``x @ weight.T (+ bias)`` against a teacher,
    without materialising the ``[N, V]`` logits (docs/contract.md has the full contract).

    The arguments are ``torch_kl.fused_linear_kl_div``'s (``backend``: a name of
    ``jax_kl.backends.NAMES`` or a value of ``jax_kl.backends.resolve``), with ``mesh``, ``batch_axis`` and
    ``vocab_axis`` for several devices: global arrays sharded over ``mesh`` (``x``:
    ``P(batch_axis, None)``, ``weight``: ``P(vocab_axis, None)``), or, without ``mesh``, the
    local blocks inside the caller's own ``shard_map`` over those axis names. The teacher's
    arrays and ``row_weight`` get a zero gradient (``stop_gradient``); ``return_row_losses`` returns
    ``(loss, row_losses)``, the row losses shaped like the rows (with ``mesh``, sharded like them) and
    detached. Works under ``jax.jit``, ``jax.grad``,
    ``jax.lax.scan``, ``jax.checkpoint`` and ``jax.vmap``.
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
    return _run(arrays, True, return_row_losses, mesh, batch_axis, vocab_axis, options)


def fused_linear_cross_entropy(
    x: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    *,
    bias: jax.Array | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    accum_dtype: DTypeLike | None = None,
    chunk_size: int | None = None,
    backend: str | Backend = "auto",
    row_weight: jax.Array | None = None,
    return_row_losses: bool = False,
    z_loss_weight: float = 0.0,
    mesh: jax.sharding.Mesh | None = None,
    batch_axis: str | None = None,
    vocab_axis: str | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
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
    return _run(arrays, False, return_row_losses, mesh, batch_axis, vocab_axis, options)
