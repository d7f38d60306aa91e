"""The Pallas row kernels on a machine without a GPU: every phase of every loss kind, teacher
format and hard-label option lowers for CUDA to a Mosaic GPU kernel and to a Triton kernel (the
step that rejects unsupported operations and layouts; the CPU tests otherwise run the Triton
lowering's kernels in interpret mode); the chunk checks, the grid, and what ``backend="pallas"``
and ``"auto"`` resolve to with and without Mosaic GPU. Their numbers are tested on the GPU
(``tests/test_gpu_mosaic.py``)."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from harness import jax_pallas_on_hopper  # noqa: E402

from fused_kl.loss import Loss, Teacher  # noqa: E402
from fused_kl.rows import MIXTURE_SUMS  # noqa: E402
from jax_kl.backends import mosaic_missing, pallas_mosaic, pallas_triton, resolve, xla_phases  # noqa: E402

LOSSES = {
    "forward-probs": (Loss(teacher=Teacher("probs", 1.0)), jnp.float32, False),
    "forward-log_probs-hard": (Loss(teacher=Teacher("log_probs", 1.0), weight_hard=0.5), jnp.bfloat16, True),
    "reverse-logits-softcap-T": (
        Loss(
            beta=1.0,
            temperature=2.0,
            softcap=20.0,
            logit_scale=0.5,
            weight_hard=0.5,
            teacher=Teacher("logits", 2.0, softcap=30.0),
        ),
        jnp.bfloat16,
        True,
    ),
    "jsd-probs": (Loss(beta=0.5, teacher=Teacher("probs", 1.0)), jnp.float32, False),
    "topk-coef": (Loss(teacher=Teacher("topk_log_probs", 1.0)), None, False),
    "cross-entropy": (Loss(teacher=None, weight_soft=0.0, weight_hard=1.0, label_smoothing=0.1), None, True),
}
ROWS, V = 200, 1024  # 200 rows: a partial last 64-row block


def _chunk(kernels, loss: Loss, z, t, y, tile=(1, 1)):
    stats = kernels.stats(z, t, y, loss, tile)
    if loss.kind == "jsd":  # reverse KL's sum comes with the statistics
        stats = stats + kernels.mixture_sums(z, t, stats, loss, tile)[:, MIXTURE_SUMS.teacher, None]
    return kernels.finish(z, t, y, stats, loss, V, tile, True)


def _lowered_chunk(kernels, name: str, tile=(1, 1)) -> tuple[str, int]:
    """The CUDA lowering of one chunk's phases, and how many phases it has."""
    loss, t_dtype, hard = LOSSES[name]
    z = jax.ShapeDtypeStruct((ROWS, V), jnp.bfloat16)
    target = None if t_dtype is None else jax.ShapeDtypeStruct((ROWS + 64, V), t_dtype)
    y = jax.ShapeDtypeStruct((ROWS,), jnp.int32) if hard else None

    def f(z, target, y):
        return _chunk(kernels, loss, z, None if target is None else (target, 64), y, tile)

    text = jax.jit(f).trace(z, target, y).lower(lowering_platforms=("cuda",)).as_text()
    return text, 2 + (loss.kind == "jsd")


@pytest.mark.parametrize("name", list(LOSSES))
def test_every_phase_lowers_to_a_mosaic_gpu_kernel(name: str) -> None:
    text, phases = _lowered_chunk(pallas_mosaic, name)
    assert text.count("fused_kl_rows_mosaic") >= phases, text[:2000]


@pytest.mark.parametrize("name", list(LOSSES))
def test_every_phase_lowers_to_a_triton_kernel(name: str, monkeypatch) -> None:
    # Off a GPU the kernels run in interpret mode, which lowers none of their operations.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    text, phases = _lowered_chunk(pallas_triton, name, tile=(8, 128))
    assert text.count("xla.gpu.triton") == phases, text[:2000]


