"""The sharded JAX checks, on 4 CPU devices: ``python jax_worker.py OUT``.

``test_jax_sharding.py`` runs this with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``
set before JAX starts. Each case compares a sharded run under ``jax.jit(jax.value_and_grad)``
with the single-device run on the whole arrays, and writes ``{case: None or the traceback}``
to ``OUT/jax.json``. Modes: ``mesh`` (global arrays, ``mesh=``), ``inside`` / ``unchecked``
(local blocks in the caller's ``shard_map`` with ``check_vma`` True / False).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_kl

CASES: dict[str, Callable[[], None]] = {}
LAYOUTS = {"b": ("b", None), "v": (None, "v"), "bv": ("b", "v")}
MODES = ("mesh", "inside", "unchecked")
DENSE = ("probs", "log_probs", "logits")
ARRAYS = ("x", "weight", "bias", "target", "labels", "teacher_weight", "teacher_bias", "target_indices")
UPSTREAM = 2.5  # the loss enters a larger function: every gradient scales by it


def mesh_shape(text: str) -> tuple[int, int]:
    """``"B,V"`` (``FUSED_KL_MESH``) as the mesh's shape."""
    b, v = (int(d) for d in text.split(","))
    return b, v


def _mesh() -> Mesh:
    """A ``("b", "v")`` mesh, 2 x 2 unless ``FUSED_KL_MESH`` says another shape (e.g. "1,2" on 2 GPUs)."""
    shape = mesh_shape(os.environ.get("FUSED_KL_MESH", "2,2"))
    return Mesh(np.array(jax.devices()[: shape[0] * shape[1]]).reshape(shape), ("b", "v"))


def problem(fmt: str, *, n=16, h=8, v=24, k=6, ht=6, bias=False, labels=True, seed=0) -> dict:
    """Whole arrays; rows 9..15 mostly ignored, so the batch shards keep unequal counts."""
    rng = np.random.default_rng(seed)
    p = {"x": rng.standard_normal((n, h)), "weight": rng.standard_normal((v, h)) * 2 / h**0.5}
    if bias:
        p["bias"] = rng.standard_normal(v)
    raw = rng.standard_normal((n, v)) * 2
    log_p = raw - np.log(np.exp(raw).sum(-1, keepdims=True))
    if fmt in DENSE:
        p["target"] = {"probs": np.exp(log_p), "log_probs": log_p, "logits": raw}[fmt]
    elif fmt == "hidden":
        p["target"] = rng.standard_normal((n, ht))
        p["teacher_weight"] = rng.standard_normal((v, ht)) * 2 / ht**0.5
        p["teacher_bias"] = rng.standard_normal(v)
    elif fmt == "topk_log_probs":
        idx = np.argsort(rng.random((n, v)), -1)[:, :k]
        t = np.take_along_axis(log_p, idx, 1)
        t[::3, -1] = -np.inf
        p["target"], p["target_indices"] = t, idx.astype(np.int32)
    if labels:
        p["labels"] = rng.integers(0, v, n).astype(np.int32)
        p["labels"][[3, 9, 10, 11, 13, 14]] = -100
    return {k: jnp.asarray(a, jnp.int32 if a.dtype.kind == "i" else jnp.float32) for k, a in p.items()}


def specs(p: dict, fmt: str, b, v) -> dict:
    rows = P(b, v) if fmt in DENSE else P(b, None)
    table = {"x": P(b, None), "weight": P(v, None), "bias": P(v), "target": rows, "labels": P(b), "row_weight": P(b),
             "teacher_weight": P(v, None), "teacher_bias": P(v), "target_indices": P(b, None)}  # fmt: skip
    return {k: table[k] for k in p}


def loss_fn(fmt: str | None, options: dict) -> Callable:
    def f(arrays: dict, **layout):
        a = dict(arrays)
        if fmt is None:
            a.pop("target")
            return jax_kl.fused_linear_cross_entropy(**a, **options, **layout)
        return jax_kl.fused_linear_kl_div(**a, target_format=fmt, **options, **layout)

    return f


