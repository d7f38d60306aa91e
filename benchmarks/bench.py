"""``python -m fused_kl bench``: speed and memory of every implementation, side by side.

In one process on one device, for each head ``HxV`` and row count ``N``, every implementation
of :mod:`fused_kl.bench_impls` runs forward + backward on the same bf16 inputs. Reported per row:

* the median time, and its ratio to the GEMM floor of that shape (quote the ratio: it carries
  over between GPUs and clock speeds far better than a lone time). The floor is timed right
  before and after each of the implementation's timing rounds, and each round is divided by
  the mean of the two: the card's clock follows its temperature (the same GEMMs took 37 ms on
  a cool H200 and 40 ms after a minute of load), so a floor timed once, minutes earlier, would
  flatter it. torch on CUDA is timed with CUDA events (``triton.testing.do_bench``); JAX, and
  everything on CPU, by the wall clock around a synchronised call, median of ``--reps``;
* the peak memory beyond the inputs: torch's allocator peak above what was allocated before
  the row, plus the temporaries and outputs of the compiled JAX programs (XLA's memory
  analysis), since each framework's allocator is blind to the other's; and the same minus
  the gradients, i.e. what the loss costs beyond ``grad_x`` and ``grad_weight``;
* at the smallest ``N`` only, the relative error ``||g - ref|| / ||ref||`` of ``grad_weight``
  and ``grad_x`` against the unfused loss with fp32 logits.

Rows that cannot fit (estimated beforehand) are skipped, rows that run out of memory are marked
``OOM``, and rows that fail are marked and printed: one bad row never ends the run. The table
is printed and ``results.json`` / ``results.md`` rewritten after every row, so a partial run
keeps its results; ``bench.png`` is drawn at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from .bench_impls import IMPLS, Impl, Inputs, Skip, make_inputs, make_weight, reference_grads

GIB = 1 << 30
# Rows estimated to need more than this beyond their inputs are skipped without trying.
MAX_ESTIMATE_BYTES = 100 * GIB

DEFAULTS = {
    "heads": ((4096, 128256), (2048, 32000)),  # the llama-3 head and a smaller one
    "n": (2048, 4096, 8192, 16384, 32768),
    "reps": 10,
    "rep_ms": 200.0,
    "warmup_ms": 25.0,
}
# Tiny shapes and few repetitions: a smoke test that runs on CPU in well under two minutes.
# Timing rounds of each implementation, each between two timings of the floor.
ROUNDS = 2
QUICK = {"heads": ((64, 512), (32, 256)), "n": (64, 128), "reps": 3, "rep_ms": 20.0, "warmup_ms": 5.0}

HEADER = ("head", "N", "impl", "ms", "× floor", "peak GiB", "beyond grads GiB", "err grad_w", "err grad_x", "note")
WIDTHS = (12, 6, 16, 9, 8, 9, 17, 11, 11, 0)


@dataclasses.dataclass(frozen=True)
class Config:
    """What to measure and how long; from the command line."""

    heads: tuple[tuple[int, int], ...]  # (H, V)
    n: tuple[int, ...]
    impls: tuple[str, ...]
    reps: int  # timed calls of the wall clock (JAX, and anything on CPU)
    rep_ms: float  # do_bench's time budget for torch on CUDA
    warmup_ms: float
    out_dir: Path


@dataclasses.dataclass
class Row:
    """One (head, N, implementation) result; ``None`` where not measured."""

    head: str
    n: int
    impl: str
    status: str = "ok"  # "ok", "OOM", "skipped: why" or "failed: error"
    ms: float | None = None
    x_floor: float | None = None
    peak_gib: float | None = None
    beyond_grads_gib: float | None = None
    err_grad_weight: float | None = None
    err_grad_x: float | None = None


# ----------------------------------------------------------------------------- command line


def _items(values: list[str]) -> list[str]:
    """Space- and comma-separated values, flattened."""
    return [item for value in values for item in value.split(",") if item]


def _parse_head(text: str) -> tuple[int, int]:
    h, sep, v = text.lower().partition("x")
    if not (sep and h.isdigit() and v.isdigit()):
        raise ValueError(f"--heads: expected HxV such as 4096x128256, got {text!r}")
    return int(h), int(v)


def parse_args(argv: list[str] | None) -> Config:
    """The command line as a :class:`Config`; ``--quick`` changes the defaults, not explicit flags."""
    parser = argparse.ArgumentParser(
        prog="python -m fused_kl bench",
        description="Time and memory of the fused linear KL implementations against unfused baselines.",
    )
    parser.add_argument("--n", nargs="+", help=f"rows N (default {' '.join(map(str, DEFAULTS['n']))})")
    parser.add_argument("--heads", nargs="+", help="LM heads as HxV (default 4096x128256 2048x32000)")
    parser.add_argument("--impls", nargs="+", help=f"subset of: {' '.join(IMPLS)} (default all; -> for →)")
    parser.add_argument("--reps", type=int, help="timed calls per row on the wall clock (JAX, CPU)")
    parser.add_argument("--rep-ms", type=float, help="do_bench's budget in ms per row (torch on CUDA)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench_out"), help="where the results go")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions; runs on CPU")
    args = parser.parse_args(argv)

    base = QUICK if args.quick else DEFAULTS
    impls = [name.replace("->", "→") for name in _items(args.impls or list(IMPLS))]
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        parser.error(f"--impls: unknown {', '.join(unknown)}; expected some of {', '.join(IMPLS)}")
    try:
        heads = tuple(_parse_head(h) for h in _items(args.heads)) if args.heads else base["heads"]
        n = tuple(sorted(int(v) for v in _items(args.n))) if args.n else base["n"]
    except ValueError as e:
        parser.error(str(e))
    return Config(
        heads=heads,
        n=n,
        impls=tuple(name for name in IMPLS if name in impls),  # the registry's order: floor first
        reps=args.reps or base["reps"],
        rep_ms=args.rep_ms or base["rep_ms"],
        warmup_ms=base["warmup_ms"],
        out_dir=args.out_dir,
    )


# ----------------------------------------------------------------------------- measuring


def _sync(framework: str, out: Any) -> None:
    """Wait until ``out`` exists: JAX dispatches asynchronously, and so does CUDA."""
    if framework == "jax":
        import jax

        jax.block_until_ready(out)
    elif torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_wall_ms(step: Callable[[], Any], sync: Callable[[Any], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        sync(step())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def time_ms(impl: Impl, step: Callable[[], Any], cfg: Config, on_gpu: bool) -> float:
    """Median milliseconds of one ``step`` (already warmed up)."""
    if impl.framework == "torch" and on_gpu:
        from triton.testing import do_bench

        return do_bench(step, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median")
    return _median_wall_ms(step, functools.partial(_sync, impl.framework), cfg.reps)


def time_against_floor(
    impl: Impl, step: Callable[[], Any], floor_step: Callable[[], Any], cfg: Config, on_gpu: bool
) -> tuple[float, float]:
    """Median milliseconds of ``step`` and its median ratio to the floor timed around it."""
    floor = IMPLS["floor"]
    floors = [time_ms(floor, floor_step, cfg, on_gpu)]
    times = []
    for _ in range(ROUNDS):
        times.append(time_ms(impl, step, cfg, on_gpu))
        floors.append(time_ms(floor, floor_step, cfg, on_gpu))
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
    cfg: Config,
    on_gpu: bool,
    floor_step: Callable[[], Any] | None,
) -> dict:
    """Warm up; one step for the peak memory and the gradients' error; then the timing, against
    the floor's ``floor_step`` when there is one."""
    baseline = torch.cuda.memory_allocated() if on_gpu else 0
    prepared = impl.make(inputs)
    sync = functools.partial(_sync, impl.framework)
    sync(prepared.step())  # compiles, autotunes and warms up outside the measurements
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    grads = prepared.step()
    sync(grads)
    torch_peak = torch.cuda.max_memory_allocated() - baseline if on_gpu else 0
    fields: dict[str, Any] = {}
    if ref is not None and impl.gradients:
        fields["err_grad_x"], fields["err_grad_weight"] = (_rel_err(g, r) for g, r in zip(grads, ref, strict=True))
    del grads
    if on_gpu or prepared.programs:  # on CPU only XLA's share is known
        peak = torch_peak + _program_bytes(prepared.programs)
        fields["peak_gib"] = peak / GIB
        fields["beyond_grads_gib"] = (peak - inputs.grad_bytes) / GIB
    if floor_step is None:
        fields["ms"] = time_ms(impl, prepared.step, cfg, on_gpu)
    else:
        fields["ms"], fields["x_floor"] = time_against_floor(impl, prepared.step, floor_step, cfg, on_gpu)
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
    inputs: Inputs,
    ref: tuple[torch.Tensor, ...] | None,
    cfg: Config,
    on_gpu: bool,
    floor_step: Callable[[], Any] | None = None,
) -> dict:
    """The measured fields of one row, or its status when it cannot run; never raises."""
    impl = IMPLS[name]
    if impl.gpu_only and not on_gpu:
        return {"status": "skipped: needs a CUDA GPU"}
    estimate = impl.estimate_bytes(inputs)
    if estimate > MAX_ESTIMATE_BYTES:
        return {"status": f"skipped: needs ~{estimate / GIB:.0f} GiB"}
    try:
        return _measure(impl, inputs, ref, cfg, on_gpu, floor_step)
    except Skip as e:
        return {"status": f"skipped: {e}"}
    except Exception as e:
        if _is_oom(e):
            return {"status": "OOM"}
        message = f"{type(e).__name__}: {e}"
        print(f"{name} failed: {message[:2000]}", file=sys.stderr, flush=True)
        return {"status": f"failed: {message.splitlines()[0][:120]}"}


