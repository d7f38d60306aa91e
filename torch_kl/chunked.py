"""Stages 2-4 in PyTorch: plan the chunks, then per chunk one GEMM, the row kernel, two GEMMs.

The ``[N, V]`` logits never exist: one ``[chunk, V]`` buffer is reused for every chunk's
logits and, after the row kernel, for its ``dL/dz``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fused_kl.contract import Options
from fused_kl.plan import kernel_scales, plan_chunks

from . import plain

Kernel = Callable[..., None]


@dataclass(frozen=True)
class Needs:
    """Which gradients to compute; all False computes the loss alone."""

    x: bool = False
    weight: bool = False
    bias: bool = False

    @property
    def any(self) -> bool:
        """Whether any gradient is needed, so the kernel writes dL/dz."""
        return self.x or self.weight or self.bias


def row_kernel(backend: str) -> Kernel:
    """The row kernel of a backend: Triton's (imported only when asked for) or plain torch."""
    if backend == "triton":
        from . import kernel

        return kernel.kl_rows
    return plain.kl_rows


_OUT_DTYPE: dict[tuple[str, torch.dtype], bool] = {}


def _has_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm``/``torch.addmm`` take ``out_dtype=float32`` for ``dtype`` operands here.

    (torch >= 2.8, CUDA): a float32 accumulator is then written by the GEMM itself.
    """
    key = (device.type, dtype)
    if key not in _OUT_DTYPE:
        a = torch.zeros(1, 1, dtype=dtype, device=device)
        acc = torch.zeros(1, 1, device=device)
        try:
            torch.mm(a, a, out_dtype=torch.float32, out=acc)
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _OUT_DTYPE[key] = True
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE[key] = False
    return _OUT_DTYPE[key]


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``acc (+)= a @ b`` with the product accumulated in ``acc``'s dtype.

    The first product overwrites the accumulator (no zero fill, no read) when the GEMM can
    write its dtype; otherwise the accumulator is zeroed first.
    """
    if acc.dtype == a.dtype:
        if first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
    elif _has_out_dtype(acc.device, a.dtype):
        if first:
            torch.mm(a, b, out_dtype=acc.dtype, out=acc)
        else:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        if first:
            acc.zero_()
        acc.add_(torch.mm(a, b))


def forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    labels: torch.Tensor | None,
    bias: torch.Tensor | None,
    opts: Options,
    needs: Needs,
    out: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Loss and the needed gradients of 2-D inputs ``x [N, H]``, ``target [N, V]``, ``labels [N]``.

    ``out`` may hold preallocated ``loss``/``grad_x``/``grad_weight``/``grad_bias`` to write
    into (the bridge hands JAX's output buffers this way).
    """
    out = out or {}
    n, h = x.shape
    v = weight.shape[0]
    dev = x.device
    plan = plan_chunks(n, v, x.element_size(), opts.chunk_size)
    kernel = row_kernel(opts.backend)

    if labels is None:
        kept = torch.full((), float(n), dtype=torch.float32, device=dev)
    else:
        kept = (labels != opts.ignore_index).sum(dtype=torch.float32)
    scale, unscale = kernel_scales(kept, opts.reduction, v, x.dtype == torch.float16, torch)

    accum = getattr(torch, opts.accum_dtype) if opts.accum_dtype else weight.dtype
    row_loss = torch.empty(n, dtype=torch.float32, device=dev)
    grad_x = _buffer(out, "grad_x", x.dtype, (n, h), dev) if needs.x else None
    grad_w = _buffer(out, "grad_weight", accum, (v, h), dev) if needs.weight else None
    if grad_w is not None and not plan.bounds:  # otherwise the first chunk's GEMM writes it
        grad_w.zero_()
    grad_b = _buffer(out, "grad_bias", torch.float32, (v,), dev).zero_() if needs.bias else None
    wt = weight.t()

    # One [chunk, V] buffer: each chunk's logits, then its dL/dz in place.
    buf = torch.empty(plan.chunk_rows if n else 0, v, dtype=x.dtype, device=dev)
    for start, stop in plan.bounds:
        xc, z = x[start:stop], buf[: stop - start]
        if bias is None:
            torch.mm(xc, wt, out=z)
        else:
            torch.addmm(bias, xc, wt, out=z)
        kernel(z, target, labels, scale, row_loss, start, opts, plan.tile, needs.any)
        if grad_x is not None:
            torch.mm(z, weight, out=grad_x[start:stop])
        if grad_w is not None:
            _accumulate(grad_w, z.t(), xc, first=start == 0)
        if grad_b is not None:
            grad_b.add_(z.sum(0, dtype=torch.float32))

    if unscale is not None:  # float16; exact: a power of two
        for grad in (grad_x, grad_w, grad_b):
            if grad is not None:
                grad.mul_(unscale)
    loss = _cast_into(row_loss.sum(), out.get("loss"), torch.float32)
    if grad_w is not None:
        grad_w = _cast_into(grad_w, out.get("grad_weight"), weight.dtype)
    if grad_b is not None:
        grad_b = _cast_into(grad_b, out.get("grad_bias"), bias.dtype)  # type: ignore[union-attr]
    return loss, grad_x, grad_w, grad_b


def _buffer(
    out: dict[str, torch.Tensor], key: str, dtype: torch.dtype, shape: tuple[int, ...], dev: torch.device
) -> torch.Tensor:
    """The caller's output buffer ``out[key]`` if it has this dtype, else a new one."""
    given = out.get(key)
    if given is not None and given.dtype == dtype:
        return given
    return torch.empty(shape, dtype=dtype, device=dev)


def _cast_into(value: torch.Tensor, dest: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``value`` in ``dtype``, written into ``dest`` when one is given (a no-op if it is ``dest``)."""
    if dest is None:
        return value.to(dtype)
    if dest is not value:
        dest.copy_(value)
    return dest