def run(fmt: str | None, p: dict, options: dict, mode: str | None = None, layout: str = "bv", mesh=None,
        grad: bool = True):  # fmt: skip
    """``(loss, gradients of x, weight and bias, specs)`` of ``UPSTREAM * loss``; ``grad=False``:
    the loss alone, outside ``jax.grad`` (no gradients)."""
    f = loss_fn(fmt, options)
    diff = {k: p[k] for k in ("x", "weight", "bias") if k in p}
    rest = {k: a for k, a in p.items() if k not in diff}
    b, v = LAYOUTS[layout]
    sp = specs(p, fmt or "probs", b, v)

    def total(diff, rest):
        arrays = {**diff, **rest}
        if mode is None:
            return f(arrays) * UPSTREAM
        if mode == "mesh":
            return f(arrays, mesh=mesh, batch_axis=b, vocab_axis=v) * UPSTREAM
        body = lambda arrays: f(arrays, batch_axis=b, vocab_axis=v) * UPSTREAM
        return jax.shard_map(body, mesh=mesh, in_specs=(sp,), out_specs=P(), check_vma=mode == "inside")(arrays)

    if mode == "mesh":
        diff = {k: jax.device_put(a, NamedSharding(mesh, sp[k])) for k, a in diff.items()}
        rest = {k: jax.device_put(a, NamedSharding(mesh, sp[k])) for k, a in rest.items()}
    if not grad:
        return float(jax.jit(total)(diff, rest)) / UPSTREAM, {}, sp
    value, grads = jax.jit(jax.value_and_grad(total))(diff, rest)
    return float(value) / UPSTREAM, {k: g / UPSTREAM for k, g in grads.items()}, sp


def close(what: str, got, want, tol: float = 2e-5) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    denom = max(float(np.linalg.norm(want)), 1e-2)
    err = float(np.linalg.norm(got - want)) / denom
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def layouts_case(
    fmt: str | None, pkw: dict, options: dict, layout: str, modes: tuple[str, ...], grad: bool = True
) -> Callable:
    def body() -> None:
        mesh = _mesh()
        p = problem(fmt or "probs", **pkw)
        want_loss, want, _ = run(fmt, p, options)
        for mode in modes:
            loss, grads, sp = run(fmt, p, options, mode, layout, mesh, grad)
            close(f"{mode}: loss", loss, want_loss)
            for k, g in grads.items():
                close(f"{mode}: grad_{k}", g, want[k])
                if mode == "mesh":  # sharded like its input
                    assert g.sharding.is_equivalent_to(NamedSharding(mesh, sp[k]), g.ndim), (k, g.sharding)

    return body


MATRIX = [  # (name, format, problem keywords, options, layouts)
    ("forward_probs_bias", "probs", dict(bias=True), dict(chunk_size=6), ("b", "v", "bv")),
    ("hard_smoothing_softcap", "probs", dict(bias=True),
     dict(weight_hard_loss=0.7, weight_soft_loss=0.4, label_smoothing=0.1, softcap=3.0, logit_scale=1.3,
          temperature=1.5, chunk_size=6), ("b", "v", "bv")),
    ("no_labels_logits", "logits", dict(labels=False, bias=True), dict(temperature=0.8, chunk_size=5), ("bv",)),
    ("reverse_log_probs_sum", "log_probs", dict(), dict(beta=1.0, reduction="sum"), ("bv",)),
    ("reverse_logits_hard", "logits", dict(), dict(beta=1.0, weight_hard_loss=0.5, temperature=2.0,
                                                   teacher_temperature=1.5, chunk_size=5), ("v",)),
    ("jsd_logits_mean", "logits", dict(), dict(beta=0.5, reduction="mean", temperature=2.0, teacher_temperature=1.5),
     ("bv",)),
    ("topk_bin_hard", "topk_log_probs", dict(), dict(weight_hard_loss=0.5, label_smoothing=0.2, chunk_size=5),
     ("v", "bv")),
    ("topk_renormalize", "topk_log_probs", dict(bias=True), dict(topk_tail="renormalize", softcap=2.0), ("bv",)),
    ("hidden_jsd", "hidden", dict(bias=True), dict(beta=0.3, teacher_softcap=4.0, chunk_size=6), ("bv",)),
    ("cross_entropy", None, dict(), dict(label_smoothing=0.1, softcap=4.0), ("bv",)),
]  # fmt: skip
for _name, _fmt, _pkw, _options, _layouts in MATRIX:
    for _layout in _layouts:
        CASES[f"{_name}[{_layout}]"] = layouts_case(_fmt, _pkw, _options, _layout, MODES)
