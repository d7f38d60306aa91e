"""Bad input: every case raises the right exception in both frameworks, with the same message
naming the argument, before any kernel runs and without touching the inputs.

Also: a backend that cannot run here says why, ``N == 0`` is not an error, and NaN or inf in
the inputs come out as NaN.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from harness import Inputs, make_inputs, run
from reference import reference

import fused_kl.bridge
import jax_kl
import jax_kl.chunked
import jax_kl.kernel
import jax_kl.plain
import jax_kl.validate
import torch_kl
import torch_kl.chunked
import torch_kl.kernel
import torch_kl.plain
import torch_kl.validate

N, H, V = 4, 3, 5


def _valid() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    target = rng.random((N, V))
    return dict(
        x=rng.standard_normal((N, H)),
        weight=rng.standard_normal((V, H)),
        target=target / target.sum(-1, keepdims=True),
        labels=np.array([1, -100, 2, 3]),
        bias=rng.standard_normal(V),
    )


class Torch:
    """Builds the call in torch; dtypes are named as in SPEC.md."""

    name = "torch"
    fn = staticmethod(torch_kl.fused_linear_kl_div)

    @staticmethod
    def array(a, dtype: str) -> torch.Tensor:
        return torch.from_numpy(np.asarray(a)).to(getattr(torch, dtype))

    @staticmethod
    def dtype(name: str) -> torch.dtype:
        return getattr(torch, name)


class Jax:
    """Builds the call in JAX; a dtype JAX would narrow (float64 and int64 without x64)
    stays a NumPy array, which ``jax_kl`` accepts as it is."""

    name = "jax"
    fn = staticmethod(jax_kl.fused_linear_kl_div)

    @staticmethod
    def array(a, dtype: str):
        dt = jnp.dtype(dtype)
        if jax.dtypes.canonicalize_dtype(dt) != dt:
            return np.asarray(a, dt)
        return jnp.asarray(np.asarray(a), dt)

    @staticmethod
    def dtype(name: str):
        return jnp.dtype(name)


FRAMEWORKS = (Torch, Jax)


def _call_args(fw, overrides: Callable) -> dict:
    """The valid float32 call with int32 labels and a bias, then the case's overrides."""
    base = _valid()
    args = {k: fw.array(a, "int32" if k == "labels" else "float32") for k, a in base.items()}
    args.update(overrides(fw))
    return args


def _call(fw, args: dict):
    args = dict(args)
    return fw.fn(args.pop("x"), args.pop("weight"), args.pop("target"), args.pop("labels"), **args)


@dataclass(frozen=True)
class Bad:
    exc: type[Exception]
    arg: str  # the argument the message must name first
    overrides: Callable  # framework -> keyword overrides of the valid call
    same_message: bool = True  # False where the message names the framework's own types
    expected_got: bool = True  # the message says "expected ..., got ..."
    frameworks: tuple = FRAMEWORKS


def _shape(arg: str, shape: tuple[int, ...], dtype: str = "float32") -> Callable:
    return lambda fw: {arg: fw.array(np.zeros(shape), dtype)}


def _dtype(arg: str, dtype: str) -> Callable:
    return lambda fw: {arg: fw.array(_valid()[arg], dtype)}


def _option(**options) -> Callable:
    return lambda fw: options


def _meta(arg: str) -> Callable:
    return lambda fw: {arg: fw.array(_valid()[arg], "int32" if arg == "labels" else "float32").to("meta")}