def test_finish_writes_dl_dz_over_the_logits() -> None:
    """The ``finish`` kernel's gradient output aliases the logits operand: no second ``[rows, V]``
    buffer (0.73 GiB on the llama-3 head at 3072 rows), and ``dL/dz`` keeps the logits' shape."""
    loss = Loss(teacher=Teacher("probs", 1.0))
    z = jax.ShapeDtypeStruct((ROWS, V), jnp.bfloat16)
    target = jax.ShapeDtypeStruct((ROWS, V), jnp.float32)

    def f(z, target):
        g, sums = _chunk(pallas_mosaic, loss, z, (target, 0), None)
        assert g.shape == z.shape and g.dtype == z.dtype
        return g, sums

    calls = [line for line in jax.jit(f).trace(z, target).lower(lowering_platforms=("cuda",)).as_text().splitlines()
             if "custom_call @mosaic_gpu" in line]  # fmt: skip
    assert len(calls) == 2
    assert "output_operand_alias" not in calls[0]  # stats: partial sums only
    assert "output_operand_alias" in calls[1] and "operand_index = 0" in calls[1]


def test_a_dense_teacher_wider_than_the_logits_is_moved_by_the_tma() -> None:
    """At a vocabulary a multiple of 64 columns but not of 128, the aligned part's teacher is the
    user's array, a tile wider than its logits: the TMA moves its first columns, every phase one
    Mosaic GPU kernel that takes the array whole."""
    loss = Loss(teacher=Teacher("probs", 1.0))
    z = jax.ShapeDtypeStruct((ROWS, V), jnp.bfloat16)
    target = jax.ShapeDtypeStruct((ROWS + 64, V + 64), jnp.bfloat16)
    assert pallas_mosaic.fits(jnp.zeros(z.shape, z.dtype), (jnp.zeros(target.shape, target.dtype), 64))
    text = jax.jit(lambda z, t: _chunk(pallas_mosaic, loss, z, (t, 64), None)).trace(z, target).lower(
        lowering_platforms=("cuda",)).as_text()  # fmt: skip
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 2 and all(f"tensor<{ROWS + 64}x{V + 64}xbf16>" in line for line in calls)


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_logarithms_are_approximate_and_tanh_is_not(softcap) -> None:
    """JSD's ``mixture_sums`` kernel takes the hardware's ``lg2.approx`` for ``log p`` and ``log m`` (as
    torch_kl's Triton kernels do), with a softcap too: its ``tanh`` goes through the approximate
    ``exp2``, never through ``tanh.approx``, too coarse for the capped logits."""
    loss = Loss(beta=0.5, softcap=softcap, teacher=Teacher("logits", 1.0, softcap=softcap))
    z = jax.ShapeDtypeStruct((ROWS, V), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((ROWS, V), jnp.bfloat16)

    def f(z, t):
        stats = pallas_mosaic.stats(z, (t, 0), None, loss, (1, 1))
        return pallas_mosaic.mixture_sums(z, (t, 0), stats, loss, (1, 1))

    text = jax.jit(f).trace(z, t).lower(lowering_platforms=("cuda",)).as_text()
    assert "lg2.approx" in text
    assert "tanh.approx" not in text  # jnp.tanh in the kernel would put it here


def test_chunks_the_tma_cannot_move_are_refused_by_name() -> None:
    aligned, odd_v = jnp.zeros((64, 128), jnp.bfloat16), jnp.zeros((64, 100), jnp.bfloat16)
    assert pallas_mosaic.fits(aligned, None)
    assert not pallas_mosaic.fits(odd_v, None)
    assert not pallas_mosaic.fits(jnp.zeros((60, 128), jnp.bfloat16), None)  # rows % 8
    assert not pallas_mosaic.fits(aligned, (jnp.zeros((128, 128), jnp.float32), 32))  # teacher row 32
    assert pallas_mosaic.fits(aligned, (jnp.zeros((128, 128), jnp.float32), 64))
    assert not pallas_mosaic.fits(aligned, (jnp.zeros((128, 129), jnp.float32), 64))  # teacher rows V + 1 apart
    with pytest.raises(ValueError, match=r"^backend: 'pallas_mosaic' is not available here: the TMA needs"):
        pallas_mosaic.stats(odd_v, None, None, Loss(teacher=None, weight_hard=1.0, weight_soft=0.0), (1, 1))


@pytest.mark.parametrize(("rows", "v"), [(3072, 128256), (64, 4096), (200, 1024), (8192, 32000)])
def test_grid_covers_every_tile_once(rows: int, v: int) -> None:
    tv = pallas_mosaic.TV[True]
    blocks, segs, steps = pallas_mosaic._grid(rows, v, tv)
    tiles = -(-v // tv)
    assert blocks * pallas_mosaic.R >= rows > (blocks - 1) * pallas_mosaic.R
    assert segs * steps == tiles
    assert blocks * segs >= pallas_mosaic.MIN_PROGRAMS or segs == tiles


def test_pallas_runs_the_xla_phases_where_mosaic_cannot_move_a_chunk() -> None:
    z = jnp.zeros((64, 128), jnp.bfloat16)
    expected = pallas_mosaic if mosaic_missing() is None else pallas_triton
    assert resolve("pallas").chunk_phases(z, None) is expected
    # as on a Hopper GPU: the Mosaic GPU kernels, else the XLA phases, never the Triton lowering
    with_mosaic = jax_pallas_on_hopper()
    assert with_mosaic.chunk_phases(z, None) is pallas_mosaic
    assert with_mosaic.chunk_phases(jnp.zeros((64, 100), jnp.bfloat16), None) is xla_phases
    assert with_mosaic.chunk_phases(z, (jnp.zeros((64, 128), jnp.float32), 32)) is xla_phases  # teacher row 32
    # an unaligned vocabulary's aligned part, its dense teacher the user's array (rows V + 1 apart)
    assert with_mosaic.chunk_phases(z, (jnp.zeros((128, 129), jnp.float32), 64)) is xla_phases


@pytest.mark.parametrize("mosaic", [True, False])
def test_on_a_gpu_the_default_paths_never_take_the_triton_lowering(monkeypatch, mosaic: bool) -> None:
    """On a GPU with Mosaic GPU, ``"auto"`` is ``"pallas"``, whose fallback is the XLA phases; on
    one without, ``"auto"`` is ``"xla"`` and the Triton lowering runs only when named."""
    import jax_kl.backends as registry

    monkeypatch.setattr(registry, "_on_gpu", lambda: True)
    monkeypatch.setattr(registry, "mosaic_missing", lambda: None if mosaic else "an older GPU")
    auto, pallas = registry.resolve("auto"), registry.resolve("pallas")
    if mosaic:
        assert auto.name == "pallas" and (pallas.phases, pallas.mosaic_phases) == (xla_phases, pallas_mosaic)
    else:
        assert auto.name == "xla" and (pallas.phases, pallas.mosaic_phases) == (pallas_triton, None)


@pytest.mark.parametrize("acc_dtype", [jnp.bfloat16, jnp.float32])
def test_grad_weight_kernel_lowers_and_adds_in_place(acc_dtype) -> None:
    from jax_kl.backends import mosaic_accumulate

    acc = jax.ShapeDtypeStruct((384, 512), acc_dtype)
    g = jax.ShapeDtypeStruct((192, 384), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((192, 512), jnp.bfloat16)
    text = jax.jit(mosaic_accumulate.accumulate).trace(acc, g, x).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 1 and "operand_index = 2" in calls[0]  # the output is the accumulator's buffer


def test_grad_weight_kernel_takes_only_whole_tiles_of_one_16_bit_dtype() -> None:
    from jax_kl.backends import mosaic_accumulate

    def fits(rows=192, v=384, h=512, dtype=jnp.bfloat16, acc_dtype=None):
        acc = jnp.zeros((v, h), acc_dtype or dtype)
        return mosaic_accumulate.fits(acc, jnp.zeros((rows, v), dtype), jnp.zeros((rows, h), dtype))

    assert fits() and fits(dtype=jnp.float16)
    assert fits(acc_dtype=jnp.float32) and fits(dtype=jnp.float16, acc_dtype=jnp.float32)  # accum_dtype=float32
    assert not fits(acc_dtype=jnp.float16) and not fits(dtype=jnp.float16, acc_dtype=jnp.bfloat16)
    assert not fits(dtype=jnp.float32)
    assert fits(rows=200)  # a partial last slice of rows: the TMA reads zeros past the chunk
    assert not fits(rows=233)  # not a whole number of the operands' 8-row tiles
    assert not fits(v=400) and not fits(h=384)


@pytest.mark.parametrize(
    ("flags", "folds"),
    [("", False), ("--xla_gpu_enable_triton_gemm=false", True), ("--a=1 --xla_gpu_enable_triton_gemm=False", True),
     ("--xla_gpu_enable_triton_gemm=0", True), ("--xla_gpu_enable_triton_gemm=true", False)],
)  # fmt: skip
def test_xla_flags_that_fold_the_add_leave_it_to_xla(monkeypatch, flags: str, folds: bool) -> None:
    import jax_kl.backends as registry
    from jax_kl.backends import mosaic_accumulate, xla_folds_the_add

    monkeypatch.setenv("XLA_FLAGS", flags)
    assert xla_folds_the_add() is folds
    assert resolve("pallas_triton").in_place_grad_weight is None and resolve("xla").in_place_grad_weight is None
    # As on a Hopper GPU with Mosaic GPU: the in-place kernel unless XLA folds the add itself.
    monkeypatch.setattr(registry, "mosaic_missing", lambda: None)
    assert resolve("pallas").in_place_grad_weight is (None if folds else mosaic_accumulate)


def test_in_place_kernels_lower_inside_shard_map() -> None:
    """The layouts run the kernels inside ``shard_map``, whose varying-axes check the row
    kernels' outputs would fail: they run with it off, as ``plgpu.kernel`` does; the in-place
    outputs keep their aliases there, the row writer's too."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from jax_kl.backends import mosaic_accumulate

    mesh = Mesh(jax.devices()[:1], ("v",))
    loss = Loss(teacher=Teacher("probs", 1.0))

    def local(z, target, acc, x):
        g, sums = _chunk(pallas_mosaic, loss, z, (target, 0), None)
        return mosaic_accumulate.accumulate(acc, g, x), sums

    specs = (P(None, "v"), P(None, "v"), P("v"), P())
    f = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P("v"), P()))
    bf16, f32 = jnp.bfloat16, jnp.float32
    args = [jax.ShapeDtypeStruct((192, 384), bf16), jax.ShapeDtypeStruct((192, 384), f32),
            jax.ShapeDtypeStruct((384, 512), bf16), jax.ShapeDtypeStruct((192, 512), bf16)]  # fmt: skip
    lines = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text().splitlines()
    calls = [line for line in lines if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 3  # stats, finish over the logits, the GEMM into the accumulator
    assert "operand_index = 0" in calls[1] and "operand_index = 2" in calls[2]

    def made(g, x, rest):  # an unaligned vocabulary slice's one array: made, then finished
        return mosaic_accumulate.put_rows(mosaic_accumulate.product(g, x, 389, bf16), rest)

    f = jax.shard_map(made, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P())
    args = [jax.ShapeDtypeStruct((192, 384), bf16), jax.ShapeDtypeStruct((192, 512), bf16),
            jax.ShapeDtypeStruct((5, 512), bf16)]  # fmt: skip
    lines = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text().splitlines()
    calls = [line for line in lines if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 2 and "operand_index = 1" in calls[1]


def _grad_weight_lowering(backend, n: int, h: int, v: int, probs: bool = False) -> str:
    """The CUDA lowering of a cross-entropy step's ``grad_weight`` (``probs``: a forward KL's
    against dense float32 probabilities instead), 256-row chunks."""
    import jax_kl

    def loss(x, w, target):
        if probs:
            return jax_kl.fused_linear_kl_div(x, w, target, chunk_size=256, backend=backend)
        return jax_kl.fused_linear_cross_entropy(x, w, target, chunk_size=256, backend=backend)

    target = jax.ShapeDtypeStruct((n, v), jnp.float32) if probs else jax.ShapeDtypeStruct((n,), jnp.int32)
    shapes = (jax.ShapeDtypeStruct((n, h), jnp.bfloat16), jax.ShapeDtypeStruct((v, h), jnp.bfloat16), target)
    return jax.jit(jax.grad(loss, argnums=1)).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def _mosaic_calls(backend, n: int, h: int, v: int, probs: bool = False) -> tuple[int, int]:
    """The Mosaic GPU kernels of :func:`_grad_weight_lowering`, and how many of them are the
    in-place add (its output the accumulator, operand 2)."""
    text = _grad_weight_lowering(backend, n, h, v, probs)
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    return len(calls), sum("operand_index = 2" in line for line in calls)


def test_an_unaligned_vocabulary_keeps_grad_weight_in_one_array_where_the_in_place_add_runs() -> None:
    """At V = 8291 with the in-place kernel, ``grad_weight`` is one ``[V, H]`` array: the first
    chunk's kernel makes it, the other chunks' add their aligned part into its first rows in place,
    the rest's 99 rows are written into it once after the last chunk by the row writer, the label
    rows' kernel adds the labels' term into it in place, and no copy, select or zero fill of the
    whole array runs; without the kernel each part keeps its own
    accumulator and one copy joins them; a last chunk the kernel cannot take, the latter."""

    def count(backend) -> tuple[int, int, int, int]:
        lines = _grad_weight_lowering(backend, 1024, 256, 8291).splitlines()
        whole = [line for line in lines if "tensor<8291x256xbf16>" in line]
        joins = sum("stablehlo.concatenate" in line or "stablehlo.select" in line for line in whole)
        zeros = sum("stablehlo.broadcast_in_dim" in line for line in whole)
        made = sum("custom_call @mosaic_gpu" in line for line in whole)
        written = sum("custom_call @mosaic_gpu" in line and "operand_index" in line for line in whole)
        return joins, zeros, made, written

    # 4 chunks: one kernel makes the array, three add into it, the row writer puts the rest in, the labels' rows
    assert count(jax_pallas_on_hopper()) == (0, 0, 1 + 3 + 1 + 1, 3 + 1 + 1)
    assert count(jax_pallas_on_hopper(in_place_grad_weight=None))[:2] == (1, 0)
    # a last chunk the in-place add cannot take (233 rows): the parts' accumulators again
    lines = _grad_weight_lowering(jax_pallas_on_hopper(), 1001, 256, 8291).splitlines()
    assert sum("stablehlo.concatenate" in line and "tensor<8291x256xbf16>" in line for line in lines) == 1


@pytest.mark.parametrize("acc_dtype", [jnp.bfloat16, jnp.float32])
def test_grad_weight_kernel_makes_a_fresh_array_and_writes_the_last_rows_in_place(acc_dtype) -> None:
    """``mosaic_accumulate.product`` makes a new array (no input aliased); ``put_rows`` writes
    over its accumulator (the output aliases it) and refuses rows it was not made for."""
    from jax_kl.backends import mosaic_accumulate

    g, x = jax.ShapeDtypeStruct((192, 384), jnp.bfloat16), jax.ShapeDtypeStruct((192, 512), jnp.bfloat16)
    made = (
        jax.jit(mosaic_accumulate.product, static_argnums=(2, 3))
        .trace(g, x, 431, acc_dtype)
        .lower(lowering_platforms=("cuda",))
    )
    calls = [line for line in made.as_text().splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 1 and "operand_index" not in calls[0]
    assert made.out_info.shape == (431, 512) and made.out_info.dtype == acc_dtype
    acc, rows = jax.ShapeDtypeStruct((431, 512), acc_dtype), jax.ShapeDtypeStruct((47, 512), acc_dtype)
    text = jax.jit(mosaic_accumulate.put_rows).trace(acc, rows).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 1 and "operand_index = 1" in calls[0]
    bad = [((431, 512), (129, 512)), ((431, 512), (47, 256)), ((431, 512), (0, 512)), ((5, 512), (6, 512)),
           ((431, 500), (47, 500))]  # fmt: skip
    for acc_shape, rows_shape in bad:
        with pytest.raises(ValueError, match=r"^rows: "):
            mosaic_accumulate.put_rows(jnp.zeros(acc_shape, acc_dtype), jnp.zeros(rows_shape, acc_dtype))
    with pytest.raises(ValueError, match=r"^rows: "):  # another dtype
        mosaic_accumulate.put_rows(jnp.zeros((431, 512), acc_dtype), jnp.zeros((47, 512), jnp.float16))


def test_a_last_chunk_of_odd_rows_keeps_xla_s_add() -> None:
    """1001 rows in chunks of 256: the last chunk's 233 rows are no whole number of the operands'
    8-row tiles, so its ``grad_weight`` is added by XLA; the step lowers for CUDA."""
    # chunks 1 to 3: stats and finish on Mosaic GPU; chunks 2 and 3 add in place; chunk 4 on XLA; the labels' rows
    assert _mosaic_calls(jax_pallas_on_hopper(), 1001, 256, 8192) == (3 * 2 + 2 + 1, 2)


def test_vocabulary_parts_split_where_the_in_place_add_takes_the_aligned_part() -> None:
    """``jax_kl.gemm.vocab_parts`` splits at a multiple of ``mosaic_accumulate``'s row tile; at
    V = 8291 the aligned part's row phases and ``grad_weight`` GEMM lower to Mosaic GPU kernels:
    the first chunk's kernel makes the accumulator, every later one adds into its aligned rows in
    place, and the row writer puts the rest's rows in."""
    from jax_kl import gemm
    from jax_kl.backends import mosaic_accumulate

    assert gemm.SPLIT_MULTIPLE % mosaic_accumulate.CTA_M == 0
    assert [(p.start, p.stop) for p in gemm.vocab_parts(300, True)] == [(0, 256), (256, 300)]
    assert [(p.start, p.stop) for p in gemm.vocab_parts(300, False)] == [(0, 300)]
    assert [(p.start, p.stop) for p in gemm.vocab_parts(256, True)] == [(0, 256)]
    assert [(p.start, p.stop) for p in gemm.vocab_parts(100, True)] == [(0, 100)]
    # every chunk's aligned part: stats, finish and its grad_weight GEMM on Mosaic GPU (the first
    # making the array, the three after it adding in place), the row writer and the labels' rows
    assert _mosaic_calls(jax_pallas_on_hopper(), 1024, 256, 8291) == (4 * 3 + 1 + 1, 3)
    # one part: all on XLA but the labels' rows
    assert _mosaic_calls(jax_pallas_on_hopper(vocab_parts=False), 1024, 256, 8291) == (1, 0)
    # against a dense teacher, read where it lies (rows V apart, which the TMA cannot move), the
    # aligned part's stats and finish run on XLA: its grad_weight GEMMs and the row writer only
    assert _mosaic_calls(jax_pallas_on_hopper(), 1024, 256, 8291, probs=True) == (4 + 1, 3)
    assert pallas_mosaic.NAME in _grad_weight_lowering(jax_pallas_on_hopper(), 1024, 256, 8291, False)
    assert pallas_mosaic.NAME not in _grad_weight_lowering(jax_pallas_on_hopper(), 1024, 256, 8291, True)
