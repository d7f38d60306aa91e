"""``torch_kl.compiled``: what a call describes crosses the ``torch.library`` custom op as
numbers and a string; decoded, it is the same ``Loss``, ``RunOptions``, ``Layout`` and backend,
every field at a value other than its default included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fused_kl.loss import Loss, Teacher
from fused_kl.options import RunOptions
from torch_kl import backends
from torch_kl.compiled import _decode, _encode
from torch_kl.layout import Layout

# Every field of each description at a value other than its default: a field added to one of
# them without a value here fails test_every_field_has_a_value_to_cross.
TEACHER = dict(format="logits", temperature=1.5, logit_scale=0.75, softcap=12.0, topk_tail="drop", eps=1e-6)
LOSS = dict(reduction="sum", ignore_index=7, temperature=2.5, beta=0.25, weight_soft=0.625, weight_hard=0.375,
            label_smoothing=0.125, logit_scale=1.25, softcap=30.0, teacher=Teacher(**TEACHER), z_loss=0.0625)
RUN = dict(accum_dtype="float32", chunk_size=3, values_checked=True)


@pytest.mark.parametrize(("cls", "values"), [(Teacher, TEACHER), (Loss, LOSS), (RunOptions, RUN)])
def test_every_field_has_a_value_to_cross(cls, values: dict) -> None:
    fields = dataclasses.fields(cls)
    assert {f.name for f in fields} == set(values)
    defaults = cls(**{f.name: values[f.name] for f in fields if f.default is dataclasses.MISSING})
    assert all(getattr(defaults, f.name) != values[f.name] for f in fields if f.default is not dataclasses.MISSING)


@pytest.mark.parametrize(
    "loss",
    [
        Loss(**LOSS),
        Loss(**{**LOSS, "teacher": Teacher(**{**TEACHER, "format": "topk_log_probs", "softcap": None})}),
        Loss(**{**LOSS, "softcap": None, "teacher": None, "weight_soft": 0.0}),  # the fused cross-entropy
        Loss(teacher=Teacher("probs", 1.0)),  # the defaults
    ],
    ids=["every-field", "topk-uncapped-teacher", "cross-entropy-uncapped", "defaults"],
)
@pytest.mark.parametrize("run", [RunOptions(**RUN), RunOptions()], ids=["options", "default-options"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_op_decodes_what_it_was_given(loss: Loss, run: RunOptions, backend: str) -> None:
    resolved = backends.resolve(backend, torch.device("cpu"))
    values, floats, ints, joined = _encode(loss, run, Layout(), resolved)
    assert all(type(f) is float for f in values + floats) and all(type(i) is int for i in ints)
    assert _decode(values, floats, ints, joined) == (loss, run, Layout(), resolved)
    variant = dataclasses.replace(resolved, split_vocab_gemms=False, phases=None)  # a switch and a part off
    assert _decode(*_encode(loss, run, Layout(), variant)) == (loss, run, Layout(), variant)
