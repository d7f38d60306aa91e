"""The bad inputs of ``test_validation``: a valid call of either framework, and per case what
to change in it and what the refusal must say (docs/contract.md)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_kl
import torch_kl

N, H, V, HT, K = 4, 3, 5, 6, 3


def _valid() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    target = rng.random((N, V))
    return dict(
        x=rng.standard_normal((N, H)),
        weight=rng.standard_normal((V, H)),
        target=target / target.sum(-1, keepdims=True),
        labels=np.array([1, -100, 2, 3]),
        bias=rng.standard_normal(V),
        hidden=rng.standard_normal((N, HT)),
        teacher_weight=rng.standard_normal((V, HT)),
        teacher_bias=rng.standard_normal(V),
        topk=np.log(np.full((N, K), 0.2)),
        target_indices=np.array([[0, 1, 2], [4, 3, 2], [1, 3, 0], [2, 4, 1]]),
    )


INTEGER = ("labels", "target_indices")


class Torch:
    """Builds the call in torch; dtypes are named as in docs/contract.md."""

    name = "torch"
    fn = staticmethod(torch_kl.fused_linear_kl_div)
    ce = staticmethod(torch_kl.fused_linear_cross_entropy)

    @staticmethod
    def array(a, dtype: str) -> torch.Tensor:
        return torch.from_numpy(np.asarray(a)).to(getattr(torch, dtype))

    @staticmethod
    def dtype(name: str) -> torch.dtype:
        return getattr(torch, name)


class Jax:
    """Builds the call in JAX; a dtype JAX would narrow (float64 and int64 without x64) stays a
    NumPy array, which ``jax_kl`` accepts as it is."""

    name = "jax"
    fn = staticmethod(jax_kl.fused_linear_kl_div)
    ce = staticmethod(jax_kl.fused_linear_cross_entropy)

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


def _array(fw, name: str, dtype: str | None = None):
    """A valid array of ``_valid()`` (int32 for integers, else float32 unless ``dtype``)."""
    return fw.array(_valid()[name], dtype or ("int32" if name in INTEGER else "float32"))


def call_args(fw, overrides: Callable) -> dict:
    """The valid float32 call (int32 labels, a bias, a dense teacher), then the case's overrides."""
    args = {k: _array(fw, k) for k in ("x", "weight", "target", "labels", "bias")}
    args.update(overrides(fw))
    return args


def call(fw, args: dict, fn: str = "kl_div"):
    args = dict(args)
    if fn == "cross_entropy":
        args.pop("target", None)
        return fw.ce(args.pop("x"), args.pop("weight"), args.pop("labels"), **args)
    return fw.fn(args.pop("x"), args.pop("weight"), args.pop("target"), args.pop("labels"), **args)


@dataclass(frozen=True)
class Bad:
    exc: type[Exception]
    arg: str  # the argument the message must name first
    overrides: Callable  # framework -> keyword overrides of the valid call
    same_message: bool = True  # False where the message names the framework's own types
    expected_got: bool = True  # the message says "expected ..., got ..."
    frameworks: tuple = FRAMEWORKS
    contains: tuple[str, ...] = ()  # more the message must say
    on_values: bool = False  # a check of values: eager only (under jit: NaN, see test_validation_values)
    fn: str = "kl_div"


def _shape(arg: str, shape: tuple[int, ...], dtype: str = "float32") -> Callable:
    return lambda fw: {arg: fw.array(np.zeros(shape), dtype)}


def _dtype(arg: str, dtype: str) -> Callable:
    return lambda fw: {arg: _array(fw, arg, dtype)}


def option(**options) -> Callable:
    return lambda fw: options


def _meta(arg: str, teacher: Callable = lambda fw: {}) -> Callable:
    return lambda fw: {**teacher(fw), arg: call_args(fw, teacher)[arg].to("meta")}


def _hidden(**over) -> Callable:
    """The valid call with a teacher head, then ``over`` (values, or ``fw -> value``)."""
    return lambda fw: {"target_format": "hidden", "target": _array(fw, "hidden"),
                       "teacher_weight": _array(fw, "teacher_weight")} | {
        k: v(fw) if callable(v) else v for k, v in over.items()}


def _topk(**over) -> Callable:
    """The valid call with a top-k teacher, then ``over`` (values, or ``fw -> value``)."""
    return lambda fw: {"target_format": "topk_log_probs", "target": _array(fw, "topk"),
                       "target_indices": _array(fw, "target_indices")} | {
        k: v(fw) if callable(v) else v for k, v in over.items()}


def _indices(rows) -> Callable:
    return lambda fw: fw.array(np.array(rows), "int32")


def _zeros(*shape: int, dtype: str = "float32") -> Callable:
    return lambda fw: fw.array(np.zeros(shape), dtype)


