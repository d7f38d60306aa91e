"""What to compute: the loss description, framework-free and hashable (a static argument).

``Loss`` says which divergence, which terms and weights, how rows are reduced and how the
student's logits are transformed; ``Teacher`` says in what form the teacher arrives. Run
options (chunk size, accumulation dtype, backend) live apart, in ``fused_kl.options``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

REDUCTIONS = ("batchmean", "sum", "mean")
# Dense formats give the kernel a [rows, V] teacher chunk; "hidden" becomes "logits" per chunk
# (one more GEMM); "topk_log_probs" gives k values per row, handled around the kernel.
TARGET_FORMATS = ("probs", "log_probs", "logits", "hidden", "topk_log_probs")
TOPK_TAILS = ("bin", "renormalize", "drop")
# The divergence kinds of the row kernel; "coef" is a per-row multiple of q (top-k teachers,
# or no teacher at all: the fused cross-entropy).
KINDS = ("forward", "reverse", "jsd", "coef")


def _is(value: Any, constant: float) -> bool:
    """``value == constant`` for a number. A runtime value (a traced 0-d array, ``VALUES``) is
    never taken as equal: what it decides statically takes the general case (a traced ``beta`` is
    the JSD kind, a traced weight keeps its term, a traced temperature its own log-sum-exp)."""
    return isinstance(value, (int, float)) and value == constant


@dataclass(frozen=True)
class Teacher:
    """How the teacher arrives and how its logits are read (formats "logits" and "hidden")."""

    format: str
    temperature: float
    logit_scale: float = 1.0
    softcap: float | None = None
    topk_tail: str = "bin"
    eps: float = 1e-10

    @property
    def dense_format(self) -> str | None:
        """The format of the [rows, V] chunk the row kernel reads, or None (top-k)."""
        if self.format == "topk_log_probs":
            return None
        return "logits" if self.format == "hidden" else self.format

    @property
    def has_logits(self) -> bool:
        return self.dense_format == "logits"


@dataclass(frozen=True)
class Loss:
    """``weight_soft * reduce(divergence(teacher, student)) + reduce(weight_hard * CE(labels) + z_loss * lse**2)``,
    ``lse`` the log-sum-exp of the student's transformed logits at temperature 1 (the z-loss)."""

    reduction: str = "batchmean"
    ignore_index: int = -100
    temperature: float = 1.0
    beta: float = 0.0
    weight_soft: float = 1.0
    weight_hard: float = 0.0
    label_smoothing: float = 0.0
    logit_scale: float = 1.0
    softcap: float | None = None
    teacher: Teacher | None = None  # None: no soft term (the fused cross-entropy)
    z_loss: float = 0.0

    @property
    def soft(self) -> bool:
        return self.teacher is not None and not _is(self.weight_soft, 0.0)

    @property
    def hard(self) -> bool:
        """The hard side is on: the student's softmax at temperature 1 enters the loss (the
        cross-entropy, the z-loss or both), with the rows' labels (``rowmath.hard_labels``)."""
        return self.cross_entropy or self.z_term

    @property
    def cross_entropy(self) -> bool:
        """The hard side holds the cross-entropy against the labels (not only the z-loss)."""
        return not _is(self.weight_hard, 0.0)

    @property
    def z_term(self) -> bool:
        """The hard side holds the z-loss."""
        return not _is(self.z_loss, 0.0)

    @property
    def teacher_head(self) -> bool:
        """The soft term's teacher is a head: a GEMM makes its logits per chunk, into a second buffer."""
        return self.soft and self.teacher.format == "hidden"  # type: ignore[union-attr]

    @property
    def kind(self) -> str:
        """The row kernel's divergence kind: by ``beta`` for dense teachers, else ``"coef"``."""
        if not self.soft or self.teacher.dense_format is None:  # type: ignore[union-attr]
            return "coef"
        if _is(self.beta, 0.0):
            return "forward"
        return "reverse" if _is(self.beta, 1.0) else "jsd"

    @property
    def stats_read_teacher(self) -> bool:
        """Whether the ``stats`` phase reads a dense teacher: the log-sum-exp of teacher logits,
        the forward KL's mass ``K = sum p``, reverse KL's sum ``R`` (``fused_kl.rows.Stats.reverse``).
        JSD on probabilities needs none of them: its sums need the student's log-sum-exp first."""
        if self.kind == "coef":
            return False
        return self.teacher.has_logits or self.kind != "jsd"  # type: ignore[union-attr]

    @property
    def separate_hard_lse(self) -> bool:
        """The hard term's log-sum-exp (temperature 1) differs from the soft term's."""
        return self.hard and not _is(self.temperature, 1.0)


# The hyperparameters that are values, not part of what is compiled: torch's custom op takes them
# as a tensor operand, JAX may take them as traced 0-d arrays, so a new value needs no new trace.
# What they decide statically (the divergence's kind, whether a term exists) is read from the
# ``Loss`` that travels as the static description (``_is``).
VALUES = ("temperature", "teacher_temperature", "beta", "weight_soft", "weight_hard", "label_smoothing", "z_loss")
# The arguments that set them, in the same order (both frameworks' names).
VALUE_ARGUMENTS = (
    "temperature", "teacher_temperature", "beta", "weight_soft_loss", "weight_hard_loss", "label_smoothing",
    "z_loss_weight",
)  # fmt: skip

# No runtime values: the ``Loss`` holds them all (``with_values`` keeps a None's own value).
NO_VALUES = (None,) * len(VALUES)


def values_of(loss: Loss) -> list[Any]:
    """The :data:`VALUES` of ``loss`` in order (the teacher's temperature 1.0 without a teacher)."""
    teacher_t = 1.0 if loss.teacher is None else loss.teacher.temperature
    return [teacher_t if name == "teacher_temperature" else getattr(loss, name) for name in VALUES]


def with_values(loss: Loss, values: Sequence[Any]) -> Loss:
    """``loss`` with its :data:`VALUES` replaced by ``values`` (numbers, or traced 0-d arrays; None
    keeps the loss's own)."""
    named = {name: own if v is None else v for name, v, own in zip(VALUES, values, values_of(loss), strict=True)}
    teacher_t = named.pop("teacher_temperature")
    teacher = None if loss.teacher is None else replace(loss.teacher, temperature=teacher_t)
    return replace(loss, teacher=teacher, **named)
