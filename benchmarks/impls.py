"""The implementations that ``python -m fused_kl bench`` compares, and the inputs they share.

Each implementation is a factory: given one shape's :class:`Inputs` it returns a
:class:`Prepared` whose ``step()`` runs forward and backward once and returns
``(grad_x, grad_weight)`` in its own framework. Packages are imported only when a factory
runs, so a missing one (or a compile error) costs that row alone.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# Rows of the teacher's logits drawn at once: bounds the fp32 temporaries of building a target.
_TARGET_ROWS = 2048

LossFn = Callable[[Any, Any, Any], Any]


class Skip(Exception):
    """An implementation that cannot run here; the message says why."""


@dataclasses.dataclass
class Inputs:
    """One shape's bf16 inputs, made once and shared by every implementation."""

    x: torch.Tensor  # [N, H]
    weight: torch.Tensor  # [V, H]
    target: torch.Tensor  # [N, V] teacher probabilities

    @functools.cached_property
    def jax(self) -> tuple[Any, Any, Any]:
        """The same buffers as JAX arrays, through DLPack: no copy, no second target in memory."""
        from jax import dlpack

        return tuple(dlpack.from_dlpack(t) for t in (self.x, self.weight, self.target))

    @property
    def grad_bytes(self) -> int:
        """Bytes of ``grad_x`` and ``grad_weight`` together, in the inputs' dtype."""
        return (self.x.numel() + self.weight.numel()) * self.x.element_size()


def make_weight(h: int, v: int, device: torch.device) -> torch.Tensor:
    """An LM head ``[V, H]`` in bf16, ``N(0, 0.02²)`` as in a freshly initialised model."""
    gen = torch.Generator(device).manual_seed(0)
    return torch.randn(v, h, generator=gen, device=device, dtype=torch.bfloat16).mul_(0.02)


def make_inputs(weight: torch.Tensor, n: int) -> Inputs:
    """``x ~ N(0, 1)`` and a bf16 teacher distribution (softmax of random logits) for ``n`` rows."""
    v, h = weight.shape
    gen = torch.Generator(weight.device).manual_seed(n)
    x = torch.randn(n, h, generator=gen, device=weight.device, dtype=torch.bfloat16)
    target = torch.empty(n, v, device=weight.device, dtype=torch.bfloat16)
    for rows in target.split(_TARGET_ROWS):
        rows.copy_(torch.randn(rows.shape, generator=gen, device=weight.device).softmax(-1))
    return Inputs(x, weight, target)


