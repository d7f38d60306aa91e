"""The ``nn.Module`` forms: drop-ins for Liger's ``LigerFusedLinearKLDivLoss`` and
``LigerFusedLinearJSDLoss``, and a fused linear cross-entropy."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from fused_kl.checks import check_flag, cross_entropy_options

from .api import fused_linear_cross_entropy, fused_linear_kl_div
from .validate import check_module_options

# FusedLinearJSDLoss's logged hard part is derived from the loss (no pass of its own) only where
# weight_hard_loss is at least 1/16 of weight_soft_loss: the subtraction then loses at most about
# four bits of float32 where the parts are alike.
_DERIVED_HARD_RATIO = 16.0
# What FusedLinearJSDLoss passes itself: forward's arguments under the function's names, and the
# format and reduction it fixes.
_JSD_SETS = (
    "x", "weight", "target", "labels", "bias", "teacher_weight", "teacher_bias", "row_weight", "target_format",
    "reduction",
)


def _constructor_options(options: dict, fn: Callable, taken: tuple[str, ...]) -> dict:
    """``options`` for every call to ``fn``, refusing at construction a keyword ``fn`` does not
    take, or one the module passes itself (``taken``: ``forward``'s arguments, or what the module
    fixes): either would otherwise fail only at the first call."""
    known = inspect.signature(fn).parameters
    for name in options:
        if name in taken:
            raise TypeError(f"{name}: this module sets it on every call (pass it to forward() if it is an input there)")
        if name not in known:
            raise TypeError(f"{name}: not a keyword of torch_kl.{fn.__name__}")
    return options


class FusedLinearKLDivLoss(torch.nn.Module):
    """Fused LM head + distillation loss; see :func:`torch_kl.fused_linear_kl_div`.

    The constructor's first five parameters and ``forward(x, weight, target, labels=None,
    bias=None, row_weight=None, target_indices=None)`` have the positional order of Liger's
    ``LigerFusedLinearKLDivLoss``, so it is a drop-in replacement; every other keyword of the
    function is accepted, keyword-only, except ``forward``'s arguments; those and unknown keywords
    are refused with a ``TypeError`` at construction, a value the function would refuse with its
    own error.
    """

    def __init__(
        self,
        reduction: str = "batchmean",
        ignore_index: int = -100,
        temperature: float = 1.0,
        eps: float = 1e-10,
        accum_dtype: torch.dtype | None = None,
        **options: object,
    ) -> None:
        super().__init__()
        self.options = dict(
            reduction=reduction,
            ignore_index=ignore_index,
            temperature=temperature,
            eps=eps,
            accum_dtype=accum_dtype,
            **_constructor_options(
                options,
                fused_linear_kl_div,
                ("x", "weight", "target", "labels", "bias", "row_weight", "target_indices"),
            ),
        )
        check_module_options(self.options, teacher_head=True)

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        labels: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        row_weight: torch.Tensor | None = None,
        target_indices: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The loss of ``x @ weight.T (+ bias)`` against ``target`` (with ``target_indices``, the
        batch's token ids of a top-k target); rows labelled ``ignore_index`` skipped, each kept
        row's loss times its ``row_weight`` if given."""
        return fused_linear_kl_div(
            x, weight, target, labels, bias=bias, row_weight=row_weight, target_indices=target_indices,
            **self.options,  # type: ignore[arg-type]
        )  # fmt: skip

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


