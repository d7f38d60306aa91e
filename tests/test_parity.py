"""Cross-framework parity: the same tensors, handed to JAX with DLPack, give the same loss and
gradients in every backend of ``torch_kl`` and of ``jax_kl``, for the loss family and every
teacher format. The bridges run the other framework's kernels: their gradients are bitwise that framework's,
the loss within float32's rounding of a sum taken in another order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from harness import (
    ALL_BACKENDS,
    BRIDGES,
    JAX_BACKENDS,
    TOLERANCE,
    TORCH_BACKENDS,
    make_inputs,
    rel_err,
    torch_tensors,
)

import jax_kl
import torch_kl

# (make_inputs keywords, options)
CASES = {
    "forward-probs-bias": (dict(n=13, h=6, v=37, bias=True, zero_frac=0.3), dict(chunk_size=5)),
    "reverse-log_probs-sum": (dict(n=11, h=5, v=29, target_format="log_probs"), dict(beta=1.0, reduction="sum")),
    "jsd-logits-transforms": (
        dict(n=12, h=6, v=33, target_format="logits"),
        dict(beta=0.3, teacher_logit_scale=1.5, teacher_softcap=3.0, teacher_temperature=2.0, logit_scale=0.7)),
    "hard-smoothing-softcap-mean": (
        dict(n=14, h=6, v=31, target_format="logits", bias=True),
        dict(weight_hard_loss=0.6, weight_soft_loss=0.5, label_smoothing=0.1, softcap=4.0, temperature=2.0,
             reduction="mean")),
    "hidden-jsd-bias": (
        dict(n=12, h=6, v=35, target_format="hidden", ht=7, teacher_bias=True, bias=True), dict(beta=0.5)),
    "hidden-bf16-3d-hard": (
        dict(n=12, h=16, v=41, target_format="hidden", ht=16, dtype="bfloat16", lead=(3, 4)),
        dict(beta=1.0, weight_hard_loss=0.5, accum_dtype="float32", chunk_size=6)),
    "topk-bin": (dict(n=13, h=6, v=39, target_format="topk_log_probs", k=5, pad_frac=0.4), dict(temperature=1.5)),
    "topk-renormalize-hard": (
        dict(n=12, h=6, v=31, target_format="topk_log_probs", k=6, pad_frac=0.3),
        dict(topk_tail="renormalize", weight_hard_loss=0.5, logit_scale=1.3)),
    "topk-drop-fp16": (
        dict(n=16, h=16, v=43, target_format="topk_log_probs", k=7, dtype="float16"), dict(topk_tail="drop")),
    "cross_entropy": (dict(n=15, h=6, v=37, bias=True), dict(fn="cross_entropy", label_smoothing=0.1, softcap=5.0)),
}


GRADS = ("x", "weight", "bias")


def _split(arrays: dict) -> tuple[dict, dict, dict]:
    """``(x, weight, bias)``, the other arrays, the static keywords (``target_format``)."""
    leaves = {k: arrays[k] for k in GRADS}
    static = {k: v for k, v in arrays.items() if isinstance(v, str)}
    return leaves, {k: v for k, v in arrays.items() if k not in leaves and k not in static}, static


def _torch_run(backend: str, arrays: dict, options: dict) -> list:
    fn = options.pop("fn", "kl_div")
    leaves, rest, static = _split(arrays)
    leaves = {k: None if a is None else a.detach().clone().requires_grad_() for k, a in leaves.items()}
    if "accum_dtype" in options:
        options["accum_dtype"] = getattr(torch, options["accum_dtype"])
    x, w, b = leaves.values()
    labels = rest.pop("labels")
    if fn == "cross_entropy":
        loss = torch_kl.fused_linear_cross_entropy(x, w, labels, bias=b, backend=backend, **options)
    else:
        loss = torch_kl.fused_linear_kl_div(x, w, rest.pop("target"), labels, bias=b, backend=backend, **rest,
                                            **static, **options)
    loss.backward()
    return [float(loss.detach())] + [None if a is None else a.grad.float().numpy() for a in leaves.values()]


def _jax_run(backend: str, arrays: dict, options: dict) -> list:
    fn = options.pop("fn", "kl_div")
    leaves, rest, static = _split(arrays)

    def f(x, w, b, rest):
        rest = dict(rest)
        labels = rest.pop("labels")
        if fn == "cross_entropy":
            return jax_kl.fused_linear_cross_entropy(x, w, labels, bias=b, backend=backend, **options)
        return jax_kl.fused_linear_kl_div(x, w, rest.pop("target"), labels, bias=b, backend=backend, **rest,
                                          **static, **options)

    loss, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(*leaves.values(), rest)
    return [float(loss)] + [None if g is None else np.asarray(g.astype(jnp.float32)) for g in grads]


def _to_jax(arrays: dict) -> dict:
    """The same memory as JAX arrays (DLPack), strings left as they are."""
    return {k: a if a is None or isinstance(a, str) else jax.dlpack.from_dlpack(a) for k, a in arrays.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_every_backend_agrees(case: str) -> None:
    shape, options = CASES[case]
    inp = make_inputs(**shape)
    tensors = torch_tensors(inp, index_dtype="int32")  # int32: JAX takes them as they are
    got = {b: _torch_run(b.split("/")[1], tensors, dict(options)) for b in TORCH_BACKENDS}
    got |= {b: _jax_run(b.split("/")[1], _to_jax(tensors), dict(options)) for b in JAX_BACKENDS}
    assert set(got) == set(ALL_BACKENDS)

    tol = TOLERANCE[inp.dtype]
    for a in TORCH_BACKENDS:
        for c in JAX_BACKENDS:
            ta, tc = got[a], got[c]
            assert abs(ta[0] - tc[0]) <= tol * max(abs(ta[0]), 1e-2), (a, c, ta[0], tc[0])
            for name, ga, gc in zip(("grad_x", "grad_weight", "grad_bias"), ta[1:], tc[1:], strict=True):
                assert (ga is None) == (gc is None), (a, c, name)
                if ga is not None:
                    assert rel_err(gc, ga) <= tol, f"{a} vs {c}: {name} {rel_err(gc, ga):.3g}"
    for bridge in BRIDGES:  # the same kernels as the other framework's backend of that name
        framework, name = bridge.split("/")
        native = f"{'jax' if framework == 'torch' else 'torch'}/{name}"
        # The native JAX call runs under jit, where the labels are traced: its program also holds the
        # guard that turns rows the eager check would refuse into NaN (a few [rows]-sized ops), so XLA
        # may add the rows' losses in another order than the bridge's checked program does.
        assert got[bridge][0] == pytest.approx(got[native][0], rel=1e-6, abs=0), (bridge, native)
        for gb, gn in zip(got[bridge][1:], got[native][1:], strict=True):
            assert (gb is None and gn is None) or np.array_equal(gb, gn), (bridge, native)
