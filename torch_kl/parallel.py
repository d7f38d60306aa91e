"""``LinearLossParallel``: the fused losses under ``torch.distributed.tensor.parallel``.

``parallelize_module(loss_module, mesh, LinearLossParallel(sequence_dim=1))`` makes a
``FusedLinearKLDivLoss`` (or ``FusedLinearJSDLoss``, ``FusedLinearCrossEntropyLoss``) take
its rows sharded over a 1-D ``DeviceMesh`` (sequence / data parallel) and run with
``batch_group`` = the mesh's process group, so the loss is normalised over the rows of all
ranks. For each call:

* row arguments (``x``, ``target``, ``labels``, ``row_weight``, ``target_indices``; the JSD module's
  ``student_input``, ``teacher_input``, ``true_labels``): a ``DTensor`` is redistributed to
  ``Shard(sequence_dim)`` (uneven shards are fine) and its local rows used; a plain tensor is
  taken as this rank's rows already;
* head arguments (``weight``, ``bias``, teacher heads): a ``Replicate`` DTensor is used
  locally, its gradient reported as ``Partial`` so that DTensor sums the ranks' shares; a
  plain tensor (an ``nn.Linear`` head's weight) gets the same sum, all-reduced over the mesh
  in backward: every rank's ``.grad`` is the global loss's gradient. A
  ``Shard`` DTensor (FSDP2's ``fully_shard`` on the head) is refused with a ``ValueError``:
  gathering it here would send its gradient around FSDP2's reduce-scatter and its gradient
  divide factor, scaled differently from every other parameter's. Compute the loss where
  FSDP2 has unsharded the head (inside the forward of the module that holds it);
* the output is the global loss as a ``Partial`` DTensor (``.full_tensor()`` gives its value;
  ``.backward()`` works as is), or, with ``use_local_output=True``, this rank's share
  ``local_sum / global_n`` as a plain tensor (the ranks' shares sum to the global loss).
  With ``return_row_losses=True`` the row losses come back beside it as this rank's rows' (a
  plain tensor, shaped like its local rows): a shard of the rows, not a share of a sum.

Arrays in the module's own options (``teacher_weight``, ``target_indices`` given at
construction) are passed through unchanged.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from .module import FusedLinearCrossEntropyLoss, FusedLinearJSDLoss, FusedLinearKLDivLoss

ROWS = ("x", "target", "labels", "row_weight", "target_indices", "student_input", "teacher_input", "true_labels")
HEADS = ("weight", "bias", "student_weight", "student_bias", "teacher_weight", "teacher_bias")
MODULES = (FusedLinearKLDivLoss, FusedLinearJSDLoss, FusedLinearCrossEntropyLoss)


class LinearLossParallel(ParallelStyle):
    """Rows sharded along ``sequence_dim`` of the row arguments, head replicated; see the module
    docstring. ``sequence_dim`` indexes every row argument alike (``x [B, T, H]``, ``labels
    [B, T]``, ``target [B, T, V]``: 1; flat ``[N, ...]`` rows: 0)."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False) -> None:
        super().__init__()
        if not isinstance(sequence_dim, int) or isinstance(sequence_dim, bool) or sequence_dim < 0:
            raise ValueError(f"sequence_dim: expected an int >= 0, got {sequence_dim!r}")
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        if not isinstance(module, MODULES):
            names = ", ".join(m.__name__ for m in MODULES)
            raise TypeError(f"LinearLossParallel: expected one of {names}, got {type(module).__name__}")
        if device_mesh.ndim != 1:
            raise ValueError(
                f"device_mesh: expected a 1-D mesh (the ranks sharing the rows), got {device_mesh.ndim} "
                "dimensions; pass the sub-mesh, e.g. mesh['dp']"
            )
        for name in ("batch_group", "vocab_group"):
            if module.options.get(name) is not None:  # type: ignore[union-attr]
                raise ValueError(f"{name}: already set on {type(module).__name__}; LinearLossParallel sets batch_group")
        module.options = {**module.options, "batch_group": device_mesh.get_group()}  # type: ignore[operator]
        signature = inspect.signature(module.forward)
        module.register_forward_pre_hook(functools.partial(self._inputs, signature, device_mesh), with_kwargs=True)
        module.register_forward_hook(functools.partial(self._output, device_mesh))
        return module

    def _inputs(
        self, signature: inspect.Signature, mesh: DeviceMesh, module: torch.nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict[str, Any]]:
        bound = signature.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        for name, value in arguments.items():
            if name in ROWS:
                arguments[name] = self._rows(name, value, mesh)
            elif name in HEADS:
                arguments[name] = _head(name, value, mesh)
        return (), arguments

    def _rows(self, name: str, a: Any, mesh: DeviceMesh) -> Any:
        if not isinstance(a, DTensor):
            return a  # this rank's rows already
        _same_mesh(name, a, mesh)
        if self.sequence_dim >= a.ndim:
            raise ValueError(f"{name}: sequence_dim {self.sequence_dim} is not a dimension of shape {list(a.shape)}")
        sharded = (Shard(self.sequence_dim),)
        if tuple(a.placements) != sharded:
            a = a.redistribute(placements=sharded)
        return a.to_local()

    def _output(self, mesh: DeviceMesh, module: torch.nn.Module, inputs: Any, output: Any) -> Any:
        if self.use_local_output:
            return output
        rows = None
        if module.options.get("return_row_losses"):  # type: ignore[union-attr]
            output, rows = output
        if isinstance(output, tuple):  # FusedLinearJSDLoss(return_soft_hard_loss=True)
            loss = tuple(DTensor.from_local(o, mesh, (Partial(),)) for o in output)
        else:
            loss = DTensor.from_local(output, mesh, (Partial(),))
        return loss if rows is None else (loss, rows)


def _same_mesh(name: str, a: DTensor, mesh: DeviceMesh) -> None:
    if a.device_mesh != mesh:
        raise ValueError(f"{name}: a DTensor on {a.device_mesh}, expected one on the style's mesh {mesh}")


class _SumGradOverRanks(torch.autograd.Function):
    """The identity, whose backward sums the gradient over ``group`` (an all-reduce): a plain
    head's gradient, as DTensor sums a ``Partial`` one."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return a.view_as(a)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.clone(memory_format=torch.contiguous_format)
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def _head(name: str, a: Any, mesh: DeviceMesh) -> Any:
    if not isinstance(a, DTensor):
        if isinstance(a, torch.Tensor) and a.requires_grad and torch.is_grad_enabled():
            return _SumGradOverRanks.apply(a, mesh.get_group())
        return a
    _same_mesh(name, a, mesh)
    if any(isinstance(p, Shard) for p in a.placements):
        raise ValueError(
            f"{name}: a DTensor sharded as {tuple(a.placements)} (FSDP2's fully_shard on the head?) is refused: "
            "gathering it here would send its gradient around FSDP2's reduce-scatter and gradient divide factor. "
            "Compute the loss where the head is unsharded (inside the forward of the module holding it), or pass "
            "a Replicate DTensor or a plain tensor"
        )
    if not all(isinstance(p, Replicate) for p in a.placements):
        a = a.redistribute(placements=(Replicate(),))
    return a.to_local(grad_placements=(Partial(),))