def _release() -> None:
    """Free what the last row left: its tensors die with it, the allocator's cache does not."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- reporting


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _cells(row: Row) -> tuple[str, ...]:
    return (
        row.head,
        str(row.n),
        row.impl,
        _fmt(row.ms, ".4g"),
        _fmt(row.x_floor, ".2f"),
        _fmt(row.peak_gib, ".3g"),
        _fmt(row.beyond_grads_gib, ".3g"),
        _fmt(row.err_grad_weight, ".1e"),
        _fmt(row.err_grad_x, ".1e"),
        "" if row.status == "ok" else row.status,
    )


def _text_line(cells: tuple[str, ...]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, WIDTHS, strict=True)).rstrip()


def markdown(rows: list[Row]) -> str:
    """The table of ``rows`` in Markdown."""
    lines = [HEADER, tuple("---" for _ in HEADER), *(_cells(r) for r in rows)]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def describe(cfg: Config, on_gpu: bool) -> dict:
    """What the numbers were measured on and with."""
    packages = ("torch", "triton", "jax", "jaxlib", "liger-kernel")
    return {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "versions": {p: _version(p) for p in packages},
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items()},
        "timing": (
            "torch on CUDA: do_bench median (CUDA events); JAX and CPU: wall-clock median; "
            f"x floor: median over {ROUNDS} rounds of time / mean of the floor timed just before and after"
        ),
    }


def save(rows: list[Row], meta: dict, out_dir: Path) -> None:
    """(Re)write ``results.json`` and ``results.md`` with every row so far."""
    payload = {"meta": meta, "rows": [dataclasses.asdict(r) for r in rows]}
    (out_dir / "results.json").write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / "results.md").write_text(markdown(rows), encoding="utf-8")


def plot(rows: list[Row], cfg: Config, path: Path) -> None:
    """Time and memory against N, one panel pair per head, one line per implementation.

    An implementation keeps its colour and marker in every panel; JAX rows are dashed.
    """
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    heads = [f"{h}x{v}" for h, v in cfg.heads]
    fig = Figure(figsize=(14, 5 * len(heads)), layout="constrained")
    axes = fig.subplots(len(heads), 2, squeeze=False)
    for i, impl in enumerate(cfg.impls):
        style = {
            "color": colormaps["tab20"](i % 20),
            "marker": "os^vD<>ph*XP"[i % 12],
            "linestyle": "--" if IMPLS[impl].framework == "jax" else "-",
            "label": impl,
        }
        for (ax_time, ax_mem), head in zip(axes, heads, strict=True):
            mine = [r for r in rows if r.head == head and r.impl == impl]
            for ax, field in ((ax_time, "ms"), (ax_mem, "peak_gib")):
                points = [(r.n, getattr(r, field)) for r in mine if (getattr(r, field) or 0) > 0]
                if points:
                    ax.plot(*zip(*points, strict=True), **style)
    for (ax_time, ax_mem), head in zip(axes, heads, strict=True):
        ax_time.set(title=f"head {head}: forward + backward", ylabel="ms (median)")
        ax_mem.set(title=f"head {head}: peak memory beyond the inputs", ylabel="GiB")
        for ax in (ax_time, ax_mem):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(cfg.n, [str(n) for n in cfg.n])
            ax.set_xlabel("N (rows)")
            ax.grid(True, which="both", alpha=0.3)
    legend: dict[str, Any] = {}  # one entry per implementation drawn anywhere
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(legend.values(), legend.keys(), loc="outside right upper")
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------- driver


def _floor_step(inputs: Inputs, cfg: Config) -> Callable[[], Any] | None:
    """The floor's warmed-up step, timed around every other row of this shape (if asked for)."""
    if "floor" not in cfg.impls:
        return None
    prepared = IMPLS["floor"].make(inputs)
    _sync("torch", prepared.step())
    return prepared.step


