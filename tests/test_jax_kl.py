"""jax_kl behaviour beyond the shared matrix: transformations, dead gradients, memory."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import JAX_BACKENDS, assert_matches, expected, jax_arrays, make_inputs, run

import jax_kl
import jax_kl.backends

NAMES = [b.split("/")[1] for b in JAX_BACKENDS]
# The divergence family's terms ride along in the transformation tests.
OPTIONS = dict(target_format="logits", beta=0.5, weight_hard_loss=0.5, softcap=4.0, chunk_size=4)


def _arrays(inp):
    arrays = jax_arrays(inp)
    return tuple(arrays[k] for k in ("x", "weight", "target", "labels", "bias"))


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_grad_of_a_larger_function(backend: str) -> None:
    inp = make_inputs(11, 5, 23, bias=True, target_format="logits")
    x, w, t, lab, b = _arrays(inp)
    options = {k: v for k, v in OPTIONS.items() if k != "target_format"} | dict(chunk_size=6)

    def f(x, w, b):
        loss = jax_kl.fused_linear_kl_div(x, w, t, lab, bias=b, temperature=1.5, target_format="logits",
                                          backend=backend, **options)
        return 3.0 * loss + jnp.sum(jnp.sin(x))

    ref = expected(inp, temperature=1.5, **options)
    for transform in (jax.grad, lambda f, **kw: lambda *a: jax.value_and_grad(f, **kw)(*a)[1]):
        gx, gw, gb = jax.jit(transform(f, argnums=(0, 1, 2)))(x, w, b)
        np.testing.assert_allclose(gx, 3 * ref.grad_x + np.cos(inp.x), rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(gw, 3 * ref.grad_weight, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(gb, 3 * ref.grad_bias, rtol=2e-5, atol=1e-6)
    if backend == "xla":  # eagerly, without jit, too (op by op: slow for the interpreted kernels)
        np.testing.assert_allclose(jax.grad(f)(x, w, b), 3 * ref.grad_x + np.cos(inp.x), rtol=2e-5, atol=1e-6)


def test_teacher_is_a_constant() -> None:
    inp = make_inputs(7, 4, 13, target_format="hidden", teacher_bias=True)
    x, w, t, lab, _ = _arrays(inp)
    tw, tb = jnp.asarray(inp.teacher_weight), jnp.asarray(inp.teacher_bias)

    def loss(t, tw, tb):
        return jax_kl.fused_linear_kl_div(x, w, t, lab, target_format="hidden", teacher_weight=tw, teacher_bias=tb,
                                          beta=0.5, backend="xla")

    for g, a in zip(jax.grad(loss, argnums=(0, 1, 2))(t, tw, tb), (t, tw, tb), strict=True):
        assert g.shape == a.shape and not np.any(np.asarray(g))


def _dots(fn, *args) -> int:
    """The number of matrix products in the optimised program."""
    return len(re.findall(r"\bdot\(", jax.jit(fn).lower(*args).compile().as_text()))


@pytest.mark.parametrize("fmt", ["probs", "hidden"])
def test_unused_gradients_are_dead_code(fmt: str) -> None:
    inp = make_inputs(12, 4, 19, ignore_frac=None, target_format=fmt)
    x, w, t, _, _ = _arrays(inp)
    teacher = {} if fmt == "probs" else dict(target_format="hidden", teacher_weight=jnp.asarray(inp.teacher_weight))

    def loss(x, w):
        return jax_kl.fused_linear_kl_div(x, w, t, backend="xla", chunk_size=4, **teacher)

    chunks, head = 3, 1 + (fmt == "hidden")  # per chunk: the logits GEMM (and the teacher head's)
    assert _dots(loss, x, w) == head * chunks  # primal: no gradient GEMM
    assert _dots(jax.grad(loss, argnums=(0, 1)), x, w) == (head + 2) * chunks
    assert _dots(jax.grad(loss, argnums=0), x, w) == (head + 1) * chunks  # frozen head: no grad_weight GEMM
    assert _dots(jax.grad(loss, argnums=1), x, w) == (head + 1) * chunks  # frozen input: no grad_x GEMM


@pytest.mark.parametrize("fmt", ["probs", "hidden"])
def test_no_logits_sized_buffer(fmt: str) -> None:
    """Forward + backward make no [N, V] array: every value the program computes is a chunk at most.

    (The Pallas backend is checked on the GPU, by the compiled program's temporary bytes:
    on CPU it runs in interpret mode, whose buffers say nothing about the GPU kernel's.)
    """
    n, h, v, chunk = 512, 8, 256, 64
    t_shape = (n, v) if fmt == "probs" else (n, h)
    spec = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((n, h), (v, h), t_shape, (v, h))]

    def loss(x, w, t, tw):
        teacher = {} if fmt == "probs" else dict(target_format="hidden", teacher_weight=tw)
        return jax_kl.fused_linear_kl_div(x, w, t, backend="xla", chunk_size=chunk, **teacher)

    hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*spec).compile().as_text()
    made = [
        int(a) * int(b)
        for line in hlo.splitlines()
        if "parameter(" not in line
        for a, b in re.findall(r"= \w+\[(\d+),(\d+)\]", line)
    ]
    assert made and max(made) <= chunk * v < n * v


def _equations(jaxpr) -> int:
    """The equations of a jaxpr and of every jaxpr nested in its equations' parameters."""
    count = 0
    for eqn in jaxpr.eqns:
        count += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds its Jaxpr
                if hasattr(inner, "eqns"):
                    count += _equations(inner)
    return count


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_many_chunks_trace_linearly_and_match_the_reference(backend: str) -> None:
    """The chunk loop is unrolled at trace time: each chunk adds the same equations to the
    program (4, 8 and 16 chunks of 64 rows), so a loop whose trace grows faster than the chunks
    fails; 16 chunks of 4 rows still give the reference."""
    inp = make_inputs(64, 8, 37, target_format="logits", bias=True)
    x, w, t, lab, b = _arrays(inp)

    def equations(chunk_size: int) -> int:
        options = {**OPTIONS, "chunk_size": chunk_size}

        def f(x, w, b):
            return jax_kl.fused_linear_kl_div(x, w, t, lab, bias=b, backend=backend, **options)

        return _equations(jax.make_jaxpr(jax.value_and_grad(f, argnums=(0, 1, 2)))(x, w, b).jaxpr)

    four, eight, sixteen = (equations(64 // chunks) for chunks in (4, 8, 16))
    per_chunk = (eight - four) / 4
    assert per_chunk > 0 and sixteen - eight == pytest.approx(8 * per_chunk, rel=0.05), (four, eight, sixteen)
    options = {k: v for k, v in OPTIONS.items() if k != "target_format"} | {"chunk_size": 4}
    assert_matches(run(f"jax/{backend}", inp, **options), inp, **options)


def test_xla_hessian_is_the_unfused_losss() -> None:
    """The ``"xla"`` backend's forward rule is plain ``jax.numpy``: JAX differentiates it again,
    and ``jax.hessian`` equals the Hessian of the unfused loss (forward KL and a hard term)."""
    inp = make_inputs(4, 3, 5, bias=True, ignore_frac=0.3, seed=1)
    x, w, t, lab, b = _arrays(inp)
    keep = lab != -100

    def unfused(x, w):
        log_q = jax.nn.log_softmax(x @ w.T + b)
        soft = jnp.sum(jnp.where(t > 0, t * (jnp.log(jnp.where(t > 0, t, 1.0)) - log_q), 0.0), -1)
        hard = -jnp.take_along_axis(log_q, jnp.where(keep, lab, 0)[:, None], -1)[:, 0]
        return jnp.sum(jnp.where(keep, soft + 0.5 * hard, 0.0)) / jnp.sum(keep)

    def fused(x, w):
        return jax_kl.fused_linear_kl_div(x, w, t, lab, bias=b, weight_hard_loss=0.5, backend="xla", chunk_size=2)

    assert float(unfused(x, w)) == pytest.approx(expected(inp, weight_hard_loss=0.5).loss, rel=1e-5)
    for argnums in (0, 1):
        want = jax.hessian(unfused, argnums)(x, w)
        got = jax.jit(jax.hessian(fused, argnums))(x, w)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", [name for name in NAMES if name != "xla"])
def test_second_derivatives_through_kernels_are_refused_by_name(backend: str) -> None:
    inp = make_inputs(4, 3, 5, target_format="logits")
    x, w, t, lab, _ = _arrays(inp)

    def f(x):
        return jax_kl.fused_linear_kl_div(x, w, t, lab, target_format="logits", backend=backend)

    jax.grad(f)(x)  # first derivatives are fine
    for transform in (jax.hessian, lambda f: jax.grad(lambda x: jnp.sum(jax.grad(f)(x)))):
        with pytest.raises(ValueError, match=rf"^backend: '{backend}' supports first derivatives only"):
            transform(f)(x)


def test_auto_backend_on_cpu_is_xla() -> None:
    assert jax_kl.backends.resolve("auto").name == "xla"


@pytest.mark.parametrize("backend", NAMES)
def test_scan_accumulates_gradients(backend: str) -> None:
    """Gradient accumulation over micro-batches with ``jax.lax.scan``: the sum of each one's gradient."""
    micro = [make_inputs(6, 4, 17, target_format="logits", seed=s) for s in range(3)]
    w = jnp.asarray(micro[0].weight)
    xs, ts = (jnp.stack([jnp.asarray(getattr(m, k)) for m in micro]) for k in ("x", "target"))
    labs = jnp.stack([jnp.asarray(m.labels, jnp.int32) for m in micro])

    def step(w, xs, ts, labs):
        def body(acc, batch):
            x, t, lab = batch
            loss, g = jax.value_and_grad(
                lambda w: jax_kl.fused_linear_kl_div(x, w, t, lab, backend=backend, **OPTIONS))(w)
            return (acc[0] + loss, acc[1] + g), None

        return jax.lax.scan(body, (jnp.float32(0), jnp.zeros_like(w)), (xs, ts, labs))[0]

    loss, gw = jax.jit(step)(w, xs, ts, labs)
    options = {k: v for k, v in OPTIONS.items() if k not in ("chunk_size", "target_format")}
    refs = [expected(replace(m, weight=micro[0].weight), **options) for m in micro]
    assert float(loss) == pytest.approx(sum(r.loss for r in refs), rel=2e-5)
    np.testing.assert_allclose(gw, sum(r.grad_weight for r in refs), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("backend", NAMES)
def test_checkpoint_gives_the_same_gradients(backend: str) -> None:
    inp = make_inputs(9, 5, 19, target_format="logits", bias=True)
    x, w, t, lab, b = _arrays(inp)

    def f(x, w, b):
        return jax_kl.fused_linear_kl_div(jnp.tanh(x), w, t, lab, bias=b, backend=backend, **OPTIONS)

    plain = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, w, b)
    remat = jax.jit(jax.grad(jax.checkpoint(f), argnums=(0, 1, 2)))(x, w, b)
    for a, c in zip(plain, remat, strict=True):
        np.testing.assert_allclose(c, a, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("backend", NAMES)
def test_vmap_over_problems(backend: str) -> None:
    """``jax.vmap`` over a batch of problems sharing the head: each problem's loss and gradients."""
    inp = make_inputs(8, 4, 13, target_format="logits")
    x, w, t, lab, _ = _arrays(inp)
    xs = jnp.stack([x, 0.5 * x, -x])

    def f(x, w):
        return jax_kl.fused_linear_kl_div(x, w, t, lab, backend=backend, **OPTIONS)

    losses = jax.jit(jax.vmap(f, in_axes=(0, None)))(xs, w)
    gx, gw = jax.jit(jax.grad(lambda xs, w: jax.vmap(f, in_axes=(0, None))(xs, w).sum(), argnums=(0, 1)))(xs, w)
    options = {k: v for k, v in OPTIONS.items() if k not in ("chunk_size", "target_format")}
    refs = [expected(replace(inp, x=np.asarray(xi)), **options) for xi in xs]
    np.testing.assert_allclose(losses, [r.loss for r in refs], rtol=2e-5)
    np.testing.assert_allclose(gx, np.stack([r.grad_x for r in refs]), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(gw, sum(r.grad_weight for r in refs), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("backend", NAMES)
def test_numpy_inputs_not_modified(backend: str) -> None:
    """NumPy arrays handed to ``jax_kl`` come back as they were."""
    inp = make_inputs(9, 5, 13, bias=True, target_format="topk_log_probs", k=4, pad_frac=0.5)
    arrays = [inp.x, inp.weight, inp.target, inp.labels.astype(np.int32), inp.bias,
              inp.target_indices.astype(np.int32)]
    before = [a.copy() for a in arrays]
    x, w, t, lab, b, idx = arrays

    def f(x, w, b):
        return jax_kl.fused_linear_kl_div(x, w, t, lab, bias=b, target_format="topk_log_probs", target_indices=idx,
                                          weight_hard_loss=0.5, chunk_size=5, backend=backend)

    jax.grad(f, argnums=(0, 1, 2))(x, w, b)
    for a, old in zip(arrays, before, strict=True):
        assert np.array_equal(a, old)


# (loss, options): the cross-entropy; a top-k teacher with a hard term, whose tokens fall in both
# parts; dense teachers (each part reads its columns) under each divergence; a teacher head,
# whose GEMM makes the teacher's parts.
VOCAB_PART_CASES = {
    "cross_entropy": ("ce", dict(label_smoothing=0.1, z_loss_weight=1e-2, bias=True)),
    "topk": ("topk_log_probs", dict(weight_hard_loss=0.5, temperature=1.0)),
    "forward": ("probs", dict(weight_hard_loss=0.5, temperature=2.0)),
    "reverse": ("log_probs", dict(beta=1.0)),
    "reverse_logits": ("logits", dict(beta=1.0, softcap=3.0, teacher_temperature=1.5)),
    "jsd": ("logits", dict(weight_hard_loss=0.5, beta=0.5)),
    "teacher_head": ("hidden", dict(teacher_temperature=0.5)),
}


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("case", list(VOCAB_PART_CASES))
def test_a_chunk_in_vocabulary_parts_gives_the_whole_chunks_results(backend: str, case: str) -> None:
    """``Backend.vocab_parts``: at V = 300 a chunk (and its dense teacher) is made as columns
    [0, 256) and [256, 300); the loss, the rows' losses and every gradient are the one-part
    chunk's."""
    fmt, options = VOCAB_PART_CASES[case]
    options = dict(options)
    bias = options.pop("bias", False)
    inp = make_inputs(12, 8, 300, bias=bias, target_format="logits" if fmt == "ce" else fmt, k=40, pad_frac=0.2,
                      teacher_bias=fmt == "hidden")  # fmt: skip
    arrays = jax_arrays(inp)
    x, w, b, lab = arrays["x"], arrays["weight"], arrays.get("bias"), arrays["labels"]
    resolved = jax_kl.backends.resolve(backend)

    def loss(x, w, b, chosen):
        common = dict(bias=b, backend=chosen, chunk_size=5, return_row_losses=True, **options)
        if fmt == "ce":
            return jax_kl.fused_linear_cross_entropy(x, w, lab, **common)
        keys = ("target_indices", "teacher_weight", "teacher_bias")
        teacher = {k: arrays[k] for k in keys if k in arrays}
        return jax_kl.fused_linear_kl_div(x, w, arrays["target"], lab, target_format=fmt, **teacher, **common)

    chosen = (replace(resolved, vocab_parts=False), resolved)
    argnums = (0, 1, 2) if bias else (0, 1)
    results = [jax.value_and_grad(loss, argnums=argnums, has_aux=True)(x, w, b, c) for c in chosen]
    for a, c in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-6)
    program = str(jax.make_jaxpr(lambda *a: loss(*a, chosen[1]))(x, w, b))
    assert "f32[5,256]" in program and "f32[5,44]" in program


def test_a_dense_teacher_in_vocabulary_parts_is_read_where_it_lies() -> None:
    """The part of the first columns takes the user's array itself (rows ``V`` apart, from the
    chunk's first row); only the few columns left are sliced out."""
    from fused_kl.loss import Loss, Teacher
    from jax_kl import gemm, teachers

    target = jnp.zeros((300, 1025), jnp.float32)
    parts = gemm.vocab_parts(1025, True)
    first, rest = teachers.dense_chunk(Loss(teacher=Teacher("probs", 1.0)), teachers.TeacherArrays(target), 64, 128,
                                       None, parts)  # fmt: skip
    assert first[0] is target and first[1] == 64
    assert rest[0].shape == (64, 1025 - parts[0].stop) and rest[1] == 0


class _AddInPlace:
    """A stand-in for ``mosaic_accumulate`` (which runs on Hopper only): any operands fit; adds
    ``gᵀ x`` into the accumulator's first rows. ``calls`` names its functions as they are traced."""

    calls: ClassVar[list[str]] = []

    @staticmethod
    def fits(acc, g, x) -> bool:
        return True

    @staticmethod
    def accumulate(acc: jax.Array, g: jax.Array, x: jax.Array) -> jax.Array:
        _AddInPlace.calls.append("accumulate")
        product = jnp.dot(g.T, x, precision="highest", preferred_element_type=jnp.float32)
        return acc.at[: g.shape[1]].add(product.astype(acc.dtype))

    @staticmethod
    def product(g: jax.Array, x: jax.Array, rows: int, dtype) -> jax.Array:
        """The kernel leaves the rows past ``g``'s columns unwritten: NaN here, so a result that
        read them would show it."""
        _AddInPlace.calls.append("product")
        product = jnp.dot(g.T, x, precision="highest", preferred_element_type=jnp.float32).astype(dtype)
        return jnp.full((rows, x.shape[1]), jnp.nan, dtype).at[: g.shape[1]].set(product)

    @staticmethod
    def put_rows(acc: jax.Array, rows: jax.Array) -> jax.Array:
        _AddInPlace.calls.append("put_rows")
        assert 0 < rows.shape[0] <= 128, "the kernel writes at most CTA_M rows"
        return acc.at[acc.shape[0] - rows.shape[0] :].set(rows)


@pytest.mark.parametrize("case", ["cross_entropy", "forward", "teacher_head"])
def test_grad_weight_in_one_array_where_the_in_place_add_takes_every_aligned_part(case: str) -> None:
    """``jax_kl.gemm.single_array``: with an in-place add that takes every chunk's aligned part,
    ``grad_weight`` at V = 300 is one array (the aligned rows added in place, the rest's 44 rows
    summed apart and written into it after the last chunk); the results are the one-part chunk's."""
    fmt, options = VOCAB_PART_CASES[case]
    options = dict(options)
    bias = options.pop("bias", False)
    inp = make_inputs(12, 8, 300, bias=bias, target_format="logits" if fmt == "ce" else fmt, k=40, pad_frac=0.2,
                      teacher_bias=fmt == "hidden")  # fmt: skip
    arrays = jax_arrays(inp)
    x, w, b, lab = arrays["x"], arrays["weight"], arrays.get("bias"), arrays["labels"]
    resolved = replace(jax_kl.backends.resolve("xla"), vocab_parts=True, in_place_grad_weight=_AddInPlace)

    def loss(x, w, chosen):
        common = dict(bias=b, backend=chosen, chunk_size=5, **options)
        if fmt == "ce":
            return jax_kl.fused_linear_cross_entropy(x, w, lab, **common)
        keys = ("target_indices", "teacher_weight", "teacher_bias")
        teacher = {k: arrays[k] for k in keys if k in arrays}
        return jax_kl.fused_linear_kl_div(x, w, arrays["target"], lab, target_format=fmt, **teacher, **common)

    chosen = (replace(resolved, vocab_parts=False), resolved)
    want, got = (jax.value_and_grad(loss, argnums=(0, 1))(x, w, c) for c in chosen)
    for a, c in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-6)

    def grad_weight_ops(backend) -> tuple[int, int]:
        lines = str(jax.make_jaxpr(lambda x, w: jax.grad(loss, argnums=1)(x, w, backend))(x, w)).splitlines()
        made = [line for line in lines if "f32[300,8] =" in line]
        return sum("concatenate" in line for line in made), sum("select_n" in line for line in made)

    _AddInPlace.calls.clear()
    assert grad_weight_ops(resolved) == (0, 0)  # no copy joins the parts, no select writes the rest's rows
    # 12 rows in chunks of 5: the first chunk's product makes the array, the others add into it,
    # and the rest's 44 rows are written into it once
    assert _AddInPlace.calls == ["product", "accumulate", "accumulate", "put_rows"]
    assert grad_weight_ops(replace(resolved, in_place_grad_weight=None)) == (1, 0)  # the parts joined
