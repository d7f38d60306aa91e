"""The factored ``dL/dz``: a row scale of one exponential plus the label's term, so that no pass
over a chunk writes ``dL/dz`` (stated once for both frameworks; ``torch_kl``'s logits GEMM writes
``E`` in its epilogue, ``torch_kl/backends/triton_factored.py``; ``jax_kl``'s statistics pass
writes it over the logits, ``jax_kl/factored.py``).

With ``a = f(z) / T`` (``f`` the student transform; ``T = 1`` without a soft term), ``q =
softmax(a)``, ``u_j = f'(z_j) / logit_scale`` (``1 - (f_j / softcap)^2`` when capped, else 1) and
``w_r`` the row's factor of ``q`` in ``dL/dz`` (``c_hard + c_z``, plus ``c_soft K`` with a top-k
teacher; ``fused_kl.rowmath``), each row's gradient is::

    dL/dz_j = alpha_r E_j + [j = y_r] d_r,   E_j = exp(a_j - s_r) u_j,
    alpha_r = w_r logit_scale exp(s_r - lse_r),   d_r = -c_hard logit_scale u_y

(``d`` the label's term, ``fused_kl.chunk.LabelTerm``). So ``grad_x = diag(alpha) (E W) +
diag(d) W_y`` and ``grad_W += E^T (diag(alpha) x)`` plus ``d_r x_r`` at the labels.

``E`` is written before ``lse_r`` is known, with the fixed shift ``s_r = SHIFT``, in bfloat16,
whose range is float32's. That shift is kept on rows whose maximum ``a`` lies in ``[LO, HI]``:
then ``E <= e^(HI - SHIFT)`` sums in float32 without overflow; the entries flushed to zero
(``a_j - SHIFT`` below float32's smallest normal exponent, about -87, where the GPU's
approximate ``exp`` flushes) lie more than ``LO - SHIFT + 87`` below the row's maximum (``q <
e^-31``, under bfloat16's rounding of the row's largest entries); and ``alpha >= w logit_scale
e^(SHIFT - HI - log V)`` keeps ``diag(alpha) x`` a normal bfloat16 number for ``w logit_scale``
down to about ``1e-8``. A row whose maximum leaves the window is remade with its own shift
(each framework says how).
"""

from __future__ import annotations

from typing import Any

from . import terms
from .loss import Loss

SHIFT = 16.0
LO = -40.0
HI = 56.0


def takes(bfloat16: bool, has_bias: bool, loss: Loss, topk: bool) -> bool:
    """Whether a chunk's ``dL/dz`` factors: bfloat16 logits (float16's range is too narrow for
    ``E``), no bias, no label smoothing (its ``-eps/V`` is not a multiple of ``q``); the hard
    term, and with ``topk`` (the backend factors top-k teachers) a top-k teacher uncapped (its
    logits are read back from ``log E``) at one temperature. A dense teacher's ``p`` and a
    second temperature are not a row scale of one exponential."""
    if not bfloat16 or has_bias or not _zero(loss.label_smoothing):
        return False
    if loss.soft:
        return topk and loss.kind == "coef" and loss.softcap is None and (not loss.hard or _one(loss.temperature))
    return loss.hard


def exponent(z: Any, loss: Loss, xp: Any) -> Any:
    """``a = f(z) / T`` of float32 logits ``z``: the exponent of every term of a factored row
    (``T = 1`` where the hard term is on; a top-k teacher alone may have any ``T``)."""
    return terms.transform(z, loss.logit_scale, loss.softcap, xp) / loss.temperature


def exponentials(z: Any, loss: Loss, xp: Any, shift: Any = SHIFT) -> Any:
    """``E`` of float32 logits ``z``: ``exp(a - shift) u`` (``torch_kl``'s Triton ``exp_tile`` is
    the translation); ``shift`` the fixed one, or a column of the rows' own."""
    e = xp.exp(exponent(z, loss, xp) - shift)
    if loss.softcap is None:
        return e
    r = terms.transform(z, loss.logit_scale, loss.softcap, xp) / loss.softcap
    return e * (1.0 - r * r)


def in_window(row_max: Any) -> Any:
    """Rows whose maximum exponent keeps the fixed shift (``SHIFT``): False where NaN."""
    return (row_max >= LO) & (row_max <= HI)


def alpha(q_factor: Any, shift: Any, lse: Any, loss: Loss, xp: Any) -> Any:
    """``alpha_r = w_r logit_scale exp(s_r - lse_r)``; 0 where ``w_r`` is (an ignored row, whose
    ``lse`` may be NaN)."""
    return xp.where(q_factor == 0, 0.0, q_factor * loss.logit_scale * xp.exp(shift - lse))


def q_factor(c_soft: Any, c_hard: Any, c_z: Any, k: Any | None, loss: Loss, xp: Any) -> Any:
    """The rows' factor ``w`` of ``q`` in ``dL/dz``: the hard term's and the z-loss's (a multiple
    of ``q``), plus ``c_soft K`` with a top-k teacher (``k`` its rows' ``K``, else None). A row of
    no soft weight (an ignored row) takes none of ``K``, which its NaN teacher entries would make
    NaN: ignored rows stay ignored whatever their values."""
    if k is None:
        return c_hard + c_z
    return xp.where(c_soft != 0, c_soft * k, 0.0) + (c_hard + c_z if loss.hard else 0.0)


def only_sparse(q_factor: Any, values: Any, write: Any) -> Any:
    """The rows whose gradient lies at a top-k teacher's tokens alone (``values`` where
    ``write``, no dense part ``w``): their ``E`` is zeroed before the tokens' entries are written."""
    return (q_factor == 0) & (write & (values != 0)).any(-1)


def label_held(at: Any, write: Any, y: Any | None) -> Any:
    """The rows whose label is one of the top-k teacher's tokens written (``at`` where ``write``):
    that entry holds ``dL/dz_y``, so the label's term is not kept apart (None without labels)."""
    return None if y is None else (write & (at == y[:, None])).any(-1)


def _zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and value == 0.0


def _one(value: Any) -> bool:
    return isinstance(value, (int, float)) and value == 1.0
