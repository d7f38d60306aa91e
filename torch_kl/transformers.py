"""One-line integrations with Hugging Face transformers causal LMs (an optional dependency: ``import
torch_kl`` does not import this module).

- ``fuse_loss(model, **options)``: the model's own ``model(..., labels=...)`` loss, computed by
  ``fused_linear_cross_entropy`` on the hidden states entering ``lm_head``, so the ``[B, T, V]`` logits
  never exist.
- ``distillation_loss(student, teacher, input_ids, ...)``: ``fused_linear_kl_div`` with
  ``target_format="hidden"`` on the two models' bodies and heads, neither model's logits materialised.

Both read the head (``get_output_embeddings()``, an ``nn.Linear``, its bias included) and the logit
transform the model applies after it from the model's config (``causal_lm_parts``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from . import fused_linear_cross_entropy, fused_linear_kl_div

IGNORE_INDEX = -100  # transformers' label convention for positions without a loss

# Loss arguments that come from the model or the call, never from ``options``.
_SET_BY_FUSE_LOSS = frozenset({"x", "weight", "labels", "bias", "reduction", "ignore_index", "logit_scale", "softcap"})
_SET_BY_DISTILLATION = frozenset(
    {"x", "weight", "target", "labels", "bias", "ignore_index", "target_format", "target_indices", "teacher_weight",
     "teacher_bias", "logit_scale", "softcap", "teacher_logit_scale", "teacher_softcap"}
)  # fmt: skip


@dataclass(frozen=True)
class CausalLMParts:
    """What a fused loss needs from a causal LM: the head and the transform its forward applies to the
    head's output (``logits = softcap * tanh(logit_scale * (h @ W.T + b) / softcap)``)."""

    head: nn.Linear
    logit_scale: float
    softcap: float | None


def causal_lm_parts(model: nn.Module, role: str = "model") -> CausalLMParts:
    """The head and logit transform of ``model``; ``TypeError`` naming what is missing."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"{role} ({type(model).__name__}) has no nn.Linear LM head: get_output_embeddings() gave "
            f"{type(head).__name__}; a transformers causal LM (…ForCausalLM) is expected"
        )
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{role} ({type(model).__name__}) has no `config` to read its logit transform from")
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return CausalLMParts(head, _logit_scale(config), getattr(config, "final_logit_softcapping", None))


def _logit_scale(config: Any) -> float:
    """The factor the model's forward multiplies the head's output by before any softcap."""
    scale = getattr(config, "logit_scale", None)  # Cohere: logits * logit_scale
    if scale is not None:
        return float(scale)
    scaling = getattr(config, "logits_scaling", None)  # Granite, MiniCPM3: logits / logits_scaling
    if scaling is not None:
        return float(scaling) if getattr(config, "model_type", None) == "hyperclovax" else 1.0 / float(scaling)
    return 1.0


def body_of(model: nn.Module, role: str = "model") -> nn.Module:
    """The base model under the head, whose output's ``last_hidden_state`` enters ``lm_head``."""
    get_decoder = getattr(model, "get_decoder", None)
    candidates = (
        get_decoder() if callable(get_decoder) else None,
        getattr(model, "model", None),
        getattr(model, getattr(model, "base_model_prefix", "") or "model", None),
    )
    for body in candidates:
        if isinstance(body, nn.Module) and body is not model:
            return body
    raise TypeError(
        f"{role} ({type(model).__name__}) has no base model under its head: none of get_decoder(), "
        "`.model` or its base_model_prefix gives a module"
    )


def _check_options(options: dict[str, Any], loss: Callable[..., Any], set_here: frozenset[str]) -> None:
    """Refuse, before any forward runs, an option the loss does not take or that the model decides."""
    parameters = inspect.signature(loss).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for name in options:
        if name in set_here:
            raise TypeError(f"option {name!r} is set from the model and the call, not passed to {loss.__name__}")
        if name not in parameters and not takes_any:
            raise TypeError(f"unknown option {name!r}: {loss.__name__} takes no such argument")


