"""Variants compared in interleaved rounds: each round times every implementation once, each
timing between two timings of the three-GEMM floor, so that the card's clock drift (a few per cent
over a minute) falls on all of them alike. The bench (``python -m benchmarks.bench``) times one
implementation after another; this is for A/B comparisons of a few per cent.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m benchmarks.interleave --mode ce --rounds 8 \\
        --impls torch_kl/triton torch_kl/triton-unfactored torch_kl/triton-cublas-logits

Prints each round and a table of medians [min–max] × floor; writes ``interleave.md`` and
``interleave.png`` (the ratios by round) to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from .bench import bench_environment, progress_bar
from .measure import Timing, sync, time_against_floor
from .modes import MODES, make_inputs, make_weight
from .shapes import parse_head


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.interleave", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=list(MODES), default="kl")
    parser.add_argument("--n", type=int, default=8192, help="rows N (default 8192)")
    parser.add_argument("--head", default="llama3-8b", help="LM head by name or as HxV (default llama3-8b)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--impls", nargs="+", required=True, help="bench implementations (torch ones)")
    parser.add_argument("--rep-ms", type=float, default=300.0, help="do_bench's budget per timing (GPU)")
    parser.add_argument("--out-dir", type=Path, default=Path("."))
    parser.add_argument("--quick", action="store_true", help="a tiny head, 64 rows, 2 rounds: runs on CPU")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    on_gpu = torch.cuda.is_available()
    bench_environment(on_gpu)
    from .impls import build

    impls = build()
    unknown = [name for name in args.impls if name not in impls or impls[name].framework != "torch"]
    if unknown:
        print(f"--impls: not torch implementations of the bench: {', '.join(unknown)}", file=sys.stderr)
        return 2
    head = parse_head("32x256" if args.quick else args.head)
    n, rounds = (64, min(args.rounds, 2)) if args.quick else (args.n, args.rounds)
    timing = Timing(reps=3 if args.quick else 10, rep_ms=args.rep_ms, warmup_ms=50)
    inputs = make_inputs(MODES[args.mode], make_weight(head.h, head.v, torch.device("cuda" if on_gpu else "cpu")), n)
    steps = {"floor": impls["floor"].make(inputs).step} | {name: impls[name].make(inputs).step for name in args.impls}
    for step in steps.values():  # compile and warm up
        sync("torch", step())
    floor = steps.pop("floor")
    ratios: dict[str, list[float]] = {name: [] for name in steps}
    bar = progress_bar(rounds * len(steps))
    for r in range(rounds):
        for name, step in steps.items():
            bar.set_description(f"round {r} {name}")
            ratios[name].append(time_against_floor("torch", step, floor, timing, on_gpu, rounds=1)[1])
            bar.update()
        bar.write(f"round {r}: " + "  ".join(f"{k} {v[-1]:.3f}" for k, v in ratios.items()), file=sys.stdout)
    bar.close()
    title = f"mode {args.mode}, {head.name}, N = {n}, {rounds} rounds; × the floor timed around each timing"
    lines = [title, "", "| impl | median × floor | min | max |", "| --- | --- | --- | --- |"]
    lines += [f"| {k} | {statistics.median(v):.3f} | {min(v):.3f} | {max(v):.3f} |" for k, v in ratios.items()]
    print("\n".join(lines))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "interleave.md").write_text("\n".join(lines) + "\n")
    _plot(ratios, title, args.out_dir / "interleave.png")
    return 0


def _plot(ratios: dict[str, list[float]], title: str, path: Path) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("no plot: matplotlib is not installed", file=sys.stderr)
        return
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    for name, values in ratios.items():
        ax.plot(range(len(values)), values, marker="o", label=name)
    ax.set(title=title, xlabel="round", ylabel="× floor")
    ax.legend()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
