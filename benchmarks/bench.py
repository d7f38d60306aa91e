"""``python -m benchmarks.bench``: speed and memory of every implementation, side by side.

Run from the repository root, on a GPU for real numbers (``--quick`` runs tiny shapes on CPU).
In one process on one device, for each head (``benchmarks.shapes``: named after real models,
or ``HxV``) and row count ``N``, every implementation of :mod:`benchmarks.impls` runs forward +
backward of the ``--mode``'s loss (:mod:`benchmarks.modes`) on the same bf16 inputs. Reported per row:

* the median time, and its ratio to the GEMM floor of that shape (quote the ratio: it carries
  over between GPUs and clock speeds far better than a lone time), the floor timed around each
  of the implementation's timing rounds (:mod:`benchmarks.measure`);
* the effective TFLOP/s: the step's GEMM work, ``6 N H V`` (plus ``2 N H_t V`` for a teacher
  head's logits), over its median time; the floor's is the rate of those GEMMs alone;
* the peak memory beyond the inputs: torch's allocator peak above what was allocated before
  the row, plus the temporaries and outputs of the compiled JAX programs (XLA's memory
  analysis), since each framework's allocator is blind to the other's; and the same minus
  the gradients, i.e. what the loss costs beyond ``grad_x`` and ``grad_weight``;
* the relative error ``||g - ref|| / ||ref||`` of ``grad_weight`` and ``grad_x`` against the
  float64 reference, ``fused_kl.reference`` (made a block of rows at a time: ``modes.reference_grads``).

Rows that cannot fit (estimated beforehand) are skipped, rows that run out of memory are marked
``OOM``, and rows that fail are marked and printed: one bad row never ends the run. The table
is printed and ``results.json`` / ``results.md`` rewritten after every row, so a partial run
keeps its results; ``bench.png`` is drawn at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fused_kl_cli.cli import prepare_environment

from . import report
from .impls import Impl
from .measure import ROUNDS, Timing, measure, release, sync
from .modes import MODES, Inputs, make_inputs, make_weight, reference_grads
from .report import Row
from .shapes import DEFAULT, QUICK, SHAPES, Shape, parse_head

# do_bench's budgets: a second of timing after half a second of warm-up. A budget of a few steps
# lets the first timing after a row's setup read high (docs/design-notes.md, the bench's budgets).
DEFAULTS = {"heads": DEFAULT, "n": (2048, 4096, 8192, 16384, 32768), "timing": Timing(10, 1000.0, 500.0)}
# Tiny shapes and few repetitions: a smoke test on CPU. Seconds per row, except the Triton
# interpreter's rows (torch_kl/triton, jax_kl/triton: about 10 s each); pick --impls to skip them.
QUICK_DEFAULTS = {"heads": QUICK, "n": (64, 128), "timing": Timing(2, 20.0, 5.0)}
TIMING = (
    "torch on CUDA: do_bench median (CUDA events); JAX and CPU: wall-clock median; "
    f"x floor: median over {ROUNDS} rounds of time / mean of the floor timed just before and after"
)


@dataclasses.dataclass(frozen=True)
class Config:
    """What to measure and how long; from the command line."""

    mode: str
    heads: tuple[Shape, ...]
    n: tuple[int, ...]
    impls: tuple[str, ...]
    timing: Timing
    out_dir: Path


def _items(values: list[str]) -> list[str]:
    """Space- and comma-separated values, flattened."""
    return [item for value in values for item in value.split(",") if item]


def _positive(values: list[str], flag: str) -> list[int]:
    """Space- and comma-separated positive integers; ``ValueError`` naming ``flag`` otherwise."""
    items = _items(values)
    if not all(item.isdigit() and int(item) > 0 for item in items):
        raise ValueError(f"{flag}: expected positive integers, got {' '.join(values)!r}")
    return [int(item) for item in items]


def parse_args(argv: list[str] | None, impls: dict[str, Impl]) -> Config:
    """The command line as a :class:`Config`; ``--quick`` changes the defaults, not explicit flags."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench",
        description="Time and memory of the fused linear loss implementations against unfused baselines "
        "and the GEMM floor.",
    )
    parser.add_argument(
        "--mode", choices=list(MODES), default="kl",
        help="the loss: " + "; ".join(f"{m.name}: {m.about}" for m in MODES.values()) + " (default: kl)",
    )  # fmt: skip
    parser.add_argument("--n", nargs="+", help=f"rows N (default {' '.join(map(str, DEFAULTS['n']))})")
    parser.add_argument(
        "--heads", nargs="+",
        help=f"LM heads by name ({', '.join(SHAPES)}) or as HxV (default {' '.join(DEFAULT)})",
    )  # fmt: skip
    parser.add_argument(
        "--vocab", nargs="+",
        help="vocabulary sizes V replacing each head's (every head with every V), e.g. 50257,50304: "
        "unaligned vocabularies beside aligned ones",
    )  # fmt: skip
    parser.add_argument("--impls", nargs="+", help=f"subset of: {' '.join(impls)} (default all)")
    parser.add_argument("--reps", type=int, help="timed calls per row on the wall clock (JAX, CPU)")
    parser.add_argument("--rep-ms", type=float, help="do_bench's budget in ms per timing (torch on CUDA)")
    parser.add_argument("--warmup-ms", type=float, help="do_bench's warm-up in ms before each timing (torch on CUDA)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench_out"), help="where the results go")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions; runs on CPU")
    args = parser.parse_args(argv)

    base = QUICK_DEFAULTS if args.quick else DEFAULTS
    chosen = _items(args.impls or list(impls))
    unknown = sorted(set(chosen) - set(impls))
    if unknown:
        parser.error(f"--impls: unknown {', '.join(unknown)}; expected some of {', '.join(impls)}")
    try:
        heads = tuple(parse_head(h) for h in (_items(args.heads) if args.heads else base["heads"]))
        if args.vocab:
            vocab = _positive(args.vocab, "--vocab")
            heads = tuple(dict.fromkeys(parse_head(f"{head.h}x{v}") for head in heads for v in vocab))
        n = tuple(sorted(_positive(args.n, "--n"))) if args.n else base["n"]
    except ValueError as e:
        parser.error(str(e))
    timing = base["timing"]
    return Config(
        mode=args.mode,
        heads=heads,
        n=n,
        impls=tuple(name for name in impls if name in chosen),  # the registry's order: floor first
        timing=Timing(args.reps or timing.reps, args.rep_ms or timing.rep_ms, args.warmup_ms or timing.warmup_ms),
        out_dir=args.out_dir,
    )