class _NoBar:
    """Stands in for the progress bar where tqdm is not installed: the table still prints."""

    def set_description(self, desc: str) -> None:
        pass

    def update(self) -> None:
        pass

    def close(self) -> None:
        pass

    @staticmethod
    def write(line: str, file: Any = None) -> None:
        print(line, file=file)


def _progress_bar(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="row", disable=None)  # None: no bar in a log, only the table


def run(cfg: Config, on_gpu: bool) -> list[Row]:
    """Every (head, N, implementation) row, printed and saved as it completes."""
    device = torch.device("cuda" if on_gpu else "cpu")
    meta = describe(cfg, on_gpu)
    rows: list[Row] = []
    bar = _progress_bar(len(cfg.heads) * len(cfg.n) * len(cfg.impls))
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    bar.write(f"{meta['device']}; {versions}", file=sys.stdout)
    bar.write(_text_line(HEADER), file=sys.stdout)
    for h, v in cfg.heads:
        weight = make_weight(h, v, device)
        for n in cfg.n:
            inputs = make_inputs(weight, n)
            ref = reference_grads(inputs) if n == cfg.n[0] else None  # only the smallest N, to save time
            floor_step = _floor_step(inputs, cfg)
            for name in cfg.impls:
                bar.set_description(f"{h}x{v} N={n} {name}")
                row = Row(
                    f"{h}x{v}",
                    n,
                    name,
                    **measure(name, inputs, ref, cfg, on_gpu, None if name == "floor" else floor_step),
                )
                _release()
                rows.append(row)
                if name == "floor" and row.ms:
                    row.x_floor = 1.0
                bar.write(_text_line(_cells(row)), file=sys.stdout)
                sys.stdout.flush()
                save(rows, meta, cfg.out_dir)
                bar.update()
            del inputs, ref, floor_step
            _release()
    bar.close()
    return rows


def _prepare_environment(on_gpu: bool) -> None:
    """Before JAX and Triton are imported: share the GPU with torch; on CPU, interpret the kernels."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; the arguments are those of ``python -m fused_kl bench``."""
    cfg = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    _prepare_environment(on_gpu)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    rows = run(cfg, on_gpu)
    written = ["results.json", "results.md"]
    try:
        plot(rows, cfg, cfg.out_dir / "bench.png")
        written.append("bench.png")
    except ImportError as e:
        print(f"no plot: {e}", file=sys.stderr)
    print("wrote " + ", ".join(str(cfg.out_dir / name) for name in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
