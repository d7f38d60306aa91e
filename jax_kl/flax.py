"""The LM head of a Flax NNX model in the layout the loss takes: ``weight [V, H]`` and ``bias [V]``.

``nnx.Linear(H, V)`` stores its kernel as ``[H, V]``: the loss wants its transpose, which under
``jit`` folds into the loss's GEMMs (no copy). A tied head is the ``nnx.Embed`` table, already
``[V, H]``. An ``nnx.LoRALinear`` head's adapter is folded into the kernel (``W + A B``).
Gradients flow through each to the module's parameters, so ``nnx.grad`` of a loss built on
:func:`head_params` updates the head.

Import it as ``jax_kl.flax``: ``import jax_kl`` does not import Flax.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from flax import nnx


class HeadParams(NamedTuple):
    """An LM head as ``fused_linear_kl_div`` takes it: ``weight`` ``[V, H]``, ``bias`` ``[V]`` or None."""

    weight: jax.Array
    bias: jax.Array | None


def head_params(head: nnx.Module) -> HeadParams:
    """The head's ``[V, H]`` weight and its bias, from an ``nnx.Linear`` head, a tied ``nnx.Embed``,
    or a model that holds its head as ``lm_head`` (the Hugging Face name).

    ``weight, bias = head_params(model.lm_head)`` then
    ``jax_kl.fused_linear_kl_div(hidden, weight, target, labels, bias=bias, ...)``.
    """
    if not isinstance(head, (nnx.Linear, nnx.Embed)):
        head = _lm_head_of(head)
    if isinstance(head, nnx.Embed):
        return HeadParams(head.embedding[...], None)
    kernel = head.kernel[...]
    if isinstance(head, nnx.LoRALinear):  # its adapter joins the kernel: x W + x A B = x (W + A B)
        kernel = kernel + head.lora.lora_a[...] @ head.lora.lora_b[...]
    elif type(head).__call__ is not nnx.Linear.__call__:
        raise TypeError(
            f"head: a {type(head).__name__} computes its own output, which its kernel alone may not give; "
            "pass its [V, H] weight to the loss directly"
        )
    bias = None if head.bias is None else head.bias[...]
    return HeadParams(kernel.T, bias)


def _lm_head_of(model: object) -> nnx.Linear | nnx.Embed:
    head = getattr(model, "lm_head", None) if isinstance(model, nnx.Module) else None
    if isinstance(head, (nnx.Linear, nnx.Embed)):
        return head
    raise TypeError(
        "head: expected an nnx.Linear head, the nnx.Embed of a tied head, or an nnx.Module whose `lm_head` is "
        f"one of them; got {type(model).__name__}"
        + ("" if head is None else f" whose lm_head is {type(head).__name__}")
        + ". Pass the head module itself, or its [V, H] weight to the loss directly."
    )
