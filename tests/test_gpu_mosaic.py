"""GPU tests of the Mosaic GPU row kernels (Hopper or newer, jax >= 0.11): the Triton-lowered
and Mosaic GPU kernels agree on the llama-3 vocabulary's layout, ``backend="pallas"`` runs the
Mosaic GPU kernels without the Triton lowering's deprecation warning, and shapes the TMA cannot
move fall back (``"pallas"``) or are refused by name (``"pallas_mosaic"``).

Run on a GPU machine: ``XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest -m gpu tests``.
"""

from __future__ import annotations

import warnings

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from gpu_runners import rel, run_gpu  # noqa: E402

import jax_kl  # noqa: E402
from jax_kl.backends import mosaic_missing  # noqa: E402

if jax.default_backend() == "gpu" and mosaic_missing() is not None:
    pytest.skip(mosaic_missing(), allow_module_level=True)

OPTIONS = {
    "forward": dict(),
    "reverse-softcap": dict(beta=1.0, softcap=30.0, logit_scale=0.5),
    "jsd-hard-T": dict(beta=0.5, temperature=2.0, weight_hard_loss=0.5, label_smoothing=0.1),
    "logits-teacher": dict(target_format="logits", teacher_softcap=20.0, teacher_temperature=2.0),
}


def _inputs(n: int, h: int, v: int, dtype: torch.dtype, fmt: str = "probs"):
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    w = (torch.randn(v, h, device="cuda", generator=g) * (2.0 / h**0.5)).to(dtype)
    raw = torch.randn(n, v, device="cuda", generator=g) * 2
    t = raw if fmt == "logits" else raw.softmax(-1)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[::5] = -100
    return x, w, t, labels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_mosaic_matches_triton_lowering(name: str, dtype: torch.dtype) -> None:
    options = dict(OPTIONS[name])
    fmt = options.get("target_format", "probs")
    inputs = _inputs(1000, 256, 8192, dtype, fmt)  # 1000 rows: a partial last 64-row block
    ref = run_gpu("jax/pallas_triton", *inputs, chunk_size=512, **options)
    got = run_gpu("jax/pallas_mosaic", *inputs, chunk_size=512, **options)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert abs(float(got[0]) - float(ref[0])) <= tol * abs(float(ref[0])), (float(got[0]), float(ref[0]))
    assert rel(got[1], ref[1]) <= tol
    # 16-bit grad_weight: the second chunk's sum is rounded once by the in-place GEMM
    # (mosaic_accumulate), twice by XLA's product-then-add
    assert rel(got[2], ref[2]) <= (tol if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("fn", ["kl_div", "cross_entropy"])
def test_default_path_runs_mosaic_without_deprecation_warning(fn: str) -> None:
    x, w, t, y = (jax.dlpack.from_dlpack(a) for a in _inputs(512, 128, 4096, torch.bfloat16))
    y = y.astype(jnp.int32)

    def loss(x, w):
        if fn == "kl_div":
            return jax_kl.fused_linear_kl_div(x, w, t)
        return jax_kl.fused_linear_cross_entropy(x, w, y)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        text = f.lower(x, w).as_text()
        jax.block_until_ready(f(x, w))
    assert "fused_kl_rows_mosaic" in text
    assert not [str(m.message) for m in seen if "deprecated" in str(m.message).lower()]


def test_unaligned_vocabulary_never_takes_the_deprecated_lowering() -> None:
    """At V = 1000 the default runs the aligned 896 columns on Mosaic GPU and the rest on the XLA
    phases; the chunk as one array runs the XLA phases alone; forcing Mosaic GPU is refused."""
    from dataclasses import replace

    from jax_kl.backends import resolve

    x, w, t, _ = (jax.dlpack.from_dlpack(a) for a in _inputs(64, 32, 1000, torch.bfloat16))  # 1000 % 64 != 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        auto = jax_kl.fused_linear_kl_div(x, w, t)
        whole = jax_kl.fused_linear_kl_div(x, w, t, backend=replace(resolve("pallas"), vocab_parts=False))
    assert not [str(m.message) for m in seen if "deprecated" in str(m.message).lower()]
    xla = float(jax_kl.fused_linear_kl_div(x, w, t, backend="xla"))
    assert float(whole) == xla
    assert abs(float(auto) - xla) <= 1e-3 * abs(xla)
    with pytest.raises(ValueError, match=r"^backend: 'pallas_mosaic' is not available here: the TMA"):
        jax_kl.fused_linear_kl_div(x, w, t, backend="pallas_mosaic")
    assert jnp.isfinite(auto)


@pytest.mark.parametrize("extra", [0, 1, 77])  # accumulator rows past g's columns: an unaligned vocabulary's
@pytest.mark.parametrize("rows", [192, 200])  # 200: a partial last slice of 64 rows
@pytest.mark.parametrize(("dtype", "acc_dtype"), [(jnp.bfloat16,) * 2, (jnp.float16,) * 2, (jnp.bfloat16, jnp.float32)])
def test_grad_weight_kernel_adds_in_place_rounding_once(dtype, acc_dtype, rows: int, extra: int) -> None:
    from jax_kl.backends import mosaic_accumulate

    v, h = 384, 512  # 3 x 2 output tiles
    k = jax.random.split(jax.random.key(0), 3)
    g = (jax.random.normal(k[0], (rows, v)) * 0.1).astype(dtype)
    x = jax.random.normal(k[1], (rows, h)).astype(dtype)
    acc = jax.random.normal(k[2], (v + extra, h)).astype(acc_dtype)
    assert mosaic_accumulate.fits(acc, g, x)
    product = jnp.dot(g.astype(jnp.float32).T, x.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    exact = acc[:v].astype(jnp.float32) + product
    whole = jax.jit(mosaic_accumulate.accumulate)(acc, g, x)
    assert bool(jnp.all(whole[v:] == acc[v:]))  # the rows past g's columns are left as they were
    got = whole[:v].astype(jnp.float32)
    # one rounding of the float32 sum: half a unit in the last place, plus float32's own sum order
    half_ulp = {jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11, jnp.float32: 2.0**-24}[acc_dtype]
    assert bool(jnp.all(jnp.abs(got - exact) <= half_ulp * jnp.abs(exact) + 1e-4))
    if acc_dtype != jnp.float32:
        xla = (acc[:v] + jnp.dot(g.T, x, preferred_element_type=jnp.float32).astype(acc_dtype)).astype(jnp.float32)
        assert float(jnp.linalg.norm(got - exact)) <= float(jnp.linalg.norm(xla - exact))  # one rounding, not two


@pytest.mark.parametrize("extra", [1, 77, 128])  # an unaligned vocabulary's rest (1 to 127 rows) and the limit
@pytest.mark.parametrize("acc_dtype", [jnp.bfloat16, jnp.float32])
def test_grad_weight_kernel_makes_the_array_and_the_row_writer_finishes_it(acc_dtype, extra: int) -> None:
    """``product`` writes ``gᵀ x`` rounded once into a new array's first rows; ``put_rows`` writes
    the last rows over it and leaves the others as they were."""
    from jax_kl.backends import mosaic_accumulate

    rows, v, h = 200, 384, 512
    k = jax.random.split(jax.random.key(1), 3)
    g = (jax.random.normal(k[0], (rows, v)) * 0.1).astype(jnp.bfloat16)
    x = jax.random.normal(k[1], (rows, h)).astype(jnp.bfloat16)
    rest = jax.random.normal(k[2], (extra, h)).astype(acc_dtype)
    exact = jnp.dot(g.astype(jnp.float32).T, x.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)

    def made(g, x, rest):
        return mosaic_accumulate.put_rows(mosaic_accumulate.product(g, x, v + extra, acc_dtype), rest)

    whole = jax.jit(made)(g, x, rest)
    assert whole.shape == (v + extra, h) and whole.dtype == acc_dtype
    assert bool(jnp.all(whole[v:] == rest))
    half_ulp = {jnp.bfloat16: 2.0**-8, jnp.float32: 2.0**-24}[acc_dtype]
    got = whole[:v].astype(jnp.float32)
    assert bool(jnp.all(jnp.abs(got - exact) <= half_ulp * jnp.abs(exact) + 1e-4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["forward", "jsd-hard-T"])
def test_chunks_add_grad_weight_in_place_like_xla(name: str, dtype: torch.dtype) -> None:
    """Four chunks of 256 rows: the last three add their ``grad_weight`` GEMM in place; the
    gradients agree with the Triton lowering's (XLA's add) to the dtype's rounding."""
    inputs = _inputs(1024, 256, 8192, dtype)
    options = dict(OPTIONS[name], chunk_size=256)
    ref = run_gpu("jax/pallas_triton", *inputs, **options)
    got = run_gpu("jax/pallas", *inputs, **options)
    assert abs(float(got[0]) - float(ref[0])) <= 2e-3 * abs(float(ref[0]))
    assert rel(got[1], ref[1]) <= 2e-3
    assert rel(got[2], ref[2]) <= 4e-3
    f = jax.jit(lambda x, w, t: jax.grad(lambda w: jax_kl.fused_linear_kl_div(x, w, t, chunk_size=256))(w))
    text = f.lower(*(jax.dlpack.from_dlpack(a) for a in inputs[:3])).as_text()
    assert text.count("fused_kl_grad_weight_mosaic") >= 3


def test_topk_teacher_holds_no_second_logits_buffer() -> None:
    """The top-k entries of ``dL/dz`` are settled before ``finish`` overwrites the logits in place:
    XLA keeps no copy of the chunk's logits for the scatter, so a top-k teacher's temporaries are
    no larger than a dense teacher's (one ``[chunk, V]`` buffer)."""
    n, h, v, k = 1024, 256, 16384, 16
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (n, h), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (v, h)) * h**-0.5).astype(jnp.bfloat16)
    idx = ((jnp.arange(n)[:, None] * 7919 + jnp.arange(k) * (v // k)) % v).astype(jnp.int32)  # distinct
    log_p = jax.nn.log_softmax(jax.random.normal(keys[2], (n, k)), -1) - 1.0
    dense = jax.nn.softmax(jax.random.normal(keys[2], (n, v)), -1).astype(jnp.bfloat16)

    def temporaries(loss) -> int:
        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().memory_analysis().temp_size_in_bytes

    topk = temporaries(lambda x, w: jax_kl.fused_linear_kl_div(
        x, w, log_p, target_format="topk_log_probs", target_indices=idx, chunk_size=512))  # fmt: skip
    probs = temporaries(lambda x, w: jax_kl.fused_linear_kl_div(x, w, dense, chunk_size=512))
    logits_chunk = 512 * v * 2
    assert topk < probs + logits_chunk // 2, (topk, probs, logits_chunk)


@pytest.mark.parametrize("accum_dtype", [None, "float32"])
@pytest.mark.parametrize("v", [8291, 8193])
@pytest.mark.parametrize("fn", ["cross_entropy", "topk", "forward", "teacher_head"])
def test_vocabulary_parts_run_the_aligned_part_on_mosaic(fn: str, v: int, accum_dtype: str | None) -> None:
    """``Backend.vocab_parts`` at V = 8291 (8192 + 99) and 8193 (a rest of one column):
    the aligned part's row phases and ``grad_weight`` add run on Mosaic GPU, the rest on XLA (and
    the row phases against a dense teacher, read where it lies); the
    results are the one-part chunk's (the XLA phases) to bf16's rounding, with a float32
    accumulator too."""
    from dataclasses import replace

    from jax_kl.backends import pallas_mosaic, resolve

    n, h, k = 1024, 256, 16
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (n, h), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (v, h)) * h**-0.5).astype(jnp.bfloat16)
    labels = jax.random.randint(keys[2], (n,), 0, v)
    idx = ((jnp.arange(n)[:, None] * 7919 + jnp.arange(k) * (v // k)) % v).astype(jnp.int32)  # both parts
    log_p = jax.nn.log_softmax(jax.random.normal(keys[3], (n, k)), -1) - 1.0
    probs = jax.nn.softmax(jax.random.normal(keys[3], (n, v)) * 2.0, -1)
    hidden, tw = x[:, ::-1], (jax.random.normal(keys[1], (v, h)) * h**-0.5).astype(jnp.bfloat16)[::-1]
    split = resolve("pallas")
    whole = replace(split, vocab_parts=False)

    def loss(x, w, backend, accum_dtype):
        common = dict(chunk_size=256, backend=backend, accum_dtype=accum_dtype)
        if fn == "cross_entropy":
            return jax_kl.fused_linear_cross_entropy(x, w, labels, **common)
        if fn == "forward":  # the dense teacher read where it lies (rows V apart) by the XLA phases
            return jax_kl.fused_linear_kl_div(x, w, probs, labels, weight_hard_loss=0.5, **common)
        if fn == "teacher_head":
            return jax_kl.fused_linear_kl_div(x, w, hidden, labels, target_format="hidden", teacher_weight=tw, **common)
        return jax_kl.fused_linear_kl_div(x, w, log_p, labels, target_format="topk_log_probs", target_indices=idx,
                                          weight_hard_loss=0.5, **common)  # fmt: skip

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=(2, 3))
    (want, (want_x, want_w)), (got, (got_x, got_w)) = (step(x, w, b, accum_dtype) for b in (whole, split))
    assert abs(float(got) - float(want)) <= 2e-3 * abs(float(want))
    as_torch = torch.from_dlpack
    assert rel(as_torch(got_x), as_torch(want_x)) <= 1e-2 and rel(as_torch(got_w), as_torch(want_w)) <= 1e-2
    rest = slice(v - v % 128, v)  # the rows the row writer puts in, apart: a few rows of the whole
    assert rel(as_torch(got_w[rest]), as_torch(want_w[rest])) <= 1e-2
    text = step.lower(x, w, split, accum_dtype).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert any("operand_index = 2" in line for line in calls)  # the aligned part's in-place add
    # its row phases, but against a dense teacher, whose rows V elements apart the TMA cannot move
    assert (pallas_mosaic.NAME in text) is (fn != "forward")
