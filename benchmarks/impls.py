"""The implementations that ``python -m benchmarks.bench`` compares.

Each implementation is a factory: given one shape's :class:`~benchmarks.modes.Inputs` it returns
a :class:`Prepared` whose ``step()`` runs forward and backward once and returns
``(grad_x, grad_weight)`` in its own framework. Packages are imported only when a factory runs,
so a missing one (or a compile error) costs that row alone; a factory raises :class:`Skip` where
it has no version of the mode.

The anchors: the GEMM floor, the unfused loss (eager and ``torch.compile``, and jnp under XLA
where written), and Liger's fused losses where one computes the mode's loss (``liger``; against a
teacher head also its chunked JSD loss, ``liger-chunked``). The library: one
row per backend of ``torch_kl.backends.REGISTRY`` and of ``jax_kl.backends.REGISTRY``, plus
each package's default backend with fp32 accumulation and with the low-memory chunk size
(``torch_kl-fp32``, ``-lowmem``, ``jax_kl-fp32``, ``-lowmem``), and
the A/B rows that price one optimisation each: ``torch_kl/triton-cublas-logits`` (no fused
logits GEMM), ``-unfactored`` (``dL/dz`` written by ``finish``), ``-unchecked`` (no eager value
checks), ``-whole-vocab-gemms`` (at an unaligned vocabulary, each cuBLAS GEMM over every column
at once), ``jax_kl/pallas-cublas``, ``pallas_triton-cublas`` (XLA's Triton GEMMs off) and
``jax_kl/pallas-whole-vocab`` (at an unaligned vocabulary, the chunk as one array over every
column), ``-label-in-dz`` (both frameworks: the hard term's label entries written into ``dL/dz``);
``jax_kl/pallas-xla-add`` (each chunk's ``grad_weight`` added by XLA, not in place),
``jax_kl/pallas-xla-label-rows`` (the label's term of ``grad_weight`` by XLA's segment sum); and
what the loss's options cost: ``torch_kl/triton+row-weights`` and ``jax_kl/pallas+row-weights``
(a weight per row, the per-row losses returned), ``+z-loss`` (cross-entropy only). A variant of a
backend is its resolved value with fields replaced (``dataclasses.replace``), passed as
``backend=``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from . import unfused
from .modes import Inputs, Mode
from .unfused import LossFn


class Skip(Exception):
    """An implementation that cannot run here, or has no version of the mode; the message says why."""


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One implementation ready to run on one shape."""

    step: Callable[[], tuple[Any, Any]]
    # Compiled JAX programs the step runs: their memory is invisible to torch's allocator.
    programs: tuple[Any, ...] = ()
    # False where the step's memory lives where neither torch's peak counter nor XLA's memory
    # analysis sees it (torch_kl's bridge into JAX): the peak is then left blank.
    memory_seen: bool = True
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Impl:
    """A row of the benchmark."""

    framework: str  # "torch" or "jax": how it is timed and synchronised
    make: Callable[[Inputs], Prepared]
    # Bytes held per element of the [N, V] logits at peak, to skip what cannot fit.
    bytes_per_logit: int = 0
    gpu_only: bool = False
    # False where the step's outputs are gradient-shaped but not the loss's gradients.
    gradients: bool = True

    def estimate_bytes(self, inputs: Inputs) -> int:
        """Rough peak beyond the inputs: logit-sized temporaries plus gradients and their accumulators."""
        return inputs.n * inputs.v * self.bytes_per_logit + 2 * inputs.grad_bytes


def floor(inputs: Inputs) -> Prepared:
    """The head's three GEMMs alone, into a preallocated ``[N, V]`` buffer (and the teacher head's
    GEMM first, where the teacher is a head): no kernel can beat this."""
    x, w = inputs.x, inputs.weight
    z = torch.empty(inputs.n, inputs.v, dtype=x.dtype, device=x.device)
    teacher = inputs.arrays.get("teacher_weight")
    zt = None if teacher is None else torch.empty_like(z)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        if zt is not None:
            torch.mm(inputs.arrays["target"], teacher.T, out=zt)
        torch.mm(x, w.T, out=z)
        return z @ w, z.T @ x

    return Prepared(step)