BAD = {
    # shapes and ranks
    "x rank 1": Bad(ValueError, "x", _shape("x", (H,))),
    "x rank 4": Bad(ValueError, "x", _shape("x", (1, 1, N, H))),
    "weight rank 1": Bad(ValueError, "weight", _shape("weight", (H,))),
    "weight rank 3": Bad(ValueError, "weight", _shape("weight", (1, V, H))),
    "weight transposed [H, V]": Bad(ValueError, "weight", _shape("weight", (H, V))),
    "target V mismatch": Bad(ValueError, "target", _shape("target", (N, V + 1))),
    "target N mismatch": Bad(ValueError, "target", _shape("target", (N + 1, V))),
    "target rank 3 for 2-D x": Bad(ValueError, "target", _shape("target", (1, N, V))),
    "labels wrong length": Bad(ValueError, "labels", _shape("labels", (N + 1,), "int32")),
    "labels rank 2": Bad(ValueError, "labels", _shape("labels", (N, 1), "int32")),
    "bias wrong length": Bad(ValueError, "bias", _shape("bias", (V + 1,))),
    "bias rank 2": Bad(ValueError, "bias", _shape("bias", (1, V))),
    "empty V": Bad(
        ValueError,
        "weight",
        lambda fw: {
            "weight": fw.array(np.zeros((0, H)), "float32"),
            "target": fw.array(np.zeros((N, 0)), "float32"),
            "bias": None,
        },
    ),
    "empty H": Bad(
        ValueError,
        "x",
        lambda fw: {"x": fw.array(np.zeros((N, 0)), "float32"), "weight": fw.array(np.zeros((V, 0)), "float32")},
    ),
    # kinds and dtypes
    "integer x": Bad(TypeError, "x", _dtype("x", "int32")),
    "complex x": Bad(TypeError, "x", _dtype("x", "complex64")),
    "float64 x": Bad(TypeError, "x", _dtype("x", "float64")),
    "bool x": Bad(TypeError, "x", _dtype("x", "bool")),
    "float64 weight": Bad(TypeError, "weight", _dtype("weight", "float64")),
    "weight dtype != x dtype": Bad(TypeError, "weight", _dtype("weight", "bfloat16")),
    "integer target": Bad(TypeError, "target", _dtype("target", "int32")),
    "bool target": Bad(TypeError, "target", _dtype("target", "bool")),
    "float labels": Bad(TypeError, "labels", _dtype("labels", "float32")),
    "bool labels": Bad(TypeError, "labels", _dtype("labels", "bool")),
    "bias dtype != x dtype": Bad(TypeError, "bias", _dtype("bias", "float16")),
    "integer bias": Bad(TypeError, "bias", _dtype("bias", "int32")),
    # not arrays: the message names the framework's array type
    "x a list": Bad(TypeError, "x", lambda fw: {"x": _valid()["x"].tolist()}, same_message=False),
    "weight None": Bad(TypeError, "weight", lambda fw: {"weight": None}, same_message=False),
    "target a float": Bad(TypeError, "target", lambda fw: {"target": 0.2}, same_message=False),
    "labels a list": Bad(TypeError, "labels", lambda fw: {"labels": [1, 2, 3, 4]}, same_message=False),
    "bias a list": Bad(TypeError, "bias", lambda fw: {"bias": [0.0] * V}, same_message=False),
    # reduction
    "reduction 'none'": Bad(ValueError, "reduction", _option(reduction="none"), expected_got=False),
    "reduction unknown": Bad(ValueError, "reduction", _option(reduction="avg")),
    "reduction wrong case": Bad(ValueError, "reduction", _option(reduction="Sum")),
    # temperatures
    "temperature 0": Bad(ValueError, "temperature", _option(temperature=0.0)),
    "temperature negative": Bad(ValueError, "temperature", _option(temperature=-1.0)),
    "temperature NaN": Bad(ValueError, "temperature", _option(temperature=math.nan)),
    "temperature inf": Bad(ValueError, "temperature", _option(temperature=math.inf)),
    "temperature a string": Bad(TypeError, "temperature", _option(temperature="2.0")),
    "temperature None": Bad(TypeError, "temperature", _option(temperature=None)),
    "temperature True": Bad(TypeError, "temperature", _option(temperature=True)),
    "teacher_temperature 0": Bad(ValueError, "teacher_temperature", _option(teacher_temperature=0)),
    "teacher_temperature NaN": Bad(ValueError, "teacher_temperature", _option(teacher_temperature=math.nan)),
    "teacher_temperature -inf": Bad(ValueError, "teacher_temperature", _option(teacher_temperature=-math.inf)),
    "teacher_temperature a string": Bad(TypeError, "teacher_temperature", _option(teacher_temperature="1")),
    # eps
    "eps 0": Bad(ValueError, "eps", _option(eps=0.0)),
    "eps 1": Bad(ValueError, "eps", _option(eps=1.0)),
    "eps negative": Bad(ValueError, "eps", _option(eps=-1e-10)),
    "eps NaN": Bad(ValueError, "eps", _option(eps=math.nan)),
    "eps a string": Bad(TypeError, "eps", _option(eps="1e-10")),
    # target_format, backend
    "target_format unknown": Bad(ValueError, "target_format", _option(target_format="probabilities")),
    "target_format None": Bad(ValueError, "target_format", _option(target_format=None)),
    # the message lists the framework's own backends
    "backend unknown": Bad(ValueError, "backend", _option(backend="cuda"), same_message=False),
    "backend of the other framework": Bad(
        ValueError, "backend", lambda fw: {"backend": "pallas" if fw is Torch else "torch"}, same_message=False
    ),
    # chunk_size
    "chunk_size 0": Bad(ValueError, "chunk_size", _option(chunk_size=0)),
    "chunk_size -1": Bad(ValueError, "chunk_size", _option(chunk_size=-1)),
    "chunk_size 2.5": Bad(TypeError, "chunk_size", _option(chunk_size=2.5)),
    "chunk_size True": Bad(TypeError, "chunk_size", _option(chunk_size=True)),
    "chunk_size a string": Bad(TypeError, "chunk_size", _option(chunk_size="4")),
    # ignore_index
    "ignore_index a float": Bad(TypeError, "ignore_index", _option(ignore_index=-100.0)),
    "ignore_index None": Bad(TypeError, "ignore_index", _option(ignore_index=None)),
    "ignore_index beyond 64 bits": Bad(ValueError, "ignore_index", _option(ignore_index=2**70)),
    # accum_dtype
    "accum_dtype int32": Bad(TypeError, "accum_dtype", lambda fw: {"accum_dtype": fw.dtype("int32")}),
    "accum_dtype float64": Bad(TypeError, "accum_dtype", lambda fw: {"accum_dtype": fw.dtype("float64")}),
    "accum_dtype not a dtype": Bad(TypeError, "accum_dtype", _option(accum_dtype="banana"), same_message=False),
    # devices (torch: the meta device stands for another device)
    "weight on another device": Bad(ValueError, "weight", _meta("weight"), frameworks=(Torch,)),
    "target on another device": Bad(ValueError, "target", _meta("target"), frameworks=(Torch,)),
    "labels on another device": Bad(ValueError, "labels", _meta("labels"), frameworks=(Torch,)),
    "bias on another device": Bad(ValueError, "bias", _meta("bias"), frameworks=(Torch,)),
}
assert len(BAD) >= 20


