"""Bad input (docs/contract.md): every case raises the right exception in both frameworks, with
the same message naming the argument, before any kernel runs and without touching the inputs;
in JAX the same error again at trace time under ``jax.jit`` (the checks of values excepted).
The cases are ``validation_cases.BAD``."""

from __future__ import annotations

import copy
import math

import jax
import numpy as np
import pytest
import torch
from harness import ALL_BACKENDS
from validation_cases import BAD, Jax, Torch, call, call_args, option

import fused_kl_bridges.pallas_for_torch
import fused_kl_bridges.triton_for_jax
import jax_kl.driver
import torch_kl.driver


def _snapshot(value):
    """A copy to compare with after the call (None for what cannot be read back: meta tensors)."""
    if isinstance(value, torch.Tensor):
        return None if value.is_meta else value.detach().clone()
    if isinstance(value, (jax.Array, np.ndarray)):
        return np.array(value, copy=True)
    return copy.deepcopy(value) if isinstance(value, (list, dict)) else value  # others: compared as they are


def _unchanged(before, after) -> bool:
    if before is None:
        return True
    if isinstance(before, torch.Tensor):
        return before.dtype == after.dtype and torch.equal(before, after)
    if isinstance(before, np.ndarray):
        now = np.asarray(after)
        return before.dtype == now.dtype and np.array_equal(before, now, equal_nan=before.dtype.kind in "fc")
    if isinstance(before, float) and math.isnan(before):
        return math.isnan(after)
    return before == after


@pytest.fixture
def no_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every backend's compute raise: a bad input must be refused before any of them runs,
    or (labels, token ids) by its ``ready()``, run before anything reads them (test_torch_kl)."""

    def ran(*args, ready=None, **kwargs):
        if ready is not None:
            ready()
        raise AssertionError("a kernel or GEMM stage ran on bad input")

    for module in (torch_kl.driver, jax_kl.driver):
        monkeypatch.setattr(module, "forward", ran)
    monkeypatch.setattr(fused_kl_bridges.pallas_for_torch, "torch_through_pallas", ran)
    monkeypatch.setattr(fused_kl_bridges.triton_for_jax, "jax_through_triton", ran)


@pytest.mark.usefixtures("no_kernels")
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case: str) -> None:
    bad = BAD[case]
    messages = {}
    for fw in bad.frameworks:
        args = call_args(fw, bad.overrides)
        before = {k: _snapshot(v) for k, v in args.items()}
        with pytest.raises(bad.exc) as info:
            call(fw, args, bad.fn)
        assert type(info.value) is bad.exc, f"{fw.name}: {type(info.value).__name__}: {info.value}"
        message = str(info.value)
        assert message.startswith(f"{bad.arg}: "), f"{fw.name}: {message!r} does not name {bad.arg}"
        if bad.expected_got:
            assert "expected" in message and ", got " in message, f"{fw.name}: {message!r}"
        assert all(c in message for c in bad.contains), f"{fw.name}: {message!r} lacks {bad.contains}"
        for k, v in before.items():
            assert _unchanged(v, args[k]), f"{fw.name}: {k} was modified"
        messages[fw.name] = message
        if fw is Jax and not bad.on_values:  # the same error at trace time under jax.jit, the arrays traced
            traced = {k: v for k, v in args.items() if isinstance(v, jax.Array)}
            rest = {k: v for k, v in args.items() if k not in traced}
            with pytest.raises(bad.exc) as info:
                jax.jit(lambda arrays, rest=rest: call(Jax, {**rest, **arrays}, bad.fn))(traced)
            assert str(info.value) == message
    if bad.same_message and len(messages) == 2:
        assert messages["torch"] == messages["jax"]


@pytest.mark.usefixtures("no_kernels")
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_no_kernels_stops_a_valid_call(backend: str) -> None:
    """The ``no_kernels`` fixture does catch every backend's compute."""
    framework, name = backend.split("/")
    fw = Torch if framework == "torch" else Jax
    with pytest.raises(AssertionError, match="ran on bad input"):
        call(fw, call_args(fw, option(backend=name)))