CASES["loss_only[bv]"] = layouts_case("probs", dict(bias=True), dict(chunk_size=6), "bv", MODES, grad=False)
# Pallas does not track varying axes: check_vma=True is refused for it (see "validation").
CASES["pallas_forward[bv]"] = layouts_case("probs", dict(bias=True), dict(backend="pallas", chunk_size=8), "bv",
                                           ("mesh", "unchecked"))  # fmt: skip


def _vocab_parts() -> None:
    """``Backend.vocab_parts`` (the default) with the vocabulary sharded: each shard's 148
    columns (and a dense teacher's) as 128 and 20, the row statistics combined over the parts and
    then over the shards; against the unsharded call with each chunk as one array."""
    from dataclasses import replace

    import jax_kl.backends

    whole = replace(jax_kl.backends.resolve("xla"), vocab_parts=False)
    cases = (
        (None, dict(label_smoothing=0.1, z_loss_weight=0.1)),
        ("topk_log_probs", dict(weight_hard_loss=0.5)),
        ("logits", dict(beta=0.5, teacher_temperature=1.5, weight_hard_loss=0.5)),
    )
    for fmt, options in cases:
        mesh = _mesh()
        p = problem(fmt or "probs", v=296, k=12, bias=True)
        want_loss, want, _ = run(fmt, p, dict(options, chunk_size=6, backend=whole))
        for mode in MODES:
            loss, grads, _ = run(fmt, p, dict(options, chunk_size=6, backend="xla"), mode, "bv", mesh)
            close(f"{mode}: loss", loss, want_loss)
            for k, g in grads.items():
                close(f"{mode}: grad_{k}", g, want[k])


CASES["vocab_parts[bv]"] = _vocab_parts


def _row_weights() -> None:
    """Row weights sharded like the rows, in every mode; with ``mesh`` the row losses come back
    sharded like the rows, each vocabulary shard holding its rows' whole losses."""
    mesh = _mesh()
    p = {**problem("logits", bias=True), "row_weight": jnp.asarray(np.random.default_rng(3).uniform(0, 2, 16))}
    options = dict(beta=0.5, weight_hard_loss=0.5, z_loss_weight=0.1, chunk_size=5)
    want_loss, want, _ = run("logits", p, options)
    for mode in MODES:
        loss, grads, _ = run("logits", p, options, mode, "bv", mesh)
        close(f"{mode}: loss", loss, want_loss)
        for k, g in grads.items():
            close(f"{mode}: grad_{k}", g, want[k])
    f = loss_fn("logits", {**options, "return_row_losses": True})
    sp = specs(p, "logits", "b", "v")
    sharded = {k: jax.device_put(a, NamedSharding(mesh, sp[k])) for k, a in p.items()}
    rows = jax.jit(lambda a: f(a, mesh=mesh, batch_axis="b", vocab_axis="v")[1])(sharded)
    close("mesh: row losses", rows, f(p)[1])


CASES["row_weights[bv]"] = _row_weights


