"""What ``python -m benchmarks.bench --mode`` measures: the loss, its inputs and its reference.

Every mode runs the same head on the same ``x``; the teacher differs:

* ``kl``, ``reverse``, ``jsd``: teacher probabilities ``[N, V]`` (bf16), ``beta`` 0, 1 and 0.5;
* ``hidden``: the teacher's hidden states ``[N, 2H]`` and head ``[V, 2H]``, a teacher twice the
  student's width (forward KL; the teacher's logits are one more GEMM, twice as long as the
  student's, so the floor is four GEMMs); ``reverse-hidden``: the same teacher, reverse KL;
* ``topk``: the teacher's top-64 log-probabilities and their token ids, the rest in a tail bin;
* ``ce``: no teacher, labels only (``fused_linear_cross_entropy``).

The gradients' errors are measured against :func:`fused_kl.reference.reference` (float64).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

# Rows of the teacher's logits drawn at once: bounds the fp32 temporaries of building a target.
_TARGET_ROWS = 2048
TOPK = 64
# The teacher head's width as a multiple of the student's (8192 against the llama-3 head's 4096).
TEACHER_WIDTH = 2


@dataclasses.dataclass(frozen=True)
class Mode:
    """``options``: keyword arguments of ``fused_linear_kl_div`` (and of the reference) beyond the arrays."""

    name: str
    teacher: str | None  # "probs", "hidden", "topk", or None: cross-entropy on labels
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    about: str = ""

    @property
    def beta(self) -> float:
        return self.options.get("beta", 0.0)


MODES = {
    m.name: m
    for m in (
        Mode("kl", "probs", about="forward KL, teacher probabilities [N, V]"),
        Mode("reverse", "probs", {"beta": 1.0}, about="reverse KL (beta 1), teacher probabilities [N, V]"),
        Mode("jsd", "probs", {"beta": 0.5}, about="generalized JSD (beta 0.5), teacher probabilities [N, V]"),
        Mode(
            "hidden",
            "hidden",
            {"target_format": "hidden"},
            about=f"forward KL, teacher hidden states [N, {TEACHER_WIDTH}H] and head [V, {TEACHER_WIDTH}H]; "
            "floor of 4 GEMMs",
        ),
        Mode(
            "reverse-hidden",
            "hidden",
            {"target_format": "hidden", "beta": 1.0},
            about=f"reverse KL (beta 1), the teacher head of mode hidden ([V, {TEACHER_WIDTH}H]); floor of 4 GEMMs",
        ),
        Mode(
            "topk",
            "topk",
            {"target_format": "topk_log_probs", "topk_tail": "bin"},
            about=f"forward KL, teacher top-{TOPK} log-probabilities, the rest in a tail bin",
        ),
        Mode("ce", None, about="cross-entropy on labels (fused_linear_cross_entropy), no teacher"),
        Mode("ce-smooth", None, {"label_smoothing": 0.1}, about="the same with label smoothing 0.1"),
    )
}


@dataclasses.dataclass
class Inputs:
    """One shape's inputs, made once and shared by every implementation of the mode.

    ``arrays``: the API's array arguments beyond ``x`` and ``weight``, by keyword (``target``,
    ``teacher_weight``, ``target_indices``; ``labels`` for ``ce``).
    """

    mode: Mode
    x: torch.Tensor  # [N, H] bf16
    weight: torch.Tensor  # [V, H] bf16
    arrays: dict[str, torch.Tensor]

    @property
    def n(self) -> int:
        return self.x.shape[0]

    @property
    def v(self) -> int:
        return self.weight.shape[0]

    @functools.cached_property
    def jax(self) -> tuple[Any, Any, dict[str, Any]]:
        """``x``, ``weight`` and ``arrays`` as JAX arrays through DLPack (integers as int32: JAX's
        default); no copy of the floating-point ones, so no second target in memory."""
        from jax import dlpack

        def to_jax(t: torch.Tensor) -> Any:
            return dlpack.from_dlpack(t if t.is_floating_point() else t.to(torch.int32))

        return to_jax(self.x), to_jax(self.weight), {k: to_jax(t) for k, t in self.arrays.items()}

    @property
    def flops(self) -> int:
        """The step's GEMM work: ``6 N H V`` for the logits and the two gradient GEMMs, plus
        ``2 N H_t V`` for a teacher head's logits. Over a step's time: its effective FLOP/s,
        which the floor (these GEMMs alone) bounds."""
        (n, h), v = self.x.shape, self.v
        teacher = self.arrays.get("teacher_weight")
        return 6 * n * h * v + (0 if teacher is None else 2 * n * teacher.shape[1] * v)

    @property
    def grad_bytes(self) -> int:
        """Bytes of ``grad_x`` and ``grad_weight`` together, in the inputs' dtype."""
        return (self.x.numel() + self.weight.numel()) * self.x.element_size()


