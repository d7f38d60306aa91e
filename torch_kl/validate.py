"""Stage 1: check every argument against SPEC.md before any kernel runs."""

from __future__ import annotations

import dataclasses
import os

import torch

from fused_kl.contract import (
    ArrayFacts,
    Options,
    Shapes,
    backend_unavailable,
    check_array_args,
    check_int32_ignore_index,
    check_options,
)

BACKENDS = ("auto", "triton", "torch", "jax")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "int"


def facts(name: str, value: object) -> ArrayFacts:
    """Describe a tensor argument, or raise ``TypeError`` if it is not one."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return ArrayFacts(tuple(value.shape), _dtype_name(value.dtype), _kind(value.dtype), str(value.device))


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernel cannot run on ``device``, or None if it can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install triton)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the Triton kernel needs CUDA tensors, got {device.type} (or set TRITON_INTERPRET=1 to interpret it)"
    return None


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turn ``"auto"`` into a concrete backend and check that the chosen one can run here."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_unavailable_reason(device) is None else "torch"
    if backend == "triton" and (why := triton_unavailable_reason(device)) is not None:
        raise backend_unavailable(backend, why)
    if backend == "jax":
        try:
            import jax  # noqa: F401
        except ImportError:
            raise backend_unavailable(backend, "JAX is not installed (pip install 'fused-kl[jax]')") from None
    return backend


def validate(
    x: object, weight: object, target: object, labels: object, bias: object, **options: object
) -> tuple[Shapes, Options]:
    """Check every argument; return the problem's sizes and the options, backend resolved."""
    accum = options.pop("accum_dtype")
    if accum is not None and not isinstance(accum, torch.dtype):
        raise TypeError(f"accum_dtype: expected None or a torch.dtype, got {type(accum).__name__} {accum!r}")
    opts = check_options(**options, accum_dtype=None if accum is None else _dtype_name(accum), backends=BACKENDS)
    shapes = check_array_args(facts, x, weight, target, labels, bias)
    backend = resolve_backend(opts.backend, x.device)  # type: ignore[union-attr]
    if backend == "jax" and labels is not None:
        check_int32_ignore_index(opts.ignore_index, "backend 'jax' hands the labels to JAX as int32")
    return shapes, dataclasses.replace(opts, backend=backend)