def _snapshot(value):
    """A copy to compare with after the call (None for what cannot be read back: meta tensors)."""
    if isinstance(value, torch.Tensor):
        return None if value.is_meta else value.detach().clone()
    if isinstance(value, (jax.Array, np.ndarray)):
        return np.array(value, copy=True)
    return copy.deepcopy(value)


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
    """Make every compute stage raise: a bad input must be refused before any of them runs."""

    def ran(*args, **kwargs):
        raise AssertionError("a kernel or GEMM stage ran on bad input")

    for module in (torch_kl.plain, torch_kl.kernel, jax_kl.plain, jax_kl.kernel):
        monkeypatch.setattr(module, "kl_rows", ran)
    for module in (torch_kl.chunked, jax_kl.chunked):
        monkeypatch.setattr(module, "forward", ran)
    for name in ("torch_through_pallas", "jax_through_triton"):
        monkeypatch.setattr(fused_kl.bridge, name, ran)


@pytest.mark.usefixtures("no_kernels")
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case: str) -> None:
    bad = BAD[case]
    messages = {}
    for fw in bad.frameworks:
        args = _call_args(fw, bad.overrides)
        before = {k: _snapshot(v) for k, v in args.items()}
        with pytest.raises(bad.exc) as info:
            _call(fw, args)
        assert type(info.value) is bad.exc, f"{fw.name}: {type(info.value).__name__}: {info.value}"
        message = str(info.value)
        assert message.startswith(f"{bad.arg}: "), f"{fw.name}: {message!r} does not name {bad.arg}"
        if bad.expected_got:
            assert "expected" in message and ", got " in message, f"{fw.name}: {message!r}"
        for k, v in before.items():
            assert _unchanged(v, args[k]), f"{fw.name}: {k} was modified"
        messages[fw.name] = message
        if fw is Jax:  # the same error at trace time under jax.jit, with the arrays traced
            traced = {k: v for k, v in args.items() if isinstance(v, jax.Array)}
            rest = {k: v for k, v in args.items() if k not in traced}
            with pytest.raises(bad.exc) as info:
                jax.jit(lambda arrays, rest=rest: _call(Jax, {**rest, **arrays}))(traced)
            assert str(info.value) == message
    if bad.same_message and len(messages) == 2:
        assert messages["torch"] == messages["jax"]


