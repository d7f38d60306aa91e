"""Stage 1: check every argument against SPEC.md before any kernel runs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fused_kl.contract import (
    ArrayFacts,
    Options,
    Shapes,
    backend_unavailable,
    check_array_args,
    check_int32_ignore_index,
    check_options,
)

BACKENDS = ("auto", "pallas", "xla", "triton")


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


def resolve_backend(backend: str) -> str:
    """Turn ``"auto"`` into a concrete backend and check that the chosen one can run here."""
    on_gpu = jax.default_backend() == "gpu"
    if backend == "auto":
        return "pallas" if on_gpu else "xla"
    if backend == "triton":
        try:
            import torch  # noqa: F401
            import triton  # noqa: F401
        except ImportError:
            raise backend_unavailable(
                backend, "it runs torch_kl's Triton kernel, which needs torch and triton (pip install 'fused-kl[all]')"
            ) from None
        import os

        if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise backend_unavailable(
                backend, "the Triton kernel needs a GPU (or TRITON_INTERPRET=1, set before triton is imported)"
            )
    return backend


def validate(
    x: object, weight: object, target: object, labels: object, bias: object, **options: object
) -> tuple[Shapes, Options]:
    """Check every argument; return the problem's sizes and the options, backend resolved."""
    accum = options.pop("accum_dtype")
    if accum is not None:
        try:
            accum = np.dtype(accum).name
        except TypeError:
            raise TypeError(f"accum_dtype: expected None or a dtype, got {type(accum).__name__} {accum!r}") from None
    opts = check_options(**options, accum_dtype=accum, backends=BACKENDS)
    shapes = check_array_args(facts, x, weight, target, labels, bias)
    if labels is not None and not jax.config.jax_enable_x64:
        # Else the comparison with the labels overflows inside the jitted program.
        check_int32_ignore_index(opts.ignore_index, "JAX's labels are int32 without jax_enable_x64")
    return shapes, dataclasses.replace(opts, backend=resolve_backend(opts.backend))
