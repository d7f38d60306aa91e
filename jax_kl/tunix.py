"""Logit distillation for Tunix's ``DistillationTrainer`` with the fused loss: no ``[B, T, V]`` logits.

Tunix's ``LogitStrategy`` takes both models' full logits: the teacher's are made before each step and
carried into it, the student's inside it, and the loss reads both. :class:`FusedLogitStrategy`
computes the same loss,

    alpha * temperature**2 * KL(teacher_T || student_T) + (1 - alpha) * CE(student, labels),

from the hidden states entering each head: the forward functions return hidden states
``[B, T, H]``, the heads are read from the models (:func:`jax_kl.flax.head_params`), and
``jax_kl.fused_linear_kl_div`` with ``target_format="hidden"`` makes each chunk's logits of both
models, so neither model's ``[B, T, V]`` logits exist and the teacher's output carried into the step
is its hidden states and head.

Differences from ``LogitStrategy``: ``labels_fn`` returns class ids ``[B, T]`` (not one-hot), and
positions whose label is ``ignore_index`` are left out of both terms and of the mean (Tunix's
strategy averages over every position); ``distill_top_k`` is not offered (it picks each row's top k
from the teacher's full logits, the tensor this strategy never makes).

Import it as ``jax_kl.tunix``: ``import jax_kl`` does not import Tunix or Flax.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from flax import nnx
from tunix.distillation.strategies.base_strategy import BaseStrategy, ModelForwardCallable

from fused_kl.checks import check_number, check_positive

from .api import fused_linear_cross_entropy, fused_linear_kl_div
from .flax import HeadParams, head_params


class HiddenOutput(NamedTuple):
    """What a model's forward pass hands the loss: the hidden states entering its head, and the head."""

    hidden: jax.Array
    head: HeadParams


class FusedLogitStrategy(BaseStrategy):
    """Tunix's ``LogitStrategy`` (same ``temperature``, ``alpha`` and loss) on the fused LM head + KL.

    ``student_forward_fn(model, **inputs)`` and ``teacher_forward_fn(model, **inputs)`` return the
    hidden states entering the head, ``[B, T, H]`` (``[B, T, Ht]`` for the teacher); ``student_head``
    and ``teacher_head`` read each model's head (default: :func:`jax_kl.flax.head_params`, which
    finds an ``lm_head``; a tied head: ``lambda model: head_params(model.embed)``).
    ``labels_fn(**inputs)`` returns class ids ``[B, T]``, ``ignore_index`` where a position is left
    out. ``chunk_size`` and ``backend`` go to the loss.
    """

    def __init__(
        self,
        student_forward_fn: ModelForwardCallable[jax.Array],
        teacher_forward_fn: ModelForwardCallable[jax.Array],
        labels_fn: Callable[..., jax.Array],
        temperature: float = 2.0,
        alpha: float = 0.5,
        *,
        student_head: Callable[[nnx.Module], HeadParams] = head_params,
        teacher_head: Callable[[nnx.Module], HeadParams] = head_params,
        ignore_index: int = -100,
        chunk_size: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(student_forward_fn, teacher_forward_fn, labels_fn)
        self.alpha = check_number("alpha", alpha, lambda v: 0 <= v <= 1, "a number in [0, 1]")
        self.temperature = check_positive("temperature", temperature)
        self._student_head = student_head
        self._teacher_head = teacher_head
        self._options: dict[str, Any] = {"ignore_index": ignore_index, "chunk_size": chunk_size, "backend": backend}

    def get_student_outputs(self, student_model: nnx.Module, inputs: dict[str, jax.Array]) -> HiddenOutput:
        return HiddenOutput(self._student_forward_fn(student_model, **inputs), self._student_head(student_model))

    def get_teacher_outputs(self, teacher_model: nnx.Module, inputs: dict[str, jax.Array]) -> HiddenOutput:
        hidden = super().get_teacher_outputs(teacher_model, inputs)
        return HiddenOutput(hidden, jax.lax.stop_gradient(self._teacher_head(teacher_model)))

    def compute_loss(
        self, student_output: HiddenOutput, teacher_output: HiddenOutput, labels: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        loss = fused_linear_kl_div(
            student_output.hidden, student_output.head.weight, teacher_output.hidden, labels,
            bias=student_output.head.bias, target_format="hidden",
            teacher_weight=teacher_output.head.weight, teacher_bias=teacher_output.head.bias,
            temperature=self.temperature, weight_soft_loss=self.alpha * self.temperature**2,
            weight_hard_loss=1.0 - self.alpha, **self._options,
        )  # fmt: skip
        return loss, {}

    def compute_eval_loss(
        self, student_output: HiddenOutput, labels: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        loss = fused_linear_cross_entropy(
            student_output.hidden, student_output.head.weight, labels, bias=student_output.head.bias,
            reduction="mean", **self._options,
        )  # fmt: skip
        return loss, {}
