"""Several devices in JAX: global arrays on a mesh, or the caller's own ``shard_map``.

With ``mesh``, a ``custom_vjp`` wraps one ``shard_map`` that computes the loss and the
gradients of each device's blocks with explicit collectives (``jax_kl.layout``): the loss and
the head's gradients are summed over the batch axis, ``grad_x`` over the vocabulary axis. The
gradients come back sharded like their inputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable


from jax import lax
from jax.sharding import PartitionSpec as P

from fused_kl.loss import Loss
from fused_kl.options import RunOptions

from .autograd import fused_linear_loss
from .layout import Layout
from .teachers import TeacherArrays

try:  # jax >= 0.7
    from jax import shard_map as _shard_map
except ImportError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map


def vocab_shards_inside(vocab_axis) -> int:
    """The size of ``vocab_axis`` inside the caller's ``shard_map`` (1 for None)."""
    if vocab_axis is None:
        return 1
    try:
        return int(lax.psum(1, vocab_axis))
    except NameError:
        raise ValueError(
            f"vocab_axis: {vocab_axis!r} is not an axis of an enclosing shard_map; pass mesh= with global arrays"
        ) from None


def _teacher_specs(loss: Loss, teacher: TeacherArrays, b, v) -> TeacherArrays:
    fmt = None if loss.teacher is None else loss.teacher.format
    rows = P(b, v) if fmt in ("probs", "log_probs", "logits") else P(b, None)
    return TeacherArrays(
        None if teacher.target is None else rows,
        None if teacher.weight is None else P(v, None),
        None if teacher.bias is None else P(v),
        None if teacher.indices is None else P(b, None),
    )


def _sharded(mesh, inner: Callable, x, weight, bias, teacher, labels, loss: Loss, run: RunOptions, layout: Layout,
             with_grads: bool):
    b, v = layout.batch_axis, layout.vocab_axis
    in_specs = (P(b, None), P(v, None), None if bias is None else P(v), _teacher_specs(loss, teacher, b, v),
                None if labels is None else P(b))

    def local(x, weight, bias, teacher, labels):
        value, gx, gw, gb = inner(x, weight, bias, teacher, labels, loss, run, layout, with_grads)
        if b is not None:
            value = lax.psum(value, b)
            gw = None if gw is None else lax.psum(gw, b)
            gb = None if gb is None else lax.psum(gb, b)
        return value, gx, gw, gb

    grads_specs = (P(b, None), P(v, None), None if bias is None else P(v)) if with_grads else (None, None, None)
    out_specs = (P(), *grads_specs)
    return _shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
        x, weight, bias, teacher, labels)


def run_sharded(mesh, layout: Layout, x, weight, bias, teacher, labels, loss: Loss, run: RunOptions, compute):
    """The loss of global arrays on ``mesh``, under ``custom_vjp``."""
    for name, axis in (("batch_axis", layout.batch_axis), ("vocab_axis", layout.vocab_axis)):
        if axis is not None and axis not in mesh.axis_names:
            raise ValueError(f"{name}: expected one of the mesh's axes {mesh.axis_names}, got {axis!r}")
    if layout.vocab_axis is not None and weight.shape[0] % mesh.shape[layout.vocab_axis]:
        raise ValueError(f"weight: V = {weight.shape[0]} is not divisible by the {mesh.shape[layout.vocab_axis]} "
                         f"devices of vocab_axis {layout.vocab_axis!r}")
    sharded = functools.partial(_sharded, mesh, compute)
    return fused_linear_loss(x, weight, bias, teacher, labels, loss, run, layout, sharded)