BAD = {
    # ---- shapes and ranks
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
    "empty V": Bad(ValueError, "weight", lambda fw: {"weight": _zeros(0, H)(fw), "target": _zeros(N, 0)(fw),
                                                     "bias": None}),
    "empty H": Bad(ValueError, "x", lambda fw: {"x": _zeros(N, 0)(fw), "weight": _zeros(V, 0)(fw)}),
    # ---- kinds and dtypes
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
    # ---- not arrays (the message names the framework's array type)
    "x a list": Bad(TypeError, "x", lambda fw: {"x": _valid()["x"].tolist()}, same_message=False),
    "weight None": Bad(TypeError, "weight", lambda fw: {"weight": None}, same_message=False),
    "target a float": Bad(TypeError, "target", lambda fw: {"target": 0.2}, same_message=False),
    "labels a list": Bad(TypeError, "labels", lambda fw: {"labels": [1, 2, 3, 4]}, same_message=False),
    "bias a list": Bad(TypeError, "bias", lambda fw: {"bias": [0.0] * V}, same_message=False),
    # ---- options
    "reduction 'none'": Bad(ValueError, "reduction", option(reduction="none"), expected_got=False),
    "return_row_losses a string": Bad(TypeError, "return_row_losses", option(return_row_losses="yes")),
    "mesh not a Mesh": Bad(TypeError, "mesh", option(mesh="cpu"), frameworks=(Jax,)),
    "numpy object labels": Bad(
        TypeError, "labels", lambda fw: {"labels": np.asarray(_valid()["labels"], object)}, frameworks=(Jax,)
    ),
    "numpy string labels": Bad(
        TypeError, "labels", lambda fw: {"labels": _valid()["labels"].astype(str)}, frameworks=(Jax,)
    ),
    "reduction unknown": Bad(ValueError, "reduction", option(reduction="avg")),
    "reduction wrong case": Bad(ValueError, "reduction", option(reduction="Sum")),
    "temperature 0": Bad(ValueError, "temperature", option(temperature=0.0)),
    "temperature negative": Bad(ValueError, "temperature", option(temperature=-1.0)),
    "temperature NaN": Bad(ValueError, "temperature", option(temperature=math.nan)),
    "temperature inf": Bad(ValueError, "temperature", option(temperature=math.inf)),
    "temperature a string": Bad(TypeError, "temperature", option(temperature="2.0")),
    "temperature None": Bad(TypeError, "temperature", option(temperature=None)),
    "temperature True": Bad(TypeError, "temperature", option(temperature=True)),
    "teacher_temperature 0": Bad(ValueError, "teacher_temperature", option(teacher_temperature=0)),
    "teacher_temperature NaN": Bad(ValueError, "teacher_temperature", option(teacher_temperature=math.nan)),
    "teacher_temperature -inf": Bad(ValueError, "teacher_temperature", option(teacher_temperature=-math.inf)),
    "teacher_temperature a string": Bad(TypeError, "teacher_temperature", option(teacher_temperature="1")),
    "eps 0": Bad(ValueError, "eps", option(eps=0.0)),
    "eps 1": Bad(ValueError, "eps", option(eps=1.0)),
    "eps negative": Bad(ValueError, "eps", option(eps=-1e-10)),
    "eps NaN": Bad(ValueError, "eps", option(eps=math.nan)),
    "eps a string": Bad(TypeError, "eps", option(eps="1e-10")),
    "target_format unknown": Bad(ValueError, "target_format", option(target_format="probabilities")),
    "target_format None": Bad(ValueError, "target_format", option(target_format=None)),
    "backend unknown": Bad(ValueError, "backend", option(backend="cuda"), same_message=False),
    "backend of the other framework": Bad(
        ValueError, "backend", lambda fw: {"backend": "xla" if fw is Torch else "torch"}, same_message=False),
    "chunk_size 0": Bad(ValueError, "chunk_size", option(chunk_size=0)),
    "chunk_size -1": Bad(ValueError, "chunk_size", option(chunk_size=-1)),
    "chunk_size 2.5": Bad(TypeError, "chunk_size", option(chunk_size=2.5)),
    "chunk_size True": Bad(TypeError, "chunk_size", option(chunk_size=True)),
    "chunk_size a string": Bad(TypeError, "chunk_size", option(chunk_size="4")),
    "ignore_index a float": Bad(TypeError, "ignore_index", option(ignore_index=-100.0)),
    "ignore_index None": Bad(TypeError, "ignore_index", option(ignore_index=None)),
    "ignore_index beyond 64 bits": Bad(ValueError, "ignore_index", option(ignore_index=2**70)),
    # the call's labels are int32: 2**32 would wrap to 0 and ignore every row labelled 0
    "ignore_index beyond int32 labels": Bad(ValueError, "ignore_index", option(ignore_index=2**32),
                                            contains=("the labels are int32",)),
    "accum_dtype int32": Bad(TypeError, "accum_dtype", lambda fw: {"accum_dtype": fw.dtype("int32")}),
    "accum_dtype float64": Bad(TypeError, "accum_dtype", lambda fw: {"accum_dtype": fw.dtype("float64")}),
    "accum_dtype not a dtype": Bad(TypeError, "accum_dtype", option(accum_dtype="banana"), same_message=False),
    # ---- devices (torch: the meta device stands for another device)
    "x on the meta device": Bad(ValueError, "x", _meta("x"), frameworks=(Torch,), contains=("meta device",)),
    "weight on another device": Bad(ValueError, "weight", _meta("weight"), frameworks=(Torch,)),
    "target on another device": Bad(ValueError, "target", _meta("target"), frameworks=(Torch,)),
    "labels on another device": Bad(ValueError, "labels", _meta("labels"), frameworks=(Torch,)),
    "bias on another device": Bad(ValueError, "bias", _meta("bias"), frameworks=(Torch,)),
    # ---- the divergence, the weights, the transforms
    **{f"beta {b}": Bad(ValueError, "beta", option(beta=b)) for b in (-0.1, 1.5, math.nan, math.inf)},
    "beta a string": Bad(TypeError, "beta", option(beta="0.5")),
    "weight_hard_loss negative": Bad(ValueError, "weight_hard_loss", option(weight_hard_loss=-0.5)),
    "weight_hard_loss inf": Bad(ValueError, "weight_hard_loss", option(weight_hard_loss=math.inf)),
    "weight_hard_loss True": Bad(TypeError, "weight_hard_loss", option(weight_hard_loss=True)),
    "weight_soft_loss negative": Bad(ValueError, "weight_soft_loss", option(weight_soft_loss=-1.0)),
    "weight_soft_loss NaN": Bad(ValueError, "weight_soft_loss", option(weight_soft_loss=math.nan)),
    **{f"label_smoothing {s}": Bad(ValueError, "label_smoothing", option(label_smoothing=s, weight_hard_loss=1.0))
       for s in (-0.1, 1.0, math.nan)},
    **{f"{name} {c}": Bad(ValueError, name, option(**{name: c}))
       for name in ("logit_scale", "softcap", "teacher_logit_scale", "teacher_softcap")
       for c in (0.0, -2.0, math.nan, math.inf)},
    "logit_scale a string": Bad(TypeError, "logit_scale", option(logit_scale="2")),
    "softcap True": Bad(TypeError, "softcap", option(softcap=True)),
    # ---- a teacher head
    "hidden without teacher_weight": Bad(ValueError, "teacher_weight", _hidden(teacher_weight=None),
                                         expected_got=False),
    "teacher_weight with padded rows": Bad(ValueError, "teacher_weight", _hidden(teacher_weight=_zeros(V + 3, HT)),
                                           contains=(f"teacher_weight[:{V}]",)),
    "teacher_weight wrong Ht": Bad(ValueError, "teacher_weight", _hidden(teacher_weight=_zeros(V, HT + 1))),
    "teacher_weight rank 1": Bad(ValueError, "teacher_weight", _hidden(teacher_weight=_zeros(V))),
    "teacher_weight dtype != target": Bad(TypeError, "teacher_weight",
                                          _hidden(teacher_weight=lambda fw: _array(fw, "teacher_weight", "bfloat16"))),
    "teacher_weight a list": Bad(TypeError, "teacher_weight", _hidden(teacher_weight=[[0.0] * HT] * V),
                                 same_message=False),
    "teacher_bias wrong length": Bad(ValueError, "teacher_bias", _hidden(teacher_bias=_zeros(V + 1))),
    "teacher_bias dtype": Bad(TypeError, "teacher_bias",
                              _hidden(teacher_bias=lambda fw: _array(fw, "teacher_bias", "float16"))),
    "hidden target rank 1": Bad(ValueError, "target", _hidden(target=_zeros(N))),
    "hidden target N mismatch": Bad(ValueError, "target", _hidden(target=_zeros(N + 1, HT))),
    "teacher_weight with probs": Bad(ValueError, "teacher_weight",
                                     lambda fw: {"teacher_weight": _array(fw, "teacher_weight")}, expected_got=False),
    "teacher_bias with logits": Bad(ValueError, "teacher_bias", lambda fw: {
        "target_format": "logits", "teacher_bias": _array(fw, "teacher_bias")}, expected_got=False),
    "teacher_weight on another device": Bad(ValueError, "teacher_weight", _meta("teacher_weight", _hidden()),
                                            frameworks=(Torch,)),
    "teacher_bias on another device": Bad(ValueError, "teacher_bias", _meta("teacher_bias", _hidden(
        teacher_bias=lambda fw: _array(fw, "teacher_bias"))), frameworks=(Torch,)),
    # ---- top-k log-probabilities
    "topk_tail unknown": Bad(ValueError, "topk_tail", _topk(topk_tail="truncate")),
    "topk_tail None": Bad(ValueError, "topk_tail", option(topk_tail=None)),
    "topk with beta 0.5": Bad(ValueError, "beta", _topk(beta=0.5), expected_got=False),
    "topk with beta 1": Bad(ValueError, "beta", _topk(beta=1.0), expected_got=False),
    "topk with teacher_temperature": Bad(ValueError, "teacher_temperature", _topk(teacher_temperature=2.0),
                                         expected_got=False),
    "topk without target_indices": Bad(ValueError, "target_indices", _topk(target_indices=None), expected_got=False),
    "target_indices with probs": Bad(ValueError, "target_indices",
                                     lambda fw: {"target_indices": _array(fw, "target_indices")}, expected_got=False),
    "target_indices wrong k": Bad(ValueError, "target_indices",
                                  _topk(target_indices=_zeros(N, K + 1, dtype="int32"))),
    "target_indices float": Bad(TypeError, "target_indices",
                                _topk(target_indices=lambda fw: _array(fw, "target_indices", "float32"))),
    "topk k > V": Bad(ValueError, "target", _topk(target=_zeros(N, V + 1),
                                                  target_indices=_indices([list(range(V + 1))] * N))),
    "topk target rank 1": Bad(ValueError, "target", _topk(target=_zeros(N))),
    "target_indices on another device": Bad(ValueError, "target_indices", _meta("target_indices", _topk()),
                                            frameworks=(Torch,)),
    "target_indices out of range": Bad(ValueError, "target_indices", _topk(target_indices=_indices(
        [[0, 1, 2], [4, 3, 2], [1, 3, V], [2, 4, 1]])), on_values=True, contains=(str(V),)),
    "target_indices negative": Bad(ValueError, "target_indices", _topk(target_indices=_indices(
        [[0, 1, 2], [4, 3, 2], [1, -3, 0], [2, 4, 1]])), on_values=True, contains=("-3",)),
    "target_indices duplicated": Bad(ValueError, "target_indices", _topk(target_indices=_indices(
        [[0, 1, 2], [4, 3, 2], [1, 3, 1], [2, 4, 1]])), on_values=True, contains=("distinct",)),
    # ---- the hard term
    "hard term without labels": Bad(ValueError, "labels", option(weight_hard_loss=0.5, labels=None),
                                    expected_got=False, contains=("weight_hard_loss > 0",)),
    "hard term, kept label V": Bad(ValueError, "labels", lambda fw: {
        "weight_hard_loss": 0.5, "labels": fw.array(np.array([1, -100, V, 3]), "int32")}, on_values=True,
        contains=("weight_hard_loss > 0",)),
    "hard term, kept label -1": Bad(ValueError, "labels", lambda fw: {
        "weight_hard_loss": 0.5, "labels": fw.array(np.array([1, -100, -1, 3]), "int32")}, on_values=True),
    # both value checks in one call (one transfer in torch): each still names its argument
    "top-k and hard term, kept label V": Bad(ValueError, "labels", _topk(
        weight_hard_loss=0.5, labels=_indices([1, -100, V, 3])), on_values=True),
    "top-k and hard term, duplicated index": Bad(ValueError, "target_indices", _topk(
        weight_hard_loss=0.5, labels=_indices([1, -100, 2, 3]), target_indices=_indices(
            [[0, 1, 2], [4, 3, 2], [1, 3, 1], [2, 4, 1]])), on_values=True, contains=("distinct",)),
    "cross_entropy without labels": Bad(ValueError, "labels", option(labels=None), expected_got=False,
                                        fn="cross_entropy", contains=("the cross-entropy's",)),
    "cross_entropy kept label V": Bad(ValueError, "labels", lambda fw: {
        "labels": fw.array(np.array([V, -100, 2, 3]), "int32")}, on_values=True, fn="cross_entropy",
        contains=("the cross-entropy's",)),
    "cross_entropy label_smoothing 1": Bad(ValueError, "label_smoothing", option(label_smoothing=1.0),
                                           fn="cross_entropy"),
    "cross_entropy softcap 0": Bad(ValueError, "softcap", option(softcap=0.0), fn="cross_entropy"),
    "cross_entropy reduction 'none'": Bad(ValueError, "reduction", option(reduction="none"), expected_got=False,
                                          fn="cross_entropy"),
    # ---- several devices (the bridges' refusal of a real group or mesh: test_validation_values)
    "batch_group not a process group": Bad(ValueError, "batch_group", option(batch_group=object()),
                                           expected_got=False, frameworks=(Torch,)),
    "batch_axis outside shard_map": Bad(ValueError, "batch_axis", option(batch_axis="b"), expected_got=False,
                                        frameworks=(Jax,)),
}
