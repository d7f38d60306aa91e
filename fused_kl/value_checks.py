"""The eager value checks, shared by both frameworks: what they read of the labels, the top-k
indices, the teacher and the row weights, reduced where the arrays are (:func:`value_summary`),
and the errors raised from those few numbers on the host (:func:`check_value_summary`).

Under ``jax.jit`` and ``torch.compile`` the values are not concrete and these checks do not run:
the drivers turn the rows they would have refused into NaN (``fused_kl.rowmath.invalid_rows``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .checks import labels_role
from .loss import Loss


def target_values_checked(loss: Loss) -> bool:
    """Whether the teacher's values are checked where concrete (not under ``jax.jit`` nor
    ``torch.compile``): probabilities must not be negative, top-k log-probabilities not above 0.
    The other formats hold any real number."""
    return loss.soft and loss.teacher.format in ("probs", "topk_log_probs")  # type: ignore[union-attr]


def value_summary(
    labels: Any | None, indices: Any | None, keep: Any | None, sort: Callable[[Any], Any], xp: Any,
    target: Any | None = None, target_format: str = "probs", row_weight: Any | None = None,
) -> list:  # fmt: skip
    """What the value checks read, reduced where the arrays are (``xp``: torch or numpy; ``sort``
    sorts the last axis). ``keep``, one bool a row (the rows whose label is not ``ignore_index``;
    None without labels: every row), limits every check to the kept rows: an ignored row stays
    ignored whatever its values, as where the values go unchecked (``fused_kl.rowmath.invalid_rows``).
    The parts: the kept labels' min and max (if ``labels``, with ``keep``), the top-k indices'
    min, max and whether a row repeats one (if ``indices``), whether ``target`` (where
    :func:`target_values_checked`) has a value of the wrong sign: by each row's min or max, so no
    temporary of its size, and NaN passes (it propagates); whether a row weight is not a finite
    number >= 0 (if ``row_weight``). :func:`check_value_summary` reads it."""

    def kept(bad: Any) -> Any:
        return bad if keep is None else bad & keep

    parts = []
    if labels is not None:
        kept_labels = xp.where(keep, labels.reshape(-1), 0)
        parts += [kept_labels.min(), kept_labels.max()]
    if indices is not None:
        ordered = sort(indices.reshape(-1, indices.shape[-1]))
        lo, hi = ordered[:, 0], ordered[:, -1]
        if keep is not None:
            lo, hi = xp.where(keep, lo, 0), xp.where(keep, hi, 0)
        parts += [lo.min(), hi.max(), kept((ordered[:, 1:] == ordered[:, :-1]).any(-1)).any()]
    if target is not None:
        rows = target.reshape(-1, target.shape[-1])
        wrong = xp.amin(rows, -1) < 0 if target_format == "probs" else xp.amax(rows, -1) > 0
        parts.append(kept(wrong).any())
    if row_weight is not None:
        weights = row_weight.reshape(-1)
        parts.append(kept(~((weights >= 0) & (weights < float("inf")))).any())
    return parts


def check_value_summary(
    values: list[int], loss: Loss, labels: bool, indices: bool, v: int, target: bool = False, row_weight: bool = False
) -> None:
    """Raise on bad concrete values, from :func:`value_summary`'s parts as ints: every kept label
    (the hard term's or the cross-entropy's) in ``[0, V)``; top-k indices in ``[0, V)`` and
    distinct within a row; the teacher's values of their format's sign (if ``target``); every
    row weight finite and >= 0 (if ``row_weight``)."""
    if labels:
        kept_min, kept_max = values[:2]
        values = values[2:]
        if kept_min < 0 or kept_max >= v:
            bad = kept_min if kept_min < 0 else kept_max
            raise ValueError(f"labels: expected values in [0, {v}) for kept rows ({labels_role(loss)}), got {bad}")
    if indices:
        lo, hi, duplicated = values[:3]
        if lo < 0 or hi >= v:
            raise ValueError(f"target_indices: expected token ids in [0, {v}), got {lo if lo < 0 else hi}")
        if duplicated:
            raise ValueError("target_indices: expected distinct token ids within each row, got a duplicate")
        values = values[3:]
    if target:
        if values[0] and loss.teacher.format == "probs":  # type: ignore[union-attr]
            raise ValueError("target: expected probabilities >= 0 (target_format='probs'), got a negative one")
        if values[0]:
            raise ValueError(
                "target: expected log-probabilities <= 0 (target_format='topk_log_probs'), got one above 0"
            )
        values = values[1:]
    if row_weight and values[0]:
        raise ValueError("row_weight: expected finite numbers >= 0, got a negative, infinite or NaN one")
