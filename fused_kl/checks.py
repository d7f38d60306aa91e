"""The argument contract (docs/contract.md), checked once for both frameworks (the checks of
concrete values are in ``value_checks``).

Each framework's ``validate`` module reduces its arrays to :class:`ArrayFacts` and calls
:func:`check_options` and :func:`check_array_args`, so a bad input raises the same error with the
same message in ``torch_kl`` and ``jax_kl``, before any kernel runs.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .loss import REDUCTIONS, TARGET_FORMATS, TOPK_TAILS, Loss, Teacher
from .options import FLOAT_DTYPES, RunOptions


@dataclass(frozen=True)
class ArrayFacts:
    """What the checks need to know of one array, whatever its framework."""

    shape: tuple[int, ...]
    dtype: str  # "float32", "bfloat16", "int64", ...
    kind: str  # "float", "int", "bool", "complex", or "other" (numpy's strings, objects, dates)
    device: str | None  # None when unknown (a JAX tracer)


@dataclass(frozen=True)
class Shapes:
    """The problem's sizes after flattening ``[B, T, ...]`` to ``[N, ...]``; ``t`` is the
    teacher's last dimension (``V``, its hidden size, or ``k``)."""

    n: int
    h: int
    v: int
    t: int


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_flag(name: str, value: object) -> bool:
    """A flag argument: ``True`` or ``False``, numpy's too (a string such as ``"no"`` would read as
    true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def check_number(name: str, value: object, ok: Callable[[float], bool], expected: str) -> float:
    if not _is_real(value):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")
    # Comparisons, not math.isfinite: under torch.compile a float that changed between calls is
    # symbolic, and Dynamo compares it (a guard) where it cannot call math on it. NaN fails both.
    if not -math.inf < value < math.inf or not ok(value):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return float(value)


def check_positive(name: str, value: object) -> float:
    return check_number(name, value, lambda v: v > 0, "a finite number > 0")


def _optional_positive(name: str, value: object) -> float | None:
    return None if value is None else check_number(name, value, lambda v: v > 0, "None or a finite number > 0")


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
    return value  # type: ignore[return-value]


def check_options(
    *,
    reduction: object = "batchmean",
    ignore_index: object = -100,
    temperature: object = 1.0,
    eps: object = 1e-10,
    target_format: object = "probs",
    teacher_temperature: object = None,
    beta: object = 0.0,
    weight_hard_loss: object = 0.0,
    weight_soft_loss: object = 1.0,
    label_smoothing: object = 0.0,
    logit_scale: object = 1.0,
    softcap: object = None,
    topk_tail: object = "bin",
    teacher_logit_scale: object = 1.0,
    teacher_softcap: object = None,
    z_loss_weight: object = 0.0,
    accum_dtype: str | None = None,
    chunk_size: object = None,
    with_teacher: bool = True,
) -> tuple[Loss, RunOptions]:
    """Validate every keyword argument but ``backend`` (the framework's registry resolves it into
    a value that travels beside the returned ``RunOptions``); ``accum_dtype`` arrives as a dtype name or None.
    ``with_teacher=False`` is the fused cross-entropy: no soft term."""
    if reduction == "none":
        raise ValueError(
            "reduction: 'none' is not supported: the gradient is computed in the forward pass, "
            "which needs a scalar loss and the rows' weights up front; pass row_weight= to weigh rows "
            "and return_row_losses=True to get each row's loss beside the scalar"
        )
    reduction = _one_of("reduction", reduction, REDUCTIONS)
    if not _is_int(ignore_index):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__} {ignore_index!r}")
    if not -(2**63) <= ignore_index < 2**63:
        raise ValueError(f"ignore_index: expected an int that fits in 64 bits, got {ignore_index!r}")
    temperature = check_positive("temperature", temperature)
    eps = check_number("eps", eps, lambda v: 0 < v < 1, "a number in (0, 1)")
    beta = check_number("beta", beta, lambda v: 0 <= v <= 1, "a finite number in [0, 1]")
    weights = [
        check_number(n, w, lambda v: v >= 0, "a finite number >= 0")
        for n, w in (
            ("weight_soft_loss", weight_soft_loss),
            ("weight_hard_loss", weight_hard_loss),
            ("z_loss_weight", z_loss_weight),
        )
    ]
    label_smoothing = check_number("label_smoothing", label_smoothing, lambda v: 0 <= v < 1, "a number in [0, 1)")
    target_format = _one_of("target_format", target_format, TARGET_FORMATS)
    topk_tail = _one_of("topk_tail", topk_tail, TOPK_TAILS)
    if target_format == "topk_log_probs":
        if beta != 0.0:
            raise ValueError(f"beta: top-k targets support beta = 0 (forward KL) only, got {beta!r}")
        if teacher_temperature is not None:
            raise ValueError(
                "teacher_temperature: not used with target_format='topk_log_probs' (the log-probabilities "
                f"are taken as given), got {teacher_temperature!r}"
            )
    teacher_t = temperature
    if teacher_temperature is not None:
        teacher_t = check_positive("teacher_temperature", teacher_temperature)
    teacher = Teacher(
        format=target_format,
        temperature=teacher_t,
        logit_scale=check_positive("teacher_logit_scale", teacher_logit_scale),
        softcap=_optional_positive("teacher_softcap", teacher_softcap),
        topk_tail=topk_tail,
        eps=eps,
    )
    if accum_dtype is not None and accum_dtype not in FLOAT_DTYPES:
        raise TypeError(f"accum_dtype: expected None or one of {', '.join(FLOAT_DTYPES)}, got {accum_dtype}")
    if chunk_size is not None:
        if not _is_int(chunk_size):
            raise TypeError(
                f"chunk_size: expected None or a positive int, got {type(chunk_size).__name__} {chunk_size!r}"
            )
        if chunk_size <= 0:
            raise ValueError(f"chunk_size: expected None or a positive int, got {chunk_size!r}")
    loss = Loss(
        reduction=reduction,
        ignore_index=int(ignore_index),
        temperature=temperature,
        beta=beta,
        weight_soft=weights[0] if with_teacher else 0.0,
        weight_hard=weights[1],
        label_smoothing=label_smoothing,
        logit_scale=check_positive("logit_scale", logit_scale),
        softcap=_optional_positive("softcap", softcap),
        teacher=teacher if with_teacher else None,
        z_loss=weights[2],
    )
    run = RunOptions(accum_dtype=accum_dtype, chunk_size=None if chunk_size is None else int(chunk_size))
    return loss, run


def cross_entropy_options(reduction: object, **options: object) -> dict[str, object]:
    """The loss options of a fused cross-entropy call: the hard term alone, and the reduction of its
    ``"mean"`` / ``"sum"`` (torch's meanings: ``"mean"`` divides by the kept rows; ``"none"`` goes
    on to :func:`check_options`' message)."""
    if reduction != "none":
        reduction = {"mean": "batchmean", "sum": "sum"}[_one_of("reduction", reduction, ("mean", "sum"))]
    return dict(options, reduction=reduction, weight_hard_loss=1.0, weight_soft_loss=0.0)


def _shape(facts: ArrayFacts) -> str:
    return _dims(facts.shape)


def _dims(dims: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def _same_device(name: str, facts: ArrayFacts, ref: ArrayFacts, ref_name: str = "x") -> None:
    if ref.device is not None and facts.device is not None and facts.device != ref.device:
        raise ValueError(f"{name}: expected the device of {ref_name} ({ref.device}), got {facts.device}")


def _device_reference(arrays: dict[str, ArrayFacts | None]) -> tuple[ArrayFacts, str]:
    """The array every other's device is checked against, and its name: ``x``, or where ``x``
    has none (a NumPy array, or a JAX array the call places), the first array that has one."""
    x = arrays["x"]
    assert x is not None
    placed = [(facts, name) for name, facts in arrays.items() if facts is not None and facts.device is not None]
    return (x, "x") if x.device is not None or not placed else placed[0]


def _float_array(name: str, facts: ArrayFacts, dtype: str | None = None, what: str = "") -> None:
    if facts.kind != "float" or (dtype is not None and facts.dtype != dtype):
        want = f"the dtype of {what} ({dtype})" if dtype else "a floating-point array"
        raise TypeError(f"{name}: expected {want}, got {facts.dtype}")


def _int_array(name: str, facts: ArrayFacts, lead: tuple[int, ...], what: str) -> None:
    if facts.kind != "int":
        raise TypeError(f"{name}: expected an integer array, got {facts.dtype}")
    if facts.shape != lead:
        raise ValueError(f"{name}: expected shape {_dims(lead)} ({what}), got {_shape(facts)}")


def check_arrays(loss: Loss, arrays: dict[str, ArrayFacts | None], v_total: int | None = None) -> Shapes:
    """Check kinds, dtypes, ranks, sizes and devices of the arrays (``None``: not given);
    return ``N, H, V`` and the teacher's last size. ``v_total`` is the whole vocabulary where
    ``weight`` holds a slice of it (vocabulary sharding; top-k indices are global)."""
    x, weight, labels, bias = (arrays.get(k) for k in ("x", "weight", "labels", "bias"))
    assert x is not None and weight is not None
    for name, facts in (("x", x), ("weight", weight)):
        if facts.kind != "float" or facts.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected a float32, bfloat16 or float16 array, got {facts.dtype}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight: expected the dtype of x ({x.dtype}), got {weight.dtype}")
    ref = _device_reference(arrays)
    if ref[0].device == "meta":  # shapes without values: nothing a loss can be computed from
        raise ValueError(f"{ref[1]}: expected an array with values, got one on the meta device")
    _same_device("weight", weight, *ref)
    if len(x.shape) not in (2, 3):
        raise ValueError(f"x: expected shape [N, H] or [B, T, H], got {_shape(x)}")
    if len(weight.shape) != 2:
        raise ValueError(f"weight: expected shape [V, H], got {_shape(weight)}")
    h = x.shape[-1]
    v, wh = weight.shape
    if h == 0:
        raise ValueError(f"x: expected a non-empty hidden size H, got shape {_shape(x)}")
    if v == 0:
        raise ValueError(f"weight: expected a non-empty vocabulary V, got shape {_shape(weight)}")
    if wh != h:
        raise ValueError(f"weight: expected shape [V, {h}] (H = x.shape[-1]), got {_shape(weight)}")
    lead = x.shape[:-1]
    n = math.prod(lead)
    t_size = _check_teacher(loss, arrays, ref, lead, v, v_total or v) if loss.teacher is not None else 0

    if labels is not None:
        _int_array("labels", labels, lead, "x's leading dims")
        _same_device("labels", labels, *ref)
        _check_labels_hold_ignore_index(labels.dtype, loss.ignore_index)
    elif loss.cross_entropy:
        raise ValueError(f"labels: required ({labels_role(loss)}), got None")
    row_weight = arrays.get("row_weight")
    if row_weight is not None:
        if row_weight.kind != "float":
            raise TypeError(f"row_weight: expected a floating-point array, got {row_weight.dtype}")
        if row_weight.shape != lead:
            raise ValueError(f"row_weight: expected shape {_dims(lead)} (x's leading dims), got {_shape(row_weight)}")
        _same_device("row_weight", row_weight, *ref)
    if bias is not None:
        _float_array("bias", bias, x.dtype, "x")
        if bias.shape != (v,):
            raise ValueError(f"bias: expected shape [{v}] (V), got {_shape(bias)}")
        _same_device("bias", bias, *ref)
    return Shapes(n=n, h=h, v=v, t=t_size)


def _check_teacher(
    loss: Loss, arrays: dict[str, ArrayFacts | None], ref: tuple[ArrayFacts, str], lead: tuple[int, ...], v: int,
    v_total: int,
) -> int:
    """The teacher's arrays by format (``ref``: the array devices are checked against, and its
    name); returns the target's last size."""
    fmt = loss.teacher.format  # type: ignore[union-attr]
    target, tw, tb, idx = (arrays.get(k) for k in ("target", "teacher_weight", "teacher_bias", "target_indices"))
    if target is None:
        raise ValueError("target: required, got None")
    _float_array("target", target, None)
    _same_device("target", target, *ref)
    head_ref = (target, "target") if target.device is not None else ref  # the teacher head beside its states
    check_teacher_arrays(fmt, arrays)
    if fmt == "hidden":
        if len(target.shape) != len(lead) + 1 or target.shape[:-1] != lead:
            raise ValueError(
                f"target: expected shape {_dims((*lead, 'Ht'))} (teacher hidden states), "  # type: ignore[arg-type]
                f"got {_shape(target)}"
            )
        if tw is None:
            raise teacher_weight_required()
        _float_array("teacher_weight", tw, target.dtype, "target")
        _same_device("teacher_weight", tw, *head_ref)
        if len(tw.shape) != 2 or tw.shape[1] != target.shape[-1]:
            raise ValueError(f"teacher_weight: expected shape [V, {target.shape[-1]}], got {_shape(tw)}")
        if tw.shape[0] != v:
            raise ValueError(
                f"teacher_weight: expected {v} rows (the student's V), got {tw.shape[0]}: slice padded "
                f"vocabulary rows off (teacher_weight[:{v}])"
            )
        if tb is not None:
            _float_array("teacher_bias", tb, target.dtype, "target")
            _same_device("teacher_bias", tb, *head_ref)
            if tb.shape != (v,):
                raise ValueError(f"teacher_bias: expected shape [{v}] (V), got {_shape(tb)}")
        return target.shape[-1]
    if fmt == "topk_log_probs":
        if len(target.shape) != len(lead) + 1 or target.shape[:-1] != lead:
            raise ValueError(
                f"target: expected shape {_dims((*lead, 'k'))} (top-k log-probs), "  # type: ignore[arg-type]
                f"got {_shape(target)}"
            )
        k = target.shape[-1]
        if not 1 <= k <= v_total:
            raise ValueError(f"target: expected 1 <= k <= V ({v_total}) top-k entries per row, got k = {k}")
        if idx is None:
            raise ValueError("target_indices: required with target_format='topk_log_probs' (the tokens of target)")
        _int_array("target_indices", idx, (*lead, k), "target's shape")
        _same_device("target_indices", idx, *ref)
        return k
    if target.shape != (*lead, v):
        raise ValueError(f"target: expected shape {_dims((*lead, v))} (x's leading dims, V), got {_shape(target)}")
    return v


# The teacher's arrays that one format alone uses.
TEACHER_ARRAYS = {"teacher_weight": "hidden", "teacher_bias": "hidden", "target_indices": "topk_log_probs"}


def check_teacher_arrays(fmt: str, given: Mapping[str, object]) -> None:
    """Refuse a teacher array of ``given`` (arguments by name; None: not given) that ``fmt`` does
    not use."""
    for name, used in TEACHER_ARRAYS.items():
        if given.get(name) is not None and fmt != used:
            raise ValueError(f"{name}: only used with target_format={used!r}, got one with {fmt!r}")


def teacher_weight_required() -> ValueError:
    return ValueError("teacher_weight: required with target_format='hidden' (the teacher's head [V, Ht])")


def check_array_args(
    describe: Callable[[str, object], ArrayFacts], loss: Loss, v_total: int | None = None, **arrays: object
) -> Shapes:
    """Describe each given array with the framework's ``describe`` (which raises ``TypeError``
    for a non-array) and check them together with :func:`check_arrays`."""
    required = ("x", "weight")  # None is not an array: a TypeError, like any other non-array
    facts = {name: None if value is None and name not in required else describe(name, value)
             for name, value in arrays.items()}
    return check_arrays(loss, facts, v_total)


def labels_role(loss: Loss) -> str:
    """What the labels are for, as the messages about them say it."""
    if loss.teacher is None:
        return "the cross-entropy's class indices"
    return "the hard term's class indices, weight_hard_loss > 0"


# The integer dtypes labels and top-k indices are used in. Narrower ones are widened first
# (:func:`widened_index_dtype`): a gather may not take them, and comparing them with
# ``ignore_index`` in their own dtype would wrap it (256 equals 0 in int8).
INDEX_DTYPES = ("int32", "int64")


def widened_index_dtype(facts: ArrayFacts, wide: str) -> str | None:
    """The dtype (``wide``, the framework's choice) labels or top-k indices of another integer
    dtype than :data:`INDEX_DTYPES` are widened to; None when they are used as they are."""
    return wide if facts.kind == "int" and facts.dtype not in INDEX_DTYPES else None


def _check_labels_hold_ignore_index(dtype: str, ignore_index: int) -> None:
    """Labels are compared with ``ignore_index`` in their own dtype (``"int8"``, ``"uint16"``...):
    int32 labels with a wider ``ignore_index`` are refused (:func:`check_int32_ignore_index`);
    labels of a dtype that cannot hold it could never mark a row ignored (uint8 cannot hold -100)."""
    if dtype == "int32":
        check_int32_ignore_index(ignore_index, "the labels are int32")
        return
    bits = int(dtype.removeprefix("u").removeprefix("int"))
    lo, hi = (0, 2**bits) if dtype.startswith("u") else (-(2 ** (bits - 1)), 2 ** (bits - 1))
    if not lo <= ignore_index < hi:
        raise TypeError(
            f"labels: {dtype} cannot hold ignore_index ({ignore_index}), so no row could be ignored: pass "
            f"int64 or int32 labels, or an ignore_index in [{lo}, {hi - 1}]"
        )


def check_int32_ignore_index(ignore_index: int, why: str) -> None:
    """Where labels are compared as int32, ``ignore_index`` must fit in 32 bits (``why`` says where)."""
    if not -(2**31) <= ignore_index < 2**31:
        raise ValueError(f"ignore_index: expected an int that fits in 32 bits ({why}), got {ignore_index!r}")


class BackendUnavailable(ValueError):
    """The error for a known backend that cannot run here: its name (``backend``) and why
    (``why``), both in the message."""

    def __init__(self, backend: str, why: str) -> None:
        super().__init__(f"backend: {backend!r} is not available here: {why}")
        self.backend, self.why = backend, why


def unknown_backend(backend: object, names: tuple[str, ...]) -> ValueError:
    return ValueError(f"backend: expected one of {', '.join(repr(n) for n in names)}, got {backend!r}")


def single_device_backend(backend: str, layout_args: str, multi_device: Sequence[str]) -> ValueError:
    """The error for a one-device backend asked for a multi-device layout by ``layout_args``,
    naming the backends that take one."""
    names = [repr(n) for n in multi_device]
    listed = names[-1] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return ValueError(f"backend: {backend!r} runs on one device; {layout_args} need {listed}")
