"""Check every argument against docs/contract.md before any kernel runs (labels' and top-k
indices' values: before any kernel reads them, see :func:`check_values`)."""

from __future__ import annotations

import dataclasses
import inspect
import zlib
from collections.abc import Callable

import torch

from fused_kl.checks import (
    ArrayFacts,
    Shapes,
    check_array_args,
    check_flag,
    check_int32_ignore_index,
    check_options,
    check_teacher_arrays,
    single_device_backend,
    teacher_weight_required,
    widened_index_dtype,
)
from fused_kl.loss import VALUE_ARGUMENTS, Loss
from fused_kl.options import RunOptions
from fused_kl.value_checks import check_value_summary, target_values_checked, value_summary

from . import backends
from .backends import Backend
from .layout import Layout, check_group_type

_OPTION_NAMES = set(inspect.signature(check_options).parameters) - {"with_teacher"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "int"


def _dtensor_placements(value: torch.Tensor) -> tuple | None:
    """The placements of a ``DTensor``, or None for a plain tensor."""
    placements = getattr(value, "placements", None)
    return None if placements is None or not hasattr(value, "to_local") else tuple(placements)


def facts(name: str, value: object) -> ArrayFacts:
    """Describe a tensor argument, or raise ``TypeError`` if it is not one. A ``DTensor`` is
    refused: its local block is not the array the contract describes (a ``Shard(0)`` head from
    FSDP2 would be a slice of the vocabulary)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if (placements := _dtensor_placements(value)) is not None:
        raise ValueError(
            f"{name}: expected a plain torch.Tensor, got a DTensor with placements {placements}: pass the full "
            "array (call the loss where FSDP2 has unsharded the head), a local slice with batch_group= / "
            "vocab_group=, or use torch_kl.parallel.LinearLossParallel"
        )
    if not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(value):
        raise TypeError(
            f"{name}: a tensor of a torch.func transform (grad, vmap, jacrev, ...), which the fused loss does not "
            "support: its gradients are made in its forward pass; use loss.backward() or torch.autograd.grad, "
            "and a loop over problems instead of vmap"
        )
    return ArrayFacts(tuple(value.shape), _dtype_name(value.dtype), _kind(value.dtype), str(value.device))


def _concrete() -> bool:
    """Values can be read on the host: eager mode, not while ``torch.compile`` traces nor while
    a CUDA graph is captured."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _comparable(a: torch.Tensor | None) -> torch.Tensor:
    """``a`` detached, an 8-bit float one as float16 (exactly: torch reduces and compares no 8-bit
    float on the CPU)."""
    assert a is not None
    a = a.detach()
    return a.to(torch.float16) if a.is_floating_point() and a.element_size() == 1 else a


def check_values(
    loss: Loss, labels: torch.Tensor | None, indices: torch.Tensor | None, v_total: int,
    target: torch.Tensor | None = None, row_weight: torch.Tensor | None = None,
) -> Callable[[], None] | None:  # fmt: skip
    """Value checks of labels (hard term), top-k indices, row weights and the teacher's sign
    (``fused_kl.value_checks.target_values_checked``), in eager mode only: under ``torch.compile`` a
    bad row's loss is NaN instead (reading values would break the graph); the teacher's values
    are not checked there.

    Returns ``wait()``, which raises on a bad value (None when there is nothing to check). The
    extremes and the duplicate flag are reduced on the device and copied back in one transfer,
    asynchronously on a GPU: the driver queues the first chunk's GEMMs, which read neither,
    before it waits, so the GPU works while the host waits instead of idling after it.
    """
    if not _concrete():
        return None
    check_labels = loss.cross_entropy and labels is not None and labels.numel() > 0
    check_weights = row_weight is not None and row_weight.numel() > 0
    check_indices = indices is not None and indices.numel() > 0
    check_target = target_values_checked(loss) and target is not None and target.numel() > 0
    keep = None if labels is None else (labels != loss.ignore_index).reshape(-1)
    parts = value_summary(
        labels if check_labels else None,
        indices if check_indices else None,
        keep,
        lambda a: a.sort(-1).values,
        torch,
        _comparable(target) if check_target else None,
        loss.teacher.format if check_target else "probs",  # type: ignore[union-attr]
        _comparable(row_weight) if check_weights else None,
    )
    if not parts:
        return None
    summary = torch.stack([p.to(torch.int64) for p in parts])
    done = None
    if summary.is_cuda:
        host = torch.empty(summary.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(summary, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(summary.device))  # the copy's stream, on the labels' GPU
        summary = host

    def wait() -> None:
        if done is not None:
            done.synchronize()
        check_value_summary(summary.tolist(), loss, check_labels, check_indices, v_total, check_target, check_weights)

    return wait


def _values_as_floats(options: dict[str, object]) -> dict[str, object]:
    """``options`` with a 0-d tensor given for a hyperparameter value (``fused_kl.loss.VALUE_ARGUMENTS``)
    read as a float, checked as one. Only where values are concrete: under ``torch.compile`` a float
    that changes between calls is already a runtime value (``torch_kl.compiled``)."""
    for name in VALUE_ARGUMENTS:
        value = options.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        if value.ndim != 0 or not value.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a float or a 0-d float tensor, got a {value.dtype} tensor of shape "
                            f"{list(value.shape)}")  # fmt: skip
        if not _concrete():
            raise TypeError(
                f"{name}: a tensor cannot be read while torch.compile traces or a CUDA graph is captured; pass a "
                "Python float (a float that changes between calls is a value of the compiled graph, not a constant)"
            )
        options[name] = float(value.detach())
    return options


def widen_indices(arrays: dict[str, object]) -> dict[str, object]:
    """``arrays`` with labels and top-k indices of a narrower integer dtype as new int64 tensors
    (``fused_kl.checks.INDEX_DTYPES``); the caller's tensors are untouched."""
    out = dict(arrays)
    for name in ("labels", "target_indices"):
        a = out.get(name)
        if isinstance(a, torch.Tensor) and widened_index_dtype(facts(name, a), "int64"):
            out[name] = a.to(torch.int64)
    return out


def validate(
    arrays: dict[str, object], layout: Layout, *, accum_dtype: object, with_teacher: bool = True, **options: object
) -> tuple[Shapes, Loss, RunOptions, Backend, Callable[[], None] | None]:
    """Check every argument; return the problem's sizes, the loss, the run options, the backend
    resolved (``backends.resolve``: the value everything after runs) and the value check's
    ``wait()`` (see :func:`check_values`; the caller runs it before any kernel reads labels or
    token ids).

    With a group, the value check is waited for here and the ranks then compare their calls
    (``Layout.agree``): a rank whose own arguments are rejected still takes part, so that every
    rank raises instead of hanging.
    """
    if not layout.distributed:
        return _validate(arrays, layout, accum_dtype, with_teacher, options)
    x = arrays["x"]
    device = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
    layout.check_groups()
    if torch.compiler.is_compiling():  # the ranks' comparison reads gathered values: not in a graph
        return _validate(arrays, layout, accum_dtype, with_teacher, options)
    try:
        shapes, loss, run, backend, wait = _validate(arrays, layout, accum_dtype, with_teacher, options)
        if wait is not None:
            wait()
    except (TypeError, ValueError):
        layout.agree(None, device)
        raise
    layout.agree(_facts(arrays, shapes, loss, run), device)
    return shapes, loss, run, backend, None


def _facts(arrays: dict[str, object], shapes: Shapes, loss: Loss, run: RunOptions) -> tuple[int, ...]:
    """What ``Layout.agree`` compares across ranks: sizes, and a digest of everything else."""
    given = tuple(sorted(k for k, a in arrays.items() if a is not None))
    dtypes = tuple(str(arrays[k].dtype) for k in given)  # type: ignore[attr-defined]
    # Which gradients are made decides the collectives too (grad_x's all-reduce over vocab_group).
    wanted = [arrays[k] for k in ("x", "weight", "bias") if k in given]
    grads = tuple(torch.is_grad_enabled() and a.requires_grad for a in wanted)  # type: ignore[attr-defined]
    call = repr((loss, run.chunk_size, run.accum_dtype, given, dtypes, grads))
    return shapes.n, shapes.h, shapes.v, shapes.t, zlib.crc32(call.encode())


def _accum_dtype_name(accum_dtype: object) -> str | None:
    if accum_dtype is not None and not isinstance(accum_dtype, torch.dtype):
        raise TypeError(
            f"accum_dtype: expected None or a torch.dtype, got {type(accum_dtype).__name__} {accum_dtype!r}"
        )
    return None if accum_dtype is None else _dtype_name(accum_dtype)


def check_module_options(options: dict[str, object], with_teacher: bool = True, teacher_head: bool = False) -> None:
    """What a module's constructor can refuse of ``options`` before any array is seen, with the
    call's own messages: the values (``temperature=0``, ``beta=5``), ``accum_dtype``'s type, the
    backend's name (whether it runs on the inputs' device is known at the call), a group that is
    not a process group (whether ``torch.distributed`` is initialised is known at the call), a teacher array
    the format does not use, and (``teacher_head``: the module's forward takes no teacher head) a
    ``"hidden"`` format without its head. In the call's order, so that the first error is the
    call's."""
    check_flag("return_row_losses", options.get("return_row_losses", False))
    checked = _values_as_floats({k: v for k, v in options.items() if k in _OPTION_NAMES and k != "accum_dtype"})
    check_options(**checked, accum_dtype=_accum_dtype_name(options.get("accum_dtype")), with_teacher=with_teacher)
    backends.check_name(options.get("backend", "auto"))
    for group in ("batch_group", "vocab_group"):
        check_group_type(group, options.get(group))
    fmt = str(options.get("target_format", "probs"))
    check_teacher_arrays(fmt, options)
    if teacher_head and fmt == "hidden" and options.get("teacher_weight") is None:
        raise teacher_weight_required()


def _validate(
    arrays: dict[str, object], layout: Layout, accum_dtype: object, with_teacher: bool, options: dict[str, object]
) -> tuple[Shapes, Loss, RunOptions, Backend, Callable[[], None] | None]:
    options = _values_as_floats(dict(options))
    backend = options.pop("backend")
    loss, run = check_options(**options, accum_dtype=_accum_dtype_name(accum_dtype), with_teacher=with_teacher)
    x = arrays["x"]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    chosen = backends.resolve(backend, x.device)
    shards = layout.vocab_shards
    weight = arrays.get("weight")
    v_total = weight.shape[0] * shards if isinstance(weight, torch.Tensor) and weight.ndim == 2 else None
    shapes = check_array_args(facts, loss, v_total, **arrays)
    if chosen.single_device and layout.distributed:
        multi = [name for name, entry in backends.REGISTRY.items() if not entry.single_device]
        raise single_device_backend(backend, "batch_group and vocab_group", multi)
    if chosen.name == "pallas" and arrays.get("labels") is not None:
        check_int32_ignore_index(loss.ignore_index, "backend 'pallas' hands the labels to JAX as int32")
    wait = check_values(
        loss, arrays.get("labels"), arrays.get("target_indices"), shapes.v * shards, arrays.get("target"),  # type: ignore[arg-type]
        arrays.get("row_weight"),  # type: ignore[arg-type]
    )  # fmt: skip
    return shapes, loss, dataclasses.replace(run, values_checked=_concrete()), chosen, wait
