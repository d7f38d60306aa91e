"""The loss as one opaque ``torch.library`` custom op, for ``torch.compile``.

Inside ``torch.compile`` (and CUDA graphs through ``mode="reduce-overhead"``) the chunk driver
runs as one op with a fake implementation: Dynamo traces no Python of ours and Inductor never
re-lowers our Triton kernels or reasons about their in-place writes into chunk views, which it
gets wrong (a loop-carried statistic promoted to float64; all-zero gradients on the H200). The
op returns the gradients as outputs; its backward multiplies them by the upstream gradient, a
pointwise kernel that Inductor may run in place. Eager calls keep
``autograd.FusedLinearLossFunction``, whose backward scales the saved gradients in place.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import types

import torch

from fused_kl.loss import Loss, Teacher, values_of, with_values
from fused_kl.options import Needs, RunOptions

from .backends import REGISTRY, Backend
from .layout import Layout
from .teachers import TeacherArrays

# What a Backend runs, crossing the op as import paths (``module`` or ``module:function``) and
# its switches as ``True``/``False``.
_PARTS = tuple(f.name for f in dataclasses.fields(Backend) if f.name != "entry")
_SWITCHES = {"True": True, "False": False}


def _path(part: object) -> str:
    if part is None:
        return ""
    if isinstance(part, bool):
        return str(part)
    if isinstance(part, types.ModuleType):
        return part.__name__
    return f"{part.__module__}:{part.__name__}"  # type: ignore[attr-defined]


def _load(path: str) -> object:
    if not path:
        return None
    if path in _SWITCHES:
        return _SWITCHES[path]
    module, _, name = path.partition(":")
    found = importlib.import_module(module)
    return getattr(found, name) if name else found


def _encode_backend(backend: Backend) -> str:
    """The backend value as a string the op takes: its name and the import paths of its parts
    (module-level functions and modules), so that a ``dataclasses.replace`` variant crosses too."""
    return ";".join([backend.name, *(_path(getattr(backend, part)) for part in _PARTS)])


@functools.cache
def _decode_backend(encoded: str) -> Backend:
    name, *paths = encoded.split(";")
    return Backend(REGISTRY[name], **{part: _load(path) for part, path in zip(_PARTS, paths, strict=True)})


def _encode(
    loss: Loss, run: RunOptions, layout: Layout, backend: Backend
) -> tuple[list[float], list[float], list[int], str]:
    """The arguments as the numbers and the string a custom op takes: ``(values, floats, ints,
    string)``. ``values``, ``fused_kl.loss.VALUES``, cross as a tensor (:func:`apply`): Dynamo makes
    a float that changed between calls symbolic, and a symbolic float in the op's schema would be
    made a constant of the graph again, recompiled for every value of a schedule (temperature
    annealing, loss-weight warm-up) until Dynamo's recompile limit fails the call."""
    t = loss.teacher
    floats = [loss.logit_scale, -1.0 if loss.softcap is None else loss.softcap]
    if t is not None:
        floats += [t.logit_scale, -1.0 if t.softcap is None else t.softcap, t.eps]
    groups = [_group_name(g) for g in (layout.batch_group, layout.vocab_group)]
    strs = [loss.reduction, _encode_backend(backend), run.accum_dtype or "", *groups] + (
        [] if t is None else [t.format, t.topk_tail]
    )
    ints = [loss.ignore_index, run.chunk_size or 0, int(run.values_checked)]
    return values_of(loss), floats, ints, "|".join(strs)


def _decode(
    values: list[float], floats: list[float], ints: list[int], joined: str
) -> tuple[Loss, RunOptions, Layout, Backend]:
    strs = joined.split("|")
    cap = lambda c: None if c < 0 else c
    teacher = None
    if len(strs) > 5:
        teacher = Teacher(strs[5], 1.0, floats[2], cap(floats[3]), strs[6], floats[4])
    loss = with_values(Loss(strs[0], ints[0], logit_scale=floats[0], softcap=cap(floats[1]), teacher=teacher), values)
    run = RunOptions(strs[2] or None, ints[1] or None, bool(ints[2]))
    return loss, run, Layout(*(_group(name) for name in strs[3:5])), _decode_backend(strs[1])


def _group_name(group) -> str:
    return "" if group is None else group.group_name


def _group(name: str):
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,))


@torch.library.custom_op("torch_kl::fused_linear_loss", mutates_args=())
def fused_linear_loss_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor | None,
    teacher_weight: torch.Tensor | None, teacher_bias: torch.Tensor | None, target_indices: torch.Tensor | None,
    labels: torch.Tensor | None, row_weight: torch.Tensor | None, values: torch.Tensor, floats: list[float],
    ints: list[int], strs: str, needs_x: bool, needs_weight: bool, needs_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    # ``values`` is a CPU tensor: reading it costs no device sync, and the kernels take the
    # numbers as launch arguments (never compile-time constants).
    loss, run, layout, backend = _decode(values.tolist(), floats, ints, strs)
    needs = Needs(needs_x, needs_weight, needs_bias)
    teacher = TeacherArrays(target, teacher_weight, teacher_bias, target_indices)
    value, rows, gx, gw, gb = backend.compute(
        x, weight, bias, teacher, labels, row_weight, loss, run, layout, needs, backend
    )  # fmt: skip
    grads = (_empty(x) if gx is None else gx, _empty(weight) if gw is None else gw, _empty(x) if gb is None else gb)
    return value, rows, *grads


@fused_linear_loss_op.register_fake
def _(
    x,
    weight,
    bias,
    target,
    teacher_weight,
    teacher_bias,
    target_indices,
    labels,
    row_weight,
    values,
    floats,
    ints,
    strs,
    needs_x,
    needs_weight,
    needs_bias,
):
    value = x.new_empty((), dtype=torch.float32)
    rows = x.new_empty((x.shape[0],), dtype=torch.float32)
    gb = bias.new_empty(bias.shape) if needs_bias else _empty(x)
    return (
        value,
        rows,
        x.new_empty(x.shape if needs_x else (0,)),
        weight.new_empty(weight.shape if needs_weight else (0,)),
        gb,
    )


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*output[2:])  # the gradients; the row losses carry none
    ctx.mark_non_differentiable(output[1])
    ctx.needs = inputs[-3:]  # needs_x, needs_weight, needs_bias
    ctx.no_grads = len(inputs) - 3  # the gradients of the other inputs: none


def _backward(ctx, grad_loss, *unused):
    grads = [
        g.to(torch.float32).mul(grad_loss).to(g.dtype) if needed else None
        for g, needed in zip(ctx.saved_tensors, ctx.needs, strict=True)
    ]
    return (*grads, *([None] * ctx.no_grads))


fused_linear_loss_op.register_autograd(_backward, setup_context=_setup)


def apply(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, teacher: TeacherArrays,
    labels: torch.Tensor | None, row_weight: torch.Tensor | None, loss: Loss, run: RunOptions, layout: Layout,
    needs: Needs, backend: Backend,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(loss, the rows' own losses)`` through the custom op (the loss's gradients flow through its
    autograd formula)."""
    values, *static = _encode(loss, run, layout, backend)
    return fused_linear_loss_op(
        x,
        weight,
        bias,
        teacher.target,
        teacher.weight,
        teacher.bias,
        teacher.indices,
        labels,
        row_weight,
        torch.tensor(values, dtype=torch.float64),
        *static,
        needs.x,
        needs.weight,
        needs.bias,
    )[:2]
