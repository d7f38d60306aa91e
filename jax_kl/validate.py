"""Check every argument against docs/contract.md before any kernel runs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fused_kl.checks import (
    ArrayFacts,
    Shapes,
    check_array_args,
    check_int32_ignore_index,
    check_options,
    single_device_backend,
    widened_index_dtype,
)
from fused_kl.loss import VALUE_ARGUMENTS, Loss
from fused_kl.options import RunOptions
from fused_kl.value_checks import check_value_summary, target_values_checked, value_summary

from . import backends
from .backends import Backend


def _kind(dtype: np.dtype) -> str:
    if dtype == np.bool_:
        return "bool"
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return "complex"
    if jnp.issubdtype(dtype, jnp.floating):
        return "float"
    return "int" if jnp.issubdtype(dtype, jnp.integer) else "other"  # "other": strings, objects, dates


def _device(value: object) -> str | None:
    """Where an array is committed, or None where JAX places it for the call (a NumPy array, a
    traced one, or a JAX array not committed to devices, as ``jnp.asarray`` makes them)."""
    if isinstance(value, jax.core.Tracer) or not isinstance(value, jax.Array) or not value.committed:
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


def _check_no_explicit_axes(arrays: dict[str, object]) -> None:
    """A call without ``mesh=`` takes whole arrays: one sharded over a mesh's explicit axes (the
    default of ``jax.make_mesh`` in recent JAX) would fail inside a GEMM, so it is refused here."""
    for name, a in arrays.items():
        try:
            sharding = jax.typeof(a).sharding
        except (AttributeError, TypeError):  # not an array, or a JAX without typed shardings
            continue
        explicit = set(getattr(getattr(sharding, "mesh", None), "explicit_axes", ()) or ())
        spec = getattr(sharding, "spec", ())
        used = [axis for entry in spec for axis in (entry if isinstance(entry, tuple) else (entry,))]
        sharded = sorted(axis for axis in used if axis in explicit)
        if sharded:
            raise ValueError(
                f"{name}: sharded over the mesh's explicit axes {sharded}; pass mesh= (with batch_axis / vocab_axis) "
                "for a sharded call, or replicate it"
            )


def _check_fits_int32(name: str, a: object) -> None:
    """Without ``jax_enable_x64`` JAX holds integers as int32: refuse numpy ids that would wrap (a
    label wrapped onto ``ignore_index`` would silently drop its row)."""
    if jax.config.jax_enable_x64 or not isinstance(a, np.ndarray) or a.dtype.kind not in "iu" or not a.size:
        return
    info = np.iinfo(np.int32)
    lo, hi = int(a.min()), int(a.max())
    if lo < info.min or hi > info.max:
        bad = lo if lo < info.min else hi
        raise ValueError(f"{name}: expected values that fit int32 (JAX's integers without jax_enable_x64), got {bad}")


def check_values(
    loss: Loss, labels: object, indices: object, v_total: int, target: object = None, row_weight: object = None
) -> None:
    """Value checks of labels (hard term), top-k indices, row weights and the teacher's sign
    (``fused_kl.value_checks.target_values_checked``) where the values are concrete (outside ``jit``);
    under ``jit`` a bad row's loss is NaN instead, and the teacher's values are not checked."""
    _check_fits_int32("labels", labels)
    _check_fits_int32("target_indices", indices)
    check_labels = bool(loss.cross_entropy and _concrete(labels) and np.size(labels))
    check_weights = bool(_concrete(row_weight) and np.size(row_weight))
    check_indices = bool(_concrete(indices) and np.size(indices))
    check_target = bool(target_values_checked(loss) and _concrete(target) and np.size(target))
    # Reduced where the arrays are (a GPU teacher is not copied to the host), then one transfer;
    # evaluated now even where a jit traces around concrete arrays.
    with jax.ensure_compile_time_eval():
        labels = jnp.asarray(labels) if _concrete(labels) else None
        parts = value_summary(
            labels if check_labels else None,
            jnp.asarray(indices) if check_indices else None,
            None if labels is None else (labels != loss.ignore_index).reshape(-1),
            lambda a: jnp.sort(a, axis=-1),
            jnp,
            jnp.asarray(target) if check_target else None,
            loss.teacher.format if check_target else "probs",  # type: ignore[union-attr]
            jnp.asarray(row_weight) if check_weights else None,
        )
        summary = jnp.stack([jnp.asarray(part).astype(jnp.int32) for part in parts]) if parts else None
    values = [] if summary is None else np.asarray(summary).tolist()
    check_value_summary(values, loss, check_labels, check_indices, v_total, check_target, check_weights)


# What stands in the static ``Loss`` for a traced value: the general case of every static decision
# it takes part in (``fused_kl.loss``: a traced beta is the JSD kind, a traced weight keeps its term)
# and a value every check passes; the traced value replaces it where the call runs.
_STAND_INS = dict(
    temperature=2.0, teacher_temperature=2.0, beta=0.5, weight_soft_loss=1.0, weight_hard_loss=1.0,
    label_smoothing=0.5, z_loss_weight=1.0,
)  # fmt: skip


def split_values(options: dict[str, object]) -> tuple[dict[str, object], tuple]:
    """``(options, values)``: the hyperparameter values (``fused_kl.loss.VALUE_ARGUMENTS``) given as
    0-d arrays, concrete ones as floats (checked as floats) and traced ones (under ``jax.jit``) as
    stand-ins; ``values`` holds, per argument, the traced value in float32 under ``stop_gradient``
    (a runtime value: no gradient flows to it, and its range is not checked), else None."""
    options, values = dict(options), []
    for name in VALUE_ARGUMENTS:
        value, traced = options.get(name), None
        if isinstance(value, (jax.Array, np.ndarray)):
            if np.ndim(value) != 0 or not jnp.issubdtype(value.dtype, jnp.floating):
                raise TypeError(f"{name}: expected a float or a 0-d float array, got {value.dtype} of shape "
                                f"{list(np.shape(value))}")  # fmt: skip
            if isinstance(value, jax.core.Tracer):
                if name in ("beta", "teacher_temperature") and options.get("target_format") == "topk_log_probs":
                    raise ValueError(f"{name}: a traced value is not supported with target_format='topk_log_probs'")
                traced = jax.lax.stop_gradient(value.astype(jnp.float32))
                options[name] = _STAND_INS[name]
            else:
                options[name] = float(value)
        values.append(traced)
    if options.get("teacher_temperature") is None:  # the teacher's temperature is the student's
        values[VALUE_ARGUMENTS.index("teacher_temperature")] = values[VALUE_ARGUMENTS.index("temperature")]
    return options, tuple(values)


def _check_traced(values: tuple, backend: Backend, single_device: bool) -> None:
    """A traced value runs on the plain-JAX backend of one device: the Pallas kernels and the Triton
    bridge take the hyperparameters as constants of their kernels."""
    for name, value in zip(VALUE_ARGUMENTS, values, strict=True):
        if value is None:
            continue
        if backend.name != "xla":
            raise ValueError(
                f"{name}: a traced value (under jax.jit) needs backend='xla'; backend {backend.name!r} compiles the "
                "hyperparameters into its kernels: pass a Python float (one compilation per value)"
            )
        if not single_device:
            raise ValueError(f"{name}: a traced value needs a single-device call (no mesh, batch_axis or vocab_axis)")


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
) -> tuple[Shapes, Loss, RunOptions, Backend, tuple]:
    """Check every argument; return the problem's sizes, the loss, the run options, the
    backend resolved (``backends.resolve``: the value everything after runs) and the traced
    hyperparameter values (:func:`split_values`; the loss holds stand-ins for them). ``vocab_shards``
    is the number of vocabulary slices ``weight`` is one of; ``check_vma``: the call runs inside
    a ``shard_map`` that checks varying axes."""
    if accum_dtype is not None:
        try:
            accum_dtype = np.dtype(accum_dtype).name
        except TypeError:
            raise TypeError(
                f"accum_dtype: expected None or a dtype, got {type(accum_dtype).__name__} {accum_dtype!r}"
            ) from None
    options, values = split_values(options)
    backend = options.pop("backend")
    loss, run = check_options(**options, accum_dtype=accum_dtype, with_teacher=with_teacher)  # type: ignore[arg-type]
    chosen = backends.resolve(backend, check_vma=check_vma)
    _check_traced(values, chosen, single_device)
    weight = arrays.get("weight")
    v_total = weight.shape[0] * vocab_shards if hasattr(weight, "shape") and len(weight.shape) == 2 else None
    shapes = check_array_args(facts, loss, v_total, **arrays)
    if single_device:
        _check_no_explicit_axes(arrays)
    if chosen.single_device and not single_device:
        multi = [name for name, entry in backends.REGISTRY.items() if not entry.single_device]
        raise single_device_backend(backend, "mesh, batch_axis and vocab_axis", multi)
    if arrays.get("labels") is not None and not jax.config.jax_enable_x64:
        # Else the comparison with the labels overflows inside the jitted program.
        check_int32_ignore_index(loss.ignore_index, "JAX's labels are int32 without jax_enable_x64")
    check_values(loss, arrays.get("labels"), arrays.get("target_indices"), shapes.v * vocab_shards,
                 arrays.get("target"), arrays.get("row_weight"))  # fmt: skip
    checked = not any(isinstance(arrays.get(k), jax.core.Tracer) for k in ("labels", "target_indices"))
    return shapes, loss, dataclasses.replace(run, values_checked=checked), chosen, values