class _FusedLossForward:
    """The patched ``forward`` of one model. An object rather than a closure so that ``copy.deepcopy``
    of the model (a reference model, EMA) gives a copy whose ``forward`` runs the copy."""

    def __init__(self, model: nn.Module, unfused: Callable[..., Any], options: dict[str, Any]) -> None:
        self.model, self.unfused, self.options = model, unfused, options

    @property
    def __signature__(self) -> inspect.Signature:
        # generate() and Trainer read forward's parameters (logits_to_keep, loss kwargs): keep the model's.
        return inspect.signature(self.unfused)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Labels passed positionally reach the unpatched forward: the same loss, unfused.
        labels = kwargs.pop("labels", None)
        if labels is None:
            return self.unfused(*args, **kwargs)
        return_dict = kwargs.pop("return_dict", None)
        parts = causal_lm_parts(self.model)
        seen: list[torch.Tensor] = []

        def head_sees_no_position(_head: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
            # The model's own forward runs unchanged (cache, outputs, logits_to_keep slicing), but its head
            # gets zero positions, so no logits are computed: the loss takes the positions it would have seen.
            seen.append(inputs[0])
            return (inputs[0][..., :0, :],)

        handle = parts.head.register_forward_pre_hook(head_sees_no_position)
        try:
            output = self.unfused(*args, return_dict=True, **kwargs)
        finally:
            handle.remove()
        if len(seen) != 1:
            raise RuntimeError(f"fuse_loss expects lm_head to run once per forward; it ran {len(seen)} times")
        loss = _causal_lm_loss(seen[0], labels, parts, kwargs, self.options)
        output = type(output)(**{**output, "loss": loss, "logits": None})
        if return_dict is None:
            return_dict = getattr(self.model.config, "return_dict", True)
        return output if return_dict else output.to_tuple()


def _causal_lm_loss(
    hidden: torch.Tensor, labels: torch.Tensor, parts: CausalLMParts, call: dict[str, Any], options: dict[str, Any]
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` on the head's input: labels shifted left (or the caller's
    ``shift_labels``), mean over kept positions, or their sum over ``num_items_in_batch``."""
    ignore_index = call.get("ignore_index", IGNORE_INDEX)
    targets = call.get("shift_labels")
    if targets is None:
        targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    num_items = call.get("num_items_in_batch")
    loss = fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), parts.head.weight, targets.reshape(-1).to(hidden.device),
        bias=parts.head.bias, reduction="mean" if num_items is None else "sum", ignore_index=ignore_index,
        logit_scale=parts.logit_scale, softcap=parts.softcap, **options,
    )  # fmt: skip
    if num_items is None:
        return loss
    return loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)


def fuse_loss(model: nn.Module, **options: Any) -> nn.Module:
    """Make ``model(..., labels=...)`` compute its loss with ``fused_linear_cross_entropy``.

    Patches this one instance (not its class) and returns it. With labels, the returned ``.loss`` is
    the unpatched model's (label shift, ``ignore_index=-100``, ``num_items_in_batch`` and
    ``shift_labels`` when the caller passes them, the model's softcap / logit scale) and ``.logits``
    is None; without labels the forward is the model's own. ``options`` go to the loss
    (``label_smoothing``, ``chunk_size``, ``backend``, …). Calling it again replaces the options.

    Raises:
        TypeError: the model has no ``nn.Linear`` head, its forward takes no ``labels``, its loss is
            not transformers' causal-LM cross-entropy, or an option is unknown or set by the model.
    """
    causal_lm_parts(model)  # checked now; each call reads it again, following a replaced (resized) head
    patched = model.forward if isinstance(model.forward, _FusedLossForward) else None
    unfused = patched.unfused if patched is not None else model.forward
    if "labels" not in inspect.signature(unfused).parameters:
        raise TypeError(f"{type(model).__name__}.forward takes no `labels`: not a causal LM with a loss")
    if getattr(model, "loss_function", None) is not ForCausalLMLoss:
        raise TypeError(
            f"{type(model).__name__}'s loss_function is not transformers' ForCausalLMLoss "
            "(a custom loss_type or loss_function): fuse_loss computes only the causal-LM cross-entropy"
        )
    _check_options(options, fused_linear_cross_entropy, _SET_BY_FUSE_LOSS)
    model.forward = _FusedLossForward(model, unfused, dict(options))
    return model


def _distillation_labels(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor | None, hard: bool
) -> torch.Tensor | None:
    """Per-position labels of the loss: ``IGNORE_INDEX`` on the rows it drops, else ``labels[:, t + 1]``
    (or, without labels, any class id: the labels are then only a mask)."""
    for name, tensor in (("attention_mask", attention_mask), ("labels", labels)):
        if tensor is not None and tensor.shape != input_ids.shape:
            raise ValueError(f"{name} must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(tensor.shape)}")
    if labels is None:
        if hard:
            raise ValueError("labels are required when weight_hard_loss > 0: the hard term uses labels[:, t + 1]")
        return None if attention_mask is None else torch.where(attention_mask == 1, 0, IGNORE_INDEX)
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    if attention_mask is not None:
        keep &= attention_mask[:, :-1] == 1
    return torch.where(keep, targets, IGNORE_INDEX)


def distillation_loss(
    student: nn.Module,
    teacher: nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    **options: Any,
) -> torch.Tensor:
    """``fused_linear_kl_div`` of ``student`` against ``teacher`` on ``input_ids``, from the two bodies'
    hidden states and heads (``target_format="hidden"``), biases, softcaps and logit scales included.

    Position ``t`` is kept iff ``attention_mask[:, t] == 1`` (all when None) and, when ``labels`` are
    given, ``labels[:, t + 1] != -100`` (the last position is then dropped; the hard term, if
    ``weight_hard_loss > 0``, uses ``labels[:, t + 1]``). The teacher runs under ``torch.no_grad()``
    in the mode it is in (``teacher.eval()`` for no dropout). ``options`` go to the loss (``beta``,
    ``temperature``, ``weight_hard_loss``, ``reduction``, ``chunk_size``, ``backend``, …). The value
    equals the same loss on both models' own ``.logits``.
    """
    _check_options(options, fused_linear_kl_div, _SET_BY_DISTILLATION)
    s_parts, t_parts = causal_lm_parts(student, "student"), causal_lm_parts(teacher, "teacher")
    s_body, t_body = body_of(student, "student"), body_of(teacher, "teacher")
    hard = float(options.get("weight_hard_loss", 0.0)) > 0
    row_labels = _distillation_labels(input_ids, attention_mask, labels, hard)
    body_inputs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = s_body(**body_inputs).last_hidden_state
    with torch.no_grad():
        t_hidden = t_body(**body_inputs).last_hidden_state
    if labels is not None:  # position t predicts token t + 1: the last position has no target
        hidden, t_hidden = hidden[:, :-1], t_hidden[:, :-1]
    return loss_on_heads(hidden, t_hidden, row_labels, s_parts, t_parts, **options)


def loss_on_heads(
    hidden: torch.Tensor, t_hidden: torch.Tensor, labels: torch.Tensor | None, s_parts: CausalLMParts,
    t_parts: CausalLMParts, **options: Any,
) -> torch.Tensor:  # fmt: skip
    """``fused_linear_kl_div`` of the student's and the teacher's hidden states through their models'
    heads and logit transforms (:func:`causal_lm_parts`), ``labels`` under transformers' -100
    convention; ``options`` the loss's others. What :func:`distillation_loss` and the TRL trainer
    compute once they have the hidden states."""
    return fused_linear_kl_div(
        hidden, s_parts.head.weight, t_hidden, labels, bias=s_parts.head.bias, ignore_index=IGNORE_INDEX,
        target_format="hidden", teacher_weight=t_parts.head.weight, teacher_bias=t_parts.head.bias,
        logit_scale=s_parts.logit_scale, softcap=s_parts.softcap,
        teacher_logit_scale=t_parts.logit_scale, teacher_softcap=t_parts.softcap, **options,
    )  # fmt: skip