class FusedLinearJSDLoss(torch.nn.Module):
    """Drop-in for Liger's ``LigerFusedLinearJSDLoss`` (TRL's GKD trainer): the teacher's hidden
    states and head, ``beta`` generalized JSD plus a hard cross-entropy term, ``"batchmean"``.

    ``compiled`` is accepted and ignored (nothing here needs ``torch.compile``); ``chunk_size``
    is honoured; ``return_soft_hard_loss=True`` returns ``(loss, soft, hard)``, each unweighted
    part reduced over the kept rows, detached (for logging; they cost one more pass over the rows that
    makes no gradient, two with ``weight_hard_loss`` below 1/16 of ``weight_soft_loss`` or a z-loss). Other keywords of
    :func:`torch_kl.fused_linear_kl_div` are accepted, except ``forward``'s arguments and those this
    module sets (``target_format``, ``reduction``), refused with a ``TypeError``;
    ``return_row_losses=True`` returns ``(loss, row_losses)``, not with ``return_soft_hard_loss``.
    """

    def __init__(
        self,
        weight_hard_loss: float = 0.5,
        weight_soft_loss: float = 0.5,
        beta: float = 0.5,
        ignore_index: int = -100,
        temperature: float = 1.0,
        compiled: bool = True,
        chunk_size: int = 1024,
        return_soft_hard_loss: bool = False,
        **options: object,
    ) -> None:
        super().__init__()
        del compiled
        self.weights = (weight_soft_loss, weight_hard_loss)
        self.return_soft_hard_loss = check_flag("return_soft_hard_loss", return_soft_hard_loss)
        self.options = dict(
            beta=beta,
            ignore_index=ignore_index,
            temperature=temperature,
            chunk_size=chunk_size,
            target_format="hidden",
            reduction="batchmean",
            **_constructor_options(
                options,
                fused_linear_kl_div,
                _JSD_SETS,
            ),
        )
        check_module_options(dict(self.options, weight_soft_loss=weight_soft_loss, weight_hard_loss=weight_hard_loss))
        if self.return_soft_hard_loss and self.options.get("return_row_losses"):
            raise ValueError(
                "return_row_losses: not with return_soft_hard_loss=True (its (loss, soft, hard) takes the output); "
                "pass one of them"
            )

    def forward(
        self,
        student_input: torch.Tensor,
        student_weight: torch.Tensor,
        teacher_input: torch.Tensor,
        teacher_weight: torch.Tensor,
        true_labels: torch.Tensor | None,
        student_bias: torch.Tensor | None = None,
        teacher_bias: torch.Tensor | None = None,
        row_weight: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def part(soft: float, hard: float, **options: object) -> torch.Tensor:
            return fused_linear_kl_div(
                student_input, student_weight, teacher_input, true_labels, bias=student_bias,
                teacher_weight=teacher_weight, teacher_bias=teacher_bias, weight_soft_loss=soft,
                weight_hard_loss=hard, row_weight=row_weight, **(self.options | options),  # type: ignore[arg-type]
            )  # fmt: skip

        soft_w, hard_w = self.weights
        loss = part(soft_w, hard_w)
        if not self.return_soft_hard_loss:
            return loss
        # The parts for logging, without gradients: one pass that makes only a loss (no gradient
        # GEMMs) gives the soft part, and the hard part follows from the loss. A second such pass
        # makes it where that would lose digits: a hard weight small beside the soft one (the
        # difference cancels, and 0 divides), or a z-loss (which belongs to neither part).
        with torch.no_grad():
            soft = part(1.0, 0.0, z_loss_weight=0.0)
            derived = hard_w != 0.0 and hard_w * _DERIVED_HARD_RATIO >= soft_w
            if true_labels is None:  # no hard term without labels (its weight is 0, or the call refused)
                hard = torch.zeros_like(soft)
            elif not derived or self.options.get("z_loss_weight", 0.0) != 0.0:
                hard = part(0.0, 1.0, z_loss_weight=0.0)
            else:
                hard = (loss.detach() - soft_w * soft) / hard_w
        return loss, soft, hard


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """Fused LM head + cross-entropy; see :func:`torch_kl.fused_linear_cross_entropy`.
    ``forward(x, weight, labels, bias=None, row_weight=None)``; the constructor takes the
    function's keywords but ``forward``'s arguments."""

    def __init__(self, **options: object) -> None:
        super().__init__()
        self.options = _constructor_options(
            options, fused_linear_cross_entropy, ("x", "weight", "labels", "bias", "row_weight")
        )
        check_module_options(cross_entropy_options(**{"reduction": "mean", **self.options}), False)

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        bias: torch.Tensor | None = None,
        row_weight: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return fused_linear_cross_entropy(x, weight, labels, bias=bias, row_weight=row_weight, **self.options)  # type: ignore[arg-type]
