"""The argument contract of SPEC.md, checked once for both frameworks.

Each framework's ``validate`` module reduces its arrays to :class:`ArrayFacts` and calls
:func:`check_arrays` and :func:`check_options`, so a bad input raises the same error with
the same message in ``torch_kl`` and ``jax_kl``, before any kernel runs.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

REDUCTIONS = ("batchmean", "sum", "mean")
TARGET_FORMATS = ("probs", "log_probs", "logits")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
ACCUM_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ArrayFacts:
    """What the checks need to know of one array, whatever its framework."""

    shape: tuple[int, ...]
    dtype: str  # "float32", "bfloat16", "int64", ...
    kind: str  # "float", "int", "bool", "complex"
    device: str | None  # None when unknown (a JAX tracer)


@dataclass(frozen=True)
class Options:
    """The validated keyword arguments; hashable, so it can be a static argument."""

    reduction: str
    ignore_index: int
    temperature: float
    eps: float
    target_format: str
    teacher_temperature: float
    accum_dtype: str | None
    chunk_size: int | None
    backend: str


@dataclass(frozen=True)
class Shapes:
    """The problem's sizes after flattening ``[B, T, ...]`` to ``[N, ...]``."""

    n: int
    h: int
    v: int


def _is_real(value: object) -> bool:
    """A real number, NumPy scalars included; not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    """An integer, NumPy integer scalars included; not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _positive_finite(name: str, value: object) -> float:
    if not _is_real(value):
        raise TypeError(f"{name}: expected a finite number > 0, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
    return float(value)


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
    return value  # type: ignore[return-value]


def check_options(
    *,
    reduction: object,
    ignore_index: object,
    temperature: object,
    eps: object,
    target_format: object,
    teacher_temperature: object,
    accum_dtype: str | None,
    chunk_size: object,
    backend: object,
    backends: tuple[str, ...],
) -> Options:
    """Validate every keyword argument; ``accum_dtype`` arrives as a dtype name or None."""
    if reduction == "none":
        raise ValueError(
            "reduction: 'none' is not supported: the gradient is computed in the forward pass, "
            "which needs a scalar loss; use 'sum' and divide as you like, or the unfused loss "
            "for per-row values"
        )
    reduction = _one_of("reduction", reduction, REDUCTIONS)
    if not _is_int(ignore_index):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__} {ignore_index!r}")
    ignore_index = int(ignore_index)
    if not -(2**63) <= ignore_index < 2**63:
        raise ValueError(f"ignore_index: expected an int that fits in 64 bits, got {ignore_index!r}")
    temperature = _positive_finite("temperature", temperature)
    if teacher_temperature is None:
        teacher_temperature = temperature
    teacher_temperature = _positive_finite("teacher_temperature", teacher_temperature)
    if not _is_real(eps):
        raise TypeError(f"eps: expected a number in (0, 1), got {type(eps).__name__} {eps!r}")
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps: expected a number in (0, 1), got {eps!r}")
    target_format = _one_of("target_format", target_format, TARGET_FORMATS)
    if accum_dtype is not None and accum_dtype not in ACCUM_DTYPES:
        raise TypeError(f"accum_dtype: expected None or one of {', '.join(ACCUM_DTYPES)}, got {accum_dtype}")
    if chunk_size is not None:
        if not _is_int(chunk_size):
            raise TypeError(
                f"chunk_size: expected None or a positive int, got {type(chunk_size).__name__} {chunk_size!r}"
            )
        if chunk_size <= 0:
            raise ValueError(f"chunk_size: expected None or a positive int, got {chunk_size!r}")
        chunk_size = int(chunk_size)
    backend = _one_of("backend", backend, backends)
    return Options(
        reduction=reduction,
        ignore_index=ignore_index,
        temperature=temperature,
        eps=float(eps),
        target_format=target_format,
        teacher_temperature=teacher_temperature,
        accum_dtype=accum_dtype,
        chunk_size=chunk_size,
        backend=backend,
    )


def _shape(facts: ArrayFacts) -> str:
    return "[" + ", ".join(str(d) for d in facts.shape) + "]"


def check_arrays(
    x: ArrayFacts,
    weight: ArrayFacts,
    target: ArrayFacts,
    labels: ArrayFacts | None,
    bias: ArrayFacts | None,
) -> Shapes:
    """Check kinds, dtypes, ranks, sizes and devices; return ``N, H, V``."""
    for name, facts in (("x", x), ("weight", weight)):
        if facts.kind != "float" or facts.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected a float32, bfloat16 or float16 array, got {facts.dtype}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight: expected the dtype of x ({x.dtype}), got {weight.dtype}")
    if x.device is not None and weight.device is not None and x.device != weight.device:
        raise ValueError(f"weight: expected the device of x ({x.device}), got {weight.device}")
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

    if target.kind != "float":
        raise TypeError(f"target: expected a floating-point array, got {target.dtype}")
    if target.shape != (*lead, v):
        want = "[" + ", ".join(str(d) for d in (*lead, v)) + "]"
        raise ValueError(f"target: expected shape {want} (x's leading dims, V), got {_shape(target)}")
    if x.device is not None and target.device is not None and target.device != x.device:
        raise ValueError(f"target: expected the device of x ({x.device}), got {target.device}")

    if labels is not None:
        if labels.kind != "int":
            raise TypeError(f"labels: expected an integer array, got {labels.dtype}")
        if labels.shape != lead:
            want = "[" + ", ".join(str(d) for d in lead) + "]"
            raise ValueError(f"labels: expected shape {want} (x's leading dims), got {_shape(labels)}")
        if x.device is not None and labels.device is not None and labels.device != x.device:
            raise ValueError(f"labels: expected the device of x ({x.device}), got {labels.device}")

    if bias is not None:
        if bias.kind != "float" or bias.dtype != x.dtype:
            raise TypeError(f"bias: expected the dtype of x ({x.dtype}), got {bias.dtype}")
        if bias.shape != (v,):
            raise ValueError(f"bias: expected shape [{v}] (V), got {_shape(bias)}")
        if x.device is not None and bias.device is not None and bias.device != x.device:
            raise ValueError(f"bias: expected the device of x ({x.device}), got {bias.device}")
    return Shapes(n=n, h=h, v=v)


def check_array_args(
    describe: Callable[[str, object], ArrayFacts],
    x: object,
    weight: object,
    target: object,
    labels: object,
    bias: object,
) -> Shapes:
    """Describe each array argument with the framework's ``describe`` (which raises
    ``TypeError`` for a non-array) and check them together with :func:`check_arrays`."""

    def optional(name: str, value: object) -> ArrayFacts | None:
        return None if value is None else describe(name, value)

    return check_arrays(
        describe("x", x),
        describe("weight", weight),
        describe("target", target),
        optional("labels", labels),
        optional("bias", bias),
    )


def check_int32_ignore_index(ignore_index: int, why: str) -> None:
    """Where labels are compared as int32, ``ignore_index`` must fit in 32 bits (``why`` says where)."""
    if not -(2**31) <= ignore_index < 2**31:
        raise ValueError(f"ignore_index: expected an int that fits in 32 bits ({why}), got {ignore_index!r}")


def backend_unavailable(backend: str, why: str) -> ValueError:
    """The error for a known backend that cannot run here, saying why."""
    return ValueError(f"backend: {backend!r} is not available here: {why}")
