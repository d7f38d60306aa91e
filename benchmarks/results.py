"""``python -m benchmarks.results``: the tables and the plot of ``benchmarks/RESULTS.md`` from its data.

``benchmarks/results.csv`` holds the bench rows that RESULTS.md quotes, one per (mode, N,
implementation), each with the commit whose code it measured, the date and the bench's timing
budgets (``do_bench``'s rep/warm-up in ms); a floor row per run that a quoted row came from, since
each ratio is to the floor timed in its own process. This prints one Markdown table per mode and
N and draws ``results.png``: × floor and effective TFLOP/s per mode, memory beyond the gradients
(the variants of a library's rows, such as ``torch_kl/triton+z-loss``, in the tables only).
To add a run: ``--add bench_out/results.json --commit <sha>`` puts its rows in the data (each
replaces the row of the same mode, head, N and implementation; a floor row stays while a row
measured at its commit does), then prints and draws as always.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).parent
FIELDS = (
    "mode", "head", "n", "impl", "ms", "x_floor", "tflops", "peak_gib", "beyond_grads_gib",
    "err_grad_w", "err_grad_x", "commit", "date", "timing_ms",
)  # fmt: skip
COLUMNS = ("impl", "ms", "× floor", "TFLOP/s", "GiB beyond grads", "err grad_w", "commit", "timing ms")


def load(path: Path) -> list[dict[str, str]]:
    """The rows of ``results.csv``, in the file's order."""
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if rows and tuple(rows[0]) != FIELDS:
        raise ValueError(f"{path}: expected the columns {', '.join(FIELDS)}, got {', '.join(rows[0])}")
    return rows


PLOTTED_HEAD = "llama3-8b"  # the head the plot compares the modes on; other heads (HxV) get tables only


def groups(rows: Sequence[dict[str, str]]) -> dict[tuple[str, str, int], list[dict[str, str]]]:
    """The rows by (mode, head, N), in the file's order."""
    out: dict[tuple[str, str, int], list[dict[str, str]]] = {}
    for row in rows:
        out.setdefault((row["mode"], row["head"], int(row["n"])), []).append(row)
    return out