def make_weight(h: int, v: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """An LM head ``[V, H]`` in bf16, ``N(0, 0.02²)`` as in a freshly initialised model."""
    gen = torch.Generator(device).manual_seed(seed)
    return torch.randn(v, h, generator=gen, device=device, dtype=torch.bfloat16).mul_(0.02)


def _teacher_rows(n: int, v: int, gen: torch.Generator, device: torch.device):
    """The teacher's fp32 log-probabilities (log-softmax of random logits), ``_TARGET_ROWS`` rows at a time."""
    for start in range(0, n, _TARGET_ROWS):
        rows = min(_TARGET_ROWS, n - start)
        yield start, torch.randn(rows, v, generator=gen, device=device).log_softmax(-1)


def make_inputs(mode: Mode, weight: torch.Tensor, n: int) -> Inputs:
    """``x ~ N(0, 1)`` and the mode's teacher (or labels) for ``n`` rows."""
    v, h = weight.shape
    dev = weight.device
    gen = torch.Generator(dev).manual_seed(n)
    x = torch.randn(n, h, generator=gen, device=dev, dtype=torch.bfloat16)
    arrays: dict[str, torch.Tensor] = {}
    if mode.teacher == "probs":
        arrays["target"] = torch.empty(n, v, device=dev, dtype=torch.bfloat16)
        for start, log_p in _teacher_rows(n, v, gen, dev):
            arrays["target"][start : start + len(log_p)] = log_p.exp()
    elif mode.teacher == "hidden":
        arrays["target"] = torch.randn(n, TEACHER_WIDTH * h, generator=gen, device=dev, dtype=torch.bfloat16)
        arrays["teacher_weight"] = make_weight(TEACHER_WIDTH * h, v, dev, seed=1)
    elif mode.teacher == "topk":
        k = min(TOPK, v)
        arrays["target"] = torch.empty(n, k, device=dev)
        arrays["target_indices"] = torch.empty(n, k, device=dev, dtype=torch.int64)
        for start, log_p in _teacher_rows(n, v, gen, dev):
            top = log_p.topk(k, dim=-1)
            arrays["target"][start : start + len(log_p)] = top.values
            arrays["target_indices"][start : start + len(log_p)] = top.indices
    else:
        arrays["labels"] = torch.randint(0, v, (n,), generator=gen, device=dev)
    return Inputs(mode, x, weight, arrays)


ROW_ARRAYS = ("target", "labels", "target_indices")  # the arrays with a row per row of x
REFERENCE_ROWS = 2048  # rows of the float64 reference at a time: its temporaries stay a few GiB at any N


def reference_grads(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight)`` of the mode's loss from :mod:`fused_kl.reference` (float64 on the
    inputs' device), kept in fp32: plenty to measure a bf16 gradient's error. Made
    ``REFERENCE_ROWS`` rows at a time, each block's mean over its rows weighed by its share of
    ``N`` (every mode's loss is a mean over rows, and the bench's rows are all kept), its
    ``grad_weight`` summed in float64."""
    from fused_kl.reference import reference, reference_cross_entropy

    n = inputs.n
    grad_x = torch.empty(inputs.x.shape, dtype=torch.float32, device=inputs.x.device)
    grad_w = torch.zeros(inputs.weight.shape, dtype=torch.float64, device=inputs.x.device)
    for start in range(0, n, REFERENCE_ROWS):
        stop = min(n, start + REFERENCE_ROWS)
        rows = {k: a[start:stop] if k in ROW_ARRAYS else a for k, a in inputs.arrays.items()}
        x = inputs.x[start:stop]
        if inputs.mode.teacher is None:
            want = reference_cross_entropy(x, inputs.weight, rows["labels"], **inputs.mode.options)
        else:
            want = reference(x, inputs.weight, **rows, **inputs.mode.options)
        share = (stop - start) / n
        grad_x[start:stop] = torch.as_tensor(want.grad_x) * share
        grad_w += torch.as_tensor(want.grad_weight, dtype=torch.float64) * share
        del want
    return grad_x, grad_w.float()
