"""The benchmark's results: the printed table, ``results.json``, ``results.md`` and ``bench.png``."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from .shapes import Shape

HEADER = (
    "head", "N", "impl", "ms", "× floor", "TFLOP/s", "peak GiB", "beyond grads GiB", "err grad_w", "err grad_x", "note",
)  # fmt: skip
WIDTHS = (12, 6, 29, 9, 8, 8, 9, 17, 11, 11, 0)
PACKAGES = ("torch", "triton", "jax", "jaxlib", "liger-kernel", "transformers")


@dataclasses.dataclass
class Row:
    """One (head, N, implementation) result; ``None`` where not measured."""

    head: str  # the head's name (benchmarks.shapes), or HxV
    n: int
    impl: str
    status: str = "ok"  # "ok", "OOM", "skipped: why" or "failed: error"
    ms: float | None = None
    x_floor: float | None = None
    tflops: float | None = None  # the loss's GEMM work (benchmarks.modes.Inputs.flops) over ms
    peak_gib: float | None = None
    beyond_grads_gib: float | None = None
    err_grad_weight: float | None = None  # against fused_kl.reference (float64)
    err_grad_x: float | None = None
    note: str = ""


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def cells(row: Row) -> tuple[str, ...]:
    return (
        row.head,
        str(row.n),
        row.impl,
        _fmt(row.ms, ".4g"),
        _fmt(row.x_floor, ".2f"),
        _fmt(row.tflops, ".3g"),
        _fmt(row.peak_gib, ".3g"),
        _fmt(row.beyond_grads_gib, ".3g"),
        _fmt(row.err_grad_weight, ".1e"),
        _fmt(row.err_grad_x, ".1e"),
        row.note if row.status == "ok" else row.status,
    )


def text_line(line: Sequence[str]) -> str:
    """One line of the printed table."""
    return "  ".join(c.ljust(w) for c, w in zip(line, WIDTHS, strict=True)).rstrip()


def markdown(rows: list[Row]) -> str:
    """The table of ``rows`` in Markdown."""
    lines = [HEADER, tuple("---" for _ in HEADER), *(cells(r) for r in rows)]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines) + "\n"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def describe(device: str, config: dict[str, Any], timing: str) -> dict:
    """What the numbers were measured on and with."""
    return {
        "device": device,
        "versions": {p: _version(p) for p in PACKAGES},
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in config.items()},
        "timing": timing,
    }


def save(rows: list[Row], meta: dict, out_dir: Path) -> None:
    """(Re)write ``results.json`` and ``results.md`` with every row so far."""
    payload = {"meta": meta, "rows": [dataclasses.asdict(r) for r in rows]}
    (out_dir / "results.json").write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / "results.md").write_text(markdown(rows), encoding="utf-8")


def plot(
    rows: list[Row], heads: Sequence[Shape], ns: Sequence[int], frameworks: dict[str, str], mode: str, path: Path
) -> None:
    """Time and memory against N, one panel pair per head, one line per implementation.

    ``frameworks``: implementation -> "torch" or "jax", in the table's order. An implementation
    keeps its colour and marker in every panel; JAX rows are dashed.
    """
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 5 * len(heads)), layout="constrained")
    axes = fig.subplots(len(heads), 2, squeeze=False)
    for i, (impl, framework) in enumerate(frameworks.items()):
        style = {
            "color": colormaps["tab20"](i % 20),
            "marker": "os^vD<>ph*XP"[i % 12],
            "linestyle": "--" if framework == "jax" else "-",
            "label": impl,
        }
        for (ax_time, ax_mem), head in zip(axes, heads, strict=True):
            mine = [r for r in rows if r.head == head.name and r.impl == impl]
            for ax, field in ((ax_time, "ms"), (ax_mem, "peak_gib")):
                points = [(r.n, getattr(r, field)) for r in mine if (getattr(r, field) or 0) > 0]
                if points:
                    ax.plot(*zip(*points, strict=True), **style)
    for (ax_time, ax_mem), head in zip(axes, heads, strict=True):
        ax_time.set(title=f"{head.label}, mode {mode}: forward + backward", ylabel="ms (median)")
        ax_mem.set(title=f"{head.label}, mode {mode}: peak memory beyond the inputs", ylabel="GiB")
        for ax in (ax_time, ax_mem):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(ns, [str(n) for n in ns])
            ax.set_xlabel("N (rows)")
            ax.grid(True, which="both", alpha=0.3)
    legend: dict[str, Any] = {}  # one entry per implementation drawn anywhere
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(legend.values(), legend.keys(), loc="outside right upper")
    fig.savefig(path, dpi=120)