def _autograd(get_loss: Callable[[Mode], LossFn]) -> Callable[[Inputs], Prepared]:
    """A torch loss under ``torch.autograd.grad``; ``get_loss(mode)`` runs when the row starts."""

    def make(inputs: Inputs) -> Prepared:
        loss = get_loss(inputs.mode)
        x = inputs.x.detach().requires_grad_()
        w = inputs.weight.detach().requires_grad_()
        return Prepared(lambda: torch.autograd.grad(loss(x, w, inputs.arrays), (x, w)))

    return make


def _jitted(get_loss: Callable[[Mode], LossFn], options: dict[str, Any] | None = None) -> Callable[[Inputs], Prepared]:
    """A JAX loss under ``jit(value_and_grad)``, compiled once per shape (with XLA's compiler
    ``options``), the arrays arguments."""

    def make(inputs: Inputs) -> Prepared:
        import jax

        loss = get_loss(inputs.mode)
        args = inputs.jax
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile(options)
        return Prepared(lambda: compiled(*args)[1], programs=(compiled,))

    return make


def _unfused(table: dict[str, LossFn], mode: Mode) -> LossFn:
    if mode.name not in table:
        raise Skip(f"no unfused version of mode {mode.name!r} here")
    return table[mode.name]


@functools.cache
def _compiled_unfused(mode_name: str) -> LossFn:
    # One wrapper per mode for every shape, so dynamo's shape cache and recompile limit are shared.
    return torch.compile(unfused.TORCH[mode_name])


def liger_module(name: str) -> Any:
    """Liger's module ``name``; a row without Liger is skipped, saying why."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise Skip(f"{name} is not importable ({e})") from None


def _liger(mode: Mode, accum_dtype: torch.dtype | None = None) -> LossFn:
    """Liger's fused loss of the mode, where it has one: the KL against probabilities, the JSD
    family against a teacher head (``jsd_beta`` 0: forward KL, 1: reverse), and the cross-entropy."""
    liger = liger_module("liger_kernel.transformers")
    if mode.name == "kl":
        kl = liger.LigerFusedLinearKLDivLoss(accum_dtype=accum_dtype)
        return lambda x, w, a: kl(x, w, a["target"])
    if mode.teacher == "hidden":
        jsd = liger.LigerFusedLinearJSD(jsd_beta=mode.beta, accum_dtype=accum_dtype)
        return lambda x, w, a: jsd(x, w, a["target"], a["teacher_weight"], None)
    if mode.teacher is None:
        ce = liger.LigerFusedLinearCrossEntropyLoss(accum_dtype=accum_dtype, **mode.options)
        return lambda x, w, a: ce(w, x, a["labels"])
    raise Skip(f"Liger has no fused loss for mode {mode.name!r}")


def _liger_chunked(mode: Mode) -> LossFn:
    """Liger's chunked distillation loss (``chunked_loss.LigerFusedLinearJSDLoss``: per chunk of
    rows, the logits and their loss under ``torch.compile``, gradients by ``torch.func``) against
    a teacher head, soft term only; it takes labels for its hard term, here weighted 0."""
    if mode.teacher != "hidden":
        raise Skip(f"Liger's chunked JSD takes a teacher head; mode {mode.name!r} has none")
    chunked = liger_module("liger_kernel.chunked_loss")
    jsd = chunked.LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=mode.beta)
    labels: dict[int, torch.Tensor] = {}

    def loss(x: torch.Tensor, w: torch.Tensor, a: dict[str, torch.Tensor]) -> torch.Tensor:
        if x.shape[0] not in labels:  # made once per shape, outside the timed steps
            labels[x.shape[0]] = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        return jsd(x, w, a["target"], a["teacher_weight"], labels[x.shape[0]])

    return loss


def _fused(package: str, mode: Mode, **options: Any) -> LossFn:
    """``fused_linear_kl_div`` (``fused_linear_cross_entropy`` without a teacher) of ``torch_kl`` or ``jax_kl``."""
    api = importlib.import_module(package)
    if mode.teacher is None:
        return lambda x, w, a: api.fused_linear_cross_entropy(
            x, w, a["labels"], **{k: v for k, v in a.items() if k != "labels"}, **mode.options, **options
        )
    return lambda x, w, a: api.fused_linear_kl_div(x, w, **a, **mode.options, **options)


def _jax_kl_variant(**fields: Any) -> Callable[[Mode], LossFn]:
    """``jax_kl``'s ``"pallas"`` backend with some ``Backend`` fields replaced."""

    def get_loss(mode: Mode) -> LossFn:
        from jax_kl import backends

        return _fused("jax_kl", mode, backend=dataclasses.replace(backends.resolve("pallas"), **fields))

    return get_loss


