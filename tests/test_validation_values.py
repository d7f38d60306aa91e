"""Checks that depend on values or on the machine: labels and top-k indices under ``jax.jit``
(NaN, not an error) and in narrower integer dtypes (refused where they cannot hold
``ignore_index``), teachers of the wrong sign, the bridges refusing a real group or mesh, two
names of one backend, backends not available here, ``N == 0``, NaN and inf propagating, NumPy
scalars as numbers."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from harness import ALL_BACKENDS, JAX_BACKENDS, jax_arrays, make_inputs, run, torch_tensors
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_kl
import jax_kl.backends
import torch_kl
import torch_kl.backends
from fused_kl.reference import reference


def _jax_arrays(inp) -> dict:
    """The arrays of a call (``target_format`` is left out: it is static)."""
    return {k: v for k, v in jax_arrays(inp).items() if not isinstance(v, str)}


def _call_jax(arrays: dict, **options):
    a = dict(arrays)
    return jax_kl.fused_linear_kl_div(a.pop("x"), a.pop("weight"), a.pop("target"), a.pop("labels"), **a, **options)


@pytest.mark.parametrize("backend", [b.split("/")[1] for b in JAX_BACKENDS])
@pytest.mark.parametrize("bad", ["label 11", "index -1", "index 11"])
def test_jit_bad_label_or_index_makes_the_loss_nan(backend: str, bad: str) -> None:
    """Under ``jax.jit`` the values are not known: a kept label outside ``[0, V)`` (hard term) or
    a top-k index outside it makes the loss NaN instead of an error (eager: the error)."""
    inp = make_inputs(6, 4, 11, target_format="topk_log_probs", k=3, ignore_frac=0.0)
    arrays = _jax_arrays(inp)
    options = dict(weight_hard_loss=0.5, backend=backend, target_format=inp.target_format)
    assert np.isfinite(float(jax.jit(lambda a: _call_jax(a, **options))(arrays)))
    what, value = bad.split()
    if what == "label":
        arrays["labels"] = arrays["labels"].at[2].set(int(value))
    else:
        arrays["target_indices"] = arrays["target_indices"].at[1, 0].set(int(value))
    with pytest.raises(ValueError, match=f"^{'labels' if what == 'label' else 'target_indices'}: "):
        _call_jax(arrays, **options)
    assert math.isnan(float(jax.jit(lambda a: _call_jax(a, **options))(arrays)))


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_labels_outside_the_vocabulary_are_fine_as_a_mask(framework: str) -> None:
    """Without the hard term labels are only a mask: any value is accepted. With it, a row whose
    label is ``ignore_index`` is ignored even where that lies outside ``[0, V)``."""
    inp = make_inputs(6, 4, 11)
    inp.labels[:] = [50, -7, 3, 11, 99, -1]  # nothing ignored
    backend = "torch/torch" if framework == "torch" else "jax/xla"
    got = run(backend, inp).loss
    assert got == pytest.approx(reference(inp.x, inp.weight, inp.target).loss, rel=2e-5)
    inp.labels[:] = [5, 50, 7, 3, 50, 10]
    got = run(backend, inp, weight_hard_loss=1.0, ignore_index=50).loss
    assert got == pytest.approx(reference(inp.x, inp.weight, inp.target, inp.labels, weight_hard_loss=1.0,
                                          ignore_index=50).loss, rel=2e-5)


@pytest.mark.parametrize("backend", ["torch/torch", "torch/triton", "jax/xla"])
@pytest.mark.parametrize("dtype", ["int8", "int16", "uint8"])
def test_narrower_integer_labels_and_indices_are_widened(backend: str, dtype: str) -> None:
    """Labels and top-k indices of a narrower integer dtype give the loss int32 ones give (torch's
    gathers refuse them), ignored rows included (the callers' arrays are not modified)."""
    inp = make_inputs(8, 4, 11, target_format="topk_log_probs", k=3, ignore_frac=0.0)
    inp.labels[:2] = 100  # ignored, and outside the vocabulary
    framework, name = backend.split("/")
    options = dict(weight_hard_loss=0.5, ignore_index=100, backend=name, target_format=inp.target_format)

    def loss(index_dtype: str) -> float:
        if framework == "torch":
            a = torch_tensors(inp, index_dtype=index_dtype)
            a.pop("bias"), a.pop("target_format")
            given = {k: a[k].clone() for k in ("labels", "target_indices")}
            value = float(torch_kl.fused_linear_kl_div(a.pop("x"), a.pop("weight"), a.pop("target"), **a, **options))
            assert all(torch.equal(a[k], given[k]) and a[k].dtype == given[k].dtype for k in given)
            return value
        a = _jax_arrays(inp)
        a["labels"], a["target_indices"] = (a[k].astype(index_dtype) for k in ("labels", "target_indices"))
        a.pop("bias")
        return float(_call_jax(a, **options))

    assert loss(dtype) == pytest.approx(loss("int32"), rel=1e-6)


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize(("dtype", "ignore_index"), [("uint8", -100), ("int8", 200), ("int16", 40000), ("uint16", -1)])
def test_labels_that_cannot_hold_ignore_index_are_refused(framework: str, dtype: str, ignore_index: int) -> None:
    """A label dtype in which ``ignore_index`` cannot be represented could never mark a row
    ignored (uint8 cannot hold -100): refused, naming ``labels``, mask or hard term alike."""
    inp = make_inputs(6, 4, 11)
    inp.labels[:] = 3
    arrays = torch_tensors(inp) if framework == "torch" else _jax_arrays(inp)
    labels = arrays["labels"].to(getattr(torch, dtype)) if framework == "torch" else arrays["labels"].astype(dtype)
    fn = torch_kl.fused_linear_kl_div if framework == "torch" else jax_kl.fused_linear_kl_div
    for hard in (0.0, 0.5):
        with pytest.raises(TypeError, match=rf"^labels: {dtype} cannot hold ignore_index \({ignore_index}\)"):
            fn(arrays["x"], arrays["weight"], arrays["target"], labels, ignore_index=ignore_index,
               weight_hard_loss=hard)


def test_torch_bridge_refuses_a_process_group() -> None:
    """With a real (one-rank gloo) group: the chunked backends take it, the bridge says it runs on one device."""
    code = """
import os, socket
os.environ["TRITON_INTERPRET"] = "1"; os.environ["JAX_PLATFORMS"] = "cpu"
import torch, torch.distributed as dist, torch_kl
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
x, w, t = torch.randn(4, 3), torch.randn(5, 3), torch.softmax(torch.randn(4, 5), -1)
for backend in ("pallas", "jax"):
    for key in ("batch_group", "vocab_group"):
        try:
            torch_kl.fused_linear_kl_div(x, w, t, backend=backend, **{key: dist.group.WORLD})
        except ValueError as e:
            assert str(e).startswith(f"backend: {backend!r} runs on one device"), e
        else:
            raise AssertionError(f"{backend} accepted {key}")
one = torch_kl.fused_linear_kl_div(x, w, t, backend="torch", batch_group=dist.group.WORLD)
assert torch.allclose(one, torch_kl.fused_linear_kl_div(x, w, t, backend="torch"))
dist.destroy_process_group()
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1], timeout=300)


def test_jax_bridge_refuses_a_mesh_and_axes() -> None:
    inp = make_inputs(4, 3, 5, ignore_frac=None)
    x, w, t = jnp.asarray(inp.x), jnp.asarray(inp.weight), jnp.asarray(inp.target)
    mesh = Mesh(np.array(jax.devices()[:1]), ("b",))
    for backend in ("triton",):
        with pytest.raises(ValueError, match=rf"^backend: '{backend}' runs on one device"):
            jax_kl.fused_linear_kl_div(x, w, t, backend=backend, mesh=mesh, batch_axis="b")

        def inside(x, t, backend=backend):
            return jax_kl.fused_linear_kl_div(x, w, t, backend=backend, batch_axis="b")

        with pytest.raises(ValueError, match=rf"^backend: '{backend}' runs on one device"):
            jax.shard_map(inside, mesh=mesh, in_specs=(P("b"), P("b")), out_specs=P())(x, t)
    # The chunked backend takes the mesh: the single-device loss.
    got = jax_kl.fused_linear_kl_div(x, w, t, backend="xla", mesh=mesh, batch_axis="b")
    assert float(got) == pytest.approx(float(jax_kl.fused_linear_kl_div(x, w, t, backend="xla")), rel=1e-6)


# Two names of one backend on this machine: torch's alias of the Pallas bridge, and JAX's Pallas
# backend, which lowers through Triton where Mosaic GPU cannot run.
SAME_BACKEND = [("torch/jax", "torch/pallas"), ("jax/pallas_triton", "jax/pallas")]


@pytest.mark.parametrize(("name", "same_as"), SAME_BACKEND)
def test_two_names_of_one_backend_give_the_same_bits(name: str, same_as: str) -> None:
    inp = make_inputs(7, 4, 13, target_format="logits")
    a, b = run(name, inp, beta=0.5), run(same_as, inp, beta=0.5)
    assert a.loss == b.loss and np.array_equal(a.grad_x, b.grad_x) and np.array_equal(a.grad_weight, b.grad_weight)


WRONG_SIGN = {  # (make_inputs keywords, the entry, its value, the message)
    "negative probability": (dict(), (2, 3), -1e-3, "expected probabilities >= 0"),
    "top-k log-probability above 0": (dict(target_format="topk_log_probs", k=3), (3, 1), 0.25,
                                      "expected log-probabilities <= 0"),
}


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("case", ["probability", "top-k log-probability", "top-k index", "row weight"])
def test_an_ignored_row_is_not_value_checked(framework: str, case: str) -> None:
    """An ignored row stays ignored whatever its values: a wrong-signed teacher entry, a repeated
    top-k id or a negative row weight there is not refused, and the call equals the one with that
    row's values made valid."""
    topk = case.startswith("top-k")
    inp = make_inputs(6, 4, 11, **(dict(target_format="topk_log_probs", k=3) if topk else {}))
    row = int(np.flatnonzero(inp.labels == -100)[0])
    weights = np.ones(6, np.float32)
    bad_target, bad_indices, bad_weights = inp.target.copy(), inp.target_indices, weights.copy()
    if case == "probability":
        bad_target[row, 3] = -1e-3
    elif case == "top-k log-probability":
        bad_target[row, 1] = 0.25
    elif case == "top-k index":
        bad_indices = inp.target_indices.copy()
        bad_indices[row, 1] = bad_indices[row, 0]
    else:
        bad_weights[row] = -1.0
    results = []
    for target, indices, w in ((bad_target, bad_indices, bad_weights), (inp.target, inp.target_indices, weights)):
        if framework == "torch":
            args = [torch.as_tensor(a) for a in (inp.x, inp.weight, target, inp.labels)]
            extra = {} if indices is None else dict(target_indices=torch.as_tensor(indices))
            loss = torch_kl.fused_linear_kl_div(
                *args, target_format=inp.target_format, row_weight=torch.as_tensor(w), backend="torch", **extra
            )  # fmt: skip
        else:
            args = [jnp.asarray(a) for a in (inp.x, inp.weight, target, inp.labels)]
            extra = {} if indices is None else dict(target_indices=jnp.asarray(indices))
            loss = jax_kl.fused_linear_kl_div(
                *args, target_format=inp.target_format, row_weight=jnp.asarray(w), backend="xla", **extra
            )  # fmt: skip
        results.append(float(loss))
    assert math.isfinite(results[0]) and results[0] == pytest.approx(results[1], rel=1e-6)


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("case", WRONG_SIGN)
def test_teacher_values_of_the_wrong_sign_are_refused_where_concrete(framework: str, case: str) -> None:
    """A negative probability or a top-k log-probability above 0 raises in an eager call;
    under ``jax.jit`` and ``torch.compile`` the values are not read (docs/contract.md)."""
    shape, entry, value, message = WRONG_SIGN[case]
    inp = make_inputs(6, 4, 11, **shape)
    inp.target[entry] = value
    if framework == "torch":
        a = torch_tensors(inp)
        a.pop("bias")
        fn, compiled = torch_kl.fused_linear_kl_div, torch.compile(torch_kl.fused_linear_kl_div, fullgraph=True,
                                                                   backend="eager")
    else:
        a = _jax_arrays(inp)
        a.pop("bias")
        a["target_format"] = inp.target_format
        fn, compiled = jax_kl.fused_linear_kl_div, jax.jit(jax_kl.fused_linear_kl_div, static_argnames="target_format")
    args = [a.pop(k) for k in ("x", "weight", "target", "labels")]
    with pytest.raises(ValueError, match=rf"^target: {message} \(target_format='{inp.target_format}'\)"):
        fn(*args, **a)
    assert float(fn(*args, **a, weight_soft_loss=0.0, weight_hard_loss=1.0)) > 0  # the teacher is not read
    assert math.isfinite(float(compiled(*args, **a)))


def test_unknown_backend_lists_the_framework_choices() -> None:
    x, w, t = torch.zeros(2, 3), torch.zeros(4, 3), torch.full((2, 4), 0.25)
    for call, names in ((lambda: torch_kl.fused_linear_kl_div(x, w, t, backend="cuda"), torch_kl.backends.NAMES),
                        (lambda: jax_kl.fused_linear_kl_div(x.numpy(), w.numpy(), t.numpy(), backend="cuda"),
                         jax_kl.backends.NAMES)):
        with pytest.raises(ValueError) as info:
            call()
        assert all(repr(name) in str(info.value) for name in names), str(info.value)


def _import_kernels_interpreted() -> None:
    """Triton fixes the interpreter when it is first imported: that must not happen while
    TRITON_INTERPRET is unset, or the later tests of this process could not run the kernels."""
    import torch_kl.backends.rescale
    import torch_kl.backends.triton_phases  # noqa: F401


def test_torch_triton_on_cpu_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    _import_kernels_interpreted()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError) as info:
        torch_kl.backends.resolve("triton", torch.device("cpu"))
    message = str(info.value)
    assert message.startswith("backend: 'triton' is not available here:")
    assert "CUDA" in message and "cpu" in message and "TRITON_INTERPRET=1" in message  # why, and the way out
    x, w, t = torch.zeros(2, 3), torch.zeros(4, 3), torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match=r"^backend: 'triton' is not available here"):
        torch_kl.fused_linear_kl_div(x, w, t, backend="triton")
    assert torch_kl.backends.resolve("auto", torch.device("cpu")).name == "torch"


