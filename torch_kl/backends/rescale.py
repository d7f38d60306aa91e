"""The backward pass's only work: the saved gradients times the upstream gradient, in place.

Usually the upstream gradient is 1 (``loss.backward()``). XLA sees a literal 1 at compile
time and drops the multiply; torch only has it in device memory, and ``grad.mul_(g)`` would
then read and write every ``grad_weight`` byte for nothing (about 2% of a step on the
llama-3 head). The Triton kernel reads ``g`` on the device and returns at once when it is 1:
no host sync. Otherwise it multiplies in float32 and rounds once, as JAX's backward does
(``mul_`` would first round ``g`` to a bfloat16 gradient's dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192


@triton.jit
def _scale_kernel(grad_ptr, g_ptr, numel, BLOCK: tl.constexpr):
    g = tl.load(g_ptr)
    if g != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        grad = tl.load(grad_ptr + offs, mask=mask)
        tl.store(grad_ptr + offs, (grad.to(tl.float32) * g).to(grad_ptr.dtype.element_ty), mask=mask)


def scale_(grad: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``grad *= g`` for a contiguous ``grad`` and a one-element ``g``, skipped on the device
    when ``g == 1``; returns ``grad``."""
    if grad.numel():
        _scale_kernel[(triton.cdiv(grad.numel(), BLOCK),)](grad, g.to(torch.float32), grad.numel(), BLOCK=BLOCK)
    return grad