def _with_row_weights(package: str, backend: str, mode: Mode) -> LossFn:
    """``backend`` with a weight per row and the per-row losses returned: what the two cost, priced
    beside the plain call. The weights (0.5 to 1.5) are made inside the call: ``N`` values. The
    row losses enter the value at weight 0, so that XLA cannot drop them."""
    loss = _fused(package, mode, backend=backend, return_row_losses=True)
    if package == "torch_kl":

        def weights(x: Any) -> Any:
            return torch.arange(x.shape[0], device=x.device).remainder(5).mul(0.25).add(0.5)
    else:
        import jax.numpy as jnp

        def weights(x: Any) -> Any:
            return (jnp.arange(x.shape[0]) % 5) * 0.25 + 0.5

    def with_rows(x: Any, w: Any, a: dict[str, Any]) -> Any:
        value, rows = loss(x, w, a | {"row_weight": weights(x)})
        return value + 0.0 * rows.sum()

    return with_rows


def _with_z_loss(package: str, backend: str, mode: Mode) -> LossFn:
    """``backend`` with a z-loss term (cross-entropy only: the z-loss rides on the hard term)."""
    if mode.teacher is not None:
        raise Skip("z-loss is priced on cross-entropy (mode ce)")
    return _fused(package, mode, backend=backend, z_loss_weight=1e-4)


def _registry(package: str) -> tuple[str, ...]:
    """The backend names of a package's registry; none where its framework is not installed."""
    try:
        return tuple(importlib.import_module(f"{package}.backends").REGISTRY)
    except ImportError:
        return ()


def _torch_kl(backend: Any) -> Impl:
    """``torch_kl`` with ``backend``: a name, or a resolved ``Backend`` value."""
    make = _autograd(lambda mode: _fused("torch_kl", mode, backend=backend))
    if backend != "pallas":
        return Impl("torch", make)

    def bridged(inputs: Inputs) -> Prepared:
        note = "no peak: the bridge's JAX buffers are not seen"
        return dataclasses.replace(make(inputs), memory_seen=False, note=note)

    return Impl("torch", bridged)


def _torch_kl_variant(**fields: Any) -> Callable[[Inputs], Prepared]:
    """The Triton backend with some ``Backend`` fields replaced (a kernel None: cuBLAS or the row
    kernels run instead): what they save, priced in one run."""

    def make(inputs: Inputs) -> Prepared:
        from torch_kl import backends

        triton = backends.resolve("triton", inputs.x.device)
        return _torch_kl(dataclasses.replace(triton, **fields)).make(inputs)

    return make


def _torch_kl_unchecked(inputs: Inputs) -> Prepared:
    """The Triton backend without the eager value check of labels and top-k indices (as under
    ``torch.compile``, where values are not read): what the check costs, priced in one run."""
    from torch_kl import validate

    prepared = _torch_kl("triton").make(inputs)
    concrete = validate._concrete

    def step() -> tuple[Any, Any]:
        validate._concrete = lambda: False
        try:
            return prepared.step()
        finally:
            validate._concrete = concrete

    return dataclasses.replace(prepared, step=step)