@pytest.mark.usefixtures("no_kernels")
@pytest.mark.parametrize("backend", ["torch/torch", "torch/triton", "torch/jax", "jax/xla", "jax/pallas", "jax/triton"])
def test_no_kernels_stops_a_valid_call(backend: str) -> None:
    """The ``no_kernels`` fixture does catch every backend's compute stage."""
    framework, name = backend.split("/")
    fw = Torch if framework == "torch" else Jax
    with pytest.raises(AssertionError, match="ran on bad input"):
        _call(fw, _call_args(fw, _option(backend=name)))


def test_reduction_none_says_why_and_what_instead() -> None:
    with pytest.raises(ValueError) as info:
        _call(Torch, _call_args(Torch, _option(reduction="none")))
    message = str(info.value)
    assert "forward pass" in message and "scalar" in message  # why
    assert "'sum'" in message  # what to use instead


def test_backend_lists_the_framework_choices() -> None:
    for fw, choices in ((Torch, torch_kl.validate.BACKENDS), (Jax, jax_kl.validate.BACKENDS)):
        with pytest.raises(ValueError) as info:
            _call(fw, _call_args(fw, _option(backend="cuda")))
        assert all(repr(c) in str(info.value) for c in choices)


@pytest.mark.usefixtures("no_kernels")
def test_jax_ignore_index_beyond_int32_is_refused_early() -> None:
    # JAX's labels are int32 (without jax_enable_x64): the comparison would overflow inside
    # the jitted program. torch's int64 labels take it.
    with pytest.raises(ValueError, match=r"^ignore_index: expected an int that fits in 32 bits"):
        _call(Jax, _call_args(Jax, _option(ignore_index=2**40)))
    # The torch -> JAX bridge hands the labels over as int32: refused at validation too.
    with pytest.raises(ValueError, match=r"^ignore_index: expected an int that fits in 32 bits"):
        _call(Torch, _call_args(Torch, _option(ignore_index=2**40, backend="jax")))


@pytest.mark.parametrize("fw", FRAMEWORKS, ids=lambda fw: fw.name)
def test_numpy_scalars_are_numbers(fw) -> None:
    """A NumPy scalar is a number: accepted for every numeric option, same loss as Python's."""
    plain = dict(temperature=2.0, teacher_temperature=0.5, eps=1e-6, chunk_size=3, ignore_index=-100)
    numpy = dict(
        temperature=np.float32(2.0),
        teacher_temperature=np.float64(0.5),
        eps=np.float32(1e-6),
        chunk_size=np.int64(3),
        ignore_index=np.int32(-100),
    )
    want = float(_call(fw, _call_args(fw, _option(target_format="logits", **plain))))
    got = float(_call(fw, _call_args(fw, _option(target_format="logits", **numpy))))
    assert got == want


# ---------------------------------------------------------------- backends not available here


def test_torch_triton_on_cpu_without_the_interpreter(monkeypatch: pytest.MonkeyPatch, no_kernels) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError) as info:
        torch_kl.validate.resolve_backend("triton", torch.device("cpu"))
    message = str(info.value)
    assert message.startswith("backend: 'triton' is not available here:")
    assert "CUDA" in message and "cpu" in message and "TRITON_INTERPRET=1" in message  # why, and the way out
    # The same through the public function, before any kernel; "auto" falls back to torch.
    args = _call_args(Torch, _option(backend="triton"))
    with pytest.raises(ValueError, match=r"^backend: 'triton' is not available here"):
        _call(Torch, args)
    assert torch_kl.validate.resolve_backend("auto", torch.device("cpu")) == "torch"


def test_jax_triton_on_cpu_without_the_interpreter(monkeypatch: pytest.MonkeyPatch, no_kernels) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError) as info:
        jax_kl.validate.resolve_backend("triton")
    message = str(info.value)
    assert message.startswith("backend: 'triton' is not available here:")
    assert "GPU" in message and "TRITON_INTERPRET=1" in message
    with pytest.raises(ValueError, match=r"^backend: 'triton' is not available here"):
        _call(Jax, _call_args(Jax, _option(backend="triton")))
    assert jax_kl.validate.resolve_backend("auto") == "xla"


# ---------------------------------------------------------------- N == 0 is not an error


