"""Check every argument against docs/contract.md before any kernel runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fused_kl.checks import (
    ArrayFacts,
    Shapes,
    check_array_args,
    check_int32_ignore_index,
    check_options,
    check_value_summary,
    target_values_checked,
    value_summary,
    widened_index_dtype,
)
from fused_kl.loss import Loss
from fused_kl.options import RunOptions

from . import backends
from .backends import Backend


def _kind(dtype: np.dtype) -> str:
    if dtype == np.bool_:
        return "bool"
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return "complex"
    return "float" if jnp.issubdtype(dtype, jnp.floating) else "int"


def _device(value: object) -> str | None:
    if isinstance(value, jax.core.Tracer) or not isinstance(value, jax.Array):
        return None
    return ",".join(sorted(str(d) for d in value.devices()))


def facts(name: str, value: object) -> ArrayFacts:
    """Describe an array argument (a JAX or NumPy array), or raise ``TypeError``."""
    if not isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(f"{name}: expected a jax.Array, got {type(value).__name__}")
    dtype = np.dtype(value.dtype)
    return ArrayFacts(tuple(value.shape), dtype.name, _kind(dtype), _device(value))


def _concrete(a: object) -> bool:
    return a is not None and not isinstance(a, jax.core.Tracer)


def check_values(loss: Loss, labels: object, indices: object, v_total: int, target: object = None) -> None:
    """Value checks of labels (hard term), top-k indices and the teacher's sign
    (``fused_kl.checks.target_values_checked``) where the values are concrete (outside ``jit``);
    under ``jit`` a bad row's loss is NaN instead, and the teacher's values are not checked."""
    check_labels = bool(loss.hard and _concrete(labels) and np.size(labels))
    check_indices = bool(_concrete(indices) and np.size(indices))
    check_target = bool(target_values_checked(loss) and _concrete(target) and np.size(target))
    parts = value_summary(
        np.asarray(labels) if check_labels else None,
        np.asarray(indices) if check_indices else None,
        loss.ignore_index,
        lambda a: np.sort(a, axis=-1),
        np,
        np.asarray(target) if check_target else None,
        loss.teacher.format if check_target else "probs",  # type: ignore[union-attr]
    )
    check_value_summary([int(p) for p in parts], loss, check_labels, check_indices, v_total, check_target)


def widen_indices(arrays: dict[str, object]) -> dict[str, object]:
    """``arrays`` with labels and top-k indices of a narrower integer dtype as new int32 arrays
    (int64 under ``jax_enable_x64``; ``fused_kl.checks.INDEX_DTYPES``); the caller's are untouched."""
    out = dict(arrays)
    wide = "int64" if jax.config.jax_enable_x64 else "int32"
    for name in ("labels", "target_indices"):
        a = out.get(name)
        if isinstance(a, (jax.Array, np.ndarray)) and widened_index_dtype(facts(name, a), wide):
            out[name] = a.astype(wide)
    return out


def validate(
    arrays: dict[str, object],
    vocab_shards: int = 1,
    *,
    accum_dtype: object,
    with_teacher: bool = True,
    single_device: bool = True,
    check_vma: bool = False,
    **options: object,
) -> tuple[Shapes, Loss, RunOptions, Backend]:
    """Check every argument; return the problem's sizes, the loss, the run options and the
    backend resolved (``backends.resolve``: the value everything after runs). ``vocab_shards``
    is the number of vocabulary slices ``weight`` is one of; ``check_vma``: the call runs inside
    a ``shard_map`` that checks varying axes."""
    if accum_dtype is not None:
        try:
            accum_dtype = np.dtype(accum_dtype).name
        except TypeError:
            raise TypeError(
                f"accum_dtype: expected None or a dtype, got {type(accum_dtype).__name__} {accum_dtype!r}"
            ) from None
    backend = options.pop("backend")
    loss, run = check_options(**options, accum_dtype=accum_dtype, with_teacher=with_teacher)  # type: ignore[arg-type]
    chosen = backends.resolve(backend, check_vma=check_vma)
    weight = arrays.get("weight")
    v_total = weight.shape[0] * vocab_shards if hasattr(weight, "shape") and len(weight.shape) == 2 else None
    shapes = check_array_args(facts, loss, v_total, **arrays)
    if chosen.single_device and not single_device:
        raise ValueError(
            f"backend: {backend!r} runs on one device; mesh, batch_axis and vocab_axis need 'pallas', "
            "'pallas_mosaic', 'pallas_triton' or 'xla'"
        )
    if arrays.get("labels") is not None and not jax.config.jax_enable_x64:
        # Else the comparison with the labels overflows inside the jitted program.
        check_int32_ignore_index(loss.ignore_index, "JAX's labels are int32 without jax_enable_x64")
    check_values(loss, arrays.get("labels"), arrays.get("target_indices"), shapes.v * vocab_shards,
                 arrays.get("target"))  # fmt: skip
    return shapes, loss, run, chosen