def _floor_step(impls: dict[str, Impl], inputs: Inputs, cfg: Config) -> Callable[[], Any] | None:
    """The floor's warmed-up step, timed around every other row of this shape (if asked for)."""
    if "floor" not in cfg.impls:
        return None
    prepared = impls["floor"].make(inputs)
    sync("torch", prepared.step())
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


def progress_bar(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, unit="row", disable=None)  # None: no bar in a log, only the table


def run(cfg: Config, impls: dict[str, Impl], on_gpu: bool) -> list[Row]:
    """Every (head, N, implementation) row, printed and saved as it completes."""
    device = torch.device("cuda" if on_gpu else "cpu")
    mode = MODES[cfg.mode]
    # Where the files land says nothing about the measurement, and would name a machine path.
    config = dataclasses.asdict(cfg) | {"heads": [dataclasses.asdict(h) for h in cfg.heads]}
    del config["out_dir"]
    meta = report.describe(torch.cuda.get_device_name() if on_gpu else "cpu", config, TIMING)
    rows: list[Row] = []
    bar = progress_bar(len(cfg.heads) * len(cfg.n) * len(cfg.impls))
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    bar.write(f"{meta['device']}; {versions}; mode {mode.name}: {mode.about}", file=sys.stdout)
    bar.write(report.text_line(report.HEADER), file=sys.stdout)
    for head in cfg.heads:
        weight = make_weight(head.h, head.v, device)
        for n in cfg.n:
            inputs = make_inputs(mode, weight, n)
            ref = reference_grads(inputs)
            release()  # the reference's float64 temporaries
            floor_step = _floor_step(impls, inputs, cfg)
            for name in cfg.impls:
                bar.set_description(f"{head.name} N={n} {name}")
                floor = None if name == "floor" else floor_step
                row = Row(head.name, n, name, **measure(name, impls[name], inputs, ref, cfg.timing, on_gpu, floor))
                release()
                rows.append(row)
                if name == "floor" and row.ms:
                    row.x_floor = 1.0
                if row.ms:
                    row.tflops = inputs.flops / (row.ms * 1e9)  # ms * 1e9 = seconds * 1e12
                bar.write(report.text_line(report.cells(row)), file=sys.stdout)
                sys.stdout.flush()
                report.save(rows, meta, cfg.out_dir)
                bar.update()
            del inputs, ref, floor_step
            release()
    bar.close()
    return rows


def bench_environment(on_gpu: bool) -> None:
    """The command line's environment; on the CPU also JAX's platform, so JAX is timed where torch is."""
    prepare_environment(on_gpu)
    if not on_gpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; the arguments are those of ``python -m benchmarks.bench``."""
    on_gpu = torch.cuda.is_available()
    bench_environment(on_gpu)
    from .impls import build  # imports the backend registries, so triton and JAX: after the environment

    impls = build()
    cfg = parse_args(argv, impls)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    rows = run(cfg, impls, on_gpu)
    written = ["results.json", "results.md"]
    try:
        frameworks = {name: impls[name].framework for name in cfg.impls}
        report.plot(rows, cfg.heads, cfg.n, frameworks, cfg.mode, cfg.out_dir / "bench.png")
        written.append("bench.png")
    except ImportError as e:
        print(f"no plot: {e}", file=sys.stderr)
    print("wrote " + ", ".join(str(cfg.out_dir / name) for name in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
