"""Measuring one row of the benchmark: time against the GEMM floor, peak memory, gradient error.

The floor is timed right before and after each of the implementation's timing rounds, and
each round is divided by the mean of the two: the card's clock follows its temperature (the
same GEMMs took 37 ms on a cool H200 and 40 ms after a minute of load), so a floor timed once,
minutes earlier, would flatter it. torch on CUDA is timed with CUDA events
(``triton.testing.do_bench``); JAX, and everything on CPU, by the wall clock around a
synchronised call.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from fused_kl.checks import BackendUnavailable

from .impls import Impl, Skip
from .modes import Inputs

GIB = 1 << 30
# Rows estimated to need more than this beyond their inputs are skipped without trying.
MAX_ESTIMATE_BYTES = 100 * GIB
# Timing rounds of each implementation, each between two timings of the floor.
ROUNDS = 2


@dataclasses.dataclass(frozen=True)
class Timing:
    """How long to time: ``reps`` wall-clock calls (JAX, and anything on CPU); ``rep_ms`` and
    ``warmup_ms``: ``do_bench``'s budgets (torch on CUDA)."""

    reps: int
    rep_ms: float
    warmup_ms: float


def sync(framework: str, out: Any) -> None:
    """Wait until ``out`` exists: JAX dispatches asynchronously, and so does CUDA."""
    if framework == "jax":
        import jax

        jax.block_until_ready(out)
    elif torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_wall_ms(step: Callable[[], Any], done: Callable[[Any], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        done(step())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def time_ms(framework: str, step: Callable[[], Any], timing: Timing, on_gpu: bool) -> float:
    """Median milliseconds of one ``step`` (already warmed up)."""
    if framework == "torch" and on_gpu:
        from triton.testing import do_bench

        return do_bench(step, warmup=timing.warmup_ms, rep=timing.rep_ms, return_mode="median")
    return _median_wall_ms(step, functools.partial(sync, framework), timing.reps)


def time_against_floor(
    framework: str, step: Callable[[], Any], floor_step: Callable[[], Any], timing: Timing, on_gpu: bool,
    rounds: int = ROUNDS,
) -> tuple[float, float]:  # fmt: skip
    """Median milliseconds of ``step`` and its median ratio to the (torch) floor timed around each
    of its ``rounds`` timings."""
    floors = [time_ms("torch", floor_step, timing, on_gpu)]
    times = []
    for _ in range(rounds):
        times.append(time_ms(framework, step, timing, on_gpu))
        floors.append(time_ms("torch", floor_step, timing, on_gpu))
    ratios = [t / ((before + after) / 2) for t, before, after in zip(times, floors, floors[1:], strict=False)]
    return statistics.median(times), statistics.median(ratios)


def _program_bytes(programs: tuple[Any, ...]) -> int:
    """Temporaries and outputs of compiled JAX programs, as XLA plans them."""
    stats = [p.memory_analysis() for p in programs]
    return sum(s.temp_size_in_bytes + s.output_size_in_bytes for s in stats if s is not None)


def _rel_err(grad: Any, ref: torch.Tensor) -> float:
    grad = grad if isinstance(grad, torch.Tensor) else torch.from_dlpack(grad)
    return (torch.linalg.vector_norm(grad.float() - ref) / torch.linalg.vector_norm(ref)).item()


def _measure(
    impl: Impl,
    inputs: Inputs,
    ref: tuple[torch.Tensor, ...] | None,
    timing: Timing,
    on_gpu: bool,
    floor_step: Callable[[], Any] | None,
) -> dict:
    """Warm up; one step for the peak memory and the gradients' error; then the timing, against
    the floor's ``floor_step`` when there is one."""
    baseline = torch.cuda.memory_allocated() if on_gpu else 0
    prepared = impl.make(inputs)
    done = functools.partial(sync, impl.framework)
    done(prepared.step())  # compiles, autotunes and warms up outside the measurements
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    grads = prepared.step()
    done(grads)
    torch_peak = torch.cuda.max_memory_allocated() - baseline if on_gpu else 0
    fields: dict[str, Any] = {"note": prepared.note} if prepared.note else {}
    if ref is not None and impl.gradients:
        fields["err_grad_x"], fields["err_grad_weight"] = (_rel_err(g, r) for g, r in zip(grads, ref, strict=True))
    del grads
    if prepared.memory_seen and (on_gpu or prepared.programs):  # on CPU only XLA's share is known
        peak = torch_peak + _program_bytes(prepared.programs)
        fields["peak_gib"] = peak / GIB
        fields["beyond_grads_gib"] = (peak - inputs.grad_bytes) / GIB
    if floor_step is None:
        fields["ms"] = time_ms(impl.framework, prepared.step, timing, on_gpu)
    else:
        fields["ms"], fields["x_floor"] = time_against_floor(impl.framework, prepared.step, floor_step, timing, on_gpu)
    return fields


def _is_oom(error: Exception) -> bool:
    """torch's OOM, XLA's (also what a callback's torch OOM becomes inside a JAX program)."""
    text = str(error)
    return (
        isinstance(error, torch.cuda.OutOfMemoryError)
        or "RESOURCE_EXHAUSTED" in text
        or "out of memory" in text.lower()
    )


def measure(
    name: str,
    impl: Impl,
    inputs: Inputs,
    ref: tuple[torch.Tensor, ...] | None,
    timing: Timing,
    on_gpu: bool,
    floor_step: Callable[[], Any] | None = None,
) -> dict:
    """The measured fields of one row, or its status when it cannot run; never raises."""
    if impl.gpu_only and not on_gpu:
        return {"status": "skipped: needs a CUDA GPU"}
    estimate = impl.estimate_bytes(inputs)
    if estimate > MAX_ESTIMATE_BYTES:
        return {"status": f"skipped: needs ~{estimate / GIB:.0f} GiB"}
    try:
        return _measure(impl, inputs, ref, timing, on_gpu, floor_step)
    except Exception as e:
        return failure_status(name, e)


def failure_status(name: str, e: Exception) -> dict[str, str]:
    """The status of a row that raised ``e``: skipped (saying why), out of memory, or failed (the
    error printed to stderr too)."""
    if isinstance(e, Skip):
        return {"status": f"skipped: {e}"}
    if isinstance(e, BackendUnavailable):
        return {"status": f"skipped: {e.why[:120]}"}
    if _is_oom(e):
        return {"status": "OOM"}
    message = f"{type(e).__name__}: {e}"
    print(f"{name} failed: {message[:2000]}", file=sys.stderr, flush=True)
    return {"status": f"failed: {message.splitlines()[0][:120]}"}


def release() -> None:
    """Free what the last row left: its tensors die with it, the allocator's cache does not."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