@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)], ids=str)
@pytest.mark.parametrize("fw", FRAMEWORKS, ids=lambda fw: fw.name)
def test_empty_batch_is_not_an_error(fw, lead: tuple[int, ...]) -> None:
    x = np.zeros((*lead, H), np.float32)
    w = np.random.default_rng(0).standard_normal((V, H)).astype(np.float32)
    t = np.zeros((*lead, V), np.float32)
    labels = np.zeros(lead, np.int32)
    if fw is Torch:
        xt, wt = torch.from_numpy(x).requires_grad_(), torch.from_numpy(w).requires_grad_()
        loss = torch_kl.fused_linear_kl_div(xt, wt, torch.from_numpy(t), torch.from_numpy(labels))
        loss.backward()
        loss, gx, gw = float(loss), xt.grad.numpy(), wt.grad.numpy()
    else:
        f = lambda x, w: jax_kl.fused_linear_kl_div(x, w, jnp.asarray(t), jnp.asarray(labels))
        loss, (gx, gw) = jax.value_and_grad(f, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
        loss, gx, gw = float(loss), np.asarray(gx), np.asarray(gw)
    assert loss == 0.0
    assert gx.shape == x.shape
    assert gw.shape == w.shape and not np.any(gw)


# ---------------------------------------------------------------- inputs never modified


@pytest.mark.parametrize("backend", ["torch/torch", "torch/triton", "torch/jax"])
def test_torch_inputs_not_modified(backend: str) -> None:
    """A valid call with gradients leaves its (non-contiguous) inputs as they were."""
    inp = make_inputs(9, 5, 13, bias=True)
    x = torch.from_numpy(np.ascontiguousarray(inp.x.T)).t().requires_grad_()  # non-contiguous
    w = torch.from_numpy(inp.weight).requires_grad_()
    b = torch.from_numpy(inp.bias).requires_grad_()
    t = torch.from_numpy(np.asfortranarray(inp.target))
    lab = torch.from_numpy(inp.labels)
    before = [a.detach().clone() for a in (x, w, b, t, lab)]
    loss = torch_kl.fused_linear_kl_div(x, w, t, lab, bias=b, chunk_size=4, backend=backend.split("/")[1])
    loss.backward()
    for a, old in zip((x, w, b, t, lab), before, strict=True):
        assert torch.equal(a.detach(), old)


@pytest.mark.parametrize("backend", ["jax/xla", "jax/pallas", "jax/triton"])
def test_jax_numpy_inputs_not_modified(backend: str) -> None:
    """NumPy arrays handed to ``jax_kl`` come back as they were."""
    inp = make_inputs(9, 5, 13, bias=True)
    arrays = [inp.x, inp.weight, inp.target, inp.labels.astype(np.int32), inp.bias]
    before = [a.copy() for a in arrays]
    x, w, t, lab, b = arrays
    f = lambda x, w, b: jax_kl.fused_linear_kl_div(x, w, t, lab, bias=b, chunk_size=4, backend=backend.split("/")[1])
    jax.grad(f, argnums=(0, 1, 2))(x, w, b)
    for a, old in zip(arrays, before, strict=True):
        assert np.array_equal(a, old)


# ---------------------------------------------------------------- NaN and inf propagate


def _poisoned(where: str, value: float, target_format: str) -> Inputs:
    inp = make_inputs(6, 4, 11, target_format=target_format, ignore_frac=None)
    getattr(inp, where)[(1, 2)] = value  # a kept row's entry
    return inp


@pytest.mark.parametrize("backend", ["torch/torch", "torch/triton", "jax/xla", "jax/pallas"])
@pytest.mark.parametrize(
    ("where", "value", "target_format"),
    [
        ("x", math.nan, "probs"),
        ("x", math.inf, "probs"),
        ("weight", math.nan, "log_probs"),
        ("weight", -math.inf, "logits"),
        ("target", math.nan, "probs"),
        ("target", math.nan, "log_probs"),
        ("target", math.nan, "logits"),
    ],
)
def test_nan_and_inf_propagate(backend: str, where: str, value: float, target_format: str) -> None:
    inp = _poisoned(where, value, target_format)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = reference(inp.x, inp.weight, inp.target, target_format=target_format)
    assert math.isnan(ref.loss)  # what the unfused loss gives
    out = run(backend, inp, target_format=target_format, chunk_size=4)
    assert math.isnan(out.loss), f"loss {out.loss}: NaN was clamped away"
    assert np.isnan(out.grad_weight).any(), "grad_weight: NaN was clamped away"
