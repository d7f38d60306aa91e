"""What to compute: the loss description, framework-free and hashable (a static argument).

``Loss`` says which divergence, which terms and weights, how rows are reduced and how the
student's logits are transformed; ``Teacher`` says in what form the teacher arrives. Run
options (chunk size, accumulation dtype, backend) live apart, in ``fused_kl.options``.
"""

from __future__ import annotations

from dataclasses import dataclass

REDUCTIONS = ("batchmean", "sum", "mean")
# Dense formats give the kernel a [rows, V] teacher chunk; "hidden" becomes "logits" per chunk
# (one more GEMM); "topk_log_probs" gives k values per row, handled around the kernel.
TARGET_FORMATS = ("probs", "log_probs", "logits", "hidden", "topk_log_probs")
TOPK_TAILS = ("bin", "renormalize", "drop")
# The divergence kinds of the row kernel; "coef" is a per-row multiple of q (top-k teachers,
# or no teacher at all: the fused cross-entropy).
KINDS = ("forward", "reverse", "jsd", "coef")


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
    """``weight_soft * reduce(divergence(teacher, student)) + weight_hard * reduce(CE(labels))``."""

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

    @property
    def soft(self) -> bool:
        return self.teacher is not None and self.weight_soft != 0.0

    @property
    def hard(self) -> bool:
        return self.weight_hard != 0.0

    @property
    def teacher_head(self) -> bool:
        """The soft term's teacher is a head: a GEMM makes its logits per chunk, into a second buffer."""
        return self.soft and self.teacher.format == "hidden"  # type: ignore[union-attr]

    @property
    def kind(self) -> str:
        """The row kernel's divergence kind: by ``beta`` for dense teachers, else ``"coef"``."""
        if not self.soft or self.teacher.dense_format is None:  # type: ignore[union-attr]
            return "coef"
        if self.beta == 0.0:
            return "forward"
        return "reverse" if self.beta == 1.0 else "jsd"

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
        return self.hard and self.temperature != 1.0