def _eager_mesh_places_its_inputs() -> None:
    """An eager ``mesh=`` call takes what a jitted one does: beside global arrays on the mesh,
    labels and row weights as ``jnp.asarray`` makes them (on the default device, not committed)
    or as NumPy arrays (on a mesh of explicit axes, where an eager ``shard_map`` refuses them);
    loss, row losses and ``grad_x`` of eager ``jax.value_and_grad`` equal the whole arrays'."""
    meshes = {"auto axes": (_mesh(), jnp.asarray)}
    if hasattr(jax.sharding, "AxisType") and hasattr(jax, "set_mesh"):
        devices = _mesh().devices
        explicit = jax.make_mesh(devices.shape, ("b", "v"), devices=devices.reshape(-1),
                                 axis_types=(jax.sharding.AxisType.Explicit,) * 2)  # fmt: skip
        meshes["explicit axes"] = (explicit, np.asarray)
    p = {**problem("logits"), "row_weight": jnp.asarray(np.random.default_rng(4).uniform(0, 2, 16))}
    f = loss_fn("logits", dict(weight_hard_loss=0.5, return_row_losses=True))  # one chunk: eager ops are slow
    sp = specs(p, "logits", "b", "v")
    (want_loss, want_rows), want_grad = jax.value_and_grad(lambda x: f({**p, "x": x}), has_aux=True)(p["x"])
    for kind, (mesh, make) in meshes.items():
        on_mesh = {k: jax.device_put(p[k], NamedSharding(mesh, sp[k])) for k in ("x", "weight", "target")}
        rest = {k: make(p[k]) for k in ("labels", "row_weight")}
        assert not getattr(rest["labels"], "committed", False)

        def sharded(x, on_mesh=on_mesh, rest=rest, mesh=mesh):
            return f({**on_mesh, **rest, "x": x}, mesh=mesh, batch_axis="b", vocab_axis="v")

        with contextlib.nullcontext() if kind == "auto axes" else jax.set_mesh(mesh):  # explicit axes ask for it
            (loss, rows), grad = jax.value_and_grad(sharded, has_aux=True)(on_mesh["x"])
        close(f"{kind}: loss", loss, want_loss)
        close(f"{kind}: row losses", rows, want_rows)
        close(f"{kind}: grad_x", grad, want_grad)
        # labels committed to one device: moved by neither jit nor the call, refused by name
        arrays = {**on_mesh, **rest, "labels": jax.device_put(p["labels"], mesh.devices.reshape(-1)[0])}
        _raises(functools.partial(f, arrays, mesh=mesh, batch_axis="b", vocab_axis="v"), "labels:", "device")


CASES["eager_mesh_places_its_inputs[bv]"] = _eager_mesh_places_its_inputs


def _auto_as_on_gpu() -> None:
    """ "auto" picks Pallas on a GPU: inside shard_map with check_vma=True it takes "xla" instead."""
    import jax_kl.backends

    on_gpu = jax_kl.backends._on_gpu
    jax_kl.backends._on_gpu = lambda: True
    try:
        layouts_case("probs", dict(bias=True), dict(chunk_size=8), "bv", MODES)()
    finally:
        jax_kl.backends._on_gpu = on_gpu


CASES["auto_as_on_gpu[bv]"] = _auto_as_on_gpu


def _hessian_vocab_sharded() -> None:
    """The ``"xla"`` backend's second derivatives with the vocabulary sharded (``mesh=``): the
    slices' statistics combine through a max that only shifts, so they differentiate again and
    equal the single-device Hessian."""
    p = problem("logits", bias=True)
    mesh = _mesh()

    def loss(bias, **layout):
        return jax_kl.fused_linear_kl_div(
            p["x"], p["weight"], p["target"], p["labels"], bias=bias, target_format="logits",
            weight_hard_loss=0.5, backend="xla", chunk_size=8, **layout,
        )  # fmt: skip

    want = jax.hessian(loss)(p["bias"])
    bias = jax.device_put(p["bias"], NamedSharding(mesh, P("v")))
    got = jax.jit(jax.hessian(lambda b: loss(b, mesh=mesh, batch_axis="b", vocab_axis="v")))(bias)
    close("hessian", got, want)