def unfused_loss(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The textbook loss: whole logits, fp32 log-softmax, ``KLDivLoss(reduction="batchmean")``."""
    log_q = torch.log_softmax((x @ weight.T).float(), dim=-1)
    return F.kl_div(log_q, target, reduction="batchmean")


def unfused_loss_jax(x: Any, weight: Any, target: Any) -> Any:
    """:func:`unfused_loss` in jnp, for XLA to fuse as it can."""
    import jax
    import jax.numpy as jnp

    log_q = jax.nn.log_softmax((x @ weight.T).astype(jnp.float32), axis=-1)
    p = target.astype(jnp.float32)
    return jnp.sum(jax.scipy.special.xlogy(p, p) - p * log_q) / x.shape[0]


def reference_grads(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(grad_x, grad_weight)`` of :func:`unfused_loss` on the bf16 inputs upcast (no TF32)."""
    x = inputs.x.float().requires_grad_()
    w = inputs.weight.float().requires_grad_()
    return torch.autograd.grad(unfused_loss(x, w, inputs.target), (x, w))


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One implementation ready to run on one shape."""

    step: Callable[[], tuple[Any, Any]]
    # Compiled JAX programs the step runs: their memory is invisible to torch's allocator.
    programs: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class Impl:
    """A row of the benchmark."""

    framework: str  # "torch" or "jax": how it is timed and synchronised
    make: Callable[[Inputs], Prepared]
    # Bytes held per element of the [N, V] logits at peak, to skip what cannot fit.
    bytes_per_logit: int = 0
    gpu_only: bool = False
    # False where the step's outputs are gradient-shaped but not the loss's gradients.
    gradients: bool = True

    def estimate_bytes(self, inputs: Inputs) -> int:
        """Rough peak beyond the inputs: logit-sized temporaries plus gradients and their accumulators."""
        n, v = inputs.target.shape
        return n * v * self.bytes_per_logit + 2 * inputs.grad_bytes


def _floor(inputs: Inputs) -> Prepared:
    """The three GEMMs alone, into a preallocated ``[N, V]`` buffer: no kernel can beat this."""
    x, w = inputs.x, inputs.weight
    z = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        torch.mm(x, w.T, out=z)
        return z @ w, z.T @ x

    return Prepared(step)


def _autograd(get_loss: Callable[[], LossFn]) -> Callable[[Inputs], Prepared]:
    """A torch loss under ``torch.autograd.grad``; ``get_loss`` runs when the row starts."""

    def make(inputs: Inputs) -> Prepared:
        loss = get_loss()
        x = inputs.x.detach().requires_grad_()
        w = inputs.weight.detach().requires_grad_()
        return Prepared(lambda: torch.autograd.grad(loss(x, w, inputs.target), (x, w)))

    return make


def _jitted(get_loss: Callable[[], LossFn]) -> Callable[[Inputs], Prepared]:
    """A JAX loss under ``jit(value_and_grad)``, compiled once per shape, the target an argument."""

    def make(inputs: Inputs) -> Prepared:
        import jax

        args = inputs.jax
        compiled = jax.jit(jax.value_and_grad(get_loss(), argnums=(0, 1))).lower(*args).compile()
        return Prepared(lambda: compiled(*args)[1], programs=(compiled,))

    return make


@functools.cache
def _compiled_unfused() -> LossFn:
    # One wrapper for every shape, so dynamo's shape cache and recompile limit are shared.
    return torch.compile(unfused_loss)


def _liger(accum_dtype: torch.dtype | None = None) -> LossFn:
    try:
        from liger_kernel.transformers import LigerFusedLinearKLDivLoss
    except ImportError as e:
        raise Skip(f"liger_kernel is not importable ({e})") from None
    return LigerFusedLinearKLDivLoss(accum_dtype=accum_dtype)


def _torch_kl(**options: Any) -> LossFn:
    from torch_kl import fused_linear_kl_div

    return functools.partial(fused_linear_kl_div, **options)


def _jax_kl(**options: Any) -> LossFn:
    from jax_kl import fused_linear_kl_div

    return functools.partial(fused_linear_kl_div, **options)


def _bridge_program(inputs: Inputs) -> Any:
    """The JAX program that torch_kl's backend ``"jax"`` runs for these inputs, compiled.

    Its gradients and temporaries live in JAX's allocator, where torch's peak counter cannot
    see them; this program's memory analysis can.
    """
    from fused_kl import bridge
    from torch_kl import fused_linear_kl_div
    from torch_kl.validate import validate

    # The API's own defaults: every keyword-only parameter but the bias is an option.
    params = inspect.signature(fused_linear_kl_div).parameters.values()
    options = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY and p.name != "bias"}
    _, opts = validate(inputs.x, inputs.weight, inputs.target, None, None, **options | {"backend": "jax"})
    forward = bridge._jitted_jax_forward()
    pallas = dataclasses.replace(opts, backend="pallas")
    return forward.lower(*inputs.jax, None, None, opts=pallas, with_grads=True).compile()


def _torch_through_jax(inputs: Inputs) -> Prepared:
    prepared = _autograd(functools.partial(_torch_kl, backend="jax"))(inputs)
    return dataclasses.replace(prepared, programs=(_bridge_program(inputs),))


IMPLS: dict[str, Impl] = {
    "floor": Impl("torch", _floor, bytes_per_logit=2, gradients=False),
    "eager": Impl("torch", _autograd(lambda: unfused_loss), bytes_per_logit=20),
    "compile": Impl("torch", _autograd(_compiled_unfused), bytes_per_logit=10, gpu_only=True),
    "liger": Impl("torch", _autograd(_liger), gpu_only=True),
    "liger-fp32": Impl("torch", _autograd(functools.partial(_liger, torch.float32)), gpu_only=True),
    "xla": Impl("jax", _jitted(lambda: unfused_loss_jax), bytes_per_logit=16),
    "torch_kl": Impl("torch", _autograd(_torch_kl)),
    "torch_kl-fp32": Impl("torch", _autograd(functools.partial(_torch_kl, accum_dtype=torch.float32))),
    # The documented low-memory setting.
    "torch_kl-lowmem": Impl("torch", _autograd(functools.partial(_torch_kl, chunk_size=1024))),
    "jax_kl": Impl("jax", _jitted(functools.partial(_jax_kl, backend="pallas"))),
    "torch→jax": Impl("torch", _torch_through_jax),
    "jax→triton": Impl("jax", _jitted(functools.partial(_jax_kl, backend="triton"))),
}
