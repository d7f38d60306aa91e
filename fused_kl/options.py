"""How to run a call: options that change speed and memory, never the value of a valid call, and which
gradients it makes."""

from __future__ import annotations

from dataclasses import dataclass

# The floating dtypes of the inputs, and those grad_weight can be accumulated in.
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RunOptions:
    """``accum_dtype``: dtype name ``grad_weight`` is accumulated in (None: the weight's);
    ``chunk_size``: rows per chunk (None: ``fused_kl.plan``'s heuristic). The backend travels
    beside them, resolved into its framework's ``Backend`` value.

    ``values_checked``: the labels and top-k token ids were read on the host and checked (eager
    calls). Otherwise (``jax.jit``, ``torch.compile``, CUDA graph capture) the driver turns a kept
    row they make invalid into NaN (``fused_kl.rowmath.invalid_rows``): a few ``[rows]``-sized
    operations, which a checked call skips."""

    accum_dtype: str | None = None
    chunk_size: int | None = None
    values_checked: bool = False


@dataclass(frozen=True)
class Needs:
    """Which gradients a call computes (both drivers, both bridges, both autograd layers); all
    False computes the loss alone. A frozen head (``weight=False``) costs no ``grad_weight`` GEMM."""

    x: bool = False
    weight: bool = False
    bias: bool = False

    @property
    def any(self) -> bool:
        return self.x or self.weight or self.bias