def markdown(rows: Sequence[dict[str, str]]) -> str:
    """One table per (mode, head, N): every implementation against its run's floor."""
    parts = []
    for (mode, head, n), group in groups(rows).items():
        title = f"#### `{mode}`, N = {n}" + ("" if head == PLOTTED_HEAD else f", head {head}")
        lines = [title, "", "| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
        for r in group:
            cells = (f"`{r['impl']}`", r["ms"], r["x_floor"], r["tflops"], r["beyond_grads_gib"], r["err_grad_w"],
                     f"`{r['commit']}`", r["timing_ms"])  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def _variant(impl: str) -> bool:
    """A variant of a library's row (``torch_kl/triton+z-loss``, ``torch_kl-lowmem``,
    ``jax_kl/pallas-cublas``): tables only."""
    return "+" in impl or (impl.startswith(("torch_kl", "jax_kl")) and "-" in impl)


def plot(rows: Sequence[dict[str, str]], n: int, path: Path) -> None:
    """Per mode at ``n`` rows: each implementation's × floor (its TFLOP/s written beside the bar)
    and its memory beyond the gradients."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    by_mode = {
        mode: [r for r in group if r["impl"] != "floor" and not _variant(r["impl"])]
        for (mode, head, m), group in groups(rows).items()
        if m == n and head == PLOTTED_HEAD
    }
    impls = list(dict.fromkeys(r["impl"] for group in by_mode.values() for r in group))
    fig = Figure(figsize=(14, 1.2 + 0.9 * len(by_mode)), layout="constrained")
    ax_time, ax_mem = fig.subplots(1, 2, sharey=True)
    height = 0.8 / len(impls)
    labelled: set[str] = set()  # one legend entry per implementation
    for i, impl in enumerate(impls):
        color = colormaps["tab10"](i % 10)
        for j, group in enumerate(by_mode.values()):
            row = next((r for r in group if r["impl"] == impl), None)
            if row is None:
                continue
            y = j + (i - (len(impls) - 1) / 2) * height
            ax_time.barh(y, float(row["x_floor"]), height, color=color, label=None if impl in labelled else impl)
            labelled.add(impl)
            ax_time.text(float(row["x_floor"]) + 0.005, y, f"{row['tflops']} TFLOP/s", va="center", fontsize=7)
            if row["beyond_grads_gib"]:  # blank where the bench could not see the step's memory
                ax_mem.barh(y, float(row["beyond_grads_gib"]), height, color=color)
    ax_time.set(yticks=range(len(by_mode)), yticklabels=list(by_mode), xlim=(1.0, None),
                xlabel="× the GEMM floor (lower is better)", title=f"forward + backward, N = {n}")  # fmt: skip
    ax_mem.set(xlabel="GiB beyond grad_x and grad_weight", title="memory the loss holds")
    ax_time.invert_yaxis()  # the y axis is shared: the modes top down in the table's order
    for ax in (ax_time, ax_mem):
        ax.grid(True, axis="x", alpha=0.3)
    fig.legend(loc="outside right upper")
    fig.savefig(path, dpi=120)


def _fmt(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}g}"


def _error(value: float | None) -> str:
    return "" if value is None else f"{value:.1e}"


def added(rows: Sequence[dict[str, str]], run: dict, commit: str, date: str) -> list[dict[str, str]]:
    """``rows`` with a bench run's (``results.json``) measured rows in: each replaces the row of
    the same mode, head, N and implementation; a floor row stays while a row measured at its
    commit does (the later run's floor where two runs share a commit)."""
    config, mode = run["meta"]["config"], run["meta"]["config"]["mode"]
    if "floor" not in config["impls"]:
        raise ValueError("--add: a run without the floor has no ratios; run the bench with floor in --impls")
    timing = f"{config['timing']['rep_ms']:g}/{config['timing']['warmup_ms']:g}"
    def cells(r: dict) -> tuple[str, ...]:
        return (
            mode, r["head"], str(r["n"]), r["impl"], _fmt(r["ms"], 4), f"{r['x_floor']:.2f}", _fmt(r["tflops"], 3),
            _fmt(r["peak_gib"], 3), _fmt(r["beyond_grads_gib"], 3), _error(r["err_grad_weight"]),
            _error(r["err_grad_x"]), commit, date, timing,
        )  # fmt: skip

    new = [dict(zip(FIELDS, cells(r), strict=True)) for r in run["rows"] if r["status"] == "ok"]
    # A floor row is one run's; two runs at one commit share the later one's.
    key = lambda r: (r["mode"], r["head"], r["n"], r["impl"]) + ((r["commit"],) if r["impl"] == "floor" else ())
    replaced = {key(r) for r in new}
    kept = [r for r in rows if key(r) not in replaced] + new
    runs = {(r["mode"], r["head"], r["n"], r["commit"]) for r in kept if r["impl"] != "floor"}
    return [r for r in kept if r["impl"] != "floor" or (r["mode"], r["head"], r["n"], r["commit"]) in runs]


def save(rows: Sequence[dict[str, str]], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.results", description="RESULTS.md's tables (printed) and plot from its data."
    )
    parser.add_argument("--data", type=Path, default=HERE / "results.csv", help="the rows (default: benchmarks/)")
    parser.add_argument("--plot", type=Path, default=HERE / "results.png", help="where the plot goes")
    parser.add_argument("--n", type=int, default=8192, help="the rows N the plot compares the modes at")
    parser.add_argument("--add", type=Path, nargs="*", default=[], help="bench runs' results.json to put in the data")
    parser.add_argument("--commit", help="with --add: the commit the runs measured")
    parser.add_argument("--date", default=datetime.date.today().isoformat(), help="with --add: when (default today)")
    args = parser.parse_args(argv)
    if args.add and not args.commit:
        parser.error("--add needs --commit")
    rows = load(args.data)
    for path in args.add:
        rows = added(rows, json.loads(path.read_text(encoding="utf-8")), args.commit, args.date)
    if args.add:
        save(rows, args.data)
    print(markdown(rows), end="")
    plot(rows, args.n, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