def build() -> dict[str, Impl]:
    """Every implementation, by name, the floor first (the registries are imported here)."""
    impls = {
        "floor": Impl("torch", floor, bytes_per_logit=2, gradients=False),
        "eager": Impl("torch", _autograd(functools.partial(_unfused, unfused.TORCH)), bytes_per_logit=20),
        "compile": Impl(
            "torch", _autograd(lambda mode: _compiled_unfused(mode.name)), bytes_per_logit=10, gpu_only=True
        ),
        "liger": Impl("torch", _autograd(_liger), gpu_only=True),
        "liger-fp32": Impl("torch", _autograd(functools.partial(_liger, accum_dtype=torch.float32)), gpu_only=True),
        "liger-chunked": Impl("torch", _autograd(_liger_chunked), gpu_only=True),
        "xla": Impl("jax", _jitted(functools.partial(_unfused, unfused.JAX)), bytes_per_logit=16),
    }
    impls |= {f"torch_kl/{name}": _torch_kl(name) for name in _registry("torch_kl")}
    impls |= {
        "torch_kl-fp32": Impl("torch", _autograd(lambda mode: _fused("torch_kl", mode, accum_dtype=torch.float32))),
        # The documented low-memory setting.
        "torch_kl-lowmem": Impl("torch", _autograd(lambda mode: _fused("torch_kl", mode, chunk_size=1024))),
    }
    impls |= {
        f"jax_kl/{name}": Impl("jax", _jitted(functools.partial(_fused, "jax_kl", backend=name)))
        for name in _registry("jax_kl")
    }
    if "jax_kl/pallas" in impls:
        impls |= {
            "jax_kl-fp32": Impl("jax", _jitted(functools.partial(_fused, "jax_kl", accum_dtype="float32"))),
            "jax_kl-lowmem": Impl("jax", _jitted(functools.partial(_fused, "jax_kl", chunk_size=1024))),
        }
    if "triton" in _registry("torch_kl"):
        # cuBLAS logits, then the `stats` and `finish` kernels: the comparison that prices both fusions
        impls["torch_kl/triton-cublas-logits"] = Impl(
            "torch", _torch_kl_variant(fused_logits=None, plain_logits=None, factored=None, factored_topk=None)
        )
        # the statistics in the GEMM's epilogue, `dL/dz` written by `finish` (cross-entropy: not factored)
        impls["torch_kl/triton-unfactored"] = Impl("torch", _torch_kl_variant(factored=None, factored_topk=None))
        # at an unaligned vocabulary, each cuBLAS GEMM over every column at once (--vocab)
        impls["torch_kl/triton-whole-vocab-gemms"] = Impl("torch", _torch_kl_variant(split_vocab_gemms=False))
        impls["torch_kl/triton-unchecked"] = Impl("torch", _torch_kl_unchecked)
        # the label's entries written into dL/dz by `finish` (chunks that do not factor)
        impls["torch_kl/triton-label-in-dz"] = Impl("torch", _torch_kl_variant(label_apart=False))
    for package, backend, wrap in (("torch_kl", "triton", _autograd), ("jax_kl", "pallas", _jitted)):
        if f"{package}/{backend}" in impls:
            framework = "torch" if package == "torch_kl" else "jax"
            impls[f"{package}/{backend}+row-weights"] = Impl(
                framework, wrap(functools.partial(_with_row_weights, package, backend)), gradients=False
            )
            z_loss = functools.partial(_with_z_loss, package, backend)
            impls[f"{package}/{backend}+z-loss"] = Impl(framework, wrap(z_loss), gradients=False)
    if "jax_kl/pallas" in impls:
        # at an unaligned vocabulary, the chunk as one array over every column (--vocab)
        impls["jax_kl/pallas-whole-vocab"] = Impl("jax", _jitted(_jax_kl_variant(vocab_parts=False)))
        # the cross-entropy's chunks through the row phases (stats, finish), not factored
        impls["jax_kl/pallas-unfactored"] = Impl("jax", _jitted(_jax_kl_variant(factored=None)))
        # every chunk's row phases on XLA: prices the Mosaic GPU phases (at an unaligned vocabulary
        # with a dense teacher, the default already runs that chunk's phases on XLA)
        impls["jax_kl/pallas-xla-phases"] = Impl("jax", _jitted(_jax_kl_variant(mosaic_phases=None)))
        # the label's entries written into dL/dz by `finish`
        impls["jax_kl/pallas-label-in-dz"] = Impl("jax", _jitted(_jax_kl_variant(label_apart=False)))
        # each chunk's grad_weight added by XLA, not the in-place kernel: prices mosaic_accumulate
        impls["jax_kl/pallas-xla-add"] = Impl("jax", _jitted(_jax_kl_variant(in_place_grad_weight=None)))
        # the label's term of grad_weight by XLA's segment sum: prices mosaic_label_rows
        impls["jax_kl/pallas-xla-label-rows"] = Impl("jax", _jitted(_jax_kl_variant(in_place_label_rows=None)))
    # XLA folds each chunk's `acc + g^T x` into a cuBLAS GEMM (beta = 1) only when its own Triton
    # GEMMs are off: `pallas_triton-cublas` shows that fold. `pallas-cublas` is what a user's
    # jit(compiler_options=...) gets on the default backend, which cannot see the option and still
    # adds in place (docs/choosing.md).
    no_triton_gemm = {"xla_gpu_enable_triton_gemm": False}
    for name in ("pallas", "pallas_triton"):
        if f"jax_kl/{name}" in impls:
            loss = functools.partial(_fused, "jax_kl", backend=name)
            impls[f"jax_kl/{name}-cublas"] = Impl("jax", _jitted(loss, no_triton_gemm))
    return impls