CASES["hessian_vocab_sharded[bv]"] = _hessian_vocab_sharded


def _raises(fn: Callable, *needles: str) -> None:
    try:
        fn()
    except ValueError as e:
        missing = [s for s in needles if s not in str(e)]
        assert not missing, f"error lacks {missing}: {e}"
        return
    raise AssertionError(f"no ValueError (expected one saying {needles})")


def _validation() -> None:
    mesh = _mesh()
    p = problem("probs")
    f = loss_fn("probs", {})
    if mesh.shape["v"] > 1:  # a 2-GPU mesh shards one axis
        odd_v = {**p, "weight": p["weight"][:23], "target": p["target"][:, :23]}
        _raises(lambda: f(odd_v, mesh=mesh, vocab_axis="v"), "weight:", "divisible")
    if mesh.shape["b"] > 1:
        odd_n = {k: p[k][:15] if k in ("x", "target", "labels") else p[k] for k in p}
        _raises(lambda: f(odd_n, mesh=mesh, batch_axis="b"), "x:", "divisible")
    _raises(lambda: f(p, mesh=mesh, batch_axis="rows"), "batch_axis:", "mesh's axes")
    _raises(lambda: f(p, mesh=mesh, batch_axis="b", vocab_axis="b"), "batch_axis, vocab_axis:")
    _raises(lambda: f(p, vocab_axis="v"), "vocab_axis:", "not an axis")
    _raises(lambda: loss_fn("probs", dict(backend="triton"))(p, mesh=mesh, batch_axis="b"), "backend:", "one device")
    sp = specs(p, "probs", "b", None)
    inside = jax.shard_map(lambda a: loss_fn("probs", dict(backend="triton"))(a, batch_axis="b"), mesh=mesh,
                           in_specs=(sp,), out_specs=P(), check_vma=False)  # fmt: skip
    _raises(lambda: inside(p), "backend:", "one device")
    for name in ("pallas", "pallas_triton"):  # every Pallas lowering, named in the error
        pallas = jax.shard_map(lambda a, name=name: loss_fn("probs", dict(backend=name))(a, batch_axis="b"),
                               mesh=mesh, in_specs=(sp,), out_specs=P(), check_vma=True)  # fmt: skip
        _raises(lambda pallas=pallas: pallas(p), f"backend: {name!r}", "check_vma=False")
    # x placed by JAX for the call (NumPy): the first array committed to a device stands for it
    devices = jax.devices()
    split = {**{k: np.asarray(a) for k, a in p.items()}, "weight": jax.device_put(p["weight"], devices[1]),
             "labels": jax.device_put(p["labels"], devices[0])}  # fmt: skip
    _raises(lambda: f(split), "labels:", "device of weight")
    if hasattr(jax.sharding, "AxisType"):  # a mesh of explicit axes: its arrays need mesh=
        explicit = jax.make_mesh(mesh.devices.shape, ("b", "v"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                                 devices=mesh.devices.reshape(-1))  # fmt: skip
        rows = {k: jax.device_put(a, NamedSharding(explicit, P("b") if k in ("x", "target", "labels") else P()))
                for k, a in p.items()}  # fmt: skip
        _raises(lambda: f(rows), "x:", "explicit axes ['b']", "mesh=")
        close("explicit mesh=", f(rows, mesh=explicit, batch_axis="b"), f(p))


CASES["validation"] = _validation


def main() -> None:
    out = sys.argv[1]
    assert jax.device_count() >= _mesh().size, f"{jax.device_count()} devices: set XLA_FLAGS before JAX starts"
    only = sys.argv[2:]  # case names, for running a few by hand
    results: dict[str, str | None] = {}
    for name, fn in CASES.items():
        if only and name not in only:
            continue
        try:
            fn()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    with open(os.path.join(out, "jax.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
