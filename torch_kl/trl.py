"""TRL's distillation trainers computing their loss with the fused loss (TRL is an optional dependency:
``import torch_kl`` does not import this module).

- ``FusedGKDTrainer``: TRL's ``GKDTrainer`` (``trl.experimental.gkd``; top-level ``trl`` before 1.14),
  TRL ``SUPPORTED_GKD``. Its ``compute_loss`` is ``torch_kl.transformers.distillation_loss`` with
  TRL's ``beta`` at temperature 1: the generalized JSD of TRL's unfused ``generalized_jsd_loss``
  on the rows ``labels[:, t + 1] != -100``, averaged over them (or summed over
  ``num_items_in_batch``), with neither model's ``[B, T, V]`` logits.
- ``FusedDistillationTrainer``: TRL's ``DistillationTrainer`` (``trl.DistillationTrainer``),
  TRL ``SUPPORTED_DISTILLATION``: the versions whose loss internals it was checked against, since it
  replaces ``DistillationTrainer._compute_loss``. Same divergence, ``beta`` and temperature as TRL's
  chunked loss; the per-token entropy TRL logs beside it is not computed (logged as missing).

Both take ``loss_options=`` (a dict for the loss: ``chunk_size``, ``backend``, ``weight_hard_loss``, …).
Another TRL version raises ``ImportError`` naming the installed and the supported versions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import trl
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from .transformers import IGNORE_INDEX, causal_lm_parts, distillation_loss, loss_on_heads

SUPPORTED_GKD = SpecifierSet(">=1.8,<2")
SUPPORTED_DISTILLATION = SpecifierSet(">=1.16,<1.17")
TRL_VERSION = Version(trl.__version__)


def _unsupported(what: str, supported: SpecifierSet) -> ImportError:
    return ImportError(f"torch_kl.trl's {what} supports TRL {supported}; TRL {trl.__version__} is installed")


if TRL_VERSION not in SUPPORTED_GKD:
    raise _unsupported("FusedGKDTrainer", SUPPORTED_GKD)
try:
    from trl.experimental.gkd import GKDTrainer
except ImportError:  # TRL before 1.14 keeps GKD at the top level
    from trl import GKDTrainer


def _through_wrapper(wrapper: nn.Module, module: nn.Module, compute: Callable[[], Any]) -> Any:
    """Run ``compute`` inside ``wrapper``'s forward (DDP, FSDP), so that the wrapper's hooks see the
    student's parameters used: the loss calls the student's body, not ``wrapper(...)``."""
    if wrapper is module:
        return compute()
    had_own_forward = "forward" in module.__dict__
    own_forward = module.__dict__.get("forward")

    def redirected(*_args: Any, **_kwargs: Any) -> Any:
        restore()
        return compute()

    def restore() -> None:
        if had_own_forward:
            module.forward = own_forward
        else:
            module.__dict__.pop("forward", None)

    module.forward = redirected
    try:
        return wrapper()
    finally:
        restore()


class FusedGKDTrainer(GKDTrainer):
    """``GKDTrainer`` whose loss is fused: ``FusedGKDTrainer(..., loss_options={...})``, else as TRL's."""

    def __init__(self, *args: Any, loss_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loss_options = dict(loss_options or {})

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, CausalLMOutputWithPast]:
        student = self.accelerator.unwrap_model(model)
        teacher = self.accelerator.unwrap_model(self.teacher_model)
        teacher.eval()
        reduction = "batchmean" if num_items_in_batch is None else "sum"

        def loss_of_batch() -> torch.Tensor:
            return distillation_loss(
                student, teacher, inputs["input_ids"], attention_mask=inputs["attention_mask"],
                labels=inputs["labels"], beta=self.beta, reduction=reduction, **self.loss_options,
            )  # fmt: skip

        loss = _through_wrapper(model, student, loss_of_batch)
        if num_items_in_batch is not None:  # TRL's gradient-accumulation normalisation: over the whole step
            loss = loss / torch.as_tensor(num_items_in_batch, device=loss.device)
        # No logits: the fused loss never makes them.
        return (loss, CausalLMOutputWithPast(loss=loss)) if return_outputs else loss


if TRL_VERSION in SUPPORTED_DISTILLATION:
    from trl import DistillationTrainer

    class FusedDistillationTrainer(DistillationTrainer):
        """``DistillationTrainer`` whose loss is fused: ``FusedDistillationTrainer(..., loss_options={...})``."""

        def __init__(self, *args: Any, loss_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.loss_options = dict(loss_options or {})

        def _compute_loss(
            self, unwrapped_student: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | None
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """TRL's hidden states of the completion positions (its ``_get_last_hidden_state``, teacher
            through its wrapper), then the fused divergence on them; returns TRL's ``(loss, entropy sum,
            kept positions)``, the entropy NaN (not computed; TRL logs it as missing)."""
            completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
            loss_mask = completion_mask * inputs["tool_mask"] if "tool_mask" in inputs else completion_mask
            input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
            # The model inputs TRL's own method takes (images and the like), read off its signature.
            takes = inspect.signature(self._get_last_hidden_state).parameters
            extra = {k: v for k, v in inputs.items() if k in takes and k not in ("input_ids", "attention_mask")}
            hidden_of = self._get_last_hidden_state
            kept = completion_ids.size(1)
            hidden = hidden_of(unwrapped_student, input_ids, attention_mask, kept, **extra)
            self.teacher_model.eval()
            teacher = self.accelerator.unwrap_model(self.teacher_model)
            with torch.no_grad():
                t_hidden = self._forward_redirection(
                    self.teacher_model, teacher, hidden_of, teacher, input_ids, attention_mask, kept, **extra
                )
            s_parts, t_parts = causal_lm_parts(unwrapped_student, "student"), causal_lm_parts(teacher, "teacher")
            device = s_parts.head.weight.device  # with a device_map the body may end elsewhere
            # Hidden position j is aligned to completion token j: its label for a hard term, if any.
            labels = torch.where(loss_mask.to(device) != 0, completion_ids.to(device), IGNORE_INDEX)
            loss = loss_on_heads(
                hidden.to(device), t_hidden.to(device), labels, s_parts, t_parts, beta=self.beta,
                temperature=self.temperature, reduction="sum", **self.loss_options,
            )  # fmt: skip
            n_valid = (labels != IGNORE_INDEX).sum()
            if num_items_in_batch is None:
                loss = loss / n_valid.clamp(min=1)
            else:
                loss = loss / torch.as_tensor(num_items_in_batch, device=device)
            return loss, torch.full((), float("nan"), device=device), n_valid

else:

    def __getattr__(name: str) -> Any:
        """Name the supported versions where the installed TRL has no supported DistillationTrainer."""
        if name == "FusedDistillationTrainer":
            raise _unsupported("FusedDistillationTrainer", SUPPORTED_DISTILLATION)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