def test_jax_triton_on_cpu_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    _import_kernels_interpreted()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError) as info:
        jax_kl.backends.resolve("triton")
    message = str(info.value)
    assert message.startswith("backend: 'triton' is not available here:")
    assert "GPU" in message and "TRITON_INTERPRET=1" in message
    x, w, t = jnp.zeros((2, 3)), jnp.zeros((4, 3)), jnp.full((2, 4), 0.25)
    with pytest.raises(ValueError, match=r"^backend: 'triton' is not available here"):
        jax_kl.fused_linear_kl_div(x, w, t, backend="triton")
    assert jax_kl.backends.resolve("auto").name == "xla"


@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)], ids=str)
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_empty_batch_is_not_an_error(framework: str, lead: tuple[int, ...]) -> None:
    x = np.zeros((*lead, 3), np.float32)
    w = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    t = np.zeros((*lead, 5), np.float32)
    labels = np.zeros(lead, np.int32)
    options = dict(weight_hard_loss=0.5, beta=0.5)
    if framework == "torch":
        xt, wt = torch.from_numpy(x).requires_grad_(), torch.from_numpy(w).requires_grad_()
        loss = torch_kl.fused_linear_kl_div(xt, wt, torch.from_numpy(t), torch.from_numpy(labels), **options)
        loss.backward()
        loss, gx, gw = float(loss.detach()), xt.grad.numpy(), wt.grad.numpy()
    else:
        f = lambda x, w: jax_kl.fused_linear_kl_div(x, w, jnp.asarray(t), jnp.asarray(labels), **options)
        loss, (gx, gw) = jax.value_and_grad(f, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
        loss, gx, gw = float(loss), np.asarray(gx), np.asarray(gw)
    assert loss == 0.0
    assert gx.shape == x.shape
    assert gw.shape == w.shape and not np.any(gw)


POISON = {  # (make_inputs keywords, the array, its entry, the value)
    "x nan": (dict(), "x", (1, 2), math.nan),
    "x inf": (dict(), "x", (1, 2), math.inf),
    "weight -inf logits": (dict(target_format="logits"), "weight", (1, 2), -math.inf),
    "target nan probs": (dict(), "target", (1, 2), math.nan),
    "target nan log_probs reverse": (dict(target_format="log_probs"), "target", (1, 2), math.nan),
    "teacher_weight nan": (dict(target_format="hidden"), "teacher_weight", (1, 2), math.nan),
    "topk target nan": (dict(target_format="topk_log_probs", k=3), "target", (1, 2), math.nan),
}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("case", POISON)
def test_nan_and_inf_propagate(backend: str, case: str) -> None:
    shape, where, entry, value = POISON[case]
    inp = make_inputs(6, 4, 11, ignore_frac=None, **shape)
    getattr(inp, where)[entry] = value  # a kept row's entry
    options = dict(beta=1.0) if "reverse" in case else {}
    with np.errstate(invalid="ignore", over="ignore"):
        ref = reference(inp.x, inp.weight, inp.target, bias=inp.bias, **inp.teacher(), **options)
    assert math.isnan(ref.loss)  # what the unfused loss gives
    out = run(backend, inp, chunk_size=4, **options)
    assert math.isnan(out.loss), f"loss {out.loss}: NaN was clamped away"
    assert np.isnan(out.grad_weight).any(), "grad_weight: NaN was clamped away"


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("reduction", ["batchmean", "none", "avg"])
def test_cross_entropy_reductions_are_torchs(framework: str, reduction: str) -> None:
    """The fused cross-entropy takes torch's ``"mean"`` and ``"sum"``; anything else is refused."""
    inp = make_inputs(5, 4, 11)
    fn = torch_kl.fused_linear_cross_entropy if framework == "torch" else jax_kl.fused_linear_cross_entropy
    arrays = torch_tensors(inp) if framework == "torch" else jax_arrays(inp)
    with pytest.raises(ValueError, match=r"^reduction: "):
        fn(arrays["x"], arrays["weight"], arrays["labels"], reduction=reduction)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_numpy_scalars_are_numbers(framework: str) -> None:
    """A NumPy scalar is a number: accepted for every numeric option, same loss as Python's."""
    plain = dict(temperature=2.0, teacher_temperature=0.5, eps=2.0**-20, chunk_size=3, ignore_index=-100, beta=0.5,
                 weight_hard_loss=0.5, weight_soft_loss=0.75, label_smoothing=0.125, logit_scale=1.5, softcap=4.0,
                 teacher_logit_scale=0.5, teacher_softcap=3.0)  # exact in float32
    numpy = {k: (np.int64 if isinstance(v, int) else np.float32)(v) for k, v in plain.items()}
    numpy["ignore_index"] = np.int32(-100)
    inp = make_inputs(7, 4, 13, target_format="logits")
    backend = "torch/torch" if framework == "torch" else "jax/xla"
    assert run(backend, inp, grads=False, **numpy).loss == run(backend, inp, grads=False, **plain).loss


@pytest.mark.parametrize("target_format", ["probs", "topk_log_probs"])
def test_an_8bit_float_teacher_and_row_weight_are_value_checked(target_format: str) -> None:
    """The eager checks read an 8-bit float teacher and row weights (torch reduces no 8-bit float on
    the CPU): the call equals the one on their float32 values, and a wrong sign is refused."""
    inp = make_inputs(6, 4, 11, **(dict(target_format="topk_log_probs", k=3) if target_format != "probs" else {}))
    a = {k: torch.as_tensor(getattr(inp, k)) for k in ("x", "weight", "target", "labels")}
    extra = {} if inp.target_indices is None else dict(target_indices=torch.as_tensor(inp.target_indices))
    f8 = torch.float8_e4m3fn
    target, weights = a.pop("target").to(f8), torch.rand(6).to(f8)
    args = (a["x"], a["weight"])
    common = dict(target_format=target_format, backend="torch", **extra)
    got = torch_kl.fused_linear_kl_div(*args, target, a["labels"], row_weight=weights, **common)
    want = torch_kl.fused_linear_kl_div(*args, target.float(), a["labels"], row_weight=weights.float(), **common)
    assert float(got) == float(want)
    kept = int(np.flatnonzero(inp.labels != -100)[0])
    target[kept, 0] = -0.25 if target_format == "probs" else 0.25
    with pytest.raises(ValueError, match=r"^target: expected"):
        torch_kl.fused_linear_kl_div(*args, target, a["labels"], **common)


def test_jax_refuses_numpy_ids_that_would_wrap_to_int32() -> None:
    """Without ``jax_enable_x64`` JAX's integers are int32: an int64 label past it would wrap (onto
    ``ignore_index``, silently dropping its row), so it is refused, as a wrapping top-k id is."""
    inp = make_inputs(4, 3, 7, target_format="logits")
    args = [jnp.asarray(a) for a in (inp.x, inp.weight, inp.target)]
    labels = inp.labels.astype(np.int64)
    labels[0] = 2**32 - 100
    with pytest.raises(ValueError, match=r"^labels: expected values that fit int32 .* got 4294967196"):
        jax_kl.fused_linear_kl_div(*args, labels, target_format="logits")
    labels[0] = 1
    assert math.isfinite(float(jax_kl.fused_linear_kl_div(*args, labels, target_format="logits")))
