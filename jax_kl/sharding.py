"""Several devices in JAX: global arrays on a mesh, or the caller's own ``shard_map``.

With ``mesh``, a ``custom_vjp`` wraps one ``shard_map`` that computes the loss and the
gradients of each device's blocks with explicit collectives (``jax_kl.layout``): the loss and
the head's gradients are summed over the batch axis, ``grad_x`` over the vocabulary axis. The
gradients come back sharded like their inputs. No ``shard_map`` is ever transposed.

Inside the caller's ``shard_map`` (axis names, no ``mesh``), a ``custom_vjp`` returns the
global loss on every device, and its backward rule gives each device's blocks the cotangents
that the caller's ``shard_map`` expects, which depend on its ``check_vma``:

* ``check_vma=True``: the loss is invariant over the axes and its cotangent arrives whole.
  Each gradient is summed over the axes it varies over and its input does not (the transpose
  of the implicit ``pvary`` of an invariant input): ``grad_x`` over the vocabulary axis (its
  partial products), ``grad_weight`` / ``grad_bias`` over the batch axis (the rows' shares).
  Pallas cannot run there (its outputs carry no varying axes): an explicit ``backend="pallas"``
  is refused, ``"auto"`` takes ``"xla"``.
* ``check_vma=False``: the transpose of ``shard_map`` divides a replicated output's cotangent
  by the axes' sizes and psums each input's cotangent over the axes its spec leaves out. So
  the rule sums the cotangent over the layout's axes (every device's loss depends on every
  device's blocks) and returns the local partial gradients; the ``shard_map`` sums them.

Either way the gradients are neither multiplied by an axis size nor left partial.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
from jax import shard_map as _shard_map
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fused_kl.backend import Compute
from fused_kl.loss import NO_VALUES, Loss
from fused_kl.options import Needs, RunOptions

from .autograd import compute_primals, fused_linear_loss, loss_cotangent, scale_grad
from .backends import Backend
from .layout import Layout
from .teachers import TeacherArrays


def _names(axis) -> tuple[str, ...]:
    return () if axis is None else tuple(axis) if isinstance(axis, tuple) else (axis,)


def _varying(a) -> frozenset:
    """The mesh axes ``a`` varies over (empty under ``check_vma=False``)."""
    return frozenset(jax.typeof(a).mat.varying)


def vocab_shards_inside(batch_axis: str | tuple[str, ...] | None, vocab_axis: str | tuple[str, ...] | None) -> int:
    """The size of ``vocab_axis`` inside the caller's ``shard_map`` (1 for None), after checking
    that both axes are axes of an enclosing ``shard_map``."""
    sizes = {}
    for name, axis in (("batch_axis", batch_axis), ("vocab_axis", vocab_axis)):
        if axis is None:
            continue
        try:
            sizes[name] = int(lax.psum(1, axis))
        except NameError:
            raise ValueError(
                f"{name}: {axis!r} is not an axis of an enclosing shard_map; pass mesh= with global arrays"
            ) from None
    _distinct(batch_axis, vocab_axis)
    return sizes.get("vocab_axis", 1)


def _distinct(batch_axis, vocab_axis) -> None:
    if set(_names(batch_axis)) & set(_names(vocab_axis)):
        raise ValueError(f"batch_axis, vocab_axis: expected different mesh axes, got {batch_axis!r} and {vocab_axis!r}")


# -- mesh=: global arrays -------------------------------------------------------------------


def _teacher_specs(loss: Loss, teacher: TeacherArrays, b, v) -> TeacherArrays:
    t = loss.teacher
    vocab_wide = t is not None and t.format != "hidden" and t.dense_format is not None  # the user's [N, V]
    rows = P(b, v) if vocab_wide else P(b, None)
    return TeacherArrays(
        None if teacher.target is None else rows,
        None if teacher.weight is None else P(v, None),
        None if teacher.bias is None else P(v),
        None if teacher.indices is None else P(b, None),
    )


def _sharded(
    mesh,
    inner: Compute,
    x,
    weight,
    bias,
    teacher,
    labels,
    row_weight,
    loss: Loss,
    run: RunOptions,
    layout: Layout,
    needs: Needs,
    backend: Backend,
):
    b, v = layout.batch_axis, layout.vocab_axis
    in_specs = (
        P(b, None),
        P(v, None),
        None if bias is None else P(v),
        _teacher_specs(loss, teacher, b, v),
        None if labels is None else P(b),
        None if row_weight is None else P(b),
    )

    def local(x, weight, bias, teacher, labels, row_weight):
        value, rows, gx, gw, gb = inner(x, weight, bias, teacher, labels, row_weight, loss, run, layout, needs, backend)
        if b is not None:
            value = lax.psum(value, b)
            gw = None if gw is None else lax.psum(gw, b)
            gb = None if gb is None else lax.psum(gb, b)
        return value, rows, gx, gw, gb

    grads_specs = (P(b, None) if needs.x else None, P(v, None) if needs.weight else None, P(v) if needs.bias else None)
    out_specs = (P(), P(b), *grads_specs)  # every vocabulary shard holds its rows' whole row losses
    arrays = _placed(mesh, in_specs, (x, weight, bias, teacher, labels, row_weight))
    return _shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*arrays)


def _placed(mesh, specs: tuple, arrays: tuple) -> tuple:
    """Each concrete array put on ``mesh`` as its spec says where ``jax.jit`` would place it so: a
    NumPy array, a JAX array not committed to devices (``jnp.asarray``'s, on the default device),
    or one on the mesh's devices in another layout (an eager ``shard_map`` on a mesh of explicit
    axes refuses those). An array committed to other devices stays (``jit`` refuses it too, and the
    device check names it); a traced one is left to its trace."""
    devices = set(mesh.devices.flat)

    def put(spec, a):
        if a is None or isinstance(a, jax.core.Tracer):
            return a
        if isinstance(a, jax.Array) and a.committed and set(a.devices()) != devices:
            return a
        return jax.device_put(a, NamedSharding(mesh, spec))

    return jax.tree.map(put, specs, arrays, is_leaf=lambda s: s is None or isinstance(s, P))


def run_sharded(
    mesh: jax.sharding.Mesh, layout: Layout, x: jax.Array, weight: jax.Array, bias: jax.Array | None,
    teacher: TeacherArrays, labels: jax.Array | None, row_weight: jax.Array | None, loss: Loss, run: RunOptions,
    backend: Backend,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """``(loss, row losses)`` of global arrays on ``mesh``, under ``custom_vjp``: the backend's
    compute run inside one ``shard_map``."""
    _distinct(layout.batch_axis, layout.vocab_axis)
    sizes = {}
    for name, axis in (("batch_axis", layout.batch_axis), ("vocab_axis", layout.vocab_axis)):
        missing = [a for a in _names(axis) if a not in mesh.axis_names]
        if missing:
            raise ValueError(f"{name}: expected one of the mesh's axes {mesh.axis_names}, got {axis!r}")
        sizes[name] = math.prod(mesh.shape[a] for a in _names(axis))
    for arg, size, axis, what in (
        ("x", x.shape[0], "batch_axis", "N = {} rows"),
        ("weight", weight.shape[0], "vocab_axis", "V = {}"),
    ):
        if size % sizes[axis]:
            raise ValueError(
                f"{arg}: {what.format(size)} is not divisible by the {sizes[axis]} devices of {axis} "
                f"{getattr(layout, axis)!r}"
            )
    sharded = dataclasses.replace(backend, compute=functools.partial(_sharded, mesh, backend.compute))
    return fused_linear_loss(x, weight, bias, teacher, labels, row_weight, NO_VALUES, loss, run, layout, sharded)


# -- inside the caller's shard_map ------------------------------------------------------------


def vma_checked(batch_axis: str | tuple[str, ...] | None, vocab_axis: str | tuple[str, ...] | None) -> bool:
    """Whether the caller's ``shard_map`` checks varying axes (``check_vma=True``): the backend
    is resolved knowing it (``jax_kl.backends.resolve``)."""
    return any(a in _varying(lax.axis_index(a)) for a in _names(batch_axis) + _names(vocab_axis))


def run_inside(
    layout: Layout, x: jax.Array, weight: jax.Array, bias: jax.Array | None, teacher: TeacherArrays,
    labels: jax.Array | None, row_weight: jax.Array | None, loss: Loss, run: RunOptions, backend: Backend,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """``(the global loss, this device's rows' losses)`` from this device's blocks, inside the
    caller's ``shard_map``."""
    axes = _names(layout.batch_axis) + _names(layout.vocab_axis)
    checked = vma_checked(layout.batch_axis, layout.vocab_axis)
    inputs = tuple(None if a is None else _varying(a) for a in (x, weight, bias))
    local = dataclasses.replace(layout, sum_grad_x=False)
    return _inside(x, weight, bias, teacher, labels, row_weight, loss, run, local, backend, (checked, axes, inputs))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _inside(x, weight, bias, teacher, labels, row_weight, loss, run, layout: Layout, backend: Backend, how):
    value, rows, *_ = backend.compute(x, weight, bias, teacher, labels, row_weight, loss, run, layout, Needs(), backend)
    return layout.batch_sum(value), rows


def _inside_forward(x, weight, bias, teacher, labels, row_weight, loss, run, layout, backend, how):
    del how  # the backward rule's
    value, rows, grads = compute_primals((x, weight, bias, teacher, labels, row_weight), loss, run, layout, backend)
    return (layout.batch_sum(value), rows), grads


def _inside_backward(loss, run, layout, backend, how, res, cts):
    del loss, run, layout, backend
    checked, axes, inputs = how
    ct = loss_cotangent(cts)
    if not checked:
        ct = lax.psum(ct, axes)
        return (*(scale_grad(g, ct) for g in res), None, None, None)
    grads = []
    for grad, varying in zip(res, inputs, strict=True):
        if grad is not None:
            grad = scale_grad(grad, ct)
            if extra := tuple(sorted(_varying(grad) - varying)):
                grad = lax.psum(grad, extra)
            if missing := tuple(sorted(varying - _varying(grad))):
                grad = lax.pcast(grad, missing, to="varying")
        grads.append(grad)
    return (*grads, None, None, None)


_inside.defvjp(_inside_forward, _inside_backward, symbolic_zeros=True)
