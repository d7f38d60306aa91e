"""Several devices: ``torch_kl`` and ``jax_kl`` with the rows sharded and with the vocabulary
sharded, against the same loss on one device, plus what the collectives cost per row.

    python -m benchmarks.scaling                 # 2 GPUs: NCCL for torch, two JAX GPU devices
    python -m benchmarks.scaling --quick         # CPU: gloo ranks, forced host devices, tiny head

Rows sharded runs N rows on every device (the goal: the one-device time for N rows); vocabulary
sharded runs the same N rows with a ``V / world`` slice of the head per device (the goal: about
``1 / world`` of the one-device time, and ``1 / world`` of ``grad_weight`` per device). torch runs
one process per device (``benchmarks/scaling_torch.py``), JAX one process for all
(``benchmarks/scaling_jax.py``). Prints a table; writes ``results.json``, ``results.md`` and
``scaling.png`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .bench import progress_bar

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"rows": 1.05, "vocab": 0.60}  # × the one-device time, for 2 devices


def _env(on_gpu: bool, world: int) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink SHARP is not needed for these all-reduces
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if not on_gpu:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={world}",
                   OMP_NUM_THREADS="1")  # fmt: skip
    return env


def _run_torch(args: argparse.Namespace, env: dict[str, str], folder: Path) -> dict[str, Any]:
    common = ["--world", str(args.world), "--n", str(args.n), "--reps", str(args.reps), "--head", args.head]
    store = folder / "store"

    def rank(r: int) -> list[str]:
        out = str(folder / f"rank{r}.json")
        return [sys.executable, "-m", "benchmarks.scaling_torch", "--rank", str(r), *common, "--store", str(store),
                "--out", out]  # fmt: skip

    procs = [subprocess.Popen(rank(r), env=env, cwd=ROOT) for r in range(args.world)]
    codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes):
        raise SystemExit(f"torch ranks exited with {codes}")
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(args.world)]
    # The slowest rank sets the pace of a collective step.
    return {key: max(rank[key] for rank in ranks) for key in ranks[0]}


def _run_jax(args: argparse.Namespace, env: dict[str, str], folder: Path) -> dict[str, Any]:
    out = folder / "jax.json"
    cmd = [sys.executable, "-m", "benchmarks.scaling_jax", "--world", str(args.world), "--n", str(args.n),
           "--reps", str(args.reps), "--head", args.head, "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, timeout=args.timeout)
    return json.loads(out.read_text())


def rows_of(framework: str, m: dict[str, Any], world: int, n: int) -> list[dict[str, Any]]:
    """The table's rows of one framework's measurement ``m``, in order; a measurement the
    framework does not make is left out."""
    layouts = [  # (key in m, layout, grad_weight per device, goal)
        ("one_device_ms", "one device", "grad_weight_gib_one_device", None),
        ("rows_ms", f"rows sharded, {n} rows/device", "grad_weight_gib_one_device", GOALS["rows"]),
        ("rows_local_ms", "  inside shard_map, grad_weight per device (as DDP)", "grad_weight_gib_one_device",
         GOALS["rows"]),
        ("vocab_ms", f"vocabulary sharded over {world}", "grad_weight_gib_vocab", GOALS["vocab"]),
        ("vocab_local_ms", "  its local work, no collectives", "grad_weight_gib_vocab", None),
    ]  # fmt: skip
    rows = []
    for key, layout, grad_w, goal in layouts:
        if key in m:
            row = dict(framework=framework, layout=layout, ms=m[key], x_one=m[key] / m["one_device_ms"],
                       grad_w_gib=m[grad_w])  # fmt: skip
            rows.append(row if goal is None else {**row, "goal": goal})
    return rows


def collectives(results: dict[str, dict[str, Any]], n: int) -> str:
    """What the collectives cost: the vocabulary layout's per call and per row, the rows layout's
    all-reduce of ``grad_weight`` (per step, whatever N)."""
    lines = []
    if "torch" in results:
        m = results["torch"]
        grad_x, stats = m["all_reduce_grad_x_ms"], m["all_reduce_stats_ms"]
        lines.append(f"vocabulary sharded: all-reduce of grad_x [{n}, H]: {grad_x:.3f} ms = {grad_x * 1e6 / n:.1f} "
                     f"ns/row; of one chunk's statistics {m['stats_shape']}: {stats * 1e3:.1f} µs "
                     "(three per chunk, latency-bound)")  # fmt: skip
    for framework, m in results.items():
        if "all_reduce_grad_weight_ms" in m:
            who = "left to DDP/FSDP" if framework == "torch" else "inside the global-array rows layout"
            lines.append(f"rows sharded: all-reduce of grad_weight ({m['grad_weight_gib_one_device']:.3g} GiB), "
                         f"{framework}: {m['all_reduce_grad_weight_ms']:.3f} ms ({who})")  # fmt: skip
    return "\n".join(lines)


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| framework | layout | ms | × one device | grad_weight GiB per device | goal |", "|" + " --- |" * 6]
    for r in rows:
        goal = f"≤ {r['goal']:.2f}" if "goal" in r else ""
        lines.append(f"| {r['framework']} | {r['layout']} | {r['ms']:.3f} | {r['x_one']:.3f} | "
                     f"{r['grad_w_gib']:.3g} | {goal} |")  # fmt: skip
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["layout"] != "one device"]
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(shown)))
    labels = [f"{r['framework']}: {r['layout'].strip()}" for r in shown]
    ax.barh(labels, [r["x_one"] for r in shown], color="tab:blue")
    for i, r in enumerate(shown):
        if "goal" in r:
            ax.plot([r["goal"]] * 2, [i - 0.4, i + 0.4], color="tab:red")
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("× the one-device time (red: goal)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="devices (default 2)")
    parser.add_argument("--n", type=int, help="rows per device (default 8192; --quick: 64)")
    parser.add_argument("--head", help="LM head, a name of benchmarks.shapes or HxV (default llama3-8b)")
    parser.add_argument("--reps", type=int, help="timed calls per measurement (default 10; --quick: 3)")
    parser.add_argument("--frameworks", nargs="+", choices=("torch", "jax"), default=["torch", "jax"])
    parser.add_argument("--out-dir", type=Path, default=Path("scaling_out"))
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per framework's run")
    parser.add_argument("--quick", action="store_true", help="tiny head and N on CPU (gloo, host devices)")
    args = parser.parse_args(argv)
    args.n = args.n or (64 if args.quick else 8192)
    args.head = args.head or ("quick-64" if args.quick else "llama3-8b")
    args.reps = args.reps or (3 if args.quick else 10)
    on_gpu = not args.quick
    if on_gpu:
        import torch

        if torch.cuda.device_count() < args.world:
            raise SystemExit(f"--world {args.world}: {torch.cuda.device_count()} GPU(s) here (--quick runs on CPU)")
    env = _env(on_gpu, args.world)
    rows, results = [], {}
    bar = progress_bar(len(args.frameworks))
    with tempfile.TemporaryDirectory() as tmp:
        for framework in args.frameworks:
            bar.set_description(framework)
            run = _run_torch if framework == "torch" else _run_jax
            results[framework] = run(args, env, Path(tmp))
            rows += rows_of(framework, results[framework], args.world, args.n)
            bar.update()
    bar.close()
    title = f"{args.head}, {args.n} rows per device, {args.world} {'GPUs' if on_gpu else 'CPU ranks'}"
    text = _table(rows)
    if notes := collectives(results, args.n):
        text += "\n\n" + notes
    print(title + "\n" + text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps({"title": title, "rows": rows, "raw": results}, indent=1))
    (args.out_dir / "results.md").write_text(f"{title}\n\n{text}\n")
    _plot(rows, args.out_dir / "scaling.png", title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
