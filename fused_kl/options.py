"""How to run it: options that change speed and memory, never the value computed."""

from __future__ import annotations

from dataclasses import dataclass

# The floating dtypes of the inputs, and those grad_weight can be accumulated in.
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RunOptions:
    """``accum_dtype``: dtype name ``grad_weight`` is accumulated in (None: the weight's);
    ``chunk_size``: rows per chunk (None: ``fused_kl.plan``'s heuristic); ``backend``: a
    concrete backend name of the calling framework's registry."""

    accum_dtype: str | None = None
    chunk_size: int | None = None
    backend: str = "auto"
